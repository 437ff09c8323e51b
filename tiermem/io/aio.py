"""The asyncio face of the engines, for users inside an event loop.

Swap transfers stay on the engine (io_uring or threads) and are awaited through `AsyncEngine`; the
event loop is never blocked. Small buffered files that sit beside swap data (manifests, indexes) are
read and written with aiofiles, and written atomically (temporary file, fsync, rename).

Example::

    async def main():
        with create_engine() as engine, IOFile(path, "rw") as f:
            aengine = AsyncEngine(engine)
            await aengine.write(f, buf)
            await aengine.read(f, out)
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiofiles
import aiofiles.os

from tiermem.io.engine import IOEngine
from tiermem.io.files import IOFile
from tiermem.io.future import IOFuture


def wrap_future(future: IOFuture, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[int]:
    """An asyncio future that resolves (on `loop`) when the engine future does."""
    loop = loop or asyncio.get_running_loop()
    result: asyncio.Future[int] = loop.create_future()

    def settle(done: IOFuture) -> None:
        if result.done():  # cancelled by the awaiting task; the transfer itself still finished
            return
        error = done.exception()
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(done.nbytes)

    def hand_over(done: IOFuture) -> None:  # runs on the engine's thread
        loop.call_soon_threadsafe(settle, done)

    future.add_done_callback(hand_over)
    return result


class AsyncEngine:
    """Awaitable reads and writes over an IOEngine; many may be awaited at once (asyncio.gather)."""

    def __init__(self, engine: IOEngine) -> None:
        self.engine = engine

    async def read(self, file: IOFile, buf: Any, offset: int = 0, nbytes: int | None = None) -> int:
        """Read into `buf` like IOEngine.read; returns the byte count."""
        return await wrap_future(self.engine.read(file, buf, offset, nbytes))

    async def write(self, file: IOFile, buf: Any, offset: int = 0, nbytes: int | None = None) -> int:
        """Write from `buf` like IOEngine.write; returns the byte count."""
        return await wrap_future(self.engine.write(file, buf, offset, nbytes))


async def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """Read a small metadata file without blocking the loop."""
    async with aiofiles.open(path, "rb") as f:
        return await f.read()


async def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write a small metadata file so that readers see the old or the new content, never a torn one."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    async with aiofiles.open(tmp, "wb") as f:
        await f.write(data)
        await f.flush()
        await asyncio.to_thread(os.fsync, f.fileno())
    await aiofiles.os.replace(tmp, path)
