#!/usr/bin/env bash
# Serving benchmark recorded in docs/benchmarks.md: a local `rltserve serve` on ouro-small,
# streamed through `rltserve bench serve`, against the offline engine on the same workload.
# Usage: scripts/bench_serve.sh [OUT_DIR]   (CPU, about 5 minutes on 2 cores)
set -euo pipefail
out=${1:-bench_out}
mkdir -p "$out"
model=${MODEL:-/tmp/ouro-small}
port=${PORT:-8791}
[ -f "$model/config.json" ] || rltserve make-model --preset ouro-small --out "$model"
shape=(--num-prompts 64 --input-len 32 --output-len 32)

rltserve bench offline --model "$model" "${shape[@]}" --concurrency 32 --json >"$out/serve_offline.json"

rltserve serve --model "$model" --port "$port" --max-num-seqs 32 >"$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "localhost:$port/health" >/dev/null && break
  sleep 1
done
url="http://127.0.0.1:$port"
# --ignore-eos: every request makes its whole --output-len (the recorded figures' workload;
# bench serve sends ignore_eos only when asked, as vLLM's does)
# Every run sends prompts of its own seed: with one seed, the runs after the first would find
# their prompts in the server's prefix cache and time warm-cache TTFTs.
rltserve bench serve --url "$url" "${shape[@]}" --request-rate inf --max-concurrency 32 \
  --ignore-eos --seed 0 --no-progress --json >"$out/serve_c32.json"
for rate in 2 4 8; do
  rltserve bench serve --url "$url" "${shape[@]}" --request-rate "$rate" --max-concurrency 32 \
    --ignore-eos --seed "$rate" --no-progress --json >"$out/serve_rate$rate.json"
done
echo "wrote $out/serve_*.json"
