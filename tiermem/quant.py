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
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from tiermem.errors import OffloadError

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

    def dequantize_into(self, values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, start: int = 0) -> None:
        """Expand stored `values` and `scales` into `out` (the parameter's shape, compute dtype, same device); with
        `start` (a multiple of the group), only the `out.numel()` values from that one, flat, into `out`."""
        numel, g = out.numel(), self.group
        flat = out.view(-1)
        if start:
            assert start % g == 0, (start, g)
            values, scales = values[start if self.bits == 8 else start // 2:], scales[start // g:]
        if self.bits == 8 and _use_cupy(out):
            try:
                _cupy_dequantize(values, scales, flat, g)
                return
            except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or launch: PyTorch's ops do it
                _cupy_failed(exc)
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
            flat[full:].copy_(tail[: numel - full].to(torch.float32) * scales[full // g])


# [Note: expanded where used]
# On a CUDA device a unit's compressed weights are expanded whole, by one kernel at memory bandwidth, and the
# matrix products then read them. On the CPU, the compute device being the host, the whole expansion writes
# float32 weights (four times the bytes stored) into a buffer of the unit's size, and the products read them
# back: a 1 x 8 forward of GPT-2 medium's shape from int8 spent 0.10 s of its 0.21 s expanding (cProfile),
# against 0.11 s for the whole forward in memory, and the device's ledger had to hold two expanded units (2 x
# 206 MB while the tied embedding computes). So on the CPU a compressed weight held only by nn.Linear,
# nn.Embedding and transformers' Conv1D modules is not expanded at the unit's entry: while the unit is bound,
# those modules hold a `CompressedWeight` in its place (`Unit.bind`), and F.linear, torch.addmm (Conv1D's
# product) and F.embedding on it expand `AT_USE_CHUNK` values at a time into one scratch buffer that stays in
# the core's cache, and multiply from there. A Linear takes a block of output rows at a time (each output still
# one product over the whole input); a Conv1D a block of input rows, added into the output (the sum over the
# input in pieces: the rounding, not the values, may differ from the whole expansion's, so Conv1D takes this
# path in float32 only); an embedding expands only the rows it looks up. Any other use of such a weight (a
# module reading `.weight` itself) gets it expanded whole for that call, so nothing computes wrong; only the
# fast paths avoid the copy; an in-place edit of it is an OffloadError (it would be lost, as edits of a whole
# expansion always were). This is for forwards without gradients (torch.no_grad, inference_mode, generate()) and
# without the CPU's autocast (`expands_at_use_now`): a forward that records gradients would keep every piece it
# multiplied by alive until the backward, outside the budget, and give the weights none; it expands its units
# whole, counted on the ledger, as before. A unit cut short by an interrupt (torch's always-call hooks do not
# see KeyboardInterrupt) has its Parameters put back at exit (`Unit.restore_places`). Measured on that forward,
# alternating fresh processes against the whole expansion: 0.18-0.23 s against 0.25-0.27 s (docs/benchmarks.md).
# The expansion's arithmetic (int8 to float32, times the scale) is the same either way and is most of what is
# left. Other devices expand whole, as before.
AT_USE_CHUNK = 1 << 19  # values expanded at a time: 2 MiB of float32, within one core's L2 cache here
_scratch = threading.local()  # per thread: {(dtype, device): buffer of AT_USE_CHUNK values or more}


def _scratch_for(n: int, dtype: torch.dtype, device: torch.device, saved: bool = False) -> torch.Tensor:
    """`n` values of the thread's scratch buffer; a new tensor when autograd will keep it (`saved`): the next
    piece would overwrite what the backward needs."""
    if saved:
        return torch.empty(n, dtype=dtype, device=device)
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get((dtype, device))
    if buf is None or buf.numel() < n:
        buf = bufs[(dtype, device)] = torch.empty(max(n, AT_USE_CHUNK), dtype=dtype, device=device)
    return buf[:n]


def _saved(x: torch.Tensor) -> bool:
    """Whether a product with `x` keeps its weight for the backward (gradients wanted for `x`)."""
    return torch.is_grad_enabled() and x.requires_grad


class CompressedWeight(torch.Tensor):
    """A compressed weight in a module's place while its unit computes on the CPU: shape, dtype and device of
    the expanded weight, with its stored values and scales (see [Note: expanded where used])."""

    packed: torch.Tensor  # the stored values (int8, or uint8 with two 4-bit values a byte)
    group_scales: torch.Tensor  # a float32 scale per group
    quant: Quantization
    shape_: tuple[int, ...]
    dtype_: torch.dtype
    device_: torch.device

    @staticmethod
    def __new__(cls, values: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                quant: Quantization) -> CompressedWeight:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=values.device)
        t.packed, t.group_scales, t.quant = values, scales, quant
        # kept as plain attributes: each of the tensor's own getters passes through __torch_function__
        t.shape_, t.dtype_, t.device_ = tuple(shape), dtype, values.device
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"CompressedWeight(shape={self.shape_}, dtype={self.dtype_}, int{self.quant.bits})"

    def whole(self) -> torch.Tensor:
        """The weight expanded whole into a new tensor: for the uses no fast path takes."""
        out = torch.empty(self.shape_, dtype=self.dtype_, device=self.device_)
        self.quant.dequantize_into(self.packed, self.group_scales, out)
        return out

    def _pieces(self, n_rows: int, width: int, x: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The weight's rows (`n_rows` of `width` values), expanded a block of them at a time, each block whole
        groups: (first row, end row, the block). The block's memory is reused for the next one unless a product
        with `x` keeps it for the backward."""
        step = self.quant.group // math.gcd(width, self.quant.group)
        rows = max(step, AT_USE_CHUNK // width // step * step)
        for r0 in range(0, n_rows, rows):
            r1 = min(n_rows, r0 + rows)
            w = _scratch_for((r1 - r0) * width, self.dtype_, self.device_, _saved(x))
            self.quant.dequantize_into(self.packed, self.group_scales, w, start=r0 * width)
            yield r0, r1, w.view(r1 - r0, width)

    def as_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, self, bias) for a weight of shape (out, in): a block of whole rows at a time."""
        n_out, n_in = self.shape_
        out: torch.Tensor | None = None
        for r0, r1, w in self._pieces(n_out, n_in, x):
            y = F.linear(x, w, None if bias is None else bias[r0:r1])
            if out is None:
                out = y.new_empty((*y.shape[:-1], n_out))
            out[..., r0:r1] = y
        assert out is not None
        return out

    def as_conv1d(self, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """torch.addmm(bias, x, self) for a weight of shape (in, out), transformers' Conv1D: a block of whole
        rows at a time, each block's product added into the output (the sum over the input dimension in pieces:
        rounding, not values, may differ from one product over the whole weight; float32 only, where that
        rounding is a few float32 steps, not a bfloat16 one per piece)."""
        n_in, n_out = self.shape_
        out: torch.Tensor | None = None
        for r0, r1, w in self._pieces(n_in, n_out, x):
            if out is None:
                out = torch.addmm(bias, x[:, r0:r1], w)
            else:
                out.addmm_(x[:, r0:r1], w)
        assert out is not None
        return out

    def as_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, self) for a weight of shape (entries, width): only the rows looked up."""
        n, width = self.shape_
        g = self.quant.group
        if width % g:
            return F.embedding(ids, self.whole())
        flat = ids.reshape(-1)  # index_select: an id out of range raises, as F.embedding's does
        if self.quant.bits == 8:
            picked = self.packed[: n * width].view(n, width).index_select(0, flat)
        else:  # two values a byte
            picked = _unpack4(self.packed[: n * width // 2].view(n, width // 2).index_select(0, flat).view(-1))
        picked = picked.to(self.dtype_).view(-1, width // g, g)
        scales = self.group_scales[: n * width // g].view(n, width // g).index_select(0, flat)
        picked.mul_(scales.to(self.dtype_)[..., None])
        return picked.view(*ids.shape, width)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fast = _AT_USE.get(func)
        if fast is not None:
            out = fast(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__") or name in _IN_PLACE) and args and \
                type(args[0]) is CompressedWeight:
            raise OffloadError(f"{name}() on a weight that params.storage keeps compressed: such weights are "
                               "read-only while their unit computes (an edit would be lost); use params.storage: "
                               "full to change weights")
        with torch._C.DisableTorchFunctionSubclass():
            if func in _METADATA or name == "__get__":
                return func(*args, **kwargs)  # shape, dtype, device...: the wrapper has them
            args, kwargs = pytree.tree_map_only(CompressedWeight, CompressedWeight.whole, (args, kwargs))
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        # reached only by what passes __torch_function__ by (an operator called from C++): expanded whole
        args, kwargs = pytree.tree_map_only(CompressedWeight, CompressedWeight.whole, (args, kwargs or {}))
        return func(*args, **kwargs)


# The fast paths take the arguments by torch's own names, so keyword calls reach them too.
def _fast_linear(input: Any, weight: Any, bias: Any = None) -> Any:
    if (type(weight) is not CompressedWeight or isinstance(input, CompressedWeight)
            or isinstance(bias, CompressedWeight)):
        return NotImplemented
    return weight.as_linear(input, bias)


def _fast_addmm(input: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1,
                out: Any = None) -> Any:
    if (type(mat2) is not CompressedWeight or isinstance(mat1, CompressedWeight) or isinstance(input, CompressedWeight)
            or beta != 1 or alpha != 1 or out is not None or mat1.dim() != 2 or mat2.dim() != 2
            or mat2.dtype_ is not torch.float32):  # in float32 only: see as_conv1d
        return NotImplemented
    return mat2.as_conv1d(input, mat1)


def _fast_embedding(input: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None,
                    norm_type: Any = 2.0, scale_grad_by_freq: Any = False, sparse: Any = False) -> Any:
    # padding_idx, scale_grad_by_freq and sparse change only gradients; max_norm changes the weight
    if type(weight) is not CompressedWeight or isinstance(input, CompressedWeight) or max_norm is not None:
        return NotImplemented
    return weight.as_embedding(input)


def expands_at_use_now() -> bool:
    """Whether a unit whose products can expand its weights at use does so in this forward: not while it
    records gradients (the weights' own, or its inputs', would keep every piece alive until the backward,
    outside the budget) and not under the CPU's autocast; otherwise it is expanded whole, as elsewhere."""
    return not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def release_scratch() -> None:
    """Drop this thread's scratch buffers (when the context ends)."""
    _scratch.__dict__.pop("bufs", None)


_IN_PLACE = {"__set__", "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
             "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
_AT_USE: dict[Any, Any] = {F.linear: _fast_linear, torch.addmm: _fast_addmm, F.embedding: _fast_embedding}
_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
             torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.element_size,
             torch.Tensor.is_contiguous, torch.Tensor.__hash__, torch.Tensor.__len__, torch.is_floating_point}


def at_use_holders(params: list[tuple[str, nn.Parameter]], holders: dict[int, list[tuple[nn.Module, str]]],
                   quantized: dict[str, torch.dtype]) -> dict[str, list[tuple[nn.Module, str]]] | None:
    """For a unit whose compressed parameters `quantized` (FQN -> compute dtype) are each held only by modules
    whose products expand at use (see [Note: expanded where used]), each one's holders (module, attribute);
    else None."""
    out: dict[str, list[tuple[nn.Module, str]]] = {}
    for fqn, p in params:
        if fqn not in quantized:
            continue
        mods = holders.get(id(p), [])
        if not mods or not all(_expands_at_use(m, attr, quantized[fqn]) for m, attr in mods):
            return None
        out[fqn] = mods
    return out or None


def _expands_at_use(module: nn.Module, attr: str, dtype: torch.dtype) -> bool:
    """Whether `module` uses its parameter `attr` (computed in `dtype`) only through a product that expands
    at use."""
    if attr != "weight":
        return False
    kind = type(module)
    if kind is nn.Linear:
        return True
    if kind is nn.Embedding:
        return module.max_norm is None  # max_norm renormalises the rows it looks up, in the weight itself
    # transformers' Conv1D (GPT-2 and kin): forward is torch.addmm(bias, x, weight) with weight (in, out);
    # summed in pieces, so in float32 only (see CompressedWeight.as_conv1d)
    return (kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers.")
            and dtype is torch.float32)


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


_CUPY_FAILED: list[str] = []  # why cupy's kernel failed once (then PyTorch's operations expand for good)


def _use_cupy(out: torch.Tensor) -> bool:
    """Whether cupy's fused kernel expands into `out`: a CUDA tensor, cupy usable, and no failure of it yet."""
    return out.is_cuda and not _CUPY_FAILED and _cupy() is not None


def _cupy_failed(exc: BaseException) -> None:
    """cupy's kernel failed to compile or launch: warn once, and expand with PyTorch's operations from now on."""
    if not _CUPY_FAILED:
        log.warning("cupy's dequantizing kernel failed (%s: %s); expanding compressed weights with PyTorch's "
                    "operations instead (slower; check cupy matches this CUDA: pip install cupy-cuda12x or 13x)",
                    type(exc).__name__, exc)
    _CUPY_FAILED.append(f"{type(exc).__name__}: {exc}")


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
