"""`tiermem.plan`: what `tiered_offload` would hold in each tier, whether it fits, and how fast a step could go,
worked out before anything runs.

Example::

    import tiermem
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)    # no bytes allocated
    p = tiermem.plan(model, "configs/nvme.yaml", optimizer="adamw", batch=(2, 128))
    print(p.summary())
    if not p.fits:
        print(p.fixes[0].text)       # e.g. "raise memory.host_budget to at least 7.58 MiB (8MiB)"

# [Note: plans]
A plan takes its figures from the code entry runs, not from a model of it: the units from `plan_units`, each
partition's bytes from `Layout.of` over `_unit_specs` (params.dtype applied, parameters ordered by param group
as entry orders them), the gradient tier from the optimizer's own `_choose_grads_tier` and `_host_need`, the
budget checks from `_check_fits` and `_check_budget` (the errors entry would raise, caught and turned into
fixes), the plan entry logs from `offload._plan`, the device cap from the formula `derive_device_cap` uses,
and the resident units and prefetch depth from `plan_resident`. Those functions take a swapper, units and an
optimizer; the plan hands them stand-ins that carry only the sizes and settings they read (`_Stub`), so no
host pool is mapped, no swap file made and no parameter copied.

What the ledger will count at peak follows from them:
- nvme: every NVMe-homed partition has its extent from entry on (parameters, gradients, optimizer state), so
  the figure is exact; saved activations (activations.tier nvme) add what one pass saves.
- host: the host cache keeps what it has read until the budget needs room, so every partition a pass or step
  touches is held if they all fit the budget, else the pool fills with whole partitions: the most bytes of
  partitions taken in order, cyclically, that fit.
- device: the schedule is replayed on the predicted execution order (the hooked modules in `modules()` order,
  nested hooks held while their children run; a training pass adds backward, the reverse, where a unit is held
  from its first use to its last gradient): at each acquisition the device holds the units in use and the
  window the real `Schedule` returns, except after a step records updates (optimizer.update lazy), when the
  forward's window goes to the host. The order is a prediction: a model whose forward calls its modules out of
  registration order (or one twice) can differ.
- the step-time bound: a pass or step touches every byte of the NVMe partitions it uses; at its start the host
  cache holds at most the budget of them, so at least the rest must be read, and the dirty ones (updated
  parameters and optimizer state) written. Divided by the fastest GB/s `tiermem bench io` measured on the
  drives (see [Note: bench cache] in tiermem/io/bandwidth.py), that is a time no step can beat. With a batch,
  the compute gives a second bound: the matrix products' floating-point operations of one forward of it
  (counted by torch's FlopCounterMode on fake tensors; a training step counts three forwards, backward being
  two), over the best rate a short probe reaches on the compute device (square products of 1024, 1536 and
  2048 in the parameters' dtype, the best of three each; about 0.3 s once per process and device). The
  products a model runs are smaller and its other operations are not counted, so no step beats that either;
  the step's bound is the larger of the two.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MethodType, SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

from tiermem.config import Config, _human_size, load_config
from tiermem.device import resolve_device
from tiermem.distributed import Ranks
from tiermem.errors import BudgetError, OffloadError, OptimizerError
from tiermem.io.bandwidth import GB, cached_bandwidth, path_weights
from tiermem.io.buffers import align_up
from tiermem.offload import (
    _check_fits,
    _choose_activations_tier,
    _plan,
    _plan_text,
    _quantization,
    _rank_paths,
    _unit_specs,
    choose_path_weights,
)
from tiermem.optim import SUPPORTED_OPTIMIZERS, TieredOptimizer
from tiermem.runtime.schedule import Schedule, plan_resident
from tiermem.runtime.wrap import WrapPlan, dtype_of, plan_units
from tiermem.sizes import format_size, parse_size
from tiermem.store import StripeLayout
from tiermem.swap import Layout
from tiermem.swap.transfers import make_mover

log = logging.getLogger(__name__)

__all__ = ["Fix", "Plan", "SwapPath", "plan"]

TIERS = ("device", "host", "nvme")
OPTIMIZER_NAMES = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


@dataclass
class Fix:
    """One change that makes the plan fit: set `key` to `value` (a config value, e.g. "8MiB")."""

    key: str
    """The config key to change, e.g. ``memory.host_budget``, or ``nvme.paths`` for disk space."""

    value: Any
    """A value that fits, as the config takes it (a size string such as ``"8MiB"``), or None when the fix is
    not a value (free disk space)."""

    text: str
    """The fix in words, with the figure it has to reach."""

    problem: str
    """What does not fit, as entry would say it."""


@dataclass
class SwapPath:
    """Swap space one nvme.paths directory needs, and what its filesystem has free."""

    path: str
    needed: int
    """Bytes of swap file in this directory: its stripe chunks of every NVMe extent (see [Note: striping])."""

    free: int | None
    """Bytes free to this user on its filesystem (os.statvfs); None where the filesystem does not say."""

    filesystem: str
    """major:minor of the filesystem; directories on one filesystem share its free space."""


@dataclass
class Plan:
    """What `tiered_offload` would hold and move for a model and config; made by `tiermem.plan`.

    Every byte figure counts what the swapper's ledger counts (partitions, 4 KiB-aligned), so ``peak_bytes``
    compares with ``tm.stats()["peak_bytes"]`` and ``entry`` equals ``tm.plan``.
    """

    config: Config
    """The config planned for (overrides applied)."""

    training: bool
    """An optimizer was given: gradients, optimizer state and a training pass are planned."""

    units: list[tuple[str, int]]
    """Each unit's name and partition bytes, in unit order."""

    kinds: dict[str, dict[str, Any]]
    """Per kind of state (parameters, gradients, master_weights, optimizer_state, activations, buffers): its
    ``tier`` (where it rests) and ``bytes`` (None for activations when they could not be estimated)."""

    tiers: dict[str, dict[str, int]]
    """Per tier, the bytes of each kind resting there (device, host, nvme)."""

    peak_bytes: dict[str, int]
    """Predicted peak of the ledger per tier, as ``tm.stats()["peak_bytes"]`` reports it."""

    device_budget: int | None
    """The device working-set cap: memory.device_budget, or the one the runtime derives from the prefetch
    settings when that is null (``tm.stats()["device_budget"]``)."""

    prefetch_depth: int
    """Units fetched ahead once the first pass is recorded (a resident plan may lower prefetch.depth)."""

    resident_bytes: int
    """Units kept in host memory between inference passes (``tm.stats()["resident_bytes"]``)."""

    entry: dict[str, Any]
    """The plan entry logs (``tm.plan``): bytes and tier of each kind and the host pool's split."""

    swap: list[SwapPath]
    """Swap space per nvme.paths directory (empty without an NVMe tier)."""

    fixes: list[Fix]
    """What does not fit and the change that makes it fit; empty when it fits."""

    nvme_read_bytes: int
    """Bytes a pass (inference) or step (training) must at least read from NVMe, in steady state."""

    nvme_write_bytes: int
    """Bytes a step must at least write to NVMe."""

    bandwidth: dict[str, Any] | None
    """The cached `tiermem bench io` figures for the swap drives (read_gbps, write_gbps, measured), or None."""

    step_seconds_min: float | None
    """A lower bound on a pass's or step's time from the NVMe traffic alone; None when unknown (see
    `step_note`)."""

    step_note: str
    """How the bound was found, or what to run to get one."""

    compute_seconds_min: float | None = None
    """The compute's lower bound on a pass or step (its matrix products at the probe's best rate); None
    without a batch."""

    compute_note: str = ""
    """How the compute bound was found, or why there is none."""

    activations_note: str = ""
    """How the activations were estimated, or why they were not."""

    @property
    def fits(self) -> bool:
        """Whether entry would fit the budgets and the disks (no fixes needed)."""
        return not self.fixes

    @property
    def largest_unit(self) -> tuple[str, int]:
        """The largest unit: its name and bytes."""
        return max(self.units, key=lambda u: u[1], default=("", 0))

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-able values (the config as `Config.to_dict` writes it)."""
        name, size = self.largest_unit
        return {
            "training": self.training,
            "units": len(self.units),
            "largest_unit": {"name": name, "bytes": size},
            "kinds": self.kinds,
            "tiers": self.tiers,
            "peak_bytes": self.peak_bytes,
            "device_budget": self.device_budget,
            "prefetch_depth": self.prefetch_depth,
            "resident_bytes": self.resident_bytes,
            "swap": [dataclasses.asdict(s) for s in self.swap],
            "fits": self.fits,
            "fixes": [dataclasses.asdict(f) for f in self.fixes],
            "nvme_read_bytes": self.nvme_read_bytes,
            "nvme_write_bytes": self.nvme_write_bytes,
            "bandwidth": self.bandwidth,
            "step_seconds_min": self.step_seconds_min,
            "step_note": self.step_note,
            "activations_note": self.activations_note,
            "entry": self.entry,
            "config": self.config.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """The plan for people: a few lines, the fixes last."""
        name, size = self.largest_unit
        lines = [f"tiermem plan ({'training' if self.training else 'inference'}, {self.config.origin})",
                 f"  {len(self.units)} units, largest {name} ({format_size(size)})"]
        for kind, entry in self.kinds.items():
            shown = "unknown" if entry["bytes"] is None else format_size(entry["bytes"])
            lines.append(f"  {kind:<16} {shown:>10} on {entry['tier']}")
        peak = ", ".join(f"{t} {format_size(self.peak_bytes[t])}" for t in TIERS)
        lines.append(f"  peak held: {peak}")
        cap = "none" if self.device_budget is None else format_size(self.device_budget)
        lines.append(f"  device working set: cap {cap}, prefetch depth {self.prefetch_depth}"
                     + (f", {format_size(self.resident_bytes)} kept resident" if self.resident_bytes else ""))
        for s in self.swap:
            free = "free unknown" if s.free is None else f"{format_size(s.free)} free"
            lines.append(f"  swap {s.path}: {format_size(s.needed)} ({free})")
        traffic = (f"NVMe per {'step' if self.training else 'pass'}: at least {format_size(self.nvme_read_bytes)} "
                   f"read, {format_size(self.nvme_write_bytes)} written")
        lines.append(f"  {traffic}")
        bound = self.step_seconds_min
        lines.append(f"  step time >= {bound:.4g} s ({self.step_note})" if bound is not None
                     else f"  step time bound unknown: {self.step_note}")
        if self.compute_seconds_min is not None and bound != self.compute_seconds_min:
            lines.append(f"  compute >= {self.compute_seconds_min:.4g} s ({self.compute_note})")
        if self.activations_note:
            lines.append(f"  activations: {self.activations_note}")
        if self.fits:
            lines.append("  fits: yes")
        else:
            lines.append("  fits: no")
            lines.extend(f"  - {f.text}" for f in self.fixes)
        return "\n".join(lines)


class _Stub(SimpleNamespace):
    """Stands in for a swapper, unit, partition, optimizer or handle in the entry code a plan reuses: only the
    attributes that code reads (see [Note: plans])."""


def plan(model: nn.Module, config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
         optimizer: torch.optim.Optimizer | str | None = None, batch: Any = None,
         checkpoint: str | os.PathLike[str] | None = None, **overrides: Any) -> Plan:
    """Plan `tiered_offload(model, config, optimizer=...)` without running it: see [Note: plans].

    Args:
        model: any nn.Module, on the CPU or the meta device; nothing of it is copied or moved.
        config: what `tiered_offload` takes (YAML path, mapping, Config or None).
        optimizer: a torch.optim.AdamW, Adam or SGD built on the model's parameters, or one of their names
            (``"adamw"``, ``"adam"``, ``"sgd"``: one param group with that optimizer's defaults); None plans
            inference.
        batch: what a step feeds the model, to estimate the activations a training pass saves: a tensor, a
            tuple of tensors, a dict of keyword tensors, or a shape such as ``(2, 128)`` for ``input_ids``.
            The forward runs on fake tensors (shapes without data: no bytes).
        checkpoint: the checkpoint `tiered_offload` would stream from (a model on the meta device); only its
            existence is checked, the shapes come from the model.
        **overrides: dotted config keys, as `tiered_offload` takes them.

    Returns:
        a Plan: ``summary()``, ``to_dict()``, ``fits``, ``fixes``, ``peak_bytes``, ``step_seconds_bound``.
    """
    cfg = _rank_paths(load_config(config, **overrides), Ranks.of(None))
    if checkpoint is not None and not os.path.exists(checkpoint):
        raise OffloadError(f"checkpoint: {os.fspath(checkpoint)} does not exist; pass the .safetensors file or "
                           "its index")
    opt = _optimizer(model, optimizer)
    cfg, activations_why = _choose_activations_tier(cfg, model, opt, Ranks())  # auto settled as entry does
    cfg, weights_why = choose_path_weights(cfg)
    tie = getattr(model, "tie_weights", None)
    if checkpoint is not None and callable(tie):
        tie()  # as entry does for a model built empty
    wrap = plan_units(model, cfg.wrap.classes, cfg.wrap.min_unit_bytes)
    if opt is not None:  # each param group contiguous, as entry orders it
        group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
        for up in wrap.units:
            order = sorted(up.params.items(), key=lambda kv: group_of.get(id(kv[1]), len(group_of)))
            up.params.clear()
            up.params.update(order)
    override = dtype_of(cfg.params.dtype)
    layouts = [Layout.of(_unit_specs(up, override, _quantization(cfg))) for up in wrap.units]
    mover = make_mover(resolve_device(cfg.device))
    own_memory = mover.has_own_memory
    mover.close()
    pool = align_up(cfg.memory.host_budget)
    budget = pool - (align_up(cfg.activations.host_bytes) if cfg.activations.host_bytes else 0)
    budget_text = (f"memory.host_budget less activations.buffer ({format_size(budget)})"
                   if cfg.activations.host_bytes else f"memory.host_budget ({format_size(budget)})")
    swapper = _Stub(config=cfg, mover=_Stub(has_own_memory=own_memory), partition_budget=budget,
                    budget_text=budget_text, pool=_Stub(nbytes=pool))
    units = [_Stub(index=i, name=up.name, params=list(up.params.items()), nbytes=lay.size,
                   partition=_Stub(size=lay.size, layout=lay))
             for i, (up, lay) in enumerate(zip(wrap.units, layouts, strict=True))]
    fixes: list[Fix] = []
    try:
        _check_fits(wrap, cast(Any, swapper), override)
    except BudgetError as exc:
        fixes.append(_host_fix(sum(lay.size for lay in layouts) + cfg.activations.host_bytes, str(exc)))
    largest = max((lay.size for lay in layouts), default=0)
    if largest > budget and not fixes:
        fixes.append(_host_fix(largest + cfg.activations.host_bytes,
                               f"the largest unit needs {format_size(largest)} of host memory, more than the whole "
                               f"{budget_text}"))
    train = _training(opt, units, swapper, override, fixes) if opt is not None else None
    handle = _Stub(config=cfg, units=units, device=resolve_device(cfg.device), swapper=swapper,
                   optimizer=train.stub if train is not None else None, activations_why=activations_why,
                   weights_why=weights_why)
    entry = _plan(cast(Any, handle))

    sizes = {i: lay.size for i, lay in enumerate(layouts)}
    params_home = cfg.params.tier
    nvme_units = {i: s for i, s in sizes.items() if params_home == "nvme"}
    fixed = sum(sizes.values()) if params_home == "device" else 0  # derive_device_cap's partitions homed there
    depth = cfg.prefetch.depth
    window = depth * largest if cfg.prefetch.max_bytes is None else min(depth * largest, cfg.prefetch.max_bytes)
    quant = _quantization(cfg)
    expanded = 2 * max((Layout.of(_unit_specs(up, override)).size for up in wrap.units
                        if len(_unit_specs(up, override, quant)) > len(up.params)), default=0) if quant else 0
    device_cap = (cfg.memory.device_budget if cfg.memory.device_budget is not None
                  else fixed + 2 * largest + window + expanded)  # as Runtime derives it
    if cfg.memory.device_budget is not None and largest > cfg.memory.device_budget:
        fixes.append(Fix("memory.device_budget", _size_value(largest),
                         f"raise memory.device_budget to at least {format_size(largest)} "
                         f"(memory.device_budget: {_size_value(largest)}), or use smaller units (wrap.classes)",
                         f"the largest unit needs {format_size(largest)} on the device"))

    recorded = _pass_order(_forward_order(model, wrap), train, cfg.optimizer.update == "lazy")
    resident: set[int] = set()
    depth_after = depth
    host_fixed = sum(sizes.values()) if params_home == "cpu" or (params_home == "device" and not own_memory) else 0
    if train is None and cfg.prefetch.keep_resident and depth > 0:  # as Runtime._plan_resident
        used = {i: s for i, s in nvme_units.items() if i in set(recorded.order)}
        resident, depth_after = plan_resident(used, budget - host_fixed, depth)
    device_peak = _device_peak(recorded, sizes, depth_after, cfg.prefetch.max_bytes, params_home)

    act_bytes, act_note = _activations(model, batch, training=train is not None,
                                       min_bytes=cfg.activations.min_bytes if cfg.activations.tier == "nvme" else 0)
    kinds = _kinds(cfg, layouts, train, model, act_bytes)
    parts = _partitions(cfg, sizes, train)
    nvme_total = sum(s for home, _, s in parts if home == "nvme")
    act_nvme = act_bytes if (act_bytes and cfg.activations.tier == "nvme" and train is not None) else 0
    # what the host cache holds: every partition but those on a device with memory of its own
    touched = [s for home, _, s in parts if home != "device" or not own_memory]
    host_peak = _host_peak(touched, budget)
    if act_nvme:
        host_peak += min(cfg.activations.host_bytes, act_nvme)
    peak = {"device": device_peak, "host": host_peak, "nvme": nvme_total + act_nvme}
    swap = _swap_paths(cfg, nvme_total + act_nvme) if cfg.uses_nvme else []
    fixes = _strongest(fixes) + _disk_fixes(swap)

    host_permanent = train.permanent if train is not None else host_fixed
    room = max(0, budget - host_permanent)
    moving = sum(s for home, _, s in parts if home == "nvme")
    dirty = sum(s for home, kind, s in parts if home == "nvme" and kind in ("params", "state")) if train else 0
    reads = max(0, moving - room) + act_nvme
    writes = (max(0, dirty - room) if train is not None else 0) + act_nvme
    bandwidth = cached_bandwidth(cfg.nvme.paths) if cfg.uses_nvme else None
    step_min, note = _step_bound(cfg, reads, writes, bandwidth)
    compute_min, compute_note = _compute_bound(model, batch, training=train is not None, device=cfg.device,
                                               dtype=override)
    if compute_min is not None and (step_min is None or compute_min > step_min):
        step_min, note = compute_min, f"the compute: {compute_note}" + (f"; the NVMe traffic: {note}"
                                                                        if step_min is not None else "")
    result = Plan(config=cfg, training=train is not None, units=[(up.name, lay.size) for up, lay in
                                                                  zip(wrap.units, layouts, strict=True)],
                  kinds=kinds, tiers=_by_tier(kinds), peak_bytes=peak, device_budget=device_cap,
                  prefetch_depth=depth_after, resident_bytes=sum(nvme_units[i] for i in resident), entry=entry,
                  swap=swap, fixes=fixes, nvme_read_bytes=reads, nvme_write_bytes=writes, bandwidth=bandwidth,
                  step_seconds_min=step_min, step_note=note, activations_note=act_note,
                  compute_seconds_min=compute_min, compute_note=compute_note)
    log.info("tiermem plan: %s", _plan_text(entry))
    return result


# -- the optimizer's partitions -------------------------------------------------------------------------
@dataclass
class _Training:
    """The optimizer's partitions as entry would make them."""

    stub: Any  # what offload._plan reads of a TieredOptimizer
    grads_tier: str
    grads: list[tuple[int, int]]  # (unit, bytes) of each gradient partition
    state: list[tuple[int, int]]  # (unit, bytes) of each optimizer-state partition
    master: int  # bytes of fp32 master weights among the state
    permanent: int  # host bytes kept for good (`_host_need`)


def _optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | str | None) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        if optimizer is not None and type(optimizer) not in SUPPORTED_OPTIMIZERS:
            names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED_OPTIMIZERS)
            raise OffloadError(f"optimizer: {type(optimizer).__name__} is not supported under tiered_offload; use "
                               f"one of {names}")
        return optimizer
    kind = OPTIMIZER_NAMES.get(str(optimizer).lower())
    if kind is None:
        raise OffloadError(f"optimizer: expected one of {', '.join(OPTIMIZER_NAMES)} or a torch.optim optimizer, got "
                           f"{optimizer!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    # an optimizer made on the parameters keeps no state until its first step: nothing is allocated
    return kind(params, lr=1e-3) if kind is not torch.optim.SGD else kind(params, lr=1e-3, momentum=0.9)


def _training(opt: torch.optim.Optimizer, units: list[Any], swapper: Any, override: torch.dtype | None,
              fixes: list[Fix]) -> _Training:
    """The gradient and state partitions, the grads tier and the host check, by the optimizer's own methods."""
    group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
    fake = _Stub(kind=type(opt), param_groups=opt.param_groups, mixed=override not in (None, torch.float32),
                 swapper=swapper)
    for name in ("state_kinds", "_layouts", "_host_need", "_choose_grads_tier", "_check_budget"):
        setattr(fake, name, MethodType(getattr(TieredOptimizer, name), fake))  # the optimizer's own code
    tiered = cast(Any, fake)
    plans = []
    for unit in units:
        trainable = [(fqn, p, group_of[id(p)]) for fqn, p in unit.params if p.requires_grad and id(p) in group_of]
        if trainable:
            plans.append((unit, trainable, *tiered._layouts(unit, trainable)))
    grads_tier, why = tiered._choose_grads_tier(units, plans)
    fake.grads_tier = grads_tier
    try:
        tiered._check_budget(units, plans)
    except OptimizerError as exc:
        need = fake.host_permanent + fake.host_working + swapper.config.activations.host_bytes
        fixes.append(_host_fix(need, str(exc)))
    permanent, working = tiered._host_need(units, plans, grads_tier)
    grads = [(u.index, Layout.of(g).size) for u, _, g, _ in plans]
    state = [(u.index, Layout.of(s).size) for u, _, _, s in plans if s]
    master = sum(Layout.of([x for x in s if x[0].startswith("master.")]).nbytes for _, _, _, s in plans if s)
    stub = _Stub(units=[_Stub(grads=_Stub(size=g), state=_Stub(size=s) if s else None)
                        for (_, g), s in zip(grads, _state_sizes(plans), strict=True)],
                 grads_tier=grads_tier, grads_why=why, host_permanent=permanent, host_working=working)
    return _Training(stub, grads_tier, grads, state, master if fake.mixed else 0, permanent)


def _state_sizes(plans: list[Any]) -> list[int]:
    return [Layout.of(s).size if s else 0 for _, _, _, s in plans]


def _strongest(fixes: list[Fix]) -> list[Fix]:
    """One fix per key: the largest value asked for (a budget that fits every check), in first-asked order."""
    best: dict[str, Fix] = {}
    for f in fixes:
        old = best.get(f.key)
        if old is None or parse_size(f.value) > parse_size(old.value):
            best[f.key] = f
    return list(best.values())


def _host_fix(need: int, problem: str) -> Fix:
    value = _size_value(need)
    return Fix("memory.host_budget", value, f"raise memory.host_budget to at least {format_size(need)} "
               f"(memory.host_budget: {value}), or move tiers to nvme", problem)


def _size_value(nbytes: int) -> str | int:
    """A config size of at least `nbytes`: whole MiB from 16 MiB up, else whole KiB (4 KiB-aligned)."""
    step = 1 << 20 if nbytes >= 16 << 20 else 4096
    return _human_size(max(step, math.ceil(nbytes / step) * step))


# -- the execution order and the device ---------------------------------------------------------------
def _forward_order(model: nn.Module, wrap: WrapPlan) -> list[tuple[int, tuple[int, ...]]]:
    """The acquisitions a forward makes, predicted: each hooked module in `modules()` order acquires the units it
    needs (those not in use already), held while its children run. Returns (unit, units in use besides)."""
    out: list[tuple[int, tuple[int, ...]]] = []

    def walk(mod: nn.Module, held: tuple[int, ...]) -> None:
        mine: list[int] = []
        for i in wrap.needs.get(mod, []):
            if i not in held and i not in mine:
                out.append((i, held + tuple(mine)))
                mine.append(i)
        for child in mod.children():
            walk(child, held + tuple(mine))

    walk(model, ())
    return out


@dataclass
class _Pass:
    """One pass as the schedule records it: the units acquired, what is held beside each, and for each the
    units whose prefetch would go to the host only (a recorded update comes first: [Note: lazy update])."""

    order: list[int] = field(default_factory=list)
    held: list[tuple[int, ...]] = field(default_factory=list)
    host_only: list[set[int]] = field(default_factory=list)


def _pass_order(forward: list[tuple[int, tuple[int, ...]]], train: _Training | None,
                lazy: bool) -> _Pass:
    """The forward, and for training its backward: the reverse, where a unit with gradients is acquired once
    and held until the last use of it in backward (its last gradient), see [Note: backward]."""
    out = _Pass()
    trained = {u for u, _ in train.grads} if train is not None else set()
    reached: set[int] = set()
    for unit, held in forward:
        reached.add(unit)
        out.order.append(unit)
        out.held.append(held)
        out.host_only.append(trained - reached if lazy else set())
    if train is None:
        return out
    back = [u for u, _ in reversed(forward)]
    last = {u: k for k, u in enumerate(back)}
    holding: list[int] = []
    for k, unit in enumerate(back):
        holding = [u for u in holding if last[u] >= k]
        if unit in holding:
            continue
        out.order.append(unit)
        out.held.append(tuple(holding))
        out.host_only.append(set())
        if unit in trained:
            holding.append(unit)
    return out


def _device_peak(p: _Pass, sizes: dict[int, int], depth: int, max_bytes: int | None, home: str) -> int:
    """The device ledger's peak over a recorded pass: the units in use and the window the real Schedule
    returns at each acquisition (see [Note: prefetch window])."""
    if not p.order:
        return 0
    if home == "device":
        return sum(sizes.values())  # every unit stays there
    sched = Schedule(depth, max_bytes, lambda i: sizes[i])
    for unit in p.order:
        sched.on_acquire(unit)
    sched.on_pass_end()
    peak = 0
    for unit, held, host_only in zip(p.order, p.held, p.host_only, strict=True):
        window = sched.on_acquire(unit) if depth > 0 else []
        there = {unit, *held, *(j for j in window if j not in host_only)}
        peak = max(peak, sum(sizes[j] for j in there))
    return peak


def _host_peak(touched: list[int], budget: int) -> int:
    """The host ledger's peak: every partition touched when they all fit the budget, else the most bytes of
    whole partitions, taken in order (cyclically), that do (the cache keeps what it read last)."""
    total = sum(touched)
    if total <= budget:
        return total
    best, n = 0, len(touched)
    for start in range(n):
        held = 0
        for k in range(n):
            size = touched[(start + k) % n]
            if held + size > budget:
                break
            held += size
        best = max(best, held)
    return best


# -- kinds of state ---------------------------------------------------------------------------------
_TIER_OF = {"device": "device", "cpu": "host", "nvme": "nvme", "memory": "device"}


def _partitions(cfg: Config, sizes: dict[int, int], train: _Training | None) -> list[tuple[str, str, int]]:
    """(home tier, kind, bytes) of every partition entry makes, unit by unit."""
    out: list[tuple[str, str, int]] = []
    grads = dict(train.grads) if train is not None else {}
    state = dict(train.state) if train is not None else {}
    for i, size in sizes.items():
        out.append((cfg.params.tier, "params", size))
        if i in grads and train is not None:
            out.append((train.grads_tier, "grads", grads[i]))
        if i in state:
            out.append((cfg.optimizer.tier, "state", state[i]))
    return out


def _kinds(cfg: Config, layouts: list[Layout], train: _Training | None, model: nn.Module,
           activations: int | None) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {
        "parameters": {"tier": _TIER_OF[cfg.params.tier], "bytes": sum(lay.size for lay in layouts)}}
    if train is not None:
        state = sum(s for _, s in train.state)
        kinds["gradients"] = {"tier": _TIER_OF[train.grads_tier], "bytes": sum(g for _, g in train.grads)}
        if train.master:
            kinds["master_weights"] = {"tier": _TIER_OF[cfg.optimizer.tier], "bytes": train.master}
        kinds["optimizer_state"] = {"tier": _TIER_OF[cfg.optimizer.tier], "bytes": state - train.master}
    kinds["activations"] = {"tier": _TIER_OF[cfg.activations.tier], "bytes": activations}
    kinds["buffers"] = {"tier": "device", "bytes": sum(b.numel() * b.element_size() for b in model.buffers())}
    return kinds


def _by_tier(kinds: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {t: {} for t in TIERS}
    for kind, entry in kinds.items():
        if entry["bytes"]:
            out[entry["tier"]][kind] = entry["bytes"]
    return out


def _batch_inputs(model: nn.Module, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`batch` as (args, kwargs) of tensors without data (called under a FakeTensorMode); a shape (ints) means
    input_ids of that shape, and so does one integer tensor for a forward that takes input_ids."""
    def empty(x: Any) -> Any:
        return torch.empty(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x

    if isinstance(batch, Mapping):
        return (), {k: empty(v) for k, v in batch.items()}
    if isinstance(batch, Sequence) and batch and all(isinstance(d, int) for d in batch):
        return (), {"input_ids": torch.zeros(tuple(batch), dtype=torch.long)}
    args = tuple(empty(x) for x in (batch if isinstance(batch, (tuple, list)) else [batch]))
    try:
        takes: Mapping[str, Any] = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = {}
    first = args[0] if len(args) == 1 else None
    if isinstance(first, torch.Tensor) and not first.is_floating_point() and "input_ids" in takes:
        return (), {"input_ids": first}
    return args, {}


def _compute_bound(model: nn.Module, batch: Any, *, training: bool, device: str,
                   dtype: torch.dtype | None) -> tuple[float | None, str]:
    """(seconds, how) of the compute's lower bound on a pass or step of `batch` (see the module's notes)."""
    if batch is None:
        return None, "no batch: pass batch= (tiermem plan --batch 2x128) for a compute bound"
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        with FakeTensorMode(), torch.no_grad():
            state = {n: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)
                     for n, t in [*model.named_parameters(), *model.named_buffers()]}
            args, kwargs = _batch_inputs(model, batch)
            with FlopCounterMode(display=False) as counter:
                torch.func.functional_call(model, state, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - an op without a fake kernel: no compute bound, the rest stands
        return None, f"not estimated: the forward on fake tensors failed ({type(exc).__name__}: {exc})"
    flops = counter.get_total_flops() * (3 if training else 1)
    rate = _matmul_rate(str(resolve_device(device)), dtype)
    what = "step (three forwards)" if training else "pass"
    return flops / rate, (f"{flops / 1e9:.3g} GFLOP of matrix products per {what} at the probe's best "
                          f"{rate / 1e9:.3g} GFLOP/s on {resolve_device(device)}")


@functools.cache
def _matmul_rate(device: str, dtype: torch.dtype) -> float:
    """The best floating-point operations per second square matrix products reach on `device` (see the
    module's notes)."""
    dev = torch.device(device)
    best = 0.0
    for n in (1024, 1536, 2048):
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        for _ in range(3):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            torch.mm(a, b)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = max(best, 2 * n**3 / max(time.perf_counter() - t0, 1e-9))
    return best


def _activations(model: nn.Module, batch: Any, *, training: bool, min_bytes: int = 0) -> tuple[int | None, str]:
    """Bytes autograd saves for backward in one training forward of `batch` (not parameters), found by running
    that forward on fake tensors (shapes without data: nothing is allocated) with a saved-tensor hook; with
    `min_bytes`, only those at least that large (what activations.tier nvme moves). Fake rather than meta
    tensors: transformers takes them for tracing and skips the checks that would read token ids."""
    if not training:
        return 0, "inference: autograd saves nothing for backward"
    if batch is None:
        return None, "not estimated: pass batch= (tiermem plan --batch 2x128) to estimate them"
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved: dict[int, tuple[torch.Tensor, int]] = {}  # id(base tensor) -> (it, bytes); kept so ids stay unique
    ids: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in ids:
            saved[id(base)] = (base, base.numel() * base.element_size())
        return t

    try:
        with FakeTensorMode(), torch.enable_grad():
            params = {n: torch.empty(p.shape, dtype=p.dtype).requires_grad_(p.requires_grad)
                      for n, p in model.named_parameters()}
            buffers = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in model.named_buffers()}
            ids.update(id(t) for t in params.values())
            args, kwargs = _batch_inputs(model, batch)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                torch.func.functional_call(model, {**params, **buffers}, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - an op without a fake kernel, data-dependent code: plan without them
        return None, f"not estimated: the forward on fake tensors failed ({type(exc).__name__}: {exc})"
    total = sum(n for _, n in saved.values() if n >= min_bytes)
    return total, f"saved by one training forward of the batch, estimated on fake tensors ({len(saved)} tensors)"


# -- swap space and the step's traffic ------------------------------------------------------------------
def _existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _swap_paths(cfg: Config, logical: int) -> list[SwapPath]:
    """Each directory's share of the striped swap space, as SwapStore._grow preallocates it."""
    weights, _ = path_weights(cfg.nvme.paths, cfg.nvme.path_weights)
    out = []
    for path, needed in zip(cfg.nvme.paths, StripeLayout(cfg.nvme.stripe_size, weights).bytes_per_dir(logical),
                            strict=True):
        where = _existing(path)
        st = os.statvfs(where)
        dev = os.stat(where).st_dev
        out.append(SwapPath(path, needed, st.f_bavail * st.f_frsize if st.f_blocks else None,
                            f"{os.major(dev)}:{os.minor(dev)}"))
    return out


def _disk_fixes(swap: list[SwapPath]) -> list[Fix]:
    fixes = []
    by_fs: dict[str, list[SwapPath]] = {}
    for s in swap:
        by_fs.setdefault(s.filesystem, []).append(s)
    for group in by_fs.values():
        need, free = sum(s.needed for s in group), group[0].free
        if free is not None and need > free:
            where = ", ".join(s.path for s in group)
            fixes.append(Fix("nvme.paths", None,
                             f"free {format_size(need - free)} on the filesystem of {where} (it needs "
                             f"{format_size(need)}, {format_size(free)} is free), or add a directory on another "
                             "drive to nvme.paths", f"no space for {format_size(need)} of swap in {where}"))
    return fixes


def _step_bound(cfg: Config, reads: int, writes: int, bandwidth: dict[str, Any] | None) -> tuple[float | None, str]:
    """(seconds, how) of the NVMe traffic's lower bound; None seconds when no figures are cached."""
    if not cfg.uses_nvme or (reads == 0 and writes == 0):
        return 0.0, "no NVMe traffic in steady state: what a step touches fits the host budget"
    paths = " ".join(f"--path {p}" for p in cfg.nvme.paths)
    if bandwidth is None:
        return None, (f"no `tiermem bench io` figures cached for {', '.join(cfg.nvme.paths)}; run "
                      f"`tiermem bench io {paths}` once to measure the drives")
    times = []
    for mode, nbytes in (("read", reads), ("write", writes)):
        gbps = bandwidth.get(f"{mode}_gbps")
        if nbytes and gbps:
            times.append((nbytes / (gbps * GB), f"{format_size(nbytes)} {mode} at {gbps:.3g} GB/s"))
    if not times:
        return None, f"the cached figures have no GB/s for this traffic; run `tiermem bench io {paths}`"
    seconds, how = max(times)
    when = time.strftime("%Y-%m-%d", time.localtime(bandwidth.get("measured", 0)))
    caveat = "" if cfg.io.direct else "; with io.direct false the page cache can beat it"
    return seconds, f"{how}, `tiermem bench io` of {when}{caveat}"
