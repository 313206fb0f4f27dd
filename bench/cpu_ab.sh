#!/usr/bin/env bash
# Two flashmoe binaries (or one under two environments) side by side: interleaved
# rounds of `flashmoe bench ARGS -t THREADS`, the order alternating each round; prints
# the tokens/s columns of each. The machine is shared, so the load average is printed too.
#   bench/cpu_ab.sh ROUNDS THREADS "ARGS" BIN_A BIN_B [ENV_A] [ENV_B]
#   e.g. bench/cpu_ab.sh 6 2 "-m models/coder-mini --device cpu -p 512 -n 0 -r 3" /tmp/old/flashmoe build/flashmoe
R=$1; T=$2; ARGS=$3; A=$4; B=$5; EA=${6:-}; EB=${7:-}
cd "$(dirname "$0")/.."
run() { env $2 "$1" bench $ARGS -t "$T" 2>/dev/null | awk '/^\| (pp|tg)[0-9]/ {printf "%s ", $4}'; }
for r in $(seq 1 "$R"); do
  if [ $((r % 2)) = 1 ]; then a=$(run "$A" "$EA"); b=$(run "$B" "$EB"); else b=$(run "$B" "$EB"); a=$(run "$A" "$EA"); fi
  echo "round $r load $(cut -d' ' -f1 /proc/loadavg): A $a | B $b"
done
