#!/usr/bin/env bash
# Install the peers that bench/io_vs_peers.py compares tiermem with: fio, libaio (for DeepSpeed's
# aio op) and DeepSpeed itself, and jemalloc and mimalloc for the allocator diagnostics of
# bench/train_offload.py (docs/benchmarks.md).
# Benchmark-only; tiermem does not depend on any of them.
# Usage: bash bench/setup-peers.sh   (as root, or with sudo available for apt-get)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libaio-dev fio libjemalloc2 libmimalloc2.0

# DeepSpeed asks for torch>=2; pin whatever torch is installed so pip keeps it (a CPU build must not be
# swapped for another wheel). The pin is added to any constraint file pip is already configured with.
torch_version="$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
pin="$(mktemp)"
trap 'rm -f "$pin"' EXIT
if [ -n "$torch_version" ]; then
    echo "torch==${torch_version}" > "$pin"
    echo "keeping torch ${torch_version}"
fi
"$python" -m pip install -c "$pin" -r "$here/requirements-peers.txt"

after="$("$python" -c 'import torch; print(torch.__version__)')"
if [ -n "$torch_version" ] && [ "$after" != "$torch_version" ]; then
    echo "error: torch changed from ${torch_version} to ${after}" >&2
    exit 1
fi
"$python" -m pip show torch deepspeed | grep -E '^(Name|Version):'
echo "peers installed; DeepSpeed's aio op is built on first use (DS_ACCELERATOR=cpu python3 bench/io_vs_peers.py)"
