"""A training loop left as PyTorch has it: torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler, model.zero_grad(),
model.state_dict() and activation checkpointing inside tiered_offload act on the parameters and gradients in their
tiers (see [Note: torch's loop helpers inside the context] in tiermem/optim/loop_helpers.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests import models
from tiermem import OffloadError, tiered_offload

pytest.importorskip("transformers")


def cfg(tmp_path: Any) -> dict[str, Any]:
    return {"device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme", "nvme.paths": [str(tmp_path / "swap")],
            "memory.host_budget": "8MiB", "wrap.min_unit_bytes": 0}


def model_and_optimizer(fused: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = models.gpt2().train()
    model.config.use_cache = False
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)


def _train_side_by_side(tmp_path: Any, loop: Any, steps: int = 4, fused: bool = False) -> list[Any]:
    """`loop(model, opt, data)` on the model in memory and under tiered_offload; what each returned, then the
    weights, for both."""
    data = [torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(steps)]
    out = []
    for offloaded in (False, True):
        model, opt = model_and_optimizer(fused)
        if offloaded:
            with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
                got = loop(model, opt, data)
                assert tm.stats()["bytes_read"] > 0
        else:
            got = loop(model, opt, data)
        out.append((got, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _same(results: list[Any]) -> None:
    (want, want_w), (got, got_w) = results
    assert got == want
    assert [n for n in want_w if not torch.equal(want_w[n], got_w[n])] == []


# taken by name when this module is imported, before any context: torch's own function, as a training script that
# imports it at its top holds it
from torch.nn.utils import clip_grad_norm_ as imported_early  # noqa: E402

CLIPS = {"nn.utils": lambda: torch.nn.utils.clip_grad_norm_, "nn.utils.clip_grad": lambda: torch.nn.utils.clip_grad.
         clip_grad_norm_, "imported-early": lambda: imported_early}


@pytest.mark.parametrize("clip", list(CLIPS))
def test_a_pytorch_loop_clipping_with_torch_trains_as_in_memory(tmp_path, compute_device, clip: str) -> None:
    """loss.backward(), clip_grad_norm_(model.parameters(), 0.05) (it clips at every step), step, zero_grad,
    with the function looked up in either module or imported by name before the context: the norms it returns,
    the losses and the weights equal plain PyTorch's, bit for bit. Before, torch's function found no .grad under
    the context, returned 0 and clipped nothing."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[tuple[float, float]]:
        seen = []
        for x in data:
            loss = model(x, labels=x).loss
            loss.backward()
            seen.append((loss.item(), float(CLIPS[clip]()(model.parameters(), 0.05))))
            opt.step()
            opt.zero_grad()
        return seen

    results = _train_side_by_side(tmp_path, loop)
    _same(results)
    assert all(norm > 0.05 for _, norm in results[0][0])  # clipping was active every step


def test_clipping_what_the_tiers_cannot_is_an_error_and_torch_is_put_back(tmp_path) -> None:
    """Some of the model's parameters, or them beside another model's gradients, or clipping by value, raise
    naming what to do; a model not offloaded is clipped by torch's own function; a non-finite total raises with
    error_if_nonfinite, as torch's does; on exit torch's functions are back."""
    torch_norm, torch_value = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_
    unscale = torch.amp.GradScaler._unscale_grads_
    model, opt = model_and_optimizer()
    other = nn.Linear(3, 3)
    other(torch.ones(1, 3)).sum().backward()
    x = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)):
        assert torch.nn.utils.clip_grad_norm_ is not torch_norm
        model(x, labels=x).loss.backward()
        params = list(model.parameters())
        with pytest.raises(OffloadError, match=rf"given {len(params) - 1} of the {len(params)} trainable parameters "
                                               r"of the GPT2LMHeadModel .* call tm\.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(params[1:], 1.0)
        with pytest.raises(OffloadError, match="and 2 parameters with gradients of no offloaded model"):
            torch.nn.utils.clip_grad_norm_([*params, *other.parameters()], 1.0)
        with pytest.raises(OffloadError, match="clip_grad_value_: .* clip by norm"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        want = torch_norm(nn.Linear(3, 3).requires_grad_(False).parameters(), 1.0)  # no gradients: 0
        assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3)) > 1e-3 >= float(want)
        assert float(torch_norm(other.parameters(), 1.0)) == pytest.approx(1e-3, rel=1e-3)  # torch's clipped them
        opt.zero_grad()
        (model(x, labels=x).loss * float("inf")).backward()
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.zero_grad()
    assert torch.nn.utils.clip_grad_norm_ is torch_norm and torch.nn.utils.clip_grad_value_ is torch_value
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is torch_norm
    assert torch.amp.GradScaler._unscale_grads_ is unscale


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_grad_scaler_loop_trains_as_in_memory(tmp_path, compute_device, fused: bool) -> None:
    """torch.amp.GradScaler as its documentation writes the loop (scale(loss).backward(), unscale_, clip_grad_norm_,
    step, update), 8 steps, the third overflowing: the scales, the skipped step, the norms, the losses and the
    weights equal plain PyTorch's, bit for bit, with AdamW's foreach and fused kernels (the fused one takes the
    scaler's grad_scale and found_inf). Before, GradScaler.step failed: "No inf checks were recorded"."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[tuple[float, float, Any]]:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        seen = []
        for k, x in enumerate(data):
            loss = model(x, labels=x).loss
            scaler.scale(loss * (1e38 if k == 2 else 1.0)).backward()  # step 3: inf gradients
            norm: Any = 0.0
            if not fused:  # the fused kernel unscales itself: no unscale_, no clipping
                scaler.unscale_(opt)
                norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            seen.append((loss.item(), scaler.get_scale(), "nan" if norm != norm else norm))
        return seen

    results = _train_side_by_side(tmp_path, loop, steps=8, fused=fused)
    _same(results)
    assert [s for _, s, _ in results[0][0]][:4] == [2.0**10, 2.0**10, 2.0**9, 2.0**9]  # the overflow halved it


def test_a_grad_scaler_with_float16_parameters_is_an_error_naming_the_setting(tmp_path) -> None:
    """params.dtype float16 scales the loss itself: a GradScaler on top is refused, naming both fixes."""
    from tiermem.errors import OptimizerError

    model, opt = model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path), **{"params.dtype": "float16"}):
        scaler.scale(model(x, labels=x).loss.float()).backward()
        with pytest.raises(OptimizerError, match="params.dtype float16 scales the loss itself .* drop the GradScaler"):
            scaler.unscale_(opt)
        opt.zero_grad()


def test_model_zero_grad_clears_the_gradients_in_the_tiers(tmp_path, compute_device) -> None:
    """model.zero_grad() (as HF code clears gradients) and a submodule's zero_grad() forget the gradients in the
    tiers as they forget .grad in memory: the next backward starts afresh, or, for the submodule, only its
    parameters do. Before, the tiers kept them and the next backward added to them."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[float]:
        losses = []
        for k, x in enumerate(data):
            loss = model(x, labels=x).loss
            loss.backward()
            losses.append(loss.item())
            if k == 1:  # a second backward, half of it forgotten: only block 0's gradients are this one's alone
                model(x, labels=x).loss.backward()
                model.transformer.h[0].zero_grad()
            opt.step()
            model.zero_grad()
        return losses

    _same(_train_side_by_side(tmp_path, loop))


def test_model_state_dict_inside_the_context_holds_the_trained_values(tmp_path, compute_device) -> None:
    """model.state_dict() after some steps, and a submodule's, hold the values the model in memory has after the
    same steps (pending updates applied), on the host; torch.save of it loads back the same. Before, each entry
    was a placeholder of no elements."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[Any]:
        for x in data:
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        whole = model.state_dict()
        torch.save(whole, tmp_path / "sd.pt")
        block = model.transformer.h[1].state_dict()
        return [sorted(whole), {k: v.clone() for k, v in whole.items()}, {k: v.clone() for k, v in block.items()},
                {k: v.device.type for k, v in whole.items()}]

    (want, _), (got, _) = _train_side_by_side(tmp_path, loop)
    assert got[0] == want[0] and set(got[3].values()) == {"cpu"}
    for i in (1, 2):
        assert [k for k in want[i] if not torch.equal(want[i][k], got[i][k])] == [], i
    saved = torch.load(tmp_path / "sd.pt")
    assert all(torch.equal(saved[k], want[1][k]) for k in want[1])


def test_activation_checkpointing_trains_as_in_memory(tmp_path, compute_device) -> None:
    """model.activation_checkpointing_enable(): each block's forward is recomputed in backward, called past the
    block's own hooks (only its submodules' run), and the block's parameters are there for it; the losses and
    weights equal the model's in memory with the same checkpointing. Before, the recompute saw placeholders."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[float]:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()  # transformers 5 renamed it
        losses = []
        for x in data:
            loss = model(x, labels=x).loss
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return losses

    _same(_train_side_by_side(tmp_path, loop))


def test_model_load_state_dict_inside_the_context_loads_into_the_tiers(tmp_path, compute_device) -> None:
    """model.load_state_dict() of another model's weights inside the context: the logits inside and after exit
    are that model's. A wrong shape raises torch's error and leaves no unit held; with fp32 master weights
    (params.dtype bfloat16 and an optimizer) the values go into them too, and state_dict() and exit give them
    back as loaded (before: refused). Before that, torch found placeholders of no elements and raised a size
    mismatch for every parameter."""
    model, other = models.gpt2(), models.gpt2()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)
    x = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = other(x).logits
    settings = {k: v for k, v in cfg(tmp_path).items() if k != "optimizer.tier"}
    with tiered_offload(model, **settings) as tm:
        assert str(model.load_state_dict(other.state_dict())) == "<All keys matched successfully>"
        with torch.no_grad():
            assert torch.equal(model(x).logits, want)
        bad = {**other.state_dict(), "transformer.h.0.attn.c_attn.weight": torch.zeros(3, 3)}
        with pytest.raises(RuntimeError, match="size mismatch for transformer.h.0.attn.c_attn.weight"):
            model.load_state_dict(bad)
        assert [u.depth for u in tm.units] == [0] * len(tm.units)
    with torch.no_grad():
        assert torch.equal(model(x).logits, want)
    model, opt = model_and_optimizer()  # params.dtype bfloat16: into the fp32 master weights too
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path), **{"params.dtype": "bfloat16"}):
        model.load_state_dict(other.state_dict())
        with torch.no_grad():
            assert torch.equal(model.eval()(x).logits, copy.deepcopy(other).to(torch.bfloat16).eval()(x).logits)
        for name, t in model.state_dict().items():  # the values as loaded, not their bfloat16 rounding
            assert t.dtype == torch.float32 and torch.equal(t, other.state_dict()[name]), name
    for name, t in model.state_dict().items():
        assert torch.equal(t, other.state_dict()[name]), name
    with tiered_offload(model, **settings):  # assign=True would swap the tiers' parameters for plain tensors
        with pytest.raises(OffloadError, match=r"load_state_dict\(assign=True\) .* call it without assign"):
            model.load_state_dict(other.state_dict(), assign=True)
