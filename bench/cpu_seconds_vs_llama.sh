#!/usr/bin/env bash
# CPU seconds per token, flashmoe against llama.cpp, one thread: less
# sensitive than tokens/s to a shared, oversubscribed machine (time slices
# lost to other jobs do not count). Each figure is the user+sys time of a run
# with R+1 repetitions minus that of a run with 1 (which removes loading,
# warm-up and the bandwidth probe), divided by the extra tokens. Runs are
# interleaved: flashmoe, flashmoe at avx2, llama.cpp, for each round.
#
#   LLAMA_BENCH=... GGUF=... bench/cpu_seconds_vs_llama.sh [rounds] [R] [pp|tg|both]
#
# BEFORE: another flashmoe binary run in the same rounds (a row of its own).
#
# flashmoe's tg runs include its bandwidth probe, whose CPU time varies with
# the machine's memory traffic: use a larger R for tg (e.g. 20) so that the
# extra tokens outweigh it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
R=${2:-5}
WHAT=${3:-both}
BIN=${BIN:-build/flashmoe}
MODEL=${MODEL:-models/coder-mini}
LLAMA_BENCH=${LLAMA_BENCH:?set LLAMA_BENCH to llama.cpp\'s llama-bench}
GGUF=${GGUF:?set GGUF to llama.cpp\'s model file}

cpu() {  # CPU seconds of a command
  /usr/bin/time -f "%U %S" "$@" 2>&1 >/dev/null | tail -n1 | awk '{print $1 + $2}'
}
BEFORE=${BEFORE:-}
fm() { FLASHMOE_CPU_LEVEL=$1 cpu "$BIN" bench -m "$MODEL" --device cpu -t 1 "${@:2}"; }
fb() { cpu "$BEFORE" bench -m "$MODEL" --device cpu -t 1 "$@"; }
ll() { cpu "$LLAMA_BENCH" -m "$GGUF" -t 1 "$@"; }
# ms per token: (cpu(R+1 reps) - cpu(1 rep)) / (R * tokens)
per_token() { echo "($1 - $2) * 1000 / ($R * $3)" | bc -l; }

for r in $(seq 1 "$ROUNDS"); do
  echo "round $r load: $(cut -d' ' -f1-3 /proc/loadavg)"
  for who in flashmoe avx2 llama ${BEFORE:+before}; do
    pp=0 tg=0
    case $who in
      flashmoe) run() { fm "" "$@"; } ;;
      avx2)     run() { fm avx2 "$@"; } ;;
      llama)    run() { ll "$@"; } ;;
      before)   run() { fb "$@"; } ;;
    esac
    if [ "$WHAT" != tg ]; then
      pp1=$(run -p 512 -n 0 -r 1); ppR=$(run -p 512 -n 0 -r $((R + 1))); pp=$(per_token "$ppR" "$pp1" 512)
    fi
    if [ "$WHAT" != pp ]; then
      tg1=$(run -p 0 -n 128 -r 1); tgR=$(run -p 0 -n 128 -r $((R + 1))); tg=$(per_token "$tgR" "$tg1" 128)
    fi
    printf "  %-9s pp512 %.4f ms/token  tg128 %.4f ms/token\n" "$who" "$pp" "$tg"
  done
done
