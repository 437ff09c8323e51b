#!/usr/bin/env bash
# A second "drive" for the striping bench (bench/striping.py): an ext4 filesystem on a loop device whose
# backing file lives in RAM (tmpfs), with direct I/O on the loop device. Needs root.
#   bash bench/ramdrive.sh up [MOUNTPOINT] [SIZE]   # default /mnt/tiermem-ramdrive, 2600M; prints the mount point
#   bash bench/ramdrive.sh down [MOUNTPOINT]
set -euo pipefail
cmd=${1:-up}
mnt=${2:-/mnt/tiermem-ramdrive}
size=${3:-2600M}
back="$mnt-backing"
case "$cmd" in
  up)
    if mountpoint -q "$mnt"; then echo "$mnt"; exit 0; fi
    mkdir -p "$back" "$mnt"
    mountpoint -q "$back" || mount -t tmpfs -o size="$(( ${size%M} + 64 ))M" tmpfs "$back"
    truncate -s "$size" "$back/disk.img"
    loop=$(losetup --find --show --direct-io=on "$back/disk.img")
    mkfs.ext4 -q -F "$loop" >/dev/null
    mount "$loop" "$mnt"
    echo "$mnt"
    ;;
  down)
    if mountpoint -q "$mnt"; then
      loop=$(findmnt -n -o SOURCE "$mnt")
      umount "$mnt"
      losetup -d "$loop" 2>/dev/null || true
    fi
    if mountpoint -q "$back"; then umount "$back"; fi
    rmdir "$mnt" "$back" 2>/dev/null || true
    ;;
  *) echo "usage: $0 up|down [MOUNTPOINT] [SIZE]" >&2; exit 2 ;;
esac
