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

# [Note: planning generation]
With `generate=(batch, prompt, new_tokens)`, a plan adds what `model.generate(ids, max_new_tokens=new_tokens)` on
`batch` prompts of `prompt` tokens would keep in the KV cache and read per decoding step (`Plan.generation`).
Again the figures come from the code that runs, not from a model of it:
- the cache layers, their shapes and the unit computing each come from the model's own forward on fake tensors
  (a prefill of the prompt and one decoding step through a transformers DynamicCache made from the model's
  config, as generate() makes it). A layer is kept in blocks when it is one KVStore.adopt would tier (a plain
  DynamicLayer), and it follows the unit acquired last among those in use when it updates, as
  KVStore.begin_update finds it;
- the blocks are placed by a KVStore and its TieredLayers themselves (`check_block_fits`, and
  `append_tokens`, which cuts tokens into blocks for TieredLayer._append, writing nothing here), on stand-ins
  for the runtime, the swapper and the units, appending the prompt and then one token a step to each layer in
  order; `KVStore.streamed` gives each unit's blocks read with it;
- each decoding step's bound is the pass bound above with the step's blocks in it: the NVMe units the forward
  uses and the NVMe blocks not kept as partial ones are touched every step, the host cache holds at most the
  budget less the host-homed partitions, blocks and kept partial blocks, so at least the rest is read; the
  compute bound is the step's matrix products (counted on the fake decoding step; attention's products with
  the cache, which grow with the context, are not counted) at the probe's rate; the step's bound is the larger.
  The resident plan is `plan_resident` with each unit's blocks as the bytes read with it, as the runtime makes
  it at the end of a pass for the next; a cache that does not fit (kv.tier cpu past the budget, or a block
  pair beside the unit computing) is a fix: the largest kv.block_tokens that `check_block_fits` takes, or a
  budget (for kv.tier cpu, two blocks above the bytes, what the pool was measured to lose to pieces);
- the KV bytes on the compute device are the whole cache with kv.tier memory, else the largest layer's keys
  and values at the longest, which its update puts together there; a model with a learned position table
  given more positions than it has (fake tensors index no embedding) is a fix naming the shape that runs;
- the prefill reads the weights and writes its sealed blocks, and computes the prompt's products; the whole
  generate() is bounded by the prefill and the `new_tokens - 1` decoding steps after it (the last token's keys
  and values are never appended), and tokens/s by `batch * new_tokens` over that.
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
from tiermem.optim import SUPPORTED_OPTIMIZERS, TieredOptimizer, unsupported
from tiermem.optim.optimizer import own_attributes
from tiermem.runtime.schedule import Schedule, plan_resident
from tiermem.runtime.wrap import WrapPlan, dtype_of, plan_units
from tiermem.sizes import format_size, format_size_up, parse_size
from tiermem.store import StripeLayout
from tiermem.swap import Layout, Tier
from tiermem.swap.transfers import make_mover

log = logging.getLogger(__name__)

__all__ = ["Fix", "Plan", "SwapPath", "plan"]

TIERS = ("device", "host", "nvme")
OPTIMIZER_NAMES = {c.__name__.lower(): c for c in SUPPORTED_OPTIMIZERS}


@dataclass
class Fix:
    """One change that makes the plan fit: set `key` to `value` (a config value, e.g. "8MiB")."""

    key: str
    """The config key to change, e.g. ``memory.host_budget``, or ``nvme.paths`` for disk space; ``generate`` for
    the shape planned with ``generate=`` (a model with learned positions given more than it has)."""

    value: Any
    """A value that fits, as the config takes it (a size string such as ``"8MiB"``; for ``generate``, the shape
    as ``--generate`` takes it, ``BxP+N``), or None when the fix is not a value (free disk space)."""

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
class Generation:
    """What generate() on a batch would keep in the KV cache and move per decoding step; made by `plan` with
    ``generate=(batch, prompt, new_tokens)`` (see [Note: planning generation]). Byte figures count what the KV
    store counts (`tm.stats()`'s ``kv_*`` keys): blocks of kv.block_tokens tokens, each 4 KiB-aligned."""

    batch: int
    prompt: int
    new_tokens: int
    kv_tier: str
    """kv.tier: memory leaves transformers' own cache on the compute device; the others cut it into blocks."""

    layers: int
    """Cache layers the KV store takes (kv.tier other than memory), or that grow on the device (memory)."""

    untiered_layers: int
    """Cache layers left as transformers makes them (sliding windows), on the compute device."""

    token_bytes: int
    """Bytes one token takes in those layers: keys and values of every sequence and head."""

    block_bytes: int
    """The largest block: kv.block_tokens tokens of one layer for the whole batch, placed or not (a cache that
    does not fit stops at the block that does not); 0 for kv.tier memory."""

    kv_bytes: int
    """The cache at its longest, prompt + new_tokens - 1 tokens (the last token's keys are never appended)."""

    kv_host_bytes: int
    """Of them, blocks homed in host memory (``kv_host_home_bytes``)."""

    kv_nvme_bytes: int
    """Of them, blocks homed on NVMe (``kv_nvme_home_bytes``)."""

    kept_bytes: int
    """Partial blocks with an NVMe home kept in host memory at the end (at most an eighth of the budget)."""

    device_kv_bytes: int
    """The cache's bytes on the compute device at its longest, beside the units ``peak_bytes["device"]``
    counts: the whole cache with kv.tier memory; else the keys and values of the largest layer, which each
    update puts together there for attention (the untiered layers not counted)."""

    read_bytes: int
    """NVMe bytes the whole generate() must at least read: weights and blocks."""

    write_bytes: int
    """NVMe bytes it must at least write: each block with an NVMe home once, when it fills."""

    step_read_bytes: int
    """NVMe bytes the last decoding step must at least read."""

    resident_bytes: int
    """Units the resident plan keeps in host memory during the last decoding step: the plan the runtime makes at
    the end of the step before it (``tm.stats()["resident_bytes"]`` after a generate() of one token fewer)."""

    prefetch_depth: int
    """The prefetch depth that plan leaves."""

    prefill_seconds_min: float | None
    """A bound on the prompt's forward: its reads and writes, or its matrix products."""

    step_seconds_min: float | None
    """A bound on the last decoding step, the longest."""

    seconds_min: float | None
    """A bound on the whole generate(): the prefill and the new_tokens - 1 decoding steps."""

    tokens_per_second_max: float | None
    """batch * new_tokens / seconds_min: what generation cannot beat."""

    note: str
    """How the bounds were found, or what is missing for them."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary_lines(self) -> list[str]:
        shape = f"{self.batch} x ({self.prompt} + {self.new_tokens} tokens)"
        where = ("on the compute device (kv.tier memory)" if self.kv_tier == "memory"
                 else f"in blocks of {format_size(self.block_bytes)} (kv.tier {self.kv_tier})")
        lines = [f"  generate {shape}: KV cache of {self.layers} layers, {format_size(self.token_bytes)} a token, "
                 f"{where}" + (f"; {self.untiered_layers} other layers on the device" if self.untiered_layers else "")]
        if self.kv_tier != "memory":
            lines.append(f"    at its longest {format_size(self.kv_bytes)}: {format_size(self.kv_host_bytes)} homed on "
                         f"the host, {format_size(self.kv_nvme_bytes)} on NVMe, {format_size(self.kept_bytes)} of "
                         "partial blocks kept in host memory")
            lines.append(f"    on the compute device beside the units: {format_size(self.device_kv_bytes)}, the "
                         "largest layer's keys and values as attention reads them")
        else:
            lines.append(f"    at its longest {format_size(self.kv_bytes)}, all of it on the compute device beside the "
                         "units")
        lines.append(f"    NVMe: the last decoding step reads at least {format_size(self.step_read_bytes)}; the whole "
                     f"generate() {format_size(self.read_bytes)} read, {format_size(self.write_bytes)} written"
                     + (f"; {format_size(self.resident_bytes)} kept resident, prefetch depth {self.prefetch_depth}"
                        if self.resident_bytes else ""))
        if self.seconds_min is not None and self.tokens_per_second_max is not None:
            step = (f"last decoding step >= {self.step_seconds_min:.4g} s, " if self.step_seconds_min is not None
                    else "no decoding step (one new token), ")
            lines.append(f"    prefill >= {self.prefill_seconds_min:.4g} s, {step}generate() >= "
                         f"{self.seconds_min:.4g} s: at most {self.tokens_per_second_max:.4g} tokens/s")
        lines.append(f"    ({self.note})")
        return lines


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

    generation: Generation | None = None
    """With ``generate=``: the KV cache and the decoding steps (see [Note: planning generation])."""

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
            "generation": self.generation.to_dict() if self.generation is not None else None,
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
        if self.generation is not None:
            lines.extend(self.generation.summary_lines())
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
         checkpoint: str | os.PathLike[str] | None = None, generate: tuple[int, int, int] | None = None,
         **overrides: Any) -> Plan:
    """Plan `tiered_offload(model, config, optimizer=...)` without running it: see [Note: plans].

    Args:
        model: any nn.Module, on the CPU or the meta device; nothing of it is copied or moved.
        config: what `tiered_offload` takes (YAML path, mapping, Config or None).
        optimizer: a torch.optim optimizer that tiered_offload takes, built on the model's parameters, or its
            class's name in lower case (``"adamw"``, ``"sgd"``, ``"rmsprop"``, ...: `OPTIMIZER_NAMES`, one
            param group with that optimizer's defaults; SGD with momentum 0.9); None plans inference.
        batch: what a step feeds the model, to estimate the activations a training pass saves: a tensor, a
            tuple of tensors, a dict of keyword tensors, or a shape such as ``(2, 128)`` for ``input_ids``.
            The forward runs on fake tensors (shapes without data: no bytes).
        checkpoint: the checkpoint `tiered_offload` would stream from (a model on the meta device); only its
            existence is checked, the shapes come from the model.
        generate: (batch, prompt, new_tokens): plan `generate()` of `new_tokens` tokens for `batch` prompts of
            `prompt` tokens: the KV cache's bytes per tier and each decoding step's bounds (``Plan.generation``,
            see [Note: planning generation]). Inference only; a transformers model.
        **overrides: dotted config keys, as `tiered_offload` takes them.

    Returns:
        a Plan: ``summary()``, ``to_dict()``, ``fits``, ``fixes``, ``peak_bytes``, ``step_seconds_bound``.
    """
    cfg = _rank_paths(load_config(config, **overrides), Ranks.of(None))
    if checkpoint is not None and not os.path.exists(checkpoint):
        raise OffloadError(f"checkpoint: {os.fspath(checkpoint)} does not exist; pass the .safetensors file or "
                           "its index")
    opt = _optimizer(model, optimizer)
    shape = _generate_shape(generate, opt)
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
                         f"raise memory.device_budget to at least {format_size_up(largest)} "
                         f"(memory.device_budget: {_size_value(largest)}), or use smaller units (wrap.classes)",
                         f"the largest unit needs {format_size(largest)} on the device"))

    recorded = _pass_order(_forward_order(model, wrap), train, cfg.optimizer.update == "lazy")
    resident: set[int] = set()
    depth_after = depth
    host_fixed = sum(sizes.values()) if params_home == "cpu" or (params_home == "device" and not own_memory) else 0
    used = {i: s for i, s in nvme_units.items() if i in set(recorded.order)}  # the NVMe units a pass reads
    if train is None and cfg.prefetch.keep_resident and depth > 0:  # as Runtime._plan_resident
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
    bandwidth = cached_bandwidth(cfg.nvme.paths) if cfg.uses_nvme else None
    gen = blocks = None
    if shape is not None:
        gen, blocks = _generation(model, cfg, wrap, _Stub(sizes=sizes, used=used, host_fixed=host_fixed,
                                                          budget=budget, budget_text=budget_text), override, shape,
                                  bandwidth, fixes)
        touched += blocks  # the host cache holds the blocks as it holds the units
    host_peak = _host_peak(touched, budget)
    if act_nvme:
        host_peak += min(cfg.activations.host_bytes, act_nvme)
    kv_nvme = gen.kv_nvme_bytes if gen is not None else 0
    peak = {"device": device_peak, "host": host_peak, "nvme": nvme_total + act_nvme + kv_nvme}
    swap = _swap_paths(cfg, nvme_total + act_nvme + kv_nvme) if cfg.uses_nvme else []
    fixes = _strongest(fixes) + _disk_fixes(swap)

    host_permanent = train.permanent if train is not None else host_fixed
    room = max(0, budget - host_permanent)
    moving = sum(s for home, _, s in parts if home == "nvme")
    dirty = sum(s for home, kind, s in parts if home == "nvme" and kind in ("params", "state")) if train else 0
    reads = max(0, moving - room) + act_nvme
    writes = (max(0, dirty - room) if train is not None else 0) + act_nvme
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
                  compute_seconds_min=compute_min, compute_note=compute_note, generation=gen)
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
        refused = unsupported(optimizer)
        if refused is not None:
            raise OffloadError(refused)
        return optimizer
    kind = OPTIMIZER_NAMES.get(str(optimizer).lower())
    if kind is None:
        raise OffloadError(f"optimizer: expected one of {', '.join(OPTIMIZER_NAMES)} or a torch.optim optimizer, got "
                           f"{optimizer!r}")
    # made on a placeholder, then given the parameters: Adagrad's constructor would allocate its sums, a copy of
    # the model, where planning allocates nothing
    placeholder = [torch.empty(0, device="meta")]
    opt = kind(placeholder, lr=1e-3, momentum=0.9) if kind is torch.optim.SGD else kind(placeholder)
    opt.state.clear()
    opt.param_groups[0]["params"] = [p for p in model.parameters() if p.requires_grad]
    return opt


def _training(opt: torch.optim.Optimizer, units: list[Any], swapper: Any, override: torch.dtype | None,
              fixes: list[Fix]) -> _Training:
    """The gradient and state partitions, the grads tier and the host check, by the optimizer's own methods."""
    group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
    fake = _Stub(kind=type(opt), param_groups=opt.param_groups, mixed=override not in (None, torch.float32),
                 swapper=swapper, attrs=own_attributes(opt))
    for name in ("state_kinds", "_layouts", "_param_state", "_host_need", "_choose_grads_tier", "_check_budget"):
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
    return Fix("memory.host_budget", value, f"raise memory.host_budget to at least {format_size_up(need)} "
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

    dtype = _compute_dtype(model, dtype)
    try:
        with FakeTensorMode(), torch.no_grad():
            state = _fake_state(model, dtype)
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


def _compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> torch.dtype:
    """params.dtype, or the model's floating-point dtype when that is null."""
    return dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _fake_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as tensors of the current FakeTensorMode, floating ones in `dtype`."""
    return {n: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)
            for n, t in [*model.named_parameters(), *model.named_buffers()]}


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


# -- generation: the KV cache ----------------------------------------------------------------------------
def _generate_shape(generate: Any, opt: torch.optim.Optimizer | None) -> tuple[int, int, int] | None:
    """`generate=` checked: (batch, prompt, new_tokens), each a positive int; inference only."""
    if generate is None:
        return None
    if opt is not None:
        raise OffloadError("generate: plans inference (generate() computes no gradients); plan it without "
                           "optimizer=")
    if (not isinstance(generate, Sequence) or len(generate) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in generate)):
        raise OffloadError(f"generate: expected (batch, prompt, new_tokens), three positive ints such as (32, 128, "
                           f"32), got {generate!r}")
    return cast(tuple[int, int, int], tuple(generate))


def _cache_layers(model: nn.Module, wrap: WrapPlan, shape: tuple[int, int, int],
                  dtype: torch.dtype) -> tuple[list[Any], int, float, float]:
    """The cache layers generate() fills, from the model's forward on fake tensors through a DynamicCache made
    from its config: a prefill of the prompt, then one decoding step (see [Note: planning generation]).

    Returns (the layers KVStore.adopt would tier, each with its index, shape (batch, heads, key dim, value dim),
    dtype, the unit computing it and the units in use at its first update; the number of other layers; the
    prefill's and the decoding step's floating-point operations of matrix products)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError as exc:
        raise OffloadError(f"generate: planning generation needs transformers 5 (its cache layers): {exc}") from None
    batch, prompt, _ = shape
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise OffloadError(f"generate: planning generation covers decoder-only models, and {type(model).__name__} is "
                           "an encoder-decoder; plan it without generate= (kv.tier still tiers its decoder's cache "
                           "when it runs)")
    in_use: list[int] = []  # the units in use, in the order acquired (as the runtime's hooks acquire them)
    mine: list[list[int]] = []
    first: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # layer -> (unit computing it, units in use)

    def enter(mod: nn.Module, args: Any) -> None:
        new = [i for i in wrap.needs[mod] if i not in in_use]
        in_use.extend(new)
        mine.append(new)

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        for i in mine.pop():
            in_use.remove(i)

    try:
        takes: Mapping[str, Any] = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = {}
    cache_kw = "cache" if "cache" in takes else "past_key_values"
    handles = [handle for mod in wrap.needs
               for handle in (mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave))]
    try:
        with FakeTensorMode(), torch.no_grad():
            state = _fake_state(model, dtype)
            config = getattr(model, "config", None)
            cache = DynamicCache(config=config) if config is not None else DynamicCache()
            update = cache.update

            def recording(key: torch.Tensor, value: torch.Tensor, layer_idx: int, *a: Any, **kw: Any) -> Any:
                first.setdefault(layer_idx, (in_use[-1] if in_use else None, tuple(in_use)))
                return update(key, value, layer_idx, *a, **kw)

            cache.update = recording  # type: ignore[method-assign,assignment]
            flops = []
            for tokens, seen in ((prompt, 0), (1, prompt)):
                kwargs: dict[str, Any] = {"input_ids": torch.zeros((batch, tokens), dtype=torch.long),
                                          cache_kw: cache, "use_cache": True}
                if "attention_mask" in takes:
                    kwargs["attention_mask"] = torch.ones((batch, seen + tokens), dtype=torch.long)
                with FlopCounterMode(display=False) as counter:
                    torch.func.functional_call(model, state, (), kwargs)
                flops.append(float(counter.get_total_flops()))
            layers, others = [], 0
            for idx, layer in enumerate(cache.layers):
                if not getattr(layer, "is_initialized", False):
                    continue
                if type(layer) is not DynamicLayer:  # as KVStore.adopt: only plain layers are tiered
                    others += 1
                    continue
                keys, values = cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)
                b, h, _, dk = keys.shape
                unit, held = first.get(idx, (None, ()))
                layers.append(_Stub(index=idx, shape=(b, h, dk, values.shape[-1]), dtype=keys.dtype, unit=unit,
                                    held=held))
    except OffloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - an op without a fake kernel, a model that takes no cache
        raise OffloadError(f"generate: the model's forward with a transformers DynamicCache failed on fake tensors "
                           f"({type(exc).__name__}: {exc}); plan it without generate=") from None
    finally:
        for handle in handles:
            handle.remove()
    if not layers and not others:
        raise OffloadError("generate: the model's forward filled no cache layer (a model without a KV cache?); "
                           "plan it without generate=")
    return layers, others, flops[0], flops[1]


def _generation(model: nn.Module, cfg: Config, wrap: WrapPlan, room: Any, dtype: torch.dtype | None,
                shape: tuple[int, int, int], bandwidth: dict[str, Any] | None,
                fixes: list[Fix]) -> tuple[Generation, list[int]]:
    """Place the KV blocks as generate() of `shape` would and bound each step (see [Note: planning generation]).
    `room` carries the units' sizes, the NVMe ones a pass reads (`used`), the host-homed units' bytes and the
    partition budget. Returns the Generation and the bytes of each block (the host cache holds them as it holds
    the units); what does not fit is added to `fixes`."""
    from tiermem.runtime.kv_cache import KVStore, TieredLayer, _Group

    batch, prompt, new = shape
    dtype = _compute_dtype(model, dtype)
    layers, others, prefill_flops, step_flops = _cache_layers(model, wrap, shape, dtype)
    rate = _matmul_rate(str(resolve_device(cfg.device)), dtype)
    token_bytes = cast(Any, TieredLayer.token_bytes).fget
    per_token = sum(token_bytes(layer) for layer in layers)
    longest = prompt + new - 1
    weights, budget, depth = sum(room.used.values()), room.budget, cfg.prefetch.depth
    weights_read = max(0, weights - (budget - room.host_fixed))  # the least a pass reads with no KV blocks in it
    # generate() gives its last token no position, so it uses `longest` positions; fake tensors index no
    # embedding, so a model with learned positions would fail there only for real
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    past_positions = isinstance(positions, int) and longest > positions
    learned_positions = past_positions and _learned_positions(model, cast(int, positions))
    if learned_positions:
        fixes.append(_positions_fix(shape, cast(int, positions)))

    def bound(reads: int, writes: int, flops: float) -> tuple[float | None, str]:
        """The larger of the traffic's bound and the compute's, as `plan` bounds a pass; the compute's alone
        when the drives have no bench figures."""
        seconds, how = _step_bound(cfg, reads, writes, bandwidth)
        compute = flops / rate
        if seconds is None or compute > seconds:
            what = f"the compute, {flops / 1e9:.3g} GFLOP of matrix products at {rate / 1e9:.3g} GFLOP/s"
            return compute, what if seconds is not None else f"{what} (NVMe traffic not bounded: {how})"
        return seconds, how

    def result(kind: str, prefill: tuple[float | None, str], steps: list[tuple[float | None, str]],
               **figures: Any) -> Generation:
        total = None if any(t is None for t, _ in [prefill, *steps]) else sum(t or 0.0 for t, _ in [prefill, *steps])
        last = steps[-1] if steps else (None, "")
        note = (f"prefill: {prefill[1]}" + (f"; decoding steps: {last[1]}" if steps else "")
                if prefill[0] is not None or steps else prefill[1])
        if past_positions and not learned_positions:
            note += (f"; prompt + new_tokens - 1 ({prompt + new - 1} positions) is past the model's "
                     f"max_position_embeddings ({positions}); its positions are no learned table, so generate() "
                     "runs, past the length the model was made for")
        return Generation(batch=batch, prompt=prompt, new_tokens=new, kv_tier=kind, layers=len(layers),
                          untiered_layers=others, token_bytes=per_token, prefill_seconds_min=prefill[0],
                          step_seconds_min=last[0], seconds_min=total,
                          tokens_per_second_max=batch * new / total if total else None, note=note, **figures)

    if cfg.kv.tier == "memory":  # transformers' own cache on the compute device: each step reads the weights only
        reads = weights_read
        resident, depth = (plan_resident(room.used, budget - room.host_fixed, depth)
                           if cfg.prefetch.keep_resident and depth > 0 else (set(), depth))
        gen = result("memory", bound(reads, 0, prefill_flops), [bound(reads, 0, step_flops)] * (new - 1),
                     block_bytes=0, kv_bytes=per_token * longest, kv_host_bytes=0, kv_nvme_bytes=0, kept_bytes=0,
                     device_kv_bytes=per_token * longest,
                     read_bytes=reads * new, write_bytes=0, step_read_bytes=reads if new > 1 else 0,
                     resident_bytes=sum(room.used[j] for j in resident), prefetch_depth=depth)
        return gen, []

    home = Tier.of(cfg.params.tier)
    parts: dict[str, Any] = {f"unit.{i}": _Stub(name=f"unit.{i}", size=size, home=home)
                             for i, size in room.sizes.items()}
    units = [_Stub(index=i, partition=parts[f"unit.{i}"], depth=0) for i in room.sizes]

    def add(name: str, spec: Any, *, home: Tier, fill: Any) -> Any:
        parts[name] = _Stub(name=name, size=Layout.of(spec).size, home=Tier.of(home))
        return parts[name]

    # the KV store and its layers themselves, on stand-ins for the runtime and the swapper: what they read of those
    swapper = _Stub(config=cfg, partitions=parts, partition_budget=budget, budget_text=room.budget_text, add=add,
                    keep_resident=lambda part, keep: None, write_back=lambda part: None)
    store = KVStore(cast(Any, _Stub(units=units, swapper=swapper, follow=lambda part, unit: None)))
    store.active = group = _Group()
    tiered = []
    for found in layers:
        made = TieredLayer(store, group, found.index)
        made.shape, made.dtype, made.unit, made.is_initialized = found.shape, found.dtype, found.unit, True
        tiered.append((made, found.held))

    def append(layer: TieredLayer, tokens: int) -> None:
        layer.append_tokens(tokens, lambda blk, done, take: None)  # the blocks placed, nothing written

    def left() -> int:
        """The budget less the host-homed units and blocks and the kept partial blocks, as the runtime plans."""
        return budget - room.host_fixed - store.host_bytes - store.tail_bytes

    layer: TieredLayer | None = tiered[0][0] if tiered else None
    try:
        for layer, held in tiered:  # the prefill; each layer's first update checks its block (lazy_initialization)
            for u in units:
                u.depth = 1 if u.index in held else 0
            store.check_block_fits(layer)
            append(layer, prompt)
        prefill_reads = weights_read
        prefill = bound(prefill_reads, store.bytes_written, prefill_flops)
        reads, steps, step_reads = prefill_reads, [], 0
        resident, depth = (plan_resident(room.used, left(), depth, store.streamed())
                           if cfg.prefetch.keep_resident and depth > 0 and new == 1 else (set(), depth))
        for k in range(new - 1):
            step_reads = max(0, weights + sum(store.streamed().values()) - left())
            if k == new - 2 and cfg.prefetch.keep_resident and depth > 0:  # planned again at the step's start
                resident, depth = plan_resident(room.used, left(), cfg.prefetch.depth, store.streamed())
            written = store.bytes_written
            for layer, _ in tiered:
                append(layer, 1)
            steps.append(bound(step_reads, store.bytes_written - written, step_flops))
            reads += step_reads
    except BudgetError as exc:  # the runtime would raise it: no bounds, a fix
        fixes.append(_kv_fix(store, layer, longest, exc, cfg.activations.host_bytes))
        prefill, steps, reads, step_reads, resident = (None, f"does not fit: {exc}"), [], 0, 0, set()
    blocks = [b.part for x, _ in tiered for b in x.blocks]
    largest = max((Layout.of(x.block_spec()).size for x, _ in tiered), default=0)
    gen = result(cfg.kv.tier, prefill, steps, block_bytes=largest,
                 kv_bytes=store.bytes_now(), kv_host_bytes=store.host_bytes,
                 kv_nvme_bytes=sum(b.size for b in blocks if b.home is Tier.NVME),
                 kept_bytes=store.tail_bytes, read_bytes=reads, write_bytes=store.bytes_written,
                 device_kv_bytes=max((x.token_bytes for x, _ in tiered), default=0) * longest,
                 step_read_bytes=step_reads, resident_bytes=sum(room.used[j] for j in resident),
                 prefetch_depth=depth)
    return gen, [b.size for b in blocks]


def _learned_positions(model: nn.Module, positions: int) -> bool:
    """Whether the model embeds positions with a table of `positions` rows or more (GPT-2's `wpe`, BERT's
    `position_embeddings`, OPT's `embed_positions`), which a longer sequence indexes past."""
    return any(isinstance(mod, nn.Embedding) and mod.num_embeddings >= positions
               and ("pos" in name.rsplit(".", 1)[-1] or name.endswith("wpe")) for name, mod in model.named_modules())


def _positions_fix(shape: tuple[int, int, int], positions: int) -> Fix:
    """generate() of `shape` would index a learned position table of `positions` rows past its end."""
    batch, prompt, new = shape
    problem = (f"generate: a prompt of {prompt} tokens and {new} new tokens use {prompt + new - 1} positions, and the "
               f"model's learned position embedding has {positions} (max_position_embeddings): generate() would "
               "fail with an index error")
    if prompt < positions:
        most = positions - prompt + 1
        return Fix("generate", f"{batch}x{prompt}+{most}", f"generate at most {most} new tokens after this prompt "
                   f"(generate=({batch}, {prompt}, {most}), --generate {batch}x{prompt}+{most}), or shorten the "
                   "prompt", problem)
    shorter = positions - new + 1
    if shorter < 1:  # more new tokens than positions: the most a one-token prompt takes
        return Fix("generate", f"{batch}x1+{positions}", f"generate at most {positions} new tokens, after a prompt "
                   f"of one token (--generate {batch}x1+{positions})", problem)
    return Fix("generate", f"{batch}x{shorter}+{new}", f"shorten the prompt to {shorter} tokens or less for {new} new "
               f"tokens (--generate {batch}x{shorter}+{new})", problem)


def _kv_fix(store: Any, layer: Any, longest: int, exc: BudgetError, activations: int) -> Fix:
    """The change that lets generate() place its blocks: a smaller kv.block_tokens when one block pair does not
    fit (`check_block_fits`), else the host budget that holds every block of kv.tier cpu at its longest."""
    problem = str(exc)
    wanted = store.block_tokens
    if problem.startswith("kv.block_tokens"):
        for k in range(wanted - 1, 0, -1):
            store.block_tokens = k
            try:
                store.check_block_fits(layer)
            except BudgetError:
                continue
            store.block_tokens = wanted
            return Fix("kv.block_tokens", k, f"lower kv.block_tokens to {k} or less (kv.block_tokens: {k}), lower the "
                       "batch, or raise memory.host_budget", problem)
        # no block of even one token fits: the budget that fits a pair of the blocks asked for
        store.block_tokens = wanted
        size = Layout.of(layer.block_spec()).size
        held = sum(u.partition.size for u in store.runtime.units if u.depth > 0 and u.partition.home is Tier.NVME)
        room, _ = store._room(held)
        need = store.swapper.partition_budget + 2 * size - room + activations
        value = _size_value(need)
        return Fix("memory.host_budget", value, f"raise memory.host_budget to at least {format_size_up(need)} "
                   f"(memory.host_budget: {value}) for blocks of {wanted} tokens; no smaller kv.block_tokens fits "
                   "under this budget; or lower the batch", problem)
    size = Layout.of(layer.block_spec()).size
    blocks = sum(-(-longest // wanted) * Layout.of(x.block_spec()).size for x in store.layers)
    room, _ = store._room(store._largest_streamed())  # kv.tier cpu: room beside one streamed unit
    # two blocks to spare: blocks filling the room a streamed unit left leave pieces smaller than a block, and a
    # GPT-2 and a Llama over 21 shapes needed one or two blocks more than the bytes to run (never none)
    need = store.swapper.partition_budget - room + blocks + 2 * size + activations
    value = _size_value(need)
    return Fix("memory.host_budget", value, f"raise memory.host_budget to at least {format_size_up(need)} "
               f"(memory.host_budget: {value}), or set kv.tier: auto to home the blocks past it on NVMe "
               f"({len(store.layers)} layers of {-(-longest // wanted)} blocks of {format_size(size)})", problem)


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
