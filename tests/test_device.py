"""The device path on the copying test device: device memory really alive equals the ledger, nothing of the
device reaches host-only code, and failures on the way to the device are reported, not hung on."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests import models
from tests.conftest import on_copying_device
from tiermem import tiered_offload
from tiermem.device import CopyingDevice
from tiermem.errors import BudgetError
from tiermem.swap import TensorSwapper, Tier
from tiermem.swap.transfers import CopyingMover

pytest.importorskip("transformers")


@pytest.fixture
def dev(request: pytest.FixtureRequest) -> Any:
    """Only the copying device: these tests are about memory that the CPU device does not separate."""
    with on_copying_device(request.node.nodeid) as d:
        yield d


def cfg(tmp_path, **extra: Any) -> dict[str, Any]:
    out = {"device": "cpu", "params.tier": "nvme", "nvme.paths": [str(tmp_path / "swap")],
           "memory.host_budget": "1MiB", "wrap.min_unit_bytes": "16KiB", "io.block_size": "256KiB"}
    out.update(extra)
    return out


def alive(d: CopyingDevice) -> int:
    gc.collect()
    return d.live_bytes


def test_released_units_leave_no_device_memory(tmp_path, dev: CopyingDevice) -> None:
    """After a forward without prefetch, device memory really alive is what the ledger says (nothing)."""
    model = models.gpt2(layers=4, width=64)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(5))
    with tiered_offload(model, prefetch=False, **cfg(tmp_path)) as tm:
        assert isinstance(tm.swapper.mover, CopyingMover)
        for _ in range(2):
            with torch.no_grad():
                model(ids)
            assert tm.stats()["now_bytes"]["device"] == 0
            assert alive(dev) == 0


def test_generate_stays_within_the_working_set(tmp_path, dev: CopyingDevice) -> None:
    """During generate(), device memory really alive never exceeds the ledger's peak, and that peak is at
    most the computing unit plus the prefetch window (here: a unit used inside another one, plus depth 2)."""
    model = models.gpt2(layers=6, width=64)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(5))
    with tiered_offload(model, **cfg(tmp_path, **{"prefetch.depth": 2})) as tm:
        with torch.no_grad():
            model(ids)
        gc.collect()
        dev.reset_peak()
        tm.reset_stats()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        largest = tm.stats()["largest_unit_bytes"]
        peak = tm.stats()["peak_bytes"]["device"]
        assert dev.peak_bytes <= peak
        assert peak <= (2 + 2) * largest


def test_device_budget_null_is_derived_from_the_window(tmp_path, dev: CopyingDevice) -> None:
    """memory.device_budget: null caps the device at the working set the prefetch settings allow."""
    model = models.gpt2(layers=6, width=64)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(5))
    with tiered_offload(model, **cfg(tmp_path, **{"prefetch.depth": 1})) as tm:
        with torch.no_grad():
            model(ids)
            model(ids)
        stats = tm.stats()
        assert stats["device_budget"] is not None
        assert stats["device_budget"] >= stats["peak_bytes"]["device"]
        assert stats["device_budget"] <= (1 + 2) * stats["largest_unit_bytes"]


def test_a_failed_copy_to_the_device_is_raised_and_uncharged(tmp_path, dev: CopyingDevice, monkeypatch) -> None:
    """A copy to the device that fails (out of memory) raises in the caller, not on the I/O thread, and
    leaves the ledger's device bytes equal to the memory alive."""
    with TensorSwapper(**cfg(tmp_path, **{"memory.host_budget": "4MiB"})) as sw:
        parts = [sw.add(f"p{i}", {"w": torch.full((4096,), float(i))}) for i in range(3)]
        sw.flush()
        sw.evict_idle()
        real = CopyingMover.to_device

        def failing(self: CopyingMover, host: torch.Tensor) -> Any:
            raise torch.OutOfMemoryError("copying device: out of memory")

        monkeypatch.setattr(CopyingMover, "to_device", failing)
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                sw.acquire(parts[0], Tier.DEVICE)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                outcome.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "acquire hung after the copy to the device failed"
        assert isinstance(outcome[0], torch.OutOfMemoryError)
        assert sw.stats().ledger.now["device"] == alive(dev) == 0
        monkeypatch.setattr(CopyingMover, "to_device", real)
        tensors = sw.acquire(parts[0], Tier.DEVICE)  # and it works once memory is there
        assert dev.holds(tensors["w"]) and float(tensors["w"][0]) == 0.0
        sw.release(parts[0])


def test_an_explicit_device_budget_is_never_exceeded_by_prefetch(tmp_path, dev: CopyingDevice) -> None:
    """With memory.device_budget set, prefetch never demotes a unit fetched for the window before its use,
    and never goes over the budget; results stay exact."""
    model = models.gpt2(layers=6, width=64)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits
    with tiered_offload(model, **cfg(tmp_path, **{"prefetch.depth": 3, "memory.device_budget": "300KiB"})) as tm:
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref)
        assert tm.stats()["peak_bytes"]["device"] <= 300 << 10


@pytest.mark.parametrize("extra", [
    {"optimizer.update": "step"},
    {"params.tier": "device", "memory.host_budget": "8MiB"},
    {"params.tier": "device", "memory.host_budget": "8MiB", "optimizer.update": "step"},
    {"params.tier": "cpu", "memory.host_budget": "8MiB"},
], ids=["step-fp32", "device-tier-fp32", "device-tier-step", "cpu-tier"])
def test_training_on_the_copying_device_equals_pytorch(tmp_path, dev: CopyingDevice, extra: dict[str, Any]) -> None:
    """fp32 training with the update in step() or applied lazily, or with parameters homed on the device,
    gives the update host tensors only, and trains bit-exactly."""
    offload = cfg(tmp_path, **{"memory.host_budget": "2MiB", **extra})

    def check(tm: Any) -> None:
        assert tm.stats()["now_bytes"]["device"] == alive(dev)

    models.gpt2_training_matches(offload, width=32, vocab=100, shape=(2, 8), steps=3, check=check)


def test_load_checkpoint_after_a_forward(tmp_path, dev: CopyingDevice) -> None:
    """load_checkpoint after a forward (units kept on the device for the window) reads into host memory and
    the next forward sees the loaded weights."""
    model = models.gpt2(layers=3, width=32, vocab=100)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    with tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "4MiB"})) as tm:
        with torch.no_grad():
            before = model(ids).logits
        tm.save_checkpoint(tmp_path / "ckpt")
        with tm.gathered():
            for p in model.parameters():
                p.data.add_(1.0)
        with torch.no_grad():
            changed = model(ids).logits
        assert not torch.equal(changed, before)
        tm.load_checkpoint(tmp_path / "ckpt")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before)


def test_streaming_a_checkpoint_with_device_tier(tmp_path, dev: CopyingDevice) -> None:
    """checkpoint= with params.tier: device reads the weights into host memory and then to the device."""
    from transformers import GPT2LMHeadModel

    model = models.gpt2(layers=2, width=32, vocab=100)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        empty = GPT2LMHeadModel(model.config).eval()
    with tiered_offload(empty, checkpoint=tmp_path / "hf" / "model.safetensors",
                        **cfg(tmp_path, **{"params.tier": "device", "memory.host_budget": "4MiB"})) as tm:
        with torch.no_grad():
            assert torch.equal(empty(ids).logits, ref)
        assert tm.stats()["now_bytes"]["device"] == alive(dev) > 0


def test_buffers_come_back_to_the_host_on_exit(tmp_path, dev: CopyingDevice) -> None:
    """Buffers moved to the device at entry are ordinary host tensors again after exit, with their values."""
    model = models.Tricky().eval()
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids=ids)
    before = {n: b.clone() for n, b in model.named_buffers()}
    with tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "4MiB"})):
        assert any(dev.holds(b) for b in model.buffers())
        with torch.no_grad():
            assert torch.equal(model(ids=ids), ref)
    for name, buf in model.named_buffers():
        assert not dev.holds(buf), name
        assert torch.equal(buf, before[name]), name


class _Casts(TorchDispatchMode):
    """Keeps weak references to the low-precision copies made of device memory (autocast's casts)."""

    def __init__(self, d: CopyingDevice) -> None:
        super().__init__()
        self.dev = d
        self.casts: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and self.dev.holds(args[0]) and out.dtype == torch.bfloat16:
            self.casts.append(weakref.ref(out))
        return out


def test_autocast_keeps_no_cast_of_a_released_unit(tmp_path, dev: CopyingDevice) -> None:
    """Inside torch.autocast, a unit's low-precision copies go when the unit is released, not when the
    autocast block ends (its cache holds them by Parameter)."""
    model = models.gpt2(layers=4, width=64)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(5))
    with tiered_offload(model, prefetch=False, **cfg(tmp_path, **{"memory.host_budget": "4MiB"})):
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            casts = _Casts(dev)
            with casts:
                model(ids)
            assert casts.casts, "autocast made no cast of device memory: the test sees nothing"
            gc.collect()
            assert sum(r() is not None for r in casts.casts) == 0


def test_an_explicit_device_budget_smaller_than_a_unit_is_a_clear_error(tmp_path, dev: CopyingDevice) -> None:
    """A unit larger than memory.device_budget is refused, naming the setting."""
    model = models.gpt2(layers=2, width=64)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(5))
    with tiered_offload(model, **cfg(tmp_path, **{"memory.device_budget": "4KiB"})):
        with pytest.raises(BudgetError, match="memory.device_budget"), torch.no_grad():
            model(ids)


def test_after_backward_the_next_window_waits_on_the_host(tmp_path, dev: CopyingDevice) -> None:
    """When backward ends, the units the next forward needs first are read to the host only: the step is
    about to change them, so a device copy made then would be thrown away."""
    model = models.gpt2(layers=4, width=32, vocab=100)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path, **{"memory.host_budget": "4MiB"})) as tm:
        for _ in range(3):
            loss = model(ids, labels=ids).loss
            tm.backward(loss)
            assert tm.stats()["now_bytes"]["device"] == 0
            tm.optimizer.step()
            tm.optimizer.zero_grad()


class _CopiesInto:
    """Counts the mover's device-to-host copies whose destination starts in one of the given host address
    ranges (copies land later, on the copy stream's thread: counted as they are started)."""

    def __init__(self, mover: CopyingMover, ranges: list[tuple[int, int]]) -> None:
        self.mover = mover
        self.ranges = ranges
        self.count = 0

    def __enter__(self) -> _CopiesInto:
        real = self.mover.to_host

        def counted(d: torch.Tensor, h: torch.Tensor) -> Any:
            self.count += any(lo <= h.data_ptr() < hi for lo, hi in self.ranges)
            return real(d, h)

        self.mover.to_host = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.mover.to_host


def test_gradients_leave_the_device_once_per_unit(tmp_path, dev: CopyingDevice) -> None:
    """A unit's gradients reach their host accumulators in one copy per backward, not one per parameter."""
    model = models.gpt2(layers=2, width=32, vocab=100)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path, **{"memory.host_budget": "4MiB",
                                                                 "grads.tier": "cpu"})) as tm:
        units = [st for st in tm.optimizer.units]
        params = sum(len(st.trainable) for st in units)
        assert params > len(units)  # else the test could not tell the two apart
        spans = []
        for st in units:
            flat = tm.swapper.acquire(st.grads, Tier.HOST)
            start = next(iter(flat.values())).data_ptr()
            spans.append((start, start + st.grads.size))
            tm.swapper.release(st.grads)
        counter = _CopiesInto(tm.swapper.mover, spans)
        loss = model(ids, labels=ids).loss
        with counter:
            tm.backward(loss)
        assert counter.count == len(units)
        tm.optimizer.step()


def test_a_dirty_release_copies_outside_the_swapper_lock(tmp_path, dev: CopyingDevice, monkeypatch) -> None:
    """While release(dirty=True) copies a unit back from the device, other threads can use the swapper."""
    with TensorSwapper(**cfg(tmp_path, **{"memory.host_budget": "4MiB"})) as sw:
        part = sw.add("p", {"w": torch.zeros(4096)})
        other = sw.add("q", {"w": torch.ones(4096)})
        views = sw.acquire(part, Tier.DEVICE)
        views["w"].fill_(3.0)
        got_in = threading.Event()
        real = CopyingMover.to_host

        def slow_to_host(self: CopyingMover, d: torch.Tensor, h: torch.Tensor) -> Any:
            def use_the_swapper() -> None:
                sw.acquire(other, Tier.HOST)
                sw.release(other)
                got_in.set()

            threading.Thread(target=use_the_swapper, daemon=True).start()
            got_in.wait(10)  # with the lock held here, the other thread could not get in
            return real(self, d, h)

        monkeypatch.setattr(CopyingMover, "to_host", slow_to_host)
        sw.release(part, dirty=True)
        assert got_in.is_set()
        assert float(sw.acquire(part, Tier.HOST)["w"][0]) == 3.0
        sw.release(part)


def test_a_prefetch_never_demotes_a_unit_fetched_ahead(tmp_path, dev: CopyingDevice) -> None:
    """With memory.device_budget full, a prefetch is skipped rather than demote one fetched ahead and not yet
    used (which its acquire would then have to copy again)."""
    with TensorSwapper(**cfg(tmp_path, **{"memory.host_budget": "4MiB", "memory.device_budget": "128KiB"})) as sw:
        parts = [sw.add(f"p{i}", {"w": torch.full((16384,), float(i))}) for i in range(3)]  # 64 KiB each
        held = sw.acquire(parts[0], Tier.DEVICE)
        sw.prefetch(parts[1], Tier.DEVICE)
        assert sw.is_on_the_way(parts[1], Tier.DEVICE)
        sw.prefetch(parts[2], Tier.DEVICE)  # no room: skipped
        sw.pump()
        assert parts[1].state.value == "on device"
        assert float(held["w"][0]) == 0.0
        sw.release(parts[0])
        assert float(sw.acquire(parts[1], Tier.DEVICE)["w"][0]) == 1.0
        sw.release(parts[1])


def test_close_waits_for_the_copies_before_freeing_host_memory(tmp_path, dev: CopyingDevice, monkeypatch) -> None:
    """The swapper ends the device copies (its mover) before it unmaps the host pool they read and write."""
    from tiermem.io.buffers import HostBufferPool

    order: list[str] = []
    monkeypatch.setattr(CopyingMover, "close", lambda self: order.append("copies"))
    real_close = HostBufferPool.close
    monkeypatch.setattr(HostBufferPool, "close", lambda self: (order.append("pool"), real_close(self))[1])
    sw = TensorSwapper(**cfg(tmp_path, **{"memory.host_budget": "4MiB"}))
    part = sw.add("p", {"w": torch.zeros(4096)})
    sw.acquire(part, Tier.DEVICE)
    sw.release(part)
    sw.close()
    assert order == ["copies", "pool"]
