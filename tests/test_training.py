"""Training under tiered_offload equals plain PyTorch: optimizers, groups, accumulation, schedulers, clipping."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from tests import models
from tiermem import tiered_offload
from tiermem.device import copying_device_state
from tiermem.sizes import format_size
from tiermem.swap import Tier

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device

TIERS = {"device": "cpu", "nvme.paths": [], "wrap.min_unit_bytes": 0, "memory.host_budget": "4MiB"}


def cfg(tmp_path, **extra: Any) -> dict[str, Any]:
    out = {**TIERS, "nvme.paths": [str(tmp_path / "swap")], "params.tier": "nvme", "optimizer.tier": "nvme",
           "grads.tier": "cpu"}
    out.update(extra)
    return out


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64),
                         nn.Tanh(), nn.Linear(64, 4))


def two_groups(model: nn.Module, **second: Any) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, **second}]


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def run_steps(model: nn.Module, opt: Any, data: list, *, accumulate: int = 1, clip: float | None = None,
              sched: Any = None, clip_fn: Callable[..., Any] | None = None,
              norms: list[float] | None = None) -> list[float]:
    losses = []
    for k in range(0, len(data), accumulate):
        opt.zero_grad()
        for x, y in data[k:k + accumulate]:
            loss = loss_fn(model, x, y) / accumulate
            loss.backward()
            losses.append(float(loss.detach()))
        if clip is not None:
            assert clip_fn is not None
            norm = clip_fn(clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        if sched is not None:
            sched.step()
    return losses


def compare(tmp_path, make_opt: Callable[[nn.Module], torch.optim.Optimizer], *, steps: int = 30,
            accumulate: int = 1, clip: float | None = None, sched: Callable[[Any], Any] | None = None,
            build: Callable[[], nn.Module] = mlp, exact: bool = True, **tiers: Any) -> list[float]:
    """Train a model both ways and check losses, clip norms, weights and optimizer state agree (bit for bit
    unless `exact` is False); returns the total gradient norm clipping saw at each step."""
    data = batches(steps * accumulate)
    ref = build()
    ref_opt = make_opt(ref)
    ref_norms: list[float] = []
    ref_losses = run_steps(ref, ref_opt, data, accumulate=accumulate, clip=clip,
                           sched=sched(ref_opt) if sched else None,
                           clip_fn=lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c), norms=ref_norms)
    model = build()
    opt = make_opt(model)
    norms: list[float] = []
    with tiered_offload(model, optimizer=opt, restore_optimizer=True, **cfg(tmp_path, **tiers)) as tm:
        losses = run_steps(model, tm.optimizer, data, accumulate=accumulate, clip=clip,
                           sched=sched(tm.optimizer) if sched else None, clip_fn=tm.clip_grad_norm_, norms=norms)
    tol = {} if exact else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **(tol or {"rtol": 0, "atol": 0}))
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **(tol or {"rtol": 0, "atol": 0}))
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, **(tol or {"rtol": 0, "atol": 0}), msg=lambda m, n=name: f"{n}: {m}")
    ref_state, state = ref_opt.state_dict(), opt.state_dict()  # synced back into the user's optimizer on exit
    assert ref_state["state"].keys() == state["state"].keys()
    for k, entry in ref_state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(state["state"][k][key], value, **(tol or {"rtol": 0, "atol": 0}))
    return norms


@pytest.mark.parametrize("tiers", [
    {},
    {"params.tier": "cpu", "optimizer.tier": "cpu", "grads.tier": "cpu"},
    {"grads.tier": "nvme", "memory.host_budget": "192KiB"},
], ids=["nvme", "cpu", "nvme-grads-small-budget"])
def test_adamw_two_groups_30_steps_equal_pytorch(tmp_path, tiers: dict[str, Any]) -> None:
    """AdamW with weight decay and two param groups of different lr: losses and weights bit-exact."""
    compare(tmp_path, lambda m: torch.optim.AdamW(two_groups(m, lr=3e-3), lr=1e-3), **tiers)


def test_adam_and_amsgrad_equal_pytorch(tmp_path) -> None:
    """Adam (L2 weight decay) and Adam with amsgrad match torch."""
    compare(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.01), steps=15)
    compare(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, amsgrad=True), steps=15)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_equal_pytorch(tmp_path, nesterov: bool) -> None:
    """SGD with momentum (and nesterov) and weight decay matches torch."""
    compare(tmp_path, lambda m: torch.optim.SGD(two_groups(m, lr=0.02), lr=0.05, momentum=0.9,
                                                nesterov=nesterov), steps=20)


@pytest.mark.parametrize("make_opt", [
    lambda m: torch.optim.AdamW(two_groups(m, lr=3e-3), lr=1e-3, fused=True),
    lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.01, fused=True),
    lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01, fused=True),
], ids=["adamw", "adam", "sgd-momentum"])
def test_fused_optimizers_equal_pytorch_fused(tmp_path, make_opt: Callable[[nn.Module], Any]) -> None:
    """An optimizer built with fused=True is updated with PyTorch's fused CPU kernel: bit-exact with it."""
    compare(tmp_path, make_opt, steps=15)


def test_plain_sgd_equal_pytorch(tmp_path) -> None:
    """SGD without momentum keeps no state and matches torch."""
    compare(tmp_path, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), steps=10)


def test_gradient_accumulation_equal_pytorch(tmp_path) -> None:
    """Two backward passes per step add up exactly as PyTorch's .grad accumulation does."""
    compare(tmp_path, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), steps=15, accumulate=2)


def test_lr_scheduler_equal_pytorch(tmp_path) -> None:
    """A torch.optim.lr_scheduler attached to tm.optimizer changes the lr the update uses."""
    compare(tmp_path, lambda m: torch.optim.AdamW(two_groups(m), lr=1e-2), steps=20,
            sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5))


def test_clip_grad_norm_equal_pytorch(tmp_path) -> None:
    """tm.clip_grad_norm_ clips exactly as torch.nn.utils.clip_grad_norm_."""
    compare(tmp_path, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=15, clip=0.05)


class BNDrop(nn.Module):
    """BatchNorm (buffers updated in training), dropout (RNG), a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(16, 32)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
                                  nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.tanh(self.frozen(x)))


def test_batchnorm_dropout_frozen_equal_pytorch(tmp_path) -> None:
    """BatchNorm running stats, dropout masks (same RNG stream) and frozen weights all match torch."""
    def trainable(m: nn.Module) -> list[nn.Parameter]:
        return [p for p in m.parameters() if p.requires_grad]

    torch.manual_seed(123)
    compare(tmp_path, lambda m: torch.optim.AdamW(trainable(m), lr=1e-3), steps=10, build=lambda: BNDrop().train())


def test_gpt2_tied_weights_train_equal_pytorch(tmp_path) -> None:
    """GPT-2 with its tied embedding/head trains like in memory (dropout off, fp32)."""
    pytest.importorskip("transformers")
    models.gpt2_training_matches(cfg(tmp_path), width=32, vocab=100, shape=(2, 8), steps=6)


def test_original_optimizer_step_does_the_same(tmp_path) -> None:
    """Inside the context the user's own opt.step()/zero_grad() run the tiered optimizer."""
    compare_model = mlp()
    data = batches(5)
    ref_opt = torch.optim.AdamW(compare_model.parameters(), lr=1e-3)
    run_steps(compare_model, ref_opt, data)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)):
        run_steps(model, opt, data)
    for a, b in zip(compare_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert "step" not in opt.__dict__  # the delegation is removed on exit
    opt.step()  # and the original works on its own again


def test_optimizer_on_other_parameters_is_refused(tmp_path) -> None:
    """An optimizer holding parameters outside the model is refused with what to do."""
    model = mlp()
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(Exception, match="not in the offloaded model"):
        with tiered_offload(model, optimizer=torch.optim.SGD([*model.parameters(), stray], lr=0.1),
                            **cfg(tmp_path)):
            pass


def test_state_dict_round_trip_inside(tmp_path) -> None:
    """tm.optimizer.state_dict() loads back into a fresh context and training continues identically."""
    data = batches(10)
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    run_steps(ref, ref_opt, data)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        run_steps(model, tm.optimizer, data[:5])
        saved = tm.optimizer.state_dict()
        assert saved["state"][0]["step"] == 5
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt2, **cfg(tmp_path)) as tm:
        tm.optimizer.load_state_dict(saved)
        run_steps(model, tm.optimizer, data[5:])
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_gradients_leave_the_device(tmp_path) -> None:
    """After backward no parameter holds a .grad: they sit in the fp32 accumulators of grads.tier."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batches(1)[0]
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        loss_fn(model, x, y).backward()
        assert all(p.grad is None for p in model.parameters())
        assert all(u.depth == 0 for u in tm.units)
        assert tm.stats()["now_bytes"]["device"] <= tm.stats()["largest_unit_bytes"] * (1 + 2)


def test_budget_too_small_for_a_units_training_state(tmp_path) -> None:
    """A host budget that cannot hold one unit's parameters, gradients and state is refused up front."""
    model = mlp()
    with pytest.raises(Exception, match=r"memory.host_budget \(64 KiB\) cannot hold the training state.*at least"):
        with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters()),
                            **cfg(tmp_path, **{"memory.host_budget": "64KiB"})):
            pass
    assert all(p.numel() > 0 for p in model.parameters())


MIXED_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9, centered=True),
    "NAdam": lambda params: torch.optim.NAdam(params, lr=1e-3),
}


def manual_mixed_precision(make: Callable[[Any], torch.optim.Optimizer], data: list[tuple[torch.Tensor, torch.Tensor]]
                           ) -> tuple[list[float], list[nn.Parameter]]:
    """The textbook recipe in memory: a bfloat16 mlp() computes, `make`'s optimizer steps float32 copies of its
    parameters (the masters) with its gradients in float32, and the copies go back into it before each step's
    forward. The losses, and the masters at the end."""
    ref = mlp().bfloat16()
    master = [nn.Parameter(p.detach().float().clone()) for p in ref.parameters()]
    opt = make(master)
    losses = []
    for x, y in data:
        with torch.no_grad():
            for p, m in zip(ref.parameters(), master, strict=True):
                p.copy_(m)
        ref.zero_grad()
        loss = loss_fn(ref, x, y)
        loss.backward()
        for p, m in zip(ref.parameters(), master, strict=True):
            m.grad = p.grad.float()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, master


@pytest.mark.parametrize("update", ["lazy", "step"])
@pytest.mark.parametrize("kind", list(MIXED_OPTIMIZERS))
def test_bfloat16_params_with_fp32_master_equal_manual_mixed_precision(tmp_path, update: str, kind: str) -> None:
    """params.dtype bfloat16 trains 20 steps like the textbook recipe: bf16 compute, fp32 grads and master, the
    optimizer on the master weights (AdamW; RMSprop and NAdam, whose state and scalars differ).

    The master weights start from the parameters as stored (cast to bfloat16), as when training a bf16 model.
    """
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(20)]
    ref_losses, master = manual_mixed_precision(MIXED_OPTIMIZERS[kind], data)
    model = mlp()
    opt = MIXED_OPTIMIZERS[kind](model.parameters())
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path, **{"params.dtype": "bfloat16",
                                                                  "optimizer.update": update})) as tm:
        losses = run_steps(model, tm.optimizer, data)
        state = tm.optimizer.by_unit[0].state
        assert state is not None and any(s.name.startswith("master.") for s in state.layout.slots)
    assert losses == ref_losses
    for p, m in zip(model.parameters(), master, strict=True):
        assert p.dtype == torch.float32  # restored to the model's own dtype on exit: the masters' values
        assert torch.equal(p.detach(), m.detach())


def test_float16_dynamic_loss_scaling_skips_overflow_steps(tmp_path) -> None:
    """float16 params: tm.backward scales the loss; an inf gradient skips the step and halves the scale."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batches(1)[0]
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path, **{"params.dtype": "float16"})) as tm:
        o = tm.optimizer
        assert o.loss_scaling and o.scale == 2.0**16
        with tm.gathered():
            before = [p.detach().clone() for p in model.parameters()]
        tm.backward(loss_fn(model, x.half(), y.half()) * 1e6)  # overflows in float16
        o.step()
        assert o.skipped_steps == 1 and o.scale == 2.0**15
        with tm.gathered():
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        o.zero_grad()
        tm.backward(loss_fn(model, x.half(), y.half()))
        o.step()
        assert o.skipped_steps == 1
        with tm.gathered():
            assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_float16_with_a_plain_loss_backward_is_not_divided_by_a_scale_never_applied(tmp_path, caplog) -> None:
    """float16 params and a loop calling loss.backward() instead of tm.backward: the loss was not scaled, so the
    step must not divide by the scale. Two SGD steps equal the recipe by hand without scaling (fp16 model, fp32
    gradients and master weights); a warning says once that tm.backward scales the loss. Before, the update came
    out 65536 times too small. Both kinds of backward in one step cannot be unscaled: an error."""
    from tiermem.errors import OptimizerError

    data = batches(2)
    ref = mlp().half()
    master = [p.detach().float().clone() for p in ref.parameters()]
    for x, y in data:
        ref.zero_grad()
        _fp16_loss(ref, x, y).backward()
        with torch.no_grad():
            for m, p in zip(master, ref.parameters(), strict=True):
                m.add_(p.grad.float(), alpha=-0.1)  # as torch.optim.SGD updates
                p.copy_(m.half())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="tiermem"):
        with tiered_offload(model, optimizer=opt, **cfg(tmp_path, **{"params.dtype": "float16"})) as tm:
            for x, y in data:
                _fp16_loss(model, x, y).backward()
                opt.step()
                opt.zero_grad()
            with tm.gathered():
                got = [p.detach().clone() for p in model.parameters()]
            tm.backward(_fp16_loss(model, *data[0]))
            _fp16_loss(model, *data[1]).backward()
            with pytest.raises(OptimizerError, match=r"both with tm\.backward\(loss\) .* and with loss\.backward"):
                opt.step()
            opt.zero_grad()
    assert [torch.equal(a, b.detach()) for a, b in zip(got, ref.parameters(), strict=True)] == [True] * len(got)
    assert sum("loss.backward() was called without tm.backward(loss)" in r.getMessage() for r in caplog.records) == 1


def _fp16_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x.half()).float() - y) ** 2).mean()  # the loss in float32, as autocast would compute it


@pytest.mark.parametrize("update", ["lazy", "step"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_float16_loss_scaling_with_overflows_and_clipping_equal_pytorch_grad_scaler(tmp_path, update: str,
                                                                                    accumulate: int) -> None:
    """20 steps of float16 parameters with dynamic loss scaling, two steps overflowing and clipping active,
    bit-identical to PyTorch's recipe by hand: fp16 model, fp32 gradients and master weights, AdamW with
    torch.amp.GradScaler (unscale_, clip_grad_norm_, a skipped step and a halved scale on overflow, a
    doubled scale after growth_interval good steps)."""
    # a loss times 1e30 stays finite in float32 but its fp16 gradients overflow; a growth window of 4 steps
    # (GradScaler's and tiermem's default is 2000) lets the scale grow back within 20 steps
    overflow, huge, max_norm, interval = {3, 11}, 1e30, 0.05, 4
    data = batches(20 * accumulate)
    ref = mlp().half()
    master = [p.detach().float().clone().requires_grad_(True) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW([{"params": [m for m in master if m.dim() > 1], "weight_decay": 0.1},
                                 {"params": [m for m in master if m.dim() <= 1], "weight_decay": 0.0, "lr": 3e-3}],
                                lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=interval)
    ref_losses: list[float] = []
    ref_norms: list[float] = []
    ref_skipped: list[int] = []
    scales: list[float] = []
    for k in range(20):
        for m in master:
            m.grad = None
        for x, y in data[k * accumulate:(k + 1) * accumulate]:
            ref.zero_grad()
            loss = _fp16_loss(ref, x, y) / accumulate * (huge if k in overflow else 1.0)
            scaler.scale(loss).backward()
            for p, m in zip(ref.parameters(), master, strict=True):  # accumulated in fp32
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
            ref_losses.append(float(loss.detach()))
        scaler.unscale_(ref_opt)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(master, max_norm)))
        before = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        if scaler.get_scale() < before:
            ref_skipped.append(k)
        scales.append(scaler.get_scale())
        with torch.no_grad():
            for p, m in zip(ref.parameters(), master, strict=True):
                p.copy_(m)
    model = mlp()
    opt = torch.optim.AdamW(two_groups(model, lr=3e-3), lr=1e-2)
    losses: list[float] = []
    norms: list[float] = []
    tm_scales: list[float] = []
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path, **{"params.dtype": "float16",
                                                                  "optimizer.update": update})) as tm:
        o = tm.optimizer
        o.growth_interval = interval  # no config key sets it: the attribute, as GradScaler(growth_interval=)
        for k in range(20):
            o.zero_grad()
            for x, y in data[k * accumulate:(k + 1) * accumulate]:
                loss = _fp16_loss(model, x, y) / accumulate * (huge if k in overflow else 1.0)
                tm.backward(loss)
                losses.append(float(loss.detach()))
            norms.append(float(tm.clip_grad_norm_(max_norm)))
            o.step()
            tm_scales.append(o.scale)
        assert o.skipped_steps == len(ref_skipped) == 2
        state = o.state_dict()["state"]  # in fp32 as kept (restore_optimizer would cast it to the fp16 params)
    assert ref_skipped == sorted(overflow) and max(scales) > 2.0**16  # only the forced overflows; it grew too
    assert sum(n > max_norm for k, n in enumerate(ref_norms) if k not in overflow) >= 15, ref_norms
    assert tm_scales == scales
    assert losses == ref_losses
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=0, atol=0, equal_nan=True)
    for p, m in zip(model.parameters(), master, strict=True):
        assert p.dtype == torch.float32  # restored to the model's own dtype on exit: the masters' values
        assert torch.equal(p.detach(), m.detach())
    ref_state = ref_opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for i, entry in ref_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[i][key], entry[key]), (i, key)


def _warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 5))


@pytest.mark.parametrize("update", ["lazy", "step"])
@pytest.mark.parametrize("accumulate,sched", [(2, "steplr"), (3, "warmup")])
def test_clipping_accumulation_and_schedulers_equal_pytorch_bit_for_bit(tmp_path, update: str, accumulate: int,
                                                                       sched: str) -> None:
    """20 steps of AdamW with two param groups, clip_grad_norm_ active on most steps, 2- and 3-step
    accumulation and a StepLR or warm-up schedule: losses, weights and state bit-identical to PyTorch,
    whether each unit is updated lazily (as the next forward fetches it) or in step()."""
    make = {"steplr": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), "warmup": _warmup}
    norms = compare(tmp_path, lambda m: torch.optim.AdamW(two_groups(m, lr=3e-3), lr=1e-2), steps=20,
                    accumulate=accumulate, clip=0.05, sched=make[sched], **{"optimizer.update": update})
    assert len(norms) == 20 and sum(n > 0.05 for n in norms) >= 15, norms  # clipping scaled most steps


@pytest.mark.parametrize("update", ["lazy", "step"])
@pytest.mark.parametrize("make_opt", [
    lambda m: torch.optim.AdamW(two_groups(m, lr=torch.tensor(3e-3)), lr=torch.tensor(1e-2)),
    lambda m: torch.optim.AdamW(two_groups(m, lr=torch.tensor(3e-3)), lr=torch.tensor(1e-2), fused=True),
    lambda m: torch.optim.SGD(two_groups(m, lr=torch.tensor(3e-2)), lr=torch.tensor(5e-2), momentum=0.9),
], ids=["adamw", "adamw-fused", "sgd-momentum"])
def test_tensor_lr_with_a_scheduler_equal_pytorch(tmp_path, update: str, make_opt: Callable[[nn.Module], Any]) -> None:
    """A tensor lr that StepLR changes in place after every step: each update uses its own step's lr, as a tensor."""
    compare(tmp_path, make_opt, steps=6, sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1),
            **{"optimizer.update": update})


@pytest.mark.parametrize("grads_tier", ["cpu", "nvme"])
def test_a_step_is_applied_as_the_next_forward_fetches_each_unit(tmp_path, grads_tier: str) -> None:
    """optimizer.update lazy: step() leaves every unit's update pending and reads nothing; the next forward
    applies each before using it (and gives the gradient accumulators back at once, host or NVMe); gathered()
    applies what is still pending first. The result is PyTorch's."""
    x, y = batches(1)[0]
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loss_fn(ref, x, y).backward()
    ref_opt.step()
    model = mlp()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                        **cfg(tmp_path, **{"grads.tier": grads_tier, "memory.host_budget": "8MiB"})) as tm:
        opt = tm.optimizer
        loss_fn(model, x, y).backward()
        tm.reset_stats()
        opt.step()
        assert len(opt.pending) == len(opt.units) and tm.stats()["bytes_read"] == 0  # all of it fits the budget
        assert not any(st.steps for st in opt.units)  # recorded, not applied
        opt.zero_grad()
        with torch.no_grad():
            out = model(x)
        assert not opt.pending
        assert torch.equal(out, ref(x))
        assert not any(tm.swapper.holds_host(st.grads) for st in opt.units)
        loss_fn(model, x, y).backward()
        opt.step()
        assert opt.pending
        with tm.gathered():  # applies the second step first
            assert not opt.pending
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_two_steps_without_a_forward_between_and_grads_kept_across_steps_equal_pytorch(tmp_path,
                                                                                     clip: float | None) -> None:
    """A second step() (or clip_grad_norm_) before any forward applies the first update, then records its own;
    gradients kept across a step (no zero_grad) are added to, as PyTorch adds to .grad, also from NVMe, and
    a clip before the second step sees them as the first clip left them."""
    data = batches(2)
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = mlp()
    norms: dict[str, list[float]] = {"ref": [], "tm": []}
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                        **cfg(tmp_path, **{"grads.tier": "nvme", "memory.host_budget": "8MiB"})) as tm:
        for who, m, opt, clip_fn in (
                ("ref", ref, ref_opt, lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c)),
                ("tm", model, tm.optimizer, tm.clip_grad_norm_)):
            # a backward and a step; a step on the same gradients; the second batch's added to them and a step
            for fresh in (data[0], None, data[1]):
                if fresh is not None:
                    loss_fn(m, *fresh).backward()
                if clip is not None:
                    norms[who].append(float(clip_fn(clip)))
                opt.step()
    assert norms["tm"] == norms["ref"]
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grads_tier", ["cpu", "nvme"])
def test_a_flush_gives_the_updated_units_accumulators_back(tmp_path, grads_tier: str) -> None:
    """Applying recorded updates outside a forward (state_dict(), checkpoints, exit) gives each unit's
    accumulators back at once after zero_grad: their host memory returns to the pool, none is written to NVMe."""
    x, y = batches(1)[0]
    model = mlp()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                        **cfg(tmp_path, **{"grads.tier": grads_tier, "memory.host_budget": "8MiB"})) as tm:
        opt, sw = tm.optimizer, tm.swapper
        loss_fn(model, x, y).backward()
        tm.clip_grad_norm_(0.05)  # the update scales the accumulators in place: they are dirty
        opt.step()
        opt.zero_grad()
        assert all(sw.holds_host(st.grads) for st in opt.units)
        tm._settle_transfers()  # the reads step() started for the next pass land before the host bytes are taken
        host = tm.stats()["now_bytes"]["host"]
        kept = [p for st in opt.units for p in (st.unit.partition, st.state) if p is not None]
        # The write-backs are named in a trace, not counted in bytes: a read-ahead's eviction may have
        # written a partition already, or drop a clean one, depending on when its reads land.
        with tm.trace(tmp_path / "flush.json") as tracer:
            opt.state_dict()
            assert not opt.pending and not any(sw.holds_host(st.grads) for st in opt.units)
            assert host - tm.stats()["now_bytes"]["host"] >= sum(st.grads.size for st in opt.units)
            dirty = {p.name for p in kept if p.dirty}
            sw.flush()  # every dirty partition to NVMe: the parameters and state, not the accumulators
        written = {e["name"] for e in tracer.events if e["args"].get("tier") == "host->nvme"}
        assert dirty and dirty <= written, (dirty, written)
        assert not written & {st.grads.name for st in opt.units}, written
        assert not any(p.dirty for p in kept)


def test_overlap_backward_is_an_error_naming_its_replacement(tmp_path) -> None:
    """optimizer.overlap_backward (update during backward, no clipping or accumulation) is gone; a config
    that still sets it is told what replaced it."""
    from tiermem import ConfigError

    with pytest.raises(ConfigError, match=r"optimizer\.overlap_backward: was replaced by optimizer\.update"):
        with tiered_offload(mlp(), **cfg(tmp_path, **{"optimizer.overlap_backward": True})):
            pass


def test_a_kept_key_value_cache_is_named_when_training(tmp_path, caplog) -> None:
    """A transformers model whose config keeps its key/value cache holds every layer's keys and values
    through forward; training under tiered_offload says so and names the setting, and says nothing once
    it is off."""
    model = models.gpt2(layers=1, width=32, vocab=100).train()
    for use_cache, expected in ((True, 1), (False, 0)):
        model.config.use_cache = use_cache
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tiermem.offload"):
            with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters()), **cfg(tmp_path)):
                pass
        named = [r for r in caplog.records if "model.config.use_cache = False" in r.getMessage()]
        assert len(named) == expected, (use_cache, [r.getMessage() for r in caplog.records])


def test_an_optimizer_on_a_meta_device_model_trains_it_from_its_checkpoint(tmp_path) -> None:
    """AdamW built on a model made on the meta device and streamed with checkpoint=: it ends up holding the
    real parameters, and two clipped steps equal the same training of the model built in memory."""
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    ref = models.gpt2(layers=2, width=32, vocab=100)
    ref.config.use_cache = False
    ref.config.resid_pdrop = ref.config.embd_pdrop = ref.config.attn_pdrop = 0.0
    for m in ref.modules():  # the modules were made with the old rates; the meta model is made with these
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    ref.save_pretrained(tmp_path / "hf")
    data = [torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for ids in data:
        ref_opt.zero_grad()
        ref(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
    with torch.device("meta"):
        model = GPT2LMHeadModel(ref.config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, checkpoint=tmp_path / "hf" / "model.safetensors",
                        restore_optimizer=True, **cfg(tmp_path, **{"memory.host_budget": "2MiB"})) as tm:
        for ids in data:
            tm.optimizer.zero_grad()
            tm.backward(model(ids, labels=ids).loss)
            tm.clip_grad_norm_(0.5)
            tm.optimizer.step()
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert len(opt.state) == len(list(model.parameters()))


def test_exit_unmaps_the_host_pool_while_the_handle_lives(tmp_path) -> None:
    """A user who keeps `tm` after the block (to read its stats) does not keep memory.host_budget of RSS:
    exit lets go of every view of the pool, so its mapping is closed, not merely marked closed."""
    model = models.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    with tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "8MiB", "activations.tier": "nvme",
                                                  "activations.buffer": "1MiB", "activations.min_bytes": 1}),
                        optimizer=opt) as tm:
        for _ in range(2):
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            tm.clip_grad_norm_(1.0)
            opt.step()
        pool = tm.swapper.pool
        assert not pool.buffer._map.closed
    assert pool.buffer._map.closed, "the pool is still mapped: something kept a view of it"
    assert tm.stats()["passes"] == 2  # the figures stay readable


@pytest.mark.parametrize("budget,tier", [("4MiB", "cpu"), ("1280KiB", "nvme")])
def test_grads_auto_spills_to_nvme_only_when_they_do_not_fit(tmp_path, caplog, budget: str, tier: str) -> None:
    """grads.tier auto (the default) keeps the accumulators in host memory when they all fit the budget beside a
    step, else puts them on NVMe; where a fixed grads.tier: cpu is refused at that budget. Training is exact
    either way, and the plan line at entry says where each kind of state went and why."""
    from tests.models import gpt2_training_matches

    extra = {**cfg(tmp_path), "grads.tier": "auto", "memory.host_budget": budget}
    chosen: list[str] = []
    with caplog.at_level(logging.INFO, logger="tiermem.offload"):
        gpt2_training_matches(extra, width=64, vocab=500, shape=(2, 8), steps=3,
                              check=lambda tm: chosen.append(tm.plan["grads"]["tier"]))
    assert chosen == [tier]
    line = next(r.getMessage() for r in caplog.records if "plan:" in r.getMessage())
    assert f"on {tier} (auto:" in line and "optimizer state" in line and "for a unit's step" in line
    if tier == "nvme":
        model = models.gpt2(layers=2, width=64, vocab=500)
        with pytest.raises(Exception, match="cannot hold the training state"):
            with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters()),
                                **{**extra, "grads.tier": "cpu"}):
                pass


@pytest.mark.parametrize("available,budget,cap,tier,keep", [
    (1 << 40, "12MiB", None, "memory", 0),  # plenty beside the budget, and the parameters fit a quarter of it
    (12 << 20, "12MiB", None, "nvme", 0),  # the host is short beside the budget: nothing stays in memory
    (1 << 40, "2MiB", None, "nvme", 512 << 10),  # the parameters are over a quarter of the budget: that stays
    (1 << 40, "12MiB", 384 << 10, "nvme", 384 << 10),  # a quarter is more than the cap: the cap stays (CPU)
])
def test_activations_auto_goes_to_nvme_when_a_step_would_hold_too_much_beside_the_budget(
        tmp_path, monkeypatch, available: int, budget: str, cap: int | None, tier: str, keep: int) -> None:
    """activations.tier auto (the default) keeps saved activations in memory when the parameters' size fits both
    what a step may hold beside memory.host_budget (a quarter of it, with the CPU computing at most
    ACTIVATIONS_BESIDE_BUDGET_MAX) and the host memory left beside it, else sends them to NVMe, keeping that
    share in memory where the host has room; they really go, the plan says which and why, and training is
    exact either way."""
    import tiermem.offload

    monkeypatch.setattr(tiermem.offload, "_host_memory_available", lambda: available)
    if cap is not None:  # the model's scale: its parameters (0.52 MiB) are over this, under a quarter of 12 MiB
        monkeypatch.setattr(tiermem.offload, "ACTIVATIONS_BESIDE_BUDGET_MAX", cap)
        if copying_device_state().enabled:  # activations kept on a device of its own: the cap is for host memory
            tier, keep = "memory", 0
    settings = {**cfg(tmp_path), "memory.host_budget": budget, "activations.buffer": "256KiB",
                "activations.min_bytes": 1}
    assert "activations.tier" not in settings and "activations.keep" not in settings  # the defaults
    seen: list[tuple[str, int | None, str, dict[str, Any]]] = []

    def check(tm: Any) -> None:
        seen.append((tm.plan["activations"]["tier"], tm.config.activations.keep, tm.plan_summary(), tm.stats()))

    models.gpt2_training_matches(settings, width=64, vocab=500, shape=(2, 8), steps=3, check=check)
    (chosen, kept, line, stats), = seen
    assert chosen == tier and f"activations in {tier} (auto: " in line, line
    assert (stats.get("activations_saved_bytes", 0) > 0) == (tier == "nvme")
    if tier == "nvme":
        assert kept == keep
        assert (stats["activations_in_memory_bytes"] > 0) == (keep > 0)
        assert (f"{format_size(keep)} of each forward's kept in memory" in line) == (keep > 0), line


@pytest.mark.parametrize("tier", ["memory", "nvme"])
def test_an_explicit_activations_tier_is_kept_whatever_the_memory(tmp_path, monkeypatch, tier: str) -> None:
    """activations.tier memory or nvme, set in the config, is kept whether host memory is short or plentiful,
    and the plan names no auto reason."""
    import tiermem.offload

    for available in (0, 1 << 40):
        monkeypatch.setattr(tiermem.offload, "_host_memory_available", lambda a=available: a)
        model = mlp()
        with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters()),
                            **cfg(tmp_path, **{"memory.host_budget": "8MiB", "activations.buffer": "1MiB",
                                               "activations.tier": tier})) as tm:
            assert tm.config.activations.tier == tm.plan["activations"]["tier"] == tier
            assert "auto" not in tm.plan_summary().split("activations in")[1].split(";")[0]


def test_activations_auto_stays_in_memory_without_training_or_nvme(tmp_path, monkeypatch) -> None:
    """auto keeps activations in memory, short of host memory or not, without an optimizer, with no other
    tier on NVMe, or when activations.buffer would take over a quarter of the host budget; the plan says why."""
    import tiermem.offload

    monkeypatch.setattr(tiermem.offload, "_host_memory_available", lambda: 0)
    model = mlp()
    cases = [({}, False, "no optimizer"),
             ({"params.tier": "cpu", "optimizer.tier": "cpu", "grads.tier": "cpu"}, True, "no other tier is on nvme"),
             ({"activations.buffer": "4MiB"}, True, "more than a quarter of memory.host_budget")]
    for extra, train, why in cases:
        opt = torch.optim.AdamW(model.parameters()) if train else None
        with tiered_offload(model, optimizer=opt, **cfg(tmp_path, **{"memory.host_budget": "8MiB",
                                                                     "activations.buffer": "1MiB", **extra})) as tm:
            assert tm.config.activations.tier == "memory"
            assert why in tm.plan["activations"]["why"] and why in tm.plan_summary()


def test_restore_optimizer_keeps_fp32_state_when_params_train_in_float16(tmp_path) -> None:
    """restore_optimizer=True with params.dtype float16 on an fp32 model: the state copied into the optimizer at
    exit is the fp32 state kept inside, bit for bit (it was loaded while the parameters were still float16, and
    torch cast it to them)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, restore_optimizer=True,
                        **cfg(tmp_path, **{"params.dtype": "float16"})) as tm:
        for x, y in batches(6):
            tm.optimizer.zero_grad()
            tm.backward(nn.functional.mse_loss(model(x.half()).float(), y))
            tm.optimizer.step()
        inside = tm.optimizer.state_dict()["state"]
        assert inside and tm.optimizer.skipped_steps < 6
    outside = opt.state_dict()["state"]
    assert next(model.parameters()).dtype == torch.float32
    for k, st in inside.items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert outside[k][name].dtype == torch.float32 and torch.equal(outside[k][name], st[name]), (k, name)


@pytest.mark.parametrize("grads_tier", ["cpu", "nvme"])
def test_exit_gives_the_accumulators_back_before_the_parameters(tmp_path, monkeypatch, grads_tier: str) -> None:
    """Leaving after step() with no zero_grad: the last update is applied, and every gradient accumulator's
    host memory is given back before the parameters are read back through the pool (kept, they fragmented
    it, and a unit found no piece large enough). The weights equal plain PyTorch's."""
    from tiermem import offload

    seen: list[bool] = []
    restore_units = offload._restore_units

    def checked(model, units, swapper):  # type: ignore[no-untyped-def]
        seen.append(any(swapper.holds_host(st.grads) for st in opt.units))
        return restore_units(model, units, swapper)

    monkeypatch.setattr(offload, "_restore_units", checked)
    data = batches(2)
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data:
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    model = mlp()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                        **cfg(tmp_path, **{"grads.tier": grads_tier})) as tm:
        opt = tm.optimizer
        for x, y in data:
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            tm.clip_grad_norm_(0.05)
            opt.step()
        assert opt.has_pending() and all(st.has_grad for st in opt.units)  # no zero_grad after the last step
    assert seen == [False]
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_accumulators_scattered_through_the_host_pool_are_moved_for_a_large_units_update(tmp_path) -> None:
    """GPT-2 whose embedding's optimizer state is the largest piece, with host-homed accumulators taking
    most of the pool: they end up scattered between the pieces read during backward, and the embedding's
    lazy update found 19 MiB free in no piece of its 8 MiB (a BudgetError). Moving idle accumulators joins
    the free bytes; training with clipping stays bit-identical to PyTorch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=4096, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))

    g = torch.Generator().manual_seed(0)
    # when reads and writes land decides where pieces go: with 4 steps, 1 run in 6 beside a busy CPU saw no
    # split; with 8, none in 12
    data = [torch.randint(0, 4096, (2, 32), generator=g) for _ in range(8)]
    results = []
    for offloaded in (False, True):
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        offload = cfg(tmp_path, **{"memory.host_budget": "42MiB", "activations.tier": "nvme",
                                   "activations.buffer": "1MiB", "wrap.min_unit_bytes": "1MiB"})
        with tiered_offload(model, optimizer=opt, **offload) if offloaded else nullcontext() as tm:
            step_opt = tm.optimizer if tm is not None else opt
            losses = []
            for ids in data:
                step_opt.zero_grad()
                loss = model(ids, labels=ids).loss
                loss.backward()
                if tm is not None:
                    tm.clip_grad_norm_(1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                step_opt.step()
                losses.append(float(loss.detach()))
            if tm is not None:
                assert tm.stats()["bytes_moved"] > 0  # the case this pins did come up
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert torch.equal(results[1][1][name], value), name


def test_a_pending_updates_read_ahead_takes_its_state_first_and_nothing_past_it_without_room(tmp_path,
                                                                                         monkeypatch) -> None:
    """Reading ahead for units whose update is recorded: a unit's state is asked for before its parameters,
    and when its partitions find no room, nothing of the units after it is read (those reads would take the
    room its update waits for)."""
    model = mlp()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), **cfg(tmp_path)) as tm:
        x, y = batches(1)[0]
        loss_fn(model, x, y).backward()
        tm.optimizer.step()
        rt, sw = tm.runtime, tm.swapper
        window = [u.index for u in rt.units if tm.optimizer.pending_parts(u.index)][:3]
        assert len(window) == 3
        for j in window:  # as at the start of a forward: nothing of these is in host memory yet
            for p in (rt.units[j].partition, tm.optimizer.by_unit[j].state):
                sw.evict(p).wait()
        asked: list[str] = []
        full = {tm.optimizer.by_unit[window[1]].state.name}  # the second unit's state finds no room

        def prefetch(part, tier, park=False, compact=False):  # type: ignore[no-untyped-def]
            asked.append(part.name)
            return None if part.name in full else real(part, tier, park=park, compact=compact)

        real = sw.prefetch
        monkeypatch.setattr(sw, "prefetch", prefetch)
        rt._prefetch(window)
        first, second, third = (rt.units[j].partition.name for j in window)
        states = [tm.optimizer.by_unit[j].state.name for j in window]
        assert asked.index(states[0]) < asked.index(first)
        assert states[1] in asked and third not in asked and states[2] not in asked
        tm.optimizer.flush()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_backward_before_a_step_reads_the_next_forwards_first_state_ahead(tmp_path, accumulate) -> None:
    """[Note: the state before step()]: once a step has come after `accumulate` backward passes, the last
    backward of the next step reads the state of the unit the next forward updates first ahead, before
    step() records that update; an earlier micro-batch's backward reads nothing of it, nor does the first
    step's, before any step was seen. The training stays what it was (losses equal to plain PyTorch's)."""
    model, ref = mlp(), mlp()
    data = batches(3 * accumulate)
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), **cfg(tmp_path)) as tm:
        sw, opt = tm.swapper, tm.optimizer
        first = tm.units[0]
        state = opt.by_unit[first.index].state
        read_ahead = []  # per backward: whether the first unit's state was on its way to host memory after it
        losses = []
        for k in range(0, len(data), accumulate):
            opt.zero_grad()
            for x, y in data[k:k + accumulate]:
                loss = loss_fn(model, x, y) / accumulate
                sw.evict(state).wait()  # its update is applied (or none yet): the state rests on NVMe
                assert not sw.is_on_the_way(state, Tier.HOST)
                tm.backward(loss)
                read_ahead.append(sw.is_on_the_way(state, Tier.HOST))
                losses.append(float(loss.detach()))
            opt.step()
        assert read_ahead == [False] * accumulate + ([False] * (accumulate - 1) + [True]) * 2
    assert losses == run_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, accumulate=accumulate)


def test_the_last_backward_reads_the_state_of_every_unit_its_window_reaches_in_the_next_pass(tmp_path) -> None:
    """[Note: the state before step()]: while the backward before a step runs, each unit's entry asks for the
    states of all the window's units that the next forward updates first, not only the first: a state read
    ahead at the entry before and evicted since (as room taken by something else would) is asked for again.
    Here, with prefetch.depth 2, the states of the first two units are evicted as the second unit's backward
    computes; the first unit's entry reads both again."""
    model = mlp()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                        **cfg(tmp_path, **{"prefetch.depth": 2})) as tm:
        sw, opt = tm.swapper, tm.optimizer
        states = [opt.by_unit[u.index].state for u in tm.units]
        seen = []  # per step: which states were on their way to host memory as the first unit's backward computed

        def evict(grad: torch.Tensor) -> None:
            for state in states[:2]:
                sw.wait_idle(state)
                sw.evict(state).wait()

        for x, y in batches(3):
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            hooks = [model[2].weight.register_hook(evict),
                     model[0].weight.register_hook(lambda g: seen.append(
                         [sw.is_on_the_way(state, Tier.HOST) for state in states[:2]]))]
            tm.backward(loss)
            for h in hooks:
                h.remove()
            opt.step()
        assert seen == [[False, False], [True, True], [True, True]]  # none before a step was seen


def test_update_waits_are_counted_where_the_updates_run(tmp_path) -> None:
    """`update_wait_seconds` counts the time updates waited for their partitions' reads: none before any update,
    some once a recorded update has read its state back from NVMe at its unit's entry (time that
    `stall_seconds` does not hold), and none again after reset_stats(). Without an optimizer it is 0."""
    model = mlp()
    data = batches(2)
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), **cfg(tmp_path)) as tm:
        sw, opt = tm.swapper, tm.optimizer
        tm.reset_stats()
        opt.zero_grad()
        tm.backward(loss_fn(model, *data[0]))
        assert tm.stats()["update_wait_seconds"] == 0.0  # nothing updated yet
        opt.step()  # recorded: applied at each unit's next entry
        for st in opt.units:
            if st.state is not None:
                sw.evict(st.state).wait()
        tm.reset_stats()
        opt.zero_grad()
        tm.backward(loss_fn(model, *data[1]))
        assert tm.stats()["update_wait_seconds"] > 0.0
        tm.reset_stats()
        assert tm.stats()["update_wait_seconds"] == 0.0
    with tiered_offload(mlp(), **cfg(tmp_path / "inference")) as tm:
        assert tm.stats()["update_wait_seconds"] == 0.0


def _updated(st: Any, kind: str) -> Any:
    """A unit's partition that its update changes: its optimizer state ("state") or its parameters ("params")."""
    return st.state if kind == "state" else st.unit.partition


def _record_state_writes(tm: Any, phase: list[str], kind: str = "state") -> list[tuple[str, str]]:
    """(phase[0] at the time, partition name) of every write of an optimizer-state partition (or with `kind`
    "params", of a unit's parameters) from here on."""
    sw = tm.swapper
    names = {_updated(st, kind).name for st in tm.optimizer.units if st.state is not None}
    writes: list[tuple[str, str]] = []
    start_write = sw.cache.start_write

    def recording(part: Any, **kw: Any) -> Any:
        if part.name in names:
            writes.append((phase[0], part.name))
        return start_write(part, **kw)

    sw.cache.start_write = recording
    return writes


@pytest.mark.parametrize("kind", ["state", "params"])
def test_an_updated_state_stays_in_host_memory_with_room_and_is_written_in_backward(tmp_path, kind) -> None:
    """[Note: updated state written in backward]: with room in the host pool, a state that the forward's lazy
    update changed stays in host memory, dirty. It is written when its unit's backward begins and not read back
    at the next update; once it has stayed from one update to the next it is not written again. Evicted meanwhile
    (as when room is needed), it is written then, read back at its update, and written ahead again in the backward
    after that. The unit's parameters, which the update changes too, go the same way. Losses with clipping equal
    plain PyTorch's throughout."""
    model, ref = mlp(), mlp()
    data = batches(6)
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), **cfg(tmp_path)) as tm:
        sw, opt = tm.swapper, tm.optimizer
        parts = [_updated(st, kind) for st in opt.units if st.state is not None]
        names = [p.name for p in parts]
        first = parts[0]
        assert len(names) > 1
        phase = ["-"]
        writes = _record_state_writes(tm, phase, kind)
        losses, by_step, reads = [], [], []
        for k, (x, y) in enumerate(data):
            opt.zero_grad()
            if k == 3:
                phase[0] = "evicted"
                sw.wait_idle(first)  # a write-back still in flight would leave it where it is
                sw.evict(first).wait()  # as a fetch that needs the room would: written now, read at its update
            loads = {p.name: p.host_loads for p in parts}
            phase[0] = "forward"
            loss = loss_fn(model, x, y)
            reads.append(sorted(p.name for p in parts if p.host_loads != loads[p.name]))
            phase[0] = "backward"
            tm.backward(loss)
            phase[0] = "-"
            tm.clip_grad_norm_(0.5)
            opt.step()
            losses.append(float(loss.detach()))
            by_step.append(sorted(writes))
            writes.clear()
        assert by_step[0] == []  # nothing updated yet
        assert by_step[1] == sorted(("backward", n) for n in names)  # kept in the forward, written in backward
        assert by_step[2] == []  # stayed from one update to the next: not written again
        assert by_step[3] == [("backward", first.name), ("evicted", first.name)]  # read back, so written ahead
        assert by_step[4] == by_step[5] == []
        # the first forward reads the parameters in from NVMe and makes the first states; after it nothing is read
        # back unless evicted
        assert reads[0] == ([] if kind == "state" else sorted(names)) and reads[3] == [first.name]
        assert all(r == [] for r in reads[1:3] + reads[4:])
    assert losses == run_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, clip=0.5,
                               clip_fn=lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c))


def test_an_updated_state_without_room_is_written_in_the_forward(tmp_path) -> None:
    """[Note: updated state written in backward]: where the host pool has no room to keep an updated state (a
    budget a few units wide), the forward's update writes it at once and frees the room for the reads after it;
    losses and weights with clipping stay bit-identical to plain PyTorch's."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 500, (2, 12), generator=g) for _ in range(3)]
    results, phase = [], ["-"]
    for offloaded in (False, True):
        model = models.gpt2()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        with (tiered_offload(model, optimizer=opt, **cfg(tmp_path, **{"memory.host_budget": "2MiB"}))
              if offloaded else nullcontext()) as tm:
            step_opt = tm.optimizer if tm is not None else opt
            writes = _record_state_writes(tm, phase) if tm is not None else []
            kept: list[list[str]] = []  # per step: the units whose updated state the forward kept in host memory
            for ids in data:
                step_opt.zero_grad()
                phase[0] = "forward"
                loss = model(ids, labels=ids).loss
                if tm is not None:
                    kept.append([st.unit.name for st in tm.optimizer.units if st.kept_in is not None])
                phase[0] = "backward"
                loss.backward()
                phase[0] = "-"
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # tiermem's own inside the context
                step_opt.step()
                losses.append(float(loss.detach()))
            if tm is not None:
                assert any(p == "forward" for p, _ in writes), writes
                # no room for a block's state (small ones, the position embedding's, ln_f's, may stay): each
                # block's update wrote its state at once
                assert kept[1:] and all(not any(".h." in name for name in k) for k in kept), kept
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert torch.equal(results[1][1][name], value), name


class _SometimesGated(nn.Module):
    """Tensors of sizes that leave gaps between them in a partition, and one parameter (`gate`) that gets a
    gradient only on the steps that use it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 7)
        self.gate = nn.Parameter(torch.randn(7))
        self.scale = nn.Parameter(torch.rand(4) + 0.5)  # in the gate's unit, with a gradient every step
        self.b = nn.Linear(7, 4)
        self.use_gate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h * self.gate if self.use_gate else h) * self.scale


@pytest.mark.parametrize("grads_tier", ["cpu", "nvme"])
def test_accumulators_come_back_unzeroed_and_are_zero_outside_the_gradients_they_got(tmp_path, monkeypatch,
                                                                                   grads_tier: str) -> None:
    """[Note: accumulators handed out unzeroed]: with every host buffer the pool hands out filled with
    0xFF (NaN as float32), the accumulators discarded by lazy updates come back unzeroed in the next
    backward; once it has let them go they hold the gradients the parameters got and zeros everywhere else
    (gaps, padding, a parameter that got none this step), and 12 steps with clipping and 2-step accumulation
    equal PyTorch bit for bit."""
    from tiermem.io.buffers import HostBufferPool
    from tiermem.swap.host_cache import HostCache

    def poisoning(orig: Callable[..., Any]) -> Callable[..., Any]:
        def poisoned(self: HostBufferPool, *args: Any, **kw: Any) -> Any:
            buf = orig(self, *args, **kw)
            if buf is not None:
                buf.tensor().fill_(0xFF)
            return buf
        return poisoned

    for name in ("alloc", "alloc_at"):
        monkeypatch.setattr(HostBufferPool, name, poisoning(getattr(HostBufferPool, name)))
    unzeroed: list[str] = []  # accumulators a fetch handed out as the pool had them
    orig_fill = HostCache.fill

    def fill(self: HostCache, part: Any, buf: Any) -> None:
        discarded = part.discarded
        orig_fill(self, part, buf)
        if discarded and part.name.endswith("#grads") and bool((buf.tensor() == 0xFF).all()):
            unzeroed.append(part.name)
    monkeypatch.setattr(HostCache, "fill", fill)

    data = batches(24)
    ref, model = _SometimesGated(), _SometimesGated()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for k in range(0, 24, 2):
        ref.use_gate = k % 4 == 0
        ref_opt.zero_grad()
        for x, y in data[k:k + 2]:
            loss = loss_fn(ref, x, y) / 2
            loss.backward()
            ref_losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    losses = []
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                        **cfg(tmp_path, **{"grads.tier": grads_tier})) as tm:
        opt, sw = tm.optimizer, tm.swapper
        # the case the test is about: a parameter without a gradient beside one with it, in one accumulator
        assert any({"gate", "scale"} <= {f for f, _, _ in st.trainable} for st in opt.units)
        for k in range(0, 24, 2):
            model.use_gate = k % 4 == 0
            opt.zero_grad()
            for x, y in data[k:k + 2]:
                loss = loss_fn(model, x, y) / 2
                tm.backward(loss)
                losses.append(float(loss.detach()))
                for st in opt.units:
                    expected = {f for f, p, _ in st.trainable if model.use_gate or p is not model.gate}
                    assert st.has_grad == expected, (st.unit.name, st.has_grad)
                    sw.acquire(st.grads, Tier.HOST)
                    flat = st.grads.flat(Tier.HOST)
                    try:
                        outside = torch.ones(flat.numel(), dtype=torch.bool)
                        for slot in st.grads.layout.slots:
                            if slot.name in st.has_grad:
                                outside[slot.offset : slot.offset + slot.nbytes] = False
                        assert bool((flat[outside] == 0).all()), st.unit.name
                        assert bool(outside.any())  # there are gaps to check
                    finally:
                        sw.release(st.grads)
            tm.clip_grad_norm_(0.05)
            opt.step()
    assert unzeroed, "no accumulator came back unzeroed"
    assert losses == ref_losses
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


class _TwoExperts(nn.Module):
    """Two weights in one unit, one used per call (as a mixture of experts routes a batch): each micro-batch
    of a step gives one of them a gradient and the other none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w0 = nn.Parameter(torch.randn(4, 16) * 0.3)
        self.w1 = nn.Parameter(torch.randn(4, 16) * 0.3)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return x @ (self.w0 if expert == 0 else self.w1).t()


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.experts = _TwoExperts()
        self.expert = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(torch.tanh(self.inp(x)), self.expert)


@pytest.mark.parametrize("grads_tier", ["cpu", "nvme"])
def test_a_gradient_from_an_earlier_micro_batch_survives_one_that_gives_its_unit_only_others(tmp_path,
                                                                                            grads_tier: str) -> None:
    """With 2-step accumulation the first micro-batch gives `experts.w0` a gradient and the second only
    `experts.w1`, in the same unit: the second's gradients are added to the unit's accumulators, not
    copied over them (which on a device with memory of its own zeroed w0's). 12 steps equal PyTorch's bit
    for bit, weights and losses."""
    data = batches(24)
    ref, model = _Routed(), _Routed()

    def run(m: _Routed, opt: Any, backward: Callable[[torch.Tensor], None]) -> list[float]:
        losses = []
        for k in range(0, 24, 2):
            opt.zero_grad()
            for j, (x, y) in enumerate(data[k:k + 2]):
                m.expert = j
                loss = loss_fn(m, x, y) / 2
                backward(loss)
                losses.append(float(loss.detach()))
            opt.step()
        return losses

    ref_losses = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.Tensor.backward)
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                        **cfg(tmp_path, **{"grads.tier": grads_tier})) as tm:
        assert any({"experts.w0", "experts.w1"} <= {f for f, _, _ in st.trainable} for st in tm.optimizer.units)
        losses = run(model, tm.optimizer, tm.backward)
    assert losses == ref_losses
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
