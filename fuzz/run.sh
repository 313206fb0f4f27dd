#!/usr/bin/env bash
# fuzz/run.sh BUILD_DIR SECONDS TARGET...: runs each libFuzzer target for
# SECONDS from fuzz/corpus/<target> (read-only seeds) plus a working corpus in
# BUILD_DIR/corpus/<target>; prints executions per target; fails on a crash.
# Targets run JOBS at a time (default: the number of cores; each fuzzer is
# one process on one core), so each still gets SECONDS of a whole core.
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1 secs=$2; shift 2
jobs=${JOBS:-$(nproc)}
mkdir -p "$build/crashes"

fuzz_one() {
  local t=$1 work="$build/corpus/$1" log="$build/fuzz_$1.log"
  mkdir -p "$work"
  "$build/fuzz/fuzz_$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
    -artifact_prefix="$build/crashes/$t-" -print_final_stats=1 "$work" "fuzz/corpus/$t" >"$log" 2>&1
  echo $? >"$build/fuzz_$t.rc"
}

pending=("$@")
while [ ${#pending[@]} -gt 0 ]; do
  batch=("${pending[@]:0:$jobs}")
  pending=("${pending[@]:$jobs}")
  for t in "${batch[@]}"; do fuzz_one "$t" & done
  wait
done

status=0
for t in "$@"; do
  log="$build/fuzz_$t.log"
  rc=$(cat "$build/fuzz_$t.rc" 2>/dev/null || echo 1)
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
  printf 'fuzz %-18s %4ss  execs=%-9s %s\n' "$t" "$secs" "${execs:-?}" "$([ "$rc" -eq 0 ] && echo ok || echo "CRASH (see $log)")"
  [ "$rc" -eq 0 ] || { status=1; tail -40 "$log"; }
done
exit $status
