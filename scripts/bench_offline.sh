#!/usr/bin/env bash
# Runs the offline benchmarks recorded in docs/benchmarks.md and writes one JSON file each.
# Usage: scripts/bench_offline.sh [OUT_DIR]   (CPU, about 10 minutes on 2 cores)
set -euo pipefail
out=${1:-bench_out}
mkdir -p "$out"
model=${MODEL:-/tmp/ouro-small}
[ -f "$model/config.json" ] || rltserve make-model --preset ouro-small --out "$model"
common=(--model "$model" --json)

# Issue: continuous depth batching (refill vs no-refill vs full depth vs naive loop).
rltserve bench offline "${common[@]}" --num-prompts 64 --input-len 32 --output-len 64 \
  --concurrency 32 --exit-threshold 0.5 --compare >"$out/depth_batching.json"
# Async scheduling vs sync through the engine loop.
rltserve bench offline "${common[@]}" --num-prompts 64 --input-len 32 --output-len 32 \
  --exit-threshold 0.5 --async-scheduling --compare --concurrency-list 1,8,32,64 \
  >"$out/async.json"
# Wavefront chunked prefill: time to first token of a 16-chunk prompt.
rltserve bench offline "${common[@]}" --wavefront-prefill --compare --chunk-sizes 8,32,128 \
  >"$out/wavefront.json"
# Token pipelining vs block mode.
rltserve bench offline "${common[@]}" --input-len 16 --output-len 64 --speculative-tokens 1 \
  --draft-loops 2 --compare >"$out/pipelining.json"
# KV pressure: full reservation vs on-demand (recompute, swap) vs an unpressured pool.
rltserve bench offline "${common[@]}" --num-prompts 32 --input-len 32 --output-len 32 \
  --concurrency 32 --exit-threshold 0.5 --kv-pressure >"$out/kv_pressure.json"
echo "wrote $out/*.json"
