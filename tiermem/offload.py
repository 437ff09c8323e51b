"""`tiered_offload`: the public entry point. Wraps any nn.Module so its parameters live in tiers.

Example::

    import tiermem
    model = build_model()                      # any nn.Module, e.g. a transformers model
    with tiermem.tiered_offload(model, "configs/nvme.yaml") as tm:
        out = model(input_ids)                 # ordinary PyTorch code, unchanged
        ids = model.generate(input_ids, max_new_tokens=20)
        print(tm.stats())
    # on exit the parameters are ordinary tensors again (same Parameter objects, same values)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from tiermem import rescue
from tiermem.checkpointing import CheckpointContents, load_checkpoint, save_checkpoint
from tiermem.config import Config, load_config
from tiermem.cpu_allocator import cpu_allocator, trim
from tiermem.device import resolve_device
from tiermem.distributed import Ranks, chunk_specs
from tiermem.errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    OffloadError,
    RestoreError,
    StoreError,
    TiermemError,
)
from tiermem.interrupts import deferred_interrupts
from tiermem.io.bandwidth import path_weights
from tiermem.io.engine import IOEngine
from tiermem.optim import TieredOptimizer, loop_helpers, unsupported
from tiermem.quant import Quantization, at_use_holders, release_scratch
from tiermem.runtime.runtime import Runtime
from tiermem.runtime.safetensors_io import SafetensorsCheckpoint
from tiermem.runtime.sources import WeightSources
from tiermem.runtime.unit import Unit
from tiermem.runtime.wrap import UnitPlan, WrapPlan, dtype_of, plan_units
from tiermem.sizes import format_size
from tiermem.swap import Layout, TensorSwapper, Tier
from tiermem.swap.transfers import make_mover, mover_class
from tiermem.trace import Tracer

log = logging.getLogger(__name__)


class _PlanHandler(logging.StreamHandler):
    """Shows the plan line on stderr in a program that has not configured logging (most training scripts):
    where the root logger has handlers, the record goes to them instead, as every other record does."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


# What went where, once at entry on rank 0; silenced by logging.getLogger("tiermem.plan").setLevel(logging.WARNING).
plan_log = logging.getLogger("tiermem.plan")
plan_log.setLevel(logging.INFO)
_plan_handler = _PlanHandler()
_plan_handler.setFormatter(logging.Formatter("tiermem: %(message)s"))
plan_log.addHandler(_plan_handler)

_ATTR = "_tiermem_offload"  # set on a model while it is inside tiered_offload


def _refuse_deepcopy(memo: dict[int, Any]) -> None:
    """A module's `__deepcopy__` while it is inside tiered_offload."""
    raise OffloadError("copy.deepcopy() of a module inside tiered_offload: its parameters are placeholders whose "
                       "values live in tiermem's tiers, so a copy would hold none of them. Copy the model before "
                       "entering the context or after it ends; inside it, model.state_dict() and "
                       "tm.save_checkpoint(dir) give the values")


def _guarded_apply(handle: OffloadHandle, mod: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                   recurse: bool = True) -> nn.Module:
    """A module's `_apply` (what .to(), .half(), .float(), .cuda(), .share_memory() ... call) while it is inside
    tiered_offload: one that would change its parameters' dtype or device is refused before it touches any;
    one that leaves them as they are runs as ever (the HF Trainer's model.to(args.device) on the device
    already in use)."""
    kinds = {(ph.dtype, ph.device) for u in handle.runtime.units for ph in u.placeholders}
    for dtype, device in sorted(kinds, key=str):
        probe = torch.empty(0, dtype=dtype, device=device)
        out = fn(probe)
        if isinstance(out, torch.Tensor) and (out.dtype != dtype or out.device != device):
            raise OffloadError(
                f"{type(mod).__name__}.to() / .half() / .float() / .cuda() inside tiered_offload would make its "
                f"parameters {out.dtype} on {out.device}; they are {dtype} on {device} and live in tiermem's tiers, "
                "so they would be left as empty placeholders and the model broken after exit. To compute in "
                "another dtype set params.dtype in the config (float32 master weights are kept); the compute "
                "device is the config's `device`; or convert the model before entering tiered_offload or after "
                "it ends")
    return type(mod)._apply(mod, fn, recurse)


# [Note: master weights are the values]
# With params.dtype bfloat16 or float16 and an optimizer, the optimizer keeps float32 master weights of every
# trainable parameter and steps them; the stored parameters are their rounding, made for compute. Everything
# that hands the weights to the user gives the masters, in the model's own dtype: model.state_dict() inside
# the context, the model after exit, and tm.save_checkpoint() (whose weights are then float32, as the model
# came in, so from_pretrained returns a float32 model and a resume loses nothing). model.load_state_dict()
# inside the context writes both. To save the compute dtype instead, convert after exit:
# model.to(torch.bfloat16).save_pretrained(dir). Frozen parameters have no masters: they are their rounding.
# The masters start from the stored parameters, already rounded, as when training a model saved in that dtype
# (docs/config.md, params.dtype): a context left without a step gives back the rounding.
# With several ranks each rank keeps chunks of the masters: state_dict() and exit give the rounding there,
# and model.load_state_dict() is refused (tm.save_checkpoint / tm.load_checkpoint carry the masters).


def masters_of(optimizer: TieredOptimizer | None, swapper: TensorSwapper, unit: Unit) -> dict[str, torch.Tensor]:
    """Copies of the float32 master weights the optimizer keeps for `unit`'s trainable parameters when
    params.dtype is bfloat16 or float16, by FQN, in their shapes: the values training arrived at, of which the
    stored parameters are a rounding ([Note: master weights are the values]). Empty when there are none, and
    with several ranks (each holds chunks of them)."""
    st = optimizer.by_unit.get(unit.index) if optimizer is not None and optimizer.mixed else None
    if st is None or st.state is None or not st.trainable or unit.ranks.sharded:
        return {}
    shapes = dict(zip((fqn for fqn, _ in unit.params), unit.shapes, strict=True))
    views = swapper.acquire(st.state, Tier.HOST)
    try:
        return {fqn: views[f"master.{fqn}"].reshape(shapes[fqn]).clone() for fqn, _, _ in st.trainable}
    finally:
        swapper.release(st.state, tier=Tier.HOST)


def _load_masters(optimizer: TieredOptimizer, swapper: TensorSwapper, unit: Unit,
                  values: Mapping[str, torch.Tensor]) -> None:
    """Write `values` (by FQN) into the float32 master weights of `unit`'s trainable parameters."""
    st = optimizer.by_unit.get(unit.index)
    if st is None or st.state is None:
        return
    views = swapper.acquire(st.state, Tier.HOST)
    try:
        for fqn, _, _ in st.trainable:
            if fqn in values:
                view = views[f"master.{fqn}"]
                view.copy_(values[fqn].detach().reshape(view.shape))
    finally:
        swapper.release(st.state, dirty=True, tier=Tier.HOST)


def _read_unfetched(handle: OffloadHandle, exc: BaseException) -> OffloadError | None:
    """For PyTorch's error from a forward that read parameters of a submodule it did not call (a parent using
    `self.head.weight` directly), which tiermem had not fetched: an OffloadError naming them, the module that
    read them and the fix. None for any other error."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, TiermemError):
        return None
    names = {id(m): name for name, m in handle.model.named_modules()}
    tb, innermost = exc.__traceback__, None
    while tb is not None:  # the innermost frame of one of the model's modules: where the read happened
        frame_self = tb.tb_frame.f_locals.get("self")
        if isinstance(frame_self, nn.Module) and id(frame_self) in names:
            innermost = frame_self
        tb = tb.tb_next
    if innermost is None:
        return None
    ran = handle.runtime.ran_this_pass()  # submodules it called ran and were let go: not what it read
    empty = [fqn for fqn, p in innermost.named_parameters()
             if id(p) in handle._unit_of and p.numel() == 0 and handle._unit_of[id(p)] not in ran]
    if not empty:
        return None
    where = names[id(innermost)]
    prefix = f"{where}." if where else ""
    shown = ", ".join(prefix + fqn for fqn in empty[:4]) + (f" and {len(empty) - 4} more" if len(empty) > 4 else "")
    kind = type(innermost).__name__
    fix = (f"for other reads, make {kind} and what it reads one unit with wrap.classes: [{kind}] in the config"
           if innermost is not handle.model else "write the read so, or call the submodule rather than reading its "
           "weight")
    return OffloadError(
        f"{kind} ({where or 'the model'}) used a parameter of a submodule it did not call in this forward (one of "
        f"{shown}): tiermem fetches a unit's parameters only while its module runs, and outside that they are "
        f"empty placeholders (PyTorch said: {exc}). tiermem finds reads written as self.<submodule>.<parameter> "
        f"in a forward's source and fetches them; {fix}")


def _refused_weights(model: nn.Module) -> str | None:
    """Why the model's weights cannot go into tiers, with the fix; None when they can."""
    for name, p in model.named_parameters():
        kind = type(p)
        if kind.__name__ == "Params4bit" and kind.__module__.startswith("bitsandbytes"):
            return (f"parameter {name!r} is a bitsandbytes 4-bit weight (load_in_4bit / QLoRA): tiermem cannot hold it "
                    "exactly (its quantisation state lives beside the tensor, and training from the tiers diverged "
                    "from the same steps in memory), so it is refused rather than run wrong. Load the base model in "
                    "bfloat16 (torch_dtype=torch.bfloat16; tiermem keeps what does not fit on NVMe, which is what "
                    "4-bit saved memory for) or in 8-bit (load_in_8bit, which runs exactly), and train the LoRA "
                    "adapters as before")
    return None


class OffloadHandle:
    """What `with tiered_offload(...) as tm` yields: statistics and controls of the running offload."""

    def __init__(self, model: nn.Module, swapper: TensorSwapper, runtime: Runtime,
                 optimizer: TieredOptimizer | None = None) -> None:
        self.model = model
        self.swapper = swapper
        self.runtime = runtime
        self.config: Config = swapper.config
        self.optimizer = optimizer  # the stand-in for the optimizer passed in (None when not training)
        self._unit_of: dict[int, int] = {}  # id(parameter) -> the unit holding it
        # units held by a load_state_dict under way, with the values for their master weights
        self._loading: list[tuple[nn.Module, list[int], dict[str, torch.Tensor]]] = []
        self._taking_part = False  # model.state_dict() gathers for another rank's and keeps nothing
        # the state dict a model.state_dict() call is filling, and the copies made for it, by id(parameter)
        self._copies: tuple[Callable[[], Any], weakref.WeakValueDictionary[int, torch.Tensor], set[int]] = (
            lambda: None, weakref.WeakValueDictionary(), set())
        self.closed = False  # the context has ended: the parameters are ordinary tensors again, the swap is gone
        self.saved: tuple[str, int] | None = None  # (path, optimizer progress) of the last checkpoint written
        self.plan: dict[str, Any] = {}  # what goes where and why, as entry chose it (logged at entry)
        self.activations_why = "activations.tier"  # why saved activations rest where they do (auto's reason)
        self.weights_why = "nvme.path_weights"  # why several nvme.paths are striped as they are (auto's reason)
        self._tracer: Tracer | None = None  # recording a trace (trace.path or tm.trace())
        self.ranks = Ranks()  # the ranks it shards over (set at entry)
        self.left_on: BaseException | None = None  # what the with-block raised

    def plan_summary(self) -> str:
        """`plan` in one line: what goes where and why (as logged at entry)."""
        return _plan_text(self.plan)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise OffloadError(f"{what} after the tiered_offload context has ended; call it inside the `with` block")

    def save_checkpoint(self, path: str | os.PathLike[str], max_shard_bytes: int = 1 << 30, *,
                        adapters_only: bool = False) -> str:
        """Write weights (sharded safetensors + index, readable by transformers' from_pretrained), buffers and
        optimizer state to `path`, streaming unit by unit; atomic (temporary directory, then rename).

        With ``adapters_only=True`` (a PEFT model), write only its active adapter in PEFT's own format
        (adapter_model.safetensors and adapter_config.json), for ``PeftModel.from_pretrained(base, path)``."""
        self._check_open("save_checkpoint")
        if torch._C._current_graph_task_id() != -1:  # a hook, or a signal handler that ran in one, in backward
            raise CheckpointError(
                "tm.save_checkpoint() cannot run inside a backward pass (here from a hook or from a signal handler "
                "that ran during it): the backward holds units and gradient accumulators that a save reads and "
                "writes. Nothing was saved. Set a flag there instead and save after the step, e.g. a SIGTERM "
                "handler sets `stop = True`, and the loop, after optimizer.step(), calls tm.save_checkpoint(path) "
                "when `stop` is set")
        self._check_whole("tm.save_checkpoint()")
        if self.optimizer is not None:
            self.optimizer.flush()  # what step() recorded is part of the weights and state saved
        final, written = save_checkpoint(self._contents(), path, max_shard_bytes, adapters_only=adapters_only)
        self.runtime.checkpoint_bytes_written += written
        if not adapters_only:
            self.saved = (final, self.optimizer.progress() if self.optimizer is not None else 0)
        return final

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load what `save_checkpoint` wrote (weights, buffers, optimizer state and steps)."""
        self._check_open("load_checkpoint")
        if torch._C._current_graph_task_id() != -1:  # as in save_checkpoint
            raise CheckpointError("tm.load_checkpoint() cannot run inside a backward pass (here from a hook or from "
                                  "a signal handler that ran during it): the backward holds units and gradient "
                                  "accumulators the load would replace. Nothing was loaded. Load before the "
                                  "forward, or after the step")
        if self.optimizer is not None:
            self.optimizer.drop_pending()  # the loaded weights and state replace what a step recorded
        self.runtime.checkpoint_bytes_read += load_checkpoint(self._contents(), path)

    def _contents(self) -> CheckpointContents:
        return CheckpointContents(self.model, self.units, self.swapper, self.optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the dynamic loss scale applied when parameters are float16 (else the same)."""
        self._check_open("tm.backward")
        if self.optimizer is None:
            loss.backward()
            return
        self.optimizer.loss_scale.scaling_next = True  # the backward's first hook notes it (`backward_began`)
        try:
            self.optimizer.scale_loss(loss).backward()
        finally:
            self.optimizer.loss_scale.scaling_next = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every gradient, wherever it lives; returns the total norm."""
        self._check_open("tm.clip_grad_norm_")
        if self.optimizer is None:
            raise OffloadError("clip_grad_norm_ needs the optimizer: tiered_offload(model, config, optimizer=opt)")
        return self.optimizer.clip_grad_norm_(max_norm, norm_type)

    @property
    def units(self) -> list[Unit]:
        return self.runtime.units

    @property
    def device(self) -> torch.device:
        """The compute device (the config's `device` resolved): put the model's inputs here."""
        return self.swapper.device

    def stats(self) -> dict[str, Any]:
        """Counters since entry or the last `reset_stats()`.

        Keys: ``peak_bytes`` ({'device', 'host', 'nvme'}), ``now_bytes`` (same keys), ``bytes_read``,
        ``bytes_written``, ``stall_seconds`` (time forward waited for parameters), ``update_wait_seconds``
        (time the optimizer's updates waited for their state, gradients and parameters to be read, wherever they
        ran: a recorded update's when its unit is entered is not in ``stall_seconds``), ``prefetch_hits``,
        ``prefetch_misses``, ``schedule_misses`` (acquisitions that were not the unit the recorded order
        predicted), ``retraces`` (times the execution order was recorded again), ``passes``
        (top-level forwards), ``units`` (how many), ``largest_unit_bytes`` and ``resident_bytes`` (units kept in
        host memory between passes, see ``prefetch.keep_resident``), ``evictions``, ``bytes_moved`` (copied within
        the host pool to join free pieces a partition needed in one) and ``device_budget`` (the cap
        on the device's working set: memory.device_budget, or the one derived from the prefetch settings when
        that is null; None on a device whose memory is the host's). With ``activations.tier: nvme`` also
        ``activations_saved_bytes``, ``activations_kept_bytes``, ``activations_in_memory_bytes`` (kept there by
        activations.keep), ``activations_stall_seconds``, ``activations_peak_host_bytes``,
        ``activations_bytes_written``, ``activations_bytes_read`` and ``activations_unwritten_bytes`` (sent, but
        found in memory by backward and never written). ``checkpoint_bytes_read``: what entry read
        from ``checkpoint=`` and ``load_checkpoint`` read, checking included (with several ranks each rank
        reads about 1/N; not reset); ``checkpoint_bytes_written``: the tensors' bytes ``save_checkpoint`` wrote
        (with several ranks sharing a filesystem each rank writes its chunks, about 1/N; not reset). The
        activations live in the same host cache as the parameters, so their bytes are also in ``bytes_read``,
        ``bytes_written`` and the ``host`` entries (``peak_bytes['host']`` is at most the host budget). With
        several ranks (zero otherwise): ``gathered_bytes`` (received by all-gathers), ``gather_wait_seconds``
        (waited for them: the part compute did not hide), ``gathers_ahead`` (gathers started while the unit
        before computed), ``reduced_bytes`` and ``reduce_seconds`` (gradients' reduce-scatters). With ``kv.tier``
        other than memory also ``kv_bytes`` and ``kv_peak_bytes`` (blocks of tiered KV caches), ``kv_host_home_bytes``
        and ``kv_nvme_home_bytes`` (by home), ``kv_bytes_read`` and ``kv_bytes_written`` (to and from NVMe; also in
        ``bytes_read``/``bytes_written``) and ``kv_stall_seconds`` (updates waiting for blocks).
        """
        s = self.swapper.stats()
        rt = self.runtime
        act = rt.activations.stats() if rt.activations is not None else {}
        peak, now = dict(s.ledger.peak), dict(s.ledger.now)
        return {
            "peak_bytes": peak,
            "now_bytes": now,
            "bytes_read": s.bytes_read,
            "bytes_written": s.bytes_written,
            "stall_seconds": rt.stall_seconds,
            "update_wait_seconds": rt.optimizer.wait_seconds if rt.optimizer is not None else 0.0,
            "prefetch_hits": rt.prefetch_hits,
            "prefetch_misses": rt.prefetch_misses,
            "schedule_misses": rt.schedule.misses,
            "retraces": rt.schedule.retraces,
            "passes": rt.passes,
            "units": len(rt.units),
            "largest_unit_bytes": max((u.nbytes for u in rt.units), default=0),
            "resident_bytes": rt.resident_bytes,
            "evictions": s.evictions,
            "bytes_moved": s.bytes_moved,
            "device_budget": self.swapper.device_cap,
            "checkpoint_bytes_read": rt.checkpoint_bytes_read,
            "checkpoint_bytes_written": rt.checkpoint_bytes_written,
            **act,
            **(rt.kv.stats() if rt.kv is not None else {}),
            **(dataclasses.asdict(rt.units[0].ranks.traffic) if rt.units else {}),
        }

    def kv_cache(self) -> Any:
        """A transformers DynamicCache for this model whose keys and values rest where kv.tier says (see [Note:
        tiered KV cache] in tiermem/runtime/kv_cache.py); with kv.tier memory, transformers' own.

        generate() and a forward given a cache no forward has filled get one without it; pass it explicitly to
        keep it, e.g. to go on from a prompt: ``cache = tm.kv_cache(); model(ids, cache=cache, use_cache=True)``.
        """
        self._check_open("tm.kv_cache()")
        config = getattr(self.model, "config", None)
        if self.runtime.kv is None:
            from transformers import DynamicCache

            return DynamicCache(config=config) if config is not None else DynamicCache()
        return self.runtime.kv.new_cache(config)

    def reset_stats(self) -> None:
        """Start a new measuring window (peaks restart from what is held now)."""
        self.swapper.reset_stats()
        self.runtime.reset_stats()
        if self.units:
            self.units[0].ranks.traffic.reset()

    @contextmanager
    def trace(self, path: str | os.PathLike[str]) -> Iterator[Tracer]:
        """Record a timeline of the block (see [Note: traces] in tiermem/trace.py) and write it to `path` as a
        Chrome trace / Perfetto JSON file when the block ends, also when it raises."""
        self._check_open("tm.trace()")
        if self._tracer is not None:
            raise OffloadError("tm.trace(): a trace is already being recorded (trace.path or an enclosing "
                               "tm.trace()); record one at a time")
        tracer = Tracer(self.config.to_dict())
        self._set_tracer(tracer)
        try:
            yield tracer
        finally:
            self._set_tracer(None)
            self._settle_transfers()  # the transfers the block started end in its trace
            try:
                tracer.write(path)
            except OSError as exc:
                raise OffloadError(f"tm.trace(): could not write the trace to {os.fspath(path)}: {exc}; pass a "
                                   "writable file path") from exc

    def _settle_transfers(self) -> None:
        for part in list(self.swapper.partitions.values()):
            self.swapper.wait_idle(part)

    def _set_tracer(self, tracer: Tracer | None) -> None:
        self._tracer = tracer
        self.swapper.cache.tracer = self.runtime.tracer = tracer
        if self.optimizer is not None:
            self.optimizer.tracer = tracer

    def _check_whole(self, what: str) -> None:
        """Refuse `what` when the weights are stored compressed: it would write or edit rounded weights."""
        if self.config.params.storage != "full":
            raise OffloadError(f"{what}: params.storage is {self.config.params.storage}, so only rounded weights are "
                               "kept (see tiermem/quant.py); use params.storage: full to save or edit them")

    def _state_dict_hook(self, module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        """model.state_dict() inside the context (a post-hook on each module holding parameters): each of its
        own parameters' entries, a placeholder of no elements while it lives in its tiers, becomes a copy in
        host memory of its value, pending updates applied, read unit by unit. Without it torch.save of the
        state_dict wrote empty tensors."""
        if self.closed:
            return
        mine = [(prefix + name, p) for name, p in module._parameters.items()
                if p is not None and id(p) in self._unit_of and prefix + name in state]
        if not mine:
            return
        self._check_whole("model.state_dict()")
        if self._copies[0]() is not state:  # a new state_dict() call
            self._copies = (weakref.ref(state), weakref.WeakValueDictionary(), set())
        _, copies, seen = self._copies
        for key, p in mine:  # a tied parameter (lm_head's, wte's) is one tensor under both names, as in memory,
            if id(p) in copies:  # so save_pretrained finds the tie and saves it once
                state[key] = copies[id(p)]
        mine = [(key, p) for key, p in mine if id(p) not in seen]  # each rank gathers the same units
        seen.update(id(p) for _, p in mine)
        for i in dict.fromkeys(self._unit_of[id(p)] for _, p in mine):
            self.runtime.hold([i])
            try:
                unit = self.units[i]
                masters = masters_of(self.optimizer, self.swapper, unit)  # float32, as the model came in
                fqn_of = {id(p): fqn for fqn, p in unit.params}
                for key, p in mine:
                    if self._unit_of[id(p)] == i and not self._taking_part:
                        value = masters.get(fqn_of[id(p)])
                        state[key] = copies[id(p)] = value if value is not None else p.detach().to("cpu", copy=True)
            finally:
                self.runtime.let_go([i])

    def take_part_in_state_dict(self) -> None:
        """With several ranks, take part in the gathers of another rank's `model.state_dict()`, keeping nothing:
        for code that calls it on one rank only (HF Trainer's checkpoints; see [Note: torch's loop helpers
        inside the context])."""
        self._taking_part = True
        try:
            self.model.state_dict()
        finally:
            self._taking_part = False

    def _load_state_dict_pre_hook(self, module: nn.Module, state: Mapping[str, Any], prefix: str,
                                  *_rest: Any) -> None:
        """model.load_state_dict() inside the context (a pre-hook on each module holding parameters): the units of
        the module's own parameters it loads are held, so that torch copies into their values; its post-hook
        writes them back (`_load_state_dict_post_hook`). Before, torch found placeholders of no elements."""
        if self.closed:
            return
        held = sorted({self._unit_of[id(p)] for name, p in module._parameters.items()
                       if p is not None and id(p) in self._unit_of and prefix + name in state})
        if not held:
            return
        self._check_whole("model.load_state_dict()")
        masters: dict[str, torch.Tensor] = {}
        if self.optimizer is not None and self.optimizer.mixed:  # the values go into the float32 masters too
            if self.ranks.sharded:
                raise OffloadError(f"model.load_state_dict(): params.dtype is {self.config.params.dtype} and the "
                                   "parameters are sharded over ranks, so the optimizer keeps chunks of float32 "
                                   "master weights that loading cannot reach; load the weights before entering "
                                   "tiered_offload, or use tm.load_checkpoint(dir)")
            fqn_of = {id(p): fqn for i in held for fqn, p in self.units[i].params}
            masters = {fqn_of[id(p)]: state[prefix + name] for name, p in module._parameters.items()
                       if p is not None and id(p) in fqn_of and prefix + name in state}
        self.runtime.hold(held)
        self._loading.append((module, held, masters))

    def _load_state_dict_post_hook(self, module: nn.Module, _incompatible: Any) -> None:
        for k, (m, held, masters) in enumerate(self._loading):
            if m is module:
                del self._loading[k]
                self.runtime.let_go(held, dirty=True)
                if masters and self.optimizer is not None:
                    for i in held:
                        _load_masters(self.optimizer, self.swapper, self.units[i], masters)
                return

    def _release_loading(self) -> None:
        """What a load_state_dict that raised midway still holds, written back."""
        while self._loading:
            self.runtime.let_go(self._loading.pop()[1], dirty=True)

    @contextmanager
    def gathered(self, *modules: nn.Module) -> Iterator[None]:
        """Make the parameters of `modules` (default: the whole model) real tensors for a block of code
        outside forward, e.g. to inspect or edit weights; edits are kept (written back as needed)."""
        self._check_open("tm.gathered()")
        self._check_whole("tm.gathered()")
        wanted = modules or (self.model,)
        ids = {id(p) for m in wanted for p in m.parameters()}
        indices = [u.index for u in self.units if any(id(p) in ids for _, p in u.params)]
        self.runtime.hold(indices)
        try:
            yield
        finally:
            self.runtime.let_go(indices, dirty=True)


@contextmanager
def tiered_offload(model: nn.Module, config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
                   checkpoint: str | os.PathLike[str] | None = None, restore: bool = True, prefetch: bool = True,
                   engine: IOEngine | None = None, optimizer: torch.optim.Optimizer | None = None,
                   restore_optimizer: bool = False, init_missing: str | Sequence[str] | None = None,
                   init_seed: int | None = None, process_group: Any = None,
                   **overrides: Any) -> Iterator[OffloadHandle]:
    """Run `model` with its parameters in tiers (device, host, NVMe) as the config says.

    Args:
        model: any nn.Module (a transformers model included), on the CPU or the meta device.
        config: a swap-config: YAML path, dict, Config or None (defaults); see docs/config.md.
        checkpoint: a .safetensors file or *.safetensors.index.json to stream the weights from, for a
            model built on the meta device (one too large for host RAM). Tensors are read one unit at
            a time straight into swap. Names are matched as transformers and PEFT rename them (a
            ``base_model_prefix``, PEFT's ``base_model.model.`` and ``.base_layer``).
        init_missing: meta parameters the checkpoint does not have (new LoRA adapters, a new head) that may
            be initialised as their module would, on the CPU unit by unit: ``"missing"`` for all, or fnmatch
            patterns of names (``["*.lora_*", "classifier.*"]``). Default None: each one is an error.
        init_seed: seed of the draws those initialisers make (default: torch's global generator, as
            ``from_pretrained`` uses); see [Note: weight sources] in tiermem/runtime/sources.py.
        process_group: the torch.distributed group to shard over (default: the default group once
            torch.distributed is initialised, e.g. under torchrun). With N ranks each keeps 1/N of every
            parameter, gradient and optimizer state in its own tiers; see [Note: sharding] in
            tiermem/distributed.py. Every rank enters with the same model and config.
        restore: on exit, make the parameters ordinary tensors again (same Parameter objects, same
            values). False leaves them on the meta device (for a model too large to hold in RAM).
        prefetch: False turns off execution-order prefetch (every unit is read when needed).
        engine: an I/O engine to share instead of building one from the io.* settings.
        optimizer: a torch.optim optimizer built on the model's parameters (AdamW, Adam, SGD, or another
            elementwise one: `SUPPORTED_OPTIMIZERS` in tiermem/optim/optimizer.py), to train: gradients
            then leave the device unit by unit and the state lives in optimizer.tier; use `tm.optimizer`
            (calling the original's step()/zero_grad() inside the context does the same).
        restore_optimizer: on exit, also copy the optimizer state into `optimizer` (in host memory, so
            training can go on outside). Off by default: that state is often larger than RAM, and leaving
            must never need more memory than the parameters. To keep it, call ``tm.save_checkpoint(dir)``
            inside the context, or save ``optimizer.state_dict()`` there (inside, the original's
            state_dict() and load_state_dict() are the tiers') and load it after. With several ranks every
            rank gets the whole state, gathered from all of them (not after the with-block raised).
        **overrides: dotted config keys, e.g. ``**{"prefetch.depth": 4}`` or ``prefetch__depth=4``.

    Yields:
        an OffloadHandle (`tm`): ``stats()``, ``reset_stats()``, ``gathered()``, and for training
        ``optimizer``, ``backward(loss)``, ``clip_grad_norm_()``, ``save_checkpoint()``, ``load_checkpoint()``.
    """
    _check_model(model, optimizer)
    entry = _Entry(model, optimizer, restore=restore, restore_optimizer=restore_optimizer)
    entry.settle(config, overrides, process_group)
    try:
        entry.open(engine)
        handle = entry.place(checkpoint, prefetch, init_missing, init_seed)
        entry.attach()
        try:
            yield handle
        except BaseException as exc:
            raise entry.left_on(exc)  # noqa: B904 - it is `exc` itself, or an error naming it as its cause
    finally:
        entry.leave()


def _check_model(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse, before anything is made, a model or optimizer tiered_offload cannot take, naming the fix."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise OffloadError(f"{type(model).__name__}: tiered_offload was given the DDP wrapper; pass the model "
                           "itself, tiered_offload(ddp.module, ...), and go on calling the wrapper (inside the context "
                           "the tiers do its job: see [Note: DDP around an offloaded model] in tiermem/optim/ddp.py)")
    if getattr(model, _ATTR, None) is not None:
        what = "is" if getattr(model, _ATTR).model is model else "belongs to a model that is"
        raise OffloadError(f"{type(model).__name__} {what} already inside tiered_offload; exit that context before "
                           "entering another on it")
    for name, mod in model.named_modules():
        if getattr(mod, _ATTR, None) is not None:
            raise OffloadError(f"submodule {name!r} of {type(model).__name__} is already inside tiered_offload; "
                               "offload the whole model once instead")
    refused = unsupported(optimizer) or _refused_weights(model)
    if refused is not None:
        raise OffloadError(refused)


class _Entry:
    """Entering tiered_offload and leaving it, as named steps. In: `settle` (the ranks, and the config with its
    `auto` values settled), `open` (the swap and tiermem's CPU allocator), `place` (the model into its units:
    from here on, leaving gives the parameters back), `attach` (what makes the model's and the user's code act
    on the tiers). Out, in `leave`: the recorded updates applied, then `detach`, `give_back` and `close`, each
    undoing one step of the way in, each run whatever the one before it raised."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, restore: bool,
                 restore_optimizer: bool) -> None:
        self.model, self.optimizer = model, optimizer
        self.restore, self.restore_optimizer = restore, restore_optimizer
        self.ranks = Ranks()
        self.config = Config()
        self.whys = ("activations.tier", "nvme.path_weights")  # why auto settled as it did
        self.swapper: TensorSwapper | None = None
        self.allocator = ExitStack()
        self.handle: OffloadHandle | None = None
        self.patched: dict[str, Any] = {}  # the optimizer's methods `attach` replaced
        self.zero_grads: dict[nn.Module, Any] | None = None  # the modules' own zero_grad `attach` replaced
        self.state_hooks: list[Any] = []
        self.own_load: Any = None  # a load_state_dict set on the model before entry
        self.raised = False  # the with-block raised: with several ranks, leaving cannot count on the others

    # -- in ---------------------------------------------------------------------------------------------
    def settle(self, config: Config | Mapping[str, Any] | str | os.PathLike[str] | None, overrides: Mapping[str, Any],
               process_group: Any) -> None:
        """The ranks of this entry, and the config as it will run: the ranks' paths, the compute device's mover
        for the collectives ([Note: collectives on NCCL]), `auto` settled (activations.tier before the swapper:
        with nvme, the activations' buffer is carved out of the host pool it makes; nvme.path_weights), and the
        storage checked."""
        ranks = Ranks.of(process_group).for_entry()
        cfg = _rank_paths(load_config(config, **overrides), ranks)
        _report_old_rescues(cfg, ranks)
        ranks = ranks.on_device(make_mover(resolve_device(cfg.device)))
        cfg, activations_why = _choose_activations_tier(cfg, self.model, self.optimizer, ranks)
        cfg, weights_why = choose_path_weights(cfg)
        _check_storage(cfg, self.optimizer, self.restore, ranks)
        self.ranks, self.config, self.whys = ranks, cfg, (activations_why, weights_why)

    def open(self, engine: IOEngine | None) -> None:
        """The swap (its pool registered once the parameters are in their partitions), the ranks' agreement on
        the config and the model, and tiermem's CPU allocator, before the model is placed so the compute's
        tensors from the first step on use it (tiermem/cpu_allocator.py)."""
        swapper = self.swapper = TensorSwapper(self.config, engine=engine)
        swapper.defer_registration = True  # until the parameters are in their partitions (_place_model)
        if self.ranks.sharded:
            settings = dataclasses.asdict(swapper.config)
            settings["nvme"].pop("paths", None)  # each rank may have drives of its own
            settings["nvme"].pop("path_weights", None)  # and weigh them by their own speeds
            settings["trace"].pop("path", None)  # and a trace of its own
            settings.pop("origin", None)  # where the config came from, which names the paths too
            self.ranks.check_same("the config", repr(settings))
            self.ranks.check_same("the model's parameters (names, shapes, dtypes)",
                                  repr([(n, tuple(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()]))
        self.allocator.enter_context(cpu_allocator(swapper.config.memory.cpu_allocator))

    def place(self, checkpoint: str | os.PathLike[str] | None, prefetch: bool,
              init_missing: str | Sequence[str] | None, init_seed: int | None) -> OffloadHandle:
        """The model's parameters into their units' partitions, and the handle: from here on, leaving gives
        the parameters back."""
        assert self.swapper is not None
        runtime = _place_model(self.model, self.swapper, checkpoint, prefetch, self.optimizer, init_missing,
                               init_seed, self.ranks)
        handle = self.handle = OffloadHandle(self.model, self.swapper, runtime)
        handle.ranks = self.ranks
        handle.activations_why, handle.weights_why = self.whys
        handle._unit_of = {id(p): u.index for u in runtime.units for _, p in u.params}
        return handle

    def attach(self) -> None:
        """Mark the model's modules (none may enter another context), refuse copies and conversions of those
        holding placeholders, route state_dict, load_state_dict and zero_grad through the tiers, make the
        optimizer the tiers' ([Note: torch's loop helpers inside the context]), register the runtime's hooks,
        and say what went where."""
        handle, model, optimizer = self.handle, self.model, self.optimizer
        assert handle is not None
        runtime = handle.runtime
        for mod in model.modules():
            setattr(mod, _ATTR, handle)
            if any(id(p) in handle._unit_of for p in mod.parameters()):  # a copy of one would hold no value
                mod.__dict__["__deepcopy__"] = _refuse_deepcopy  # copy.deepcopy() looks on the instance first
                mod.__dict__["_apply"] = functools.partial(_guarded_apply, handle, mod)
        owners = {id(m): m for m in model.modules() for p in m._parameters.values() if p is not None
                  and id(p) in handle._unit_of}
        for m in owners.values():  # (partials: torch marks a state_dict hook with an attribute)
            self.state_hooks += [
                m.register_state_dict_post_hook(functools.partial(OffloadHandle._state_dict_hook, handle)),
                m.register_load_state_dict_pre_hook(handle._load_state_dict_pre_hook),
                m.register_load_state_dict_post_hook(handle._load_state_dict_post_hook)]
        self.own_load = model.__dict__.get("load_state_dict")
        model.load_state_dict = functools.partial(_load_state_dict, handle, self.own_load)  # type: ignore[method-assign]
        if optimizer is not None:
            override = dtype_of(handle.config.params.dtype)
            handle.optimizer = TieredOptimizer(optimizer, runtime.units, handle.swapper,
                                               mixed=override not in (None, torch.float32),
                                               loss_scaling=override is torch.float16,
                                               on_record=runtime.prefetch_pending, model_order=model.parameters())
            runtime.optimizer = handle.optimizer
            self.patched = _delegate(optimizer, handle.optimizer)
            self.zero_grads = _delegate_zero_grad(handle)
        loop_helpers.enter(handle)  # see [Note: torch's loop helpers inside the context]
        runtime.register_hooks()
        handle.reset_stats()
        if optimizer is not None and getattr(getattr(model, "config", None), "use_cache", None) is True:
            log.warning("%s.config.use_cache is True: its forward keeps every layer's keys and values until it "
                        "returns, for a cache that training never reads; set model.config.use_cache = False to "
                        "train in less memory", type(model).__name__)
        handle.plan = _plan(handle)
        (plan_log.info if self.ranks.rank == 0 else log.debug)("tiered_offload plan: %s", handle.plan_summary())
        if handle.config.trace.path is not None:
            handle._set_tracer(Tracer(handle.config.to_dict()))  # written when the context ends

    def left_on(self, exc: BaseException) -> BaseException:
        """The with-block raised `exc`: note it, tell the other ranks (their waits end with it named), and
        return what to raise: `exc`, or an error naming a parameter read without being fetched."""
        self.raised = True
        unfetched = None
        if self.handle is not None:
            self.handle.left_on = exc
            unfetched = _read_unfetched(self.handle, exc)
        if self.ranks.sharded:
            self.ranks.announce(unfetched or exc)
        if unfetched is not None:
            unfetched.__cause__, unfetched.__suppress_context__ = exc, True  # as `raise unfetched from exc`
            return unfetched
        return exc

    # -- out --------------------------------------------------------------------------------------------
    def leave(self) -> None:
        """Out of the context, whatever happened in it: each step runs whatever the one before raised."""
        try:
            if self.handle is not None:
                with deferred_interrupts():  # a second Ctrl-C must not leave the model half given back
                    unapplied = _apply_recorded_updates(self.handle)
                    try:
                        self.detach()
                    finally:
                        self.give_back(unapplied)
        finally:
            with deferred_interrupts():  # a Ctrl-C inside the swap's close would leave the engine's threads running
                self.close()

    def detach(self) -> None:
        """Undo `attach`: the runtime's hooks, the optimizer's and the modules' methods, the loop helpers, the
        state_dict hooks, the marks and guards; the handle is closed."""
        handle, model = self.handle, self.model
        assert handle is not None
        try:
            handle.runtime.remove_hooks()
            _undelegate(self.optimizer, self.patched)
            loop_helpers.leave(handle)
            if self.zero_grads is not None:
                _undelegate_zero_grad(model, self.zero_grads)
            for hook in self.state_hooks:
                hook.remove()
            model.__dict__.pop("load_state_dict", None)
            if self.own_load is not None:
                model.load_state_dict = self.own_load  # type: ignore[method-assign]
        finally:
            handle.closed = True
            for mod in model.modules():
                if getattr(mod, _ATTR, None) is handle:
                    delattr(mod, _ATTR)
                if mod.__dict__.get("__deepcopy__") is _refuse_deepcopy:
                    del mod.__dict__["__deepcopy__"]
                guard = mod.__dict__.get("_apply")
                if isinstance(guard, functools.partial) and guard.func is _guarded_apply:
                    del mod.__dict__["_apply"]

    def give_back(self, unapplied: Exception | None) -> None:
        """Undo `place`: the optimizer's state copied out when asked (else a warning if it stays behind), the
        parameters given back (or, after an error under several ranks, each rank's share rescued), the trace
        written; then an update that could not be applied is raised."""
        handle, optimizer = self.handle, self.optimizer
        assert handle is not None
        kept_state = None
        gathers = not (self.raised and self.ranks.sharded)  # gathering needs every rank
        if self.restore_optimizer and handle.optimizer is not None and optimizer is not None and gathers:
            # read from its tiers now, loaded once the parameters are back: the original optimizer casts state
            # to its parameters' dtype, which params.dtype changes inside
            kept_state = handle.optimizer.state_dict()
        elif (handle.optimizer is not None and handle.optimizer.has_state() and gathers  # else rescued
              and (handle.saved is None or handle.saved[1] != handle.optimizer.progress())):
            log.warning("leaving tiered_offload: the optimizer state stays behind (it lives in optimizer.tier and "
                        "goes with the swap files); save it inside the context with tm.save_checkpoint(dir), or "
                        "pass restore_optimizer=True to copy it into the optimizer on exit%s",
                        f" (the last checkpoint, {handle.saved[0]}, is older)" if handle.saved is not None else "")
        try:
            _unpack(handle, self.restore, self.raised)
        finally:
            if kept_state is not None and optimizer is not None:
                optimizer.load_state_dict(kept_state)  # training goes on outside
        _write_trace(handle, self.raised)
        if unapplied is not None and not self.raised:
            raise unapplied

    def close(self) -> None:
        """Undo `open`: the swap, then the CPU allocator."""
        try:
            if self.swapper is not None:
                self.swapper.close()
        finally:
            self.allocator.close()


# -- entry ------------------------------------------------------------------------------------------
def _write_trace(handle: OffloadHandle, raised: bool) -> None:
    """Write the trace that trace.path asked for (see [Note: traces]); after an error in the with-block a
    failure to write it is logged, not raised over that error."""
    tracer, path = handle._tracer, handle.config.trace.path
    if tracer is None or path is None:
        return
    handle._set_tracer(None)
    handle._settle_transfers()
    try:
        log.info("trace written to %s (open it in ui.perfetto.dev)", tracer.write(path))
    except OSError as exc:
        error = OffloadError(f"trace.path: could not write the trace to {path}: {exc}; point trace.path at a "
                             "writable file")
        if not raised:
            raise error from exc
        log.error("%s", error)


def _apply_recorded_updates(handle: OffloadHandle) -> Exception | None:
    """The updates `step()` recorded and no forward applied yet (see [Note: lazy update]) belong to the
    weights given back and the state kept. A failure is logged and returned, to be raised once the
    parameters have been given back.

    No gradient is given back at exit, so each unit's accumulators go as soon as its update has used them
    (as after zero_grad), and the rest after: kept (no zero_grad since the last step), they were scattered
    through the host pool, and the update of a large unit, then the parameters read back, found no piece
    of it large enough (the last step's update lost, the last units left on the meta device)."""
    opt = handle.optimizer
    if opt is None:
        return None
    opt.zero_grad()
    try:
        if opt.has_pending():
            opt.flush()
    except Exception as exc:  # noqa: BLE001 - raised after the restore
        log.error("leaving tiered_offload: the last step's update could not be applied to every unit (%s); the "
                  "units it did not reach are given back as they were before that step", exc)
        return exc
    finally:
        opt.drop_accumulators()
    return None


# [Note: activations auto]
# `activations.tier: auto` (the default) is settled at entry, before the host pool is made (with nvme,
# activations.buffer is carved out of it), into `memory` or `nvme`, and the config then says which; the
# plan line gives the reason. Saved activations kept in memory are autograd's, outside memory.host_budget,
# so they are what a step holds beyond it; the estimate of a step's, made before any batch is seen, is the
# parameters' bytes in the compute dtype (a transformer's reach its parameters' size at a few hundred
# tokens per step: GPT-2 small saves 0.29 GB at 2 x 128 tokens, for 0.5 GB of fp32 weights). They go to
# NVMe only when all of these hold:
# - there is an optimizer (a training step saves activations; without one, nvme would only take
#   activations.buffer from the host budget);
# - another tier is already on NVMe (a config that uses none gets no swap files for activations);
# - activations.buffer is at most a quarter of memory.host_budget (the rest stays for the partitions);
# - the estimate is more than the share a step may hold beside the budget, a quarter of memory.host_budget
#   (at most ACTIVATIONS_BESIDE_BUDGET_MAX on the CPU), or than the host memory left beside the budget
#   (`_host_memory_available` less memory.host_budget): kept in memory, they would take the process well
#   past the budget the user set, or past what the machine or its cgroup gives it.
# Picking nvme, auto also sets activations.keep (unless set) to that share, where the machine has twice
# it beside the budget, else 0: the newest activations, which backward needs first, stay in memory up to
# that, and only the rest is read and written. The cap keeps the share a fixed slack above large budgets
# where the activations would be in host memory (the CPU computing): a quarter of 1.25 GiB kept beside it
# took the training bench's steps to 1.71 GB above its imports, past the budget + 300 MB of issue 14
# (docs/benchmarks.md). On a device with memory of its own (CUDA, or the copying test device standing for
# one) autograd keeps them there, outside host memory, and the share is a quarter of the budget.
# With several ranks the choice is one for all (their configs must be the same): nvme if any rank's
# memory calls for it, keeping the least any rank keeps. An explicit `memory` or `nvme` is kept as set.


ACTIVATIONS_BESIDE_BUDGET_MAX = 128 * 1024**2
"""The most saved activations `activations.tier: auto` lets a step hold in host memory beside
memory.host_budget, with the CPU computing: a quarter of the budget, at most this ([Note: activations auto])."""


def choose_path_weights(cfg: Config) -> tuple[Config, str]:
    """Settle `nvme.path_weights: auto` into weights ([Note: path weights]); the config and the reason."""
    if cfg.nvme.path_weights != "auto":
        return cfg, "nvme.path_weights"
    weights, why = path_weights(cfg.nvme.paths, "auto")
    return load_config(cfg, **{"nvme.path_weights": list(weights)}), why


def _host_memory_available() -> int | None:
    """Bytes of host memory this process could still take now: MemAvailable of /proc/meminfo, or less where
    its cgroup (v2) caps it (memory.max less memory.current); None where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if rel is not None:
            base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as f:
                    found.append(max(0, int(limit) - int(f.read())))
    except (OSError, ValueError, IndexError):
        pass
    return min(found) if found else None


def _choose_activations_tier(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                             ranks: Ranks) -> tuple[Config, str]:
    """`cfg` with activations.tier (and, when auto picks nvme, activations.keep) settled, and why (see
    [Note: activations auto])."""
    if cfg.activations.tier != "auto":
        return cfg, "activations.tier"
    nvme, keep, why = _activations_auto(cfg, model, optimizer)
    if ranks.sharded:
        anyone, least = ranks.all_reduce(torch.tensor([float(nvme), float(-keep)]), "max").tolist()
        if anyone and not nvme:
            why = "auto: another rank's host memory cannot hold a step's activations"
        nvme, keep = bool(anyone), int(-least)  # one choice for all, and the least any rank keeps
    settled: dict[str, Any] = {"activations.tier": "nvme" if nvme else "memory"}
    if nvme and cfg.activations.keep is None:
        settled["activations.keep"] = keep
    return load_config(cfg, **settled), why


def _activations_auto(cfg: Config, model: nn.Module,
                      optimizer: torch.optim.Optimizer | None) -> tuple[bool, int, str]:
    """Whether `auto` sends saved activations to NVMe on this rank, the bytes of each forward's it keeps in
    memory then, and why."""
    budget, buffer = cfg.memory.host_budget, cfg.activations.buffer
    if optimizer is None:
        return False, 0, "auto: no optimizer, no training step"
    if "nvme" not in (cfg.params.tier, cfg.optimizer.tier, cfg.grads.tier):
        return False, 0, "auto: no other tier is on nvme"
    if 4 * buffer > budget:
        return False, 0, (f"auto: activations.buffer ({format_size(buffer)}) is more than a quarter of "
                          f"memory.host_budget ({format_size(budget)})")
    override = dtype_of(cfg.params.dtype)
    need = sum(p.numel() * (override or p.dtype).itemsize for p in model.parameters())
    available = _host_memory_available()
    left = available - budget if available is not None else None
    share = budget // 4  # what a step may hold beside the budget
    if not mover_class(resolve_device(cfg.device)).has_own_memory:  # kept activations are in host memory
        share = min(share, ACTIVATIONS_BESIDE_BUDGET_MAX)
    taken = f"a step's activations, taken as the parameters' {format_size(need)}"
    keep = share if left is None or left >= 2 * share else 0  # what stays in memory if they go to nvme
    if left is not None and left < need:
        return True, keep, (f"auto: {format_size(max(left, 0))} of host memory beside the budget is less than "
                            f"{taken}")
    if need > share:
        return True, keep, (f"auto: {taken}, are more than the {format_size(share)} a step may hold beside "
                            f"memory.host_budget; activations.tier: memory keeps them all in memory")
    return False, 0, (f"auto: {taken}, fit in the {format_size(share)} a step may hold beside "
                      f"memory.host_budget")


def _rank_paths(cfg: Config, ranks: Ranks) -> Config:
    """nvme.paths and trace.path with ``{rank}`` and ``{local_rank}`` filled in (LOCAL_RANK as torchrun sets
    it), so that one config gives each rank, or each GPU's rank on a machine, drives and a trace of its own:
    ``/mnt/nvme{local_rank}``."""
    local = int(os.environ.get("LOCAL_RANK", ranks.rank))

    def fill(key: str, paths: list[str]) -> list[str]:
        try:
            return [p.format(rank=ranks.rank, local_rank=local) for p in paths]
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"{key}: {paths!r} has a placeholder other than {{rank}} and {{local_rank}} "
                              f"({exc})") from None

    changes: dict[str, Any] = {}
    if any("{" in p for p in cfg.nvme.paths):
        changes["nvme.paths"] = fill("nvme.paths", list(cfg.nvme.paths))
    if cfg.trace.path is not None and "{" in cfg.trace.path:
        changes["trace.path"] = fill("trace.path", [cfg.trace.path])[0]
    return load_config(cfg, **changes) if changes else cfg


def _plan(handle: OffloadHandle) -> dict[str, Any]:
    """The memory plan entry made: bytes and tier of each kind of state, and the host pool's split."""
    cfg, units, opt = handle.config, handle.units, handle.optimizer
    plan: dict[str, Any] = {
        "units": len(units), "device": str(handle.device),
        "params": {"bytes": sum(u.partition.size for u in units), "tier": cfg.params.tier,
                   "largest_unit_bytes": max((u.partition.size for u in units), default=0)},
        "activations": {"tier": cfg.activations.tier, "host_bytes": cfg.activations.host_bytes,
                        "keep_bytes": (cfg.activations.keep or 0) if cfg.activations.tier == "nvme" else 0,
                        "why": handle.activations_why},
        "host_budget": handle.swapper.pool.nbytes,
    }
    if opt is not None:
        plan["grads"] = {"bytes": sum(st.grads.size for st in opt.units), "tier": opt.grads_tier,
                         "why": opt.grads_why}
        plan["optimizer_state"] = {"bytes": sum(st.state.size for st in opt.units if st.state is not None),
                                   "tier": cfg.optimizer.tier}
        plan["host_kept_bytes"], plan["host_step_bytes"] = opt.host_permanent, opt.host_working
    if cfg.uses_nvme:
        plan["nvme_paths"] = list(cfg.nvme.paths)
        if len(cfg.nvme.paths) > 1:
            plan["nvme_weights"] = {"weights": list(cfg.nvme.path_weights), "why": handle.weights_why}
    return plan


def _plan_text(plan: dict[str, Any]) -> str:
    """The plan in one line, e.g. "6 units on cpu; params 1.2 GiB on nvme (largest unit 96 MiB); ..."."""
    def where(key: str) -> str:
        entry = plan[key]
        return f"{format_size(entry['bytes'])} on {entry['tier']}"

    parts = [f"{plan['units']} units on {plan['device']}",
             f"params {where('params')} (largest unit {format_size(plan['params']['largest_unit_bytes'])})"]
    if "grads" in plan:
        parts.append(f"grads {where('grads')} ({plan['grads']['why']})")
        parts.append(f"optimizer state {where('optimizer_state')}")
    act = plan["activations"]
    extra = [act["why"]] if act.get("why", "activations.tier") != "activations.tier" else []
    if act["host_bytes"]:
        extra.append(f"{format_size(act['host_bytes'])} of the host budget")
    if act.get("keep_bytes"):
        extra.append(f"the newest {format_size(act['keep_bytes'])} of each forward's kept in memory")
    parts.append(f"activations in {act['tier']}" + (f" ({'; '.join(extra)})" if extra else ""))
    pool = f"host budget {format_size(plan['host_budget'])}"
    if "host_kept_bytes" in plan:
        pool += (f": {format_size(plan['host_kept_bytes'])} kept for good, {format_size(plan['host_step_bytes'])} "
                 "for a unit's step")
    parts.append(pool)
    if "nvme_paths" in plan:
        swap = f"swap in {', '.join(plan['nvme_paths'])}"
        if "nvme_weights" in plan:
            w = plan["nvme_weights"]
            swap += f" (striped {':'.join(map(str, w['weights']))}, {w['why']})"
        parts.append(swap)
    return "; ".join(parts)


_DELEGATED = ("step", "zero_grad", "state_dict", "load_state_dict")


def _delegate(original: torch.optim.Optimizer, tiered: TieredOptimizer) -> dict[str, Any]:
    """Make the original optimizer's step, zero_grad, state_dict and load_state_dict tm.optimizer's; return what
    to put back.

    A learning-rate scheduler wraps `optimizer.step` when it is made, to note each call (`_opt_called`), and a
    step marked `_wrapped_by_lr_sched` it leaves as it is. The step put in place does the noting itself and
    carries the mark: a scheduler made before the context then does not warn that step() was replaced, and one
    made inside it (as HF Trainer makes its own in train()) does not wrap the tiers' step, which it would call
    as a method of the original optimizer. Step hooks registered on the original run around it.

    state_dict()/load_state_dict() are the tiers' as well: the state lives there, so the original's would save
    none (HF Trainer saves `optimizer.state_dict()` in its checkpoints) and load into a state no step reads;
    and torch's load_state_dict would replace the param-group dicts the tiers share (accelerate's prepare()
    round-trips the optimizer through it)."""
    saved: dict[str, Any] = {n: original.__dict__[n] for n in _DELEGATED if n in original.__dict__}

    def step(*args: Any, **kwargs: Any) -> Any:
        original._opt_called = True  # type: ignore[attr-defined]  # what a scheduler's own wrapper notes
        # hooks registered on the original (register_step_pre_hook / _post_hook), called as torch calls them;
        # torch's global ones are called by tm.optimizer's own step
        for pre in list(original._optimizer_step_pre_hooks.values()):
            changed = pre(original, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        out = tiered.step(*args, **kwargs)
        for post in list(original._optimizer_step_post_hooks.values()):
            post(original, args, kwargs)
        return out

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    original.step = step  # type: ignore[method-assign]
    original.zero_grad = tiered.zero_grad  # type: ignore[method-assign]
    original.state_dict = tiered.state_dict  # type: ignore[method-assign]
    original.load_state_dict = tiered.load_state_dict  # type: ignore[method-assign]
    return saved


def _undelegate(original: torch.optim.Optimizer | None, saved: dict[str, Any]) -> None:
    if original is None:
        return
    for name in _DELEGATED:
        original.__dict__.pop(name, None)
        if name in saved:
            setattr(original, name, saved[name])


def _load_state_dict(handle: OffloadHandle, own: Any, state_dict: Mapping[str, Any], strict: bool = True,
                     assign: bool = False) -> Any:
    """model.load_state_dict() inside the context: the model's own (`own`, one set on it before entry, else its
    class's), with the units its hooks held written back also when it raises midway (see
    `OffloadHandle._load_state_dict_pre_hook`). assign=True would put plain tensors in place of the parameters
    the tiers hold, which the optimizer would go on updating unseen: refused."""
    if assign:
        raise OffloadError("model.load_state_dict(assign=True) inside tiered_offload would replace the parameters "
                           "whose values live in the tiers; call it without assign (the values are copied into "
                           "the tiers), or load before entering")
    try:
        if own is not None:
            return own(state_dict, strict=strict)
        return type(handle.model).load_state_dict(handle.model, state_dict, strict=strict)
    finally:
        handle._release_loading()


def _module_zero_grad(handle: OffloadHandle, module: nn.Module, set_to_none: bool = True) -> None:
    """`module.zero_grad()` inside the context: the gradients in the tiers go too (model.zero_grad() is how HF
    code clears them); before, they stayed and the next backward added to them."""
    type(module).zero_grad(module, set_to_none)  # its class's own: .grad of anything not in the tiers
    if handle.optimizer is not None and not handle.closed:
        handle.optimizer.zero_grad_of({id(p) for p in module.parameters()}, set_to_none)


def _delegate_zero_grad(handle: OffloadHandle) -> dict[nn.Module, Any]:
    """Make every module's zero_grad clear its gradients in the tiers; return what to put back."""
    saved = {m: m.__dict__["zero_grad"] for m in handle.model.modules() if "zero_grad" in m.__dict__}
    for m in handle.model.modules():
        m.zero_grad = functools.partial(_module_zero_grad, handle, m)  # type: ignore[method-assign]
    return saved


def _undelegate_zero_grad(model: nn.Module, saved: dict[nn.Module, Any]) -> None:
    for m in model.modules():
        m.__dict__.pop("zero_grad", None)
        if m in saved:
            m.zero_grad = saved[m]  # type: ignore[method-assign]


def _place_model(model: nn.Module, swapper: TensorSwapper, checkpoint: str | os.PathLike[str] | None,
          prefetch: bool, optimizer: torch.optim.Optimizer | None = None,
          init_missing: str | Sequence[str] | None = None, init_seed: int | None = None,
          ranks: Ranks | None = None) -> Runtime:
    cfg = swapper.config
    ckpt = SafetensorsCheckpoint(checkpoint) if checkpoint is not None else None
    tie = getattr(model, "tie_weights", None)
    if ckpt is not None and callable(tie):
        tie()  # as from_pretrained does: a model built empty may not have its ties yet
    plan = plan_units(model, cfg.wrap.classes, cfg.wrap.min_unit_bytes)
    if ckpt is None and init_missing is None:
        meta = [n for n, p in model.named_parameters() if p.is_meta]
        if meta:
            raise OffloadError(f"parameter {meta[0]!r} (and {len(meta) - 1} more) is on the meta device; pass "
                               "checkpoint=PATH to stream its weights, or build the model with real weights")
    sources = WeightSources(model, ckpt, plan.aliases, init_missing, init_seed)
    sources.check({fqn: p for up in plan.units for fqn, p in up.params.items()})
    override = dtype_of(cfg.params.dtype)
    _check_fits(plan, swapper, override)
    if optimizer is not None:  # each param group contiguous in every partition: see [Note: training state per unit]
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        for up in plan.units:
            order = sorted(up.params.items(), key=lambda kv: group_of.get(id(kv[1]), len(group_of)))
            up.params.clear()
            up.params.update(order)
    units: list[Unit] = []
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # id(param) -> (module, attribute) holding it
    for mod in model.modules():
        for pname, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, pname))
    moved: list[tuple[nn.Module, str, torch.device, torch.dtype]] = []
    try:
        try:
            with sources.generator():
                _move_buffers(model, sources, swapper, moved, override)
                for index, up in enumerate(plan.units):
                    units.append(_place_unit(index, up, swapper, sources, override, holders, optimizer,
                                            ranks or Ranks()))
        finally:
            if ckpt is not None:
                ckpt.close()
        if sources.initialised:
            log.info("tiered_offload: initialised %d tensors the checkpoint lacks, as their modules would (e.g. %s)",
                     len(sources.initialised), ", ".join(sources.initialised[:3]))
        swapper.flush()  # every NVMe partition is on disk before the first forward
        trim()  # the model's own parameter memory is free now: give it back (see tiermem/cpu_allocator.py)
        swapper.register_pool()  # only now: registering faults in the whole pool (see TensorSwapper.__init__)
        runtime = Runtime(model, swapper, units, plan.needs, prefetch=prefetch)
    except BaseException as exc:
        with deferred_interrupts():  # give the parameters back before failing: nothing is lost
            _restore_buffers(moved)
            failed = _restore_units(model, units, swapper)
        if failed:
            raise _restore_error(failed, "entering tiered_offload failed and ") from exc
        raise
    runtime.moved_buffers = moved
    runtime.checkpoint_bytes_read = ckpt.bytes_read if ckpt is not None else 0
    return runtime


def _unit_specs(up: UnitPlan, override: torch.dtype | None,
                quant: Quantization | None = None) -> list[tuple[str, torch.Tensor]]:
    """(FQN, meta tensor) for each parameter of a unit, in its compute dtype (params.dtype applied); with
    `quant`, the slots each compressed parameter is stored in instead (see [Note: compressed weights])."""
    out: list[tuple[str, torch.Tensor]] = []
    for fqn, p in up.params.items():
        meta = torch.empty(p.shape, dtype=override if override is not None and p.is_floating_point() else p.dtype,
                           device="meta")
        out.extend(quant.specs(fqn, meta) if quant is not None and quant.applies(meta) else [(fqn, meta)])
    return out


def _quantization(cfg: Config) -> Quantization | None:
    return Quantization.of(cfg.params.storage, cfg.params.group_size)


def _check_storage(cfg: Config, optimizer: torch.optim.Optimizer | None, restore: bool, ranks: Ranks) -> None:
    """Compressed weights are for inference from a checkpoint: refuse what they would silently spoil."""
    storage = cfg.params.storage
    if storage == "full":
        return
    if optimizer is not None:
        raise OffloadError(f"params.storage: {storage} stores weights compressed for inference, and training needs "
                           "them whole; set params.storage: full to train")
    if restore:
        raise OffloadError(f"params.storage: {storage} keeps only rounded weights, so leaving could not give the "
                           "model its own back; pass restore=False (for a model built on the meta device and "
                           "streamed from checkpoint=...), or use params.storage: full")
    if ranks.sharded:
        raise OffloadError(f"params.storage: {storage} is not supported with several ranks yet; use "
                           "params.storage: full")


def _check_fits(plan: WrapPlan, swapper: TensorSwapper, override: torch.dtype | None) -> None:
    """Tiers that hold every parameter in host memory must fit the host budget: say so before placing the model."""
    cfg = swapper.config
    in_host = cfg.params.tier == "cpu" or (cfg.params.tier == "device" and not swapper.mover.has_own_memory)
    if not in_host:
        return
    total = sum(Layout.of(_unit_specs(u, override, _quantization(cfg))).size for u in plan.units)
    if total > swapper.partition_budget:
        raise BudgetError(
            f"params.tier: {cfg.params.tier} keeps every parameter in host memory here, {format_size(total)}, but "
            f"{swapper.budget_text} is smaller; raise memory.host_budget or set "
            "params.tier: nvme"
        )


def _place_unit(index: int, up: UnitPlan, swapper: TensorSwapper, sources: WeightSources,
               override: torch.dtype | None, holders: dict[int, list[tuple[nn.Module, str]]],
               optimizer: torch.optim.Optimizer | None, ranks: Ranks) -> Unit:
    whole = _unit_specs(up, override)
    quant = _quantization(swapper.config)
    stored = _unit_specs(up, override, quant) if quant is not None else whole  # see [Note: compressed weights]
    if len(stored) == len(whole):  # nothing of this unit is compressed (biases, norms): stored as it is
        stored, quant = whole, None
    specs = chunk_specs(ranks, whole) if ranks.sharded else stored  # this rank's share: see [Note: sharding]
    shapes = dict(whole)

    def fill(views: dict[str, torch.Tensor]) -> None:
        """Each tensor from its source: see [Note: weight sources]; with several ranks, this rank's chunk."""
        ckpt = sources.ckpt
        names = {fqn: sources.checkpoint_name(fqn) for fqn in up.params}
        made = sources.initialise([f for f, p in up.params.items() if p.is_meta and names[f] is None])
        for fqn, p in up.params.items():
            name = names[fqn]
            if quant is not None and f"{fqn}#q" in views:  # read whole, then stored compressed
                if ckpt is not None and name is not None:
                    src = torch.empty(shapes[fqn].shape, dtype=shapes[fqn].dtype)
                    ckpt.read_into(swapper.engine, name, src)
                else:
                    src = made[fqn] if fqn in made else p.detach()
                quant.quantize_into(src, views[f"{fqn}#q"], views[f"{fqn}#scale"])
                continue
            if not ranks.sharded:
                if ckpt is not None and name is not None:
                    ckpt.read_into(swapper.engine, name, views[fqn])
                else:
                    views[fqn].copy_(made[fqn] if fqn in made else p.detach())
                continue
            if ckpt is not None and name is not None:  # this rank's chunk only: 1/N of the checkpoint's bytes
                start, end = ranks.my_range(shapes[fqn].numel())
                ckpt.read_range_into(swapper.engine, name, tuple(shapes[fqn].shape), start, views[fqn][: end - start])
            else:
                ranks.keep_mine(made[fqn] if fqn in made else p.detach(), views[fqn])

    part = swapper.add(up.name, specs, home=swapper.config.params.tier, fill=fill, zero=ranks.sharded)
    at_use = None
    if quant is not None and swapper.device.type == "cpu" and not swapper.mover.has_own_memory:
        # the CPU computing from host memory: weights used by products expand at use ([Note: expanded where used])
        dtypes = {fqn: meta.dtype for fqn, meta in whole}
        at_use = at_use_holders(list(up.params.items()), holders,
                                {name[:-2]: dtypes[name[:-2]] for name, _ in stored if name.endswith("#q")})
    unit = Unit(index, up.name, list(up.params.items()), part, swapper.device, ranks,
                Layout.of(whole) if ranks.sharded or quant is not None else None, quant, at_use)
    replaced: dict[int, nn.Parameter] = {}
    for k, (fqn, p) in enumerate(unit.params):
        if p.is_meta:  # a meta tensor cannot take real storage through .data: give it a real Parameter
            real = nn.Parameter(unit.placeholders[k], requires_grad=p.requires_grad)
            for mod, attr in holders.get(id(p), []):
                mod._parameters[attr] = real
            unit.params[k] = (fqn, real)
            replaced[id(p)] = real
    _swap_in_optimizer(optimizer, replaced)  # an optimizer built on the meta model now holds the real ones
    unit.unbind()  # the model's own storage for these parameters is dropped here, unit by unit
    return unit


def _swap_in_optimizer(optimizer: torch.optim.Optimizer | None, replaced: dict[int, nn.Parameter]) -> None:
    """Make `optimizer` hold the new Parameter objects in place of the ones they replaced (by id), in its param
    groups and its state."""
    if optimizer is None or not replaced:
        return
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    for old in [p for p in optimizer.state if id(p) in replaced]:
        optimizer.state[replaced[id(old)]] = optimizer.state.pop(old)


def _move_buffers(model: nn.Module, sources: WeightSources, swapper: TensorSwapper,
                  moved: list[tuple[nn.Module, str, torch.device, torch.dtype]], dtype: torch.dtype | None) -> None:
    """Buffers stay resident on the compute device (they are small). With a checkpoint, every persistent
    buffer it holds comes from it, as every parameter does: BatchNorm's running statistics of a model built
    under accelerate's init_empty_weights() are real but freshly initialised, and the checkpoint's are the
    trained ones. Meta buffers it lacks come from their module's initialiser (see [Note: weight sources]).
    With params.dtype (`dtype`) floating buffers are cast to it too, as model.to(dtype) casts them (BatchNorm's
    statistics must match its weights' dtype). Each one moved is added to `moved` with the device and dtype to
    give it back in (the CPU for a meta buffer)."""
    for mod_name, mod in model.named_modules():
        for name, buf in list(mod._buffers.items()):
            if buf is None:
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            persistent = name not in mod._non_persistent_buffers_set
            found = sources.checkpoint_name(fqn) if persistent or buf.is_meta else None
            origin = torch.device("cpu") if buf.is_meta else buf.device
            if found is not None and sources.ckpt is not None:
                real = torch.empty(buf.shape, dtype=buf.dtype)
                sources.ckpt.read_into(swapper.engine, found, real)
                buf = real
            elif buf.is_meta:
                if not persistent or sources.allowed(fqn):
                    try:
                        buf = sources.initialise([fqn])[fqn]
                    except CheckpointError as exc:
                        raise OffloadError(f"buffer {fqn!r} is on the meta device and not in the checkpoint, and "
                                           f"cannot be initialised ({exc}); build the model with real buffers "
                                           "(e.g. accelerate's init_empty_weights(include_buffers=False))") from exc
                else:
                    raise OffloadError(f"buffer {fqn!r} is on the meta device and not in the checkpoint; build the "
                                       "model with real buffers (e.g. accelerate's init_empty_weights("
                                       "include_buffers=False)), or allow it with init_missing")
            moved.append((mod, name, origin, buf.dtype))
            if dtype is not None and buf.is_floating_point():
                buf = buf.to(dtype)
            mod._buffers[name] = swapper.mover.tensor_to_device(buf)


def _restore_buffers(moved: list[tuple[nn.Module, str, torch.device, torch.dtype]]) -> None:
    """Give the buffers moved at entry back to the devices and dtypes they came in, with their current values."""
    for mod, name, device, dtype in moved:
        buf = mod._buffers.get(name)
        if buf is not None:
            mod._buffers[name] = buf.to(device, dtype, copy=True)
    moved.clear()


# -- exit -------------------------------------------------------------------------------------------
def _report_old_rescues(config: Config, ranks: Ranks) -> None:
    """Say, once at entry, which rescue folders earlier runs left on the swap paths, their size and what to do
    with them: each is a rank's share of every weight and optimizer state, tens of GB on a large model."""
    found = rescue.found_in(config.nvme.paths)
    if not found:
        return
    shown = ", ".join(folder for folder, _ in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    log.warning("rank %d: %d rescue folder(s) that earlier runs left when they raised hold %s on the swap paths: %s. "
                "Join a complete set (one per rank) into a checkpoint with `tiermem rescue DIR... --out CKPT`, or "
                "delete them with `tiermem rescue --remove DIR...`", ranks.rank, len(found),
                format_size(sum(size for _, size in found)), shown)


def _dead_ranks(exc: BaseException | None) -> list[int]:
    """The ranks a RanksError in `exc`'s chain found dead (see Ranks.dead)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "dead_ranks", None):
            return list(exc.dead_ranks)  # type: ignore[attr-defined]
        exc = exc.__cause__ or exc.__context__
    return []


def _unpack(handle: OffloadHandle, restore: bool, raised: bool = False) -> None:
    for unit in handle.units:  # a forward cut short by an interrupt leaves its unit bound: see Unit.restore_places
        unit.restore_places()
    release_scratch()
    if restore and raised and handle.units and handle.units[0].ranks.sharded:
        # gathering needs every rank, and the others may be waiting in a collective of the failed step (or be
        # gone): the parameters are left on the meta device, named, rather than paired with the wrong gathers;
        # this rank's chunks are written first, which needs no other rank ([Note: rescue at several ranks])
        opt, kept = handle.optimizer, ""
        trained = opt is not None and opt.progress() > 0 and (handle.saved is None or handle.saved[1] != opt.progress())
        dead = _dead_ranks(handle.left_on)
        if trained and dead:  # their shares went with them: this rank's alone could never be joined
            last = (f"the last checkpoint, {handle.saved[0]}" if handle.saved is not None else "a checkpoint of "
                    "your own (none was written in this with-block: call tm.save_checkpoint every so many steps)")
            kept = (f"; rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died, and each rank's share "
                    "of the parameters and optimizer state lives only in its own tiers: theirs went with them, so "
                    f"the shares cannot be put together and this rank wrote none of its own. Resume from {last}")
            trained = False
        try:
            if trained:  # else they are what entry read, or what the last checkpoint holds
                folder = rescue.write(handle._contents(), handle.ranks, handle.config.nvme.paths[0])
                kept = (f"; this rank's share of every parameter and of its optimizer state was written to {folder}: "
                        "with every rank's such directory, `tiermem rescue DIR... --out CKPT` puts them together "
                        "into a checkpoint that tm.load_checkpoint resumes from")
        except Exception as exc:  # noqa: BLE001 - said in the error below
            log.error("could not write this rank's share of the parameters: %s", exc)
            kept = f"; writing this rank's share of them failed ({exc})"
        _restore_buffers(handle.runtime.moved_buffers)  # after the rescue, which reads them on the device
        _to_meta(handle.model, handle.units)
        why = OffloadError(f"rank {handle.units[0].ranks.rank} left tiered_offload on an error; with several ranks "
                           f"the parameters can be given back only by all ranks together{kept}")
        raise _restore_error({fqn: why for u in handle.units for fqn, _ in u.params}, "", unreadable=False)
    _restore_buffers(handle.runtime.moved_buffers)
    if not restore:
        made = _to_meta(handle.model, handle.units)
        _swap_in_optimizer(handle.optimizer.original if handle.optimizer is not None else None, made)
        return
    failed = _restore_units(handle.model, handle.units, handle.swapper)
    for unit in handle.units:  # the values training arrived at, not their params.dtype rounding
        try:
            values = masters_of(handle.optimizer, handle.swapper, unit)
        except Exception as exc:  # noqa: BLE001 - the rounded values stay, said here
            log.error("could not read the float32 master weights of unit %r (%s): its parameters keep their "
                      "%s values", unit.name, exc, handle.config.params.dtype)
            continue
        for fqn, p in unit.params:
            if fqn in values and fqn not in failed:
                p.data.copy_(values[fqn])
    if failed:
        raise _restore_error(failed, "")


def _restore_units(model: nn.Module, units: list[Unit], swapper: TensorSwapper) -> dict[str, BaseException]:
    """Give every unit's parameters back; a unit that cannot be read does not stop the others. Returns the
    names of the parameters that could not be restored (made meta-device Parameters, shapes kept), with why."""
    failed: dict[str, BaseException] = {}
    lost: list[Unit] = []
    if units and units[0].ranks.sharded:
        return _restore_sharded(model, units, swapper)
    # the units in host memory first: reading the others may evict them, and a failing drive could not give
    # an evicted one back
    for unit in sorted(units, key=lambda u: not swapper.holds_host(u.partition)):
        try:
            _restore_unit(unit, swapper)
        except Exception as exc:  # noqa: BLE001 - reported below, with every other unit's
            log.error("could not restore unit %r: %s", unit.name, str(exc))
            lost.append(unit)
            failed.update((fqn, exc) for fqn, _ in unit.params)
    if lost:
        _to_meta(model, lost)
    return failed


def _restore_sharded(model: nn.Module, units: list[Unit], swapper: TensorSwapper) -> dict[str, BaseException]:
    """`_restore_units` with several ranks: every rank gathers every unit, in unit order, so the collectives
    pair up even where a rank cannot read its chunk (it sends zeros); a unit any rank could not read is then
    lost on all of them, named."""
    errors: dict[int, BaseException] = {}
    for unit in units:
        try:
            swapper.acquire(unit.partition, Tier.HOST)
            mine, held = unit.partition.flat(Tier.HOST), True
        except Exception as exc:  # noqa: BLE001 - reported below
            errors[unit.index] = exc
            mine, held = torch.zeros(unit.partition.size, dtype=torch.uint8), False
        try:
            whole = unit.gather(mine, torch.empty(unit.whole.size, dtype=torch.uint8))
        finally:
            if held:
                swapper.release(unit.partition, tier=Tier.HOST)
        _give_back(unit, whole)
    bad = torch.tensor([float(u.index in errors) for u in units])
    units[0].ranks.all_reduce(bad, "max")
    lost = [u for u, b in zip(units, bad.tolist(), strict=True) if b]
    failed: dict[str, BaseException] = {}
    for unit in lost:
        why = errors.get(unit.index) or StoreError(f"another rank could not read its share of unit {unit.name!r}")
        log.error("could not restore unit %r: %s", unit.name, str(why))
        failed.update((fqn, why) for fqn, _ in unit.params)
    if lost:
        _to_meta(model, lost)
    return failed


def _restore_error(failed: dict[str, BaseException], context: str, unreadable: bool = True) -> RestoreError:
    """`unreadable`: the bytes could not be read (else they were not gathered: a rank left on an error)."""
    names = list(failed)
    errors = sorted({str(e) for e in failed.values()})
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    check = "Check the drive (dmesg, smartctl) and reload" if unreadable else "Fix the error above and reload"
    return RestoreError(
        f"{context}{len(names)} parameter(s) could not be given back"
        f"{', their bytes unreadable' if unreadable else ''} ({'; '.join(errors[:3])}): {shown}. Every other "
        f"parameter was restored; these are on the meta device now. {check} them from your last checkpoint",
        failed)


def _restore_unit(unit: Unit, swapper: TensorSwapper) -> None:
    """Give the unit's Parameter objects ordinary storage again, with their values, dtype and device."""
    tensors = swapper.acquire(unit.partition, Tier.HOST)
    try:
        _give_back(unit, tensors)
    finally:
        swapper.release(unit.partition, tier=Tier.HOST)


def _give_back(unit: Unit, tensors: dict[str, torch.Tensor]) -> None:
    """Point the unit's Parameters at copies of `tensors` (whole) in their own dtype and on their own device."""
    with torch.no_grad():
        for (fqn, p), (dtype, device) in zip(unit.params, unit.orig, strict=True):
            if device.type == "meta":
                device = torch.device("cpu")  # streamed from a checkpoint: materialise on the CPU
            p.data = tensors[fqn].to(device=device, dtype=dtype, copy=True)


def _to_meta(model: nn.Module, units: list[Unit]) -> dict[int, nn.Parameter]:
    """Replace every offloaded parameter with a meta-device Parameter of its shape (ties kept); return the new
    Parameters by the id of the ones they replaced."""
    shapes = {id(p): (shape, dtype) for u in units
              for (_, p), shape, (dtype, _) in zip(u.params, u.shapes, u.orig, strict=True)}
    made: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or id(p) not in shapes:
                continue
            if id(p) not in made:
                shape, dtype = shapes[id(p)]
                made[id(p)] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                           requires_grad=p.requires_grad)
            mod._parameters[name] = made[id(p)]
    return made
