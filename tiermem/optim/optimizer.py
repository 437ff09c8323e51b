"""TieredOptimizer: a torch.optim optimizer whose gradients and states live in tiers, not on the device.

# [Note: training state per unit]
For every unit with trainable parameters there are up to three partitions, each laid out in the same
order (parameters sorted by optimizer param group), so that one param group of one unit is one
contiguous range in each of them:
- the parameters themselves (home `params.tier`), which are also the fp32 master weights when the
  parameters are fp32;
- the gradient accumulators, fp32 (home `grads.tier`): a unit's gradients are added here as soon as
  autograd has accumulated them, and the device copy is dropped;
- the optimizer state (home `optimizer.tier`): what the optimizer keeps per element (exp_avg / exp_avg_sq
  for Adam and AdamW, max_exp_avg_sq with amsgrad; momentum_buffer for SGD with momentum; square_avg for
  RMSprop; ...), or for a per-parameter optimizer whatever tensors it keeps per parameter, in their own
  shapes and dtypes (Adafactor's row and column, bitsandbytes' uint8 states), and fp32 master weights when
  the parameters are bfloat16/float16.
Updating walks the units in order: while unit i is updated on the CPU, unit i+1's partitions are being
read and unit i-1's written back (when: see [Note: lazy update]). The update itself is the user's optimizer
class stepping the flat fp32 range of each param group, or each parameter with its own shape (see [Note:
which optimizers]), so its arithmetic is its own. On the flat path a param group whose parameters did not all
get a gradient, or whose step counts or scalars differ, is updated tensor by tensor instead, exactly as torch
skips parameters without a gradient.

# [Note: lazy update]
With `optimizer.update: lazy` (the default) `step()` updates nothing: it records, for each unit with
gradients, which parameters have one and the step's settings as they are at that moment (every param
group's hyperparameters, lr included and tensors copied, so a scheduler stepping afterwards, even in place
on a tensor lr, changes only the next step; and the factor that clipping and the float16 loss scale
apply). Each unit is updated when it is next fetched (`apply_pending`, called by the runtime before the
unit's parameters go to the device), so the state's reads and writes hide behind the next forward, which
reads that unit anyway: its parameters are updated in host memory and used at once instead of being
written back and read again. Anything else that reads weights or state first applies what is pending
(`flush`): `tm.gathered()`, `state_dict()`, checkpoints, leaving the context. The arithmetic is the same
as updating in `step()`: the same kernels on the same gradients with the same settings, in the same order
per parameter. A unit always comes back to the device before its gradients can change (backward fetches it
first), so a recorded update always finds the gradients it was recorded for; a second `step()` before that
applies the first update, then records. The update could instead run during backward, but clipping needs
the global norm and accumulation the last micro-batch before any unit may be updated; updating lazily
needs neither. It costs memory, not arithmetic: every unit's gradients live from its backward until the
next forward reaches it, where an update during backward gave each unit's back at once. With a host budget
that cannot hold them and the read-ahead too, more is read again (measured in docs/benchmarks.md). A
unit's accumulators are given back as soon as its update is applied.

# [Note: updated state written in backward]
The forward carries every lazy update, and the disk shares its bandwidth between reads and writes (fio on this
project's machines: 1.46 GB/s reading alone, 0.75 + 0.75 mixed), so a state written during the forward slows
the reads the forward waits for, while the backward's disk is mostly idle. And a state freed once written must
be read again next step even where the host pool had room to keep it: with a budget of 1.25 GiB against 1.46
GB of training state, every byte of the 0.7 GB of Adam state went out and back each step, where the plan
counted 0.19 GB. So after an update applied in the forward, the state stays in host memory, dirty, when no
read-ahead is waiting for room and its arena has (prefetch.depth + 1) times its size free besides
(`TensorSwapper.room_to_spare`): each update of the window needs about as much for its own state. Otherwise it
is written and freed at once, as before. Asking only for a free piece of one state's size, the training bench
at its 544 MiB budget kept 3-4 of its 13 units' states a step, in room the next units' reads needed, and its
steps took 5% longer than before in 4 alternating pairs (the same bytes moved; within this machine's spread).
With the window counted it keeps none there, as before, and at 1.25 GiB it keeps 10-11 of 13. A state kept so
is written when its unit's backward begins (`write_back_updated`), one unit at a time while backward computes,
and stays cached, clean, for the next step's update if nothing needs the room first. Unless it stayed in host
memory from the update before to this one: then the room held, it is likely to hold again, and writing it
would only cost the bandwidth, so it stays dirty. When something needs the room before its next update,
evicting it writes it then (a read-ahead parks until the write frees the room), and at its next update it
counts as not having stayed, so in the backward after that it is written ahead again. Every dirty state is
written by `flush`, checkpoints and exit as before, so nothing depends on when.

The unit's parameters, which the same update changes, go the same way: written as the unit's backward begins
(the backward reads them, never changes them), cached clean, unless they stayed in host memory from the last
update to this one. Before, they stayed dirty until something needed their room: at 2 ranks on the training
bench that was the reads of the next forward's first states after `step()`, which then waited behind five
write-backs of 14 MB each, with the disk idle through the backward just before. Written in backward, with the
next pass's states read there too ([Note: the state before step()] in tiermem/runtime/runtime.py), the
updates' waits fell from 68-87 ms a rank and step to 13-20 ms, for 2-4% more bytes written (the parameters of
units whose room would have held until their next update).

# [Note: accumulators handed out unzeroed]
With lazy updates a unit's accumulators are discarded once its update is applied, and come back in its next
backward. Handing them out as zeros cost a pass over all of them each step (the training bench: 366 MB, 24
ms of a 0.93 s step) that the backward then overwrites: the first micro-batch copies each gradient into its
view, and with several ranks or a device with memory of its own one copy fills every byte. So they are
discarded with `zeros=False` and come back as the pool has them; the unit's state says so (`grads_unset`),
and when the backward lets them go the bytes it did not write (the gaps between tensors, the padding, the
parameters that got no gradient) are zeroed (`_zero_outside`), so that from then on they hold what zeroed
accumulators would. Nothing reads them before that: the norm, the finite check and the update read only
the parameters with a gradient, and only after the backward.

Only a unit none of whose accumulators holds a gradient yet takes a micro-batch's gradients as one copy over
the whole partition (zeros for the parameters it has none of); once any holds one, each later micro-batch is
added, also where it gives gradients only to parameters the earlier ones gave none (a mixture of experts
sending two micro-batches to different experts of one layer). Copying over them then, as the code did while
the test was whether this micro-batch's parameters had one, zeroed the earlier micro-batches' gradients on a
device with memory of its own and with several ranks. With several ranks on the CPU that first copy is not
made at all: the reduce-scatter's output is the accumulators' host buffer itself.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tiermem.device import check_host
from tiermem.distributed import Reducing, finish_scatter_sum, gather_unit, start_scatter_sum
from tiermem.errors import OptimizerError
from tiermem.interrupts import deferred_interrupts
from tiermem.optim.loss_scale import LossScale
from tiermem.runtime.unit import Unit
from tiermem.sizes import format_size, format_size_up
from tiermem.swap import Layout, Partition, TensorSwapper, Tier, room_needed
from tiermem.trace import Tracer

log = logging.getLogger(__name__)

# [Note: which optimizers]
# Two ways to run the user's optimizer class on a unit, both its own `step()` code, so its arithmetic is its own:
# - flat (`_apply`): torch.optim's elementwise classes (SUPPORTED_OPTIMIZERS) step one flat range of many
#   parameters at once, in pieces of `_CHUNK` elements. That is what torch would compute parameter by parameter
#   only because each element's new value and state depend on that element alone, plus per-parameter scalars
#   (a step count, NAdam's mu_product, ASGD's eta and mu) equal across the range.
# - per parameter (`_update_params`): any other optimizer (transformers' Adafactor, bitsandbytes' 8-bit ones,
#   lion_pytorch's Lion, torch's Adafactor and Muon, a subclass of torch's) steps the unit's parameters with
#   their own shapes: fp32 views of the parameters (or of the fp32 masters) with `.grad` set to views of the
#   accumulators, and its state views of the state partition. The instance stepping them is a shell of the
#   user's (`_shell`: the same class and attributes, so bitsandbytes' min_8bit_size or percentile clipping come
#   along, with its own state and one param group). What it keeps per parameter is found before the first
#   step by stepping a shell twice on a scratch parameter of the same shape (`_probe_param`): its tensors
#   (shape and dtype: Adafactor's row and column, bitsandbytes' uint8 states, their 256-entry qmaps and absmax
#   blocks) get slots in the state partition; its numbers and 0-dim tensors (step counts, Adafactor's RMS) are
#   kept beside it, as they are. Its `state_dict()` is its class's own, made by a shell holding the whole
#   state, and loads into it in memory and back. This is exact when each parameter's update reads only its own
#   gradient, state and group settings. What the probe finds otherwise is refused naming it: state whose
#   shapes change between steps, state that is neither a tensor nor a number, a step that changes its param
#   group's settings or counts in the optimizer object itself (one shell per unit would lose it), a step
#   that fails on one parameter alone. So are, by name, those whose update couples parameters of different
#   units (`_COUPLED`), and with several ranks any per-parameter optimizer: each rank holds a chunk of every
#   parameter ([Note: sharding] in tiermem/distributed.py), and a factored or blockwise state needs it whole.
SUPPORTED_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop,
                        torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam,
                        torch.optim.RAdam, torch.optim.Rprop, torch.optim.ASGD)
_COUPLED = {  # by class name: their update couples parameters across units
    "LBFGS": "it keeps a history over all parameters at once and re-evaluates the model in a closure",
    "SparseAdam": "it takes sparse gradients, and the accumulators hold dense ones",
    "Prodigy": "it estimates its step size from sums over every parameter of a param group",
    "DAdaptAdam": "it estimates its step size from sums over every parameter of a param group",
    "DAdaptAdaGrad": "it estimates its step size from sums over every parameter of a param group",
    "DAdaptAdan": "it estimates its step size from sums over every parameter of a param group",
    "DAdaptLion": "it estimates its step size from sums over every parameter of a param group",
    "DAdaptSGD": "it estimates its step size from sums over every parameter of a param group",
}
_OWN_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict")  # set on the user's instance inside the context
_CHUNK = 1 << 20  # elements per call of the optimizer: bounds its temporaries (4 MiB each in fp32)


def unsupported(optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why this optimizer cannot train under tiered_offload, with the fix; None when it can (or is None).
    Only optimizers whose update couples parameters across units are refused by name here; the others are
    checked at entry by what their step keeps (`_probe_param`)."""
    kind = type(optimizer)
    if optimizer is None or kind in SUPPORTED_OPTIMIZERS:
        return None
    why = _COUPLED.get(kind.__name__)
    if why is None:
        return None
    names = ", ".join(c.__name__ for c in SUPPORTED_OPTIMIZERS)
    return (f"optimizer: {kind.__module__}.{kind.__name__} is not supported under tiered_offload ({why}); use one "
            f"of torch.optim's {names}, or another optimizer that updates each parameter from its own gradient and "
            "state (transformers' Adafactor, bitsandbytes' 8-bit optimizers, Lion: see \"Optimizers\" in "
            "docs/architecture.md)")


def elementwise(kind: Any) -> bool:
    """Whether `kind` is updated on flat ranges of many parameters (else per parameter: [Note: which
    optimizers])."""
    return kind in SUPPORTED_OPTIMIZERS


def _settings(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's settings as the update passes them: the update runs on host tensors outside autograd
    and outside CUDA graphs, so never differentiable or capturable."""
    out = {k: v for k, v in group.items() if k != "params"}
    for key in ("capturable", "differentiable"):
        if key in out:
            out[key] = False
    return out


def _hashable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    return v if isinstance(v, (int, float, bool, str, type(None))) else repr(v)


@functools.lru_cache(maxsize=256)
def _probe(kind: Any, key: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, ...], tuple[tuple[str, torch.dtype], ...]]:
    """The state `kind` keeps per parameter with these settings, found by stepping it twice on a small tensor:
    (elementwise kinds, each the parameter's shape; per-parameter scalars with their dtypes), in torch's order."""
    p = torch.zeros(2)
    opt = kind([{**dict(key), "params": [p]}])
    for _ in range(2):
        p.grad = torch.ones(2)
        _step_without_hooks(opt)
    kinds, scalars = [], []
    for name, v in opt.state[p].items():
        if isinstance(v, torch.Tensor) and v.shape == p.shape:
            kinds.append(name)
        elif isinstance(v, torch.Tensor) and v.dim() == 0:
            scalars.append((name, v.dtype))
        elif v is not None:
            raise OptimizerError(f"optimizer: {kind.__name__} keeps {name!r} of type {type(v).__name__} per parameter, "
                                 "which tiered_offload cannot keep in tiers")
    return tuple(kinds), tuple(scalars)


def _state_of(kind: Any, group: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, torch.dtype]]:
    """What `_probe` says of one param group (its settings decide, e.g. amsgrad or momentum)."""
    settings = _settings(group)
    kinds, scalars = _probe(kind, tuple(sorted((k, _hashable(v)) for k, v in settings.items())))
    return kinds, dict(scalars)


def own_attributes(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The user's optimizer's attributes a shell of it takes (`_shell`): all but its state, its param groups and
    the methods tiered_offload sets on it inside the context."""
    return {k: v for k, v in optimizer.__dict__.items() if k not in ("state", "param_groups", *_OWN_METHODS)}


def _shell(kind: Any, attrs: Mapping[str, Any], groups: list[dict[str, Any]],
           state: Mapping[Any, dict[str, Any]] | None = None) -> torch.optim.Optimizer:
    """An instance of `kind` with the user's instance's attributes (`own_attributes`: its constructor's settings
    that no param group holds, such as bitsandbytes' min_8bit_size) but these param groups and this state; no
    constructor runs, so it allocates nothing."""
    opt: torch.optim.Optimizer = object.__new__(kind)
    opt.__dict__.update(attrs)
    opt.state = defaultdict(dict, state or {})
    opt.param_groups = groups
    return opt


@dataclass(frozen=True)
class ParamState:
    """What a per-parameter optimizer keeps for a parameter of one shape ([Note: which optimizers])."""

    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (key, shape, dtype): slots in the partition
    scalars: tuple[tuple[str, Any], ...]  # (key, int, float, bool or the dtype of a 0-dim tensor): kept aside
    order: tuple[str, ...]  # every key in the order the optimizer makes them (its state_dict's)

    def scalar_type(self, key: str) -> Any:
        return dict(self.scalars).get(key, float)


def _describe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype) if v.dim() else v.dtype
    if isinstance(v, (bool, int, float)):
        return type(v)
    return None


def _probe_param(kind: Any, attrs: Mapping[str, Any], settings: dict[str, Any], shape: tuple[int, ...]) -> ParamState:
    """The state `kind` keeps for one fp32 parameter of `shape` with these settings, found by stepping a shell of
    the user's optimizer twice on a scratch one; an OptimizerError naming why its state cannot be kept in tiers
    or its update not run unit by unit."""
    name = f"{kind.__module__}.{kind.__name__}"
    fix = "use an optimizer that updates each parameter from its own gradient and state (see \"Optimizers\" in " \
          "docs/architecture.md)"
    gen = torch.Generator().manual_seed(0)
    p = torch.zeros(shape)
    opt = _shell(kind, attrs, [{**settings, "params": [p]}])
    numbers = {k: v for k, v in opt.__dict__.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    seen = []
    try:
        for _ in range(2):
            p.grad = torch.randn(shape, generator=gen)
            _step_without_hooks(opt)
            seen.append({k: _describe(v) for k, v in opt.state.get(p, {}).items()})
    except Exception as exc:  # noqa: BLE001 - its own step's error, named
        raise OptimizerError(f"optimizer: {name} could not step one parameter of shape {list(shape)} alone "
                             f"({type(exc).__name__}: {exc}), as tiered_offload runs it unit by unit; {fix}") from exc
    changed = sorted(k for k, v in opt.param_groups[0].items() if k != "params" and _hashable(v) !=
                     _hashable(settings.get(k)))
    counted = sorted(k for k, v in numbers.items() if opt.__dict__.get(k) != v)
    bad = [k for k, v in seen[-1].items() if v is None]
    why = None
    if seen[0] != seen[1]:
        why = f"the state it keeps per parameter changes between steps ({seen[0]} after one, {seen[1]} after two)"
    elif bad:
        kept = type(opt.state[p][bad[0]]).__name__
        why = f"it keeps {bad[0]!r} per parameter as a {kept}, neither a tensor nor a number"
    elif changed:
        why = f"its step changes its param group's {changed[0]!r}, which couples every parameter of the group"
    elif counted:
        why = f"its step counts in the optimizer object itself ({counted[0]!r}), not per parameter"
    if why is not None:
        raise OptimizerError(f"optimizer: {name} is not supported under tiered_offload: {why}; {fix}")
    tensors = tuple((k, d[0], d[1]) for k, d in seen[-1].items() if isinstance(d, tuple))
    scalars = tuple((k, d) for k, d in seen[-1].items() if not isinstance(d, tuple))
    return ParamState(tensors, scalars, tuple(seen[-1]))


def _number(v: Any) -> int | float:
    """A scalar state value as JSON keeps it (for checkpoints)."""
    if isinstance(v, torch.Tensor):
        return float(v) if v.is_floating_point() else int(v)
    return int(v) if isinstance(v, bool) else v


def _as_kept(v: Any, kind: Any) -> Any:
    """A scalar read back from a checkpoint, as the optimizer keeps it (`ParamState.scalars`)."""
    if isinstance(kind, torch.dtype):
        return torch.tensor(v, dtype=kind)
    return kind(v)


def _copy(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


@dataclass
class GroupRange:
    """One param group's parameters inside a unit: their FQNs in layout order."""

    group: int
    fqns: list[str]


@dataclass(frozen=True)
class StepSettings:
    """What a step's update uses beyond gradients and state, as it was when `step()` was called."""

    groups: list[dict[str, Any]]  # each param group's settings but "params"
    factor: float  # the gradients' multiplier: clip coefficient / loss scale


@dataclass
class UnitOptimState:
    """The training state of one unit: which parameters train, and the partitions holding their state."""

    unit: Unit
    trainable: list[tuple[str, nn.Parameter, int]]  # (FQN, Parameter, param-group index), layout order
    grads: Partition
    state: Partition | None
    ranges: list[GroupRange]
    steps: dict[str, int] = field(default_factory=dict)  # optimizer steps taken per parameter
    # per-parameter scalar state other than the step count (NAdam's mu_product, ASGD's eta and mu); for a
    # per-parameter optimizer every number or 0-dim tensor it keeps, as it keeps them (its own step count too)
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    # a per-parameter optimizer's state per parameter, by FQN ([Note: which optimizers]); empty on the flat path
    own: dict[str, ParamState] = field(default_factory=dict)
    has_grad: set[str] = field(default_factory=set)  # parameters with a gradient since zero_grad
    grads_held: bool = False  # the accumulators are acquired for the backward in progress
    # discarded unzeroed ([Note: accumulators handed out unzeroed]): the bytes outside has_grad's views are
    # zeroed when the backward lets them go
    grads_unset: bool = False
    on_device: dict[str, torch.Tensor] = field(default_factory=dict)  # fresh gradients still in device memory
    params_end: int = 0  # the update changes no byte of the unit's partition past this (frozen ones come last)
    # [Note: updated state written in backward]: the state's `host_loads` when its last update kept it dirty in
    # host memory (None: written at once), and whether at that update it had stayed there since the one before
    kept_in: int | None = None
    stayed: bool = False
    # the same for the unit's parameters, which every update leaves dirty in host memory
    params_kept_in: int | None = None
    params_stayed: bool = False


@dataclass(frozen=True)
class StateTensor:
    """One tensor of optimizer state, as a checkpoint names and finds it (`TieredOptimizer.state_tensors`)."""

    name: str  # "<parameter>::<kind>", its name in a checkpoint
    unit: int  # the unit whose state partition holds it (`TieredOptimizer.state_partition`)
    slot: str  # its slot in that partition, "<kind>.<parameter>"
    shape: tuple[int, ...]  # the whole tensor's shape (with several ranks a partition holds a chunk of it)
    dtype: torch.dtype = torch.float32  # bitsandbytes' 8-bit states are uint8


class TieredOptimizer(torch.optim.Optimizer):
    """Stands in for the user's optimizer (one of `SUPPORTED_OPTIMIZERS`) inside `tiered_offload` (`tm.optimizer`).

    `param_groups` are the original optimizer's own dicts, so changing an lr (by hand or with a
    torch.optim.lr_scheduler) takes effect. `step()`, `zero_grad()`, `state_dict()` and
    `load_state_dict()` behave as the original's, with the state kept in tiers.
    """

    def __init__(self, original: torch.optim.Optimizer, units: list[Unit], swapper: TensorSwapper,
                 mixed: bool, loss_scaling: bool = False, on_record: Callable[[], None] | None = None,
                 model_order: Iterable[nn.Parameter] = ()) -> None:
        refused = unsupported(original)
        if refused is not None:
            raise OptimizerError(refused)
        super().__init__([{**g, "params": list(g["params"])} for g in original.param_groups], original.defaults)
        self.original = original  # whose param_groups are ours from now on (see `param_groups`)
        # each parameter's place in model.parameters(), the order torch's clip_grad_norm_ stacks the norms in (a
        # unit's partitions hold the parameters by param group: see offload's [Note: training state per unit])
        self.model_rank = {id(p): i for i, p in enumerate(model_order)}
        self.kind: Any = type(original)  # the user's optimizer's class, whose step runs on each unit
        self.elementwise = elementwise(self.kind)  # updated on flat ranges, else per parameter
        self.attrs = own_attributes(original)  # what a shell of it takes (`_shell`), as it is before entry
        self.swapper = swapper
        self.mixed = mixed  # parameters are bf16/fp16: keep fp32 master weights in the state partition
        self._clip_scale: float | None = None  # clip_grad_norm_'s factor, applied to gradients at step
        self.loss_scale = LossScale(loss_scaling)  # float16's dynamic loss scale (tiermem/optim/loss_scale.py)
        self.found_inf = False  # an inf/nan gradient arrived since zero_grad: the next step is skipped
        self._grads_agreed = True  # several ranks: every rank's has_grad is the union since the last gradients
        # torch.amp.GradScaler's unscale_ of this step's gradients (see [Note: torch's loop helpers inside the
        # context] in tiermem/optim/loop_helpers.py): the factor the step multiplies them by; and whether
        # gradients are checked for inf/nan as they arrive (for the loss scale, tiermem's or GradScaler's)
        self.unscaled_by = 1.0
        self.check_finite = loss_scaling
        self.lazy = swapper.config.optimizer.update == "lazy"  # see [Note: lazy update]
        self.pending: dict[int, tuple[StepSettings, frozenset[str]]] = {}  # unit -> its recorded update
        self.on_record = on_record  # called when step() has recorded updates: start reading what comes first
        self.tracer: Tracer | None = None  # see [Note: traces] in tiermem/trace.py
        self.wait_seconds = 0.0  # time updates waited for their partitions' reads (tm.stats' update_wait_seconds)
        # several ranks: the unit whose gradients' reduce-scatter is in flight (see finish_grads)
        self._reducing: tuple[UnitOptimState, list[str], torch.Tensor, Reducing] | None = None
        self.index_of: dict[int, int] = {}  # id(param) -> index in torch's state_dict numbering
        self.group_of: dict[int, int] = {}
        for g, group in enumerate(original.param_groups):
            for p in group["params"]:
                self.group_of[id(p)] = g
                self.index_of[id(p)] = len(self.index_of)
        self.units: list[UnitOptimState] = []
        self.by_unit: dict[int, UnitOptimState] = {}
        known = {id(p) for u in units for _, p in u.params}
        stray = [p for p in self.group_of if p not in known]
        if stray:
            raise OptimizerError("optimizer: it holds parameters that are not in the offloaded model; build it on "
                                 "model.parameters() (or groups of them)")
        if not self.elementwise and any(u.ranks.sharded for u in units):
            raise OptimizerError(
                f"optimizer: {self.kind.__module__}.{self.kind.__name__} is not supported with several ranks: each "
                "rank holds a chunk of every parameter, and it is updated per parameter, on whole tensors (a "
                "factored or blockwise state, a matrix orthogonalized); train on one rank, or use one of "
                "torch.optim's elementwise optimizers (see \"Optimizers\" in docs/architecture.md)")
        plans = []
        for unit in units:
            trainable = [(fqn, p, self.group_of[id(p)]) for fqn, p in unit.params
                         if p.requires_grad and id(p) in self.group_of]
            if trainable:
                plans.append((unit, trainable, *self._layouts(unit, trainable)))
        self.grads_tier, self.grads_why = self._choose_grads_tier(units, plans)
        self._check_budget(units, plans)
        swapper.evict_idle()  # host-homed state packs at the top of an empty pool, leaving the rest in one piece
        # host-homed partitions first, all of them, so they sit together at the top of the pool
        cfg = swapper.config
        made: dict[tuple[int, str], Partition | None] = {}
        for kind in sorted(("grads", "state"), key=lambda k: (self.grads_tier if k == "grads" else
                                                             cfg.optimizer.tier) != "cpu"):
            for unit, trainable, grad_specs, state_specs in plans:
                made[unit.index, kind] = (self._make_grads(unit, grad_specs) if kind == "grads"
                                          else self._make_state_part(unit, trainable, state_specs))
        for unit, trainable, _, _ in plans:
            grads = made[unit.index, "grads"]
            assert grads is not None
            st = self._unit_state(unit, trainable, grads, made[unit.index, "state"])
            self.units.append(st)
            self.by_unit[unit.index] = st
        # id of a state or accumulator partition -> its unit, whose update reads it (the runtime's next use)
        self.part_unit = {id(p): st.unit.index for st in self.units for p in (st.grads, st.state) if p is not None}
        if original.state:
            self.load_state_dict(original.state_dict())

    # -- set-up -------------------------------------------------------------------------------------
    def _host_need(self, units: list[Unit], plans: list[Any], grads_tier: str) -> tuple[int, int]:
        """(bytes that stay in the host pool for good, bytes a unit's step needs besides, whatever the placement
        of pieces in the pool: `room_needed`) with gradients in `grads_tier`. A unit's update holds its
        parameters, gradients and state at once; backward its parameters and gradients, plus a staging copy
        of them where the device has memory of its own."""
        cfg = self.swapper.config
        params_in_host = cfg.params.tier == "cpu" or (cfg.params.tier == Tier.DEVICE
                                                    and not self.swapper.mover.has_own_memory)
        in_host = {"params": params_in_host, "grads": grads_tier == "cpu", "state": cfg.optimizer.tier == "cpu"}
        permanent = sum(u.partition.size for u in units) if in_host["params"] else 0
        working = 0
        for unit, _, grad_specs, state_specs in plans:
            sizes = {"params": unit.partition.size, "grads": Layout.of(grad_specs).size,
                     "state": Layout.of(state_specs).size if state_specs else 0}
            permanent += sum(v for k, v in sizes.items() if in_host[k] and k != "params")
            moving = {k: v for k, v in sizes.items() if not in_host[k] and v}
            update = sorted(moving.values(), reverse=True)  # the order _update_unit takes them
            backward = [moving[k] for k in ("params", "grads") if k in moving]
            if self.swapper.mover.has_own_memory:
                backward.append(sizes["grads"])  # _gradients_to_host's staging buffer
            working = max(working, room_needed(update), room_needed(backward))
        return permanent, working

    def _choose_grads_tier(self, units: list[Unit], plans: list[Any]) -> tuple[str, str]:
        """grads.tier as set, or for `auto`: host memory when every accumulator fits the host budget beside
        the step's working set, else NVMe (with the optimizer state there). Returns (tier, why)."""
        cfg = self.swapper.config
        if cfg.grads.tier != "auto":
            return cfg.grads.tier, "grads.tier"
        if cfg.optimizer.tier != "nvme":
            return "cpu", "auto: optimizer.tier is cpu"
        total = sum(Layout.of(g).size for _, _, g, _ in plans)
        permanent, working = self._host_need(units, plans, "cpu")
        budget = self.swapper.partition_budget
        if permanent + working <= budget:
            return "cpu", f"auto: all {format_size(total)} of accumulators fit the host budget"
        return "nvme", (f"auto: {format_size(total)} of accumulators and a step's {format_size(working)} do not fit "
                        f"{self.swapper.budget_text} together")

    def _check_budget(self, units: list[Unit], plans: list[Any]) -> None:
        """Host-homed partitions stay in the pool for good, and a unit's step needs room besides: the host
        budget must fit both (`_host_need`), or training could not proceed."""
        permanent, working = self._host_need(units, plans, self.grads_tier)
        self.host_permanent, self.host_working = permanent, working
        if permanent + working > self.swapper.partition_budget:
            cfg = self.swapper.config
            raise OptimizerError(
                f"{self.swapper.budget_text} cannot hold the training state: "
                f"{format_size(permanent)} stays in host memory for good (the tiers set to cpu) and a unit's step "
                f"needs {format_size(working)} more for its parameters, gradients and optimizer state (with room "
                "for the pieces in use to split the free memory). Raise memory.host_budget to at least "
                f"{format_size_up(working + permanent + cfg.activations.host_bytes)}, move tiers to nvme, or "
                "use smaller units (wrap.classes)"
            )

    def _layouts(self, unit: Unit, trainable: list[tuple[str, nn.Parameter, int]]) -> tuple[list[Any], list[Any]]:
        # the shapes the unit's partition holds: whole tensors, or with several ranks this rank's chunks
        shapes = {slot.name: slot.shape for slot in unit.partition.layout.slots}
        grad_specs = [(fqn, torch.empty(shapes[fqn], dtype=torch.float32, device="meta")) for fqn, _, _ in trainable]
        if elementwise(self.kind):
            state_specs = [(f"{k}.{fqn}", t) for k in self.state_kinds() for fqn, t in grad_specs]
            return grad_specs, state_specs
        state_specs = [(f"{k}.{fqn}", torch.empty(shape, dtype=dtype, device="meta"))
                       for fqn, _, g in trainable for k, shape, dtype in self._param_state(g, shapes[fqn]).tensors]
        if self.mixed:
            state_specs += [(f"master.{fqn}", t) for fqn, t in grad_specs]
        return grad_specs, state_specs

    def _param_state(self, group: int, shape: tuple[int, ...]) -> ParamState:
        """What the per-parameter optimizer keeps for a parameter of this shape in this param group, probed once
        per shape and settings (`_probe_param`)."""
        settings = _settings(self.param_groups[group])
        key = (tuple(sorted((k, _hashable(v)) for k, v in settings.items())), tuple(shape))
        probed = self.__dict__.setdefault("_probed", {})
        if key not in probed:
            probed[key] = _probe_param(self.kind, self.attrs, settings, tuple(shape))
        kept: ParamState = probed[key]
        return kept

    def state_kinds(self) -> list[str]:
        """The kinds of state kept per parameter, in the order of the state partition's slots: what the optimizer
        keeps elementwise for any of its param groups (exp_avg and exp_avg_sq for Adam, momentum_buffer for SGD
        with momentum, ...; see `_probe`), or the tensors a per-parameter one keeps for any parameter, then fp32
        master weights for bf16/fp16 parameters."""
        kinds: list[str] = []
        if not elementwise(self.kind):
            for st in self.__dict__.get("units", []):
                for ps in st.own.values():
                    kinds += [k for k, _, _ in ps.tensors if k not in kinds]
        for group in self.param_groups if elementwise(self.kind) else []:
            kinds += [k for k in _state_of(self.kind, group)[0] if k not in kinds]
        if self.mixed:
            kinds.append("master")
        return kinds

    def _make_grads(self, unit: Unit, grad_specs: list[Any]) -> Partition:
        part = self.swapper.add(f"{unit.name}#grads", grad_specs, home=self.grads_tier, zero=True)
        if self.lazy:  # held only from the unit's backward to its update (apply_pending), from the first step
            self.swapper.discard(part, zeros=False)
        return part

    def _make_state_part(self, unit: Unit, trainable: list[tuple[str, nn.Parameter, int]],
                         state_specs: list[Any]) -> Partition | None:
        if not state_specs:
            return None
        master_from = unit.partition if self.mixed else None

        def fill(views: dict[str, torch.Tensor]) -> None:
            if master_from is None:
                return
            params = self.swapper.acquire(master_from, Tier.HOST)
            try:
                for fqn, _, _ in trainable:
                    views[f"master.{fqn}"].copy_(params[fqn])
            finally:
                self.swapper.release(master_from, tier=Tier.HOST)

        return self.swapper.add(f"{unit.name}#state", state_specs, home=self.swapper.config.optimizer.tier,
                                zero=True, fill=fill)

    def _unit_state(self, unit: Unit, trainable: list[tuple[str, nn.Parameter, int]], grads: Partition,
                    state: Partition | None) -> UnitOptimState:
        ranges: list[GroupRange] = []
        for fqn, _, g in trainable:
            if not ranges or ranges[-1].group != g:
                ranges.append(GroupRange(g, []))
            ranges[-1].fqns.append(fqn)
        slots = {slot.name: slot for slot in unit.partition.layout.slots}
        end = max(slots[fqn].offset + slots[fqn].nbytes for fqn, _, _ in trainable)
        own = {} if self.elementwise else {fqn: self._param_state(g, slots[fqn].shape) for fqn, _, g in trainable}
        return UnitOptimState(unit, trainable, grads, state, ranges, params_end=end, grads_unset=self.lazy, own=own)

    # -- gradients (called by the runtime during backward) -------------------------------------------
    def accumulate(self, unit_index: int, fqn: str, grad: torch.Tensor) -> None:
        """Take one parameter's fresh gradient: on a device with memory of its own it waits there until the
        unit's backward is over (see `finish_grads`); on the CPU it is added into its fp32 accumulator now."""
        st = self.by_unit[unit_index]
        if self.swapper.mover.has_own_memory or st.unit.ranks.sharded:  # reduce-scattered with the unit's others
            st.on_device[fqn] = grad
            return
        grads = self._hold_grads(st)
        self._add_grads(st, {fqn: grad}, grads)

    def finish_grads(self, unit_index: int) -> None:
        """The unit's backward is over: bring its gradients off the device in one copy, and let its
        accumulators go (written back if their tier is NVMe). With several ranks their reduce-scatter starts
        now and is finished when the next unit's starts, or when backward ends (`settle_grads`): it runs while
        the next unit computes its backward."""
        st = self.by_unit.get(unit_index)
        if st is None:
            return
        if st.on_device and st.unit.ranks.sharded:
            self.settle_grads()
            fresh, st.on_device = st.on_device, {}
            names = list(fresh)
            if self.swapper.mover.has_own_memory or st.has_grad:
                flat = self.swapper.mover.empty(st.grads.size)  # the reduce-scatter writes every byte, gaps as zeros
            else:  # the CPU computing and nothing accumulated yet: the reduce-scatter writes the accumulators
                self._hold_grads(st)
                flat = st.grads.flat(Tier.HOST)
            with torch.no_grad():  # each rank gets its chunks, averaged over the ranks ([Note: sharding])
                self._reducing = (st, names, flat, start_scatter_sum(st.unit.ranks, fresh, st.grads.layout, flat))
            return
        if st.on_device:
            fresh, st.on_device = st.on_device, {}
            flat = self.swapper.mover.empty(st.grads.size).zero_()
            views = st.grads.layout.views(flat)
            with torch.no_grad():
                for fqn, grad in fresh.items():
                    views[fqn].copy_(grad)  # the cast to fp32 runs on the device
            self._gradients_to_host(st, list(fresh), flat)
        self._let_grads_go(st)

    def settle_grads(self, *, discard: bool = False) -> None:
        """Finish the reduce-scatter in flight (several ranks): its unit's gradients go into their
        accumulators. `discard`: a backward that raised; wait
        for the collective, keep nothing."""
        if self._reducing is None:
            return
        st, names, flat, reducing = self._reducing
        self._reducing = None
        finish_scatter_sum(st.unit.ranks, reducing, st.grads.layout, flat)
        if discard:
            if st.grads_held and not st.has_grad:  # it wrote the accumulators themselves: zeroed and let go
                st.grads_unset = True
                self._let_grads_go(st)
            return
        self._gradients_to_host(st, names, flat)
        self._let_grads_go(st)

    def drop_grads(self, unit_index: int) -> None:
        """A backward that raised: forget the unit's fresh gradients (no collective: the other ranks may not
        be here) and let its accumulators go."""
        st = self.by_unit.get(unit_index)
        if st is not None:
            st.on_device = {}
            self._let_grads_go(st)

    def _let_grads_go(self, st: UnitOptimState) -> None:
        if st.grads_held:
            if st.grads_unset:
                _zero_outside(st.grads, st.has_grad)
                st.grads_unset = False
            st.grads_held = False
            self.swapper.release(st.grads, dirty=True)

    def _hold_grads(self, st: UnitOptimState) -> dict[str, torch.Tensor]:
        if not st.grads_held:
            self.swapper.acquire(st.grads, Tier.HOST)
            st.grads_held = True
        return st.grads.tensors(Tier.HOST)

    def _add_grads(self, st: UnitOptimState, fresh: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        """Copy (first micro-batch) or add (later ones) host gradients into the fp32 accumulators."""
        for fqn, grad in fresh.items():
            view = grads[fqn]
            check_host(f"the gradient accumulator of {fqn!r}", view)
            if self.check_finite and not self.found_inf and not bool(torch.isfinite(grad).all()):
                self.found_inf = True
            with torch.no_grad():
                if fqn in st.has_grad:
                    view.add_(grad)
                else:
                    view.copy_(grad)
            st.has_grad.add(fqn)

    def _gradients_to_host(self, st: UnitOptimState, names: list[str], flat: torch.Tensor) -> None:
        """The unit's gradients `names`, in fp32 on the device in one flat buffer laid out as the accumulators,
        in one copy to the host: straight into the accumulators when none of the unit's holds an earlier
        micro-batch's gradient (`flat` may be the accumulators themselves then, written by the reduce-scatter),
        else into a staging buffer from the host pool that is added on the host. Not only `names`: a parameter
        that got a gradient in an earlier micro-batch and none in this one keeps it."""
        if self.check_finite and not self.found_inf and not bool(torch.isfinite(flat.view(torch.float32)).all()):
            self.found_inf = True
        grads = self._hold_grads(st)
        sharded = st.unit.ranks.sharded
        self._grads_agreed = not sharded
        if not st.has_grad:
            host = st.grads.flat(Tier.HOST)
            if flat.data_ptr() != host.data_ptr():
                self._to_host(flat, host)  # every byte, zeros between the tensors
            st.has_grad.update(names)
            st.grads_unset = False
            return
        if sharded and not self.swapper.mover.has_own_memory:  # the CPU: `flat` is host memory already
            _add_whole(st.grads.flat(Tier.HOST), flat)
            st.has_grad.update(names)
            return
        staging = self.swapper.cache.alloc(st.grads)  # a host buffer the accumulators' size, evicting as needed
        try:
            host = staging.tensor()
            self._to_host(flat, host)
            if sharded:  # every rank's chunks, of the parameters this rank got no gradient for as well
                _add_whole(st.grads.flat(Tier.HOST), host)
                st.has_grad.update(names)
            else:
                staged = st.grads.layout.views(host)
                self._add_grads(st, {f: staged[f] for f in names}, grads)
        finally:
            self.swapper.pool.free(staging)

    def _to_host(self, flat: torch.Tensor, host: torch.Tensor) -> None:
        mover = self.swapper.mover
        if mover.has_own_memory:
            mover.synchronize(mover.to_host(flat, host))
        else:  # the CPU device: `flat` is memory of its own only with several ranks
            host[: flat.numel()].copy_(flat)

    def apply_pending(self, unit_index: int) -> None:
        """Apply the unit's recorded update, if any (see [Note: lazy update]); its accumulators then go back
        to their tier at once."""
        rec = self.pending.get(unit_index)
        if rec is None:
            return
        # it leaves `pending` with its arithmetic: an update that could not start (a read, Ctrl-C) stays due
        self._update_many([(self.by_unit[unit_index], *rec)], done=self.pending, give_back=True)

    def _give_back_grads(self, st: UnitOptimState) -> None:
        """A lazily applied update consumed the unit's accumulators: their memory goes to the reads of the
        units after it, unwritten, unless no zero_grad came since step() (the next backward adds to them, as
        torch's does to .grad); those go to NVMe, when that is their tier, until then."""
        if not st.has_grad:
            self.swapper.discard(st.grads, zeros=False)
            st.grads_unset = True
        elif st.grads.home is Tier.NVME:
            self.swapper.evict(st.grads)

    def write_back_updated(self, unit_index: int) -> None:
        """Start writing the unit's optimizer state if its last update left it dirty in host memory, and its
        parameters, which that update changed, each unless at that update it had stayed there since the one
        before; both stay cached (see [Note: updated state written in backward])."""
        st = self.by_unit.get(unit_index)
        if st is None:
            return
        if st.state is not None and st.kept_in is not None and not st.stayed:
            self.swapper.write_back(st.state)
        if st.params_kept_in is not None and not st.params_stayed:
            self.swapper.write_back(st.unit.partition)

    def pending_parts(self, unit_index: int) -> list[Partition]:
        """The partitions the unit's recorded update needs besides its parameters (to read ahead)."""
        if unit_index not in self.pending:
            return []
        st = self.by_unit[unit_index]
        return [st.grads, st.state] if st.state is not None else [st.grads]

    def coming_parts(self, unit_index: int) -> list[Partition]:
        """The partitions of the unit's next update to read ahead before `step()` records it: its state, when
        that lives on NVMe (its accumulators are being filled)."""
        st = self.by_unit.get(unit_index)
        return [st.state] if st is not None and st.state is not None and st.state.home is Tier.NVME else []

    def flush(self) -> None:
        """Apply every recorded update, in unit order (each leaves `pending` once applied, and gives its
        accumulators back at once, as `apply_pending` does)."""
        self._update_many([(self.by_unit[i], *self.pending[i]) for i in sorted(self.pending)], done=self.pending,
                          give_back=True)

    def drop_accumulators(self) -> None:
        """Leaving the context: give back every gradient accumulator's memory (no gradient is given back with
        the parameters; see `_apply_recorded_updates` in tiermem/offload.py)."""
        for st in self.units:
            st.has_grad.clear()
            if st.grads_held:
                continue  # a backward that raised still holds them: they go with the swapper
            try:
                self.swapper.discard(st.grads)
                st.grads_unset = False
            except Exception as exc:  # noqa: BLE001 - the restore goes on; their memory goes at close
                log.warning("leaving tiered_offload: could not drop the gradient accumulators of unit %r: %s",
                            st.unit.name, exc)

    # -- its state, for checkpoints ---------------------------------------------------------------
    def state_tensors(self) -> Iterator[StateTensor]:
        """Every state tensor (moments, momentum, master weights), unit by unit."""
        kinds = self.state_kinds()
        for st in self.units:
            if st.state is None:
                continue
            shapes = dict(zip([f for f, _ in st.unit.params], st.unit.shapes, strict=True))
            if not self.elementwise:  # what each parameter keeps, whole tensors (one rank)
                for fqn, _, _ in st.trainable:
                    for k, shape, dtype in st.own[fqn].tensors:
                        yield StateTensor(f"{fqn}::{k}", st.unit.index, f"{k}.{fqn}", shape, dtype)
                    if self.mixed:
                        yield StateTensor(f"{fqn}::master", st.unit.index, f"master.{fqn}", tuple(shapes[fqn]))
                continue
            for kind in kinds:
                for fqn, _, _ in st.trainable:
                    yield StateTensor(f"{fqn}::{kind}", st.unit.index, f"{kind}.{fqn}", tuple(shapes[fqn]))

    def state_partition(self, unit_index: int) -> Partition:
        """The partition holding the unit's state tensors (acquire it through the swapper)."""
        part = self.by_unit[unit_index].state
        if part is None:
            raise OptimizerError(f"unit {self.by_unit[unit_index].unit.name!r} keeps no optimizer state")
        return part

    def trained(self) -> list[str]:
        """The names of the parameters this optimizer updates."""
        return [fqn for st in self.units for fqn, _, _ in st.trainable]

    def step_counts(self) -> dict[str, int]:
        """Optimizer steps taken, per parameter name (those not yet stepped are absent)."""
        return {fqn: n for st in self.units for fqn, n in st.steps.items()}

    def load_step_counts(self, counts: Mapping[str, int]) -> None:
        """Put back what `step_counts` returned; parameters it does not name have taken no step."""
        for st in self.units:
            st.steps = {f: int(counts[f]) for f, _, _ in st.trainable if f in counts}

    def has_pending(self) -> bool:
        """Whether step() recorded updates that no forward has applied yet (see [Note: lazy update])."""
        return bool(self.pending)

    def drop_pending(self) -> None:
        """Forget the recorded updates: what replaces the weights and state (a loaded checkpoint) wins."""
        self.pending.clear()

    def loss_scale_state(self) -> dict[str, float | int] | None:
        """The dynamic loss scale's state (float16 parameters), for checkpoints; None without loss scaling."""
        return self.loss_scale.state()

    def load_loss_scale_state(self, state: Any) -> None:
        """Put back what `loss_scale_state` returned (nothing to do for None or without loss scaling)."""
        self.loss_scale.load_state(state)

    # the loss scale as GradScaler's users read and set it (tm.optimizer.scale, .growth_interval, ...)
    @property
    def loss_scaling(self) -> bool:
        return self.loss_scale.enabled

    @property
    def scale(self) -> float:
        return self.loss_scale.value

    @scale.setter
    def scale(self, value: float) -> None:
        self.loss_scale.value = value

    @property
    def growth_interval(self) -> int:
        return self.loss_scale.growth_interval

    @growth_interval.setter
    def growth_interval(self, n: int) -> None:
        self.loss_scale.growth_interval = n

    @property
    def skipped_steps(self) -> int:
        return self.loss_scale.skipped

    @skipped_steps.setter
    def skipped_steps(self, n: int) -> None:
        self.loss_scale.skipped = n

    def has_state(self) -> bool:
        """Whether any step has been taken (there is optimizer state worth keeping)."""
        return any(st.steps for st in self.units)

    def progress(self) -> int:
        """Steps taken, summed over parameters: changes whenever the state does (a checkpoint's freshness)."""
        return sum(n for st in self.units for n in st.steps.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients (the accumulators are overwritten by the next backward).

        Their memory stays: allocated afresh during each backward, between the parameters being read, the
        accumulators fragment the host pool, and the step then finds no room for the optimizer state.
        With optimizer.update lazy they are given back instead as each unit's update is applied (in host
        memory or on NVMe): they are held only from the unit's backward to its update.
        """
        for st in self.units:
            st.has_grad.clear()
        self._clip_scale = None
        self.found_inf = False
        self.loss_scale.forget_backwards()
        self.unscaled_by = 1.0

    def unscale_from(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
        """torch.amp.GradScaler.unscale_ of this step's gradients: the step (and clipping's norm) will multiply
        them by `inv_scale`; `found_inf` is set to 1 where one of them is inf or nan, and returned."""
        if self.loss_scaling:
            raise OptimizerError("torch.amp.GradScaler: params.dtype float16 scales the loss itself (tm.backward); "
                                 "drop the GradScaler from the loop, or set params.dtype to bfloat16 or float32")
        self.unscaled_by = float(inv_scale)
        self._agree_grads()
        if not self.check_finite:  # the first time: this step's gradients arrived unchecked
            self.check_finite = True
            self.found_inf = self._any_nonfinite()
        found = self.found_inf
        ranks = self.units[0].unit.ranks if self.units else None
        if ranks is not None and ranks.sharded:  # skipped on every rank, or on none
            found = bool(ranks.all_reduce(torch.tensor([float(found)]), "max")[0])
        found_inf.fill_(float(found))
        return found_inf

    def _any_nonfinite(self) -> bool:
        for st in self.units:
            if not st.has_grad:
                continue
            grads = self.swapper.acquire(st.grads, Tier.HOST)
            try:
                if not all(bool(torch.isfinite(grads[f]).all()) for f in st.has_grad):
                    return True
            finally:
                self.swapper.release(st.grads)
        return False

    def zero_grad_of(self, params: set[int], set_to_none: bool = True) -> None:
        """`module.zero_grad()` inside the context: forget the gradients of the parameters `params` (ids), all of
        them as `zero_grad` does when they are every trainable one, else only theirs."""
        every = {id(p) for st in self.units for _, p, _ in st.trainable}
        if every <= params:
            self.zero_grad(set_to_none)
            return
        for st in self.units:
            st.has_grad.difference_update(f for f, p, _ in st.trainable if id(p) in params)

    def backward_began(self) -> None:
        """A backward reached the model (the runtime's hook): note whether tm.backward scaled its loss."""
        self.loss_scale.backward_began()

    def loss_scale_now(self) -> float:
        """What this step's gradients carry of the loss scale (`LossScale.now`)."""
        return self.loss_scale.now()

    def _agree_grads(self) -> None:
        """With several ranks, a parameter has a gradient when any rank gave it one, as DDP (with
        find_unused_parameters) averages the others' in as zeros: each rank's `has_grad` becomes the union,
        with one all-reduce of a flag per parameter once the last gradients are in (see [Note: sharding]).
        Every rank calls it at the same points (clipping, unscaling, the step), so their collectives match."""
        if self._grads_agreed:
            return
        self._grads_agreed = True
        ranks = self.units[0].unit.ranks
        flags = torch.tensor([float(f in st.has_grad) for st in self.units for f, _, _ in st.trainable])
        got = iter(ranks.all_reduce(flags, "max").tolist())
        for st in self.units:
            st.has_grad.update([f for f, _, _ in st.trainable if next(got)])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Like torch.nn.utils.clip_grad_norm_ over every gradient, wherever it lives; returns the total norm."""
        self._agree_grads()
        self._apply_to_kept_grads()  # the norm is of the gradients as the last step left them, as torch's
        ranked: list[tuple[int, torch.Tensor]] = []
        for st in self.units:
            if not st.has_grad:
                continue
            grads = self.swapper.acquire(st.grads, Tier.HOST)
            try:
                last = len(self.model_rank)
                ranked.extend((self.model_rank.get(id(p), last), torch.linalg.vector_norm(grads[f], norm_type))
                              for f, p, _ in st.trainable if f in st.has_grad)
            finally:
                self.swapper.release(st.grads)
        # in the model's order, as torch stacks them: the total's rounding depends on it
        norms = [n for _, n in sorted(ranked, key=lambda rn: rn[0])]
        scale = self.loss_scale_now() / self.unscaled_by  # what the gradients carry of a loss scale
        ranks = self.units[0].unit.ranks if self.units else None
        if ranks is not None and ranks.sharded:  # each rank has its chunks of every gradient: combine
            if norm_type == float("inf"):
                local = torch.stack(norms).max() if norms else torch.tensor(0.0)
                total = ranks.all_reduce(local.reshape(1).float(), "max")[0] / scale
            else:
                local = torch.stack([n.float() ** norm_type for n in norms]).sum() if norms else torch.tensor(0.0)
                total = ranks.all_reduce(local.reshape(1), "sum")[0] ** (1.0 / norm_type) / scale
        elif not norms:
            return torch.tensor(0.0)
        else:
            total = torch.linalg.vector_norm(torch.stack(norms), norm_type) / scale  # of the unscaled gradients
        coef = float(max_norm) / (total + 1e-6)
        self._clip_scale = float(torch.clamp(coef, max=1.0))
        return total

    # -- the step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every unit with gradients, pipelined: read i+1 | update i | write back i-1."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._agree_grads()
        if self.loss_scaling and self.units and self.units[0].unit.ranks.sharded:  # skip on every rank, or none
            self.found_inf = bool(self.units[0].unit.ranks.all_reduce(torch.tensor([float(self.found_inf)]), "max")[0])
        scale = self.loss_scale_now()
        applied = self.loss_scale.applied()  # tm.backward scaled this step's losses
        self.loss_scale.forget_backwards()
        # a fused optimizer under GradScaler is given its scale and inf flag as attributes, as torch's fused
        # kernels take them (see [Note: torch's loop helpers inside the context])
        given_scale = self.original.__dict__.get("grad_scale")
        given_inf = self.original.__dict__.get("found_inf")
        if given_inf is not None and float(given_inf) != 0.0:
            self._clip_scale, self.unscaled_by = None, 1.0
            return loss
        if given_scale is not None:
            scale *= float(given_scale)
        scale /= self.unscaled_by
        self.unscaled_by = 1.0
        if self.loss_scaling and self.found_inf:  # as GradScaler: skip the step, lower the scale
            self.loss_scale.update(True, applied)
            self._clip_scale = None
            log.info("inf/nan gradients: step skipped, loss scale now %g", self.scale)
            return loss
        settings = StepSettings([_snapshot(g) for g in self.param_groups], (self._clip_scale or 1.0) / scale)
        self._apply_to_kept_grads()
        todo = [st for st in self.units if st.has_grad]
        if self.lazy:
            for st in todo:
                self.pending[st.unit.index] = (settings, frozenset(st.has_grad))
            if self.on_record is not None:
                self.on_record()
        else:
            self._update_many([(st, settings, frozenset(st.has_grad)) for st in todo])
        self._clip_scale = None
        self.loss_scale.update(False, applied)
        return loss

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the dynamic loss scale for float16, else itself."""
        return self.loss_scale.scale_loss(loss)

    def _apply_to_kept_grads(self) -> None:
        """Apply the recorded updates of units whose gradients were kept since (no zero_grad, no forward):
        a second step() or clip_grad_norm_ before these units came back. The first update goes first, and
        scales those gradients in place (by the clip coefficient, the loss scale) as torch's scale .grad;
        the accumulators stay, since what comes next reads them."""
        again = [st.unit.index for st in self.units if st.has_grad and st.unit.index in self.pending]
        if again:
            self._update_many([(self.by_unit[i], *self.pending[i]) for i in again], done=self.pending)

    def _parts(self, st: UnitOptimState) -> list[Partition]:
        parts = [st.unit.partition, st.grads]
        return parts + [st.state] if st.state is not None else parts

    def _update_many(self, todo: list[tuple[UnitOptimState, StepSettings, frozenset[str]]],
                     done: dict[int, Any] | None = None, give_back: bool = False) -> None:
        """Update units in turn, pipelined: read i+1 | update i | write back i-1; each updated unit leaves
        `done` (the recorded updates) as soon as it is, and with `give_back` its accumulators go at once
        (`_give_back_grads`)."""
        for k, (st, settings, fqns) in enumerate(todo):
            if k + 1 < len(todo):
                for part in self._parts(todo[k + 1][0]):
                    self.swapper.prefetch(part, Tier.HOST)
            self._update_unit(st, settings, fqns, done)
            if st.unit.partition.home is Tier.NVME:
                st.params_kept_in = st.unit.partition.host_loads
            if give_back:
                self._give_back_grads(st)
            if st.state is None or st.state.home is not Tier.NVME:
                continue
            st.kept_in = None
            # [Note: updated state written in backward]
            if give_back and self.swapper.room_to_spare(st.state, self.swapper.config.prefetch.depth + 1):
                st.kept_in = st.state.host_loads
            else:
                self.swapper.evict(st.state)  # write-back starts now, overlapping the next update

    def _update_unit(self, st: UnitOptimState, settings: StepSettings, fqns: frozenset[str],
                     done: dict[int, Any] | None = None) -> None:
        sw = self.swapper
        sw.demote(st.unit.partition)  # a device copy would go stale: the host copy is about to change
        held: list[Partition] = []
        views: dict[str, dict[str, torch.Tensor]] = {}
        try:
            waited = self.tracer.now() if self.tracer is not None else 0.0
            t0 = time.perf_counter()
            if st.state is not None:
                st.stayed = st.state.host is not None and st.state.host_loads == st.kept_in
            own = st.unit.partition
            st.params_stayed = own.host is not None and own.host_loads == st.params_kept_in
            for part in self._update_order(st):
                views[part.name] = sw.acquire(part, Tier.HOST)
                held.append(part)
            self.wait_seconds += time.perf_counter() - t0
            if self.tracer is not None and self.tracer.now() - waited > 1.0:  # its state's reads were waited for
                self.tracer.span("wait", f"wait state {st.unit.name}", waited, unit=st.unit.index,
                                 partitions=[p.name for p in held], kind="state")
            params, grads = views[st.unit.partition.name], views[st.grads.name]
            state = views[st.state.name] if st.state is not None else {}
            check_host(f"the update of unit {st.unit.name!r}", *params.values(), *grads.values(), *state.values())
            began = self.tracer.now() if self.tracer is not None else 0.0
            with deferred_interrupts():  # all of the unit's arithmetic or none: Ctrl-C waits for its end
                if settings.factor != 1.0:  # unscale (float16) and clip, in one pass
                    for f in fqns:
                        grads[f].mul_(settings.factor)
                update = self._update_range if self.elementwise else self._update_params
                for rng in st.ranges:
                    update(st, rng, params, grads, state, settings.groups[rng.group], fqns)
                if done is not None:
                    done.pop(st.unit.index, None)  # applied: never again
            if self.tracer is not None:
                self.tracer.span("optimizer", f"update {st.unit.name}", began, unit=st.unit.index)
        finally:
            for part in held:  # a unit's frozen parameters are not written back (a LoRA base's weights)
                sw.release(part, dirty=part is not st.grads or settings.factor != 1.0,
                           tier=Tier.HOST, dirty_end=st.params_end if part is st.unit.partition else None)

    def _update_order(self, st: UnitOptimState) -> list[Partition]:
        """The order the update takes a unit's partitions in: those in host memory already first (so making
        room for the others never evicts them, to read them again at once), then the largest first, when
        the host budget has room for that order whatever the placement (`room_needed`); else largest
        first, what the entry check counted on (see [Note: host budget])."""
        largest_first = sorted(self._parts(st), key=lambda p: -p.size)
        there = [p for p in largest_first if self.swapper.holds_host(p)]
        order = there + [p for p in largest_first if p not in there]
        if self.host_permanent + room_needed([p.size for p in order]) <= self.swapper.partition_budget:
            return order
        return largest_first

    def _update_range(self, st: UnitOptimState, rng: GroupRange, params: dict[str, torch.Tensor],
                      grads: dict[str, torch.Tensor], state: dict[str, torch.Tensor], group: dict[str, Any],
                      fqns: frozenset[str]) -> None:
        live = [f for f in rng.fqns if f in fqns]
        if not live:
            return
        alike = {(f in st.steps, st.steps.get(f, 0), _values(st.scalars.get(f, {}))) for f in live}
        if len(live) == len(rng.fqns) and len(alike) == 1:
            batches = [rng.fqns]  # the whole range at once, as one flat tensor per kind
        else:
            batches = [[f] for f in live]
        kinds = _state_of(self.kind, group)[0]
        for batch in batches:
            target = state if self.mixed else params
            prefix = "master." if self.mixed else ""
            first = batch[0]
            scalars = self._scalars(st, first, group) if first in st.steps else None
            out = self._apply(group, _flat(target, [prefix + f for f in batch]), _flat(grads, batch),
                              {k: _flat(state, [f"{k}.{f}" for f in batch]) for k in kinds}, scalars)
            extra = {k: v for k, v in out.items() if k != "step"}
            for f in batch:
                st.steps[f] = st.steps.get(f, 0) + 1
                if extra:
                    st.scalars[f] = extra
            if self.mixed:
                for f in batch:
                    params[f].copy_(state[f"master.{f}"])

    def _update_params(self, st: UnitOptimState, rng: GroupRange, params: dict[str, torch.Tensor],
                       grads: dict[str, torch.Tensor], state: dict[str, torch.Tensor], group: dict[str, Any],
                       fqns: frozenset[str]) -> None:
        """The per-parameter path ([Note: which optimizers]): a shell of the user's optimizer steps the range's
        parameters that have a gradient, as fp32 tensors of their own shapes (views of the parameters, or of
        the master weights), their state views of the state partition and the scalars kept aside."""
        live = [f for f in rng.fqns if f in fqns]
        if not live:
            return
        target, prefix = (state, "master.") if self.mixed else (params, "")
        tensors = {f: target[prefix + f] for f in live}
        opt = _shell(self.kind, self.attrs, [{**_settings(group), "params": list(tensors.values())}])
        for f, t in tensors.items():
            t.grad = grads[f]
            if f in st.steps:  # else the optimizer makes its state, as on its first step in memory
                kept = st.scalars.get(f, {})
                opt.state[t] = {k: _copy(kept[k]) if k in kept else state[f"{k}.{f}"] for k in st.own[f].order
                                if k in kept or f"{k}.{f}" in state}
        try:
            _step_without_hooks(opt)
        finally:
            for t in tensors.values():
                t.grad = None
            after = {f: opt.state.pop(t, {}) for f, t in tensors.items()}
            opt.param_groups[0]["params"] = []
        for f in live:
            self._keep(st, f, after[f], state)
            st.steps[f] = st.steps.get(f, 0) + 1
            if self.mixed:
                params[f].copy_(state[f"master.{f}"])

    def _keep(self, st: UnitOptimState, fqn: str, new: Mapping[str, Any], state: dict[str, torch.Tensor]) -> None:
        """Keep what a per-parameter optimizer's step left for one parameter: tensors in their slots (copied
        there if it made new ones), numbers aside; anything the probe did not foresee is an error naming it."""
        ps = st.own[fqn]
        slots = {k: (shape, dtype) for k, shape, dtype in ps.tensors}
        kept: dict[str, Any] = {}
        for k, v in new.items():
            if k in slots:
                view = state[f"{k}.{fqn}"]
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != view.shape or v.dtype != view.dtype:
                    raise OptimizerError(f"optimizer: {self.kind.__name__} kept {k!r} of {fqn!r} as {_describe(v)}, "
                                         f"where its first steps kept {slots[k]}; tiered_offload sizes the state "
                                         "before the first step, and cannot keep state whose shape changes")
                if v.data_ptr() != view.data_ptr():
                    view.copy_(v)
            elif _describe(v) is not None and not isinstance(_describe(v), tuple):
                kept[k] = v.detach() if isinstance(v, torch.Tensor) else v
            else:
                raise OptimizerError(f"optimizer: {self.kind.__name__} kept {k!r} of {fqn!r} as "
                                     f"{_describe(v) or type(v)}, which its first steps did not keep; tiered_offload "
                                     "sizes the state before the first step, and cannot keep state that appears later")
        missing = [k for k in slots if k not in new]
        if missing:
            raise OptimizerError(f"optimizer: {self.kind.__name__} dropped {missing[0]!r} of {fqn!r}, which its first "
                                 "steps kept; tiered_offload cannot keep state that comes and goes")
        if kept:
            st.scalars[fqn] = kept
        else:
            st.scalars.pop(fqn, None)

    def _scalars(self, st: UnitOptimState, fqn: str, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """One parameter's scalar state as torch's optimizer keeps it: its step count as a tensor (for those
        that count) and the rest as kept (`UnitOptimState.scalars`); copies, which the update may change."""
        out = {k: v.clone() for k, v in st.scalars.get(fqn, {}).items()}
        dtype = _state_of(self.kind, group)[1].get("step")
        if dtype is not None:
            out = {"step": torch.tensor(float(st.steps[fqn]), dtype=dtype), **out}
        return out

    def _apply(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor],
               scalars: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The user's optimizer's own step on one flat range, in pieces of `_CHUNK` elements (see [Note: which
        optimizers]): its class, with the recorded settings (foreach and fused as the user chose, a tensor lr a
        tensor, because torch's kernels compute with it in its dtype), so the kernels are the ones it would run.
        `state` holds the range's elementwise state, changed in place; `scalars` the per-parameter scalars
        before the step, or None for a first step, where the optimizer makes its state as torch's would (an
        Adagrad's initial sum, an SGD momentum that starts as the gradient), copied into `state` afterwards.
        Returns the scalars after the step."""
        settings = _settings(group)
        after: dict[str, torch.Tensor] = {}
        for lo in range(0, p.numel(), _CHUNK):
            piece = slice(lo, min(p.numel(), lo + _CHUNK))
            pc, views = p[piece], {k: t[piece] for k, t in state.items()}
            if scalars is None:
                opt = self.kind([{**settings, "params": [pc]}])
            else:
                opt = self._scratch(settings, pc)
                opt.state[pc] = {**{k: v.clone() for k, v in scalars.items()}, **views}
            pc.grad = g[piece]
            try:
                _step_without_hooks(opt)
            finally:
                pc.grad = None
                new = opt.state.pop(pc, {})
                opt.param_groups[0]["params"] = []  # the kept instance holds no view of the pool past the step
            for k, v in views.items():
                t = new.get(k)
                if isinstance(t, torch.Tensor) and t.data_ptr() != v.data_ptr():
                    v.copy_(t)
            after = {k: v for k, v in new.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
        return after

    def _scratch(self, settings: dict[str, Any], p: torch.Tensor) -> torch.optim.Optimizer:
        """An instance of the user's optimizer class that steps one range at a time, made once."""
        opt: torch.optim.Optimizer | None = self.__dict__.get("_scratch_opt")
        if opt is None:
            opt = self.__dict__["_scratch_opt"] = self.kind([{**settings, "params": [p]}])
            opt.state.clear()  # Adagrad makes state in its constructor: the caller puts the range's there
        else:
            opt.param_groups[0] = {**settings, "params": [p]}
        return opt

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The original optimizer's, looked up at each use: lr changes and schedulers act on both, also after
        something gave the original new group dicts (torch's load_state_dict does)."""
        groups: list[dict[str, Any]] = (self.original.param_groups if "original" in self.__dict__
                                        else self.__dict__["_groups"])  # torch's __init__ builds them before it
        return groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if "original" in self.__dict__:
            self.original.param_groups = groups
        else:
            self.__dict__["_groups"] = groups

    # -- torch's state_dict format ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state in torch.optim's format (parameters numbered as in the original optimizer). With several
        ranks every state tensor is whole, gathered from every rank's chunk: each rank must call it, as each
        calls `tm.save_checkpoint` (HF Trainer's checkpoints are seen to: [Note: torch's loop helpers inside the
        context])."""
        return self._state_dict(keep=True)

    def take_part_in_state_dict(self) -> None:
        """With several ranks, take part in the gathers of another rank's `state_dict()`, keeping nothing."""
        self._state_dict(keep=False)

    def _state_dict(self, keep: bool) -> dict[str, Any]:
        self.flush()
        if not self.elementwise:
            return self._own_state_dict()
        state: dict[int, dict[str, Any]] = {}
        for st in self.units:
            if not st.steps:  # the same units on every rank: steps are counted per parameter
                continue
            with self._whole_state(st) as views:
                if not keep:
                    continue
                for fqn, p, g in st.trainable:
                    if fqn not in st.steps:
                        continue
                    group = self.param_groups[g]
                    entry: dict[str, Any] = {**self._scalars(st, fqn, group),
                                             **{k: views[f"{k}.{fqn}"].clone() for k in _state_of(self.kind, group)[0]}}
                    if entry:  # torch keeps none for plain SGD
                        state[self.index_of[id(p)]] = entry
        groups = []
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = [self.index_of[id(p)] for p in group["params"]]
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    def _own_state_dict(self) -> dict[str, Any]:
        """A per-parameter optimizer's state_dict, made by its class's own `state_dict` on a shell holding every
        parameter's state (copies), so its format is the one it has in memory (bitsandbytes wraps its
        quantization state, for one)."""
        entries: dict[nn.Parameter, dict[str, Any]] = {}
        for st in self.units:
            if not st.steps:
                continue
            with self._whole_state(st) as views:
                for fqn, p, _ in st.trainable:
                    if fqn not in st.steps:
                        continue
                    kept = st.scalars.get(fqn, {})
                    entries[p] = {k: _copy(kept[k]) if k in kept else views[f"{k}.{fqn}"].clone()
                                  for k in st.own[fqn].order if k in kept or f"{k}.{fqn}" in views}
        shell = _shell(self.kind, self.attrs, self.param_groups, entries)
        out: dict[str, Any] = self.kind.state_dict(shell)
        return out

    def _load_own_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a per-parameter optimizer's state_dict with its class's own `load_state_dict`, into a shell whose
        parameters are fp32 placeholders (what its tensors are cast to: the fp32 state it steps), then into the
        slots and scalars."""
        stand_in = {id(p): torch.empty(0) for group in self.param_groups for p in group["params"]}
        groups = [{**group, "params": [stand_in[id(p)] for p in group["params"]]} for group in self.param_groups]
        shell = _shell(self.kind, self.attrs, groups)
        try:
            self.kind.load_state_dict(shell, state_dict)
        except (ValueError, KeyError, TypeError) as exc:
            raise OptimizerError(f"load_state_dict: {self.kind.__name__} could not load it ({exc}); load a state_dict "
                                 "of this optimizer with the same param groups") from exc
        for saved, group in zip(shell.param_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for st in self.units:
            loaded = {fqn: shell.state.get(stand_in[id(p)]) for fqn, p, _ in st.trainable}
            if not st.steps and not any(loaded.values()):
                continue  # nothing held, nothing to load
            views = self.swapper.acquire(st.state, Tier.HOST) if st.state is not None else {}
            try:
                for fqn, _, _ in st.trainable:
                    entry = loaded[fqn]
                    st.scalars.pop(fqn, None)
                    if not entry:
                        st.steps.pop(fqn, None)
                        continue
                    ps = st.own[fqn]
                    for k, shape, dtype in ps.tensors:
                        v = entry.get(k)
                        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != dtype:
                            raise OptimizerError(f"load_state_dict: the state {k!r} of {fqn!r} is {_describe(v)}, "
                                                 f"where {self.kind.__name__} keeps {(shape, dtype)}; load a "
                                                 "state_dict of this optimizer with the same settings")
                        views[f"{k}.{fqn}"].copy_(v)
                    slots = {k for k, _, _ in ps.tensors}
                    kept = {k: _copy(v) for k, v in entry.items() if k not in slots}
                    odd = [k for k, v in kept.items() if not isinstance(_describe(v), type | torch.dtype)]
                    if odd:
                        raise OptimizerError(f"load_state_dict: the state {odd[0]!r} of {fqn!r} is "
                                             f"{_describe(kept[odd[0]]) or type(kept[odd[0]]).__name__}, which "
                                             f"{self.kind.__name__} does not keep with these settings; load a "
                                             "state_dict of this optimizer with the same settings")
                    if kept:
                        st.scalars[fqn] = kept
                    step: Any = kept.get("step")
                    st.steps[fqn] = int(step) if _describe(step) not in (None, bool) else st.steps.get(fqn, 0) + 1
            finally:
                if st.state is not None:
                    self.swapper.release(st.state, dirty=True)

    @contextmanager
    def _whole_state(self, st: Any) -> Iterator[dict[str, torch.Tensor]]:
        """The unit's state tensors on the host, whole, while held (none without state): with several ranks
        gathered from every rank into a temporary."""
        part = st.state
        if part is None:
            yield {}
            return
        views = self.swapper.acquire(part, Tier.HOST)
        try:
            if st.unit.ranks.sharded:
                whole = self.state_whole_layout(st.unit.index)
                out = torch.empty(whole.size, dtype=torch.uint8)
                gather_unit(st.unit.ranks, part.flat(Tier.HOST), part.layout, whole, out)
                views = whole.views(out)
            yield views
        finally:
            self.swapper.release(part)

    def state_whole_layout(self, unit_index: int) -> Layout:
        """The layout of the unit's state partition with every tensor whole (with several ranks the partition
        holds a chunk of each)."""
        st = self.by_unit[unit_index]
        shapes = dict(zip([f for f, _ in st.unit.params], st.unit.shapes, strict=True))
        return Layout.of([(slot.name, torch.empty(shapes[slot.name.split(".", 1)[1]], dtype=slot.dtype, device="meta"))
                          for slot in self.state_partition(unit_index).layout.slots])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch.optim-format state dict (e.g. from the original optimizer or `state_dict()`); for a
        per-parameter optimizer, its own class's format."""
        self.flush()
        if not self.elementwise:
            self._load_own_state_dict(state_dict)
            return
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups, strict=True)):
            raise OptimizerError("load_state_dict: the saved param groups do not match this optimizer's")
        for saved, group in zip(groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        for st in self.units:
            if not st.steps and not any(self.index_of[id(p)] in saved_state for _, p, _ in st.trainable):
                continue  # nothing held, nothing to load: its state is not read (and written) for nothing
            views = self.swapper.acquire(st.state, Tier.HOST) if st.state is not None else {}
            try:
                for fqn, p, g in st.trainable:
                    entry = saved_state.get(self.index_of[id(p)])
                    st.scalars.pop(fqn, None)
                    if entry is None:
                        st.steps.pop(fqn, None)
                        continue
                    kinds, scalar_kinds = _state_of(self.kind, self.param_groups[g])
                    for k in kinds:
                        if entry.get(k) is not None:
                            _load_into(views[f"{k}.{fqn}"], entry[k], st.unit.ranks)
                    st.steps[fqn] = int(entry["step"]) if "step" in entry else st.steps.get(fqn, 0) + 1
                    extra = {k: torch.as_tensor(entry[k], dtype=dtype).detach().clone()
                             for k, dtype in scalar_kinds.items() if k != "step" and k in entry}
                    if extra:
                        st.scalars[fqn] = extra
            finally:
                if st.state is not None:
                    self.swapper.release(st.state, dirty=True)

    def scalar_state(self) -> dict[str, dict[str, int | float]]:
        """Per-parameter scalar state other than step counts (NAdam, ASGD; every number a per-parameter optimizer
        keeps), by parameter name, for checkpoints."""
        return {fqn: {k: _number(v) for k, v in kept.items()} for st in self.units for fqn, kept in st.scalars.items()}

    def load_scalar_state(self, saved: Mapping[str, Mapping[str, int | float]]) -> None:
        """Put back what `scalar_state` returned."""
        for st in self.units:
            st.scalars = {}
            for fqn, _, g in st.trainable:
                if not self.elementwise:
                    own = {k: _as_kept(v, st.own[fqn].scalar_type(k)) for k, v in saved.get(fqn, {}).items()}
                    if own:
                        st.scalars[fqn] = own
                    continue
                dtypes = _state_of(self.kind, self.param_groups[g])[1]
                kept = {k: torch.tensor(float(v), dtype=dtypes.get(k, torch.float32))
                        for k, v in saved.get(fqn, {}).items()}
                if kept:
                    st.scalars[fqn] = kept

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "units"):  # torch's __init__ adds the groups; those are ours already
            super().add_param_group(param_group)
            return
        raise OptimizerError("add_param_group is not supported inside tiered_offload; add the group before entering")


def _add_whole(acc: torch.Tensor, src: torch.Tensor) -> None:
    """Add the fp32 accumulators' partition `src` (uint8, laid out as `acc`, at least as long) into `acc`,
    every byte: the gaps hold zeros in both."""
    acc.view(torch.float32).add_(src[: acc.numel()].view(torch.float32))


def _flat(views: dict[str, torch.Tensor], names: Iterable[str]) -> torch.Tensor:
    """One fp32 tensor spanning the named views, which lie in layout order in one buffer."""
    names = list(names)
    first, last = views[names[0]], views[names[-1]]
    if len(names) == 1:
        return first.reshape(-1)
    start = first.data_ptr()
    count = (last.data_ptr() + last.numel() * last.element_size() - start) // first.element_size()
    return first.reshape(-1).as_strided((count,), (1,))


def _zero_outside(part: Partition, names: set[str]) -> None:
    """Zero the bytes of `part`'s host copy that no tensor in `names` covers (`Layout.outside`)."""
    flat = part.flat(Tier.HOST)
    for start, end in part.layout.outside(names):
        flat[start:end].zero_()


def _step_without_hooks(opt: torch.optim.Optimizer) -> None:
    """`opt.step()` without the step hooks torch calls around it: these steps are pieces of the user's one
    step, whose hooks run once around it (`TieredOptimizer.step`), and a global hook (a profiler's, or
    tiermem's own refusal of other optimizers) should not see them."""
    step: Any = type(opt).step
    raw = step.__wrapped__ if getattr(step, "hooked", False) else step  # torch.optim's profile_hook_step
    with torch.no_grad():
        raw(opt)


def _load_into(view: torch.Tensor, value: torch.Tensor, ranks: Any) -> None:
    """Copy a loaded state tensor into its slot: with several ranks a slot holds this rank's chunk, and a
    whole tensor (the user's optimizer's state at entry, an in-memory state_dict) gives it its part."""
    if ranks.sharded and value.shape != view.shape:
        ranks.keep_mine(value, view.reshape(-1))
    else:
        view.copy_(value)


def _values(kept: Mapping[str, torch.Tensor]) -> tuple[tuple[str, float], ...]:
    """Scalar state as values, to tell which parameters may be updated together."""
    return tuple(sorted((k, float(v)) for k, v in kept.items()))


def _snapshot(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's settings but "params", as they are now: tensors (an lr, betas) are copied, because
    torch's schedulers change a tensor lr in place, which would hand a recorded update the next step's."""
    def frozen(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, tuple):
            return tuple(frozen(x) for x in v)
        return v

    return {k: frozen(v) for k, v in group.items() if k != "params"}

