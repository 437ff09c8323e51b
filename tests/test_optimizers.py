"""Every elementwise torch.optim optimizer, and the per-parameter ones users bring (transformers' Adafactor,
bitsandbytes' 8-bit optimizers, Lion, Muon), trains under tiered_offload exactly as in memory; those whose update
couples parameters across units are refused naming why (see [Note: which optimizers] in
tiermem/optim/optimizer.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from tests.test_training import batches, cfg, compare, manual_mixed_precision, mlp, run_steps, two_groups
from tiermem import OffloadError, tiered_offload
from tiermem.errors import OptimizerError
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
    assert not any(c.__name__ in PER_PARAMETER for c in SUPPORTED_OPTIMIZERS)  # those take the per-parameter path


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


def _lib(name: str) -> Any:
    return pytest.importorskip(name)


def _no_bias() -> nn.Module:
    """The mlp's shapes without biases: Muon takes matrices only."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False), nn.Tanh(),
                         nn.Linear(64, 4, bias=False))


class _MyAdam(torch.optim.Adam):
    """A subclass of torch's: not known to be elementwise, so stepped per parameter."""


# the mlp's 64x64 weights have 4096 elements, so bitsandbytes keeps 8-bit state for them (uint8 states, a qmap,
# absmax blocks) and 32-bit state for its smaller tensors; two param groups where the optimizer takes them
PER_PARAMETER: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.optim.Optimizer]]] = {
    "Adafactor": (mlp, lambda m: _lib("transformers.optimization").Adafactor(m.parameters())),  # relative step
    "Adafactor-lr": (mlp, lambda m: _lib("transformers.optimization").Adafactor(
        two_groups(m, lr=2e-3), lr=1e-3, scale_parameter=False, relative_step=False, beta1=0.9)),
    "AdamW8bit": (mlp, lambda m: _lib("bitsandbytes").optim.AdamW8bit(two_groups(m, lr=2e-3), lr=1e-3)),
    "PagedAdamW8bit": (mlp, lambda m: _lib("bitsandbytes").optim.PagedAdamW8bit(m.parameters(), lr=1e-3)),
    "Lion8bit": (mlp, lambda m: _lib("bitsandbytes").optim.Lion8bit(m.parameters(), lr=1e-4, weight_decay=0.01)),
    "Lion": (mlp, lambda m: _lib("lion_pytorch").Lion(two_groups(m, lr=2e-4), lr=1e-4)),
    "torch-Adafactor": (mlp, lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2)),
    "Muon": (_no_bias, lambda m: torch.optim.Muon(m.parameters(), lr=1e-2)),
    "Adam-subclass": (mlp, lambda m: _MyAdam(m.parameters(), lr=1e-3, weight_decay=0.01)),
}
TIERS = {"nvme": {}, "host": {"params.tier": "cpu", "optimizer.tier": "cpu"}}


def _same(a: Any, b: Any, where: str = "state_dict") -> None:
    """Equal to the bit, in type and structure too (a step count an int where the optimizer keeps an int)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{k}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")  # bitsandbytes steps unpaged there
@pytest.mark.parametrize("tiers", sorted(TIERS))
@pytest.mark.parametrize("name", sorted(PER_PARAMETER))
def test_a_per_parameter_optimizer_equals_itself_in_memory(tmp_path, name: str, tiers: str) -> None:
    """2 steps of 2 micro-batches, clipped, each parameter stepped with its own shape by the optimizer's own code
    on views of the tiers: losses, clip norms, weights and its state_dict (its own format, every key, a step
    count's type included) bit-exact with the same loop in memory; state on NVMe or in host memory."""
    build, make = PER_PARAMETER[name]
    data = batches(4)
    ref = build()
    ref_opt = make(ref)
    ref_norms: list[float] = []
    ref_losses = run_steps(ref, ref_opt, data, accumulate=2, clip=0.5, norms=ref_norms,
                           clip_fn=lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c))
    model = build()
    norms: list[float] = []
    with tiered_offload(model, optimizer=make(model), **cfg(tmp_path, **TIERS[tiers])) as tm:
        assert not tm.optimizer.elementwise
        losses = run_steps(model, tm.optimizer, data, accumulate=2, clip=0.5, clip_fn=tm.clip_grad_norm_, norms=norms)
        saved = tm.optimizer.state_dict()
    assert losses == ref_losses and norms == ref_norms
    for (n, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), n
    _same(saved, ref_opt.state_dict())


def test_bitsandbytes_keeps_8bit_state_in_the_tiers(tmp_path) -> None:
    """AdamW8bit's state of a 64x64 weight lies in the state partition as it keeps it: two uint8 tensors of the
    weight's shape, their 256-entry qmaps and absmax blocks; a bias's is 32-bit."""
    model = mlp()
    with tiered_offload(model, optimizer=PER_PARAMETER["AdamW8bit"][1](model), **cfg(tmp_path)) as tm:
        slots = {s.name: (s.shape, s.dtype) for st in tm.optimizer.units if st.state is not None
                 for s in st.state.layout.slots}
    assert slots["state1.2.weight"] == ((64, 64), torch.uint8)
    assert slots["state2.2.weight"] == ((64, 64), torch.uint8)
    assert slots["qmap1.2.weight"] == ((256,), torch.float32)
    assert slots["absmax1.2.weight"][1] == torch.float32
    assert slots["state1.2.bias"] == ((64,), torch.float32) and "qmap1.2.bias" not in slots


@pytest.mark.parametrize("update", ["lazy", "step"])
@pytest.mark.parametrize("name", ["Adafactor-lr", "AdamW8bit"])
def test_a_per_parameter_optimizer_steps_fp32_masters_of_bfloat16_params(tmp_path, name: str, update: str) -> None:
    """params.dtype bfloat16: the optimizer steps the fp32 master weights, as the textbook recipe does with the
    same optimizer in memory on fp32 copies of the parameters; losses and weights bit-exact."""
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(4)]
    make = PER_PARAMETER[name][1]
    ref_losses, master = manual_mixed_precision(lambda ps: make(nn.ParameterList(ps)), data)
    model = mlp()
    with tiered_offload(model, optimizer=make(model), **cfg(tmp_path, **{"params.dtype": "bfloat16",
                                                                         "optimizer.update": update})) as tm:
        losses = run_steps(model, tm.optimizer, data)
    assert losses == ref_losses
    for p, m in zip(model.parameters(), master, strict=True):  # exit gives back the masters, not their rounding
        assert torch.equal(p.detach(), m.detach())


@pytest.mark.parametrize("name", ["Adafactor", "AdamW8bit", "Lion"])
def test_a_per_parameter_optimizers_state_dict_and_checkpoint_resume(tmp_path, name: str) -> None:
    """Its state_dict saved under tiered_offload equals the one saved in memory and loads in memory; the one
    saved in memory loads under tiered_offload; a tiermem checkpoint resumes: each way, 3 steps then 3 more end
    bit-exact where 6 straight through end."""
    build, make = PER_PARAMETER[name]
    data = batches(6)
    ref = build()
    ref_opt = make(ref)
    run_steps(ref, ref_opt, data)
    half = build()
    half_opt = make(half)
    run_steps(half, half_opt, data[:3])
    in_memory = half_opt.state_dict()

    model = build()
    with tiered_offload(model, optimizer=make(model), **cfg(tmp_path / "a")) as tm:
        run_steps(model, tm.optimizer, data[:3])
        saved = tm.optimizer.state_dict()
        tm.save_checkpoint(tmp_path / "ckpt")
    _same(saved, in_memory)
    outside = build()
    outside.load_state_dict(model.state_dict())
    outside_opt = make(outside)
    outside_opt.load_state_dict(saved)
    run_steps(outside, outside_opt, data[3:])
    finals = {"memory": outside}
    for how in ("state_dict", "checkpoint"):
        resumed = build()
        resumed.load_state_dict(half.state_dict() if how == "state_dict" else model.state_dict())
        with tiered_offload(resumed, optimizer=make(resumed), **cfg(tmp_path / how)) as tm:
            if how == "state_dict":
                tm.optimizer.load_state_dict(in_memory)
            else:
                tm.load_checkpoint(tmp_path / "ckpt")
            run_steps(resumed, tm.optimizer, data[3:])
            _same(tm.optimizer.state_dict(), ref_opt.state_dict(), how)
        finals[how] = resumed
    for how, final in finals.items():
        for (n, a), b in zip(ref.named_parameters(), final.parameters(), strict=True):
            assert torch.equal(a, b), (how, n)


def test_a_plan_counts_a_per_parameter_optimizers_state(tmp_path) -> None:
    """`plan(..., optimizer=opt)` sizes a per-parameter optimizer's state as entry does: bitsandbytes' 8-bit
    AdamW about 2 bytes per element of its large tensors, Adafactor a row and a column per matrix."""
    from tiermem.planning import plan

    model = mlp()
    numel = sum(p.numel() for p in model.parameters())
    sizes = {}
    for name in ("AdamW8bit", "Adafactor"):
        opt = PER_PARAMETER[name][1](model)
        planned = plan(model, optimizer=opt, **cfg(tmp_path))
        sizes[name] = planned.kinds["optimizer_state"]["bytes"]
        with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
            assert planned.entry == tm.plan
    assert sizes["Adafactor"] < 4 * numel  # rows and columns (4 KiB-aligned per unit), not a copy of each matrix
    assert 2 * 2 * 64 * 64 < sizes["AdamW8bit"] < 8 * numel  # uint8 moments of the 64x64 weights, 32-bit the rest


@pytest.mark.parametrize(("make", "why"), [
    (lambda m: torch.optim.LBFGS(m.parameters()), "closure"),
    (lambda m: torch.optim.SparseAdam(m.parameters()), "sparse gradients"),
], ids=["LBFGS", "SparseAdam"])
def test_an_optimizer_coupling_parameters_across_units_is_refused_naming_why(tmp_path, make: Any, why: str) -> None:
    """Refused at entry with the reason and the optimizers that work; the model is untouched."""
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(OffloadError, match=f"is not supported under tiered_offload \\(.*{why}.*\\); use one of "
                                           "torch.optim's AdamW, Adam, SGD, RMSprop.*or another optimizer that "
                                           "updates each parameter"):
        with tiered_offload(model, optimizer=make(model), **cfg(tmp_path)):
            pass
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _Counting(torch.optim.SGD):
    """Counts its steps in the optimizer object, not per parameter: a shell per unit would lose the count."""

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        return super().step(closure)


class _Growing(torch.optim.SGD):
    """Keeps one more entry of history per step: its state cannot be sized before the first step."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                seen = self.state[p].get("seen")
                self.state[p]["seen"] = torch.zeros(1 if seen is None else seen.numel() + 1)
        return super().step(closure)


class _Noting(torch.optim.SGD):
    """Keeps a string per parameter, which no tier holds."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["note"] = "seen"
        return super().step(closure)


@pytest.mark.parametrize(("kind", "why"), [
    (_Counting, "counts in the optimizer object itself \\('calls'\\)"),
    (_Growing, "changes between steps"),
    (_Noting, "keeps 'note' per parameter as a str"),
], ids=["counting", "growing", "noting"])
def test_an_optimizer_whose_state_cannot_be_laid_out_is_refused_naming_why(tmp_path, kind: Any, why: str) -> None:
    """What the probe at entry finds is named: state kept in the optimizer object, state whose shape changes,
    state that is no tensor or number."""
    model = mlp()
    opt = kind(model.parameters(), lr=0.1)
    opt.calls = 0
    with pytest.raises(OptimizerError, match=f"{kind.__name__} is not supported under tiered_offload: .*{why}"):
        with tiered_offload(model, optimizer=opt, **cfg(tmp_path)):
            pass


def test_the_planners_names_and_the_clis_choices_are_the_supported_optimizers() -> None:
    """`tiermem plan --optimizer NAME` offers every elementwise class, by its name in lower case (a per-parameter
    optimizer is planned given as an object: test_a_plan_counts_a_per_parameter_optimizers_state)."""
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
