#!/usr/bin/env bash
# Serving through Ray Serve replicas against the single-process server, in one run:
#   single     rltserve serve                               (one stage, torch's default threads)
#   ray-1x2    rltserve serve --replicas 1 --replica-cpus 2 (one replica, two torch threads)
#   ray-2x1    rltserve serve --replicas 2 --replica-cpus 1 (two replicas, one thread each)
# For each: `rltserve bench serve` at concurrency 1 (TTFT; its difference to `single` is the
# routing overhead per request) and at concurrency 16 (throughput); then offline throughput
# with `bench offline` and `bench offline --replicas 2`.
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
  local name=$1; shift
  "${RLT[@]}" serve --model "$MODEL" --port "$PORT" --log-level warning "$@" \
    2> "$OUT/$name.server.log" &
  local pid=$!
  "${RLT[@]}" bench serve --url "http://127.0.0.1:$PORT" --num-prompts "$N1" --max-concurrency 1 \
    --input-len 64 --output-len "$OUT1" --quiet --json > "$OUT/$name.c1.json"
  "${RLT[@]}" bench serve --url "http://127.0.0.1:$PORT" --num-prompts "$N16" --max-concurrency 16 \
    --input-len 64 --output-len "$OUT16" --quiet --json > "$OUT/$name.c16.json"
  kill -TERM "$pid"; wait "$pid" || true
}

run_mode single
run_mode ray-1x2 --replicas 1 --replica-cpus 2
run_mode ray-2x1 --replicas 2 --replica-cpus 1
"${RLT[@]}" bench offline --model "$MODEL" --num-prompts "$N16" --input-len 64 \
  --output-len "$OUT16" --concurrency 16 --quiet --json > "$OUT/offline.json"
"${RLT[@]}" bench offline --model "$MODEL" --num-prompts "$N16" --input-len 64 \
  --output-len "$OUT16" --concurrency 16 --replicas 2 --quiet --json > "$OUT/offline-2.json"
echo "results in $OUT"
