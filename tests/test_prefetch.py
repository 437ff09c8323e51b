"""Execution-order prefetch: zero misses on static models, the device bound, reuse, re-tracing, overlap."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tests import models
from tiermem import tiered_offload
from tiermem.io.engine import Chunk
from tiermem.io.threads import ThreadEngine
from tiermem.runtime.schedule import Schedule
from tiermem.swap import Residency

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device


def cfg(tmp_path, **extra) -> dict:
    out = {"device": "cpu", "params.tier": "nvme", "nvme.paths": [str(tmp_path / "swap")],
           "memory.host_budget": "2MiB", "wrap.min_unit_bytes": 0, "io.block_size": "256KiB"}
    out.update(extra)
    return out


def equal_layers(n: int = 8, width: int = 128) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)]).eval()


def test_static_model_has_no_misses_after_the_first_pass(tmp_path) -> None:
    """The first pass records; every later pass finds each unit prefetched."""
    model = equal_layers()
    x = torch.randn(4, 128)
    with torch.no_grad(), tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "512KiB"})) as tm:
        model(x)
        tm.reset_stats()
        for _ in range(4):
            model(x)
        s = tm.stats()
    assert s["prefetch_misses"] == 0 and s["prefetch_hits"] == 4 * 8
    assert s["bytes_read"] > 0  # the budget holds 7 of 8 units: the hits really came from NVMe reads


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_device_holds_at_most_the_current_unit_and_the_window(tmp_path, depth: int) -> None:
    """The ledger's device peak never exceeds (1 + prefetch.depth) units."""
    model = equal_layers()
    unit = None
    with torch.no_grad(), tiered_offload(model, **cfg(tmp_path, **{"prefetch.depth": depth})) as tm:
        unit = tm.units[0].nbytes
        assert all(u.nbytes == unit for u in tm.units)
        for _ in range(3):
            model(torch.randn(2, 128))
        assert tm.stats()["peak_bytes"]["device"] <= (1 + depth) * unit
        assert tm.stats()["peak_bytes"]["device"] >= 2 * unit  # prefetch did put more than one unit there


def test_prefetch_max_bytes_caps_the_window(tmp_path) -> None:
    """prefetch.max_bytes below two units limits the window to one unit even with depth 4."""
    model = equal_layers()
    with torch.no_grad(), tiered_offload(model, **cfg(tmp_path, **{"prefetch.depth": 4})) as probe:
        unit = probe.units[0].nbytes
    with torch.no_grad(), tiered_offload(model, **cfg(tmp_path, **{"prefetch.depth": 4,
                                                                   "prefetch.max_bytes": unit + 1})) as tm:
        for _ in range(3):
            model(torch.randn(2, 128))
        assert tm.stats()["peak_bytes"]["device"] <= 2 * unit


def test_unit_used_again_inside_the_window_stays_on_the_device(tmp_path) -> None:
    """A layer called again two steps later is kept on the device between its uses, not dropped."""
    torch.manual_seed(0)
    a, b, c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = a, b, c

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.a(self.b(self.a(x))))

    model = Reuse().eval()
    seen: list[Residency] = []
    x = torch.randn(2, 64)
    ref = model(x).detach()
    with torch.no_grad(), tiered_offload(model, **cfg(tmp_path)) as tm:
        unit_a = next(u for u in tm.units if u.name == "a")
        hook = model.b.register_forward_hook(lambda *args: seen.append(unit_a.partition.state))
        for _ in range(3):
            assert torch.equal(model(x), ref)
        hook.remove()
    assert seen[1:] == [Residency.DEVICE, Residency.DEVICE]  # after recording: kept while b runs


def test_skipped_layers_resynchronise_without_retracing(tmp_path) -> None:
    """Skipping different layers each pass gives right outputs; misses are counted, the order is kept."""
    model = models.Skippy().eval()
    x = torch.randn(3, 32)
    skips = [(), (2,), (1, 3, 4), (5,)]
    with torch.no_grad():
        refs = [model(x, skip) for skip in skips]
    with torch.no_grad(), tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "24KiB"})) as tm:
        for _ in range(2):
            for skip, ref in zip(skips, refs, strict=True):
                assert torch.equal(model(x, skip), ref)
        s = tm.stats()
    assert s["schedule_misses"] > 0 and s["prefetch_misses"] > 0
    assert s["retraces"] == 0


def test_changed_order_is_recorded_again_not_thrashed(tmp_path) -> None:
    """When the order really changes (layers run backwards), it is re-recorded once, then predicted exactly."""
    model = models.Skippy().eval()
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref_fwd, ref_rev = model(x), model(x, reverse=True)
    with torch.no_grad(), tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "24KiB"})) as tm:
        assert torch.equal(model(x), ref_fwd)
        assert torch.equal(model(x), ref_fwd)
        tm.reset_stats()
        for _ in range(4):
            assert torch.equal(model(x, reverse=True), ref_rev)
        s = tm.stats()
        assert s["retraces"] == 1 and s["schedule_misses"] > 0
        tm.reset_stats()
        for _ in range(3):
            assert torch.equal(model(x, reverse=True), ref_rev)
        s = tm.stats()
    assert s["schedule_misses"] == 0 and s["prefetch_misses"] == 0 and s["retraces"] == 0


def test_generate_has_no_misses_once_recorded(tmp_path) -> None:
    """generate() with a KV cache repeats one unit order per token: no misses after the first pass."""
    pytest.importorskip("transformers")
    model = models.gpt2()
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(3))
    with tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "768KiB"})) as tm:
        with torch.no_grad():
            model(ids)
        tm.reset_stats()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        s = tm.stats()
    assert s["passes"] == 5 and s["prefetch_misses"] == 0 and s["retraces"] == 0


class SlowEngine(ThreadEngine):
    """A disk that serves one request at a time and takes `delay` seconds for each."""

    def __init__(self, delay: float) -> None:
        super().__init__(block_size=1 << 20, queue_depth=1)
        self.delay = delay

    def _serve(self, chunk: Chunk) -> BaseException | None:  # type: ignore[override]
        time.sleep(self.delay)
        return super()._serve(chunk)


def test_prefetch_overlaps_reads_with_compute(tmp_path) -> None:
    """With a slow disk and slow layers, the prefetching run waits for reads less than the serial one."""
    model = models.Sleepy(width=128, depth=12, compute_s=0.02).eval()
    x = torch.randn(2, 128)
    timings = {}
    with SlowEngine(delay=0.02) as engine:
        for prefetch in (False, True):
            with torch.no_grad(), tiered_offload(model, engine=engine, prefetch=prefetch,
                                                 **cfg(tmp_path, **{"memory.host_budget": "208KiB"})) as tm:
                model(x)  # record
                tm.reset_stats()
                for _ in range(3):
                    model(x)
                timings[prefetch] = tm.stats()
    s_stats, o_stats = timings[False], timings[True]
    assert s_stats["bytes_read"] > 0 and o_stats["bytes_read"] > 0  # both really read from the slow disk
    # the stall time, not the wall clock (which a busy machine moves either way), shows the overlap
    assert o_stats["stall_seconds"] < s_stats["stall_seconds"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_working_set_stays_within_the_window(tmp_path) -> None:
    """On CUDA, allocated device memory beyond activations stays within (1 + depth) units, from the first
    pass on (a released unit's device copy is really freed), and outputs match."""
    model = equal_layers(n=8, width=1024)
    x = torch.randn(4, 1024)
    with torch.no_grad():
        ref = model(x)
    settings = cfg(tmp_path, device="cuda", **{"memory.host_budget": "32MiB"})
    xc = x.cuda()
    xc @ xc.T  # cuBLAS's workspace, allocated at the first matrix product and kept, is not a unit's memory
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.no_grad(), tiered_offload(model, **settings) as tm:
        unit = tm.units[0].nbytes
        model(xc)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before <= 3 * unit + (2 << 20)  # not the 8 units of the model
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = model(xc)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert tm.stats()["peak_bytes"]["device"] <= 3 * unit
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-5)
    activations = 2 * 4 * 1024 * 4
    assert peak <= 3 * unit + activations + (2 << 20)


def one_big_layer() -> nn.Module:
    """A 1 MiB layer followed by six of about 130 KiB: a tied embedding and its blocks, in miniature."""
    torch.manual_seed(0)
    dims = [256, 1024, 32, 1024, 32, 1024, 32, 256]
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False)]).eval()


def test_plan_resident_keeps_the_largest_units_that_leave_room_to_stream() -> None:
    """Largest first, while the rest of the budget holds the unit computing plus one read ahead."""
    from tiermem.runtime.schedule import plan_resident

    sizes = {0: 206, 1: 4} | {k: 50 for k in range(2, 26)}
    assert plan_resident(sizes, 335, 2) == ({0, 1}, 1)  # GPT-2 medium under 320 MiB, in MB
    assert plan_resident(sizes, 250, 2) == (set(), 2)  # 206 + 2 x 50 does not fit: nothing kept
    assert plan_resident({0: 10, 1: 10}, 100, 2) == ({0, 1}, 2)  # everything fits: everything kept
    pinned, depth = plan_resident({k: 10 for k in range(10)}, 75, 3)
    assert len(pinned) == 5 and depth == 1  # 50 kept leaves 25: the unit computing and 1 ahead
    # the bytes read with each unit (its layers' KV blocks) count in the room to stream, not in what keeping saves
    layers = range(2, 26)
    assert plan_resident(sizes, 335, 2, {k: 1 for k in layers}) == ({0, 1}, 1)  # one sequence's blocks
    assert plan_resident(sizes, 335, 2, {k: 37 for k in layers}) == (set(), 2)  # 32 sequences': 206 + 2 x 87
    pinned, depth = plan_resident({k: 10 for k in range(10)}, 75, 3, {k: 5 for k in range(10)})
    assert len(pinned) == 4 and depth == 1  # 40 kept leaves 35: two units of 10 + 5 at a time


def test_resident_units_are_not_read_again(tmp_path) -> None:
    """With keep_resident the big layer stays in host memory between passes, so no pass reads it again;
    outputs are the same either way and no acquisition misses."""
    x = torch.randn(3, 256)
    for keep in (True, False):
        model = one_big_layer()
        ref = model(x).detach()
        settings = cfg(tmp_path / str(keep), **{"memory.host_budget": "1536KiB", "prefetch.keep_resident": keep})
        with torch.no_grad(), tiered_offload(model, **settings) as tm:
            big = tm.units[0].partition
            others = sum(u.partition.size for u in tm.units[1:])
            for _ in range(2):  # record the order, then one pass under the plan
                assert torch.equal(model(x), ref)
            tm.reset_stats()
            for _ in range(3):
                assert torch.equal(model(x), ref)
                if keep:
                    assert big.state is not Residency.NVME  # never evicted
            s = tm.stats()
        assert s["prefetch_misses"] == 0
        if keep:
            assert s["resident_bytes"] >= big.size and s["bytes_read"] <= 3 * others
        else:
            assert s["resident_bytes"] == 0


def test_training_keeps_no_units_resident(tmp_path) -> None:
    """With an optimizer the budget belongs to gradients and optimizer state: no resident plan."""
    model = one_big_layer().train()
    with tiered_offload(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        **cfg(tmp_path, **{"memory.host_budget": "8MiB"})) as tm:
        for _ in range(3):
            tm.optimizer.zero_grad()
            model(torch.randn(3, 256)).sum().backward()
            tm.optimizer.step()
        assert tm.stats()["resident_bytes"] == 0


def test_reads_ahead_fill_the_room_the_resident_plan_leaves(tmp_path) -> None:
    """With resident units, reading ahead goes by the bytes the plan leaves for streamed units, not by the
    window: while the resident first units compute, the next streamed units that fit that room are read
    (two here, where the window is one), and no unit is read twice in a pass; outputs are the same."""
    from tiermem.swap.state import Tier

    model = equal_layers(12)
    x = torch.randn(3, 128)
    ref = model(x).detach()
    with torch.no_grad(), tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "512KiB"})) as tm:
        for _ in range(2):  # record the order, then one pass under the plan
            assert torch.equal(model(x), ref)
        rt, sched = tm.runtime, tm.runtime.schedule
        streamed = [u for u in sched.order if u not in sched.resident]
        size = rt.units[streamed[0]].partition.size
        assert sched.resident and sched.stream_room is not None and sched.stream_room // size > sched.depth
        ahead = [u for u in streamed if tm.swapper.holds_host(rt.units[u].partition)
                 or tm.swapper.is_on_the_way(rt.units[u].partition, Tier.HOST)]
        assert ahead == streamed[: sched.stream_room // size], (ahead, sched.stream_room, size, sched.depth)
        tm.reset_stats()
        for _ in range(3):
            assert torch.equal(model(x), ref)
        s = tm.stats()
    # three passes' streamed units, and at most the next pass's read-ahead (in flight as the last pass ends)
    assert s["prefetch_misses"] == 0 and s["bytes_read"] <= (3 * len(streamed) + len(ahead)) * size, s


def test_the_next_pass_is_what_the_window_reaches_past_the_orders_end() -> None:
    """Schedule.next_pass: the window's units whose next use is in the next pass ([Note: the state before
    step()] reads their optimizer state ahead): none while the window lies inside this pass, then those past
    the order's end, and the whole window once the pass has ended; nothing while recording."""
    s = Schedule(2, None, lambda i: 1)
    for u in (0, 1, 2, 1, 0):  # a forward then a backward, as the runtime records them
        assert s.on_acquire(u) == [] and s.next_pass() == []
    assert s.on_pass_end() == [0, 1] and s.next_pass() == [0, 1]
    for u in (0, 1, 2):
        s.on_acquire(u)
    assert s.window() == [1, 0] and s.next_pass() == []
    s.on_acquire(1)
    assert s.window() == [0, 1] and s.next_pass() == [1]  # 0 is still to come in this pass; 1 only in the next
