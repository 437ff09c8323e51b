#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a machine lent with one (about 5 minutes, at most 8):
#   1. the tests that need CUDA (tests/ files that ask torch.cuda.is_available(), tests named *cuda*);
#   2. bench/gpu_check.py: a GPT-2-medium-shaped fp16 model from NVMe under tiered_offload against the same
#      model plainly on the GPU (logits, greedy tokens, device memory, tokens/s with and without prefetch),
#      and training steps in float32 and bfloat16 against plain GPU training.
# It installs and downloads nothing: tiermem is imported from this checkout (PYTHONPATH), transformers builds
# its models from configs (offline), and io.engine auto falls back to the threads backend when the io_uring
# extension is not built or cannot load. Extra arguments go to bench/gpu_check.py (try it anywhere with
# `bash scripts/gpu_check.sh --device cpu --small`). Output files go to $OUT when it is set (pytest.log,
# gpu_check.json), else to a temporary directory. Exit status: 0 when everything passed, else the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-150}
CHECK_TIMEOUT_S=${CHECK_TIMEOUT_S:-300}
work=$(mktemp -d "${TMPDIR:-/tmp}/tiermem-gpu-check.XXXXXX")  # swap files, checkpoints; removed at exit
trap 'rm -rf "$work"' EXIT
out=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/tiermem-gpu-check-out.XXXXXX")}  # kept
mkdir -p "$out"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TIERMEM_CACHE_DIR="$work/cache"  # tiermem's CPU allocator, built once here and shared by both steps
export TMPDIR="$work"                   # pytest's tmp_path and the check's swap files stay under $work

status=0
note() { echo; echo "== $* ($(date +%T))"; }
failed() { [ "$status" = 0 ] && status=$1; }  # the exit status is the first failure's

note "system"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" - <<'EOF'
import torch
from tiermem.io.engine import available_backends
reason = available_backends()["io_uring"]
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPU {gpu}, io backend "
      + ("io_uring" if reason is None else f"threads (io_uring not usable: {reason})"))
EOF

note "1. tests that need CUDA"
if "$PY" -c "import pytest" 2>/dev/null; then
    mapfile -t files < <(grep -l "torch.cuda.is_available" tests/test_*.py)
    timeout "$PYTEST_TIMEOUT_S" "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda "${files[@]}" 2>&1 \
        | tee "$out/pytest.log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) ;;
        124) echo "the CUDA tests ran past ${PYTEST_TIMEOUT_S} s and were stopped"; failed 124 ;;
        *) echo "the CUDA tests failed (pytest exit status $rc)"; failed "$rc" ;;
    esac
else
    echo "pytest is not installed: the CUDA tests are skipped"
fi

note "2. bench/gpu_check.py $*"
timeout "$CHECK_TIMEOUT_S" "$PY" bench/gpu_check.py --dir "$work/check" --json "$out/gpu_check.json" "$@"
rc=$?
case $rc in
    0) ;;
    124) echo "bench/gpu_check.py ran past ${CHECK_TIMEOUT_S} s and was stopped"; failed 124 ;;
    *) echo "bench/gpu_check.py exit status $rc (1: a check failed, 2: a section raised)"; failed "$rc" ;;
esac
note "done: exit status $status; logs and JSON in $out"
exit "$status"
