"""How a group of tensors packs into one flat partition: names, dtypes, shapes and byte offsets."""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

import torch

from tiermem.io.buffers import align_up

TENSOR_ALIGN = 64  # each tensor starts on a cache line, so any dtype view and SIMD kernel is aligned


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in a partition."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The slots of a partition in order, and its total size (4 KiB-aligned for O_DIRECT)."""

    slots: tuple[TensorSlot, ...]
    nbytes: int  # bytes of data, up to the end of the last tensor
    size: int  # nbytes rounded up to 4 KiB: what the host buffer and swap extent hold

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, torch.Tensor]]) -> Layout:
        slots, offset, seen = [], 0, set()
        for name, t in tensors:
            if name in seen:
                raise ValueError(f"tensor name {name!r} appears twice in one partition")
            seen.add(name)
            offset = align_up(offset, TENSOR_ALIGN)
            nbytes = t.numel() * t.element_size()
            slots.append(TensorSlot(name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += nbytes
        return cls(tuple(slots), offset, align_up(max(offset, 1)))

    def outside(self, names: Container[str]) -> list[tuple[int, int]]:
        """The byte ranges [start, end) of the partition (all `size` bytes) that no tensor in `names` covers:
        the gaps between tensors, the padding at the end, and the tensors not named."""
        out, pos = [], 0
        for s in self.slots:  # by offset
            if s.name in names:
                if s.offset > pos:
                    out.append((pos, s.offset))
                pos = s.offset + s.nbytes
        if pos < self.size:
            out.append((pos, self.size))
        return out

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors viewing the flat uint8 storage `flat` (no copies), by name."""
        out = {}
        for s in self.slots:
            piece = flat[s.offset : s.offset + s.nbytes]
            out[s.name] = piece.view(s.dtype).view(s.shape)
        return out
