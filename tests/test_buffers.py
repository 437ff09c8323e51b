"""Aligned host buffers and the buffer pool: alignment, zero-copy views, budget, no fragmentation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.errors import BudgetError
from tiermem.io.buffers import HUGE_PAGE, AlignedBuffer, HostBufferPool


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
        assert pool._free.holes == [(0, pool.nbytes)]
        assert pool.alloc(pool.nbytes).nbytes == pool.nbytes


def test_pinning_requires_cuda() -> None:
    """pin=True without CUDA is a clear error; the default quietly skips pinning on the CPU."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        with AlignedBuffer(1 << 20, pin=True) as buf:
            assert buf.pinned
        return
    with pytest.raises(RuntimeError, match="needs CUDA"):
        AlignedBuffer(1 << 20, pin=True)
    with AlignedBuffer(1 << 20) as buf:
        assert not buf.pinned


def test_long_lived_pieces_go_to_the_top() -> None:
    """from_top pieces fill the pool from its end, leaving the low room in one piece."""
    with HostBufferPool(1 << 20) as pool:
        low = pool.alloc(64 << 10)
        high = pool.alloc(64 << 10, from_top=True)
        assert low.offset == 0 and high.offset == pool.nbytes - (64 << 10)
        low.release()
        assert pool._free.largest() == pool.nbytes - (64 << 10)
