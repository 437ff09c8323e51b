"""A process group that treats memory as NCCL does, for the copying test device: a test tool.

NCCL takes device memory only: a collective on a host tensor raises ("Tensors must be CUDA and dense"), and a
default `init_process_group("nccl")` has no CPU backend to fall back to. gloo takes host tensors, and the
copying device's memory is host memory too, so on gloo alone tiermem's collectives on host tensors pass here
and raise on the first multi-GPU run. `StrictGroup` is gloo underneath (the bytes still move over TCP on
this machine) but refuses every tensor that is not copying-device memory, naming the collective and the
tensor; like NCCL's, its works do not block the host until waited on. Registered as the backend
"tiermem_strict" (for the CPU device type, where the copying device's tensors are), by `register()`.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from tiermem.device import copying_device_state

NAME = "tiermem_strict"


class StrictGroup(dist.ProcessGroup):
    """gloo, refusing tensors outside the copying device's memory as NCCL refuses host tensors."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)  # what moves the bytes
        self.options = self._gloo.options  # its timeout, as NCCL's backend carries its own

    def _device_only(self, what: str, *tensors: Any) -> None:
        for t in tensors:
            if isinstance(t, (list, tuple)):
                self._device_only(what, *t)
            elif not copying_device_state().holds(t):
                raise RuntimeError(f"{NAME} {what}: Tensors must be CUDA and dense (a host tensor of shape "
                                   f"{tuple(t.shape)}, {t.dtype}, is not device memory; NCCL refuses it)")

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._device_only("allreduce", tensors)
        return self._gloo.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._device_only("broadcast", tensors)
        return self._gloo.broadcast(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._device_only("reduce", tensors)
        return self._gloo.reduce(tensors, opts)

    def allgather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], opts: Any = None) -> Any:
        self._device_only("allgather", outs, ins)
        return self._gloo.allgather(outs, ins, opts)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        self._device_only("all_gather_into_tensor", out, inp)
        return self._gloo._allgather_base(out, inp, opts)

    _allgather_base = all_gather_single  # the older name

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        self._device_only("reduce_scatter_tensor", out, inp)
        return self._gloo._reduce_scatter_base(out, inp, opts)

    _reduce_scatter_base = reduce_scatter_single  # the older name

    def barrier(self, opts: Any = None) -> Any:
        return self._gloo.barrier(opts)  # NCCL's is a collective on a device tensor of its own making

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME


def register() -> None:
    """Make "tiermem_strict" a backend `init_process_group` knows (once per process)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, StrictGroup, devices=["cpu"])
