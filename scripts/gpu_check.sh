#!/usr/bin/env bash
# One-shot GPU check of rltserve, for a machine with an NVIDIA GPU (within ~8 minutes):
#   1. picks a Python with a CUDA torch (a venv: $RLTSERVE_GPU_VENV, the current one, or a new
#      --system-site-packages venv), makes the repo importable (PYTHONPATH, nothing installed),
#      and installs missing packages from $WHEELS,
#   2. builds the native extension with its CUDA kernel (python native/build.py --cuda on),
#   3. runs the gpu-marked tests (pytest -m gpu); the summary counts passed and skipped tests,
#      and a run where every test was skipped reads SKIPPED (and fails on DEVICE=cuda),
#   4. makes ouro-1.4b with random weights (bf16) unless present, and benchmarks decode tokens/s
#      in one process (`rltserve bench offline --cuda-graphs --compare`) at concurrency 1, 32
#      and 128: eager vs CUDA graphs, each at an exit threshold giving mean depth ~2.5 and at
#      full depth (threshold 1.0),
#   5. async vs sync scheduling through the spawned stage (dedicated stream, deferred result
#      reads) at concurrency 32 and 128 (ASYNC_CONCURRENCY), with CUDA graphs,
#   6. prints a summary and writes four files to the output dir: summary.json (environment,
#      native build, the full reports), summary.txt, gpu_check.log, gpu_tests.xml.
#
# Usage: scripts/gpu_check.sh                 (from anywhere; exit 0 when every step passed)
#        scripts/gpu_check.sh --fetch-wheels  (on a machine with a package index: downloads the
#                     wheels of packages a bare GPU image may lack into .whl/ of the repo, which
#                     is git-ignored; take .whl along to the GPU machine)
# Environment (all optional):
#   OUT                 output dir (default: bench_out/gpu_check in the repo, git-ignored)
#   PYTHON              interpreter to use or to base a venv on (default: python3)
#   RLTSERVE_GPU_VENV   venv to use, created with --system-site-packages when missing
#   WHEELS              dir of wheels for missing packages (pip --no-index --find-links;
#                       default: the repo's .whl/ when it exists, else the package index)
#   WHEEL_PYTHON        Python version of the wheels --fetch-wheels gets (default 3.12)
#   MODEL_DIR           checkpoint dir (default: /tmp/rltserve-<preset>; made when missing)
#   EXIT_THRESHOLD      Ouro exit threshold for the early-exit runs (default 0.55: mean depth
#                       ~2.5 of 4 with the synthetic weights; the summary prints the measured one)
#   CONCURRENCY         default "1,32,128";  INPUT_LEN / OUTPUT_LEN default 128 / 64
#   ASYNC_CONCURRENCY   default "32,128" (the async-vs-sync comparison; empty skips it)
#   ASYNC_NUM_PROMPTS   prompts per async-vs-sync run (default 128)
#   KV_CACHE_GB         KV pool per run (default 24)
#   BUDGET_S            overall time budget in seconds (default 480); steps that no longer fit
#                       are skipped and reported
#   PRESET, DEVICE, DTYPE   default ouro-1.4b, cuda, bfloat16 (DEVICE=cpu PRESET=ouro-tiny
#                       smoke-tests this script without a GPU; the benchmarks then run eager only)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Packages that GPU images with torch preinstalled often lack; --fetch-wheels gets them.
IMAGE_MISSING=(orjson)
if [[ "${1:-}" == --fetch-wheels ]]; then
  platforms=()
  for tag in manylinux_2_28 manylinux_2_17 manylinux2014; do platforms+=(--platform "${tag}_x86_64"); done
  exec "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: \
    --python-version "${WHEEL_PYTHON:-3.12}" --implementation cp "${platforms[@]}" \
    -d "$REPO/.whl" "${IMAGE_MISSING[@]}"
fi
OUT="${OUT:-$REPO/bench_out/gpu_check}"
PRESET="${PRESET:-ouro-1.4b}"
DEVICE="${DEVICE:-cuda}"
DTYPE="${DTYPE:-bfloat16}"
MODEL_DIR="${MODEL_DIR:-/tmp/rltserve-$PRESET}"
EXIT_THRESHOLD="${EXIT_THRESHOLD:-0.55}"
CONCURRENCY="${CONCURRENCY:-1,32,128}"
ASYNC_CONCURRENCY="${ASYNC_CONCURRENCY:-32,128}"
ASYNC_NUM_PROMPTS="${ASYNC_NUM_PROMPTS:-128}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
KV_CACHE_GB="${KV_CACHE_GB:-24}"
BUDGET_S="${BUDGET_S:-480}"
if [[ -z "${WHEELS:-}" && -d "$REPO/.whl" ]]; then WHEELS="$REPO/.whl"; fi
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
  local rc=$?  # non-zero when `set -e` ended the script early: never report success then
  ((rc != 0 && FAILED == 0)) && FAILED=$rc
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
    for m in $missing; do  # one by one: a package without a wheel there must not block the rest
      step "pip install $m (from $WHEELS)" 60 \
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$m" || true
    done
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
# Only the modules that hold gpu tests: the others may need packages (pytest-asyncio) that a
# GPU image lacks, and a module that fails to collect fails the whole run.
mapfile -t GPU_TESTS < <(grep -l "pytest.mark.gpu" "$REPO"/tests/test_*.py || true)
if ((${#GPU_TESTS[@]} == 0)); then
  SUMMARY+=("FAILED   pytest -m gpu (no module with gpu tests found)")
  FAILED=1
else
  rm -f "$OUT/gpu_tests.xml"
  if step "pytest -m gpu (${#GPU_TESTS[@]} modules)" 240 \
    "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" \
    "${GPU_TESTS[@]}"; then
    # pytest exits 0 when every test was skipped: count from the JUnit report, so a run that
    # skipped everything reads SKIPPED, never ok (and fails the check on a GPU).
    read -r passed skipped < <("$PY" - "$OUT/gpu_tests.xml" 2>>"$LOG" <<'EOF' || echo "0 0"
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "skipped", "failures", "errors")}
print(n["tests"] - n["skipped"] - n["failures"] - n["errors"], n["skipped"])
EOF
    )
    last=$((${#SUMMARY[@]} - 1))
    if ((passed == 0)); then
      SUMMARY[last]="SKIPPED  pytest -m gpu: 0 passed, all $skipped skipped (see $LOG)"
      [[ "$DEVICE" == cuda ]] && FAILED=1
    else
      SUMMARY[last]="ok       pytest -m gpu: $passed passed, $skipped skipped"
    fi
    say "gpu tests: $passed passed, $skipped skipped"
  fi
fi

# ---------------------------------------------------------------- 4. benchmarks
if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  step "make-model $PRESET -> $MODEL_DIR" 240 \
    "${RLT[@]}" make-model --preset "$PRESET" --out "$MODEL_DIR" --force || true
fi
BENCH_ARGS=(--model "$MODEL_DIR" --dtype "$DTYPE" --device "$DEVICE" --input-len "$INPUT_LEN"
  --output-len "$OUTPUT_LEN" --exit-threshold "$EXIT_THRESHOLD" --kv-cache-gb "$KV_CACHE_GB"
  --max-model-len $((INPUT_LEN + OUTPUT_LEN + 16)) --json)
if [[ -f "$MODEL_DIR/config.json" ]]; then
  # Eager vs graphs at the threshold and at full depth, one process per concurrency (a
  # timeout loses only that one); on a CPU the eager cells only.
  for c in ${CONCURRENCY//,/ }; do
    step "graphs_compare c=$c" 150 bash -c 'out=$1; shift; "$@" >"$out"' _ \
      "$WORK/graphs_compare_c$c.json" "${RLT[@]}" bench offline "${BENCH_ARGS[@]}" \
      --cuda-graphs --compare --concurrency-list "$c" || true
  done
fi

if [[ -f "$MODEL_DIR/config.json" && -n "$ASYNC_CONCURRENCY" ]]; then
  extra=()
  [[ "$DEVICE" == cuda ]] && extra=(--cuda-graphs)
  step "async_compare ($ASYNC_CONCURRENCY)" 150 bash -c 'out=$1; shift; "$@" >"$out"' _ \
    "$WORK/async_compare.json" "${RLT[@]}" bench offline "${BENCH_ARGS[@]}" \
    --async-scheduling --compare --concurrency-list "$ASYNC_CONCURRENCY" --num-prompts "$ASYNC_NUM_PROMPTS" \
    "${extra[@]}" || true
fi

# ---------------------------------------------------------------- 6. summary
"$PY" - "$WORK" "$OUT" >>"$LOG" 2>&1 <<'EOF' || true
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])

def load(name, key):
    f = work / name
    try:
        return json.loads(f.read_text()).get(key) if f.is_file() and f.stat().st_size else None
    except ValueError:
        return None

graphs_cmp = None
for f in sorted(work.glob("graphs_compare_c*.json"), key=lambda f: int(f.stem.split("_c")[-1])):
    part = load(f.name, "graphs_compare")
    if part:
        graphs_cmp = {**(graphs_cmp or {}), **part}
async_cmp = load("async_compare.json", "async_compare")
native = load("native_build.json", "backend_info")
env = json.loads((work / "env.json").read_text()) if (work / "env.json").is_file() else {}
rows = []
for c, row in (graphs_cmp or {}).items():
    if not c.isdigit():
        continue
    for mode in graphs_cmp["modes"]:
        for q in graphs_cmp["exit_thresholds"]:
            run = row.get(f"{mode}_q{q}", {})
            rows.append({"concurrency": int(c), "mode": mode, "exit_threshold": q,
                         "tokens_per_s": run.get("output_tokens_per_s"),
                         "mean_exit_depth": run.get("mean_exit_depth"),
                         "graph_steps": run.get("graph_steps"), "steps": run.get("steps"),
                         "vs_full_depth": row.get(f"{mode}_vs_full_depth") if q != 1.0 else None,
                         "vs_eager": row.get(f"graphs_vs_eager_q{q}") if mode != "eager" else None})
summary = {"env": env, "native": native, "runs": rows, "graphs_compare": graphs_cmp,
           "async_compare": async_cmp}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
lines = [f"native backend: {native['backend'] if native else 'not built'}",
         f"{'conc':>5} {'mode':>6} {'thr':>5} {'tok/s':>9} {'depth':>6} {'vs full':>8} {'vs eager':>8} {'graphed':>9}"]
for r in rows:
    graphed = f"{r['graph_steps']}/{r['steps']}" if r["graph_steps"] is not None else "-"
    lines.append(f"{r['concurrency']:>5} {r['mode']:>6} {r['exit_threshold']:>5} "
                 f"{r['tokens_per_s'] or '-':>9} {r['mean_exit_depth'] or '-':>6} "
                 f"{r['vs_full_depth'] or '-':>8} {r['vs_eager'] or '-':>8} {graphed:>9}")
for c, row in (async_cmp or {}).items():
    lines.append(f"async c={c}: sync {row['sync']['output_tokens_per_s']} tok/s, async "
                 f"{row['async']['output_tokens_per_s']} tok/s ({row['async_vs_sync']}x), busy "
                 f"{row['sync']['executor_busy']} / {row['async']['executor_busy']}")
(out / "summary.txt").write_text("\n".join(lines) + "\n")
EOF
