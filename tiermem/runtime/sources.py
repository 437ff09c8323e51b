"""Where each parameter's values come from when `tiered_offload` packs a unit: the model, the checkpoint, or
the initialiser of its module.

# [Note: weight sources]
Without `checkpoint=`, every parameter keeps the values it holds. With one, every parameter comes from it,
found under
- its own name, or another name of the same tied Parameter;
- the name without what a PEFT wrapper adds (``base_model.model.`` in front, ``.base_layer`` inside);
- the name with or without the model's ``base_model_prefix`` (``bert.`` ...), as transformers loads a
  BertModel checkpoint into a BertForSequenceClassification.
A parameter the checkpoint lacks is an error naming it, before anything is placed in a partition, unless
``init_missing`` allows it (``"missing"``: every one; or fnmatch patterns of names such as
``["*.lora_*", "classifier.*"]``). Such a parameter built with real values keeps them; one on the meta
device is initialised on the CPU, unit by unit, as its module would initialise it, in module order:
- a PEFT LoRA layer: its adapter Linears' ``reset_parameters()`` and then its
  ``reset_lora_parameters(adapter, init_lora_weights)``, the draws ``get_peft_model`` makes in memory;
- a module inside a transformers PreTrainedModel: that model's ``_init_weights(module)``, what
  ``from_pretrained`` runs for weights its checkpoint lacks;
- any other module: its ``reset_parameters()``.
The module is initialised on a scratch copy that shares every other tensor, so nothing else is touched.
The random draws come from torch's global generator, as from_pretrained's do; with ``init_seed`` from a
generator seeded with it, leaving the global one as it was. So ``torch.manual_seed(s)`` before
``get_peft_model(base_on_meta, ...)`` and ``init_seed=s`` give the adapters ``torch.manual_seed(s)`` before
``get_peft_model(base_in_memory, ...)`` gives; and ``init_seed=s`` gives a new head the values
``torch.manual_seed(s); Model.from_pretrained(...)`` gives it.
Meta buffers the checkpoint lacks come from the same initialisers: non-persistent ones (never saved,
such as BERT's ``position_ids``) always, persistent ones when ``init_missing`` allows.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tiermem.errors import CheckpointError
from tiermem.runtime.safetensors_io import SafetensorsCheckpoint

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."


class WeightSources:
    """Resolves, for every parameter and buffer, where its values come from; see [Note: weight sources]."""

    def __init__(self, model: nn.Module, ckpt: SafetensorsCheckpoint | None, aliases: dict[str, str],
                 init_missing: str | Sequence[str] | None = None, init_seed: int | None = None) -> None:
        if isinstance(init_missing, str) and init_missing != "missing":
            raise ValueError(f"init_missing: expected 'missing' or a list of name patterns, got {init_missing!r}")
        self.model = model
        self.ckpt = ckpt
        self.aliases = aliases
        self.init_missing = init_missing
        self.init_seed = init_seed
        self.prefixes = sorted({p for m in model.modules() if isinstance(p := getattr(m, "base_model_prefix", None),
                                                                          str) and p}, key=len, reverse=True)
        self.order = {id(m): k for k, (_, m) in enumerate(model.named_modules(remove_duplicate=False))}
        self.names = {id(m): n for n, m in model.named_modules()}
        self.parent: dict[int, nn.Module] = {id(c): m for m in model.modules() for c in m.children()}
        self.initialised: list[str] = []  # names initialised, for the log line

    # -- names ----------------------------------------------------------------------------------------
    def checkpoint_name(self, fqn: str) -> str | None:
        """The name `fqn`'s tensor has in the checkpoint, or None when it has none."""
        if self.ckpt is None:
            return None
        entries = self.ckpt.entries
        for name in self._candidates(fqn):
            if name in entries:
                return name
        return None

    def _candidates(self, fqn: str) -> Iterator[str]:
        plain = [fqn] + [alias for alias, target in self.aliases.items() if target == fqn]
        for name in list(plain):
            if name.startswith(PEFT_PREFIX):  # a PEFT model's own names, as its base model had them
                plain.append(name[len(PEFT_PREFIX):].replace(".base_layer.", "."))
        for name in plain:
            yield name
            for prefix in self.prefixes:
                if name.startswith(prefix + "."):
                    yield name[len(prefix) + 1:]
                else:
                    yield f"{prefix}.{name}"

    def allowed(self, fqn: str) -> bool:
        """Whether init_missing lets `fqn` be initialised when the checkpoint lacks it."""
        if self.init_missing is None:
            return False
        if self.init_missing == "missing":
            return True
        return any(fnmatch.fnmatchcase(fqn, pattern) for pattern in self.init_missing)

    def check(self, params: dict[str, nn.Parameter]) -> None:
        """Raise CheckpointError naming every meta parameter that would have no source; nothing is placed yet."""
        lacking = [fqn for fqn, p in params.items()
                   if (p.is_meta or self.ckpt is not None) and self.checkpoint_name(fqn) is None]
        refused = [fqn for fqn in lacking if not self.allowed(fqn)]
        if refused:
            where = f"checkpoint {self.ckpt.path}" if self.ckpt is not None else "a checkpoint (none was given)"
            held = f"; it holds e.g. {', '.join(list(self.ckpt.entries)[:4])}" if self.ckpt is not None else ""
            raise CheckpointError(
                f"parameter {refused[0]!r} (and {len(refused) - 1} more) is not in {where}{held}. Was it saved from "
                "this model? To let such parameters start as their modules initialise them (new adapters, a new "
                f"head; one built with real values keeps them), pass init_missing=[{_pattern_hint(refused[0])!r}] "
                "or init_missing='missing'"
            )

    # -- initialising ---------------------------------------------------------------------------------
    def module_of(self, fqn: str) -> tuple[nn.Module, str]:
        """The module owning parameter or buffer `fqn`, and its attribute name."""
        mod_name, _, attr = fqn.rpartition(".")
        return self.model.get_submodule(mod_name), attr

    @contextmanager
    def generator(self) -> Iterator[None]:
        """Around the placing of the whole model: with init_seed, the draws come from a generator seeded with it."""
        if self.init_seed is None:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.init_seed)
            yield

    def initialise(self, fqns: list[str]) -> dict[str, torch.Tensor]:
        """Initial values of the parameters and buffers `fqns` (meta ones, absent from the checkpoint), as CPU
        tensors, made module by module in module order."""
        by_module: dict[int, tuple[nn.Module, list[str]]] = {}
        for fqn in fqns:
            mod, _ = self.module_of(fqn)
            owner = self._initialiser_owner(mod)
            by_module.setdefault(id(owner), (owner, []))[1].append(fqn)
        out: dict[str, torch.Tensor] = {}
        for owner, names in sorted(by_module.values(), key=lambda mn: self.order.get(id(mn[0]), 0)):
            out.update(self._initialise_module(owner, names))
        self.initialised.extend(n for n in fqns if n in out)
        return out

    def _initialiser_owner(self, mod: nn.Module) -> nn.Module:
        """The module whose initialiser makes `mod`'s tensors: a PEFT LoRA layer for its adapter Linears."""
        node: nn.Module | None = mod
        for _ in range(3):  # lora_A (a ModuleDict) -> its Linear: the layer is two levels up
            if node is None:
                break
            if callable(getattr(node, "reset_lora_parameters", None)):
                return node
            node = self.parent.get(id(node))
        return mod

    def _initialise_module(self, owner: nn.Module, fqns: list[str]) -> dict[str, torch.Tensor]:
        prefix = self.names[id(owner)]
        rel = [f[len(prefix) + 1:] if prefix else f for f in fqns]
        targets = {id(owner.get_parameter(r) if _is_param(owner, r) else owner.get_buffer(r)) for r in rel}
        # the scratch copy shares every tensor that is not being initialised (so copying it costs nothing)
        memo: dict[int, object] = {id(t): t for t in (*owner.parameters(), *owner.buffers()) if id(t) not in targets}
        shared = set(memo)
        scratch = copy.deepcopy(owner, memo)
        for mod in scratch.modules():  # the copies of the targets, still meta: give them CPU memory
            for name, param in mod._parameters.items():
                if param is not None and param.is_meta and id(param) not in shared:
                    mod._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                         requires_grad=param.requires_grad)
            for name, buf in mod._buffers.items():
                if buf is not None and buf.is_meta and id(buf) not in shared:
                    mod._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype)
        with torch.no_grad():
            self._run_initialiser(owner, scratch)
        values = {}
        for fqn, r in zip(fqns, rel, strict=True):
            t = scratch.get_parameter(r) if _is_param(scratch, r) else scratch.get_buffer(r)
            if t.is_meta:
                raise CheckpointError(f"initialising {fqn!r}: {type(owner).__name__} left it uninitialised")
            values[fqn] = t.detach()
        return values

    def _run_initialiser(self, owner: nn.Module, scratch: nn.Module) -> None:
        lora: Any = scratch
        if callable(getattr(lora, "reset_lora_parameters", None)):  # PEFT LoRA, as get_peft_model draws
            configs = _peft_configs(self.model)
            for adapter in list(getattr(lora, "lora_A", {})):
                for part in (lora.lora_A[adapter], lora.lora_B[adapter]):
                    part.reset_parameters()
                cfg = configs.get(adapter)
                lora.reset_lora_parameters(adapter, getattr(cfg, "init_lora_weights", True))
            return
        model: Any = self._pretrained_owner(owner)
        if model is not None:
            model._init_weights(scratch)
            return
        reset = getattr(scratch, "reset_parameters", None)
        if not callable(reset):
            name = self.names[id(owner)]
            raise CheckpointError(f"module {name!r} ({type(owner).__name__}) has parameters to initialise but no "
                                  "reset_parameters() and no transformers model around it; put them in the "
                                  "checkpoint, or build the module with real weights")
        reset()

    def _pretrained_owner(self, mod: nn.Module) -> nn.Module | None:
        """The innermost transformers PreTrainedModel holding `mod` (or `mod` itself), if any."""
        node: nn.Module | None = mod
        while node is not None:
            if callable(getattr(node, "_init_weights", None)) and hasattr(node, "config"):
                return node
            node = self.parent.get(id(node))
        return None


def _is_param(mod: nn.Module, rel: str) -> bool:
    mod_name, _, attr = rel.rpartition(".")
    return attr in mod.get_submodule(mod_name)._parameters


def _peft_configs(model: nn.Module) -> dict[str, object]:
    configs = getattr(model, "peft_config", None)
    return dict(configs) if isinstance(configs, dict) else {}


def _pattern_hint(fqn: str) -> str:
    """A pattern a user would write for `fqn`: its adapter part, or its top-level module."""
    for key in ("lora_", "adapter"):
        if key in fqn:
            return f"*.{key}*"
    return fqn.split(".")[0] + ".*"
