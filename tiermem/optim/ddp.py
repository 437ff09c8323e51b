"""DistributedDataParallel(model) of a model under tiered_offload: the wrapper HF Trainer, accelerate and
torchrun scripts put around the model, kept, with the tiers doing DDP's job.

# [Note: DDP around an offloaded model]
Launched on several processes, HF Trainer and accelerate's `prepare()` wrap the model in
`DistributedDataParallel`, and so do most hand-written torchrun loops. DDP's own machinery cannot run here: it
broadcasts and hooks each parameter, and under tiered_offload a parameter is an empty placeholder between
uses (backward failed with "invalid gradient ... expected shape compatible with [0]"). Nor is it needed: with
N ranks the tiers already keep 1/N of every unit per rank, gather each unit whole to compute, and average
each unit's gradients over the ranks by reduce-scattering them, the mean DDP's all-reduce takes.

So while a context trains a model, `DistributedDataParallel(model)` makes a `TieredDDP`, a DDP subclass
(isinstance checks hold, and `.module` is the model) whose forward calls the model, the tiers' hooks doing
the rest. Of DDP's arguments:
- `process_group` (default: the default group) must be the group the context shards over, and the context
  must be sharded when the group has several ranks: a context entered before `init_process_group` keeps the
  whole model in each rank and averages nothing, so the wrap is refused, naming the order to enter in.
- `device_ids=[d]`: inputs are moved to d before the forward, as DDP moves them; d must be the context's
  compute device.
- `broadcast_buffers` (default on): the model's buffers, which stay resident outside the tiers, are broadcast
  from rank 0 at the wrap (with `init_sync`) and before each forward with gradients enabled, as DDP does.
- `bucket_cap_mb`, `find_unused_parameters`, `gradient_as_bucket_view`, `static_graph`, `check_reduction`,
  `skip_all_reduce_unused_params`, `output_device`, `dim`: they tune or describe DDP's reducer and
  scatter, which do not run; the tiers reduce one unit at a time as its gradients complete. Accepted.
- `mixed_precision`, `device_mesh`, `delay_all_reduce_named_params`, `param_to_hook_all_reduce` change what
  is computed or reduced: refused, naming tiermem's own setting. So are `register_comm_hook` (the tiers'
  reduce-scatter takes no hook) and `join` (uneven inputs: every rank must take part in every gather).
- `zero_grad()` is the model's, which clears the gradients in the tiers (HF Trainer clears them so).
- `no_sync()`, which accumulation calls on every micro-batch but the last, does not defer the reduction:
  the tiers reduce each micro-batch's gradients into their shards as they come (each rank keeps only its
  shard, see "Accumulation reduces every micro-batch" in docs/benchmarks.md), the same sum, rounded once
  per micro-batch.
A DDP made before the context began (a torchrun script wraps its model first) becomes a TieredDDP at its
first forward inside it (`adopt_made`; DDP's own forward failed on the placeholders' empty size). Its reducer
is let go, freeing its buckets (a whole copy of the model's gradients) and its hooks. The same checks apply, to the
attributes it was made with. A wrapper used after its context ended raises: the model is whole in each rank
again, and nothing would average its gradients; wrap it again.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map_only

from tiermem.errors import OffloadError

_ACCEPTED = {"output_device", "dim", "bucket_cap_mb", "find_unused_parameters", "check_reduction",
             "gradient_as_bucket_view", "static_graph", "skip_all_reduce_unused_params"}
_REFUSED = {  # DDP argument -> what to use instead under tiered_offload
    "mixed_precision": "set params.dtype (or use torch.autocast) in the tiers' config instead",
    "device_mesh": "pass the mesh's process group to tiered_offload(..., process_group=...) and leave it out here",
    "delay_all_reduce_named_params": "the tiers reduce each unit as its gradients complete; leave it out",
    "param_to_hook_all_reduce": "the tiers reduce each unit as its gradients complete; leave it out",
}


class TieredDDP(DistributedDataParallel):
    """DistributedDataParallel of a model under tiered_offload: forward calls the model, whose tiers shard it
    and average its gradients over the ranks (see [Note: DDP around an offloaded model])."""

    tm: Any
    compute_on: torch.device | None

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.tm.closed:
            raise OffloadError(f"DistributedDataParallel({type(self.module).__name__}) was made inside a "
                               "tiered_offload context that has ended: nothing averages its gradients any more. "
                               "Wrap the model again (torch's DDP, outside a context) or call it inside one")
        if self.compute_on is not None:
            inputs, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(self.compute_on), (inputs, kwargs))
        if self.broadcast_buffers and torch.is_grad_enabled():
            self._broadcast_buffers()
        return self.module(*inputs, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The model's, which clears the gradients in the tiers (nn.Module's would only clear `.grad`)."""
        self.module.zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Does not defer the reduction: the tiers reduce each micro-batch into their shards as it comes."""
        yield

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise OffloadError("DistributedDataParallel.join() of a model under tiered_offload: uneven inputs are not "
                           "supported, since every rank takes part in gathering every unit; give each rank the "
                           "same number of batches (e.g. DistributedSampler(drop_last=True))")

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise OffloadError("DistributedDataParallel.register_comm_hook() of a model under tiered_offload: the tiers "
                           "reduce-scatter each unit's gradients themselves and take no communication hook; leave "
                           "the hook out (accelerate: no comm_hook in DistributedDataParallelKwargs)")

    def _set_static_graph(self) -> None:
        """A hint for DDP's reducer, which does not run here (HF Trainer calls it for ddp_static_graph)."""

    def _broadcast_buffers(self) -> None:
        for buf in self.module.buffers():
            dist.broadcast(buf, 0, group=self.process_group)


def adopt(ddp: DistributedDataParallel, module: nn.Module, tm: Any, args: tuple[Any, ...],
          kwargs: dict[str, Any], torch_init: Any) -> None:
    """Make `ddp`, being built by DistributedDataParallel(module, *args, **kwargs) while `tm` trains `module`, the
    TieredDDP of it; raise naming the fix where its arguments ask for what the tiers do not do."""
    name = f"DistributedDataParallel({type(module).__name__})"
    _check_class(ddp, module)
    bound = inspect.signature(torch_init).bind(ddp, module, *args, **kwargs)
    given = {k: v for k, v in bound.arguments.items() if k not in ("self", "module")}
    for key, fix in _REFUSED.items():
        if given.get(key) is not None:
            raise OffloadError(f"{name}: {key}= is not supported for a model under tiered_offload: {fix}")
    unknown = sorted(set(given) - _ACCEPTED - set(_REFUSED) - {"device_ids", "process_group", "broadcast_buffers",
                                                               "init_sync"})
    if unknown:
        raise OffloadError(f"{name}: {unknown} are not known to tiermem's DDP wrapper; leave them out")
    if not dist.is_initialized():
        raise OffloadError(f"{name}: torch.distributed is not initialised; call init_process_group (or launch with "
                           "torchrun) before tiered_offload and the wrap, or call the model unwrapped in one process")
    group = given.get("process_group") or dist.distributed_c10d._get_default_group()
    ids = list(given["device_ids"]) if given.get("device_ids") else None
    compute_on = _check_placement(name, tm, group, ids)
    nn.Module.__init__(ddp)
    wrapped: Any = ddp  # DDP's attributes, set as its __init__ sets them, for code that reads them
    wrapped.module = module
    wrapped.broadcast_buffers = bool(given.get("broadcast_buffers", True))
    wrapped.device_ids = ids
    wrapped.output_device, wrapped.dim = given.get("output_device"), given.get("dim", 0)
    wrapped.static_graph = bool(given.get("static_graph", False))
    _become(wrapped, tm, group, compute_on)
    if given.get("init_sync", True) and wrapped.broadcast_buffers:
        wrapped._broadcast_buffers()


def adopt_made(ddp: DistributedDataParallel, tm: Any) -> None:
    """Make `ddp`, a DistributedDataParallel made before `tm` began on its module, the TieredDDP of it, at its
    first forward inside the context (DDP's own forward failed there on the placeholders' size). Its reducer is
    let go: its buckets hold a whole copy of the model's gradients, and its hooks the parameters replaced."""
    module, wrapped = ddp.module, cast(Any, ddp)
    name = f"DistributedDataParallel({type(module).__name__})"
    _check_class(ddp, module)
    if getattr(wrapped, "mixed_precision", None) is not None:
        raise OffloadError(f"{name}: made with mixed_precision=, which is not supported under tiered_offload: "
                           f"{_REFUSED['mixed_precision']}")
    if getattr(wrapped, "_comm_hooks", None) or getattr(wrapped, "_delay_all_reduce_params", None):
        raise OffloadError(f"{name}: made with a communication hook or delayed all-reduce, which the tiers' "
                           "reduce-scatter does not take: wrap the model without them")
    compute_on = _check_placement(name, tm, wrapped.process_group, wrapped.device_ids)
    for attr in ("reducer", "logger"):  # the logger holds the reducer too
        wrapped.__dict__.pop(attr, None)
    _become(wrapped, tm, wrapped.process_group, compute_on)


def _check_class(ddp: DistributedDataParallel, module: nn.Module) -> None:
    if type(ddp) not in (DistributedDataParallel, TieredDDP):
        raise OffloadError(f"{type(ddp).__name__}, a subclass of DistributedDataParallel, of the "
                           f"{type(module).__name__} under tiered_offload: its overrides would meet the tiers' "
                           "placeholders; wrap the model in DistributedDataParallel itself, or call it unwrapped")


def _check_placement(name: str, tm: Any, group: Any, ids: list[Any] | None) -> torch.device | None:
    """Refuse a process group other than the tiers' and a device other than theirs; where to move inputs to."""
    ours = tm.ranks.group or (dist.distributed_c10d._get_default_group() if tm.ranks.sharded else None)
    if ours is None and dist.get_world_size(group) > 1:
        raise OffloadError(f"{name} over {dist.get_world_size(group)} ranks, but the tiered_offload context around the "
                           "model was entered with one (torch.distributed was not initialised then), so each rank "
                           "holds the whole model and nothing would average the gradients: enter the context after "
                           "init_process_group (HF Trainer: after TrainingArguments is made, which initialises it)")
    if ours is not None and group is not ours:
        raise OffloadError(f"{name}: process_group= is not the group the tiered_offload context shards over; pass "
                           "the same group to both (or neither, for the default group)")
    if not ids:
        return None
    compute_on = _device(ids[0])
    if len(ids) != 1 or not _same(compute_on, tm.device):
        raise OffloadError(f"{name}: device_ids={ids}, but the tiers compute on {tm.device}: give device_ids="
                           f"[{tm.device}] (one device, the config's `device`) or leave it out")
    return compute_on


def _become(wrapped: Any, tm: Any, group: Any, compute_on: torch.device | None) -> None:
    wrapped.__class__ = TieredDDP
    wrapped.tm, wrapped.compute_on, wrapped.process_group = tm, compute_on, group
    wrapped.require_backward_grad_sync = wrapped.require_forward_param_sync = True
    wrapped.device, wrapped.device_type = tm.device, tm.device.type


def _device(d: Any) -> torch.device:
    """A DDP device id as a torch.device (an int is an index of the current accelerator, as DDP takes it)."""
    if isinstance(d, int):
        kind = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return torch.device(kind.type if kind is not None else "cuda", d)
    return torch.device(d)


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
