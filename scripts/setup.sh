#!/usr/bin/env bash
# Installs what tiermem needs on a fresh Debian machine, idempotently:
#   - Debian's liburing-dev (the io_uring core is built against it; without it tiermem uses threads) and g++
#     (tiermem's CPU allocator is built with it at first use: memory.cpu_allocator in docs/config.md),
#   - PyTorch, only when none is installed: the CPU build 2.13.0, so pip never pulls a multi-GB CUDA
#     wheel here (a user's own torch, CUDA or not, is kept),
#   - tiermem itself, editable, with its test tools (extras [dev]).
# Set PYTHON to choose the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

missing=()
for pkg in liburing-dev g++ "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing Debian packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "setup: warning: missing Debian packages ${missing[*]}; run: sudo apt-get install ${missing[*]}" >&2
    fi
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (CPU build)"
    "$PY" -m pip install -q torch==2.13.0
fi

echo "setup: installing tiermem (editable) with its dev tools"
"$PY" -m pip install -q -e ".[dev]"
"$PY" -m tiermem info | sed -n '1,5p'
