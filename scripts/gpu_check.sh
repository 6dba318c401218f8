#!/usr/bin/env bash
# One-shot GPU check of rltserve, for a machine with an NVIDIA GPU (within ~9 minutes):
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
#   6. the targets a CPU cannot settle, each step under its own time limit, on ouro-small
#      (float32, made unless present; the dtype of the recorded CPU figures):
#      - KV pressure: the command of docs/benchmarks.md "KV pressure" (`bench offline
#        --kv-pressure`): full reservation vs on-demand recompute vs swap vs an unpressured pool,
#      - rollout: `bench rollout`, in-place weight updates vs a new engine per training step,
#      - host path: `bench host` (stand-in model: the host CPU's figures, whatever the device)
#        at 256 and 512 decode rows, 1k context, sync and async, decode and mixed, one process
#        per row count;
#      the summary has one line per target: measured value, target, met yes/no,
#      then, last, scripts/fuzz_oracle.py on the device against the CPU oracle (FUZZ_CASES),
#   7. prints a summary and writes four files to the output dir: summary.json (environment,
#      native build, the full reports, the target checks), summary.txt, gpu_check.log,
#      gpu_tests.xml.
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
#   BUDGET_S            overall time budget in seconds (default 540); steps that no longer fit
#                       are skipped and reported
#   TARGETS_RESERVE_S   part of the budget steps 1-5 leave to the target steps (default 240)
#   SMALL_PRESET, SMALL_MODEL_DIR, SMALL_DTYPE   the target steps' model: default ouro-small,
#                       /tmp/rltserve-<preset> (MODEL_DIR for PRESET's), float32
#   KV_PRESSURE_CONCURRENCY  requests of the KV-pressure run (default 32; the pool holds 1/8 of
#                       them; empty skips it);  KV_PRESSURE_LEN  prompt and output tokens (32);
#                       KV_PRESSURE_REPEATS  runs of each case, in rounds, median times (3);
#                       KV_PAD_COMPARE  the same again with --attention-pad-budget KV_PAD_BUDGET
#                       (default 1 on CUDA, 0 elsewhere; budget 262144; run last, within
#                       KV_PAD_LIMIT_S, default 120), KV_PAD_REPEATS times (2)
#   ROLLOUT_STEPS       training steps per rollout arm (default 3; 0 skips it); ROLLOUT_PROMPTS,
#                       ROLLOUT_N, ROLLOUT_MAX_TOKENS default 4, 8, 8
#   HOST_ROWS           decode rows of the host-path cells, one process each (default "256,512";
#                       empty skips them); HOST_CONTEXTS "1024", HOST_STEPS 100, HOST_REPEATS 3
#   FUZZ_CASES          cases of scripts/fuzz_oracle.py on the device, last (default 100; 0
#                       skips it), within FUZZ_LIMIT_S (90)
#   KV_PRESSURE_LIMIT_S, ROLLOUT_LIMIT_S, HOST_LIMIT_S   the target steps' limits (default 180,
#                       120, and 30 per row count)
#   PRESET, DEVICE, DTYPE   default ouro-1.4b, cuda, bfloat16 (DEVICE=cpu PRESET=ouro-tiny
#                       smoke-tests this script without a GPU; the benchmarks then run eager only)
#   SMOKE=1             smoke sizes for a CPU without a GPU: DEVICE=cpu, ouro-tiny for both
#                       models, every benchmark a few steps (each knob still overridable)
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
if [[ "${SMOKE:-0}" == 1 ]]; then  # CPU smoke sizes; each still overridable
  : "${DEVICE=cpu}" "${PRESET=ouro-tiny}" "${SMALL_PRESET=ouro-tiny}" "${CONCURRENCY=2}"
  : "${ASYNC_CONCURRENCY=2}" "${ASYNC_NUM_PROMPTS=8}" "${INPUT_LEN=8}" "${OUTPUT_LEN=4}"
  : "${KV_CACHE_GB=0.25}" "${KV_PRESSURE_CONCURRENCY=8}" "${KV_PRESSURE_LEN=2}"
  : "${KV_PRESSURE_REPEATS=2}" "${KV_PAD_COMPARE=1}" "${KV_PAD_REPEATS=1}"
  : "${ROLLOUT_STEPS=1}" "${ROLLOUT_PROMPTS=1}" "${ROLLOUT_N=2}" "${ROLLOUT_MAX_TOKENS=2}"
  : "${HOST_ROWS=256}" "${HOST_STEPS=4}" "${HOST_REPEATS=1}" "${FUZZ_CASES=3}"
fi
OUT="${OUT:-$REPO/bench_out/gpu_check}"
PRESET="${PRESET:-ouro-1.4b}"
DEVICE="${DEVICE:-cuda}"
DTYPE="${DTYPE:-bfloat16}"
MODEL_DIR="${MODEL_DIR:-/tmp/rltserve-$PRESET}"
EXIT_THRESHOLD="${EXIT_THRESHOLD:-0.55}"
CONCURRENCY="${CONCURRENCY:-1,32,128}"
ASYNC_CONCURRENCY="${ASYNC_CONCURRENCY-32,128}"  # empty: skipped
ASYNC_NUM_PROMPTS="${ASYNC_NUM_PROMPTS:-128}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
KV_CACHE_GB="${KV_CACHE_GB:-24}"
BUDGET_S="${BUDGET_S:-540}"
TARGETS_RESERVE_S="${TARGETS_RESERVE_S:-240}"
SMALL_PRESET="${SMALL_PRESET:-ouro-small}"
SMALL_MODEL_DIR_DEFAULT="/tmp/rltserve-$SMALL_PRESET"
[[ "$SMALL_PRESET" == "$PRESET" ]] && SMALL_MODEL_DIR_DEFAULT="$MODEL_DIR"
SMALL_MODEL_DIR="${SMALL_MODEL_DIR:-$SMALL_MODEL_DIR_DEFAULT}"
SMALL_DTYPE="${SMALL_DTYPE:-float32}"
KV_PRESSURE_CONCURRENCY="${KV_PRESSURE_CONCURRENCY-32}"
KV_PRESSURE_LEN="${KV_PRESSURE_LEN:-32}"
KV_PRESSURE_REPEATS="${KV_PRESSURE_REPEATS:-3}"
KV_PRESSURE_LIMIT_S="${KV_PRESSURE_LIMIT_S:-180}"
KV_PAD_COMPARE="${KV_PAD_COMPARE:-$([[ "$DEVICE" == cuda ]] && echo 1 || echo 0)}"
KV_PAD_REPEATS="${KV_PAD_REPEATS:-2}"
KV_PAD_BUDGET="${KV_PAD_BUDGET:-262144}"
KV_PAD_LIMIT_S="${KV_PAD_LIMIT_S:-120}"
ROLLOUT_STEPS="${ROLLOUT_STEPS:-3}"
ROLLOUT_PROMPTS="${ROLLOUT_PROMPTS:-4}"
ROLLOUT_N="${ROLLOUT_N:-8}"
ROLLOUT_MAX_TOKENS="${ROLLOUT_MAX_TOKENS:-8}"
ROLLOUT_LIMIT_S="${ROLLOUT_LIMIT_S:-120}"
HOST_ROWS="${HOST_ROWS-256,512}"
HOST_CONTEXTS="${HOST_CONTEXTS:-1024}"
HOST_STEPS="${HOST_STEPS:-100}"
HOST_REPEATS="${HOST_REPEATS:-3}"
HOST_LIMIT_S="${HOST_LIMIT_S:-30}"
FUZZ_CASES="${FUZZ_CASES:-100}"
FUZZ_LIMIT_S="${FUZZ_LIMIT_S:-90}"
if [[ -z "${WHEELS:-}" && -d "$REPO/.whl" ]]; then WHEELS="$REPO/.whl"; fi
START=$(date +%s)
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/rltserve-gpu-check.XXXXXX")"  # per-step JSON
LOG="$OUT/gpu_check.log"
: >"$LOG"
declare -a SUMMARY=()
FAILED=0

say() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
# The budget left to the current step: the steps before 6 leave RESERVE_S to the targets, so
# slow builds or benchmarks cannot crowd them out; step 6 sets it to 0.
RESERVE_S=0
if [[ -n "$KV_PRESSURE_CONCURRENCY" || "$ROLLOUT_STEPS" != 0 || -n "$HOST_ROWS" ]]; then
  RESERVE_S=$TARGETS_RESERVE_S
fi
remaining() { echo $((BUDGET_S - RESERVE_S - ($(date +%s) - START))); }

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
    # shellcheck disable=SC2086  # one argument per package
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
# TO_FILE FILE CMD...: CMD with its stdout in FILE (the JSON reports), runnable under timeout.
# shellcheck disable=SC2016  # expanded by the inner bash
TO_FILE=(bash -c 'out=$1; shift; "$@" >"$out"' _)

# ---------------------------------------------------------------- 2. native extension
CUDA_FLAG=on
[[ "$DEVICE" == cpu ]] && CUDA_FLAG=auto
step "build native extension (--cuda $CUDA_FLAG)" 300 \
  "${TO_FILE[@]}" "$WORK/native_build.json" "$PY" "$REPO/native/build.py" --cuda "$CUDA_FLAG" ||
  true

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
    step "graphs_compare c=$c" 150 "${TO_FILE[@]}" \
      "$WORK/graphs_compare_c$c.json" "${RLT[@]}" bench offline "${BENCH_ARGS[@]}" \
      --cuda-graphs --compare --concurrency-list "$c" || true
  done
fi

if [[ -f "$MODEL_DIR/config.json" && -n "$ASYNC_CONCURRENCY" ]]; then
  extra=()
  [[ "$DEVICE" == cuda ]] && extra=(--cuda-graphs)
  step "async_compare ($ASYNC_CONCURRENCY)" 150 "${TO_FILE[@]}" \
    "$WORK/async_compare.json" "${RLT[@]}" bench offline "${BENCH_ARGS[@]}" \
    --async-scheduling --compare --concurrency-list "$ASYNC_CONCURRENCY" --num-prompts "$ASYNC_NUM_PROMPTS" \
    "${extra[@]}" || true
fi

# ---------------------------------------------------------------- 6. targets
# KV pressure, rollout and host path: what a CPU cannot settle, on the small model in the dtype
# of the recorded CPU figures; each step under its own limit.
RESERVE_S=0
SMALL_ARGS=(--model "$SMALL_MODEL_DIR" --device "$DEVICE" --dtype "$SMALL_DTYPE")
if [[ (-n "$KV_PRESSURE_CONCURRENCY" || "$ROLLOUT_STEPS" != 0) &&
  ! -f "$SMALL_MODEL_DIR/config.json" ]]; then
  step "make-model $SMALL_PRESET -> $SMALL_MODEL_DIR" 60 \
    "${RLT[@]}" make-model --preset "$SMALL_PRESET" --out "$SMALL_MODEL_DIR" --force --quiet || true
fi
# The CLI twice in one process, the first time (ARGS before --) with its report discarded: the
# first engine of a process pays the device's one-time start-up (context, libraries, kernels),
# which would otherwise land on the first case measured (the KV bench's full reservation).
WARM_THEN_RUN='import contextlib, io, sys
from rltserve.cli import main
cut = sys.argv.index("--")
with contextlib.redirect_stdout(io.StringIO()):
    main(sys.argv[1:cut])
sys.exit(main(sys.argv[cut + 1:]))'
if [[ -f "$SMALL_MODEL_DIR/config.json" && -n "$KV_PRESSURE_CONCURRENCY" ]]; then
  KV_ARGS=(bench offline "${SMALL_ARGS[@]}" --exit-threshold 0.5 --kv-pressure --json --quiet)
  # The KV bench after a discarded smoke-sized copy of it; the caller adds its last flags.
  KV_RUN=("$PY" -c "$WARM_THEN_RUN"
    "${KV_ARGS[@]}" --num-prompts 8 --concurrency 8 --input-len 4 --output-len 2 --
    "${KV_ARGS[@]}" --num-prompts "$KV_PRESSURE_CONCURRENCY"
    --concurrency "$KV_PRESSURE_CONCURRENCY" --input-len "$KV_PRESSURE_LEN"
    --output-len "$KV_PRESSURE_LEN")
  step "kv_pressure $SMALL_PRESET c=$KV_PRESSURE_CONCURRENCY" "$KV_PRESSURE_LIMIT_S" \
    "${TO_FILE[@]}" "$WORK/kv_pressure.json" "${KV_RUN[@]}" --repeats "$KV_PRESSURE_REPEATS" ||
    true
fi
if [[ -f "$SMALL_MODEL_DIR/config.json" && "$ROLLOUT_STEPS" != 0 ]]; then
  step "rollout $SMALL_PRESET ($ROLLOUT_STEPS steps)" "$ROLLOUT_LIMIT_S" \
    "${TO_FILE[@]}" "$WORK/rollout.json" \
    "${RLT[@]}" bench rollout "${SMALL_ARGS[@]}" --num-prompts "$ROLLOUT_PROMPTS" \
    --n "$ROLLOUT_N" --max-tokens "$ROLLOUT_MAX_TOKENS" --steps "$ROLLOUT_STEPS" --json || true
fi
for rows in ${HOST_ROWS//,/ }; do
  step "host rows=$rows ctx=$HOST_CONTEXTS" "$HOST_LIMIT_S" \
    "${TO_FILE[@]}" "$WORK/host_rows$rows.json" \
    "${RLT[@]}" bench host --rows "$rows" --contexts "$HOST_CONTEXTS" --steps "$HOST_STEPS" \
    --repeats "$HOST_REPEATS" --quiet || true
done

# An attention pad budget's effect on a GPU (whose small-model steps are launch-bound): the KV
# runs again with one, after the targets' steps so that it never crowds them out.
if [[ -f "$SMALL_MODEL_DIR/config.json" && -n "$KV_PRESSURE_CONCURRENCY" &&
  "$KV_PAD_COMPARE" == 1 ]]; then
  step "kv_pressure with attention pad budget $KV_PAD_BUDGET" "$KV_PAD_LIMIT_S" \
    "${TO_FILE[@]}" "$WORK/kv_pressure_pad.json" "${KV_RUN[@]}" --repeats "$KV_PAD_REPEATS" \
    --attention-pad-budget "$KV_PAD_BUDGET" || true
fi

# The engine on the device against the CPU oracle (random engine settings and workloads, CUDA
# graphs in half the cases): last, within what the budget leaves.
if ((FUZZ_CASES > 0)); then
  step "fuzz_oracle on $DEVICE ($FUZZ_CASES cases)" "$FUZZ_LIMIT_S" \
    "${TO_FILE[@]}" "$WORK/fuzz_oracle.json" "$PY" "$REPO/scripts/fuzz_oracle.py" \
    --device "$DEVICE" --cases "$FUZZ_CASES" --json || true
fi

# ---------------------------------------------------------------- 7. summary
"$PY" "$REPO/scripts/gpu_check_summary.py" "$WORK" "$OUT" "$DEVICE" "$SMALL_PRESET" \
  "$SMALL_DTYPE" >>"$LOG" 2>&1 || { SUMMARY+=("FAILED   summary (see $LOG)") && FAILED=1; }
