#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: a GPT-2-medium-shaped transformer (1.3 GiB of fp32
# weights) generating from NVMe under a 320 MiB host budget, with and without execution-order prefetch.
# Extra arguments go to `tiermem demo` (see `tiermem demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m tiermem demo "$@"
