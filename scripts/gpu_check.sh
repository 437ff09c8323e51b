#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a machine lent with one (about 5 minutes, at most 8).
#
#   bash scripts/gpu_check.sh [--device cuda|copy|cpu] [--small] [bench/gpu_check.py options]
#
#   --device cuda   (default) the lent GPU. Before the session, run `bash scripts/gpu_deps.sh` here: it fetches
#                   what that machine lacks into .whl/ and .gl/ (git ignores them; give the device tool
#                   carry [".whl", ".gl"]).
#   --device copy   the same path on any machine, under tiermem's copying test device (asynchronous copies,
#                   backward on a device thread: [Note: as strict as a GPU] in tiermem/device.py); CI runs it
#                   with --small (tests/test_gpu_check.py), so the script itself cannot rot.
#   --device cpu    the plain CPU (no device copies at all).
#
# Steps, each with a time limit, everything printed also written to $OUT/gpu_check.log as it goes:
#   0. system: GPU, driver, Python, torch and CUDA versions;
#   1. dependencies: the modules this tree needs that the machine lacks (cffi, pytest, pytest-timeout,
#      hypothesis, aiofiles) installed offline from .whl/ into a folder of this run's; the io_uring core
#      (tiermem/io/_uring_cffi.abi3.so) taken from .gl/io_uring/ when the tree has none that loads; then the
#      I/O engine tiermem will use: io_uring, or the threads engine only where the kernel refuses io_uring
#      (said, not a failure); a core that cannot load is a failure;
#   2. tests: on cuda the tests that need CUDA (tests/ files that ask torch.cuda.is_available(), tests named
#      *cuda*), on copy those of its strictness (tests/test_strict_device.py); log in $OUT/pytest.log;
#   3. bench/gpu_check.py: host<->device GB/s (pinned and pageable, torch's and tiermem's), whether the pool
#      was page-locked and copies overlap compute, `tiermem bench io` on the work directory, a
#      GPT-2-medium-shaped fp16 model streamed from NVMe against it in device memory (logits, tokens,
#      tokens/s, streaming GB/s against the disk's, stall time), int8/int4 expansion, and training steps in
#      float32 and bfloat16 against the same steps in device memory (losses, weights, step time); its JSON is
#      rewritten to $OUT/gpu_check.json after each section.
# Without $OUT, output goes to a temporary folder (printed). Exit status: 0 only when every step passed, else
# the first failure's (124: a step ran past its limit).
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
for arg in "$@"; do
    case $arg in -h|--help) usage; exit 0 ;; esac
done
cd "$(dirname "$0")/.."

device=cuda
small=()
rest=()
while [ $# -gt 0 ]; do
    case $1 in
        --device) device=${2:-}; shift 2 || { echo "--device needs a value: cuda, copy or cpu" >&2; exit 2; } ;;
        --device=*) device=${1#--device=}; shift ;;
        --small) small=(--small); shift ;;
        *) rest+=("$1"); shift ;;
    esac
done
case $device in
    cuda|cuda:*|copy|cpu) ;;
    *) echo "--device $device: expected cuda, cuda:N, copy or cpu" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-150}
CHECK_TIMEOUT_S=${CHECK_TIMEOUT_S:-300}
work=$(mktemp -d "${TMPDIR:-/tmp}/tiermem-gpu-check.XXXXXX")  # swap files, checkpoints, installed modules
trap 'rm -rf "$work"' EXIT
out=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/tiermem-gpu-check-out.XXXXXX")}  # kept
mkdir -p "$out"
exec > >(tee -a "$out/gpu_check.log") 2>&1  # the log is written as it goes: a run stopped early keeps it
tee_pid=$!

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TIERMEM_CACHE_DIR="$work/cache"  # tiermem's CPU allocator, built once here and shared by the steps
export TMPDIR="$work"                   # pytest's tmp_path and the check's swap files stay under $work

status=0
note() { echo; echo "== $* ($(date +%T))"; }
failed() { [ "$status" = 0 ] && status=$1; }  # the exit status is the first failure's
timed_step() {  # timed_step LIMIT_S WHAT CMD...: run CMD under a time limit; a failure is recorded, not fatal
    local limit=$1 what=$2 rc
    shift 2
    timeout "$limit" "$@"
    rc=$?
    case $rc in
        0) ;;
        124) echo "$what ran past ${limit} s and was stopped"; failed 124 ;;
        *) echo "$what failed (exit status $rc)"; failed "$rc" ;;
    esac
    return "$rc"
}

note "0. system (device $device; output in $out)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used \
    --format=csv,noheader
"$PY" -c 'import sys, platform, torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), GPU {gpu}, "
      f"kernel {platform.release()}")' || failed 1
if [ "${device%%:*}" = cuda ] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "--device $device but torch sees no GPU here"
    exit 2
fi

note "1. dependencies"
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"cffi": "cffi", "pytest": "pytest", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis",
        "aiofiles": "aiofiles"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing from .whl/ (offline) into this run's folder: $missing"
        # shellcheck disable=SC2086  # one word a package
        "$PY" -m pip install -q --no-index --find-links .whl --target "$work/site" $missing \
            || { echo "installing $missing from .whl/ failed"; failed 1; }
        export PYTHONPATH="$PYTHONPATH:$work/site"
    else
        echo "missing here: $missing, and no .whl/ to install them from (run scripts/gpu_deps.sh where a package" \
             "registry is reached, and carry .whl and .gl)"
        failed 1
    fi
fi
core_error() { "$PY" -c 'from tiermem.io._native import IMPORT_ERROR; print(IMPORT_ERROR or "")' 2>&1; }
why=$(core_error)
if [ -n "$why" ] && [ -f .gl/io_uring/tiermem/io/_uring_cffi.abi3.so ]; then
    echo "the tree's io_uring core does not load ($why); using the one scripts/gpu_deps.sh built"
    cp .gl/io_uring/tiermem/io/_uring_cffi.abi3.so tiermem/io/
    why=$(core_error)
fi
"$PY" - "$why" <<'EOF' || failed 1
import sys
from tiermem.io.backends import available_backends
reason = available_backends()["io_uring"]
if sys.argv[1]:
    print(f"io engine: threads; FAILED: the io_uring core is not built or does not load: {sys.argv[1]}")
    sys.exit(1)
print("io engine: io_uring" if reason is None else f"io engine: threads (the kernel refuses io_uring: {reason})")
EOF

note "2. tests"
if "$PY" -c "import pytest" 2>/dev/null; then
    case $device in
        cuda*) mapfile -t files < <(grep -l "torch.cuda.is_available" tests/test_*.py); select=(-k cuda) ;;
        copy) files=(tests/test_strict_device.py); select=() ;;
        *) files=(); select=() ;;
    esac
    if [ ${#files[@]} -gt 0 ]; then
        timed_step "$TESTS_TIMEOUT_S" "the tests" "$PY" -m pytest -q -rs -p no:cacheprovider "${select[@]}" \
            "${files[@]}" > >(tee "$out/pytest.log") 2>&1
    else
        echo "no tests for --device $device"
    fi
else
    echo "pytest is not importable: the tests did not run"
    failed 1
fi

note "3. bench/gpu_check.py --device $device ${small[*]} ${rest[*]}"
timed_step "$CHECK_TIMEOUT_S" "bench/gpu_check.py (1: a check failed, 2: a section raised)" \
    "$PY" bench/gpu_check.py --device "$device" "${small[@]}" --dir "$work/check" --json "$out/gpu_check.json" \
    "${rest[@]}"

note "done: exit status $status; log, pytest.log and gpu_check.json in $out"
exec >&- 2>&-
wait "$tee_pid"  # the log's last lines are written before this script ends
exit "$status"
