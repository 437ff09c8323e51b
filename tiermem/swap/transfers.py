"""Transfers between host buffers and the compute device: none on the CPU, a side stream on CUDA, and real
copies into tracked tensors on the copying test device.

# [Note: device copies]
Only the compute thread (the one running the model) allocates device memory or starts a device copy;
the I/O engine's completion thread never does (see [Note: swapper locking] in swapper.py). On CUDA,
host->device and device->host copies run on one side stream from pinned host buffers (non_blocking), and
each records an event. The compute stream waits on that event (not the host thread), so a copy for the
next unit overlaps the kernels of the current one; a device tensor made on the side stream is recorded on
the compute stream before it is used there, so the caching allocator does not hand its memory out again
while compute still reads it. On the CPU the device tier is the host buffer itself: "moving" is a state
change and no byte is copied. The copying test device is described in [Note: copying test device] in tiermem/device.py.
"""

from __future__ import annotations

import torch

from tiermem.device import CopyStream, copy_device_empty, copying_device_state


class DeviceMover:
    """The CPU compute device: the device tier is the host buffer itself, so nothing is copied."""

    has_own_memory = False  # True: device memory is separate from host memory and bytes move between them

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty(self, nbytes: int) -> torch.Tensor:
        """A new uint8 device tensor of `nbytes` (on the CPU device, host memory outside the pool)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """Start copying `host` (uint8) to a new device tensor; return it and the event marking it done."""
        return host, None

    def to_host(self, dev: torch.Tensor, host: torch.Tensor) -> object | None:
        """Start copying `dev` into `host`; return the event that marks it done."""
        return None

    def to_device_into(self, host: torch.Tensor, dev: torch.Tensor) -> object | None:
        """Start copying `host` into the existing device tensor `dev`; return the event that marks it done."""
        return None

    def tensor_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a small resident tensor, e.g. a buffer) copied to the device; itself on the CPU device."""
        return t

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is in this device's memory (on the CPU device: any CPU tensor)."""
        return t.device.type == "cpu"

    def use_on_compute(self, dev: torch.Tensor, event: object | None) -> None:
        """Order the compute stream after the copy that made `dev`, and keep its memory until compute is done."""

    def free_bytes(self) -> int | None:
        """Device memory free now (None: no separate device memory, or no limit known)."""
        return None

    @staticmethod
    def done(event: object | None) -> bool:
        return event is None or bool(event.query())  # type: ignore[attr-defined]

    @staticmethod
    def synchronize(event: object | None) -> None:
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Wait for every copy this mover started (before the host memory they read or write goes)."""


class CudaMover(DeviceMover):
    """Copies on one side stream of a CUDA device; see [Note: device copies]."""

    has_own_memory = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._stream = torch.cuda.Stream(device=device)  # side stream for copies

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def tensor_to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def holds(self, t: torch.Tensor) -> bool:
        return t.device == self.device

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        with torch.cuda.stream(self._stream):
            dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return dev, event

    def to_host(self, dev: torch.Tensor, host: torch.Tensor) -> object | None:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer's kernels first
        with torch.cuda.stream(self._stream):
            host.copy_(dev, non_blocking=True)
            dev.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def to_device_into(self, host: torch.Tensor, dev: torch.Tensor) -> object | None:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # compute's reads of `dev` first
        with torch.cuda.stream(self._stream):
            dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def free_bytes(self) -> int | None:
        return int(torch.cuda.mem_get_info(self.device)[0])

    def use_on_compute(self, dev: torch.Tensor, event: object | None) -> None:
        compute = torch.cuda.current_stream(self.device)
        if event is not None:
            compute.wait_event(event)  # type: ignore[arg-type]
        dev.record_stream(compute)

    def close(self) -> None:
        self._stream.synchronize()


class CopyingMover(DeviceMover):
    """Computes on the CPU but keeps the device tier in separate, tracked tensors, copied to and from on a copy
    stream that completes later (see [Note: as strict as a GPU] in tiermem/device.py)."""

    has_own_memory = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._stream = CopyStream("mover")  # the side stream's stand-in

    def empty(self, nbytes: int) -> torch.Tensor:
        return copy_device_empty(nbytes)

    def tensor_to_device(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        dev = self.empty(flat.numel())
        dev.copy_(flat)  # synchronous, as `Tensor.to(device)` is for the host
        return dev.view(t.dtype).view(t.shape)

    def holds(self, t: torch.Tensor) -> bool:
        return copying_device_state().holds(t)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        dev = self.empty(host.numel())
        return dev, self._stream.copy(dev, host, "host to device")

    def to_host(self, dev: torch.Tensor, host: torch.Tensor) -> object | None:
        return self._stream.copy(host, dev, "device to host")

    def to_device_into(self, host: torch.Tensor, dev: torch.Tensor) -> object | None:
        return self._stream.copy(dev, host, "host to device")

    def use_on_compute(self, dev: torch.Tensor, event: object | None) -> None:
        self.synchronize(event)  # the compute stream is the calling thread here

    def free_bytes(self) -> int | None:
        return copying_device_state().free_bytes()

    def close(self) -> None:
        self._stream.close()


def mover_class(device: torch.device) -> type[DeviceMover]:
    """The kind of mover a compute device gets (the copying one for the CPU while `copying_device()` is open);
    its `has_own_memory` says whether the device's memory is separate from the host's."""
    if device.type == "cuda":
        return CudaMover
    if copying_device_state().enabled:
        return CopyingMover
    return DeviceMover


def make_mover(device: torch.device) -> DeviceMover:
    """The mover for a compute device (see `mover_class`)."""
    return mover_class(device)(device)
