"""The copying test device is as strict as a GPU ([Note: as strict as a GPU] in tiermem/device.py): copies land
later and poison their destinations, a source changed before its copy landed fails, backward runs on a device
thread, and a capacity bounds the device; and the defects these found stay fixed. scripts/gpu_check.sh
--device copy runs this file as its tests step."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
import torch

from tests import models
from tiermem import tiered_offload
from tiermem.device import copying_device
from tiermem.errors import BudgetError, CopyRaceError
from tiermem.swap import TensorSwapper, Tier
from tiermem.swap.transfers import CopyingMover


def cfg(tmp_path, **extra: Any) -> dict[str, Any]:
    out = {"device": "cpu", "params.tier": "nvme", "nvme.paths": [str(tmp_path / "swap")],
           "memory.host_budget": "1MiB", "wrap.min_unit_bytes": "16KiB", "io.block_size": "256KiB"}
    out.update(extra)
    return out

def test_a_source_written_before_its_copy_lands_is_caught() -> None:
    """Writing into a copy's source before its event completes raises CopyRaceError at the wait, and the
    race is kept for the test's teardown; the same copy left alone lands intact."""
    with copying_device(delay_s=(0.05, 0.05)) as d:
        mover = CopyingMover(torch.device("cpu"))
        try:
            faults = len(d.faults)
            host = torch.full((4096,), 7, dtype=torch.uint8)
            dev_t, event = mover.to_device(host)
            host.fill_(9)  # the host buffer reused before the copy has read it
            with pytest.raises(CopyRaceError, match="changed before the copy completed"):
                mover.synchronize(event)
            assert len(d.faults) == faults + 1
            d.faults[faults:] = []  # expected here: not a fault of the suite
            dev_t, event = mover.to_device(host)
            mover.synchronize(event)
            assert torch.equal(dev_t, host)
        finally:
            mover.close()


def test_a_destination_holds_poison_until_its_copy_lands() -> None:
    """Until a copy's event completes, its destination reads as NaN (float) or -1 (integer), as a GPU's
    would read as garbage; after the wait it holds the source's bytes."""
    with copying_device(delay_s=(0.05, 0.05)):
        mover = CopyingMover(torch.device("cpu"))
        try:
            host = torch.arange(1024, dtype=torch.float32).view(torch.uint8)
            dev_t, event = mover.to_device(host)
            assert not mover.done(event)
            assert torch.isnan(dev_t.view(torch.float32)).all()
            assert (dev_t.view(torch.int32) == -1).all()
            back = torch.zeros_like(host)
            mover.synchronize(mover.to_host(dev_t, back))  # stream order: after the first copy
            assert torch.equal(back.view(torch.float32), torch.arange(1024, dtype=torch.float32))
        finally:
            mover.close()


@pytest.mark.parametrize("how", ["add", "dirty host release"])
def test_a_device_homed_unit_keeps_its_host_buffer_until_its_copy_lands(tmp_path, how: str) -> None:
    """A device-homed partition's host buffer goes back to the pool only once the copy to the device that
    reads it has landed: the next partition filled into those bytes does not change what reaches the device
    (on CUDA, the pinned pool's next fill or NVMe read raced the DMA)."""
    with copying_device(delay_s=(0.05, 0.05)) as d, \
            TensorSwapper(**cfg(tmp_path, **{"memory.host_budget": "64KiB"})) as sw:
        faults = len(d.faults)
        part = sw.add("a", {"w": torch.full((4096,), 1.0)}, home="device")
        if how == "dirty host release":
            sw.acquire(part, Tier.DEVICE)  # the first copy lands; the next is the one that races
            sw.release(part)
            views = sw.acquire(part, Tier.HOST)
            views["w"].fill_(3.0)
            sw.release(part, dirty=True)  # copied host -> device, then the host buffer goes back
        other = sw.add("b", {"w": torch.full((4096,), 2.0)}, home="cpu")  # into the bytes just freed
        got = sw.acquire(part, Tier.DEVICE)["w"].clone()
        sw.release(part)
        assert len(d.faults) == faults
        assert torch.equal(got, torch.full((4096,), 1.0 if how == "add" else 3.0))
        assert torch.equal(sw.acquire(other, Tier.HOST)["w"], torch.full((4096,), 2.0))
        sw.release(other)


def test_backward_runs_on_a_device_thread_and_an_interrupt_lands_after_it() -> None:
    """On the copying device, backward's hooks run on another thread than the caller's (as CUDA's engine
    runs them on its device thread), and a Ctrl-C arriving during backward is raised in the caller once
    backward has ended, with every gradient made."""
    lin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    seen: list[threading.Thread] = []

    def hook(g: torch.Tensor) -> None:
        seen.append(threading.current_thread())
        if len(seen) == 1:
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.05)  # the caller handles the signal meanwhile

    for p in lin.parameters():
        p.register_hook(hook)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with copying_device() as d:
            threads = d.backward_threads
            with pytest.raises(KeyboardInterrupt):
                lin(torch.ones(2, 8)).sum().backward()
            assert d.backward_threads == threads + 1
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(seen) == 4 and threading.current_thread() not in seen
    assert all(p.grad is not None for p in lin.parameters())


@pytest.mark.parametrize("budget", ["4MiB", None])
def test_a_device_budget_past_the_devices_free_memory_is_refused_at_entry(tmp_path, budget: str | None) -> None:
    """A device whose free memory is less than memory.device_budget (or than the cap derived from the prefetch
    settings) is refused at entry with a BudgetError naming the setting, not out of memory mid-run; the model
    comes back as it was."""
    model = models.gpt2(layers=4, width=64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with copying_device(capacity=64 << 10):
        with pytest.raises(BudgetError, match="memory.device_budget") as info:
            with tiered_offload(model, **cfg(tmp_path, **{"memory.device_budget": budget})):
                pass
    assert "has free" in str(info.value) and ("prefetch" in str(info.value)) == (budget is None)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_a_demoted_prefetch_keeps_its_host_buffer_until_its_copy_lands(tmp_path) -> None:
    """A partition fetched ahead to the device and demoted before its copy landed, then evicted: its host
    buffer goes back to the pool only once that copy has read it, so the next read into those bytes races no
    copy (before, the copy's source was refilled under it)."""
    with copying_device(delay_s=(0.05, 0.05)) as d, \
            TensorSwapper(**cfg(tmp_path, **{"memory.host_budget": "64KiB"})) as sw:
        faults = len(d.faults)
        part = sw.add("a", {"w": torch.full((4096,), 1.0)}, home="nvme")
        sw.evict(part).wait()
        sw.prefetch(part, Tier.DEVICE).wait()
        sw.pump()  # the host bytes are in: the copy to the device starts, landing 50 ms later
        assert part.ready_event is not None and not sw.mover.done(part.ready_event)
        sw.demote(part)
        sw.evict(part).wait()
        other = sw.add("b", {"w": torch.full((4096,), 2.0)}, home="nvme")  # into the bytes just freed
        assert other.host is not None and other.host.offset == 0
        sw.mover.close()  # every copy has landed
        assert len(d.faults) == faults
        assert torch.equal(sw.acquire(other, Tier.HOST)["w"], torch.full((4096,), 2.0))
        sw.release(other)
