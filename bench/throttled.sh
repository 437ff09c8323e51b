#!/usr/bin/env bash
# Run a command with the disk under a directory read and written at set speeds: the kernel's block throttle
# (a blkio cgroup, v1 blkio.throttle.{read,write}_bps_device, or v2 io.max) on the block device holding DIR,
# for the command and every process it starts; the processes outside keep the disk as it is. Every tool a
# bench compares then meets the same slower disk, e.g. to see how a ratio between them moves with the disk's
# speed (docs/benchmarks.md). Needs root. Rates in bytes per second (1750000000 = 1.75 GB/s).
#   bash bench/throttled.sh DIR READ_BPS WRITE_BPS COMMAND [ARGS...]
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 DIR READ_BPS WRITE_BPS COMMAND [ARGS...]" >&2
  exit 2
fi
dir=$1 rbps=$2 wbps=$3
shift 3
for r in "$rbps" "$wbps"; do
  case $r in
    ''|*[!0-9]*) echo "$0: rates are bytes per second, whole numbers (got $r)" >&2; exit 2 ;;
  esac
done
mkdir -p "$dir"
src=$(findmnt -n -o SOURCE --target "$dir")
dev=$(lsblk -n -d -o MAJ:MIN "$src" 2>/dev/null | tr -d ' ' || true)
if [ -z "$dev" ]; then
  echo "$0: no block device found for $dir (its filesystem is $src)" >&2
  exit 2
fi
# a partition's requests are throttled on its disk: take the whole disk's major:minor
parent=$(lsblk -n -s -o MAJ:MIN "$src" 2>/dev/null | tail -1 | tr -d ' ')
dev=${parent:-$dev}
group="tiermem-throttled-$$"
if [ -d /sys/fs/cgroup/blkio ]; then
  g=/sys/fs/cgroup/blkio/$group
  mkdir "$g"
  echo "$dev $rbps" > "$g/blkio.throttle.read_bps_device"
  echo "$dev $wbps" > "$g/blkio.throttle.write_bps_device"
elif grep -qw io /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
  g=/sys/fs/cgroup/$group
  mkdir "$g"
  echo "$dev rbps=$rbps wbps=$wbps" > "$g/io.max"
else
  echo "$0: needs a blkio cgroup (v1) or the io controller (v2), as root" >&2
  exit 2
fi
cleanup() { rmdir "$g" 2>/dev/null || true; }
trap cleanup EXIT
echo "$0: $dir on $src ($dev): reads at most $rbps B/s, writes at most $wbps B/s" >&2
# the command runs in a child shell moved into the group; this shell stays outside to remove the group after
rc=0
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' throttled "$g" "$@" || rc=$?
exit $rc
