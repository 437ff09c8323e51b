"""Several ranks (gloo on the CPU, two processes per test): sharding, gathering and reduce-scattering units."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.ranks import run_ranks
from tests.test_disk_faults import ext4_mount as ext4_mount  # a fixture  # noqa: PLC0414
from tests.test_disk_faults import free_bytes
from tiermem.distributed import (
    Ranks,
    _rows_to_whole,
    _whole_to_rows,
    chunk_specs,
    finish_scatter_sum,
    gather_unit,
    start_scatter_sum,
)
from tiermem.swap import Layout
from tiermem.swap.transfers import make_mover

pytestmark = pytest.mark.timeout(180)


def _specs() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.empty(5, 3, device="meta")), ("b", torch.empty(7, dtype=torch.float32, device="meta")),
            ("c", torch.empty(2, 2, dtype=torch.float32, device="meta"))]


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(t.shape, generator=g) for name, t in _specs()}


def _gather_and_scatter(rank: int, world: int, folder: Path) -> None:
    ranks = Ranks.of().on_device(make_mover(torch.device("cpu")))  # on the strict group, the copying device's
    assert (ranks.rank, ranks.world) == (rank, world)
    full = Layout.of(_specs())
    chunks = Layout.of(chunk_specs(ranks, _specs()))
    values = _values()
    mine = torch.zeros(chunks.size, dtype=torch.uint8)
    views = chunks.views(mine)
    for name, t in values.items():
        start, end = ranks.my_range(t.numel())
        views[name][: end - start].copy_(t.reshape(-1)[start:end])
    out = torch.zeros(full.size, dtype=torch.uint8)
    gather_unit(ranks, mine, chunks, full, out)
    for name, t in full.views(out).items():
        assert torch.equal(t, values[name]), name
    # each rank contributes (rank + 1) * value: the mean over ranks is value * (world + 1) / 2
    grads = torch.zeros(chunks.size, dtype=torch.uint8)
    reducing = start_scatter_sum(ranks, {n: v * (rank + 1) for n, v in values.items()}, chunks, grads)
    finish_scatter_sum(ranks, reducing, chunks, grads)
    got = chunks.views(grads)
    for name, t in values.items():
        start, end = ranks.my_range(t.numel())
        want = t.reshape(-1)[start:end] * (world + 1) / 2
        torch.testing.assert_close(got[name][: end - start], want)
        assert not got[name][end - start :].any()  # the padding stays zero


def test_a_unit_gathered_from_two_ranks_chunks_is_whole_and_gradients_reduce_to_each_ranks_chunk(
        tmp_path, rank_backend: str) -> None:
    """Each rank holds chunk r of every tensor; all-gathering gives every tensor whole on each rank, and
    reduce-scattering whole gradients leaves each rank the mean of its chunks, padding zero (host tensors on a
    device-only group go through device memory)."""
    run_ranks(_gather_and_scatter, 2, tmp_path, backend=rank_backend)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_tensor_split_into_rank_rows_and_joined_again_is_itself_with_the_padding_zero(world: int) -> None:
    """The strided copies between a tensor whole and its ranks' rows (the last ones padded, or empty), for the
    numbers of ranks no test spawns; joined again also with one rank's row given apart."""
    for numel in (0, 1, world - 1, world, world + 1, 7 * world - 1, 101):
        t = torch.randn(max(numel, 0))
        n = -(-t.numel() // world)
        rows = torch.full((world, n), float("nan"))
        _whole_to_rows(t, rows)
        want = torch.zeros(world * n)
        want[: t.numel()] = t
        assert torch.equal(rows.reshape(-1), want), (world, numel)
        back = torch.full_like(t, float("nan"))
        _rows_to_whole(rows, back)
        assert torch.equal(back, t), (world, numel)
        for r in range(world):  # rank r's row not among the rows (gloo's gather sends its chunk from its partition)
            others = torch.cat([rows[:r], rows[r + 1 :]])
            back = torch.full_like(t, float("nan"))
            _rows_to_whole(others, back, (r, rows[r].clone()))
            assert torch.equal(back, t), (world, numel, r)


def _offload_cfg(folder: Path, rank: int, **extra: object) -> dict[str, object]:
    out: dict[str, object] = {"device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme",
                              "nvme.paths": [str(folder / f"swap{rank}")], "memory.host_budget": "2MiB",
                              "wrap.min_unit_bytes": "64KiB", "io.block_size": "256KiB"}
    out.update(extra)
    return out


def _gpt2() -> torch.nn.Module:
    from tests import models

    model = models.gpt2(layers=3, width=128, vocab=500)
    model.config.use_cache = False
    for m in model.modules():  # dropout off: its masks would differ between one batch and two halves
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _forward(rank: int, world: int, folder: Path) -> None:
    from tiermem import tiered_offload

    model = _gpt2()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    detour = _detour(model)
    with torch.no_grad():
        ref_detour = model(ids).logits
    detour.remove()
    per_rank = {"memory.host_budget": "64MiB", "nvme.paths": [str(folder / "drive{rank}")]}  # one config
    with tiered_offload(model, **_offload_cfg(folder, rank, **per_rank)) as tm:
        for k in range(3):
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref)
            st = tm.stats()
            if k == 0 and world > 1:  # the first pass records the order: nothing to gather ahead yet
                assert st["gathers_ahead"] == 0 and st["gathered_bytes"] > 0, st
        # once the order is known, each acquisition but a pass's first is gathered ahead, unless it is the unit
        # acquired just before it (wte then wpe, one unit)
        order = tm.runtime.schedule.order
        per_pass = sum(a != b for a, b in zip(order, order[1:], strict=False))
        assert st["gathers_ahead"] == (2 * per_pass if world > 1 else 0), (order, st)
        if world > 1:  # a unit entered twice in a row (wte, then wpe) is gathered once ([Note: a unit entered again])
            tm.reset_stats()
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref)
            runs = [u for k, u in enumerate(order) if k == 0 or u != order[k - 1]]
            assert len(runs) < len(order), order
            sizes = {u.index: (world - 1) * u.partition.size for u in tm.runtime.units}
            assert tm.stats()["gathered_bytes"] == sum(sizes[u] for u in runs), (order, tm.stats())
        peak = st["peak_bytes"]
        if world > 1:  # a pass that leaves the recorded order (on every rank alike) computes the same
            detour = _detour(model)
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref_detour)
            detour.remove()
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref)
        with tm.gathered(model.transformer.h[0]), torch.no_grad():  # whole on every rank; edits kept
            assert torch.equal(model.transformer.h[0].ln_1.weight, _gpt2().transformer.h[0].ln_1.weight)
            model.transformer.h[0].ln_1.weight.add_(1.0)
    edited = _gpt2().transformer.h[0].ln_1.weight.detach() + 1.0
    assert torch.equal(model.transformer.h[0].ln_1.weight, edited)
    model.transformer.h[0].ln_1.weight.data.sub_(1.0)
    assert (folder / f"drive{rank}").is_dir()  # {rank} filled in: each rank's swap on its own path
    torch.save({"nvme": peak["nvme"], "host": peak["host"]}, folder / f"stats{rank}.pt")
    for p, q in zip(model.parameters(), _gpt2().parameters(), strict=True):
        assert torch.equal(p, q)  # restored whole on every rank


def _detour(model: torch.nn.Module) -> object:
    """Make block 0 run block 2 as well and add a tenth of its output: an order the schedule did not record."""
    def also_block_2(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        return out + 0.1 * model.transformer.h[2](out)

    return model.transformer.h[0].register_forward_hook(also_block_2)


def test_two_ranks_each_hold_half_and_compute_what_one_process_computes(tmp_path, rank_backend: str) -> None:
    """Inference under two ranks: each rank keeps its half of every unit on its NVMe tier, gathers units to
    compute (once the order is known, each while the unit before computes, and a unit entered twice in a row
    once), and gets the logits of the
    model in memory, also in a pass that leaves the recorded order; each rank's NVMe and host-tier bytes
    are half of a single process's (within 5%); an edit in tm.gathered() is kept; leaving gives every rank
    the whole model back."""
    run_ranks(_forward, 2, tmp_path / "two", backend=rank_backend)
    _forward(0, 1, tmp_path / "one")  # no process group here: one rank, the whole units
    one = torch.load(tmp_path / "one" / "stats0.pt")
    for rank in range(2):
        got = torch.load(tmp_path / "two" / f"stats{rank}.pt")
        for key in ("nvme", "host"):
            assert abs(got[key] - one[key] / 2) <= 0.05 * one[key] / 2, (rank, key, got[key], one[key])


def _stream(rank: int, world: int, folder: Path) -> None:
    from tiermem import tiered_offload

    weights = folder.parent / "weights.safetensors"
    with torch.device("meta"):
        model = _gpt2()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    with tiered_offload(model, checkpoint=weights, **_offload_cfg(folder, rank)) as tm, torch.no_grad():
        logits = model(ids).logits
        read = tm.stats()["checkpoint_bytes_read"]
    torch.save({"logits": logits, "read": read}, folder / f"streamed{rank}.pt")


def test_two_ranks_streaming_a_checkpoint_each_read_their_half_of_it(tmp_path, rank_backend: str) -> None:
    """A model built on the meta device, its weights streamed from a float16 safetensors file at entry: each
    of two ranks reads only its chunk of every tensor (half the bytes one process reads, to the padding of
    one element per tensor), converts it to float32, and both compute the logits one process does. Before,
    every rank read every tensor whole and kept its chunk."""
    from safetensors.torch import save_file

    model = _gpt2()
    save_file({k: v.half() for k, v in model.state_dict().items() if k != "lm_head.weight"},  # tied to wte
              str(tmp_path / "weights.safetensors"))
    run_ranks(_stream, 2, tmp_path / "two", backend=rank_backend)
    _stream(0, 1, tmp_path / "one")
    one = torch.load(tmp_path / "one" / "streamed0.pt")
    params = sum(p.numel() for p in model.parameters())
    assert one["read"] == 2 * params  # float16, every tensor whole once
    for rank in range(2):
        got = torch.load(tmp_path / "two" / f"streamed{rank}.pt")
        assert torch.equal(got["logits"], one["logits"]), rank
        assert abs(got["read"] - one["read"] / 2) <= 2 * len(list(model.parameters())), (rank, got["read"], one["read"])


STEPS, ACCUMULATE = 10, 2


def _batches(rank: int | None) -> list[torch.Tensor]:
    """Micro-batches of token ids: rank r's half of each, or (None) both halves together."""
    g = torch.Generator().manual_seed(7)
    whole = [torch.randint(0, 500, (4, 16), generator=g) for _ in range(STEPS * ACCUMULATE)]
    return whole if rank is None else [b[2 * rank : 2 * rank + 2] for b in whole]


def _groups(model: torch.nn.Module) -> list[dict[str, object]]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-3}]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor], backward, clip) -> None:
    for k in range(0, len(data), ACCUMULATE):
        opt.zero_grad()
        for ids in data[k : k + ACCUMULATE]:
            backward(model(ids, labels=ids).loss / ACCUMULATE)
        clip(1.0)
        opt.step()


def _optimizer(kind: str, params: list[dict[str, object]]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "asgd":  # per-parameter scalars (eta, mu) beside its elementwise average
        return torch.optim.ASGD(params, lr=0.05, t0=2)
    if kind == "adagrad":  # holds state from its constructor: each rank takes its chunk of it at entry
        return torch.optim.Adagrad(params, lr=0.01, initial_accumulator_value=0.1)
    return torch.optim.AdamW(params, lr=1e-3)


def _train_rank(rank: int, world: int, folder: Path, kind: str = "adamw", budget: str = "4MiB") -> None:
    from tiermem import tiered_offload

    model = _gpt2().train()
    opt = _optimizer(kind, _groups(model))
    cfg = _offload_cfg(folder, rank, **{"memory.host_budget": budget, "grads.tier": "nvme"})
    with tiered_offload(model, optimizer=opt, restore_optimizer=True, **cfg) as tm:
        _train(model, tm.optimizer, _batches(rank if world > 1 else None), tm.backward, tm.clip_grad_norm_)
        st = tm.stats()
        if world > 1:
            assert st["gathers_ahead"] > STEPS and st["reduced_bytes"] > 0, st  # in forward and backward
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, folder / f"params{rank}.pt")
    torch.save(opt.state_dict()["state"], folder / f"state{rank}.pt")  # given back whole on every rank
    torch.save(st["peak_bytes"], folder / f"peak{rank}.pt")


def _train_in_memory(kind: str) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Plain PyTorch in one process on the whole batches: the weights and the optimizer's state."""
    model = _gpt2().train()
    opt = _optimizer(kind, _groups(model))
    _train(model, opt, _batches(None), lambda loss: loss.backward(),
           lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))
    return {n: p.detach() for n, p in model.named_parameters()}, opt.state_dict()["state"]


def _train_halves_in_memory(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain PyTorch in one process with DDP's arithmetic: each micro-batch's loss is the mean of the two
    halves' losses."""
    model = _gpt2().train()
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    halves = list(zip(_batches(0), _batches(1), strict=True))[: steps * ACCUMULATE]
    for k in range(0, len(halves), ACCUMULATE):
        opt.zero_grad()
        for a, b in halves[k : k + ACCUMULATE]:
            ((model(a, labels=a).loss + model(b, labels=b).loss) / 2 / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _adam_gap(steps: int = STEPS) -> float:
    """How far plain PyTorch in one process moves AdamW's weights when each batch's gradient is the mean of
    its halves' (DDP's arithmetic) instead of the whole batch's: rounding, which Adam magnifies."""
    model = _gpt2().train()
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    _train(model, opt, _batches(None)[: steps * ACCUMULATE], lambda loss: loss.backward(),
           lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))
    halves = _train_halves_in_memory(steps)
    gap = max((p.detach() - halves[n]).abs().max().item() for n, p in model.named_parameters())
    assert 0 < gap < 1e-4
    return gap


KINDS = ("sgd", "asgd", "adagrad", "adamw")


def _train_rank_kinds(rank: int, world: int, folder: Path) -> None:
    """`_train_rank` with each optimizer of KINDS in turn, on one process group (a spawn of two ranks costs more
    than one kind's steps)."""
    for kind in KINDS:
        _train_rank(rank, world, folder / kind, kind)


def test_two_ranks_train_as_one_process_on_both_batches(tmp_path, rank_backend: str) -> None:
    """Ten steps with two parameter groups, clipping and 2-step accumulation, each rank on its half of every
    batch: both ranks end with the same weights, those of one process training on the whole batches in
    memory. With SGD and momentum, ASGD and Adagrad within 1e-6 (1.1e-8 measured for SGD). With AdamW as close
    as DDP's arithmetic gets: averaging two halves' gradients rounds differently from one batch and Adam
    magnifies it (plain PyTorch doing the same in one process lands 1.9e-5 from the whole batch here, and the
    ranks as far), so the bound is twice that gap, measured in the test. With restore_optimizer=True each rank's
    optimizer holds the state whole after exit, as in memory (within 1e-6 but AdamW's). Each rank's NVMe tier
    holds half of what one process's holds (parameters, gradients and optimizer state), within 5%."""
    run_ranks(_train_rank_kinds, 2, tmp_path / "two", timeout_s=240, backend=rank_backend)
    for kind in KINDS:
        _check_trained_kind(tmp_path, kind)


def _check_trained_kind(tmp_path: Path, kind: str) -> None:
    two = tmp_path / "two" / kind
    whole, state = _train_in_memory(kind)
    bound = 2 * _adam_gap() if kind == "adamw" else 1e-6
    ranks = [torch.load(two / f"params{rank}.pt") for rank in range(2)]
    for name, value in whole.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), (kind, name)
        diff = (ranks[0][name] - value).abs().max().item()
        assert diff <= bound, (kind, name, diff, bound)
    states = [torch.load(two / f"state{rank}.pt") for rank in range(2)]
    assert set(states[0]) == set(states[1]) == set(state)
    for index, entry in state.items():  # restore_optimizer: the state whole, as in memory
        for key, value in entry.items():
            assert torch.equal(states[0][index][key], states[1][index][key]), (kind, index, key)
            assert states[0][index][key].shape == value.shape, (kind, index, key)
            if kind != "adamw":  # Adam's second moments carry the rounding its weights show, magnified less
                torch.testing.assert_close(states[0][index][key], value, rtol=0, atol=1e-6)
    if kind == "adamw":
        _train_rank(0, 1, tmp_path / "one", kind, "8MiB")  # no process group: one rank, whole (larger) units
        one = torch.load(tmp_path / "one" / "peak0.pt")["nvme"]
        for rank in range(2):
            got = torch.load(two / f"peak{rank}.pt")["nvme"]
            assert abs(got - one / 2) <= 0.05 * one / 2, (rank, got, one)


def _tensor_bytes(folder: Path) -> int:
    from tiermem.runtime.safetensors_io import SafetensorsCheckpoint

    return sum(e.nbytes for index in folder.glob("*.safetensors.index.json")
               for e in SafetensorsCheckpoint(index).entries.values())


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "manifest.json"}


def _manifest(folder: Path) -> dict[str, object]:
    return json.loads((folder / "manifest.json").read_text())


SAVED_AT, CONTINUED_TO = 3, 6  # steps


def _continue(model: torch.nn.Module, tm: object, rank: int, world: int, folder: Path) -> None:
    """Train from step SAVED_AT to CONTINUED_TO on this rank's halves (or, alone, the whole batches); keep
    the weights."""
    data = _batches(rank if world > 1 else None)[SAVED_AT * ACCUMULATE : CONTINUED_TO * ACCUMULATE]
    _train(model, tm.optimizer, data, tm.backward, tm.clip_grad_norm_)  # type: ignore[attr-defined]
    with tm.gathered(model), torch.no_grad():  # type: ignore[attr-defined]
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, folder / f"continued{rank}.pt")


def _save_after_steps(rank: int, world: int, folder: Path) -> None:
    """Train three steps on this rank's halves (or, alone, the whole batches), save, and train on."""
    from tiermem import tiered_offload

    model = _gpt2().train()
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **_offload_cfg(folder, rank, **{"memory.host_budget": "8MiB"})) as tm:
        _train(model, tm.optimizer, _batches(rank if world > 1 else None)[: SAVED_AT * ACCUMULATE], tm.backward,
               tm.clip_grad_norm_)
        tm.save_checkpoint(folder / "saved")
        (folder / f"written{rank}").write_text(str(tm.stats()["checkpoint_bytes_written"]))
        with tm.gathered(model), torch.no_grad():
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, folder / f"params{rank}.pt")
        _continue(model, tm, rank, world, folder)


def _load_and_save(rank: int, world: int, folder: Path, source: Path) -> None:
    """Load a checkpoint saved with another number of ranks, save it again at once, and train on."""
    from tiermem import tiered_offload

    model = _gpt2().train()
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **_offload_cfg(folder, rank, **{"memory.host_budget": "8MiB"})) as tm:
        tm.load_checkpoint(source)
        (folder / f"read{rank}").write_text(str(tm.stats()["checkpoint_bytes_read"]))
        tm.save_checkpoint(folder / "again")
        _continue(model, tm, rank, world, folder)


def _load_damaged(rank: int, world: int, folder: Path, source: Path) -> None:
    """Load a checkpoint whose last tensor (checked by the last rank only) has a changed byte: every rank
    raises, naming it, and nothing is loaded."""
    from tiermem import tiered_offload
    from tiermem.errors import CheckpointError

    model = _gpt2().train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **_offload_cfg(folder, rank, **{"memory.host_budget": "8MiB"})) as tm:
        with pytest.raises(CheckpointError, match=r"optimizer-00001-of-00001.safetensors: tensor .* does not match"):
            tm.load_checkpoint(source)
        assert not tm.optimizer.state_dict()["state"]  # nothing loaded
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def _assert_continued_alike(got: Path, want: Path, bound: float) -> None:
    a, b = torch.load(got), torch.load(want)
    for name, value in b.items():
        diff = (a[name] - value).abs().max().item()
        assert diff <= bound, (name, diff, bound)


class _Experts(torch.nn.Module):
    """Two weights in one unit, one used per call, as a mixture of experts routes a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.randn(4, 32) * 0.3)
        self.w1 = torch.nn.Parameter(torch.randn(4, 32) * 0.3)

    def forward(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return h @ (self.w0 if expert == 0 else self.w1).t()


class _RoutedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(32, 32)
        self.experts = _Experts()

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.experts(torch.tanh(self.inp(x)), expert)


def _routed_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11 + rank)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS * ACCUMULATE)]


def _routed_rank(rank: int, world: int, folder: Path) -> None:
    from tiermem import tiered_offload

    model = _RoutedModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = _offload_cfg(folder, rank, **{"wrap.min_unit_bytes": 0, "grads.tier": "nvme"})
    data = _routed_data(rank)
    with tiered_offload(model, optimizer=opt, **cfg) as tm:
        assert any({"experts.w0", "experts.w1"} <= {f for f, _, _ in st.trainable} for st in tm.optimizer.units)
        for k in range(0, len(data), ACCUMULATE):
            tm.optimizer.zero_grad()
            for j, (x, y) in enumerate(data[k : k + ACCUMULATE]):
                expert = rank if k % 4 == 0 else (rank + j) % 2  # expert r on rank r, or each in turn
                tm.backward(((model(x, expert) - y) ** 2).mean() / ACCUMULATE)
            tm.clip_grad_norm_(0.5)
            tm.optimizer.step()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, folder / f"params{rank}.pt")


def test_two_ranks_that_give_different_parameters_of_a_unit_gradients_update_them_as_ddp_would(
        tmp_path, rank_backend: str) -> None:
    """Rank r sends its micro-batches to expert r (on every other step, each rank both experts in turn), so
    each rank has gradients for only some of one unit's parameters: every rank updates every parameter some
    rank gave a gradient, with the average over the ranks (the others' counted as zeros, as DDP with
    find_unused_parameters does), and clipping takes the norm of all of them. 10 steps of SGD with momentum,
    2-step accumulation, clipping: both ranks end with the weights of one process doing DDP's arithmetic,
    within 1e-6. Before, each rank updated only its own experts' chunks."""
    run_ranks(_routed_rank, 2, tmp_path / "two", timeout_s=120, backend=rank_backend)
    model = _RoutedModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [_routed_data(rank) for rank in range(2)]
    for k in range(0, STEPS * ACCUMULATE, ACCUMULATE):
        opt.zero_grad()
        for j in range(ACCUMULATE):
            losses = []
            for rank in range(2):
                x, y = data[rank][k + j]
                expert = rank if k % 4 == 0 else (rank + j) % 2
                losses.append(((model(x, expert) - y) ** 2).mean() / ACCUMULATE)
            (sum(losses) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    ranks = [torch.load(tmp_path / "two" / f"params{rank}.pt") for rank in range(2)]
    for name, value in model.named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        diff = (ranks[0][name] - value.detach()).abs().max().item()
        assert diff <= 1e-6, (name, diff)


def _backward_fails_once_rank(rank: int, world: int, folder: Path, fail: bool) -> None:
    from tiermem import tiered_offload

    model = _gpt2().train()
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    armed = {"now": False}

    def raising(grad: torch.Tensor) -> None:
        raise ValueError("block 0's backward fails")

    def arm(module: torch.nn.Module, args: object, out: tuple[torch.Tensor, ...]) -> None:
        if armed["now"]:  # block 1's gradients are all in (their reduce-scatter started) when this one's comes
            armed["now"] = False
            out[0].register_hook(raising)

    model.transformer.h[0].attn.register_forward_hook(arm)
    cfg = _offload_cfg(folder, rank, **{"memory.host_budget": "4MiB", "grads.tier": "cpu"})
    data = _batches(rank)[:8]
    with tiered_offload(model, optimizer=opt, **cfg) as tm:
        for k, ids in enumerate(data):
            tm.optimizer.zero_grad()
            if fail and k == 3:  # on both ranks
                armed["now"] = True
                with pytest.raises(ValueError, match="block 0's backward fails"):
                    tm.backward(model(ids, labels=ids).loss)
                tm.optimizer.zero_grad()
                loss = model(ids, labels=ids).loss  # its first unit gives back what the failed backward held
                held = [st.unit.name for st in tm.optimizer.units if st.grads_held]
                assert not held, held
                tm.backward(loss)
            else:
                tm.backward(model(ids, labels=ids).loss)
            tm.clip_grad_norm_(1.0)
            tm.optimizer.step()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, folder / f"params{rank}.pt")


def test_two_ranks_whose_backward_raises_with_a_reduce_scatter_in_flight_train_on_as_if_it_never_ran(
        tmp_path, rank_backend: str) -> None:
    """Both ranks' backward raises in block 0 while block 1's gradients are being reduce-scattered into its
    accumulators; the loop catches it and runs that batch again. Once the next forward has given back what
    the failed backward held, no unit's accumulators are held (block 1's were, written by the collective),
    and the weights after 8 steps equal, bit for bit, those of the same ranks that never failed."""
    run_ranks(_backward_fails_once_rank, 2, tmp_path / "failed", True, timeout_s=120, backend=rank_backend)
    run_ranks(_backward_fails_once_rank, 2, tmp_path / "clean", False, timeout_s=120, backend=rank_backend)
    for rank in range(2):
        got = torch.load(tmp_path / "failed" / f"params{rank}.pt")
        want = torch.load(tmp_path / "clean" / f"params{rank}.pt")
        for name, value in want.items():
            assert torch.equal(got[name], value), (rank, name)


def test_a_checkpoint_saved_by_two_ranks_loads_in_one_and_back(tmp_path, rank_backend: str) -> None:
    """Two ranks save one checkpoint of whole tensors (transformers' from_pretrained loads its weights); one
    process loads it and saves the same bytes again; and a checkpoint saved by one process, loaded by two
    ranks, is saved again unchanged: weights, optimizer state, steps and groups survive either way. Training
    on from the loaded checkpoint, three more AdamW steps, ends where the run that saved it ends when it goes
    on: bit for bit with the same number of ranks, and with the other within what averaging two halves'
    gradients instead of the whole batch's moves the weights (twice the gap measured in memory; a lost
    optimizer state would move them by the learning rate, 1e-3)."""
    from transformers import GPT2LMHeadModel

    run_ranks(_save_after_steps, 2, tmp_path / "two", timeout_s=120, backend=rank_backend)
    saved = tmp_path / "two" / "saved"
    loaded = dict(GPT2LMHeadModel.from_pretrained(saved).named_parameters())
    for rank in range(2):  # the weights each rank had when it saved, whole
        for name, value in torch.load(tmp_path / "two" / f"params{rank}.pt").items():
            assert torch.equal(loaded[name], value), (rank, name)
    _load_and_save(0, 1, tmp_path / "one", saved)
    assert _files(tmp_path / "one" / "again") == _files(saved)  # each rank wrote its chunks of the same files
    assert _manifest(tmp_path / "one" / "again") == _manifest(saved)  # the CRC-32s of the chunks joined
    total = _tensor_bytes(saved)
    for rank in range(2):  # each rank wrote its chunks, about half ([Note: each rank writes its own chunks])
        got = int((tmp_path / "two" / f"written{rank}").read_text())
        assert abs(got - total / 2) <= 0.05 * total, (rank, got, total)
    bound = 2 * _adam_gap(CONTINUED_TO)
    _assert_continued_alike(tmp_path / "one" / "continued0.pt", tmp_path / "two" / "continued0.pt", bound)
    # the same ranks: bit for bit
    run_ranks(_load_and_save, 2, tmp_path / "two-again", saved, timeout_s=120, backend=rank_backend)
    _assert_continued_alike(tmp_path / "two-again" / "continued0.pt", tmp_path / "two" / "continued0.pt", 0.0)
    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    with open(damaged / "optimizer-00001-of-00001.safetensors", "r+b") as f:  # the last byte of the last tensor
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    run_ranks(_load_damaged, 2, tmp_path / "damaged-load", damaged, timeout_s=120, backend=rank_backend)
    one = int((tmp_path / "one" / "read0").read_text())  # checked, then read: twice the tensors' bytes
    assert one == 2 * _tensor_bytes(saved)
    for rank in range(2):  # each rank checks a run of half the tensors' bytes, then reads its chunk of each
        got = int((tmp_path / "two-again" / f"read{rank}").read_text())
        assert abs(got - one / 2) <= 0.1 * one / 2, (rank, got, one)

    _save_after_steps(0, 1, tmp_path / "single")
    assert int((tmp_path / "single" / "written0").read_text()) == _tensor_bytes(tmp_path / "single" / "saved")
    run_ranks(_load_and_save, 2, tmp_path / "back", tmp_path / "single" / "saved", timeout_s=120, backend=rank_backend)
    assert _files(tmp_path / "back" / "again") == _files(tmp_path / "single" / "saved")
    for rank in range(2):
        _assert_continued_alike(tmp_path / "back" / f"continued{rank}.pt", tmp_path / "single" / "continued0.pt",
                                bound)


def _save_twice(rank: int, world: int, folder: Path, target: str, case: str) -> None:
    """Train a step and save into `target`; then, with `case` "unshared", save again with rank 1 not seeing the
    folder rank 0 made; with "full", fill the drive and save again, which must fail on both ranks."""
    import hashlib

    from tiermem import checkpointing, tiered_offload
    from tiermem.errors import CheckpointError

    model = _gpt2().train()
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    ckpt = Path(target) / "ckpt"
    with tiered_offload(model, optimizer=opt, **_offload_cfg(folder, rank, **{"memory.host_budget": "8MiB"})) as tm:
        _train(model, tm.optimizer, _batches(rank)[:ACCUMULATE], tm.backward, tm.clip_grad_norm_)
        tm.save_checkpoint(ckpt)
        first = tm.stats()["checkpoint_bytes_written"]
        digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}
        _train(model, tm.optimizer, _batches(rank)[ACCUMULATE : 2 * ACCUMULATE], tm.backward, tm.clip_grad_norm_)
        if case == "unshared":
            if rank == 1:  # looks for another name: as a rank on a machine that does not see rank 0's folder
                checkpointing._MARK = ".not-this-one-"
            tm.save_checkpoint(ckpt)
            again = tm.stats()["checkpoint_bytes_written"] - first
            (folder / f"written{rank}").write_text(f"{first} {again}")
            with tm.gathered(model), torch.no_grad():
                torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, folder / f"params{rank}.pt")
            return
        if rank == 0:  # leave the drive less than half of what the next save needs
            with open(Path(target) / "filler", "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(free_bytes(target) - first // 2, 1))
        if case == "full-unshared" and rank == 1:  # rank 0 writes it all, gathered, and fails part way
            checkpointing._MARK = ".not-this-one-"
        with pytest.raises(CheckpointError, match=r"writing failed \(.*No space left on device\).*Free space"):
            tm.save_checkpoint(ckpt)
        assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()} == digest
        if rank == 0:  # it made the new folder and removed it before raising; rank 1 may raise before that
            assert not [p for p in Path(target).iterdir() if ".tmp-" in p.name]
        (folder / f"raised{rank}").write_text("yes")


def _save_with_a_buffer_on_the_device(rank: int, world: int, folder: Path, case: str) -> None:
    """On the copying test device, a model with a persistent buffer (moved to the device at entry) saved by two
    ranks; with "unshared", rank 1 does not see the folder."""
    from tiermem import checkpointing, tiered_offload
    from tiermem.device import copying_device

    model = _gpt2()
    model.transformer.register_buffer("scale", torch.arange(5, dtype=torch.float32))
    with copying_device(), tiered_offload(model, **_offload_cfg(folder, rank)) as tm:
        if case == "unshared" and rank == 1:
            checkpointing._MARK = ".not-this-one-"
        tm.save_checkpoint(folder / "ckpt")


@pytest.mark.parametrize("case", ["shared", "unshared"])
def test_two_ranks_save_a_buffer_that_lives_on_the_device(tmp_path, case: str, rank_backend: str) -> None:
    """A persistent buffer on the device is copied to the host to be written, by either path (before: the
    ranks' own writer was handed the device tensor and every save failed)."""
    from safetensors.torch import load_file

    run_ranks(_save_with_a_buffer_on_the_device, 2, tmp_path, case, timeout_s=120, backend=rank_backend)
    saved = load_file(str(tmp_path / "ckpt" / "model-00001-of-00001.safetensors"))
    assert torch.equal(saved["transformer.scale"], torch.arange(5, dtype=torch.float32))
    assert torch.equal(saved["transformer.wte.weight"], _gpt2().transformer.wte.weight)


def test_two_ranks_that_do_not_see_one_folder_save_through_rank_0(tmp_path, rank_backend: str) -> None:
    """When a rank does not see the folder rank 0 made (machines without a shared filesystem), rank 0 writes
    every byte, gathered, and the checkpoint is the one the ranks would have written each their chunks of."""
    from transformers import GPT2LMHeadModel

    run_ranks(_save_twice, 2, tmp_path / "ranks", str(tmp_path), "unshared", timeout_s=120, backend=rank_backend)
    total = _tensor_bytes(tmp_path / "ckpt")
    (first0, again0), (first1, again1) = (
        map(int, (tmp_path / "ranks" / f"written{r}").read_text().split()) for r in range(2))
    assert abs(first0 - total / 2) <= 0.05 * total and abs(first1 - total / 2) <= 0.05 * total  # shared at first
    assert (again0, again1) == (total, 0)  # then rank 0 alone
    loaded = dict(GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt").named_parameters())
    for name, value in torch.load(tmp_path / "ranks" / "params1.pt").items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize("case", ["full", "full-unshared"])
def test_a_full_drive_fails_a_two_rank_save_on_both_ranks_and_the_old_checkpoint_stays(
        tmp_path, ext4_mount, case: str, rank_backend: str) -> None:
    """A real ext4 filesystem with room for one checkpoint: the second save, with the drive filled, raises on
    both ranks a CheckpointError naming the cause and the fix, whether each rank writes its chunks or rank 0
    writes everything gathered (its failed write stops the writing, not the gathers the other rank makes);
    the first checkpoint is unchanged and loads."""
    from transformers import GPT2LMHeadModel

    target = ext4_mount(48 << 20)
    run_ranks(_save_twice, 2, tmp_path / "ranks", target, case, timeout_s=120, backend=rank_backend)
    assert all((tmp_path / "ranks" / f"raised{r}").exists() for r in range(2))
    assert not [p for p in Path(target).iterdir() if ".tmp-" in p.name]  # the new folder was removed
    GPT2LMHeadModel.from_pretrained(Path(target) / "ckpt")


def _lora_adapter_saved(rank: int, world: int, folder: Path, case: str) -> None:
    """Train LoRA adapters (PEFT) on a GPT-2 for a step on two ranks and save the adapter alone; with "unshared",
    rank 1 does not see the folder rank 0 made."""
    import peft

    from tiermem import checkpointing, tiered_offload

    base = _gpt2().train()
    torch.manual_seed(3)  # the adapters' initial values, the same on both ranks
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                      fan_in_fan_out=True, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with tiered_offload(model, optimizer=opt, **_offload_cfg(folder, rank, **{"memory.host_budget": "8MiB"})) as tm:
        _train(model, tm.optimizer, _batches(rank)[:ACCUMULATE], tm.backward, tm.clip_grad_norm_)
        if case == "unshared" and rank == 1:
            checkpointing._MARK = ".not-this-one-"
        tm.save_checkpoint(folder / "adapter", adapters_only=True)
        (folder / f"written{rank}").write_text(str(tm.stats()["checkpoint_bytes_written"]))
        with tm.gathered(model), torch.no_grad():
            torch.save({n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n},
                       folder / f"lora{rank}.pt")


@pytest.mark.parametrize("case", ["shared", "unshared"])
def test_two_ranks_save_a_lora_adapter_that_peft_loads(tmp_path, case: str, rank_backend: str) -> None:
    """`tm.save_checkpoint(dir, adapters_only=True)` on two ranks writes the adapter whole, in PEFT's format:
    each rank its chunks when both see the folder, rank 0 alone (gathered) when not; PeftModel.from_pretrained
    loads the trained adapter (before: each rank wrote its chunks as whole tensors into the same file, and the
    save failed)."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    run_ranks(_lora_adapter_saved, 2, tmp_path, case, timeout_s=120, backend=rank_backend)
    want = torch.load(tmp_path / "lora0.pt")
    assert want and all(torch.equal(v, torch.load(tmp_path / "lora1.pt")[n]) for n, v in want.items())
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved.keys() == {n.replace(".default.", ".", 1) for n in want}
    loaded = dict(peft.PeftModel.from_pretrained(_gpt2(), tmp_path / "adapter").named_parameters())
    for name, value in want.items():
        assert torch.equal(loaded[name], value), name
    total = sum(v.numel() * v.element_size() for v in want.values())
    written = [int((tmp_path / f"written{r}").read_text()) for r in range(2)]
    if case == "shared":
        assert sum(written) == total and abs(written[0] - written[1]) <= 0.05 * total, (written, total)
    else:
        assert written == [total, 0], (written, total)


def _one_rank_raises(rank: int, world: int, folder: Path, stays: bool) -> None:
    import time

    from tiermem import RanksError, RestoreError, tiered_offload

    model = _gpt2()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))

    def fail(module: torch.nn.Module, args: object) -> None:
        raise ValueError("rank 1 fails in the forward of block 1")

    if rank == 1:
        model.transformer.h[1].register_forward_pre_hook(fail)
    t0 = time.monotonic()
    try:
        with tiered_offload(model, **_offload_cfg(folder, rank)):
            with torch.no_grad():
                model(ids)
    except RestoreError as exc:  # each rank leaves with the parameters named, on the meta device
        cause = exc.__context__
        assert isinstance(cause, RanksError if rank == 0 else ValueError), repr(cause)
        # the bytes were never unreadable: the fix named is the error's, not the drive's
        assert "Check the drive" not in str(exc) and "Fix the error above" in str(exc), str(exc)
        (folder / f"outcome{rank}").write_text(f"{type(cause).__name__}: {cause}\n{time.monotonic() - t0:.1f}")
        if rank == 1 and stays:  # its loop caught the error and went on: the process group stays up
            while not (folder / "outcome0").exists() and time.monotonic() - t0 < 40:
                time.sleep(0.1)
        return
    raise AssertionError("no error")


@pytest.mark.parametrize("stays", [False, True], ids=["rank-leaves", "rank-stays-alive"])
def test_a_rank_that_raises_makes_the_others_raise_not_hang(tmp_path, stays: bool, rank_backend: str) -> None:
    """Rank 1 raises in the forward of one block while rank 0 waits to gather that block with it: rank 0 gets a
    RanksError naming rank 1 and its error well within the process group's timeout (60 s here), whether rank
    1's process ends or stays alive (its loop caught the error), and both leave with a RestoreError naming the
    parameters, left on the meta device, instead of pairing their exit's gathers with the wrong collectives."""
    run_ranks(_one_rank_raises, 2, tmp_path, stays, timeout_s=60, backend=rank_backend)
    zero = (tmp_path / "outcome0").read_text()
    one = (tmp_path / "outcome1").read_text()
    assert zero.startswith("RanksError: rank 0 of 2: gathering a unit"), zero
    assert "rank 1 failed and left the collective: ValueError: rank 1 fails in the forward of block 1" in zero, zero
    assert one.startswith("ValueError: rank 1 fails"), one
    assert float(zero.split("\n")[1]) < 20, zero  # entry included; the announcement is looked for every 0.2 s


def _one_rank_stalls(rank: int, world: int, folder: Path) -> None:
    import time

    from tiermem import RestoreError, tiered_offload

    model = _gpt2()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))

    def stall(module: torch.nn.Module, args: object) -> None:  # alive, announcing nothing: a hung disk, a debugger
        until = time.monotonic() + 60
        while not (folder / "outcome0").exists() and time.monotonic() < until:
            time.sleep(0.1)

    if rank == 1:
        model.transformer.h[1].register_forward_pre_hook(stall)
    t0 = time.monotonic()
    try:
        with tiered_offload(model, **_offload_cfg(folder, rank)):
            with torch.no_grad():
                model(ids)
    except RestoreError as exc:
        cause = exc.__context__
        (folder / f"outcome{rank}").write_text(f"{type(cause).__name__}: {cause}\n{time.monotonic() - t0:.1f}")
        return
    raise AssertionError("no error")


def test_a_rank_that_stops_answering_ends_the_others_wait_at_the_groups_timeout_named(
        tmp_path, rank_backend: str) -> None:
    """Rank 1 stays alive but stops (in a forward pre-hook) while rank 0 waits for it in a collective: rank 0
    gets a RanksError naming rank 1 as the rank that did not arrive once the process group's timeout (8 s here)
    has passed, not later (before: it was still waiting after 120 s with a 10 s timeout); rank 1, when it goes
    on, ends with rank 0's error named instead of waiting out a timeout of its own."""
    run_ranks(_one_rank_stalls, 2, tmp_path, timeout_s=8, backend=rank_backend)
    zero = (tmp_path / "outcome0").read_text()
    one = (tmp_path / "outcome1").read_text()
    assert zero.startswith("RanksError: rank 0 of 2: "), zero
    assert "rank 1 did not arrive within the process group's timeout (8 s" in zero, zero
    assert 8 <= float(zero.split("\n")[1]) < 8 + 15, zero  # entry included
    assert "rank 0 failed and left the collective: RanksError" in one and "rank 1 did not arrive" in one, one
    assert float(one.split("\n")[1]) < float(zero.split("\n")[1]) + 8, (zero, one)


def _killed_mid_step(rank: int, folder: Path) -> None:
    """One of two ranks, started as its own process (not through run_ranks, which ends every rank once one dies):
    rank 1 is SIGKILLed in the forward of block 1 after two steps; rank 0 notes how it left."""
    import datetime
    import signal
    import time

    import torch.distributed as dist

    from tiermem import RestoreError, tiered_offload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = _gpt2().train()
    opt = _optimizer("adamw", _groups(model))
    t0 = time.monotonic()
    try:
        with tiered_offload(model, optimizer=opt, **_offload_cfg(folder, rank, **{"memory.host_budget": "4MiB"})) as tm:
            _train(model, tm.optimizer, _batches(rank)[:2], tm.backward, tm.clip_grad_norm_)
            if rank == 1:
                model.transformer.h[1].register_forward_pre_hook(lambda m, a: os.kill(os.getpid(), signal.SIGKILL))
            ids = _batches(rank)[0]
            t0 = time.monotonic()
            model(ids, labels=ids).loss.backward()
    except RestoreError as exc:
        (folder / f"outcome{rank}").write_text(f"{time.monotonic() - t0:.1f}\n{exc}\n---\n{exc.__context__}")


def test_a_rank_killed_mid_step_is_named_and_no_share_that_cannot_be_joined_is_left(tmp_path) -> None:
    """Rank 1 is SIGKILLed mid-step after two steps: rank 0 ends within seconds with the dead rank named (its
    process gone), and since a rank's share of the weights and optimizer state lives only in its own tiers, it
    writes no rescue folder of its own that could never be joined (tens of GB on a real model), saying to resume
    from a checkpoint. Before: a RestoreError telling it to join every rank's rescue folder, though the dead rank
    wrote none, and a new folder left behind at every crash."""
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    code = ("import sys, pathlib; from tests.test_ranks import _killed_mid_step as f; "
            "f(int(sys.argv[1]), pathlib.Path(sys.argv[2]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path)], cwd=root,
                              env={**os.environ, "PYTHONPATH": root}, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9, outs[1]
    assert procs[0].returncode == 0, outs[0]
    took, text = (tmp_path / "outcome0").read_text().split("\n", 1)
    assert float(took) < 15, text
    assert "rank 1 died (its process" in text and "is gone: killed, or out of memory" in text, text
    assert "wrote none of its own. Resume from a checkpoint of your own (none was written" in text, text
    assert "tiermem rescue" not in text, text
    assert not list(tmp_path.rglob("tiermem-rescue-*")), list(tmp_path.rglob("tiermem-rescue-*"))


def _gpt2_with_buffer() -> torch.nn.Module:
    model = _gpt2()
    model.register_buffer("tally", torch.zeros(3))  # persistent: a checkpoint holds it
    return model


def _train_then_one_rank_raises(rank: int, world: int, folder: Path) -> None:
    import re

    from tiermem import RestoreError, tiered_offload

    model = _gpt2_with_buffer().train()
    opt = _optimizer("adamw", _groups(model))
    cfg = _offload_cfg(folder, rank, **{"memory.host_budget": "4MiB"})
    try:
        with tiered_offload(model, optimizer=opt, **cfg) as tm:
            _train(model, tm.optimizer, _batches(rank)[:4], tm.backward, tm.clip_grad_norm_)
            model.tally += torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)  # rank 0's is the one a checkpoint keeps
            trained = {k: v.clone() for k, v in model.state_dict().items()}  # every rank gathers: the weights now
            torch.save(tm.optimizer.state_dict(), folder / f"state{rank}.pt")  # every rank gathers: whole
            if rank == 1:
                model.transformer.h[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(
                    ValueError("rank 1 fails in the forward of block 1")))
            ids = _batches(rank)[0]
            model(ids, labels=ids).loss.backward()
    except RestoreError as exc:
        assert all(p.is_meta for p in model.parameters())
        found = re.search(r"written to (\S+): with every rank's", str(exc))
        assert found, str(exc)
        torch.save(trained, folder / f"trained{rank}.pt")
        (folder / f"rescued{rank}").write_text(found.group(1))
        return
    raise AssertionError("no error")


def test_a_rank_that_raises_leaves_each_ranks_share_and_they_join_into_a_checkpoint_training_resumes_from(
        tmp_path, rank_backend: str) -> None:
    """After 2 steps of AdamW on 2 ranks, rank 1 raises in a forward: the parameters cannot be gathered back and
    stay on the meta device on both ranks, but each rank writes its chunks of every parameter and of its
    optimizer state beside its swap, and `tiermem rescue` puts them together into a checkpoint as
    tm.save_checkpoint writes one. One process loads it with tm.load_checkpoint: the weights and buffers are
    those model.state_dict() gathered before the error, bit for bit, and the optimizer state what
    optimizer.state_dict() gathered then (whole tensors), steps included; transformers' from_pretrained loads
    the weights too. Before, all of it was lost. Joining refuses an incomplete set of ranks, naming it."""
    from transformers import AutoModelForCausalLM

    from tiermem import tiered_offload
    from tiermem.cli import main
    from tiermem.errors import CheckpointError
    from tiermem.rescue import join

    run_ranks(_train_then_one_rank_raises, 2, tmp_path, timeout_s=120, backend=rank_backend)
    dirs = [(tmp_path / f"rescued{r}").read_text() for r in range(2)]
    assert [Path(d).parent for d in dirs] == [tmp_path / "swap0", tmp_path / "swap1"]
    assert main(["rescue", dirs[1], dirs[0], "--out", str(tmp_path / "ckpt")]) == 0
    want = torch.load(tmp_path / "trained0.pt")
    assert want["tally"].tolist() == [1.0, 2.0, 3.0]
    assert all(torch.equal(want[k], v) for k, v in torch.load(tmp_path / "trained1.pt").items() if k != "tally")
    states = [torch.load(tmp_path / f"state{r}.pt")["state"] for r in range(2)]

    model = _gpt2_with_buffer()
    one = _offload_cfg(tmp_path, 9, **{"memory.host_budget": "8MiB"})
    with tiered_offload(model, optimizer=_optimizer("adamw", _groups(model)), **one) as tm:
        tm.load_checkpoint(tmp_path / "ckpt")
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
        state = tm.optimizer.state_dict()["state"]
    assert set(loaded) == set(want)
    for name, value in loaded.items():
        assert torch.equal(value, want[name]), name
    assert set(state) == set(states[0]) and len(state) == len(list(model.parameters()))
    assert sum(e["exp_avg"].numel() for e in states[1].values()) == sum(p.numel() for p in model.parameters())
    for index, entry in state.items():
        assert float(entry["step"]) == float(states[0][index]["step"]) == 2.0
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[kind], states[0][index][kind]), (index, kind)
            assert torch.equal(entry[kind], states[1][index][kind]), (index, kind)
    pretrained = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")  # config.json came with the rescue
    for name, value in pretrained.state_dict().items():
        assert torch.equal(value, want[name]), name
    with pytest.raises(CheckpointError, match=r"ranks \[1\] of \[2\] ranks; give one directory for each of the 2"):
        join([dirs[1]], tmp_path / "partial")
    manifest = Path(dirs[1], "rescue.json")  # a unit rank 1 could not read (its drive failed at exit)
    shutil.copytree(dirs[1], tmp_path / "doctored")
    doctored = json.loads(manifest.read_text())
    doctored["lost"] = {"h.0": "reading partition ... failed: EIO"}
    (tmp_path / "doctored" / "rescue.json").write_text(json.dumps(doctored))
    with pytest.raises(CheckpointError, match=r"units \['h.0'\] could not be read on some rank \(reading partition"):
        join([dirs[0], str(tmp_path / "doctored")], tmp_path / "partial")
    with pytest.raises(CheckpointError, match="no rescue.json; not a tiermem rescue directory"):
        join([dirs[0], str(tmp_path)], tmp_path / "partial")
    _old_rescues_are_reported_and_removed(tmp_path, dirs)


def _old_rescues_are_reported_and_removed(tmp_path: Path, dirs: list[str]) -> None:
    """A later run on the same swap path says at entry which rescue folders are there, their size and how to
    join or delete them (before: nothing, and a new one was added at every crash); `tiermem rescue --remove`
    deletes rescue folders only."""
    import logging

    from tiermem import tiered_offload
    from tiermem.cli import main

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("tiermem.offload").addHandler(handler)
    try:
        with tiered_offload(_gpt2(), device="cpu", **{"nvme.paths": [str(tmp_path / "swap0")]}):
            pass
    finally:
        logging.getLogger("tiermem.offload").removeHandler(handler)
    said = [r.getMessage() for r in records if "rescue folder" in r.getMessage()]
    assert len(said) == 1 and dirs[0] in said[0] and "tiermem rescue --remove DIR" in said[0], said
    assert main(["rescue", "--remove", str(tmp_path)]) == 2 and Path(dirs[0]).is_dir()  # not a rescue folder
    assert main(["rescue", "--remove", str(tmp_path / "doctored")]) == 2  # its name is not a rescue's
    assert main(["rescue", "--remove", dirs[0], dirs[1]]) == 0
    assert not Path(dirs[0]).exists() and not Path(dirs[1]).exists()



def _polled_wait_sees_a_failed_rank(rank: int, world: int, folder: Path) -> None:
    import time

    import torch.distributed as dist

    from tiermem import RanksError

    ranks = Ranks.of().on_device(make_mover(torch.device("cpu"))).for_entry()
    if rank == 1:  # raised, announced it, and stays alive without joining the all-reduce
        ranks.announce(ValueError("rank 1 failed in its forward"))
        while not (folder / "done0").exists():
            time.sleep(0.05)
        return
    flag = ranks._staged(torch.ones(1))
    work = dist.all_reduce(flag, async_op=True)
    t0 = time.monotonic()
    with pytest.raises(RanksError, match="rank 1 failed and left the collective: ValueError: rank 1 failed"):
        ranks._poll(work, "an all-reduce", *ranks._began_waiting())
    (folder / "done0").write_text(f"{time.monotonic() - t0:.2f}")


def test_on_nccl_a_wait_that_asks_whether_the_work_completed_sees_a_rank_that_failed(
        tmp_path, rank_backend: str) -> None:
    """The wait NCCL gets (`Ranks._poll`: NCCL's `wait()` does not block the host, so the work is asked whether
    it completed) ends with a RanksError naming a rank that announced a failure and stays alive, within a few
    of its 0.2 s looks at the store, on a real process group's work."""
    run_ranks(_polled_wait_sees_a_failed_rank, 2, tmp_path, timeout_s=60, backend=rank_backend)
    assert float((tmp_path / "done0").read_text()) < 5.0
