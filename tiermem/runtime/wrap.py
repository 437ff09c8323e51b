"""The wrap policy: which modules form units, and which parameters each unit owns.

# [Note: units]
A unit is a group of parameters moved together, with the modules whose forward needs them.
- Unit roots: the modules named by `wrap.classes`, or, by default, the children of the model's largest
  repeated block list (a ModuleList/Sequential of at least two modules of one class: GPT-2's
  `transformer.h`, Llama's `model.layers`). A root's unit owns every parameter in its subtree that no
  nested root owns.
- Leftover parameters (embeddings, final norms, heads) form one unit per module that holds them.
- A parameter reachable under several names (tied weights: GPT-2's `wte` and `lm_head`) belongs to the
  unit that meets it first in `named_parameters()` order; every module that holds it directly gets a
  hook that acquires that unit too.
- Units smaller than `wrap.min_unit_bytes` are merged with their neighbours so that no transfer is tiny.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from tiermem.errors import ConfigError


@dataclass
class UnitPlan:
    """A unit before it is placed: a name, the modules that anchor it, and the parameters it owns by FQN."""

    name: str
    roots: list[nn.Module] = field(default_factory=list)
    params: OrderedDict[str, nn.Parameter] = field(default_factory=OrderedDict)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())


@dataclass
class WrapPlan:
    """All units, and for every hooked module the indices of the units its forward needs."""

    units: list[UnitPlan]
    needs: dict[nn.Module, list[int]]
    aliases: dict[str, str]  # every other name of a tied parameter -> the FQN it is stored under


def find_block_list(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The repeated block list with the most parameters: (its FQN, the container), or None."""
    best: tuple[int, str, nn.Module] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size and (best is None or size > best[0]):
            best = (size, name, mod)
    return None if best is None else (best[1], best[2])


def plan_units(model: nn.Module, classes: tuple[str, ...] = (), min_unit_bytes: int = 0) -> WrapPlan:
    """Cut `model` into units (see [Note: units])."""
    names = {id(m): n for n, m in model.named_modules()}
    roots: list[nn.Module] = []
    if classes:
        known = {type(m).__name__ for m in model.modules()}
        missing = [c for c in classes if c not in known]
        if missing:
            raise ConfigError(
                f"wrap.classes: {', '.join(missing)} not found in {type(model).__name__}; module classes there "
                f"include {', '.join(sorted(known)[:12])}"
            )
        roots = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
    else:
        found = find_block_list(model)
        if found is not None:
            roots = list(found[1].children())
    root_ids = {id(m) for m in roots}

    # The innermost root above each module, found walking down from the model.
    owner_root: dict[int, nn.Module | None] = {}

    def walk(mod: nn.Module, current: nn.Module | None) -> None:
        if id(mod) in owner_root:
            return
        current = mod if id(mod) in root_ids else current
        owner_root[id(mod)] = current
        for child in mod.children():
            walk(child, current)

    walk(model, None)

    units: OrderedDict[int, UnitPlan] = OrderedDict()  # keyed by id of the anchoring module
    unit_of_param: dict[int, int] = {}  # id(param) -> key in `units`
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for mod_name, mod in model.named_modules():
        for pname, param in mod.named_parameters(recurse=False, remove_duplicate=False):
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if id(param) in first_name:
                aliases[fqn] = first_name[id(param)]
                continue
            first_name[id(param)] = fqn
            anchor = owner_root[id(mod)] or mod
            key = id(anchor)
            if key not in units:
                units[key] = UnitPlan(names[id(anchor)] or type(model).__name__, [anchor])
            units[key].params[fqn] = param
            unit_of_param[id(param)] = key
    ordered = [u for u in units.values() if u.params]
    ordered = _coalesce(ordered, min_unit_bytes)
    index_of = {id(r): i for i, u in enumerate(ordered) for r in u.roots}
    by_param = {id(p): i for i, u in enumerate(ordered) for p in u.params.values()}

    needs: dict[nn.Module, list[int]] = {}
    for i, u in enumerate(ordered):
        for r in u.roots:
            needs.setdefault(r, []).append(i)
    # modules outside their parameter's unit that hold it directly (tied weights)
    for mod in model.modules():
        anchor = owner_root[id(mod)] or mod
        for param in mod.parameters(recurse=False):
            i = by_param[id(param)]
            home = index_of.get(id(anchor))
            if home == i:
                continue
            hooked = anchor if home is not None else mod
            if i not in needs.setdefault(hooked, []):
                needs[hooked].append(i)
    # modules whose forward reads a parameter of a submodule it does not call (`self.head.weight`)
    for mod, read in _read_in_forward(model).items():
        anchor = owner_root[id(mod)] or mod
        home = index_of.get(id(anchor))
        hooked = anchor if home is not None else mod
        for param in read:
            unit = by_param.get(id(param))
            if unit is not None and unit != home and unit not in needs.setdefault(hooked, []):
                needs[hooked].append(unit)
    return WrapPlan(ordered, needs, aliases)


# Reading these of a parameter needs no values: a placeholder answers them.
_META_ONLY = frozenset({"dtype", "device", "is_meta", "is_cuda", "requires_grad", "ndim", "dim"})


def _read_in_forward(model: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
    """For each module whose class's `forward` reads `self.<submodule>...<parameter>` (accelerate's test model
    `x @ self.linear.weight.t()`, a head applied as `F.linear(h, self.head.weight)`), those parameters: their
    units are then needed by its forward as by the submodule's. Found in the source of forward, once per
    class; a read it cannot see (through getattr, a loop over submodules) is named when it fails (see
    `_read_unfetched` in tiermem/offload.py)."""
    chains: dict[type, list[list[str]]] = {}
    out: dict[nn.Module, list[nn.Parameter]] = {}
    for mod in model.modules():
        kind = type(mod)
        if kind not in chains:
            chains[kind] = _self_chains(kind)
        for chain in chains[kind]:
            owner: nn.Module | None = mod
            for k, attr in enumerate(chain):
                if owner is None:
                    break
                param = owner._parameters.get(attr)
                if param is not None and k > 0:
                    read = out.setdefault(mod, [])
                    if not (k + 1 < len(chain) and chain[k + 1] in _META_ONLY) and all(q is not param for q in read):
                        read.append(param)
                    break
                owner = owner._modules.get(attr)
    return out


def _self_chains(kind: type) -> list[list[str]]:
    """The attribute chains `self.a.b.c` in the source of `kind.forward` ([] where it has none to read)."""
    import ast
    import inspect
    import textwrap

    forward = getattr(kind, "forward", None)
    if forward is None or getattr(forward, "__module__", "").startswith("torch."):
        return []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return []
    found: list[list[str]] = []
    for node in ast.walk(tree):
        chain: list[str] = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "self" and len(chain) >= 2:
            found.append(chain[::-1])
    return found


def _coalesce(units: list[UnitPlan], min_bytes: int) -> list[UnitPlan]:
    """Merge runs of neighbouring units smaller than `min_bytes` (in parameter order)."""
    if min_bytes <= 0:
        return units
    out: list[UnitPlan] = []
    for u in units:
        last = out[-1] if out else None
        if last is not None and (last.nbytes < min_bytes or u.nbytes < min_bytes) and \
                last.nbytes + u.nbytes <= max(min_bytes, 2 * max(last.nbytes, u.nbytes)) and \
                not _nested(last, u):
            last.name = f"{last.name}+{u.name}"
            last.roots.extend(u.roots)
            last.params.update(u.params)
        else:
            out.append(u)
    return out


def _nested(a: UnitPlan, b: UnitPlan) -> bool:
    """Whether a root of one unit lies inside a root of the other (nested units stay apart)."""
    inside_a = {id(m) for r in a.roots for m in r.modules()}
    inside_b = {id(m) for r in b.roots for m in r.modules()}
    return any(id(r) in inside_a for r in b.roots) or any(id(r) in inside_b for r in a.roots)



def dtype_of(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)
