"""Unit: a wrapped group of parameters with its partition; binds parameter storage in and out.

While a unit is acquired, each of its parameters' `.data` is a view of the partition on the compute
device; otherwise it is an empty placeholder of the right dtype and device, so a use outside the hooks
fails loudly (a shape error) instead of computing with stale numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from tiermem.swap import Partition


class Unit:
    """One unit of the model at run time."""

    def __init__(self, index: int, name: str, params: list[tuple[str, nn.Parameter]], partition: Partition,
                 device: torch.device) -> None:
        self.index = index
        self.name = name
        self.params = params  # (FQN, Parameter): the Parameter objects the model and optimizers hold
        self.partition = partition
        self.depth = 0  # nested acquisitions in progress (a unit's modules may call each other)
        dtypes = {slot.name: slot.dtype for slot in partition.layout.slots}  # storage dtype (params.dtype)
        self.placeholders = [torch.empty(0, dtype=dtypes[fqn], device=device) for fqn, _ in params]
        self.shapes = [tuple(p.shape) for _, p in params]  # the real shapes, for restoring and errors
        self.orig = [(p.dtype, p.device) for _, p in params]  # dtype and device to restore on exit

    @property
    def nbytes(self) -> int:
        return self.partition.size

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point every parameter at its view in the partition."""
        with torch.no_grad():
            for fqn, p in self.params:
                p.data = tensors[fqn]

    def unbind(self) -> None:
        """Point every parameter at its empty placeholder, dropping the last reference to the views."""
        with torch.no_grad():
            for (_, p), ph in zip(self.params, self.placeholders, strict=True):
                p.data = ph

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, {len(self.params)} params, {self.nbytes} bytes)"
