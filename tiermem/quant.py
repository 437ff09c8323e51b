"""Compressed weights on NVMe (`params.storage: int8 | int4`): stored small, dequantized after the read.

# [Note: compressed weights]
For a model larger than memory, inference reads every weight from disk on every pass, so the bytes per
weight set the speed. With `params.storage: int8` each floating parameter of two or more dimensions with
at least `params.group_size` elements is kept as signed 8-bit integers and one float32 scale per group of
`group_size` consecutive elements (in the tensor's flat order: for a linear layer's weight, runs of one
output row's inputs); `int4` packs two 4-bit values per byte. The scale of a group is its largest magnitude
over 127 (int8) or 7 (int4), so a value comes back within half a step, `scale / 2`, of what it was.
Biases, norms and other small or 1-D tensors stay in their own dtype: they are few bytes and sensitive.

A unit's partition then holds, per compressed tensor, `NAME#q` (int8, or uint8 with two values a byte)
and `NAME#scale` (float32), padded to whole groups; `Unit.whole` lays the unit out in the compute dtype.
After the read (`Runtime.enter`), the values are expanded into a buffer of that layout on the device,
counted on its ledger like a gathered unit, and the parameters point into it until the unit is released.
On a CUDA device the expansion is one fused kernel of cupy's when cupy is installed (the `cuda` extra),
else two PyTorch operations; on the CPU it is a copy and an in-place multiply, which measured 3.3 ms for
12.6M elements here against 21 ms for the one-step `int8 * float` (which makes a float copy first).

Compression is for inference only, and it loses precision for good: entry refuses an optimizer, and
refuses `restore=True` (exit could only give the model back rounded weights, not the ones it came with),
so a compressed run is one of a model built on the meta device and streamed from its checkpoint;
`tm.gathered()` and `tm.save_checkpoint()` are refused too. See docs/benchmarks.md for the error it costs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

_LEVELS = {8: 127, 4: 7}  # the largest magnitude a stored value takes


@dataclass(frozen=True)
class Quantization:
    """How compressed weights are stored: `bits` per value (8 or 4) and values per scale (`group`)."""

    bits: int
    group: int

    @classmethod
    def of(cls, storage: str, group: int) -> Quantization | None:
        """The quantization `params.storage` asks for; None for ``full``."""
        return None if storage == "full" else cls(int(storage[3:]), group)

    def applies(self, t: torch.Tensor) -> bool:
        """Whether a parameter is stored compressed: floating, two or more dimensions, one group at least."""
        return t.is_floating_point() and t.dim() >= 2 and t.numel() >= self.group

    def groups(self, numel: int) -> int:
        return -(-numel // self.group)

    def specs(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The partition slots of parameter `name` (meta tensor `t`): its values and its scales."""
        n = self.groups(t.numel()) * self.group
        values = torch.empty(n if self.bits == 8 else n // 2, dtype=torch.int8 if self.bits == 8 else torch.uint8,
                             device="meta")
        return [(f"{name}#q", values), (f"{name}#scale", torch.empty(self.groups(t.numel()), device="meta"))]

    def quantize_into(self, src: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Store `src` (any floating dtype and device) compressed into its slots `values` and `scales`."""
        levels = _LEVELS[self.bits]
        flat = src.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        padded = torch.zeros(self.groups(flat.numel()) * self.group)
        padded[: flat.numel()] = flat
        rows = padded.view(-1, self.group)
        scale = rows.abs().amax(dim=1) / levels
        scale[scale == 0] = 1.0  # an all-zero group: any scale gives zeros back
        q = torch.round(rows / scale[:, None]).clamp_(-levels, levels).to(torch.int8).view(-1)
        scales.copy_(scale)
        if self.bits == 8:
            values.copy_(q)
        else:  # two values a byte, each shifted to 1..15: the first in the low half
            u = (q + 8).to(torch.uint8)
            values.copy_(u[0::2] | (u[1::2] << 4))

    def dequantize_into(self, values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Expand stored `values` and `scales` into `out` (the parameter's shape, compute dtype, same device)."""
        numel, g = out.numel(), self.group
        flat = out.view(-1)
        if out.is_cuda and self.bits == 8 and _cupy() is not None:
            _cupy_dequantize(values, scales, flat, g)
            return
        full = numel // g * g
        if full:
            rows = flat[:full].view(-1, g)
            if self.bits == 8:
                rows.copy_(values[:full].view(-1, g))
            else:  # each byte's halves straight into their places (a third faster than unpacking first)
                pairs = flat[:full].view(-1, 2)
                pairs[:, 0].copy_(values[: full // 2] & 0x0F)
                pairs[:, 1].copy_(values[: full // 2] >> 4)
                rows.sub_(8)
            rows.mul_(scales[: full // g].to(out.dtype)[:, None])
        if full < numel:  # the last, padded group
            tail = values[full:] if self.bits == 8 else _unpack4(values[full // 2 :])
            flat[full:].copy_(tail[: numel - full].to(torch.float32) * scales[-1])


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    """int8 values in -7..7 from bytes that hold two each (see `Quantization.quantize_into`)."""
    out = torch.empty(packed.numel() * 2, dtype=torch.int8, device=packed.device)
    out[0::2] = (packed & 0x0F).to(torch.int8)
    out[1::2] = (packed >> 4).to(torch.int8)
    return out.sub_(8)


@functools.cache
def _cupy() -> Any:
    """cupy, when it is installed and sees a GPU; None otherwise (PyTorch's operations are used instead)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA runtime error: not there to use
        log.debug("cupy is not usable (%s): dequantizing with PyTorch's operations", exc)
        return None
    return cupy


@functools.cache
def _kernel(out_type: str) -> Any:
    cupy = _cupy()
    return cupy.ElementwiseKernel(
        "raw int8 q, raw float32 s, int64 g", f"{out_type} y",
        f"y = ({out_type})((float)q[i] * s[i / g])", f"tiermem_dequantize_int8_{out_type}")


_CUPY_TYPES = {torch.float32: "float32", torch.float16: "float16"}


def _cupy_dequantize(values: torch.Tensor, scales: torch.Tensor, flat: torch.Tensor, group: int) -> None:
    """One fused kernel on PyTorch's current stream: y[i] = q[i] * s[i / group]. bfloat16 (no cupy type)
    goes through float32 and one copy."""
    cupy = _cupy()
    target = flat if flat.dtype in _CUPY_TYPES else torch.empty(flat.numel(), dtype=torch.float32,
                                                                device=flat.device)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(flat.device).cuda_stream):
        # the output is a plain (not raw) argument, so it sets the kernel's size: one thread per value
        _kernel(_CUPY_TYPES[target.dtype])(cupy.asarray(values), cupy.asarray(scales), group, cupy.asarray(target))
    if target is not flat:
        flat.copy_(target)
