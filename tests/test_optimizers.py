"""Every elementwise torch.optim optimizer trains under tiered_offload exactly as in memory; the others are
refused naming why (see [Note: which optimizers] in tiermem/optim/optimizer.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from tests.test_training import batches, cfg, compare, mlp, run_steps, two_groups
from tiermem import OffloadError, tiered_offload
from tiermem.optim import SUPPORTED_OPTIMIZERS

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device

# each with settings that make it keep all the state it can (momentum, centering, decay), and a second param
# group of other settings
ELEMENTWISE: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "RMSprop": lambda m: torch.optim.RMSprop(two_groups(m, lr=3e-3, centered=False), lr=1e-3, momentum=0.9,
                                             centered=True, weight_decay=0.01),
    "Adagrad": lambda m: torch.optim.Adagrad(two_groups(m, lr=2e-2), lr=1e-2, lr_decay=0.01,
                                             initial_accumulator_value=0.1),
    "Adadelta": lambda m: torch.optim.Adadelta(two_groups(m, rho=0.8), lr=1.0, weight_decay=0.01),
    "Adamax": lambda m: torch.optim.Adamax(two_groups(m, lr=4e-3), lr=2e-3, weight_decay=0.01),
    "NAdam": lambda m: torch.optim.NAdam(two_groups(m, momentum_decay=3e-3), lr=2e-3, decoupled_weight_decay=True),
    "RAdam": lambda m: torch.optim.RAdam(two_groups(m, lr=3e-3), lr=1e-3, decoupled_weight_decay=True),
    "Rprop": lambda m: torch.optim.Rprop(two_groups(m, etas=(0.4, 1.1)), lr=1e-3),
    "ASGD": lambda m: torch.optim.ASGD(two_groups(m, lr=2e-2), lr=1e-2, t0=3, weight_decay=0.01),
}


def test_every_supported_optimizer_is_tested_here_or_in_test_training() -> None:
    """A class added to SUPPORTED_OPTIMIZERS gets a case here (Adam, AdamW and SGD have test_training's)."""
    names = {c.__name__ for c in SUPPORTED_OPTIMIZERS}
    assert names - {"Adam", "AdamW", "SGD"} == set(ELEMENTWISE)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_optimizer_with_clipping_accumulation_and_a_scheduler_equals_pytorch(tmp_path, name: str) -> None:
    """20 steps of 2 micro-batches, clipped at 0.05 (most steps clip) and a StepLR: losses, clip norms,
    weights and the optimizer's state (step counts and scalars such as NAdam's mu_product included) bit-exact
    with the same loop in memory; state on NVMe under a budget that holds a few units."""
    norms = compare(tmp_path, ELEMENTWISE[name], steps=20, accumulate=2, clip=0.05,
                    sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5))
    assert sum(n > 0.05 for n in norms) >= 10  # clipping acted


@pytest.mark.parametrize("name", ["RMSprop", "NAdam"])
def test_optimizer_state_in_host_memory_and_one_big_range_in_pieces(tmp_path, name: str, monkeypatch) -> None:
    """State in host memory, and the update in pieces of 100 elements, so a range spans several calls of the
    optimizer: still bit-exact."""
    import tiermem.optim.optimizer as optimizer

    monkeypatch.setattr(optimizer, "_CHUNK", 100)
    compare(tmp_path, ELEMENTWISE[name], steps=8, clip=0.05, **{"params.tier": "cpu", "optimizer.tier": "cpu"})


@pytest.mark.parametrize("name", ["NAdam", "ASGD", "Adagrad"])
def test_state_dict_and_checkpoint_carry_the_scalars(tmp_path, name: str) -> None:
    """tm.optimizer.state_dict() is torch's format, scalars included; loading it, or a tiermem checkpoint,
    into a fresh context and training on ends where training straight through ends."""
    data = batches(10)
    ref = mlp()
    ref_opt = ELEMENTWISE[name](ref)
    run_steps(ref, ref_opt, data)
    ref_state = ref_opt.state_dict()["state"]

    def resumed(how: str) -> nn.Module:
        model = mlp()
        with tiered_offload(model, optimizer=ELEMENTWISE[name](model), **cfg(tmp_path / how)) as tm:
            run_steps(model, tm.optimizer, data[:5])
            saved = tm.optimizer.state_dict()
            tm.save_checkpoint(tmp_path / how / "ckpt")
        for k, entry in ref_opt_at_5["state"].items():
            assert saved["state"][k].keys() == entry.keys()
            for key, value in entry.items():
                assert torch.equal(saved["state"][k][key], value), (k, key)
        with tiered_offload(model, optimizer=ELEMENTWISE[name](model), **cfg(tmp_path / how)) as tm:
            if how == "state_dict":
                tm.optimizer.load_state_dict(saved)
            else:
                tm.load_checkpoint(tmp_path / how / "ckpt")
            run_steps(model, tm.optimizer, data[5:])
            final = tm.optimizer.state_dict()["state"]
        for k, entry in ref_state.items():
            for key, value in entry.items():
                assert torch.equal(final[k][key], value), (k, key)
        return model

    half = mlp()
    half_opt = ELEMENTWISE[name](half)
    run_steps(half, half_opt, data[:5])
    ref_opt_at_5 = half_opt.state_dict()
    for how in ("state_dict", "checkpoint"):
        model = resumed(how)
        for (n, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), (how, n)


@pytest.mark.parametrize(("make", "why"), [
    (lambda m: torch.optim.Adafactor(m.parameters()), "row and a column"),
    (lambda m: torch.optim.LBFGS(m.parameters()), "closure"),
    (lambda m: torch.optim.SparseAdam(m.parameters()), "sparse gradients"),
], ids=["Adafactor", "LBFGS", "SparseAdam"])
def test_an_optimizer_that_is_not_elementwise_is_refused_naming_why(tmp_path, make: Any, why: str) -> None:
    """Refused at entry with the reason and the optimizers that work; the model is untouched."""
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(OffloadError, match=f"is not supported under tiered_offload \\(.*{why}.*\\); use one of "
                                           "torch.optim's AdamW, Adam, SGD, RMSprop"):
        with tiered_offload(model, optimizer=make(model), **cfg(tmp_path)):
            pass
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_an_optimizer_from_elsewhere_is_refused(tmp_path) -> None:
    """A subclass (or another library's optimizer) is refused: its update may not be torch's elementwise one."""
    class MyAdam(torch.optim.Adam):
        pass

    model = mlp()
    with pytest.raises(OffloadError, match="MyAdam is not supported under tiered_offload; use one of"):
        with tiered_offload(model, optimizer=MyAdam(model.parameters()), **cfg(tmp_path)):
            pass


def test_the_planners_names_and_the_clis_choices_are_the_supported_optimizers() -> None:
    """`tiermem plan --optimizer NAME` offers every supported class, by its name in lower case."""
    from tiermem.cli.plan import OPTIMIZER_CHOICES
    from tiermem.planning import OPTIMIZER_NAMES

    assert OPTIMIZER_NAMES == {c.__name__.lower(): c for c in SUPPORTED_OPTIMIZERS}
    assert list(OPTIMIZER_CHOICES) == list(OPTIMIZER_NAMES)


@pytest.mark.parametrize(("name", "kinds"), [("rmsprop", 1), ("adamax", 2), ("rprop", 2), ("sgd", 1), ("adagrad", 1)])
def test_a_plan_counts_each_optimizers_own_state(tmp_path, name: str, kinds: int) -> None:
    """`plan(..., optimizer=NAME)` holds as many fp32 tensors per parameter as that optimizer keeps, and a plan
    made with the optimizer itself (RMSprop centered, with momentum: three) equals what entry plans."""
    from tests import models
    from tiermem.planning import plan

    model = models.llama()
    numel = sum(p.numel() for p in model.parameters())
    got = plan(model, optimizer=name, **cfg(tmp_path)).kinds["optimizer_state"]["bytes"]
    assert 4 * kinds * numel <= got < 4 * kinds * numel * 1.05
    opt = torch.optim.RMSprop(model.parameters(), momentum=0.9, centered=True)
    planned = plan(model, optimizer=opt, **cfg(tmp_path))
    assert 12 * numel <= planned.kinds["optimizer_state"]["bytes"] < 12 * numel * 1.05
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        assert planned.entry == tm.plan


def test_a_global_step_hook_sees_one_step_per_step(tmp_path) -> None:
    """The update's calls of the optimizer class on pieces of ranges are not steps of the user's: a global
    step hook (a profiler's, say) runs once per `step()`, though pieces of 100 elements make each range take
    several calls."""
    import tiermem.optim.optimizer as optimizer

    seen: list[str] = []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: seen.append(type(opt).__name__))
    try:
        model = mlp()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(optimizer, "_CHUNK", 100)
            with tiered_offload(model, optimizer=torch.optim.RMSprop(model.parameters()), **cfg(tmp_path)) as tm:
                run_steps(model, tm.optimizer, batches(3))  # the last update is applied at exit
    finally:
        handle.remove()
    assert seen == ["TieredOptimizer"] * 3, seen
