"""The compute device: resolving the config's `device`, and the copying test device's bookkeeping.

# [Note: copying test device]
A CPU-only machine cannot show the bugs that come from confusing device and host memory, since they are
the same memory there. `copying_device()` (a switch for the tests and bench/gpu_check.py, not a user
setting) makes every swapper whose device is the CPU use `CopyingMover` (swap/transfers.py): a
partition's bytes are copied into a separate tensor per transfer, made by `copy_device_empty`, whose
memory is counted while it is alive (its owner goes with the last view of it). A test can then compare
the ledger's device bytes with the bytes really alive, and `check_host` (called where only host memory
may go: the optimizer's update, the I/O engine, checkpoints) raises when a device tensor arrives there,
as CUDA's device mismatch would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from tiermem.errors import ConfigError, DeviceMismatchError


def resolve_device(spec: str) -> torch.device:
    """The compute device for a config's `device` value (auto | cpu | cuda | cuda:N)."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {spec!r} but CUDA is not available here; set device: auto or cpu")
        dev = torch.device(spec)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device: {spec!r} but only {torch.cuda.device_count()} CUDA device(s) exist; "
                              "pick one of them")
        return torch.device("cuda", index)
    return torch.device("cpu")


class _Block:
    """Owns one copying-device allocation; counted alive until the last tensor over it is freed."""

    __slots__ = ("nbytes", "address", "__weakref__")

    def __init__(self, nbytes: int, address: int) -> None:
        self.nbytes = nbytes
        self.address = address
        _DEVICE.added(self)

    def __del__(self) -> None:
        _DEVICE.freed(self)


class _OwnedArray(np.ndarray):
    """A numpy array that keeps its `_Block` alive (torch.from_numpy keeps the array alive)."""

    block: _Block


class CopyingDevice:
    """Every live copying-device allocation: bytes now and at peak, and which storages are device memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.enabled = 0  # nesting of copying_device(); swappers made while > 0 copy
        self.live: dict[int, int] = {}  # storage address -> bytes, of every live device allocation
        self.live_bytes = 0  # the sum of `live`: what a test compares with the ledger's device bytes
        self.peak_bytes = 0  # the most `live_bytes` since reset_peak()

    def added(self, block: _Block) -> None:
        with self._lock:
            self.live[block.address] = block.nbytes
            self.live_bytes += block.nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def freed(self, block: _Block) -> None:
        with self._lock:
            if self.live.pop(block.address, None) is not None:
                self.live_bytes -= block.nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` views copying-device memory."""
        if not self.live or t.device.type != "cpu" or t.is_meta:
            return False
        return t.untyped_storage().data_ptr() in self.live


_DEVICE = CopyingDevice()


def copying_device_state() -> CopyingDevice:
    """The copying test device's counters (live and peak bytes)."""
    return _DEVICE


@contextmanager
def copying_device() -> Iterator[CopyingDevice]:
    """While open, swappers made for the CPU compute device copy into tracked tensors (for tests and
    bench/gpu_check.py; see [Note: copying test device])."""
    _DEVICE.enabled += 1
    try:
        yield _DEVICE
    finally:
        _DEVICE.enabled -= 1


def copy_device_empty(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of `nbytes` in copying-device memory (counted until its last view goes)."""
    arr = np.empty(max(nbytes, 1), dtype=np.uint8).view(_OwnedArray)
    arr.block = _Block(arr.nbytes, arr.ctypes.data)
    return torch.from_numpy(arr)[:nbytes]


def check_host(what: str, *tensors: torch.Tensor) -> None:
    """Raise DeviceMismatchError when one of `tensors` is in device memory (CUDA, or the copying device)."""
    for t in tensors:
        if t.device.type == "cuda" or _DEVICE.holds(t):
            raise DeviceMismatchError(f"{what}: expected a host tensor, got one in device memory ({t.device}, "
                                      f"{tuple(t.shape)}); this is a tiermem bug, please report it")
