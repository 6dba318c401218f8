#!/usr/bin/env bash
# One-shot GPU check of rltserve, for a machine with an NVIDIA GPU (within ~8 minutes):
#   1. picks a Python with a CUDA torch (a venv: $RLTSERVE_GPU_VENV, the current one, or a new
#      --system-site-packages venv), makes the repo importable (PYTHONPATH, nothing installed),
#   2. builds the native extension with its CUDA kernel (python native/build.py --cuda on),
#   3. runs the gpu-marked tests (pytest -m gpu),
#   4. makes ouro-1.4b with random weights (bf16) unless present, and benchmarks decode tokens/s
#      with `rltserve bench offline` at concurrency 1, 32 and 128: refill at an exit threshold
#      giving mean depth ~2.5 vs full depth (threshold 1.0); eager, plus CUDA graphs when
#      `rltserve bench offline --help` lists --cuda-graphs,
#   5. async vs sync scheduling through the spawned stage (dedicated stream, deferred result
#      reads) at concurrency 32 and 128 (ASYNC_CONCURRENCY), with CUDA graphs when available,
#   6. prints a summary and writes four files to the output dir: summary.json (environment,
#      native build, every run's full report), summary.txt, gpu_check.log, gpu_tests.xml.
#
# Usage: scripts/gpu_check.sh            (from anywhere; exit 0 when every step passed)
# Environment (all optional):
#   OUT                 output dir (default: bench_out/gpu_check in the repo, git-ignored)
#   PYTHON              interpreter to use or to base a venv on (default: python3)
#   RLTSERVE_GPU_VENV   venv to use, created with --system-site-packages when missing
#   WHEELS              dir of wheels for missing packages (pip --no-index --find-links); the
#                       workplace H200 image lacks orjson, which the CLI needs
#   MODEL_DIR           checkpoint dir (default: /tmp/rltserve-<preset>; made when missing)
#   EXIT_THRESHOLD      Ouro exit threshold for the early-exit runs (default 0.55: mean depth
#                       ~2.5 of 4 with the synthetic weights; the summary prints the measured one)
#   CONCURRENCY         default "1 32 128";  INPUT_LEN / OUTPUT_LEN default 128 / 64
#   ASYNC_CONCURRENCY   default "32,128" (the async-vs-sync comparison; empty skips it)
#   KV_CACHE_GB         KV pool per run (default 24)
#   BUDGET_S            overall time budget in seconds (default 480); steps that no longer fit
#                       are skipped and reported
#   PRESET, DEVICE, DTYPE   default ouro-1.4b, cuda, bfloat16 (DEVICE=cpu PRESET=ouro-tiny
#                       smoke-tests this script without a GPU)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/bench_out/gpu_check}"
PRESET="${PRESET:-ouro-1.4b}"
DEVICE="${DEVICE:-cuda}"
DTYPE="${DTYPE:-bfloat16}"
MODEL_DIR="${MODEL_DIR:-/tmp/rltserve-$PRESET}"
EXIT_THRESHOLD="${EXIT_THRESHOLD:-0.55}"
CONCURRENCY="${CONCURRENCY:-1 32 128}"
ASYNC_CONCURRENCY="${ASYNC_CONCURRENCY:-32,128}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
KV_CACHE_GB="${KV_CACHE_GB:-24}"
BUDGET_S="${BUDGET_S:-480}"
START=$(date +%s)
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/rltserve-gpu-check.XXXXXX")"  # per-step JSON
LOG="$OUT/gpu_check.log"
: >"$LOG"
declare -a SUMMARY=()
FAILED=0

say() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
remaining() { echo $((BUDGET_S - ($(date +%s) - START))); }

# step NAME LIMIT_S CMD...: runs CMD under `timeout`, capped by the remaining budget; records
# ok / FAILED / TIMEOUT / SKIPPED in the summary; never aborts the script.
step() {
  local name="$1" limit="$2"
  shift 2
  local left
  left=$(remaining)
  if ((left < 15)); then
    SUMMARY+=("SKIPPED  $name (budget spent)")
    FAILED=1
    say "skip $name: budget spent"
    return 1
  fi
  ((limit > left - 5)) && limit=$((left - 5))
  say "start $name (limit ${limit}s)"
  local t0 rc=0
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  local dt=$(($(date +%s) - t0))
  if ((rc == 0)); then
    SUMMARY+=("ok       $name (${dt}s)")
  elif ((rc == 124 || rc == 137)); then
    SUMMARY+=("TIMEOUT  $name (${limit}s)")
    FAILED=1
  else
    SUMMARY+=("FAILED   $name (rc $rc, ${dt}s; see $LOG)")
    FAILED=1
  fi
  say "end $name rc=$rc (${dt}s)"
  return "$rc"
}

finish() {
  echo
  echo "==== gpu_check summary ($(($(date +%s) - START))s, output in $OUT)"
  local line
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  if [[ -f "$OUT/summary.txt" ]]; then cat "$OUT/summary.txt"; fi
  rm -rf "$WORK"
  exit "$FAILED"
}
trap finish EXIT

# ---------------------------------------------------------------- 1. Python
if [[ "$DEVICE" == cuda ]] && ! nvidia-smi -L >>"$LOG" 2>&1; then
  say "no NVIDIA GPU visible (nvidia-smi failed): nothing to check"
  SUMMARY+=("FAILED   gpu present")
  FAILED=1
  exit
fi
PY="${PYTHON:-python3}"
torch_ok() { "$1" -c "import torch, sys; sys.exit(0 if '$DEVICE' == 'cpu' or torch.cuda.is_available() else 1)" >>"$LOG" 2>&1; }
if [[ -n "${RLTSERVE_GPU_VENV:-}" ]]; then
  if [[ ! -x "$RLTSERVE_GPU_VENV/bin/python" ]]; then
    say "creating venv $RLTSERVE_GPU_VENV (--system-site-packages, base $PY)"
    "$PY" -m venv --system-site-packages "$RLTSERVE_GPU_VENV"
  fi
  PY="$RLTSERVE_GPU_VENV/bin/python"
elif ! "$PY" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then
  # Not a venv: make one that sees the system torch (a venv made from a venv would not).
  VENV="${TMPDIR:-/tmp}/rltserve-gpu-venv"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV"
  PY="$VENV/bin/python"
fi
if ! torch_ok "$PY"; then
  say "$PY has no torch that sees a CUDA device"
  SUMMARY+=("FAILED   python with CUDA torch ($PY)")
  FAILED=1
  exit
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
missing=$("$PY" - <<'EOF'
import importlib.util
need = ["safetensors", "transformers", "tokenizers", "jinja2", "aiohttp", "anyio", "orjson",
        "numpy", "pytest"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
)
if [[ -n "$missing" ]]; then
  say "missing Python packages: $missing"
  if [[ -n "${WHEELS:-}" ]]; then
    step "pip install $missing (from $WHEELS)" 120 \
      "$PY" -m pip install -q --no-index --find-links "$WHEELS" $missing || true
  else
    step "pip install $missing" 90 "$PY" -m pip install -q $missing || true
  fi
fi
"$PY" - >"$WORK/env.json" 2>>"$LOG" <<'EOF' || true
import json, platform, sys, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps({"python": sys.executable, "python_version": platform.python_version(),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu}, indent=2))
EOF
say "python: $PY ($(tr -d '\n ' <"$WORK/env.json" 2>/dev/null || true))"
RLT=("$PY" -c "import sys; from rltserve.cli import main; sys.exit(main())")  # the CLI

# ---------------------------------------------------------------- 2. native extension
CUDA_FLAG=on
[[ "$DEVICE" == cpu ]] && CUDA_FLAG=auto
step "build native extension (--cuda $CUDA_FLAG)" 300 \
  bash -c '"$1" "$2/native/build.py" --cuda "$3" >"$4/native_build.json"' _ \
  "$PY" "$REPO" "$CUDA_FLAG" "$WORK" || true

# ---------------------------------------------------------------- 3. gpu tests
step "pytest -m gpu" 240 \
  "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors \
  --junitxml "$OUT/gpu_tests.xml" "$REPO/tests" || true

# ---------------------------------------------------------------- 4. benchmarks
if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  step "make-model $PRESET -> $MODEL_DIR" 240 \
    "${RLT[@]}" make-model --preset "$PRESET" --out "$MODEL_DIR" --force || true
fi
GRAPH_MODES=(eager)
if [[ "$DEVICE" != cuda ]]; then
  SUMMARY+=("note     CUDA graphs: DEVICE=$DEVICE; eager only")
elif "${RLT[@]}" bench offline --help 2>>"$LOG" | grep -q -- "--cuda-graphs"; then
  GRAPH_MODES+=(graphs)
else
  SUMMARY+=("note     CUDA graphs: 'rltserve bench offline' has no --cuda-graphs flag yet; eager only")
fi
if [[ -f "$MODEL_DIR/config.json" ]]; then
  for c in $CONCURRENCY; do
    n=$((c >= 4 ? 2 * c : 4))
    for mode in "${GRAPH_MODES[@]}"; do
      extra=()
      if [[ "${#GRAPH_MODES[@]}" -gt 1 ]]; then
        # Explicit either way, whatever the engine's default.
        [[ "$mode" == graphs ]] && extra=(--cuda-graphs) || extra=(--no-cuda-graphs)
      fi
      for q in "$EXIT_THRESHOLD" 1.0; do
        name="bench_c${c}_q${q}_${mode}"
        step "$name" 120 bash -c 'out=$1; shift; "$@" >"$out"' _ "$WORK/$name.json" \
          "${RLT[@]}" bench offline --model "$MODEL_DIR" --dtype "$DTYPE" --device "$DEVICE" \
          --num-prompts "$n" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
          --concurrency "$c" --exit-threshold "$q" --kv-cache-gb "$KV_CACHE_GB" \
          --max-model-len $((INPUT_LEN + OUTPUT_LEN + 16)) --json "${extra[@]}" \
          || true
      done
    done
  done
fi

if [[ -f "$MODEL_DIR/config.json" && -n "$ASYNC_CONCURRENCY" ]]; then
  extra=()
  [[ "${#GRAPH_MODES[@]}" -gt 1 ]] && extra=(--cuda-graphs)
  step "async_compare" 150 bash -c 'out=$1; shift; "$@" >"$out"' _ "$WORK/async_compare.json" \
    "${RLT[@]}" bench offline --model "$MODEL_DIR" --dtype "$DTYPE" --device "$DEVICE" \
    --async-scheduling --compare --concurrency-list "$ASYNC_CONCURRENCY" \
    --num-prompts 128 --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --exit-threshold "$EXIT_THRESHOLD" --kv-cache-gb "$KV_CACHE_GB" \
    --max-model-len $((INPUT_LEN + OUTPUT_LEN + 16)) --json "${extra[@]}" || true
fi

# ---------------------------------------------------------------- 6. summary
"$PY" - "$WORK" "$OUT" >>"$LOG" 2>&1 <<'EOF' || true
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = []
for f in sorted(work.glob("bench_c*_q*_*.json")):
    try:
        rep = json.loads(f.read_text())
    except ValueError:
        continue
    run = rep.get("refill", {})
    c, rest = f.stem[len("bench_c"):].split("_q", 1)
    thr, mode = rest.rsplit("_", 1)
    rows.append({"concurrency": int(c), "mode": mode, "exit_threshold": float(thr),
                 "tokens_per_s": run.get("output_tokens_per_s"),
                 "mean_exit_depth": run.get("mean_exit_depth"),
                 "mean_rows_per_step": run.get("mean_rows_per_step"),
                 "graph_steps": run.get("graph_steps"), "steps": run.get("steps"),
                 "seconds": run.get("seconds"), "report": rep})
by = {(r["concurrency"], r["mode"], r["exit_threshold"]): r for r in rows}
for r in rows:
    full = by.get((r["concurrency"], r["mode"], 1.0))
    if full and r["tokens_per_s"] and full["tokens_per_s"]:
        r["vs_full_depth"] = round(r["tokens_per_s"] / full["tokens_per_s"], 3)
    eager = by.get((r["concurrency"], "eager", r["exit_threshold"]))
    if r["mode"] != "eager" and eager and r["tokens_per_s"] and eager["tokens_per_s"]:
        r["vs_eager"] = round(r["tokens_per_s"] / eager["tokens_per_s"], 3)
build = work / "native_build.json"
native = json.loads(build.read_text()).get("backend_info") if build.is_file() and build.stat().st_size else None
env = json.loads((work / "env.json").read_text()) if (work / "env.json").is_file() else {}
async_file = work / "async_compare.json"
async_cmp = None
if async_file.is_file() and async_file.stat().st_size:
    try:
        async_cmp = json.loads(async_file.read_text()).get("async_compare")
    except ValueError:
        pass
summary = {"env": env, "native": native, "runs": sorted(rows, key=lambda r: (r["concurrency"], r["mode"], -r["exit_threshold"])), "async_compare": async_cmp}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
lines = [f"native backend: {native['backend'] if native else 'not built'}",
         f"{'conc':>5} {'mode':>6} {'thr':>5} {'tok/s':>9} {'depth':>6} {'vs full':>8} {'vs eager':>8} {'graphed':>9}"]
for r in summary["runs"]:
    lines.append(f"{r['concurrency']:>5} {r['mode']:>6} {r['exit_threshold']:>5} "
                 f"{r['tokens_per_s'] or '-':>9} {r['mean_exit_depth'] or '-':>6} "
                 f"{r.get('vs_full_depth', '-'):>8} {r.get('vs_eager', '-'):>8} "
                 f"{str(r['graph_steps']) + '/' + str(r['steps']) if r['graph_steps'] is not None else '-':>9}")
for c, row in (async_cmp or {}).items():
    lines.append(f"async c={c}: sync {row['sync']['output_tokens_per_s']} tok/s, async "
                 f"{row['async']['output_tokens_per_s']} tok/s ({row['async_vs_sync']}x), busy "
                 f"{row['sync']['executor_busy']} / {row['async']['executor_busy']}")
(out / "summary.txt").write_text("\n".join(lines) + "\n")
EOF
