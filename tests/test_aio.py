"""The asyncio face: awaitable engine transfers and atomic metadata files."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from tiermem.io.aio import AsyncEngine, read_bytes, write_bytes_atomic
from tiermem.io.engine import IOEngine, ReadPastEndError
from tiermem.io.files import IOFile


def test_awaited_transfers_round_trip_concurrently(engine: IOEngine, tmp_path) -> None:
    """Fifty reads awaited with asyncio.gather each get their own bytes, and the loop stays free."""
    blob = np.random.default_rng(0).integers(0, 256, 50 * 10_000, dtype=np.uint8)

    async def run() -> tuple[np.ndarray, int]:
        aengine = AsyncEngine(engine)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.create_task(ticker())
        with IOFile(tmp_path / "a.bin", "rw") as f:
            await aengine.write(f, blob)
            out = np.zeros_like(blob)
            sizes = await asyncio.gather(*[
                aengine.read(f, out[i * 10_000:(i + 1) * 10_000], i * 10_000) for i in range(50)
            ])
        tick_task.cancel()
        assert sizes == [10_000] * 50
        return out, ticks

    out, ticks = asyncio.run(run())
    assert np.array_equal(out, blob)
    assert ticks > 0  # the loop ran other work while transfers were in flight


def test_awaited_errors_are_raised_in_the_task(engine: IOEngine, tmp_path) -> None:
    """An engine error surfaces from the await, not on another thread."""
    async def run() -> None:
        with IOFile(tmp_path / "s.bin", "rw") as f:
            await AsyncEngine(engine).write(f, b"x" * 100)
            await AsyncEngine(engine).read(f, bytearray(4096), 8192)

    with pytest.raises(ReadPastEndError):
        asyncio.run(run())


def test_metadata_written_atomically(tmp_path) -> None:
    """write_bytes_atomic replaces the file whole and leaves no temporary file behind."""
    path = tmp_path / "manifest.json"
    path.write_bytes(b"old")

    async def run() -> bytes:
        await write_bytes_atomic(path, b'{"new": true}')
        return await read_bytes(path)

    assert asyncio.run(run()) == b'{"new": true}'
    assert os.listdir(tmp_path) == ["manifest.json"]
