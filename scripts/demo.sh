#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: for now, tiermem's I/O benchmark on the default
# swap directory with a short size. Extra arguments go to `tiermem bench io`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m tiermem bench io --size 256MiB --runs 3 --plot /var/tmp/tiermem-bench-io.png "$@"
