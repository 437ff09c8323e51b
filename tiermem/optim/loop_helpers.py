"""torch's own training-loop helpers on a model under tiered_offload: clip_grad_norm_, clip_grad_value_ and
torch.amp.GradScaler.

# [Note: torch's loop helpers inside the context]
A training loop written for PyTorch clips with `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`,
and HF Trainer and accelerate call it so; with float16 autocast it scales the loss with `torch.amp.GradScaler`.
Under tiered_offload the gradients live in their tiers, not in `.grad`. So torch's clipping finds none: it
returns 0 and clips nothing, and the loop trains differently without a word. And GradScaler finds no gradient
to unscale or check, and its step() fails ("No inf checks were recorded"). While a context with an optimizer
is open:
- `clip_grad_norm_` in `torch.nn.utils` (and in `torch.nn.utils.clip_grad`) is replaced by one that hands an
  offloaded model's parameters to `tm.clip_grad_norm_` (the same total, bit for bit, and the same clipping) and
  everything else to torch's. Given only some of an offloaded model's trainable parameters, or those of two
  models, or those of one beside gradients of others, it raises: the tiers clip one whole model at once.
- `clip_grad_value_` of offloaded parameters raises. It is not supported; use `clip_grad_norm_`.
- `GradScaler._unscale_grads_`, which unscale_() and step() call, hands an offloaded model's optimizer to
  `TieredOptimizer.unscale_from`: the step divides the gradients by the scale (as torch's unscale_ does, one
  multiply by its inverse) and clipping takes their norm unscaled; inf/nan gradients are found in the tiers (a
  pass over them the first time, then as they arrive) and reported to the scaler, whose step() then skips
  optimizer.step() and whose update() lowers the scale. Fused optimizers get the scaler's `grad_scale` and
  `found_inf` as torch's fused kernels do. Not with params.dtype float16, whose loss tiermem scales itself.
- A module that took `clip_grad_norm_` itself before the context began (`from torch.nn.utils import
  clip_grad_norm_`) holds torch's, which looks up `_get_total_norm` and `_clip_grads_with_norm_` in its module
  when called: those are replaced too, and the second, given an offloaded model's parameters, clips in the
  tiers and writes their total into the one torch returns.
- accelerate's `Accelerator.clip_grad_norm_`, which HF Trainer clips with, takes the norm itself over the
  parameters whose `.grad` is set (none, here) and so returned 0 without clipping: it is replaced alike,
  unscaling first as accelerate does. accelerate is not imported for this: if it is not yet when the context
  begins, the replacement is made when it is (transformers imports it with its models or its Trainer).
- `DistributedDataParallel(model)` of such a model is kept as the wrapper it is, the tiers doing DDP's job: see
  [Note: DDP around an offloaded model] in tiermem/optim/ddp.py; so is one made before the context, from its first
  forward inside it.
- Any context, training or not: another optimizer's step() on its model's parameters (one built inside the
  context, as HF Trainer builds its own when not handed one) raises, naming the optimizer to pass. Its step
  would see the tiers' placeholders: it updated nothing, silently, or failed on their size.
- Everything is put back when the last such context ends.
- Under several ranks each unit is gathered from every rank, so `model.state_dict()` (below) and
  `optimizer.state_dict()` (whole tensors, gathered) are called on every rank, as `tm.save_checkpoint` is.
  HF Trainer calls them on its saving rank only (`args.should_save`): its `save_model` and
  `_save_optimizer_and_scheduler` are replaced by ones that have every other rank take part in those
  gathers first, keeping nothing (`take_part_in_state_dict`), then do what the Trainer's do. Before, the
  saving rank's gathers met the other ranks' next collectives: gloo aborted on the mismatch, or both
  waited until the process group's timeout.
The rest of such a loop is served where the model is or by the optimizer passed in: its step(), zero_grad(),
state_dict() and load_state_dict() are the tiers' (`_delegate` in tiermem/offload.py, also for a learning-rate
scheduler made inside the context, as HF Trainer makes one); `model.zero_grad()` (each module's, as HF code clears
gradients) forgets the gradients in the tiers (`_module_zero_grad` in tiermem/offload.py); `model.state_dict()`
holds each parameter's value read from its tiers (`OffloadHandle._state_dict_hook`), and `load_state_dict()`
copies into them (`OffloadHandle._load_state_dict_pre_hook`); and activation
checkpointing, which recomputes a block in backward by calling its forward() past the block's hooks, finds
the block's parameters through its submodules' hooks (`Runtime.register_hooks`).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad as _clip_module
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tiermem.errors import OffloadError
from tiermem.optim import ddp as ddp_wrapper

_TORCH: dict[str, Callable[..., Any]] = {"clip_grad_norm_": _clip_module.clip_grad_norm_,
                                         "clip_grad_value_": _clip_module.clip_grad_value_,
                                         "_get_total_norm": _clip_module._get_total_norm,
                                         "_clip_grads_with_norm_": _clip_module._clip_grads_with_norm_,
                                         "_unscale_grads_": GradScaler._unscale_grads_}
_norm_type = [2.0]  # the norm type torch's clip_grad_norm_ asked `_get_total_norm` for last (see `_clip_grads`)
_owner: dict[int, Any] = {}  # id(parameter) -> the OffloadHandle of the context training it
_optimizers: dict[int, Any] = {}  # id(the optimizer passed in, or tm.optimizer) -> that OffloadHandle
_handles: list[Any] = []  # the open contexts with an optimizer, in the order they began


def _trainable(tm: Any) -> set[int]:
    return {id(p) for st in tm.optimizer.units for _, p, _ in st.trainable}


def _split(parameters: Any) -> tuple[list[Any], Any]:
    """The parameters given, and the one context that trains them (None: no offloaded ones among them)."""
    given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {id(_owner[id(p)]): _owner[id(p)] for p in given if id(p) in _owner}
    if len(owners) > 1:
        raise OffloadError("torch.nn.utils clipping was given the parameters of two models under tiered_offload: "
                           "each clips its own whole model, so clip each model's parameters apart (or call each "
                           "tm.clip_grad_norm_)")
    return given, next(iter(owners.values()), None)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, with an offloaded model's gradients clipped in their tiers (see [Note:
    torch's loop helpers inside the context])."""
    given, tm = _split(parameters)
    if tm is None:
        norm: torch.Tensor = _TORCH["clip_grad_norm_"](given, max_norm, norm_type, error_if_nonfinite, foreach)
        return norm
    return _clip_in_tiers(tm, given, max_norm, norm_type, error_if_nonfinite)


def _get_total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch's, noting the norm type for `_clip_grads` (torch's clip_grad_norm_ calls the two in turn)."""
    _norm_type[0] = float(norm_type)
    norm: torch.Tensor = _TORCH["_get_total_norm"](tensors, norm_type, error_if_nonfinite, foreach)
    return norm


def _clip_grads(parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    """torch's `_clip_grads_with_norm_`, which its clip_grad_norm_ looks up when called: the path of a
    clip_grad_norm_ imported by name before the context began. For an offloaded model the total it was given
    is of no gradients (they are in the tiers): the tiers clip, and that total becomes theirs in place, so the
    caller returns it."""
    given, tm = _split(parameters)
    if tm is None:
        _TORCH["_clip_grads_with_norm_"](given, max_norm, total_norm, foreach)
        return
    total_norm.copy_(_clip_in_tiers(tm, given, max_norm, _norm_type[0], False))


def _clip_in_tiers(tm: Any, given: list[Any], max_norm: float, norm_type: float,
                   error_if_nonfinite: bool) -> torch.Tensor:
    """tm.clip_grad_norm_ for parameters given to torch's clipping: all of the model's trainable ones, or an error."""
    trainable = _trainable(tm)
    mine = {id(p) for p in given if id(p) in trainable}
    others = [p for p in given if id(p) not in _owner and p.grad is not None]
    if mine != trainable or others:
        besides = f" and {len(others)} parameters with gradients of no offloaded model" if others else ""
        raise OffloadError(
            f"torch.nn.utils.clip_grad_norm_: given {len(mine)} of the {len(trainable)} trainable parameters of the "
            f"{type(tm.model).__name__} under tiered_offload{besides}; its gradients live in its tiers and are "
            "clipped for the whole model at once: pass model.parameters(), or call tm.clip_grad_norm_(max_norm)")
    total: torch.Tensor = tm.clip_grad_norm_(max_norm, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients by "
                           "the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    """torch.nn.utils.clip_grad_value_, refused for an offloaded model's parameters."""
    given, tm = _split(parameters)
    if tm is not None:
        raise OffloadError(f"torch.nn.utils.clip_grad_value_: the {type(tm.model).__name__} is under tiered_offload, "
                           "whose gradients live in its tiers, and clipping by value is not supported there; clip "
                           "by norm (torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or "
                           "tm.clip_grad_norm_)")
    _TORCH["clip_grad_value_"](given, clip_value, foreach)


def _unscale_grads_(scaler: GradScaler, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                    allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
    """GradScaler's unscale and inf check, for an offloaded model's optimizer in its tiers (see [Note: torch's
    loop helpers inside the context])."""
    tm = _optimizers.get(id(optimizer))
    if tm is None:
        per_device: dict[torch.device, torch.Tensor] = _TORCH["_unscale_grads_"](scaler, optimizer, inv_scale,
                                                                                 found_inf, allow_fp16)
        return per_device
    return {found_inf.device: tm.optimizer.unscale_from(inv_scale, found_inf)}


def _accelerate_clip_grad_norm_(accelerator: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
    """accelerate's `Accelerator.clip_grad_norm_` (HF Trainer's clipping), with an offloaded model's gradients
    clipped in their tiers after the accelerator's own unscale (see [Note: torch's loop helpers inside the
    context])."""
    given, tm = _split(parameters)
    if tm is None:
        return _PATCHED["clip_grad_norm_"](accelerator, given, max_norm, norm_type)
    accelerator.unscale_gradients()
    return _clip_in_tiers(tm, given, max_norm, norm_type, False)


def _sharded_owner(parameters: Any) -> Any:
    """The context training these parameters when it shards over several ranks, else None."""
    tm = next((_owner[id(p)] for p in parameters if id(p) in _owner), None)
    return tm if tm is not None and tm.ranks.sharded else None


def _trainer_save_model(trainer: Any, output_dir: str | None = None, _internal_call: bool = False) -> Any:
    """HF Trainer's `save_model`: with several ranks only the saving rank reaches `model.state_dict()`, whose
    gathers need every rank, so the others take part in them (see [Note: torch's loop helpers inside the
    context])."""
    tm = _sharded_owner(trainer.model.parameters())
    if tm is not None and not trainer.args.should_save and not getattr(
            trainer, "is_distributed_loading_by_transformers", False):  # else transformers has every rank gather
        tm.take_part_in_state_dict()
    return _PATCHED["save_model"](trainer, output_dir, _internal_call)


def _trainer_save_optimizer(trainer: Any, output_dir: str) -> Any:
    """HF Trainer's `_save_optimizer_and_scheduler`: the same for `optimizer.state_dict()`."""
    tm = _sharded_owner(trainer.model.parameters())
    if tm is not None and not trainer.args.should_save:
        tm.optimizer.take_part_in_state_dict()
    return _PATCHED["_save_optimizer_and_scheduler"](trainer, output_dir)


def _install_accelerate(module: Any, ours: bool) -> None:
    _replace(module.Accelerator, {"clip_grad_norm_": _accelerate_clip_grad_norm_}, ours)


def _install_trainer(module: Any, ours: bool) -> None:
    _replace(module.Trainer, {"save_model": _trainer_save_model,
                              "_save_optimizer_and_scheduler": _trainer_save_optimizer}, ours)


_PATCHED: dict[str, Callable[..., Any]] = {}  # accelerate's and transformers' own, while ours replace them


def _replace(cls: Any, ours: dict[str, Callable[..., Any]], install: bool) -> None:
    for name, fn in ours.items():
        if install:
            _PATCHED.setdefault(name, getattr(cls, name))
            setattr(cls, name, fn)
        elif name in _PATCHED:
            setattr(cls, name, _PATCHED.pop(name))


_ON_IMPORT = {"accelerate.accelerator": _install_accelerate, "transformers.trainer": _install_trainer}


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports accelerate's Accelerator module or transformers' Trainer module as the other finders would, then
    puts ours in it: for a loop that first imports them inside a context (transformers imports its Trainer,
    and with it accelerate, only when first used)."""

    def __init__(self) -> None:
        self.inner: dict[str, Any] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _ON_IMPORT or name in self.inner:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                self.inner[name], spec.loader = spec.loader, self
                return spec
        return None

    def create_module(self, spec: Any) -> Any:
        return self.inner[spec.name].create_module(spec)

    def exec_module(self, module: Any) -> None:
        inner = self.inner.pop(module.__name__)
        inner.exec_module(module)
        if _handles:
            _ON_IMPORT[module.__name__](module, True)


_on_import = _PatchOnImport()


def _ddp_init(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
    """DistributedDataParallel's __init__: for a model under tiered_offload, a TieredDDP (see [Note: DDP around
    an offloaded model] in tiermem/optim/ddp.py)."""
    tm = next((_owner[id(p)] for p in module.parameters() if id(p) in _owner), None)
    if tm is None:
        _DDP["__init__"](ddp, module, *args, **kwargs)
    else:
        ddp_wrapper.adopt(ddp, module, tm, args, kwargs, _DDP["__init__"])


def _ddp_forward(ddp: Any, *inputs: Any, **kwargs: Any) -> Any:
    """DistributedDataParallel's forward: one made before a context began training its model becomes a TieredDDP
    (see [Note: DDP around an offloaded model]); one around a model of a context that does not train it raises."""
    tm = next((_owner[id(p)] for p in ddp.module.parameters() if id(p) in _owner), None)
    if tm is not None:
        ddp_wrapper.adopt_made(ddp, tm)
        return ddp.forward(*inputs, **kwargs)  # now TieredDDP's; this call's module hooks have run already
    if any(id(p) in _managed for p in ddp.module.parameters()):
        raise OffloadError(
            f"DistributedDataParallel({type(ddp.module).__name__}) around a model under tiered_offload without an "
            "optimizer: the context does not train it, and DDP's hooks hold the parameters the tiers replaced; call "
            "the model unwrapped")
    return _DDP["forward"](ddp, *inputs, **kwargs)


_DDP: dict[str, Callable[..., Any]] = {"__init__": DistributedDataParallel.__init__,
                                       "forward": DistributedDataParallel.forward}


_OURS: dict[str, Callable[..., Any]] = {"clip_grad_norm_": clip_grad_norm_, "clip_grad_value_": clip_grad_value_,
                                        "_get_total_norm": _get_total_norm, "_clip_grads_with_norm_": _clip_grads,
                                        "_unscale_grads_": _unscale_grads_}


def _install(functions: dict[str, Callable[..., Any]]) -> None:
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        setattr(torch.nn.utils, name, functions[name])
        setattr(_clip_module, name, functions[name])
    for name in ("_get_total_norm", "_clip_grads_with_norm_"):
        setattr(_clip_module, name, functions[name])
    GradScaler._unscale_grads_ = functions["_unscale_grads_"]  # type: ignore[method-assign]
    ours = functions is _OURS
    DistributedDataParallel.__init__ = _ddp_init if ours else _DDP["__init__"]  # type: ignore[method-assign,assignment]
    DistributedDataParallel.forward = _ddp_forward if ours else _DDP["forward"]  # type: ignore[method-assign,assignment]
    for name, install in _ON_IMPORT.items():
        if name in sys.modules:
            install(sys.modules[name], ours)
    if _on_import in sys.meta_path:
        sys.meta_path.remove(_on_import)
    if ours and any(name not in sys.modules for name in _ON_IMPORT):
        sys.meta_path.insert(0, _on_import)


_managed: dict[int, Any] = {}  # id(parameter) -> the OffloadHandle holding it, for every open context
_step_hook: list[Any] = []  # the global optimizer step pre-hook's handle, while a context is open


def _foreign_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's global optimizer step pre-hook while a context is open: an optimizer other than the one the
    context trains with, holding its model's parameters, would step the tiers' empty placeholders (nothing is
    updated, or torch fails on their size): refused with the fix named."""
    tm = next((_managed[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in _managed), None)
    if tm is None or (tm.optimizer is not None and optimizer is tm.optimizer):
        return
    name, model = type(optimizer).__name__, type(tm.model).__name__
    why = (f"{name}.step(): this optimizer holds parameters of the {model} under tiered_offload, whose values and "
           "gradients live in its tiers, so its step would update nothing; ")
    if tm.optimizer is not None:
        raise OffloadError(why + "the context trains with the optimizer it was given (tiered_offload(..., "
                           "optimizer=opt)): step that one (HF Trainer: Trainer(..., optimizers=(opt, None)))")
    raise OffloadError(why + "the context was entered without an optimizer, so it does not train: build the "
                       "optimizer before the context and pass it, tiered_offload(model, ..., optimizer=opt) (HF "
                       "Trainer: and Trainer(..., optimizers=(opt, None)))")


def enter(tm: Any) -> None:
    """A context began: another optimizer's step on its parameters is refused; and when it trains `tm.model`,
    torch's clipping and GradScaler hand its parameters to it."""
    for u in tm.units:
        for _, p in u.params:
            _managed[id(p)] = tm
    if not _step_hook:
        _step_hook.append(register_optimizer_step_pre_hook(_foreign_step))
    if tm.optimizer is None:
        return
    for _, p, _ in (x for st in tm.optimizer.units for x in st.trainable):
        _owner[id(p)] = tm
    _optimizers[id(tm.optimizer)] = _optimizers[id(tm.optimizer.original)] = tm
    _handles.append(tm)
    _install(_OURS)


def leave(tm: Any) -> None:
    """That context ended: its parameters are torch's again, and with the last context so are the functions."""
    for key in [k for k, owner in _managed.items() if owner is tm]:
        del _managed[key]
    if not _managed and _step_hook:
        _step_hook.pop().remove()
    if tm not in _handles:
        return
    _handles.remove(tm)
    for table in (_owner, _optimizers):
        for key in [k for k, owner in table.items() if owner is tm]:
            del table[key]
    if not _handles:
        _install(_TORCH)
