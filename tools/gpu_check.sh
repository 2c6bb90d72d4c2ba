#!/usr/bin/env bash
# GPU check of the Triton attention kernels (issue 5), within 8 minutes on one GPU: the `gpu`
# kernel and engine tests (CUDA at real sizes, CUDA graphs, overlap), then tools/bench_kernels.py
# (decode bandwidth, prefill TFLOP/s vs SDPA, Llama-3.1-8B-shaped decode step vs the weight-read
# roofline), then its engine-loop part (tokens/s with overlap on/off x CUDA graphs on/off).
#
# Expects, already installed for $PYTHON (default python3; 3.11+): torch with CUDA (2.11 on the
# GPU machine), triton (3.6 there), pytest; hypothesis if present (the root conftest imports it;
# without it the tests run with --noconftest, which on a GPU loses nothing they need). It creates
# no venv and installs nothing. Run from anywhere: it works in the repository root.
#
#   tools/gpu_check.sh                    # output on the terminal
#   OUT=/some/dir tools/gpu_check.sh      # also $OUT/gpu_check.log and $OUT/gpu_tests.xml
#   PEAK_TBPS=3.35 tools/gpu_check.sh     # HBM peak of a device the benchmark does not know
#   SMOKE=1 tools/gpu_check.sh            # without a GPU: the benchmark's tiny CPU smoke mode
#
# Exit status: 0 when the tests pass and the benchmark ran; the benchmark's goal verdicts are
# reported in its table, not in the exit status.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
TEST_TIMEOUT_S=150
ENGINE_TEST_TIMEOUT_S=60
BENCH_TIMEOUT_S=190
ENGINE_BENCH_TIMEOUT_S=60

out() {
  if [[ -n "${OUT:-}" ]]; then tee -a "$OUT/gpu_check.log"; else cat; fi
}

step() {  # step NAME COMMAND...: run, tee, print and return the command's exit status
  local name=$1
  shift
  echo "== $name: $*" | out
  local start=$SECONDS
  "$@" 2>&1 | out
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s" | out
  return "$rc"
}

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  : >"$OUT/gpu_check.log"
fi

step environment "$PYTHON" -c "
import sys, torch, triton
print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__)
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')
"
command -v nvidia-smi >/dev/null && step nvidia-smi nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv

conftest_args=()
if ! "$PYTHON" -c "import hypothesis" 2>/dev/null; then
  echo "hypothesis is not installed: running the tests with --noconftest" | out
  conftest_args=(--noconftest)
fi
junit_args=()
[[ -n "${OUT:-}" ]] && junit_args=(--junitxml "$OUT/gpu_tests.xml")

step gpu-tests timeout "$TEST_TIMEOUT_S" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -q -rs \
  "${conftest_args[@]}" "${junit_args[@]}" \
  tests/unit/kernels/test_kv_store.py \
  tests/unit/kernels/test_decode_attention.py \
  tests/unit/kernels/test_prefill_attention.py \
  tests/unit/kernels/test_triton_backend.py
tests_rc=$?

# the engine's CUDA tests and benchmark need the engine's own dependencies
engine_ok=0
if "$PYTHON" -c "import transformers, tokenizers, safetensors, msgspec" 2>/dev/null; then
  engine_ok=1
  step engine-gpu-tests timeout "$ENGINE_TEST_TIMEOUT_S" "$PYTHON" -m pytest -m gpu \
    -p no:cacheprovider -q -rs tests/unit/engine/test_cuda_graphs.py
  [[ $? -eq 0 ]] || tests_rc=1
else
  echo "== engine tests and engine benchmark skipped: transformers/tokenizers/safetensors/msgspec missing" | out
fi

bench_args=()
[[ -n "${PEAK_TBPS:-}" ]] && bench_args+=(--peak-tbps "$PEAK_TBPS")
[[ -n "${SMOKE:-}" ]] && bench_args+=(--smoke)
step benchmark timeout "$BENCH_TIMEOUT_S" "$PYTHON" tools/bench_kernels.py "${bench_args[@]}" \
  --only decode --only prefill --only e2e --only sweep
bench_rc=$?
engine_rc=0
if [[ $engine_ok -eq 1 ]]; then
  step engine-benchmark timeout "$ENGINE_BENCH_TIMEOUT_S" "$PYTHON" tools/bench_kernels.py \
    "${bench_args[@]}" --only engine
  engine_rc=$?
fi

echo "== gpu_check: tests exit $tests_rc, benchmark exit $bench_rc, engine benchmark exit $engine_rc" | out
[[ $tests_rc -eq 0 && $bench_rc -eq 0 && $engine_rc -eq 0 ]]
