"""The runtime behind `tiered_offload`: units, the schedule, and the forward hooks that drive them.

# [Note: backward]
Autograd keeps the tensors it needs for backward; a parameter (or a view of one, like weight.t()) is
among them. A saved-tensor pack hook replaces each managed parameter by a marker; the unpack hook, which
runs in backward when the tensor is needed, acquires the parameter's unit again and rebuilds the
tensor from the freshly bound parameter. A gradient hook on each trainable parameter acquires its unit
too, since autograd accumulates into the parameter itself. When autograd has accumulated a gradient, a
post-accumulate hook moves it into the optimizer's fp32 accumulator and frees it; once every trainable
parameter of the unit is done the unit is released. A unit with no gradient still to come (frozen, as a
LoRA base is, or finished) is held only while autograd uses the tensor unpacked from it (`_brief_hold`).
Whatever is still held when backward ends is released by a callback queued on the autograd engine; a
backward that raised never runs it, so the next backward or forward gives back what that one held
(`_abandon_backward`). A training pass (forward and backward) is one pass of the schedule, so
backward acquisitions are recorded and prefetched like forward ones.

# [Note: acquire and release]
A forward pre-hook on each hooked module acquires the units that module needs (its own, plus the
units of tied parameters it holds), binding their parameters to partition views on the device; the
matching forward hook (always called, also when forward raises) releases them. Acquiring asks the
schedule for the window of units needed next and prefetches them; releasing keeps a unit on the
device when the window holds it again. See [Note: prefetch window] in schedule.py.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tiermem.distributed import Gathering
from tiermem.quant import expands_at_use_now
from tiermem.runtime.activations import ActivationStore, _SavedActivation
from tiermem.runtime.schedule import Schedule, plan_resident
from tiermem.runtime.unit import Unit
from tiermem.sizes import format_size
from tiermem.swap import Partition, TensorSwapper, Tier
from tiermem.trace import Tracer

if TYPE_CHECKING:  # the optimizer imports the runtime's units: typed here, imported only for the check
    from tiermem.optim.optimizer import TieredOptimizer
    from tiermem.runtime.kv_cache import KVStore

log = logging.getLogger(__name__)
_Hook = TypeVar("_Hook", bound=Callable[..., Any])  # a hook torch.compiler.disable wraps, as it was


class _SavedParam:
    """What autograd holds instead of a managed parameter (or a view of one) between forward and backward."""

    __slots__ = ("param", "unit", "view")

    def __init__(self, param: nn.Parameter, unit: int, view: tuple[Any, Any, int] | None) -> None:
        self.param = param
        self.unit = unit
        self.view = view  # (size, stride, offset from the parameter's own offset) for a view; None for itself


class Runtime:
    """Owns the units and the schedule of one `tiered_offload` context; registers and removes hooks."""

    def __init__(self, model: nn.Module, swapper: TensorSwapper, units: list[Unit],
                 needs: dict[nn.Module, list[int]], *, prefetch: bool = True) -> None:
        self.model = model
        self.swapper = swapper
        self.units = units
        self.needs = needs  # module -> indices of the units its forward needs
        cfg = swapper.config.prefetch
        self.prefetch_enabled = prefetch and cfg.depth > 0
        self.schedule = Schedule(cfg.depth if self.prefetch_enabled else 0, cfg.max_bytes,
                                 lambda i: units[i].nbytes)
        self._depth = self.schedule.depth  # as configured; a resident plan may lower schedule.depth
        self._planned_for: list[int] | None = None  # the recorded order the resident plan was made for
        self._planned_kv: tuple[dict[int, int], int, int] = ({}, 0, 0)  # and the KV blocks it saw (_kv_plan_inputs)
        self.resident_bytes = 0  # bytes of the units the plan keeps in host memory
        self.handles: list[RemovableHandle] = []  # every hook we registered, removed on exit
        self._pass_depth = 0  # nesting of the model's own forward; a pass ends when it returns to 0
        self._pass_began: tuple[Tracer, float] | None = None  # the tracer and its time when this pass began
        self._on_device: set[int] = set()  # units whose partition is on the device (in use or kept)
        self.stall_seconds = 0.0  # time forward waited for a unit's bytes
        self.prefetch_hits = 0  # acquisitions whose bytes were on the device or on their way
        self.prefetch_misses = 0  # acquisitions that had to start reading
        self.passes = 0
        self._unit_of = {id(u.partition): u.index for u in units}
        self._entered_at: dict[int, int] = {}  # unit -> the swapper's clock when it was last entered
        self.pass_clock = 0  # the swapper's clock when the model's forward last began
        self._param_unit = {id(p): (u.index, fqn) for u in units for fqn, p in u.params}  # id -> (unit, FQN)
        self.optimizer: TieredOptimizer | None = None  # what takes the gradients, when training
        self._saved_hooks: Any = None  # the saved_tensors_hooks context, entered for the context's life
        self._bwd_held: set[int] = set()  # units acquired by the backward in progress
        # brief backward holds: the unit of each unpacked tensor by its weak reference, and the references whose
        # tensor died (appended by the reference's callback, a builtin: no Python code runs in a teardown, where
        # a signal's exception would be dropped; see [Note: interrupts] in tiermem/interrupts.py)
        self._brief_refs: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._brief_done: list[weakref.ref[torch.Tensor]] = []
        self._bwd_done: dict[int, int] = {}  # unit -> trainable parameters whose gradient arrived
        self._trainable_count: dict[int, int] = {}  # unit -> parameters that get gradients
        self._in_backward = False
        self._backward_task = -1  # autograd's id of the backward in progress
        self._awaiting_backward = False  # a grad-enabled forward ended; its pass ends with its backward
        self._backwards = 0  # backward passes ended since step() last recorded updates
        self._backwards_per_step = 0  # how many ended before that step (0: none recorded yet)
        self._distance: tuple[int, dict[int, int]] = (-1, {})  # (cursor, unit -> acquisitions until next use)
        self.activations: ActivationStore | None = None  # saved activations on NVMe (activations.tier)
        self.kv: KVStore | None = None  # the tiered KV cache's blocks (kv.tier other than memory), see kv_cache.py
        # (module, name, device, dtype) of each buffer moved at entry, to give it back in
        self.moved_buffers: list[tuple[nn.Module, str, torch.device, torch.dtype]] = []
        self.checkpoint_bytes_read = 0  # what entry read from checkpoint= (with several ranks, this rank's chunks)
        self.checkpoint_bytes_written = 0  # the tensors' bytes tm.save_checkpoint wrote (with several ranks, its own)
        self._ahead: tuple[int, Gathering] | None = None  # a unit whose gather started early (several ranks)
        self._lingering: int | None = None  # a gathered unit kept bound past its exit ([Note: a unit entered again])
        self._charged: dict[int, int] = {}  # unit -> gathered bytes counted on the device's ledger
        self._expanded: dict[int, torch.Tensor] = {}  # unit -> the buffer its compressed weights expand into
        self._spare: dict[int, torch.Tensor] = {}  # size -> an expansion buffer kept for the next unit of it
        # expansion buffers kept alive by views, by weak reference with their bytes, and those that died since
        # the ledger last heard of it (appended by the references' callback, a builtin, as `_brief_done`)
        self._freed_refs: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._freed: list[weakref.ref[torch.Tensor]] = []
        self.tracer: Tracer | None = None  # see [Note: traces] in tiermem/trace.py
        self._bound_at: dict[int, float] = {}  # unit -> when it became usable (trace time)
        swapper.evict_by_next_use(self._next_use)
        largest = max((u.nbytes for u in units), default=0)
        window = self.schedule.depth * largest
        if cfg.max_bytes is not None:
            window = min(window, cfg.max_bytes)
        # with several ranks also the unit computing, gathered whole, and the next one's gather in flight
        gathered = max((3 * u.ranks.world * u.nbytes for u in units if u.ranks.sharded), default=0)
        # compressed units: the two in use expanded into their compute dtype (see [Note: compressed weights])
        # (also those that expand at use: a forward recording gradients, or under autocast, expands them whole)
        gathered += 2 * max((u.whole.size for u in units if u.quant is not None), default=0)
        swapper.derive_device_cap(largest, window, gathered)

    def _next_use(self, part: Partition) -> float:
        """Acquisitions until the schedule needs this partition again, counting the next one as 1 (inf when it
        never does); 0 for one needed now (see follow()) and for all while no order is recorded."""
        order = self.schedule.order
        if not order:
            return 0.0  # nothing recorded yet: fall back to least recently used
        pos, dist = self._distance
        if pos != self.schedule.pos or not dist:
            n = len(order)
            dist = {}
            for k in range(n):
                dist.setdefault(order[(self.schedule.pos + k) % n], k + 1)
            self._distance = (self.schedule.pos, dist)
        unit = self._unit_of.get(id(part), -1)
        if unit < 0 and self.optimizer is not None:
            return float(dist.get(self._updated_by(part), float("inf")))
        entered = self.entered_at(unit) if unit >= 0 and part is not self.units[unit].partition else None
        if entered is not None and part.last_used <= entered:
            return 0.0  # see follow()
        return float(dist.get(unit, float("inf")))

    def _updated_by(self, part: Partition) -> int:
        """The unit whose coming update reads `part` (its optimizer state or accumulators), else -1: a lazy
        update runs as its unit is next entered, so that is when they are needed; the state of a unit whose
        update is not recorded yet is needed then only when `step()` is expected (see [Note: the state
        before step()])."""
        opt = self.optimizer
        if opt is None:
            return -1
        u = opt.part_unit.get(id(part), -1) if opt.lazy else -1
        if u < 0 or u in opt.pending:
            return u
        return u if part is opt.by_unit[u].state and self._step_follows() else -1

    # [Note: the state before step()]
    # A lazy update's reads start when `step()` records it, and the first unit of the next forward then waits
    # for the whole of its state: on the training bench 25-50 ms for `wte+wpe` each step, while the last units of
    # backward had computed with the disk idle. The loop's shape says when a step comes: it follows as many
    # backward passes as the last one did (one; two with 2-step accumulation). In that backward, once the
    # window reaches past the pass's end, the units it reaches in the next pass have their states read ahead,
    # in order (parked without room, as any read-ahead), as they do once the step is recorded. Before, only
    # the first while backward ran, keeping the room for the accumulators still to come; at
    # 2 ranks that left `h.0`'s state, and `h.1`'s once evicted, to be read after `step()`, behind the
    # write-backs of the parameters the last updates had left dirty, and the next forward's first updates
    # waited 68-87 ms a rank and step. The parameters are now written as their unit's backward begins ([Note:
    # updated state written in backward] in tiermem/optim/optimizer.py), so the room these reads take is
    # mostly clean copies dropped without a write; the waits fell to 13-20 ms. Until the update
    # is recorded such a state is needed at its unit's next entry, like a recorded one, so reading it evicts
    # only what is needed later, and the parameters the update comes with stay (before, a state read ahead
    # counted as needed by nobody, evicted anything, and `wte+wpe` and `h.0` were read again at once). A
    # wrong guess costs a read: once no step is expected the state is needed by nobody again, and of what was
    # read ahead it is evicted first.
    def _step_follows(self) -> bool:
        """Whether the loop's `step()` is expected before the next forward: in, or after, the backward that
        the last recorded step came after as many of."""
        opt = self.optimizer
        if opt is None or not opt.lazy or not self._backwards_per_step:
            return False
        return self._backwards + int(self._in_backward) == self._backwards_per_step

    # -- hooks --------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """All hooks, in one place; their handles are kept so `remove_hooks` undoes exactly these.

        # [Note: torch.compile]
        A model compiled with torch.compile (the whole model, or each block, as `module.compile()` does) is traced
        by dynamo through its modules' hooks as well. The runtime's hooks do I/O, wait on other threads and
        rebind parameters: each is marked `torch.compiler.disable`, so dynamo breaks its graph there and calls
        the hook as it is, and the compiled graphs run between them, one per stretch of a unit's compute. A
        parameter is a graph input, so the storage a hook binds to it before the compute is what the graph reads.
        The saved-tensor hooks stay outside any graph: AOTAutograd's compiled functions save through them as
        eager autograd does, so parameters and activations leave the device between forward and backward alike.
        """
        eager: Callable[[_Hook], _Hook] = torch.compiler.disable
        self.handles.append(self.model.register_forward_pre_hook(eager(self._pass_begin)))
        self.handles.append(self.model.register_forward_hook(eager(self._pass_end), always_call=True))
        for module, indices in self.needs.items():
            self.handles.append(module.register_forward_pre_hook(eager(self._make_pre(indices))))
            self.handles.append(module.register_forward_hook(eager(self._make_post(indices)), always_call=True))
        # every other module holding a unit's parameters acquires that unit too: inside the unit's own forward
        # that only counts a use (cheap), but activation checkpointing recomputes a block in backward by calling
        # its forward() itself, past the block's hooks, and only its submodules' hooks see the recompute
        for module, held in self._parameter_owners().items():
            if module not in self.needs:
                self.handles.append(module.register_forward_pre_hook(eager(self._make_pre(held))))
                self.handles.append(module.register_forward_hook(eager(self._make_post(held)), always_call=True))
        for u in self.units:
            for _, p in u.params:
                if p.requires_grad:
                    self._trainable_count[u.index] = self._trainable_count.get(u.index, 0) + 1
                    self.handles.append(p.register_hook(eager(self._make_grad_arriving(u.index))))
                    self.handles.append(p.register_post_accumulate_grad_hook(eager(self._grad_ready)))
        act = self.swapper.config.activations
        if act.tier == "nvme":
            self.activations = ActivationStore(self.swapper, act.buffer, act.min_bytes, act.keep or 0)
        if self.swapper.config.kv.tier != "memory":  # see [Note: tiered KV cache] in kv_cache.py
            from tiermem.runtime.kv_cache import KVStore  # transformers' cache layers: imported only for it

            self.kv = KVStore(self)
            self.handles.append(self.model.register_forward_pre_hook(eager(self.kv.on_forward), with_kwargs=True))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()

    def _parameter_owners(self) -> dict[nn.Module, list[int]]:
        """Each module holding managed parameters directly, and the units they are in."""
        out: dict[nn.Module, list[int]] = {}
        for module in self.model.modules():
            held = sorted({self._param_unit[id(p)][0] for p in module._parameters.values()
                           if p is not None and id(p) in self._param_unit})
            if held:
                out[module] = held
        return out

    def remove_hooks(self) -> None:
        try:
            self.settle()
        except Exception as exc:  # noqa: BLE001 - another rank failed; exit goes on and reports what it must
            log.warning("a gather started ahead did not finish: %s", exc)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.drop_spare()
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        if self.activations is not None:
            self.activations.close()
        if self.kv is not None:
            self.kv.close()

    # -- backward (see [Note: backward]) ---------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        found = self._param_unit.get(id(base))
        if found is None:
            if self.activations is not None and not self._in_backward:
                return self.activations.pack(t)  # see [Note: activation offload] in activations.py
            return t
        if base is t:
            return _SavedParam(t, found[0], None)  # type: ignore[arg-type]
        offset = t.storage_offset() - base.storage_offset()
        return _SavedParam(base, found[0], (t.size(), t.stride(), offset))  # type: ignore[arg-type]

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedParam):
            if isinstance(saved, _SavedActivation):
                return saved.store.unpack(saved)
            return saved  # type: ignore[no-any-return]  # what autograd saved that is not ours, as it was
        self._end_brief_holds()
        i, p = saved.unit, saved.param
        if self._bwd_done.get(i) == -1 or not self._trainable_count.get(i, 0):
            return self._brief_hold(i, saved)
        self._backward_acquire(i)
        if saved.view is None:
            return p
        size, stride, rel = saved.view
        return p.detach().as_strided(size, stride, p.storage_offset() + rel)

    def _brief_hold(self, i: int, saved: _SavedParam) -> torch.Tensor:
        """A unit backward needs with no gradient still to come (frozen, as a LoRA base, or already done) is
        held only while autograd uses the tensor unpacked from it: the tensor's finalizer ends the hold (the
        compute thread releases it at the next unpack or at the end of backward), so backward never holds
        more than the units it is working on."""
        self._start_backward()
        self.enter(i)
        p = saved.param.detach()
        if saved.view is not None:
            size, stride, rel = saved.view
            p = p.as_strided(size, stride, p.storage_offset() + rel)
        ref = weakref.ref(p, self._brief_done.append)
        self._brief_refs[id(ref)] = (ref, i)
        return p

    def _end_brief_holds(self) -> None:
        while self._brief_done:
            _, i = self._brief_refs.pop(id(self._brief_done.pop()))
            self.exit(i, drop=self.optimizer is not None)

    def _start_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._in_backward and task != self._backward_task:
            self._abandon_backward()  # the last backward raised, so it never reached its end callback
        if not self._in_backward:
            self._in_backward = True
            self._backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            if self.optimizer is not None:
                self.optimizer.backward_began()  # whether tm.backward scaled its loss

    def _abandon_backward(self) -> None:
        """Autograd drops the end callback of a backward that raised (a read that failed, a Ctrl-C): give back
        what that backward held before the next pass needs the room, without updating anything."""
        self._end_brief_holds()
        if self.optimizer is not None:
            self.optimizer.settle_grads(discard=True)  # the reduce-scatter in flight meets the other ranks'
        for i in sorted(self._bwd_held):
            if self.optimizer is not None:
                self.optimizer.drop_grads(i)  # lets go of the unit's accumulators; zero_grad clears them
            self.exit(i, drop=True)
        self._bwd_held.clear()
        self._bwd_done.clear()
        self._in_backward = False
        self._awaiting_backward = False

    def _backward_acquire(self, i: int) -> None:
        self._start_backward()
        if i not in self._bwd_held:
            self._bwd_held.add(i)
            self.enter(i)
            if self.optimizer is not None:  # its last update's state and parameters go to disk now
                self.optimizer.write_back_updated(i)  # ([Note: updated state written in backward])

    def _make_grad_arriving(self, i: int) -> Any:
        def arriving(grad: torch.Tensor) -> None:
            self._backward_acquire(i)  # autograd accumulates into the parameter: it must be bound

        return arriving

    def _grad_ready(self, p: torch.Tensor) -> None:
        self._start_backward()
        i, fqn = self._param_unit[id(p)]
        if self.optimizer is not None and i in self.optimizer.by_unit and p.grad is not None:
            self.optimizer.accumulate(i, fqn, p.grad)
            p.grad = None  # the device copy goes now; the fp32 accumulator holds it
        self._bwd_done[i] = self._bwd_done.get(i, 0) + 1
        if self._bwd_done[i] == self._trainable_count.get(i, 0):
            self._finish_unit_backward(i)
            self._bwd_done[i] = -1  # finished: the end-of-backward sweep leaves it alone

    def _finish_unit_backward(self, i: int) -> None:
        if self.optimizer is not None:
            self.optimizer.finish_grads(i)
        if i in self._bwd_held:
            self._bwd_held.discard(i)
            # backward needs a unit once; the next forward's first units come up in the window at its end, but
            # the step changes them before that forward: keeping their device copies would waste the copy
            self.exit(i, drop=self.optimizer is not None)

    def _backward_end(self) -> None:
        """Runs once when autograd finishes a backward: release what it still holds, end the pass."""
        self._end_brief_holds()
        for i in sorted(self._bwd_held | {j for j, n in self._bwd_done.items() if n >= 0}):
            self._finish_unit_backward(i)  # units some of whose parameters got no gradient
        if self.optimizer is not None:
            self.optimizer.settle_grads()  # the last unit's reduce-scatter (several ranks)
        self._bwd_done.clear()
        self._in_backward = False
        self._backwards += 1
        if self._awaiting_backward:
            self._awaiting_backward = False
            self._finish_pass(trained=True)

    def _make_pre(self, indices: list[int]) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            for i in indices:
                self.enter(i)

        return pre

    def _make_post(self, indices: list[int]) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            for i in reversed(indices):
                self.exit(i)

        return post

    def _pass_begin(self, module: nn.Module, args: Any) -> None:
        if self._in_backward and torch._C._current_graph_task_id() == -1:
            self._abandon_backward()  # a forward outside any backward: the last backward raised
        if self._pass_depth == 0 and self._awaiting_backward:  # the last forward's backward never came
            self._awaiting_backward = False
            self._finish_pass()
        if self._pass_depth == 0:
            if self.activations is not None:
                self.activations.begin_pass()
            self._pass_began = (self.tracer, self.tracer.now()) if self.tracer is not None else None
            self.pass_clock = self.swapper.clock
        self._pass_depth += 1

    def _pass_end(self, module: nn.Module, args: Any, output: Any) -> None:
        self._pass_depth -= 1
        if self._pass_depth == 0:
            if torch.is_grad_enabled() and self._trainable_count:
                self._awaiting_backward = True  # the pass goes on through backward
            else:
                self._finish_pass()

    def _finish_pass(self, *, trained: bool = False) -> None:
        self.passes += 1
        window = self.schedule.on_pass_end()
        if self.schedule.order is not self._planned_for or (
                self.kv is not None and self._kv_plan_inputs() != self._planned_kv):
            self._plan_resident()
            window = self.schedule.window() if self.schedule.order else window
        # after a backward the optimizer's step comes next and changes these units: a device copy made now
        # would be stale before the next forward, so the window is read to the host only
        self._prefetch(window, Tier.HOST if trained and self.optimizer is not None else Tier.DEVICE)
        if self._pass_began is not None and self._pass_began[0] is self.tracer:  # begun and ended under this
            # tracer; its span takes in the reads it issued last, for the next pass ([Note: passes in a report])
            self.tracer.span("pass", f"pass {self.passes}", self._pass_began[1], backward=trained)
        self._pass_began = None

    def _plan_resident(self) -> None:
        """Choose the units kept in host memory between passes for the order just recorded and the KV blocks
        read with them; see [Note: resident units] in schedule.py. Only for inference: training shares the
        budget with gradients and optimizer state, whose reads need that room. The room left to stream is
        known to the window with prefetch.keep_resident off too, so KV blocks do not overrun it (`_fitting`)."""
        order = self.schedule.order
        self._planned_for = order
        self._planned_kv = self._kv_plan_inputs()
        follow, tails, _ = self._planned_kv  # the host-homed blocks are among the partitions counted below
        resident: set[int] = set()
        depth = self._depth
        room: int | None = None
        sizes: dict[int, int] = {}
        if order and self.optimizer is None and self.prefetch_enabled:
            used = set(order)
            sizes = {u.index: u.partition.size for u in self.units
                     if u.index in used and u.partition.home is Tier.NVME}
            fixed = sum(p.size for p in self.swapper.partitions.values() if p.home is not Tier.NVME)
            fixed += tails  # the KV cache's partial blocks, kept in host memory
            if self.swapper.config.prefetch.keep_resident:
                resident, depth = plan_resident(sizes, self.swapper.partition_budget - fixed, self._depth, follow)
            room = self.swapper.partition_budget - fixed - sum(sizes[j] for j in resident)
        before = self.schedule.resident
        for j in before - resident:
            self.swapper.keep_resident(self.units[j].partition, False)
        for j in resident - before:
            self.swapper.keep_resident(self.units[j].partition, True)
        self.schedule.resident = resident
        self.schedule.depth = depth
        self.schedule.follow = follow
        self.schedule.stream_room = room if resident or follow else None
        self.resident_bytes = sum(self.units[j].partition.size for j in resident)
        if resident != before:
            log.info("keeping %d of %d units (%s) in host memory between passes; prefetch depth %d",
                     len(resident), len(sizes), format_size(self.resident_bytes), depth)

    def _kv_plan_inputs(self) -> tuple[dict[int, int], int, int]:
        """What the resident plan needs of the KV cache: the bytes of blocks each unit reads with it from NVMe, of
        partial blocks kept in host memory, and of blocks homed there (kv.tier auto or cpu); the plan is made
        again when any of them changes. Without the last, kv.tier auto kept the plan its first pass made while its
        blocks filled the room that plan had counted as free."""
        return (self.kv.streamed(), self.kv.tail_bytes, self.kv.host_bytes) if self.kv is not None else ({}, 0, 0)

    # -- acquire / release --------------------------------------------------------------------------
    def enter(self, i: int) -> None:
        """Make unit `i` usable on the device (see [Note: acquire and release])."""
        unit = self.units[i]
        if self._lingering is not None and self._lingering != i:
            self.let_lingering_go()
        unit.depth += 1
        if unit.depth > 1:
            return
        if self._lingering == i:  # still bound since its exit, gathered whole
            self._lingering = None
            self._enter_again(unit)
            return
        self._entered_at[i] = self.swapper.clock  # see follow()
        part = unit.partition
        sw = self.swapper
        try:
            ahead = self._take_ahead(i)
            if self.optimizer is not None and ahead is None:
                self.optimizer.apply_pending(i)  # the last step's update of this unit ([Note: lazy update])
        except BaseException:
            unit.depth -= 1
            raise
        if ahead is not None or sw.is_on_the_way(part, Tier.DEVICE) or (
                not sw.mover.has_own_memory and sw.is_on_the_way(part, Tier.HOST)):
            self.prefetch_hits += 1
        else:
            self.prefetch_misses += 1
        window = self.schedule.on_acquire(i)
        t0 = time.perf_counter()
        began = self.tracer.now() if self.tracer is not None else 0.0
        try:
            if ahead is not None:  # its chunks are held on the device and its gather has been running
                self._prefetch(window)
                tensors = self._finish_gather(unit, ahead)
            else:
                # this unit's read is queued first; the window's reads start once it is marked in use
                tensors = self.swapper.acquire(part, Tier.DEVICE, before_wait=lambda: self._prefetch(window))
                if unit.ranks.sharded:  # this rank's chunks: gather the unit whole (see [Note: sharding])
                    tensors = self._finish_gather(unit, self._start_gather(unit))
                elif unit.quant is not None and not (unit.at_use is not None and expands_at_use_now()):
                    # stored compressed: expand it whole (see [Note: compressed weights]), unless its products
                    # expand it where they use it ([Note: expanded where used])
                    tensors = self._expand(unit, tensors)
        except BaseException:
            unit.depth -= 1
            raise
        self.stall_seconds += time.perf_counter() - t0
        if self.tracer is not None:
            self._trace_acquired(unit, began)
        self._on_device.add(i)
        unit.bind(tensors)
        for j in list(self._on_device):  # units left on the device that nothing will need soon
            if j != i and self.units[j].depth == 0 and j not in window:
                self.swapper.demote(self.units[j].partition)
                self._on_device.discard(j)
        if unit.ranks.sharded:
            self._gather_ahead(i)

    # -- several ranks: gathering units whole (see [Note: sharding] in tiermem/distributed.py) --------------
    # [Note: a unit entered again]
    # A unit of several modules is entered once per module: `h.11+ln_f` for the block, then for the final norm;
    # `wte+wpe` for each embedding, and for the tied head at the end of forward and again at the start of
    # backward. With one rank its host copy stays, and entering it again costs nothing. With several, the
    # unit's whole copy, gathered from every rank, went at each exit, so each entry gathered it again, and
    # nothing had started that gather ahead (`_gather_ahead` skips the unit computing). On the training bench
    # at 2 ranks those gathers were waited for in full: 46 ms for `h.11+ln_f`, 10-25 ms for each second use of
    # `wte+wpe`, each step. Now, when the order says the unit leaving is the next one entered, it stays bound,
    # gathered, until then (`_lingering`); any other entry, and `settle`, let it go first. Its chunks do not
    # change in between: an update applies to a unit only as it is first entered, and `prefetch_pending`
    # (a step recorded) lets it go too. A unit whose tensors were changed (dirty) never lingers.
    def _enter_again(self, unit: Unit) -> None:
        """Unit `unit`, whose gathered copy stayed bound since its exit, is in use again."""
        i = unit.index
        self._entered_at[i] = self.swapper.clock
        self.prefetch_hits += 1
        window = self.schedule.on_acquire(i)
        self._prefetch(window)
        if self.tracer is not None:
            self._trace_acquired(unit, self.tracer.now())
        self._on_device.add(i)
        self._gather_ahead(i)

    def let_lingering_go(self) -> None:
        """Release the unit kept gathered past its exit, if any ([Note: a unit entered again])."""
        i, self._lingering = self._lingering, None
        if i is not None:
            self._let_go(self.units[i], dirty=False, drop=False)

    def _trace_acquired(self, unit: Unit, began: float) -> None:
        """The wait for `unit` (its read, its gather) as a span, and the bytes each tier holds now."""
        assert self.tracer is not None
        now = self.tracer.now()
        if now - began > 1.0:  # a microsecond and more: something was waited for
            self.tracer.span("wait", f"wait {unit.name}", began, now, unit=unit.index,
                             partition=unit.partition.name, gather=unit.ranks.sharded)
        self._bound_at[unit.index] = now
        self.tracer.held(self.swapper.ledger, self.swapper.cache.store_if_open)

    def prefetch_pending(self) -> None:
        """`step()` recorded updates: start reading what the next pass's first units' updates need."""
        self.let_lingering_go()  # the updates change it: its gathered copy would be stale
        if self._backwards:  # see [Note: the state before step()]
            self._backwards_per_step, self._backwards = self._backwards, 0
        if self.schedule.order:
            self._prefetch(self.schedule.window(), Tier.HOST)

    def _start_gather(self, unit: Unit) -> Gathering:
        """Start the all-gather of `unit`, whose partition is acquired on the device (released on failure)."""
        try:
            self._charge(unit, unit.ranks.rows_received * unit.partition.size)  # the rows the gather fills
            return unit.start_gather(unit.partition.flat(Tier.DEVICE))
        except BaseException:
            self._uncharge(unit)
            self.swapper.release(unit.partition, tier=Tier.DEVICE)
            raise

    def _finish_gather(self, unit: Unit, g: Gathering) -> dict[str, torch.Tensor]:
        """Unit `unit` whole on the device once `g` is done; that memory goes when the unit is unbound."""
        try:
            self._charge(unit, unit.whole.size)
            tensors = unit.finish_gather(g, self.swapper.mover.empty(unit.whole.size))
        except BaseException:
            self._uncharge(unit)
            self.swapper.release(unit.partition, tier=Tier.DEVICE)
            raise
        del g  # the rows go
        self._uncharge(unit, keep=unit.whole.size)
        return tensors

    def _expand(self, unit: Unit, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Unit `unit`, acquired compressed on the device, expanded into its compute dtype there; that memory
        is counted on the device's ledger while the unit is bound. The buffer is the one the last unit of the
        same size left when nothing else held it: a fresh one costs a page fault per 4 KiB on the CPU (25 ms
        more per 50 MB unit, measured), more than the expansion itself."""
        size = unit.whole.size
        self._note_freed()
        try:
            buf = self._spare.pop(size, None)
            if buf is None:
                self._charge(unit, size)
                buf = self.swapper.mover.empty(size)
            else:  # its bytes are on the ledger already, as the spare's: now the unit's
                self._charged[unit.index] = self._charged.get(unit.index, 0) + size
            self._expanded[unit.index] = buf
            return unit.expand(stored, buf)
        except BaseException:
            self._expanded.pop(unit.index, None)
            self._uncharge(unit)
            self.swapper.release(unit.partition, tier=Tier.DEVICE)
            raise

    def _let_expanded_go(self, unit: Unit) -> None:
        """After `unit` is unbound: keep its expansion buffer for the next unit of its size when no view of it
        is alive any more (none is, unless the caller kept a parameter's tensor or autograd a graph), else let
        it go with its last reference."""
        buf = self._expanded.pop(unit.index, None)
        if buf is None:
            self._uncharge(unit)
            return
        n = self._charged.pop(unit.index, 0)  # the ledger keeps counting it: as the spare, or until it dies
        # 2: `buf` and the storage object asked for here; every view alive adds one
        if buf.size(0) not in self._spare and torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2:
            self._spare[buf.size(0)] = buf
        else:  # a view keeps it (and, through the view's _base, `buf`): counted until the last one goes
            ref = weakref.ref(buf, self._freed.append)  # drained on this thread: see _note_freed
            self._freed_refs[id(ref)] = (ref, n)

    def _note_freed(self) -> None:
        """Take the expansion buffers that died off the ledger (a finalizer may run inside the ledger's lock,
        at any allocation, so it only notes them)."""
        while self._freed:
            self.swapper.ledger.sub("device", self._freed_refs.pop(id(self._freed.pop()))[1])

    def drop_spare(self) -> None:
        """Give back the expansion buffers kept for reuse (when the context ends)."""
        self._note_freed()
        for size in list(self._spare):
            del self._spare[size]
            self.swapper.ledger.sub("device", size)

    def _gather_ahead(self, i: int) -> None:
        """Start gathering the unit the recorded order says comes next in this pass, so the collective runs
        while unit `i` computes. Depends only on the order, so every rank starts the same gathers."""
        j = self.schedule.next_in_pass()
        if j is None or j == i or self.units[j].depth > 0 or self._ahead is not None:
            return
        unit = self.units[j]
        if self.optimizer is not None:
            self.optimizer.apply_pending(j)  # as enter() does; its time is the update's, not a stall
        t0 = time.perf_counter()
        self.swapper.acquire(unit.partition, Tier.DEVICE)  # its read was started with the window
        self.stall_seconds += time.perf_counter() - t0
        self._on_device.add(j)
        self._ahead = (j, self._start_gather(unit))
        unit.ranks.traffic.gathers_ahead += 1

    def _take_ahead(self, i: int) -> Gathering | None:
        """The gather started ahead for unit `i`, or None; one started for another unit is finished and
        dropped (the prediction was wrong, on every rank alike)."""
        if self._ahead is None:
            return None
        j, g = self._ahead
        self._ahead = None
        if j == i:
            return g
        self._drop_gather(j, g)
        return None

    def _drop_gather(self, j: int, g: Gathering) -> None:
        unit = self.units[j]
        try:
            unit.ranks.wait(g.work)
        finally:
            self._uncharge(unit)
            self.swapper.release(unit.partition, tier=Tier.DEVICE)

    def settle(self) -> None:
        """Finish a gather started ahead that no unit took (the with-block ends, or raised mid-pass), and let
        go of a unit kept gathered past its exit."""
        self.let_lingering_go()
        if self._ahead is not None:
            j, g = self._ahead
            self._ahead = None
            self._drop_gather(j, g)

    def _charge(self, unit: Unit, nbytes: int) -> None:
        """Count gathered or expanded memory on the device's ledger (it counts against memory.device_budget)."""
        how = "expanded from its compressed storage" if unit.quant is not None else \
            f"gathered from {unit.ranks.world} ranks"
        self.swapper.ledger.add("device", nbytes, f"unit {unit.name!r} {how}")
        self._charged[unit.index] = self._charged.get(unit.index, 0) + nbytes

    def _uncharge(self, unit: Unit, keep: int = 0) -> None:
        n = self._charged.pop(unit.index, 0)
        self.swapper.ledger.sub("device", n - keep)
        if keep:
            self._charged[unit.index] = keep

    def exit(self, i: int, *, dirty: bool = False, drop: bool = False) -> None:
        """Release unit `i`, keeping it on the device if the window needs it again (unless `drop`)."""
        unit = self.units[i]
        if unit.depth == 0:
            return  # its enter failed (the forward hook runs also when the pre-hook raised)
        unit.depth -= 1
        if unit.depth > 0:
            return
        if self.tracer is not None and i in self._bound_at:
            self.tracer.span("compute", f"{'backward' if self._in_backward else 'forward'} {unit.name}",
                             self._bound_at.pop(i), unit=i)
        if (unit.ranks.sharded and unit.quant is None and not dirty and not drop
                and self.schedule.next_in_pass() == i):
            self._lingering = i  # entered again next: it stays gathered ([Note: a unit entered again])
            return
        self._let_go(unit, dirty=dirty, drop=drop)

    def _let_go(self, unit: Unit, *, dirty: bool, drop: bool) -> None:
        """The release of `exit`, once nothing uses the unit."""
        i = unit.index
        if dirty and unit.ranks.sharded:  # edits to the gathered unit (tm.gathered()): keep this rank's chunks
            unit.keep_chunks()
        unit.unbind()
        if unit.quant is not None:
            self._let_expanded_go(unit)
        elif unit.ranks.sharded:
            self._uncharge(unit)  # the gathered copy went with the last reference to it
        if torch.is_autocast_enabled(self.swapper.device.type):
            # autocast caches the low-precision copy of each parameter by the Parameter object until the
            # autocast block ends: without this, every released unit's copy would stay alive on the device
            torch.clear_autocast_cache()
        keep = not drop and bool(self.schedule.order) and i in self.schedule.window()
        self.swapper.release(unit.partition, keep=keep, dirty=dirty, tier=Tier.DEVICE)
        if not keep:
            self._on_device.discard(i)

    def _prefetch(self, window: list[int], tier: Tier = Tier.DEVICE) -> None:
        self.swapper.forget_parked()  # this round's reads replace what the last one could not start
        coming = self.schedule.next_pass() if self._step_follows() else []  # [Note: the state before step()]
        window = self._fitting(window)
        for j in window:
            part = self.units[j].partition
            extra = self.optimizer.pending_parts(j) if self.optimizer is not None else []
            if not extra and j in coming and self.optimizer is not None:
                extra = self.optimizer.coming_parts(j)
            to = Tier.HOST if extra else tier  # its update comes first, on the host (see [Note: lazy update])
            # A unit's recorded update needs its state, gradients and parameters at once: its state is read
            # first, and when any of them finds no room nothing past it is read, since those reads would take
            # the room this update waits for (and be evicted by its reads before their use).
            for p in (*reversed(extra), part):
                if not self.swapper.is_on_the_way(p, to):
                    # without room now, once a write-back frees it; an update's room is joined from pieces
                    self.swapper.prefetch(p, to, park=True, compact=p is not part)
            if extra and not all(self.swapper.is_on_the_way(p, Tier.HOST) for p in (*extra, part)):
                break
            if to is Tier.DEVICE:
                self._on_device.add(j)
        if self.schedule.resident and window:  # resident units fill window places: read past them
            for j in self.schedule.read_ahead(self._room_to_stream()):
                part = self.units[j].partition
                if j not in window and not self.swapper.is_on_the_way(part, Tier.HOST):
                    self.swapper.prefetch(part, Tier.HOST)
        if self.kv is not None and window:
            self.kv.prefetch(window)  # the KV blocks of the layers these units compute

    def _need(self, j: int) -> int:
        """The bytes unit `j` holds while it computes: its own, unless kept resident, and those read with it."""
        own = 0 if j in self.schedule.resident else self.units[j].partition.size
        return own + self.schedule.follow.get(j, 0)

    def _room_to_stream(self) -> int | None:
        """What the resident plan leaves for the units read in, less what the streamed units computing hold;
        None without a plan."""
        room = self.schedule.stream_room
        if room is None:
            return None
        return room - sum(self._need(u.index) for u in self.units if u.depth > 0)

    def _fitting(self, window: list[int]) -> list[int]:
        """The window cut where the bytes read with its units (KV blocks) pass the room to stream; its first unit
        is always kept. Without this, generation under a budget that holds one layer and its blocks beside the
        one computing read two ahead, and the second's reads evicted blocks the first then read again."""
        room = self._room_to_stream() if self.schedule.follow else None
        if room is None:
            return window
        out: list[int] = []
        for j in window:
            room -= self._need(j)
            if out and room < 0:
                break
            out.append(j)
        return out

    def follow(self, part: object, unit: int) -> None:
        """Evict `part` (a KV block) by the next use of unit `unit`, as the unit's own partition is. While that
        unit computes, a followed partition it has not used since it was entered is needed now (its layer's
        update is still to come), not at the unit's next use, a whole pass away: the units read ahead meanwhile
        must not evict it (they did, and each decoding step read a KV cache under a tight budget 1.7 times)."""
        self._unit_of[id(part)] = unit

    def ran_this_pass(self) -> set[int]:
        """The units entered since the model's forward last began."""
        return {i for i, at in self._entered_at.items() if at >= self.pass_clock}

    def entered_at(self, unit: int) -> int | None:
        """The swapper's clock when unit `unit` was entered, while it computes; None when it does not."""
        return self._entered_at.get(unit) if self.units[unit].depth > 0 else None

    def unfollow(self, part: object) -> None:
        self._unit_of.pop(id(part), None)

    def reset_stats(self) -> None:
        if self.activations is not None:
            self.activations.reset_stats()
        if self.kv is not None:
            self.kv.reset_stats()
        self.stall_seconds = 0.0
        if self.optimizer is not None:
            self.optimizer.wait_seconds = 0.0
        self.prefetch_hits = self.prefetch_misses = self.passes = 0
        self.schedule.hits = self.schedule.misses = self.schedule.retraces = 0

    def hold(self, indices: list[int]) -> None:
        """Acquire units outside any forward (for `OffloadHandle.gathered`)."""
        for i in indices:
            self.enter(i)

    def let_go(self, indices: list[int], *, dirty: bool = False) -> None:
        """Release what `hold` acquired; `dirty`: the parameters were changed."""
        for i in reversed(indices):
            self.exit(i, dirty=dirty)
