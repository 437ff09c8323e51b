"""Unit: a wrapped group of parameters with its partition; binds parameter storage in and out.

While a unit is acquired, each of its parameters' `.data` is a view of the partition on the compute
device; otherwise it is an empty placeholder of the right dtype and device, so a use outside the hooks
fails loudly (a shape error) instead of computing with stale numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from tiermem.distributed import Gathering, Ranks, finish_gather, start_gather
from tiermem.quant import CompressedWeight, Quantization
from tiermem.swap import Layout, Partition, Tier


class Unit:
    """One unit of the model at run time. With several ranks its partition holds this rank's chunk of each
    parameter, and `whole` lays the unit out whole (see [Note: sharding] in tiermem/distributed.py)."""

    def __init__(self, index: int, name: str, params: list[tuple[str, nn.Parameter]], partition: Partition,
                 device: torch.device, ranks: Ranks | None = None, whole: Layout | None = None,
                 quant: Quantization | None = None,
                 at_use: dict[str, list[tuple[nn.Module, str]]] | None = None) -> None:
        self.index = index
        self.name = name
        self.params = params  # (FQN, Parameter): the Parameter objects the model and optimizers hold
        self.partition = partition
        self.ranks = ranks if ranks is not None else Ranks()
        self.whole = whole if whole is not None else partition.layout  # the unit's tensors, whole
        self.quant = quant  # how the partition stores compressed weights (see [Note: compressed weights]), or None
        # compressed weights left compressed while bound: FQN -> the (module, attribute) places that hold it,
        # each given a CompressedWeight (see [Note: expanded where used]); None: the unit is expanded whole
        self.at_use = at_use
        self.depth = 0  # nested acquisitions in progress (a unit's modules may call each other)
        dtypes = {slot.name: slot.dtype for slot in self.whole.slots}  # compute dtype (params.dtype)
        self.dtypes = [dtypes[fqn] for fqn, _ in params]  # each parameter's, for its CompressedWeight
        self.placeholders = [torch.empty(0, dtype=dtypes[fqn], device=device) for fqn, _ in params]
        self.shapes = [tuple(p.shape) for _, p in params]  # the real shapes, for restoring and errors
        self.orig = [(p.dtype, p.device) for _, p in params]  # dtype and device to restore on exit

    @property
    def nbytes(self) -> int:
        return self.partition.size

    def gather(self, mine: torch.Tensor, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit whole, gathered now (see `start_gather` and `finish_gather`)."""
        return self.finish_gather(self.start_gather(mine), out)

    def start_gather(self, mine: torch.Tensor) -> Gathering:
        """Start gathering the unit whole from this rank's partition `mine` (its flat bytes on the device) and
        every other rank's."""
        return start_gather(self.ranks, mine, self.partition.layout)

    def finish_gather(self, g: Gathering, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """Wait for `g` and write the unit whole into `out` (`whole.size` bytes on the same device): its
        tensors by name."""
        finish_gather(self.ranks, g, self.partition.layout, self.whole, out)
        return self.whole.views(out)

    def expand(self, stored: dict[str, torch.Tensor], out: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit in its compute dtype in `out` (`whole.size` bytes on the partition's device), from the
        compressed partition's tensors `stored` (see [Note: compressed weights] in tiermem/quant.py)."""
        assert self.quant is not None
        tensors = self.whole.views(out)
        with torch.no_grad():
            for fqn, t in tensors.items():
                if f"{fqn}#q" in stored:
                    self.quant.dequantize_into(stored[f"{fqn}#q"], stored[f"{fqn}#scale"], t)
                else:
                    t.copy_(stored[fqn])
        return tensors

    def keep_chunks(self) -> None:
        """Copy this rank's chunk of each bound (gathered) parameter back into the partition's device views."""
        mine = self.partition.tensors(Tier.DEVICE)
        with torch.no_grad():
            for fqn, p in self.params:
                self.ranks.keep_mine(p.data, mine[fqn])

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point every parameter at its view in the partition (or in the gathered unit). A unit whose weights
        stay compressed (`at_use`), bound from its compressed partition's tensors (not expanded whole):
        each such weight's holders get a CompressedWeight in its place, the other parameters their views."""
        with torch.no_grad():
            for k, (fqn, p) in enumerate(self.params):
                places = self.at_use.get(fqn) if self.at_use is not None and f"{fqn}#q" in tensors else None
                if places is None:
                    p.data = tensors[fqn]
                    continue
                assert self.quant is not None
                w = CompressedWeight(tensors[f"{fqn}#q"], tensors[f"{fqn}#scale"], self.shapes[k], self.dtypes[k],
                                     self.quant)
                for module, attr in places:
                    module._parameters[attr] = w  # type: ignore[assignment]  # until unbind

    def unbind(self) -> None:
        """Point every parameter at its empty placeholder, dropping the last reference to the views, and give
        a weight left compressed its Parameter back in each of its places."""
        with torch.no_grad():
            for (_, p), ph in zip(self.params, self.placeholders, strict=True):
                p.data = ph
        self.restore_places()

    def restore_places(self) -> None:
        """Give each weight left compressed while bound its Parameter back in every module that holds it (also
        at exit, for a unit whose forward was cut short by an interrupt and never released)."""
        if self.at_use is not None:
            for fqn, p in self.params:
                for module, attr in self.at_use.get(fqn, ()):
                    module._parameters[attr] = p

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, {len(self.params)} params, {self.nbytes} bytes)"
