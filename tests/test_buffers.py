"""Aligned host buffers and the buffer pool: alignment, zero-copy views, budget, no fragmentation."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.errors import BudgetError
from tiermem.freelist import FreeList, plan_moves
from tiermem.io import buffers
from tiermem.io.buffers import CUDA_HOST_REGISTER_PORTABLE, HUGE_PAGE, AlignedBuffer, HostBufferPool
from tiermem.swap import room_needed


class TorchCudart:
    """torch.cuda.cudart() where no GPU exists, as torch binds it (no cudaGetLastError); registering returns `error`."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.calls: list[tuple[Any, ...]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


class FakeCudart(TorchCudart):
    """A cudart that also binds cudaGetLastError."""

    def cudaGetLastError(self) -> int:  # noqa: N802
        self.calls.append(("get_last_error",))
        return 0


def fake_cuda(monkeypatch: pytest.MonkeyPatch, cudart: TorchCudart) -> TorchCudart:
    """Make torch see CUDA, with `cudart` as its runtime bindings."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


def test_buffer_is_huge_page_aligned_and_zeroed() -> None:
    """Buffers start on a 2 MiB boundary, round up to 4 KiB, and start zeroed."""
    with AlignedBuffer(5000) as buf:
        assert buf.address % HUGE_PAGE == 0
        assert buf.nbytes == 8192
        assert not buf.numpy().any()


def test_tensor_and_numpy_views_share_memory() -> None:
    """tensor() and numpy() are views: a write through one is seen by the other, no copy."""
    torch = pytest.importorskip("torch")
    with AlignedBuffer(1 << 20) as buf:
        t = buf.tensor()
        assert t.data_ptr() == buf.address
        t[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert list(buf.numpy()[:4]) == [1, 2, 3, 4]
        f32 = t.view(torch.float32)
        f32[1] = 1.5
        assert buf.numpy()[4:8].view(np.float32)[0] == 1.5


def test_pool_allocations_are_aligned_and_disjoint() -> None:
    """Pool pieces are 4 KiB aligned and never overlap."""
    with HostBufferPool(1 << 20) as pool:
        pieces = [pool.alloc(n) for n in (1, 4096, 10_000, 100_000)]
        assert all(p.address % 4096 == 0 for p in pieces)
        spans = sorted((p.offset, p.offset + p.nbytes) for p in pieces)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert pool.used == sum(p.nbytes for p in pieces)


def test_pool_over_budget_names_sizes_and_fix() -> None:
    """A request larger than what is free raises BudgetError with the sizes and the config keys to change."""
    with HostBufferPool(1 << 20) as pool:
        pool.alloc(768 << 10)
        with pytest.raises(BudgetError) as info:
            pool.alloc(512 << 10)
    msg = str(info.value)
    assert "512 KiB" in msg and "256 KiB free" in msg and "memory.host_budget" in msg


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 200_000)), max_size=60))
def test_pool_never_exceeds_budget_and_merges_on_free(ops: list[tuple[bool, int]]) -> None:
    """Under random alloc/free sequences: used <= size, peak is the max of used, and freeing all merges back."""
    with HostBufferPool(1 << 20) as pool:
        live, peak = [], 0
        for is_alloc, n in ops:
            if is_alloc or not live:
                try:
                    live.append(pool.alloc(n))
                except BudgetError:
                    pass
            else:
                live.pop(n % len(live)).release()
            assert 0 <= pool.used <= pool.nbytes
            peak = max(peak, pool.used)
        assert pool.peak == peak
        for piece in live:
            piece.release()
        assert pool.used == 0
        assert pool._free["main"].holes == [(0, pool.nbytes)]
        assert pool.alloc(pool.nbytes).nbytes == pool.nbytes


def test_alloc_at_takes_only_a_free_range() -> None:
    """alloc_at hands out the piece at the offset asked for when that range is free, else None."""
    with HostBufferPool(1 << 20) as pool:
        low = pool.alloc(256 << 10)
        assert pool.alloc_at(128 << 10, 4096) is None  # inside `low`
        piece = pool.alloc_at(512 << 10, 8192)
        assert piece is not None and piece.offset == 512 << 10 and pool.used == (256 << 10) + 8192
        assert pool.holes() == [(256 << 10, 256 << 10), ((512 << 10) + 8192, (512 << 10) - 8192)]
        assert pool.alloc_at((1 << 20) - 4096, 8192) is None  # runs past the end
        piece.release()
        low.release()
        assert pool.holes() == [(0, 1 << 20)]


def _layout(draw: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """A space of consecutive ranges, each free, movable or held: (holes, movable, held), in 4 KiB units."""
    kinds = draw(st.lists(st.tuples(st.sampled_from("fmh"), st.integers(1, 12)), min_size=1, max_size=24))
    free = FreeList()
    movable, held, at = [], [], 0
    for kind, n in kinds:
        if kind == "f":
            free.give(at, n)
        else:
            (movable if kind == "m" else held).append((at, n))
        at += n
    return free.holes, movable, held


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_plan_moves_frees_one_range_by_moving_only_movable_pieces_into_holes(data: st.DataObject) -> None:
    """Applying plan_moves' moves leaves a free range of the size asked for; each piece moved is movable and
    lands in a hole; nothing overlaps. A plan is found whenever the holes alone hold the size in one piece."""
    holes, movable, held = _layout(data.draw)
    size = data.draw(st.integers(1, 40))
    plan = plan_moves(holes, movable, size)
    if max((n for _, n in holes), default=0) >= size:
        assert plan is not None
    if plan is None:
        return
    sizes = dict(movable)
    free = FreeList()
    for s, n in holes:
        free.give(s, n)
    assert len({src for src, _ in plan}) == len(plan)
    for src, dest in plan:
        assert src in sizes and free.take_at(dest, sizes[src])  # into a hole, not over anything
    for src, _ in plan:
        free.give(src, sizes[src])
    assert free.largest() >= size
    taken = sorted([(d, sizes[s]) for s, d in plan] + [m for m in movable if m[0] not in dict(plan)] + held)
    assert all(a + n <= b for (a, n), (b, _) in zip(taken, taken[1:], strict=False))


def test_plan_moves_gives_up_when_held_pieces_split_every_run() -> None:
    """No run of free and movable ranges reaches the size: no plan, even though enough bytes are free."""
    holes = [(0, 3), (4, 3), (8, 3)]
    held = [(3, 1), (7, 1)]
    assert sum(n for _, n in holes) >= 5 and len(held) == 2
    assert plan_moves(holes, [], 5) is None
    assert plan_moves(holes, [(11, 2)], 5) == [(11, 0)]  # (8..13) with the piece at 11 moved into 0..3


def test_pinning_requires_cuda(caplog: pytest.LogCaptureFixture) -> None:
    """pin=True or pin(required=True) without CUDA is a clear error; pin() warns and returns False."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        with AlignedBuffer(1 << 20, pin=True) as buf:
            assert buf.pinned
        return
    with pytest.raises(RuntimeError, match="needs CUDA"):
        AlignedBuffer(1 << 20, pin=True)
    with HostBufferPool(1 << 20) as pool:
        assert not pool.pinned
        with pytest.raises(RuntimeError, match="needs CUDA"):
            pool.pin(required=True)
        with caplog.at_level(logging.WARNING, logger=buffers.__name__):
            assert pool.pin() is False
        assert "CUDA is not available" in caplog.text and not pool.pinned


def test_default_never_pins_even_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA present, a buffer or pool built with default arguments is not page-locked."""
    cudart = fake_cuda(monkeypatch, FakeCudart())
    with AlignedBuffer(1 << 20) as buf, HostBufferPool(1 << 20) as pool:
        assert not buf.pinned and not pool.pinned
    assert cudart.calls == []


def test_pin_registers_portable_once_and_close_unregisters(monkeypatch: pytest.MonkeyPatch) -> None:
    """pool.pin() registers the whole pool once with cudaHostRegisterPortable (1); close() unregisters it."""
    cudart = fake_cuda(monkeypatch, FakeCudart())
    pool = HostBufferPool(1 << 20)
    piece = pool.alloc(4096)  # pieces handed out before pinning stay valid: the memory does not move
    assert pool.pin() is True and pool.pin() is True and pool.pinned
    assert CUDA_HOST_REGISTER_PORTABLE == 1
    assert cudart.calls == [("register", pool.buffer.address, pool.nbytes, 1)]
    piece.release()
    pool.close()
    pool.close()
    assert cudart.calls[1:] == [("unregister", pool.buffer.address)] and not pool.pinned
    with pytest.raises(ValueError, match="closed"):
        pool.pin()


def test_pin_at_construction_is_portable(monkeypatch: pytest.MonkeyPatch) -> None:
    """AlignedBuffer(pin=True) registers at once, with the portable flag."""
    cudart = fake_cuda(monkeypatch, FakeCudart())
    with AlignedBuffer(5000, pin=True) as buf:
        assert buf.pinned
        assert cudart.calls == [("register", buf.address, 8192, CUDA_HOST_REGISTER_PORTABLE)]


def test_failed_registration_clears_cudas_last_error(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A refused cudaHostRegister is followed by cudaGetLastError, warns (raises if required), is not unregistered."""
    cudart = fake_cuda(monkeypatch, FakeCudart(error=2))  # cudaErrorMemoryAllocation
    with HostBufferPool(1 << 20) as pool:
        with caplog.at_level(logging.WARNING, logger=buffers.__name__):
            assert pool.pin() is False
        assert "CUDA error 2" in caplog.text and not pool.pinned
        assert cudart.calls == [("register", pool.buffer.address, pool.nbytes, 1), ("get_last_error",)]
        with pytest.raises(RuntimeError, match="CUDA error 2.*ulimit -l"):
            pool.pin(required=True)
        assert cudart.calls[-1] == ("get_last_error",)
    assert [c[0] for c in cudart.calls] == ["register", "get_last_error"] * 2


def test_error_cleared_through_loaded_libcudart_without_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's bindings have no cudaGetLastError: the error is cleared through the loaded libcudart instead."""
    cudart = fake_cuda(monkeypatch, TorchCudart(error=712))
    cleared: list[int] = []
    monkeypatch.setattr(buffers, "_loaded_cudart_get_last_error", lambda: lambda: cleared.append(1))
    with HostBufferPool(1 << 20) as pool:
        assert pool.pin() is False
    assert cleared == [1] and [c[0] for c in cudart.calls] == ["register"]


def test_loaded_library_lookup_never_loads_a_new_copy() -> None:
    """The libcudart fallback's lookup finds functions of loaded libraries (libc) only, loading nothing."""
    getpid = buffers._loaded_library_function("libc.so", "getpid")
    assert getpid is not None and getpid() == os.getpid()
    assert buffers._loaded_library_function("libtiermem-not-loaded", "getpid") is None


def test_long_lived_pieces_go_to_the_top() -> None:
    """from_top pieces fill the pool from its end, leaving the low room in one piece."""
    with HostBufferPool(1 << 20) as pool:
        low = pool.alloc(64 << 10)
        high = pool.alloc(64 << 10, from_top=True)
        assert low.offset == 0 and high.offset == pool.nbytes - (64 << 10)
        low.release()
        assert pool.largest_free() == pool.nbytes - (64 << 10)


def test_an_arena_is_apart_from_the_rest() -> None:
    """Pieces of an arena come from its own bottom range and never from the rest, nor the rest from it."""
    with HostBufferPool(1 << 20) as pool:
        pool.add_arena("activations", 256 << 10)
        assert pool.arena_bytes == {"main": 768 << 10, "activations": 256 << 10}
        act = [pool.alloc(64 << 10, arena="activations") for _ in range(4)]
        assert all(a.offset < (256 << 10) and a.arena == "activations" for a in act)
        with pytest.raises(BudgetError, match="arena 'activations'"):
            pool.alloc(4096, arena="activations")
        main = pool.alloc(768 << 10)
        assert main.offset == 256 << 10 and pool.largest_free() == 0
        act[1].release()
        assert pool.largest_free("activations") == 64 << 10 and pool.largest_free() == 0
        with pytest.raises(ValueError, match="arena"):
            pool.add_arena("late", 4096)  # only before anything is handed out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=4), st.lists(st.integers(1, 64), max_size=30),
       st.randoms(use_true_random=False))
def test_room_needed_fits_whatever_the_placement(sizes: list[int], filler: list[int], rnd: Any) -> None:
    """Pieces of `sizes` (in 4 KiB pages), taken in order and held, always fit an arena of room_needed(sizes),
    wherever earlier pieces left the held ones: fill the arena with evictable pieces, take each piece in
    whatever hole first-fit gives it, then evict everything not held before taking the next, the worst an
    evicting cache can face."""
    page = 4096
    need = room_needed([s * page for s in sizes])
    with HostBufferPool(need) as pool:
        held = []
        for size in sizes:
            others = []
            for n in filler:  # evictable pieces scattered around the held ones
                try:
                    others.append(pool.alloc(n * page, from_top=rnd.random() < 0.5))
                except BudgetError:
                    break
            rnd.shuffle(others)
            while True:
                try:
                    held.append(pool.alloc(size * page))
                    break
                except BudgetError:
                    assert others, f"{size} pages did not fit with only held pieces left: {pool._free['main'].holes}"
                    others.pop().release()  # evict one, in an order unrelated to placement
            for piece in others:
                piece.release()
