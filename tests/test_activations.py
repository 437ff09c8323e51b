"""Saved activations on NVMe (activations.tier: nvme): results equal PyTorch's, memory really goes, space comes back."""

from __future__ import annotations

import errno
import gc
import pathlib
import threading
import weakref
from collections import Counter
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from tests import models
from tests.test_training import cfg as training_cfg
from tiermem import ConfigError, tiered_offload
from tiermem.errors import StoreError
from tiermem.io.future import IOFuture
from tiermem.store import SwapStore

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device

ACT = {"activations.tier": "nvme", "activations.min_bytes": "16KiB", "activations.buffer": "512KiB"}


def cfg(tmp_path, **extra: Any) -> dict[str, Any]:
    """test_training's nvme tiers, with a budget for these wider layers and activations on NVMe."""
    return training_cfg(tmp_path, **{"memory.host_budget": "12MiB", **ACT, **extra})


def wide() -> nn.Module:
    """Activations of 64 x 512 floats (128 KiB) per layer for a batch of 64."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512),
                         nn.Sigmoid(), nn.Linear(512, 8))


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 64, generator=g), torch.randn(64, 8, generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("extra", [{}, {"optimizer.update": "step"}, {"activations.buffer": "4MiB"},
                                   {"io.engine": "threads"}],
                         ids=["buffer-smaller-than-a-step", "update-in-step", "buffer-holds-a-step",
                              "threads-engine"])
def test_training_with_activations_on_nvme_equals_pytorch(tmp_path, extra: dict[str, Any]) -> None:
    """10 AdamW steps: losses and weights bit-exact; the activations really went to disk and came back."""
    batches = data(10)
    ref = wide()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), batches)
    model = wide()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        **cfg(tmp_path, **extra)) as tm:
        losses = train(model, tm.optimizer, batches)
        st = tm.stats()
    assert losses == ref_losses
    assert_same(ref, model)
    # per step: four 128 KiB storages (tanh's and sigmoid's outputs, saved by two ops each, count once) and the
    # 16 KiB input
    step = 4 * 64 * 512 * 4 + 64 * 64 * 4
    assert st["activations_saved_bytes"] == 10 * step
    # every byte sent was written, or backward used it from memory without a write (the last of each forward's)
    assert st["activations_bytes_written"] + st["activations_unwritten_bytes"] == st["activations_saved_bytes"]
    assert st["activations_kept_bytes"] == 0
    if extra.get("activations.buffer") == "4MiB":
        assert st["activations_bytes_read"] == 0  # a step's activations fit: backward finds them in memory
        assert st["activations_bytes_written"] == step  # the first forward's, whose total was not known yet
    else:
        assert 0 < st["activations_unwritten_bytes"] < 9 * step
        assert st["activations_bytes_read"] > 0  # the buffer holds less than a step: backward read them back
    assert st["activations_peak_host_bytes"] <= (4 << 20 if extra.get("activations.buffer") else 512 << 10)


def test_keep_holds_the_newest_of_each_forward_in_memory_and_sends_the_rest(tmp_path) -> None:
    """activations.keep: the first forward sends everything; each later one sends the previous forward's total
    less `keep`, oldest first, and keeps the newest in memory. Training stays bit-exact."""
    batches = data(10)
    ref = wide()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), batches)
    model = wide()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        **cfg(tmp_path, **{"activations.keep": "256KiB"})) as tm:
        assert tm.config.activations.keep == 256 << 10
        losses = train(model, tm.optimizer, batches)
        st = tm.stats()
    assert losses == ref_losses
    assert_same(ref, model)
    big, first = 64 * 512 * 4, 64 * 64 * 4  # the four 128 KiB storages, after the 16 KiB input
    # later forwards: the input and two storages (272 KiB) reach 528 - 256 KiB sent; the two newest stay
    assert st["activations_saved_bytes"] == (4 * big + first) + 9 * (2 * big + first)
    assert st["activations_in_memory_bytes"] == 9 * 2 * big
    assert st["activations_kept_bytes"] == 0


def test_slow_writes_keep_backward_inside_the_buffer(tmp_path, monkeypatch) -> None:
    """A slow disk: every write reports done 20 ms after the kernel finished it, its buffer pinned till then. The
    writes still in flight when backward starts pin their slots, whether autograd still holds their records or
    not; backward waits for them instead of reading outside activations.buffer."""
    write = SwapStore.write

    def slow_write(self: SwapStore, extent: Any, buf: Any, *args: Any, **kwargs: Any) -> IOFuture:
        late = IOFuture(0, 1, keepalive=buf)
        write(self, extent, buf, *args, **kwargs).add_done_callback(
            lambda f: threading.Timer(0.02, late._chunk_done, (f.exception(),)).start())
        return late

    monkeypatch.setattr(SwapStore, "write", slow_write)
    batches = data(4)
    ref = wide()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), batches)
    model = wide()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **cfg(tmp_path)) as tm:
        losses = train(model, tm.optimizer, batches)
        st = tm.stats()
    assert losses == ref_losses
    assert_same(ref, model)
    assert st["activations_bytes_read"] > 0
    assert st["activations_kept_bytes"] == 0
    assert st["activations_bytes_written"] + st["activations_unwritten_bytes"] == st["activations_saved_bytes"] > 0


def count_activation_writes(monkeypatch, tm: Any) -> Counter[str]:
    """Bytes the swap store writes for saved activations, counted where they go to the drive, by partition."""
    writes: Counter[str] = Counter()
    write = SwapStore.write

    def counted(self: SwapStore, extent: Any, buf: Any, *args: Any, **kwargs: Any) -> IOFuture:
        fut = write(self, extent, buf, *args, **kwargs)
        name = next((p.name for p in list(tm.swapper.partitions.values()) if p.extent is extent), "")
        if name.startswith("activation#"):
            writes[name] += fut.nbytes
        return fut

    monkeypatch.setattr(SwapStore, "write", counted)
    return writes


@pytest.mark.parametrize("rows", [[64] * 6, [64, 64, 128, 128, 64, 64]],
                         ids=["same-forwards", "forwards-grow-and-shrink"])
def test_what_backward_finds_in_memory_is_never_written(tmp_path, monkeypatch, rows: list[int]) -> None:
    """[Note: activation writes deferred]: after the first forward, the newest activations.buffer of what each
    forward sends is not written, and backward takes it from memory. A forward that saves more than the one
    before writes the deferred ones it has to drop (training stays exact); the stats count what the drive got."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 64, generator=g), torch.randn(n, 8, generator=g)) for n in rows]
    ref = wide()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), batches)
    model = wide()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **cfg(tmp_path)) as tm:
        writes = count_activation_writes(monkeypatch, tm)
        losses = train(model, tm.optimizer, batches)
        st = tm.stats()
    assert losses == ref_losses
    assert_same(ref, model)
    assert st["activations_saved_bytes"] == sum(n * (4 * 512 + 64) * 4 for n in rows)
    assert sum(writes.values()) == st["activations_bytes_written"]
    assert st["activations_bytes_written"] + st["activations_unwritten_bytes"] == st["activations_saved_bytes"]
    # the first forward writes all it sends (528 KiB); each later one keeps up to the 512 KiB buffer unwritten
    assert st["activations_unwritten_bytes"] >= 3 * 64 * 512 * 4
    assert st["activations_bytes_written"] >= 4 * 64 * 512 * 4 + 64 * 64 * 4
    assert st["activations_bytes_read"] > 0


def test_a_deferred_activation_whose_write_fails_stays_in_memory(tmp_path, monkeypatch, caplog) -> None:
    """A forward twice as large as the one before must write the records it deferred to make room; when the
    drive fails every activation write of that step, they stay in memory (so may later ones, as autograd would
    keep them), nothing is lost, and training goes on exactly once the drive is back."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 64, generator=g), torch.randn(n, 8, generator=g)) for n in (64, 64, 128, 64)]
    ref = wide()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), batches)
    model = wide()
    failing = False
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **cfg(tmp_path)) as tm:
        writes = count_activation_writes(monkeypatch, tm)  # counts the writes that reach the drive
        counted = SwapStore.write

        def failing_write(self: SwapStore, extent: Any, buf: Any, *args: Any, **kwargs: Any) -> IOFuture:
            if failing and any(p.extent is extent and p.name.startswith("activation#")
                               for p in list(tm.swapper.partitions.values())):
                fut = IOFuture(0, 1)
                fut._chunk_done(OSError(errno.EIO, "injected write error"))
                return fut
            return counted(self, extent, buf, *args, **kwargs)

        monkeypatch.setattr(SwapStore, "write", failing_write)
        losses = train(model, tm.optimizer, batches[:2])
        before = sum(writes.values())
        failing = True
        losses += train(model, tm.optimizer, batches[2:3])
        failing = False
        assert sum(writes.values()) == before  # no activation reached the drive in the failing step
        losses += train(model, tm.optimizer, batches[3:])
        st = tm.stats()
    assert losses == ref_losses
    assert_same(ref, model)
    assert "writing a saved activation to swap failed" in caplog.text
    assert st["activations_unwritten_bytes"] > 0


def test_gpt2_with_activations_on_nvme_equals_pytorch(tmp_path) -> None:
    """GPT-2 (tied weights, attention's query/key/value as views of one tensor) trains bit-exactly."""
    pytest.importorskip("transformers")

    def read_back(tm: Any) -> None:
        assert tm.stats()["activations_bytes_read"] > 0

    models.gpt2_training_matches(cfg(tmp_path, **{"activations.min_bytes": "4KiB", "activations.buffer": "128KiB"}),
                                 width=64, vocab=300, shape=(4, 32), steps=5, check=read_back)


class Probe(nn.Module):
    """Keeps a weak reference to an intermediate that only autograd holds after forward (sin saves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 512)
        self.seen: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 2.0
        self.seen.append(weakref.ref(h))
        return h.sin()


@pytest.mark.parametrize("tier", ["memory", "nvme"])
def test_offloaded_activation_memory_is_freed_in_forward(tmp_path, tier: str) -> None:
    """With activations on NVMe, a tensor that only autograd needs is gone when forward returns (it lives on
    disk until backward); kept in memory, autograd holds it. Gradients are the same either way."""
    torch.manual_seed(0)
    model = Probe()
    x = torch.randn(64, 64)
    ref = Probe()
    ref.load_state_dict(model.state_dict())
    ref(x).sum().backward()
    with tiered_offload(model, **cfg(tmp_path, **{"activations.tier": tier})):
        out = model(x)
        gc.collect()
        assert (model.seen[-1]() is None) == (tier == "nvme")
        out.sum().backward()
    assert torch.equal(model.lin.weight.grad, ref.lin.weight.grad)


class Gated(nn.Module):
    """Saves two views of one storage in one op (like attention's query and key)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lin(x).chunk(2, dim=-1)
        return a * b


def test_views_of_one_storage_are_written_once(tmp_path) -> None:
    torch.manual_seed(0)
    model, ref = Gated(), Gated()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(64, 64)
    ref(x).square().sum().backward()
    with tiered_offload(model, **cfg(tmp_path)) as tm:
        model(x).square().sum().backward()
        st = tm.stats()
    # the projection's output (64 x 1024 floats) once for both views, the product that square() saves (64 x 512)
    # and the input that the projection saves (64 x 64)
    assert st["activations_saved_bytes"] == 64 * 1024 * 4 + 64 * 512 * 4 + 64 * 64 * 4
    assert torch.equal(model.lin.weight.grad, ref.lin.weight.grad)


def test_retain_graph_and_two_forwards_before_backward(tmp_path) -> None:
    """A graph run twice (retain_graph) and two forwards sharing one backward give PyTorch's gradients."""
    torch.manual_seed(0)
    model, ref = wide(), wide()
    (x1, _), (x2, _) = data(2)
    grads = []
    for m, ctx in ((ref, nullcontext()), (model, tiered_offload(model, **cfg(tmp_path)))):
        with ctx:
            loss = m(x1).square().mean()
            loss.backward(retain_graph=True)
            loss.backward()
            (m(x1).sum() + m(x2).sum()).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_records_read_back_by_a_retained_backward_are_dropped_oldest_first_by_the_next_forward(
        tmp_path, monkeypatch) -> None:
    """[Note: the oldest in memory]: a backward with retain_graph reads records back and keeps them; the next
    forward's packs drop them, oldest first, to stay inside activations.buffer, instead of keeping new tensors
    in memory for want of room. At every pack the bytes held are what a walk over all the records finds."""
    torch.manual_seed(0)
    model, ref = wide(), wide()
    ref.load_state_dict(model.state_dict())
    (x1, _), (x2, _) = data(2)
    loss = ref(x1).square().mean()
    loss.backward(retain_graph=True)
    (ref(x2).square().mean() + loss).backward()
    walks: list[tuple[int, int]] = []  # at each pack: the bytes held as counted, and as a walk finds them
    drops: list[tuple[list[int], list[int]]] = []  # (dropped by a pack, in memory before it)

    def in_memory(self: Any) -> list[int]:
        return [r.seq for r in self._records if r.part is not None and self.swapper.holds_host(r.part)]

    with tiered_offload(model, **cfg(tmp_path, **{"activations.keep": 0})) as tm:
        store = tm.runtime.activations
        pack = type(store).pack

        def checked(self: Any, t: torch.Tensor) -> Any:
            walk = sum(r.part.size for r in self._records if r.part is not None and self.swapper.holds_host(r.part))
            walks.append((self.host_bytes(), walk))
            before = in_memory(self)
            out = pack(self, t)
            after = set(in_memory(self))
            drops.append(([q for q in before if q not in after], before))
            return out

        monkeypatch.setattr(type(store), "pack", checked)
        loss = model(x1).square().mean()
        loss.backward(retain_graph=True)
        assert store.stats()["activations_bytes_read"] > 0  # records read back, and the retained graph keeps them
        store.reset_stats()
        (model(x2).square().mean() + loss).backward()
        st = store.stats()
        monkeypatch.undo()
    assert all(held == walk for held, walk in walks) and len(walks) > 4
    assert any(dropped for dropped, _ in drops)
    for dropped, before in drops:  # the oldest in memory go first, those read back by backward included
        assert dropped == before[: len(dropped)]
    assert st["activations_kept_bytes"] == 0  # room was made every time
    assert 0 < st["activations_peak_host_bytes"] <= 512 << 10
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_backward_finds_the_records_it_unpacks_read_ahead(tmp_path, monkeypatch) -> None:
    """Each unpack reads ahead the records saved before it, half of activations.buffer of them: on a deep
    stack backward finds all but at most 2 of the records it unpacks in memory or on their way, and no record
    is read twice. Results equal PyTorch's."""
    from tiermem.swap import TensorSwapper

    def deep() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 512), *[m for _ in range(20) for m in (nn.Tanh(), nn.Linear(512, 512))])

    model, ref = deep(), deep()
    (x, _), = data(1)
    ref(x).square().mean().backward()
    found: list[bool] = []  # per unpack: its record was in memory, or on its way, when backward asked
    prefetched: Counter[str] = Counter()
    with tiered_offload(model, **cfg(tmp_path, **{"activations.keep": 0, "memory.host_budget": "32MiB"})) as tm:
        store = tm.runtime.activations
        unpack, prefetch = type(store).unpack, TensorSwapper.prefetch

        def watched(self: Any, saved: Any) -> Any:
            found.append(self.swapper.holds_host(saved.record.part))
            return unpack(self, saved)

        def counted(self: TensorSwapper, part: Any, *args: Any, **kwargs: Any) -> Any:
            if part.name.startswith("activation#"):
                prefetched[part.name] += 1
            return prefetch(self, part, *args, **kwargs)

        monkeypatch.setattr(type(store), "unpack", watched)
        monkeypatch.setattr(TensorSwapper, "prefetch", counted)
        model(x).square().mean().backward()
        st = tm.stats()
    # 21 storages of 128 KiB (each Linear's input, each Tanh's output) and the input: all but the 4 that the
    # 512 KiB buffer holds when forward ends go to disk and come back
    assert st["activations_bytes_read"] >= 16 * 128 * 1024
    assert len(found) >= 40 and found.count(False) <= 2, found
    assert prefetched and max(prefetched.values()) == 1
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_tensor_larger_than_the_buffer_stays_in_memory(tmp_path) -> None:
    """Nothing fails for want of buffer: a saved tensor that cannot fit is kept where autograd keeps it."""
    torch.manual_seed(0)
    model, ref = wide(), wide()
    x, _ = data(1)[0]
    ref(x).sum().backward()
    with tiered_offload(model, **cfg(tmp_path, **{"activations.buffer": "64KiB"})) as tm:
        model(x).sum().backward()
        st = tm.stats()
    assert st["activations_kept_bytes"] >= 4 * 64 * 512 * 4
    assert st["activations_saved_bytes"] == 64 * 64 * 4  # only the 16 KiB input fits
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_full_swap_keeps_activations_in_memory(tmp_path) -> None:
    """When the swap store cannot take an activation (a full disk), it stays in memory; training goes on."""
    torch.manual_seed(0)
    model, ref = wide(), wide()
    x, _ = data(1)[0]
    ref(x).sum().backward()
    with tiered_offload(model, **cfg(tmp_path)) as tm:
        store = tm.swapper.store

        def full(nbytes: int) -> Any:
            raise StoreError(f"{store.run_dirs[0]}: no space for {nbytes} more swap")

        store.allocate = full  # type: ignore[method-assign]
        model(x).sum().backward()
        assert tm.stats()["activations_kept_bytes"] > 0
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_swap_space_of_activations_comes_back(tmp_path) -> None:
    """Once backward has run (or the graph is dropped), the activations' extents are free again."""
    model = wide()
    x, _ = data(1)[0]
    with tiered_offload(model, **cfg(tmp_path)) as tm:
        model(x).sum().backward()  # the first pass opens the store and records the order
        acts = tm.runtime.activations
        store = tm.swapper.store
        acts.settle()
        base = store.used
        out = model(x).sum()
        assert store.used > base
        out.backward()
        acts.settle()
        assert store.used == base
        out = model(x).sum()
        assert store.used > base
        del out  # a graph dropped without backward
        gc.collect()
        acts.settle()
        assert store.used == base


def test_activation_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"activations\.buffer.*memory\.host_budget"):
        tiered_offload(wide(), **{"device": "cpu", "memory.host_budget": "1MiB", "activations.tier": "nvme",
                                  "activations.buffer": "1MiB"}).__enter__()
    with pytest.raises(ConfigError, match=r"activations\.tier"):
        tiered_offload(wide(), **{"device": "cpu", "activations.tier": "disk"}).__enter__()


def test_leaving_with_a_graph_alive(tmp_path) -> None:
    """A graph made inside the context and dropped after it leaves cleanly: no error, no crash."""
    model = wide()
    x, _ = data(1)[0]
    with tiered_offload(model, **cfg(tmp_path)) as tm:
        out = model(x).sum()
        assert tm.stats()["activations_saved_bytes"] > 0
    del out
    gc.collect()
    assert not list((tmp_path / "swap").glob("tiermem-*"))  # the swap files went with the context


def test_the_shipped_low_memory_training_config_trains_gpt2_like_pytorch(tmp_path) -> None:
    """configs/train-lowmem.yaml (lazy updates, activations on NVMe), scaled down to a small model, trains
    GPT-2 bit-exactly, applying each step as the next forward fetches units and reading activations back."""
    pytest.importorskip("transformers")
    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "train-lowmem.yaml"

    def lazy_and_read_back(tm: Any) -> None:
        assert tm.swapper.config.optimizer.update == "lazy" and tm.optimizer.lazy
        assert tm.stats()["activations_bytes_read"] > 0

    small = {"nvme.paths": [str(tmp_path / "swap")], "memory.host_budget": "12MiB", "activations.buffer": "128KiB",
             "activations.min_bytes": "4KiB", "wrap.min_unit_bytes": 0}
    models.gpt2_training_matches({"config": str(path), **small}, width=64, vocab=300, shape=(4, 32), steps=5,
                                 check=lazy_and_read_back)
