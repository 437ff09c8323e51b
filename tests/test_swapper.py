"""The tensor swapper: bit-exact moves between tiers, the ledger and budgets, eviction, concurrency."""

from __future__ import annotations

import os
import threading
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.errors import BudgetError
from tiermem.swap import CorruptDataError, Residency, StateError, TensorSwapper, Tier

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 11), (1000,), (17, 129)]
KiB, MiB = 1 << 10, 1 << 20


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            if dtype.is_floating_point:
                t = torch.randn(shape, generator=g).to(dtype)
            else:
                t = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
            out[f"t{i}_{j}"] = t
    return out


def _swapper(tmp_path, **overrides) -> TensorSwapper:
    base = {"device": "cpu", "nvme.paths": [str(tmp_path / "swap")], "memory.host_budget": "8MiB",
            "io.block_size": "64KiB", "io.queue_depth": 8}
    base.update(overrides)
    return TensorSwapper(None, **base)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("home", ["nvme", "cpu", "device"])
@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_round_trip_every_tier_path_bit_exact(tmp_path, home: str, engine: str) -> None:
    """All dtypes and odd shapes survive add -> host -> device -> evict -> refetch bit-exact."""
    from tiermem.io.backends import available_backends

    if available_backends()[engine]:
        pytest.skip(f"{engine}: {available_backends()[engine]}")
    src = _tensors(1)
    with _swapper(tmp_path, **{"io.engine": engine}) as sw:
        part = sw.add("p", src, home=home)
        assert _same(part.tensors(), src)
        for _ in range(2):
            sw.fetch(part, Tier.HOST).wait()
            assert _same(part.tensors(), src)
            got = sw.acquire(part, Tier.DEVICE)
            assert part.state is Residency.DEVICE
            assert _same(got, src)
            sw.release(part)
            sw.evict(part).wait()
            if home == "nvme":
                assert part.state is Residency.NVME and part.host is None
                with pytest.raises(StateError, match="on nvme"):
                    part.tensors()
        assert _same(sw.acquire(part), src)
        sw.release(part)


def test_views_not_copies_and_dirty_write_back(tmp_path) -> None:
    """Tensors are views of the partition; changes released dirty come back after eviction."""
    with _swapper(tmp_path) as sw:
        part = sw.add("w", {"a": torch.zeros(1000), "b": torch.ones(10, dtype=torch.bfloat16)})
        views = sw.acquire(part)
        again = part.tensors()
        assert views["a"].data_ptr() == again["a"].data_ptr()
        views["a"] += 3
        views["b"].mul_(2)
        sw.release(part, dirty=True)
        sw.evict(part).wait()
        assert part.state is Residency.NVME
        back = sw.acquire(part)
        assert torch.equal(back["a"], torch.full((1000,), 3.0))
        assert torch.equal(back["b"], torch.full((10,), 2.0, dtype=torch.bfloat16))
        sw.release(part)


def test_views_are_made_once_per_buffer(tmp_path) -> None:
    """The same host buffer gives the same view objects; after an eviction and a fetch into another buffer,
    the views are new and see the new buffer's bytes."""
    with _swapper(tmp_path) as sw:
        part = sw.add("w", {"a": torch.arange(1000.0), "b": torch.ones(10)})
        first = sw.acquire(part, Tier.HOST)
        address = part.host.address  # type: ignore[union-attr]
        sw.release(part)
        again = sw.acquire(part, Tier.HOST)
        assert all(again[k] is first[k] for k in first)
        again.pop("a")  # callers get their own dict: this does not reach the next caller
        sw.release(part)
        sw.evict(part).wait()
        blocker = sw.add("blocker", {"y": torch.zeros(1010)})  # takes the piece `part` had
        back = sw.acquire(part, Tier.HOST)
        assert part.host.address != address  # type: ignore[union-attr]
        assert back.keys() == {"a", "b"} and back["a"] is not first["a"]
        assert back["a"].data_ptr() == part.host.address  # type: ignore[union-attr]
        assert torch.equal(back["a"], torch.arange(1000.0))
        sw.release(part)
        assert blocker.host is not None


def test_clean_eviction_skips_the_write(tmp_path) -> None:
    """Evicting a partition whose NVMe copy is current writes nothing."""
    with _swapper(tmp_path) as sw:
        part = sw.add("c", {"x": torch.randn(50_000)})
        sw.evict(part).wait()  # first eviction: written (new data)
        written = sw.stats().bytes_written
        sw.acquire(part)
        sw.release(part)  # not dirty
        sw.evict(part).wait()
        assert sw.stats().bytes_written == written
        assert sw.stats().bytes_read == part.size


def test_lru_eviction_order_under_host_budget(tmp_path) -> None:
    """With room for three partitions, fetching a fourth evicts the least recently used idle one."""
    size = 1 * MiB
    with _swapper(tmp_path, **{"memory.host_budget": "3MiB"}) as sw:
        parts = [sw.add(f"p{i}", {"x": torch.full((size // 4,), float(i))}) for i in range(3)]
        for p in parts:
            sw.evict(p).wait()
        for i in (0, 1, 2):
            sw.acquire(parts[i])
            sw.release(parts[i])
        sw.acquire(parts[0])  # p0 is now most recent; p1 least recent
        sw.release(parts[0])
        extra = sw.add("p3", {"x": torch.full((size // 4,), 3.0)})
        assert parts[1].state is Residency.NVME
        assert all(p.state is Residency.HOST for p in (parts[0], parts[2], extra))
        assert sw.stats().ledger.now["host"] <= 3 * MiB


def test_partition_larger_than_budget_names_it(tmp_path) -> None:
    """A partition bigger than the whole host budget raises BudgetError with its name, size and the key."""
    with _swapper(tmp_path, **{"memory.host_budget": "1MiB"}) as sw:
        with pytest.raises(BudgetError) as info:
            sw.add("huge.layer", {"w": torch.zeros(2 * MiB // 4)})
    msg = str(info.value)
    assert "huge.layer" in msg and "2 MiB" in msg and "memory.host_budget" in msg


def test_budget_full_of_partitions_in_use_is_an_error_not_a_hang(tmp_path) -> None:
    """When every byte of the budget is acquired, another acquire fails naming the holders."""
    with _swapper(tmp_path, **{"memory.host_budget": "2MiB"}) as sw:
        a = sw.add("a", {"x": torch.zeros(MiB // 4)})
        b = sw.add("b", {"x": torch.zeros(MiB // 4)})
        sw.evict(b).wait()
        sw.acquire(a)
        c = sw.add("c", {"x": torch.zeros(MiB // 4)})  # evicts nothing: fits
        sw.acquire(c)
        with pytest.raises(BudgetError, match="'b'.*held by partitions in use.*a, c"):
            sw.acquire(b)
        assert b.waiters == []
        sw.release(a)
        sw.acquire(b)  # now a is idle and evictable


def test_cpu_home_partitions_count_against_the_budget(tmp_path) -> None:
    """Host-homed partitions are never evicted; filling the budget with them is a clear error."""
    with _swapper(tmp_path, **{"memory.host_budget": "2MiB"}) as sw:
        sw.add("h1", {"x": torch.zeros(MiB // 4)}, home="cpu")
        sw.add("h2", {"x": torch.zeros(MiB // 4)}, home="cpu")
        with pytest.raises(BudgetError, match="h1, h2"):
            sw.add("h3", {"x": torch.zeros(MiB // 4)}, home="cpu")


def test_scattered_host_homed_pieces_are_moved_to_make_room(tmp_path) -> None:
    """Free bytes split between host-homed pieces are joined by moving an idle one, bit-exact, counted in
    stats; a piece in use is never moved, and then the allocation fails naming the split."""
    half = MiB // 2
    data = torch.arange(3 * MiB // 4, dtype=torch.float32)
    with _swapper(tmp_path, **{"memory.host_budget": "4MiB"}) as sw:
        homed = {n: sw.add(n, {"x": torch.full((half // 4,), float(i))}, home="cpu") for i, n in enumerate("abcd")}
        sw.discard(homed["b"])
        sw.discard(homed["d"])  # 3 MiB free: 0.5 between a and c at the top, 2.5 below c
        sw.acquire(homed["c"], Tier.HOST)  # in use: it stays where it is
        with pytest.raises(BudgetError, match=r"'big'.*in pieces of at most 2.5 MiB"):
            sw.add("big", {"x": data})
        sw.release(homed["c"])
        assert sw.stats().bytes_moved == 0
        big = sw.add("big", {"x": data})
        assert sw.stats().bytes_moved == half
        sw.evict(big).wait()
        assert torch.equal(sw.acquire(big, Tier.HOST)["x"], data)


def test_a_read_ahead_joins_scattered_free_pieces_only_when_asked_to(tmp_path) -> None:
    """A read-ahead moves nothing by default (it must not stall the compute); with `compact` (the runtime's
    reads of an update's state, [Note: host pool compaction]) it joins free pieces as a waiting fetch does."""
    half = MiB // 2
    data = torch.arange(3 * MiB // 4, dtype=torch.float32)
    with _swapper(tmp_path, **{"memory.host_budget": "4MiB"}) as sw:
        big = sw.add("big", {"x": data})
        sw.evict(big).wait()
        homed = {n: sw.add(n, {"x": torch.full((half // 4,), float(i))}, home="cpu") for i, n in enumerate("abcd")}
        sw.discard(homed["b"])
        sw.discard(homed["d"])  # 3 MiB free, as 0.5 and 2.5
        assert sw.prefetch(big, Tier.HOST) is None and sw.stats().bytes_moved == 0
        assert sw.prefetch(big, Tier.HOST, compact=True) is not None
        assert sw.stats().bytes_moved == half
        assert torch.equal(sw.acquire(big, Tier.HOST)["x"], data)
        assert torch.equal(sw.acquire(homed["c"], Tier.HOST)["x"], torch.full((half // 4,), 2.0))
        sw.release(big)
        for name, value in (("a", 0.0), ("c", 2.0)):
            assert torch.equal(sw.acquire(homed[name], Tier.HOST)["x"], torch.full((half // 4,), value))
            sw.release(homed[name])


def test_device_budget_demotes_idle_partitions(tmp_path) -> None:
    """Prefetching beyond memory.device_budget demotes idle device partitions; the ledger stays within it."""
    with _swapper(tmp_path, **{"memory.device_budget": "2MiB"}) as sw:
        parts = [sw.add(f"d{i}", {"x": torch.zeros(MiB // 4)}) for i in range(4)]
        for p in parts:
            sw.fetch(p, Tier.DEVICE).wait()
            assert sw.stats().ledger.now["device"] <= 2 * MiB
        assert [p.state for p in parts[:2]] == [Residency.HOST] * 2
        assert [p.state for p in parts[2:]] == [Residency.DEVICE] * 2
        assert sw.stats().ledger.peak["device"] == 2 * MiB


def test_many_partitions_in_flight_from_many_threads(tmp_path) -> None:
    """Forty partitions moved by four threads at once, over a budget of ten, keep their bytes."""
    with _swapper(tmp_path, **{"memory.host_budget": "2560KiB"}) as sw:
        parts = [sw.add(f"m{i}", {"x": torch.full((64 * KiB // 4,), float(i)), "i": torch.tensor([i])})
                 for i in range(40)]
        sw.flush()
        errors: list[BaseException] = []

        def worker(k: int) -> None:
            try:
                for rep in range(5):
                    for p in parts[k::4]:
                        sw.prefetch(p, Tier.HOST)
                    for p in parts[k::4]:
                        t = sw.acquire(p)
                        i = int(t["i"])
                        assert torch.equal(t["x"], torch.full((64 * KiB // 4,), float(i) + rep))
                        t["x"] += 1
                        sw.release(p, dirty=True)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert sw.stats().ledger.peak["host"] <= 2560 * KiB
        assert sw.stats().evictions > 0


def test_checksum_detects_a_changed_swap_file(tmp_path) -> None:
    """With nvme.checksum on, bytes altered on disk raise CorruptDataError naming the partition."""
    with _swapper(tmp_path, **{"nvme.checksum": True}) as sw:
        part = sw.add("ck", {"x": torch.arange(10_000, dtype=torch.float32)})
        sw.evict(part).wait()
        swap = os.path.join(sw.store.run_dirs[0], "swap.bin")
        assert part.extent is not None
        with open(swap, "r+b") as f:
            f.seek(part.extent.start + 100)
            f.write(b"\xff\xff")
        with pytest.raises(CorruptDataError, match="'ck'.*checksum"):
            sw.acquire(part)
        assert part.state is Residency.NVME and sw.stats().ledger.now["host"] == 0


def test_checksum_is_one_per_partition_over_its_bytes(tmp_path) -> None:
    """nvme.checksum takes one CRC-32 of a partition's bytes up to its last tensor's end at each write-back;
    the padding after it is not covered."""
    with _swapper(tmp_path, **{"nvme.checksum": True}) as sw:
        part = sw.add("ck", {"x": torch.arange(1000, dtype=torch.float32)})
        sw.evict(part).wait()
        assert part.size > part.nbytes  # 4000 bytes of data in a 4 KiB extent
        swap = os.path.join(sw.store.run_dirs[0], "swap.bin")
        assert part.extent is not None
        with open(swap, "r+b") as f:
            f.seek(part.extent.start)
            on_disk = f.read(part.size)
            assert part.checksum == zlib.crc32(on_disk[: part.nbytes])
            f.seek(part.extent.start + part.nbytes)
            f.write(b"\xff" * (part.size - part.nbytes))  # the padding: not checked
        assert torch.equal(sw.acquire(part, Tier.HOST)["x"], torch.arange(1000, dtype=torch.float32))
        sw.release(part)


def test_a_write_back_returns_to_host(tmp_path) -> None:
    """A write-back's end leaves the partition on host: flush keeps it cached and clean, and an eviction's
    write then drops it ([Note: residency])."""
    with _swapper(tmp_path) as sw:
        part = sw.add("w", {"x": torch.randn(10_000)})
        assert part.dirty
        sw.flush()
        assert part.state is Residency.HOST and not part.dirty and part.host is not None
        sw.acquire(part, Tier.HOST)["x"].add_(1)
        sw.release(part, dirty=True)
        sw.evict(part).wait()
        assert part.state is Residency.NVME and not part.dirty and sw.stats().ledger.now["host"] == 0


def test_stats_and_reset(tmp_path) -> None:
    """stats() counts bytes read/written and per-tier peaks; reset_stats() starts a new window."""
    with _swapper(tmp_path) as sw:
        part = sw.add("s", {"x": torch.zeros(MiB // 4)})
        sw.evict(part).wait()
        sw.acquire(part)
        s = sw.stats()
        assert (s.bytes_read, s.bytes_written, s.partitions) == (MiB, MiB, 1)
        assert s.ledger.peak["host"] == MiB and s.ledger.peak["device"] == MiB and s.ledger.now["nvme"] == MiB
        sw.release(part)
        sw.reset_stats()
        s = sw.stats()
        assert (s.bytes_read, s.bytes_written) == (0, 0)
        assert s.ledger.peak["device"] == 0 and s.ledger.peak["host"] == MiB


def test_misuse_is_a_clear_error(tmp_path) -> None:
    """Releasing more than acquired, evicting in use, bad tiers and duplicate names are refused clearly."""
    with _swapper(tmp_path) as sw:
        part = sw.add("u", {"x": torch.zeros(10)})
        with pytest.raises(StateError, match="released more often"):
            sw.release(part)
        sw.acquire(part)
        with pytest.raises(StateError, match="in use"):
            sw.evict(part)
        with pytest.raises(ValueError, match="tier"):
            sw.fetch(part, "disk")
        with pytest.raises(ValueError, match="exists already"):
            sw.add("u", {"x": torch.zeros(1)})
        with pytest.raises(ValueError, match="home"):
            sw.add("v", {"x": torch.zeros(1)}, home="gpu")


def test_remove_gives_back_memory_and_swap(tmp_path) -> None:
    """remove() frees host memory and the extent, so the ledger and store return to zero."""
    with _swapper(tmp_path) as sw:
        part = sw.add("r", {"x": torch.zeros(MiB // 4)})
        sw.evict(part).wait()
        sw.remove(part)
        s = sw.stats()
        assert s.ledger.now["host"] == 0 and s.ledger.now["nvme"] == 0 and s.partitions == 0


@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_discard_frees_memory_and_refills_with_zeros_without_io(tmp_path, home: str) -> None:
    """discard() drops the contents and the host memory; the next acquire gives zeros and reads nothing."""
    with _swapper(tmp_path) as sw:
        part = sw.add("g", {"x": torch.ones(MiB // 4), "y": torch.full((3, 5), 7.0)}, home=home)
        if home == "nvme":
            sw.evict(part).wait()
            sw.acquire(part, Tier.HOST)
            sw.release(part)
        held = sw.stats().ledger.now["host"]
        assert held == part.size
        read, written = sw.stats().bytes_read, sw.stats().bytes_written
        sw.discard(part)
        assert sw.stats().ledger.now["host"] == 0 and part.state is Residency.NVME
        views = sw.acquire(part, Tier.HOST)
        assert all(bool((v == 0).all()) for v in views.values())
        assert sw.stats().bytes_read == read and sw.stats().bytes_written == written
        views["x"].fill_(3.0)
        with pytest.raises(StateError, match="in use"):
            sw.discard(part)
        sw.release(part, dirty=True)
        if home == "nvme":  # a discarded-then-changed partition is written back like any other
            sw.evict(part).wait()
            assert torch.equal(sw.acquire(part, Tier.HOST)["x"], torch.full((MiB // 4,), 3.0))
            sw.release(part)


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_discard_without_zeros_hands_the_buffer_out_as_it_is(tmp_path, home: str) -> None:
    """discard(zeros=False): the next acquire reads nothing and does not zero the buffer (the pool hands the
    same place back here, so it still holds the old bytes); a plain discard after it zeroes again."""
    with _swapper(tmp_path) as sw:
        part = sw.add("g", {"x": torch.ones(MiB // 4), "y": torch.full((3, 5), 7.0)}, home=home)
        read, written = sw.stats().bytes_read, sw.stats().bytes_written
        sw.discard(part, zeros=False)
        views = sw.acquire(part, Tier.HOST)
        assert sw.stats().bytes_read == read and sw.stats().bytes_written == written
        assert torch.equal(views["x"], torch.ones(MiB // 4)) and torch.equal(views["y"], torch.full((3, 5), 7.0))
        sw.release(part)
        sw.discard(part)
        assert all(bool((v == 0).all()) for v in sw.acquire(part, Tier.HOST).values())
        sw.release(part)


def test_host_only_config_touches_no_disk(tmp_path) -> None:
    """With every tier on host, no swap directory is created."""
    with TensorSwapper("configs/cpu.yaml", **{"nvme.paths": [str(tmp_path / "never")]}) as sw:
        part = sw.add("h", {"x": torch.ones(5)}, home="cpu")
        assert torch.equal(sw.acquire(part)["x"], torch.ones(5))
        sw.release(part)
    assert not (tmp_path / "never").exists()


@settings(max_examples=25, deadline=None, derandomize=True)  # the same examples on every run: no flaky CI
@given(st.lists(st.tuples(st.sampled_from(["acquire", "release", "prefetch", "evict", "dirty"]),
                          st.integers(0, 5)), max_size=40))
def test_ledger_never_exceeds_budgets_under_random_use(tmp_path_factory, ops) -> None:
    """Random acquire/release/prefetch/evict keep host and device within budget and every byte intact."""
    tmp = tmp_path_factory.mktemp("prop")
    sizes = [96, 200, 300, 512, 64, 128]  # KiB
    with _swapper(tmp, **{"memory.host_budget": "1MiB", "memory.device_budget": "640KiB"}) as sw:
        parts = [sw.add(f"q{i}", {"x": torch.full((n * KiB // 4,), float(i))}) for i, n in enumerate(sizes)]
        expect = [float(i) for i in range(len(sizes))]
        held: list[int] = []
        for op, i in ops:
            p = parts[i]
            try:
                if op == "acquire":
                    t = sw.acquire(p)
                    held.append(i)
                    assert torch.equal(t["x"], torch.full_like(t["x"], expect[i]))
                elif op in ("release", "dirty") and i in held:
                    if op == "dirty":
                        p.tensors()["x"].add_(1)
                        expect[i] += 1
                    held.remove(i)
                    sw.release(p, dirty=op == "dirty")
                elif op == "prefetch":
                    started = sw.prefetch(p, Tier.DEVICE)  # None: no host memory free right now
                    if started is not None:
                        started.wait()
                elif op == "evict" and i not in held:
                    sw.evict(p).wait()
            except BudgetError:
                pass  # a legitimate refusal: too much is held; the budget must still hold
            snap = sw.stats().ledger
            assert snap.now["host"] <= 1 * MiB and snap.now["device"] <= 640 * KiB
        snap = sw.stats().ledger
        assert snap.peak["host"] <= 1 * MiB and snap.peak["device"] <= 640 * KiB
        for i in list(held):
            sw.release(parts[i])
        for i, p in enumerate(parts):
            t = sw.acquire(p, Tier.HOST)
            assert torch.equal(t["x"], torch.full_like(t["x"], expect[i]))
            sw.release(p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_through_pinned_host(tmp_path) -> None:
    """On CUDA, partitions reach the device through pinned buffers and come back bit-exact when dirty."""
    src = _tensors(3)
    with _swapper(tmp_path, device="cuda") as sw:
        part = sw.add("g", src)
        assert sw.pool.buffer.pinned  # pinned by the first add(), for asynchronous copies
        sw.evict(part).wait()
        got = sw.acquire(part)
        assert all(t.is_cuda for t in got.values())
        assert _same({k: v.cpu() for k, v in got.items()}, src)
        got["t0_3"].add_(1)
        sw.release(part, dirty=True)
        sw.evict(part).wait()
        back = sw.acquire(part, Tier.HOST)
        assert torch.equal(back["t0_3"], src["t0_3"] + 1)
        sw.release(part)


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_changes_during_a_write_back_are_not_lost(tmp_path, engine: str) -> None:
    """A partition acquired and changed while its eviction is being written stays dirty and is written again."""
    from tiermem.io.backends import available_backends

    if available_backends()[engine]:
        pytest.skip(f"{engine}: {available_backends()[engine]}")
    with _swapper(tmp_path, **{"io.engine": engine}) as sw:
        parts = [sw.add(f"w{i}", {"a": torch.zeros(3000), "b": torch.zeros(5000)}) for i in range(4)]
        sw.flush()
        for step in range(150):
            for k, p in enumerate(parts):
                if k + 1 < len(parts):
                    sw.prefetch(parts[k + 1], Tier.HOST)
                t = sw.acquire(p, Tier.HOST)  # may find p still WRITING: its bytes are on host meanwhile
                assert torch.all(t["a"] == step) and torch.all(t["b"] == step), (step, k)
                t["a"] += 1
                t["b"] += 1
                sw.release(p, dirty=True)
                sw.evict(p)  # write-back starts; the next step may acquire p before it ends
        for p in parts:
            sw.wait_idle(p)
            sw.evict(p).wait()
            assert torch.all(sw.acquire(p, Tier.HOST)["a"] == 150)
            sw.release(p)


class _GatedEngine:
    """Wraps an engine: reads (and with `writes`, writes) start on it at once, but report completion only once
    `open()` is called, so a test sees what the swapper has started while the earlier ones are still in flight."""

    def __init__(self, inner, *, writes: bool = False) -> None:
        self.inner = inner
        self.block_size, self.queue_depth = inner.block_size, inner.queue_depth
        self.reads: list[int] = []  # bytes of each read, in the order started
        self._held: list[tuple[object, object]] = []
        self._open = True
        self._gate_writes = writes
        self._lock = threading.Lock()

    def close_gate(self) -> None:
        self._open = False

    def open(self) -> None:
        with self._lock:
            self._open, held, self._held = True, self._held, []
        for real, proxy in held:
            real.add_done_callback(lambda f, p=proxy: p._chunk_done(f.exception()))

    def read_pieces(self, buf, pieces):
        real = self.inner.read_pieces(buf, pieces)
        with self._lock:
            self.reads.append(sum(p.length for p in pieces))
        return self._gated(real)

    def write_pieces(self, buf, pieces):
        real = self.inner.write_pieces(buf, pieces)
        return self._gated(real) if self._gate_writes else real

    def _gated(self, real):
        from tiermem.io.future import IOFuture

        with self._lock:
            if self._open:
                return real
            proxy = IOFuture(real.nbytes, 1)
            self._held.append((real, proxy))
            return proxy

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_reads_start_in_order_and_only_a_queues_worth_at_once(tmp_path) -> None:
    """[Note: reads in order]: with a queue's worth of 8 x 64 KiB, three 512 KiB reads asked for at once start
    one at a time, each when the one ahead completes (given the whole queue together they would share the
    drive and finish together); three 64 KiB reads all start at once; every byte arrives."""
    from tiermem.io.backends import create_engine

    with create_engine("auto", block_size=64 * KiB, queue_depth=8) as inner:
        engine = _GatedEngine(inner)
        with TensorSwapper(None, engine=engine, **{"device": "cpu", "nvme.paths": [str(tmp_path / "swap")],
                                                   "memory.host_budget": "8MiB"}) as sw:
            big = [torch.randn(128 * KiB, generator=torch.Generator().manual_seed(i)) for i in range(3)]  # 512 KiB
            small = [torch.randn(16 * KiB, generator=torch.Generator().manual_seed(9 + i)) for i in range(3)]
            parts = [sw.add(f"big{i}", {"w": t}, home="nvme") for i, t in enumerate(big)]
            parts += [sw.add(f"small{i}", {"w": t}, home="nvme") for i, t in enumerate(small)]
            for p in parts:
                sw.evict(p).wait()
            engine.close_gate()
            futures = [sw.prefetch(p, Tier.HOST) for p in parts[:3]]
            assert engine.reads == [512 * KiB]  # the others wait their turn
            engine.open()  # from here each completion starts the next
            for f in futures:
                assert f is not None
                f.wait()
            assert engine.reads == [512 * KiB] * 3
            engine.reads.clear()
            engine.close_gate()
            futures = [sw.prefetch(p, Tier.HOST) for p in parts[3:]]
            assert engine.reads == [64 * KiB] * 3  # 192 KiB in all: within one queue, all at once
            engine.open()
            for f in futures:
                assert f is not None
                f.wait()
            for p, t in zip(parts, big + small, strict=True):
                assert torch.equal(sw.acquire(p, Tier.HOST)["w"], t)
                sw.release(p, tier=Tier.HOST)


@pytest.mark.parametrize("how", ["parked", "not parked", "forgotten"])
def test_a_read_ahead_without_room_starts_when_a_write_back_frees_it(tmp_path, how: str) -> None:
    """[Note: parked read-aheads]: a read ahead that finds the pool held by a dirty partition starts that one's
    write-back and, parked, its own read once the write-back has freed the room, with nobody asking again;
    not parked, or forgotten before the write ends, it never starts; the bytes read are the partition's."""
    from tiermem.io.backends import create_engine

    with create_engine("auto", block_size=64 * KiB, queue_depth=8) as inner:
        engine = _GatedEngine(inner, writes=True)
        with TensorSwapper(None, engine=engine, **{"device": "cpu", "nvme.paths": [str(tmp_path / "swap")],
                                                   "memory.host_budget": "1MiB"}) as sw:
            data = [torch.randn(128 * KiB, generator=torch.Generator().manual_seed(i)) for i in range(3)]  # 512 KiB
            dirty, held, ahead = (sw.add(n, {"w": t}, home="nvme") for n, t in zip("abc", data, strict=True))
            for p in (dirty, held, ahead):
                sw.evict(p).wait()
            sw.acquire(dirty, Tier.HOST)["w"].add_(1.0)
            sw.release(dirty, dirty=True, tier=Tier.HOST)
            sw.acquire(held, Tier.HOST)  # the pool is full: `dirty` idle, `held` in use
            engine.close_gate()
            assert sw.prefetch(ahead, Tier.HOST, park=how != "not parked") is None  # `dirty`'s write has begun
            assert not sw.holds_host(ahead)
            if how == "forgotten":
                sw.forget_parked()
            engine.open()
            sw.wait_idle(dirty)  # its write is done, and what its completion started has started
            assert sw.holds_host(ahead) is (how == "parked")
            assert torch.equal(sw.acquire(ahead, Tier.HOST)["w"], data[2])
            sw.release(ahead, tier=Tier.HOST)
            sw.release(held, tier=Tier.HOST)
            assert torch.equal(sw.acquire(dirty, Tier.HOST)["w"], data[0] + 1.0)
            sw.release(dirty, tier=Tier.HOST)


def test_layout_outside_names_the_bytes_no_named_tensor_covers() -> None:
    """Layout.outside: the gaps that alignment leaves between tensors, the padding to 4 KiB, and the tensors
    not named, as byte ranges in order."""
    from tiermem.swap import Layout

    layout = Layout.of([("a", torch.empty(7)), ("b", torch.empty(5)), ("c", torch.empty(3))])
    a, b, c = layout.slots
    assert (a.offset, b.offset, c.offset) == (0, 64, 128)
    assert layout.outside({"a", "b", "c"}) == [(28, 64), (84, 128), (140, layout.size)]
    assert layout.outside({"a", "c"}) == [(28, 128), (140, layout.size)]
    assert layout.outside(set()) == [(0, layout.size)]
