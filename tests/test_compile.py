"""torch.compile on a model under tiered_offload: the whole model or each block compiled, trained and run as the
same compiled model in memory is (see [Note: torch.compile] in tiermem/runtime/runtime.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests import models
from tiermem import tiered_offload

pytest.importorskip("transformers")


def cfg(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {"device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme", "nvme.paths": [str(tmp_path / "swap")],
            "memory.host_budget": "8MiB", "wrap.min_unit_bytes": 0, **kw}


def compiled(model: nn.Module, how: str, backend: str) -> nn.Module:
    torch._dynamo.reset()  # each run compiles afresh: no graph of another run's model is reused
    if how == "model":
        return torch.compile(model, backend=backend)
    for block in model.transformer.h:  # regional compilation, as torch's docs recommend for transformers
        block.compile(backend=backend)
    return model


def train(model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return _steps(model, opt, steps)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int = 0) -> list[float]:
    losses = []
    for k in range(steps):
        x = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(k + 100 * rank))
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("activations", ["memory", "nvme"])
def test_a_compiled_model_trains_as_compiled_in_memory(tmp_path, compute_device, how: str, activations: str) -> None:
    """torch.compile (aot_eager: dynamo and AOTAutograd, the parts that meet the hooks) of the whole model or of
    each block, three steps with clipping: losses and weights equal the same compiled model's in memory, with
    parameters, optimizer state and (nvme) saved activations in their tiers. Before, dynamo traced into the
    hooks' I/O and failed."""
    results = []
    for offloaded in (False, True):
        model = models.gpt2().eval()
        model.config.use_cache = False
        run = compiled(model, how, "aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if offloaded:
            act = {"activations.tier": "nvme", "activations.min_bytes": "1KiB", "activations.buffer": "512KiB",
                   "activations.keep": 0} if activations == "nvme" else {"activations.tier": "memory"}
            with tiered_offload(model, optimizer=opt, **cfg(tmp_path, **act)) as tm:
                losses = _steps(run, opt, 3)
                stats = tm.stats()
            assert stats["bytes_read"] > 0
            if activations == "nvme":
                assert stats["activations_bytes_written"] > 0, stats
        else:
            losses = _steps(run, opt, 3)
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (want, want_w), (got, got_w) = results
    assert got == want
    assert [n for n in want_w if not torch.equal(want_w[n], got_w[n])] == []


def test_inductor_compiled_model_runs_and_trains_under_the_context(tmp_path) -> None:
    """The default backend (inductor, which generates C++ here): logits of a compiled forward and a training step
    equal the same compiled model's in memory."""
    results = []
    x = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    start_w = {n: p.detach().clone() for n, p in models.gpt2().named_parameters()}
    for offloaded in (False, True):
        model = models.gpt2().eval()
        model.config.use_cache = False
        run = compiled(model, "model", "inductor")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if offloaded:
            with tiered_offload(model, optimizer=opt, **cfg(tmp_path)):
                with torch.no_grad():
                    logits = run(x).logits
                losses = _steps(run, opt, 2)
        else:
            with torch.no_grad():
                logits = run(x).logits
            losses = _steps(run, opt, 2)
        results.append((logits, losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (want_l, want, want_w), (got_l, got, got_w) = results
    # inductor fuses across what the hooks split into separate graphs: the same values to rounding, not bit for
    # bit; AdamW's first steps, which divide by the gradients' own size, carry a rounding of 1e-7 to about 3e-5
    torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)
    assert got == pytest.approx(want, rel=1e-5)
    for n in want_w:
        torch.testing.assert_close(got_w[n], want_w[n], rtol=1e-4, atol=1e-4)
    # and the steps moved the weights by far more than that
    assert max(float((want_w[n] - start_w[n]).abs().max()) for n in want_w) > 1e-3


def _compiled_ddp_on_a_rank(rank: int, world: int, folder: Path) -> None:
    """Rank `rank` of test_a_compiled_ddp_model_on_two_ranks_trains_as_compiled_ddp_in_memory."""
    from torch.nn.parallel import DistributedDataParallel

    from tests.test_trainers import no_dropout
    from tiermem.optim.ddp import TieredDDP

    def run(where: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = no_dropout(models.gpt2())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        offload = cfg(folder / f"{where}{rank}")
        if where == "memory":
            losses = _steps(torch.compile(DistributedDataParallel(model), backend="aot_eager"), opt, 3, rank)
        elif where == "made-before":  # a torchrun script's compiled DDP(model), then the context
            ddp = DistributedDataParallel(model)
            compiled_ddp = torch.compile(ddp, backend="aot_eager")
            with tiered_offload(model, optimizer=opt, **offload) as tm:
                losses = _steps(compiled_ddp, opt, 3, rank)
                assert type(ddp) is TieredDDP and tm.stats()["gathered_bytes"] > 0
        else:
            with tiered_offload(model, optimizer=opt, **offload) as tm:
                ddp = DistributedDataParallel(model)
                losses = _steps(torch.compile(ddp, backend="aot_eager"), opt, 3, rank)
                assert type(ddp) is TieredDDP and tm.stats()["gathered_bytes"] > 0
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # compiled, not run eagerly
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

    want, want_w = run("memory")
    for where in ("made-before", "made-inside"):
        got, got_w = run(where)
        # the first loss comes before any update: the same bits; the tiers reduce-scatter where DDP all-reduces,
        # the same sums rounded apart (the weights below), so later losses agree to float32's rounding of those
        assert got[0] == want[0], (where, got, want)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"{where}: {got} against {want}")
        for n in want_w:  # the tiers reduce-scatter where DDP all-reduces: the same sums, rounded apart
            torch.testing.assert_close(got_w[n], want_w[n], rtol=0, atol=1e-6, msg=f"{where}: {n}")


def test_a_compiled_ddp_model_on_two_ranks_trains_as_compiled_ddp_in_memory(tmp_path) -> None:
    """torch.compile (aot_eager) of DistributedDataParallel(model) on 2 gloo ranks, the DDP made before the
    context (a torchrun script's) or inside it, three clipped AdamW steps on each rank's own batches: the losses
    equal those of the same compiled DDP in memory (the first bit for bit, the later ones to 1e-6 relative: the
    weights they follow agree to 1e-6), with the model sharded over the ranks' tiers."""
    from tests.ranks import run_ranks

    run_ranks(_compiled_ddp_on_a_rank, 2, tmp_path, timeout_s=300)
