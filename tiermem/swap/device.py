"""Moves between host buffers and the compute device: in place on the CPU, a side stream on CUDA.

# [Note: device copies]
On CUDA, host->device and device->host copies run on one side stream from pinned host buffers
(non_blocking), and each records an event. The compute stream waits on that event (not the host
thread), so a copy for the next unit overlaps the kernels of the current one. On the CPU the device
tier is the host buffer itself: "moving" is a state change and no byte is copied.
"""

from __future__ import annotations

import torch

from tiermem.errors import ConfigError


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


class DeviceMover:
    """Copies a partition's flat storage between host and device; the CPU version copies nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copies = device.type == "cuda"  # False: the device tier is the host buffer itself
        self._stream = torch.cuda.Stream(device=device) if self.copies else None  # side stream for copies

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """Start copying `host` (uint8, pinned) to a new device tensor; return it and its ready event."""
        if not self.copies:
            return host, None
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return dev, event

    def to_host(self, dev: torch.Tensor, host: torch.Tensor) -> object | None:
        """Start copying `dev` back into `host`; return the event that marks it done."""
        if not self.copies:
            return None
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer's kernels first
        with torch.cuda.stream(self._stream):
            host.copy_(dev, non_blocking=True)
            dev.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    @staticmethod
    def done(event: object | None) -> bool:
        return event is None or bool(event.query())  # type: ignore[attr-defined]

    def make_current_wait(self, event: object | None) -> None:
        """Order the compute stream after `event` without blocking the host thread."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    @staticmethod
    def synchronize(event: object | None) -> None:
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
