#!/usr/bin/env bash
# Fetches here, once, what scripts/gpu_check.sh needs on the lent GPU machine and that machine lacks (it has no
# package registry, no cffi, no liburing headers, no pytest), into folders git ignores, which the device tool
# carries with the tree (carry: .whl, .gl):
#   .whl/  wheels for CPython 3.12 on x86_64 Linux: cffi (the io_uring core's runtime), pytest, pytest-timeout
#          and hypothesis (the CUDA tests), aiofiles (checkpoint metadata); installed there offline, only those
#          missing, into a folder of the run's own (pip install --no-index --target);
#   .gl/liburing/  Debian's liburing-dev unpacked (headers and the static liburing.a);
#   .gl/io_uring/tiermem/io/_uring_cffi.abi3.so  the io_uring core built here against that liburing.a, linked
#          statically (it needs only libc there) for the stable ABI (abi3: it loads on any CPython 3, 3.12 too).
# Needs: pip reaching PyPI, apt-get reaching Debian's packages, a C compiler and cffi (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

rm -rf .whl .gl
mkdir -p .whl .gl/deb
echo "gpu_deps: wheels for CPython 3.12 into .whl/"
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    cffi pytest pytest-timeout hypothesis aiofiles
echo "gpu_deps: Debian's liburing-dev into .gl/liburing/"
(cd .gl/deb && apt-get download liburing-dev 2>/dev/null)
dpkg-deb -x .gl/deb/liburing-dev_*.deb .gl/liburing
echo "gpu_deps: the io_uring core, liburing linked in, into .gl/io_uring/"
TIERMEM_LIBURING_PREFIX="$PWD/.gl/liburing" "$PY" tiermem/io/_build_uring.py "$PWD/.gl/io_uring" >.gl/build.log 2>&1 \
    || { tail -20 .gl/build.log >&2; exit 1; }
so=.gl/io_uring/tiermem/io/_uring_cffi.abi3.so
[ -f "$so" ] || { echo "gpu_deps: the build made no $so (see .gl/build.log)" >&2; exit 1; }
if ldd "$so" | grep -q liburing; then
    echo "gpu_deps: $so links liburing dynamically; the GPU machine has none" >&2
    exit 1
fi
du -sh .whl .gl | sed 's/^/gpu_deps: /'
echo "gpu_deps: done; run the check with the device tool: command 'bash scripts/gpu_check.sh', carry [\".whl\", \".gl\"]"
