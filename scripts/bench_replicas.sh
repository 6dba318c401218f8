#!/usr/bin/env bash
# Serving through Ray Serve replicas against the single-process server, in one run:
#   single-1t  rltserve serve with OMP_NUM_THREADS=1        (one stage, one torch thread)
#   single-2t  rltserve serve with OMP_NUM_THREADS=2        (one stage, two torch threads)
#   ray-1x1    rltserve serve --replicas 1 --replica-cpus 1 (one replica, one thread)
#   ray-1x2    rltserve serve --replicas 1 --replica-cpus 2 (one replica, two threads)
#   ray-2x1    rltserve serve --replicas 2 --replica-cpus 1 (two replicas, one thread each)
# For each: `rltserve bench serve` at concurrency 1 (TTFT; its difference to `single` is the
# routing overhead per request: single-1t vs ray-1x1) and at concurrency 16 (throughput); then
# offline throughput with `bench offline` (one and two threads) and `bench offline --replicas 2`.
# Usage: scripts/bench_replicas.sh [MODEL_DIR] [OUT_DIR]
set -euo pipefail
MODEL=${1:-/tmp/ouro-small}
OUT=${2:-/tmp/bench_replicas}
PORT=${PORT:-8123}
N1=${N1:-16}; OUT1=${OUT1:-16}     # concurrency 1: prompts, output tokens
N16=${N16:-48}; OUT16=${OUT16:-32} # concurrency 16
RLT=(python -m rltserve.cli)
mkdir -p "$OUT"

run_mode() {
  local name=$1 threads=$2; shift 2
  OMP_NUM_THREADS=$threads "${RLT[@]}" serve --model "$MODEL" --port "$PORT" --log-level warning "$@" \
    2> "$OUT/$name.server.log" &
  local pid=$!
  "${RLT[@]}" bench serve --url "http://127.0.0.1:$PORT" --num-prompts "$N1" --max-concurrency 1 \
    --input-len 64 --output-len "$OUT1" --ignore-eos --quiet --json > "$OUT/$name.c1.json"
  "${RLT[@]}" bench serve --url "http://127.0.0.1:$PORT" --num-prompts "$N16" --max-concurrency 16 \
    --input-len 64 --output-len "$OUT16" --ignore-eos --quiet --json > "$OUT/$name.c16.json"
  kill -TERM "$pid"; wait "$pid" || true
}

run_mode single-1t 1
run_mode single-2t 2
run_mode ray-1x1 1 --replicas 1 --replica-cpus 1
run_mode ray-1x2 2 --replicas 1 --replica-cpus 2
run_mode ray-2x1 1 --replicas 2 --replica-cpus 1
for t in 1 2; do
  OMP_NUM_THREADS=$t "${RLT[@]}" bench offline --model "$MODEL" --num-prompts "$N16" \
    --input-len 64 --output-len "$OUT16" --concurrency 16 --quiet --json > "$OUT/offline-${t}t.json"
done
"${RLT[@]}" bench offline --model "$MODEL" --num-prompts "$N16" --input-len 64 \
  --output-len "$OUT16" --concurrency 16 --replicas 2 --quiet --json > "$OUT/offline-2.json"
echo "results in $OUT"
