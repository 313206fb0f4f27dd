#!/usr/bin/env bash
# SSD streaming at the 397B record size (docs/huge-models-ssd.md):
#   1. `pack --synthetic qwen3.5-397b-a17b --layers N --experts q4` into DIR
#      (skipped when DIR holds it already; N=8: 27 GiB of experts + 3.9 GiB),
#   2. the disk's own random-read rate for records of that size (fio,
#      O_DIRECT, random record-aligned offsets over the same layer files,
#      4 jobs = the store's 4 I/O threads; also 1 job and 10 in flight),
#   3. `flashmoe bench -m DIR -p 0 -n 32 --max-memory GiB --stats` cold
#      (--direct-io: every miss from the disk) at the model's K=10 and with
#      --moe-top-k 4, and warm (buffered reads, the same 8-token run twice, the
#      second measured), each under /usr/bin/time for the peak RSS.
#   bench/ssd_streaming.sh [BUILD_DIR] [DIR] [LAYERS] [MAX_MEMORY_GIB]
#     (defaults: build, /work/tmp/synth-397b-q4, 8, 8). Raw output in $OUT_DIR
#     (default /tmp/ssd_streaming). Remove DIR afterwards (rm -r DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-build}/flashmoe"
DIR="${2:-/work/tmp/synth-397b-q4}"
LAYERS="${3:-8}"
MEM="${4:-8}"
OUT_DIR="${OUT_DIR:-/tmp/ssd_streaming}"
T="${THREADS:-2}"
mkdir -p "$OUT_DIR" "$(dirname "$DIR")"
REC=7077888  # one q4 expert record of the 397B shape (SyntheticPack.The397bExpertRecordIs6Point75MiBInQ4)

if [ ! -f "$DIR/flashmoe-manifest.json" ]; then
  /usr/bin/time -f "pack: %e s wall, peak RSS %M KiB" "$BIN" pack --synthetic qwen3.5-397b-a17b --layers "$LAYERS" \
      --experts q4 -o "$DIR" 2>&1 | tail -3
fi
du -sh "$DIR" "$DIR/experts" "$DIR/model.safetensors"
FILES=$(ls "$DIR"/experts/layer-*.bin | paste -sd:)

for jobs in 1 4; do
  fio --name=rec --filename="$FILES" --readonly --rw=randread --bs=$REC --direct=1 --ioengine=psync \
      --numjobs=$jobs --group_reporting --time_based --runtime=20 --output-format=terse > "$OUT_DIR/fio_j$jobs.txt"
  # terse v3: field 7 read bandwidth KiB/s, 8 IOPS
  awk -F';' -v j=$jobs '{printf "fio O_DIRECT psync %d job(s), random %d-byte records: %.1f MiB/s, %.1f records/s\n", j, '$REC', $7/1024, $8}' "$OUT_DIR/fio_j$jobs.txt"
done
fio --name=rec --filename="$FILES" --readonly --rw=randread --bs=$REC --direct=1 --ioengine=libaio --iodepth=10 \
    --group_reporting --time_based --runtime=20 --output-format=terse > "$OUT_DIR/fio_aio10.txt"
awk -F';' '{printf "fio O_DIRECT libaio 10 in flight, random records: %.1f MiB/s, %.1f records/s\n", $7/1024, $8}' "$OUT_DIR/fio_aio10.txt"

run() {  # label, tokens, flashmoe bench options
  local label=$1 n=$2; shift 2
  /usr/bin/time -f "peak RSS %M KiB" "$BIN" bench -m "$DIR" -t "$T" -p 0 -n "$n" -r 1 --max-memory "$MEM" --stats "$@" \
      > "$OUT_DIR/$label.txt" 2>&1
  echo "== $label (-n $n $*)"
  grep -E "tg$n|measured runs|experts:|peak RSS|store:" "$OUT_DIR/$label.txt"
}
run cold_k10 32 --direct-io
run cold_k4 32 --direct-io --moe-top-k 4
# Warm: buffered reads, the same 8-token run twice (bench draws the same
# tokens each time): the second finds its experts in the OS page cache.
run warm_k10_first 8
run warm_k10 8
