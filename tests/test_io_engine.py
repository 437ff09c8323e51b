"""The I/O engines: round trips, concurrency, errors and fallbacks, on real files."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tiermem.errors import IOEngineError
from tiermem.io import backends as backends_mod
from tiermem.io.backends import available_backends, create_engine
from tiermem.io.buffers import AlignedBuffer
from tiermem.io.engine import IOEngine, Piece, ReadPastEndError
from tiermem.io.files import IOFile

SIZES = [1, 511, 4096, 4097, 65536, 65536 * 3 + 123, 1 << 20, (1 << 20) + 4095]


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_sizes_aligned_buffers(engine: IOEngine, tmp_path, size: int) -> None:
    """Bytes written from an aligned buffer read back bit-exact, for tails that are not 4 KiB multiples."""
    with IOFile(tmp_path / "f.bin", "rw") as f, AlignedBuffer(size) as src, AlignedBuffer(size) as dst:
        assert f.direct
        src.numpy()[:size] = _random(size, size)
        assert engine.write(f, src.view, 0, size).wait() == size
        assert engine.read(f, dst.view, 0, size).wait() == size
        assert np.array_equal(src.numpy()[:size], dst.numpy()[:size])


@pytest.mark.parametrize("offset", [0, 4096, 12345, (1 << 20) - 1])
def test_round_trip_offsets_unaligned_python_buffers(engine: IOEngine, tmp_path, offset: int) -> None:
    """bytearray buffers at odd file offsets go through the buffered descriptor and still round-trip."""
    data = bytearray(_random(100_003, offset).tobytes())
    with IOFile(tmp_path / "f.bin", "rw") as f:
        engine.write(f, data, offset).wait()
        out = bytearray(len(data))
        engine.read(f, out, offset).wait()
        assert out == data
        assert f.size() == offset + len(data)


def test_hundreds_in_flight_complete_in_any_order(engine: IOEngine, tmp_path) -> None:
    """400 transfers queued at once on a depth-8 engine all finish, each with its own bytes."""
    n, piece = 400, 8192 + 17
    blob = _random(n * piece, 7)
    with IOFile(tmp_path / "many.bin", "rw") as f:
        order = list(range(n))
        random.Random(1).shuffle(order)
        futures = [engine.write(f, blob[i * piece:(i + 1) * piece], i * piece) for i in order]
        assert sum(fut.wait() for fut in futures) == n * piece
        out = np.zeros_like(blob)
        futures = [engine.read(f, out[i * piece:(i + 1) * piece], i * piece) for i in order]
        for fut in futures:
            fut.wait()
        assert np.array_equal(out, blob)


def test_several_files_and_directories_at_once(engine: IOEngine, tmp_path) -> None:
    """Transfers to files in several directories interleave without mixing their bytes."""
    files = []
    for d in range(3):
        os.mkdir(tmp_path / f"d{d}")
        files.append(IOFile(tmp_path / f"d{d}" / "x.bin", "rw"))
    try:
        blobs = [_random(300_000, 100 + d) for d in range(3)]
        futures = [engine.write(f, b) for f, b in zip(files, blobs, strict=True)]
        for fut in futures:
            fut.wait()
        outs = [np.zeros_like(b) for b in blobs]
        for fut in [engine.read(f, o) for f, o in zip(files, outs, strict=True)]:
            fut.wait()
        assert all(np.array_equal(o, b) for o, b in zip(outs, blobs, strict=True))
    finally:
        for f in files:
            f.close()


def test_torch_tensors_are_buffers(engine: IOEngine, tmp_path) -> None:
    """CPU tensors of any dtype are written and read in place, bfloat16 included."""
    torch = pytest.importorskip("torch")
    src = torch.randn(1000, 37).to(torch.bfloat16)
    dst = torch.empty_like(src)
    with IOFile(tmp_path / "t.bin", "rw") as f:
        engine.write(f, src).wait()
        engine.read(f, dst).wait()
    assert torch.equal(src, dst)


def test_fixed_buffers_registered_and_used(tmp_path) -> None:
    """io_uring registers the pool as fixed buffers; I/O inside and outside them is correct."""
    if available_backends()["io_uring"]:
        pytest.skip(f"io_uring: {available_backends()['io_uring']}")
    with create_engine("io_uring", block_size=1 << 20, queue_depth=4) as eng, AlignedBuffer(4 << 20) as reg, \
            AlignedBuffer(4 << 20) as other, IOFile(tmp_path / "fx.bin", "rw") as f:
        assert eng.register_buffers([(reg.address, reg.nbytes)])
        reg.numpy()[:] = _random(reg.nbytes, 3)
        eng.write(f, reg.view).wait()  # 4 chunks inside the registered buffer
        assert eng.core_stats()["fixed_chunks"] == 4  # type: ignore[attr-defined]
        eng.read(f, other.view).wait()  # 4 outside it
        assert eng.core_stats()["fixed_chunks"] == 4  # type: ignore[attr-defined]
        assert np.array_equal(reg.numpy(), other.numpy())
        other.numpy()[:] = _random(other.nbytes, 4)
        eng.write(f, other.view).wait()
        eng.read(f, reg.view).wait()
        assert eng.core_stats()["fixed_chunks"] == 8  # type: ignore[attr-defined]
        assert np.array_equal(reg.numpy(), other.numpy())


def test_sqpoll_mode_round_trip(tmp_path) -> None:
    """With SQPOLL the kernel thread submits; data still round-trips."""
    if available_backends()["io_uring"]:
        pytest.skip(f"io_uring: {available_backends()['io_uring']}")
    try:
        eng = create_engine("io_uring", block_size=64 << 10, queue_depth=16, sqpoll=True)
    except OSError as exc:
        pytest.skip(f"SQPOLL refused here: {exc}")
    with eng, IOFile(tmp_path / "sq.bin", "rw") as f, AlignedBuffer(1 << 20) as a, AlignedBuffer(1 << 20) as b:
        a.numpy()[:] = _random(a.nbytes, 9)
        eng.write(f, a.view).wait()
        eng.read(f, b.view).wait()
        assert np.array_equal(a.numpy(), b.numpy())


def test_io_uring_batches_submissions(tmp_path) -> None:
    """Many chunks queued together go to the kernel in far fewer submit calls than chunks."""
    if available_backends()["io_uring"]:
        pytest.skip(f"io_uring: {available_backends()['io_uring']}")
    with create_engine("io_uring", block_size=4096, queue_depth=32) as eng, AlignedBuffer(4 << 20) as buf, \
            IOFile(tmp_path / "b.bin", "rw") as f:
        eng.write(f, buf.view).wait()  # 1024 chunks in one call
        assert eng.submits < 1024 // 2  # type: ignore[attr-defined]


def test_io_uring_deep_queue_with_trickling_callers(tmp_path) -> None:
    """A deep queue that is more than half full sleeps for several completions; transfers queued by other
    threads meanwhile (which do not wake it) and a lone transfer afterwards (which must) all finish."""
    if available_backends()["io_uring"]:
        pytest.skip(f"io_uring: {available_backends()['io_uring']}")
    with create_engine("io_uring", block_size=4096, queue_depth=64) as eng, AlignedBuffer(8 << 20) as big, \
            AlignedBuffer(64 * 4096) as small, IOFile(tmp_path / "t.bin", "rw") as f:
        big.numpy()[:] = _random(big.nbytes, 5)
        eng.write(f, big.view).wait()
        errors: list[BaseException] = []

        def trickle(k: int) -> None:
            try:
                for i in range(16):
                    piece = small.view[(k * 16 + i) * 4096:(k * 16 + i + 1) * 4096]
                    eng.read(f, piece, (k * 16 + i) * 4096).wait(timeout=30)
            except BaseException as exc:  # reported below
                errors.append(exc)

        out = AlignedBuffer(8 << 20)
        with out:
            whole = eng.read(f, out.view)  # 2048 chunks keep the ring full
            threads = [threading.Thread(target=trickle, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert whole.wait(timeout=30) == big.nbytes
            assert not errors
            assert np.array_equal(out.numpy(), big.numpy())
            assert np.array_equal(small.numpy(), big.numpy()[:64 * 4096])
            lone = AlignedBuffer(4096)
            with lone:
                eng.read(f, lone.view, 4096).wait(timeout=30)  # on an idle ring: the eventfd must wake it
                assert np.array_equal(lone.numpy(), big.numpy()[4096:8192])


# -- errors -------------------------------------------------------------------------------------
def test_missing_directory_names_the_path(tmp_path) -> None:
    """Opening a file in a directory that does not exist raises FileNotFoundError with the path."""
    path = tmp_path / "nope" / "f.bin"
    with pytest.raises(FileNotFoundError) as info:
        IOFile(path, "rw")
    assert str(path) in str(info.value)


def test_permission_denied_names_the_path() -> None:
    """An unprivileged process opening a 0600 file of root's gets PermissionError naming the file."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file another user cannot open")
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(dir="/var/tmp", prefix="tiermem-perm-")
    try:
        os.chmod(folder, 0o755)  # others may enter the folder; only the file itself is closed to them
        path = os.path.join(folder, "secret.bin")
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        os.chmod(path, 0o600)
        script = textwrap.dedent(f"""
            import os
            from tiermem.io.files import IOFile
            os.setgid(65534); os.setuid(65534)
            try:
                IOFile({path!r}, "r")
            except PermissionError as exc:
                print("denied", exc)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
        assert out.startswith("denied") and path in out
    finally:
        shutil.rmtree(folder)


def test_read_past_end_is_a_clear_error(engine: IOEngine, tmp_path) -> None:
    """Reading beyond the end raises ReadPastEndError naming the file, offset and its size."""
    with IOFile(tmp_path / "short.bin", "rw") as f:
        engine.write(f, bytearray(10_000)).wait()
        with pytest.raises(ReadPastEndError) as info:
            engine.read(f, bytearray(8192), 8192).wait()
    msg = str(info.value)
    assert "short.bin" in msg and "offset" in msg and "10000 bytes" in msg


def test_write_to_read_only_file_names_the_file(engine: IOEngine, tmp_path) -> None:
    """A write on a file opened read-only fails with OSError(EBADF) carrying the path."""
    (tmp_path / "ro.bin").write_bytes(b"\0" * 4096)
    with IOFile(tmp_path / "ro.bin", "r") as f:
        with pytest.raises(OSError) as info:
            engine.write(f, bytearray(4096)).wait()
    assert info.value.filename == str(tmp_path / "ro.bin")
    assert "write of 4096 bytes at offset 0" in str(info.value)


def test_a_request_of_pieces_in_several_files_is_one_future(engine: IOEngine, tmp_path) -> None:
    """read_pieces/write_pieces move pieces of one buffer to and from several files (odd sizes, unaligned
    places) and complete one future carrying the request's byte count."""
    data = _random(300_000, 7)
    with IOFile(tmp_path / "a.bin", "rw") as a, IOFile(tmp_path / "b.bin", "rw") as b:
        pieces = [Piece(a, 0, 100_000, 0), Piece(b, 8192, 150_001, 100_000), Piece(a, 1 << 20, 49_999, 250_001)]
        assert engine.write_pieces(data, pieces).wait() == 300_000
        out = np.zeros_like(data)
        assert engine.read_pieces(out, pieces).wait() == 300_000
        assert np.array_equal(out, data)
        assert engine.read_pieces(out, []).wait() == 0


def test_a_failed_piece_names_its_own_file_and_offset(engine: IOEngine, tmp_path) -> None:
    """In a request over two files, the error of the piece that failed names that file and its offset."""
    (tmp_path / "ro.bin").write_bytes(b"\0" * 16384)
    with IOFile(tmp_path / "rw.bin", "rw") as good, IOFile(tmp_path / "ro.bin", "r") as bad:
        with pytest.raises(OSError) as info:
            engine.write_pieces(bytearray(16384), [Piece(good, 0, 8192, 0), Piece(bad, 4096, 8192, 8192)]).wait()
    assert info.value.filename == str(tmp_path / "ro.bin")
    assert "write of 8192 bytes at offset 4096" in str(info.value)


def test_queue_beyond_depth_waits_instead_of_failing(tmp_path) -> None:
    """A depth-1 engine given 50 transfers at once queues them; none fails with a full queue."""
    for name in [b for b, r in available_backends().items() if r is None]:
        with create_engine(name, block_size=4096, queue_depth=1) as eng, IOFile(tmp_path / f"{name}.bin", "rw") as f:
            futures = [eng.write(f, bytes([i]) * 4096, i * 4096) for i in range(50)]
            assert all(fut.wait() == 4096 for fut in futures)
            out = bytearray(50 * 4096)
            eng.read(f, out).wait()
            assert all(out[i * 4096] == i for i in range(50))


def test_bad_arguments_are_refused_up_front(engine: IOEngine, tmp_path) -> None:
    """Negative offsets, oversize nbytes and read-only destination buffers raise ValueError at once."""
    with IOFile(tmp_path / "a.bin", "rw") as f:
        with pytest.raises(ValueError, match="offset"):
            engine.write(f, bytearray(10), -1)
        with pytest.raises(ValueError, match="does not fit"):
            engine.write(f, bytearray(10), 0, 11)
        with pytest.raises(ValueError, match="read-only"):
            engine.read(f, b"immutable")


def test_engine_settings_are_checked() -> None:
    """block_size and queue_depth are validated with the config key in the message."""
    with pytest.raises(IOEngineError, match="io.block_size"):
        create_engine("threads", block_size=1000)
    with pytest.raises(IOEngineError, match="io.queue_depth"):
        create_engine("threads", queue_depth=0)
    with pytest.raises(IOEngineError, match="io.engine"):
        create_engine("libaio")
    with pytest.raises(IOEngineError, match="io.sqpoll"):
        create_engine("threads", sqpoll=True)


def test_closed_engine_refuses_work(backend: str, tmp_path) -> None:
    """After close(), new transfers raise IOEngineError instead of hanging."""
    eng = create_engine(backend)
    eng.close()
    with IOFile(tmp_path / "c.bin", "rw") as f, pytest.raises(IOEngineError, match="closed"):
        eng.write(f, bytearray(4096))


# -- fallbacks ----------------------------------------------------------------------------------
def test_io_uring_forced_off_falls_back_to_threads(monkeypatch, caplog) -> None:
    """With io_uring disabled, auto picks threads with one warning; asking for io_uring explains why not."""
    monkeypatch.setenv("TIERMEM_DISABLE_IO_URING", "1")
    monkeypatch.setattr(backends_mod, "_probe_result", {})
    monkeypatch.setattr(backends_mod, "_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="tiermem.io.backends"):
        with create_engine("auto") as eng:
            assert eng.name == "threads"
        with create_engine("auto"):
            pass
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "TIERMEM_DISABLE_IO_URING" in caplog.records[0].getMessage()
    with pytest.raises(IOEngineError, match="io_uring is not usable here.*TIERMEM_DISABLE_IO_URING"):
        create_engine("io_uring")
    monkeypatch.setattr(backends_mod, "_probe_result", {})


def test_o_direct_refused_falls_back_to_buffered(engine: IOEngine, ramfs_dir: str, caplog) -> None:
    """On ramfs (no O_DIRECT) the file opens buffered with a warning naming the filesystem, and works."""
    with caplog.at_level(logging.WARNING, logger="tiermem.io.files"):
        f = IOFile(os.path.join(ramfs_dir, "x.bin"), "rw")
    with f, AlignedBuffer(1 << 20) as a, AlignedBuffer(1 << 20) as b:
        assert not f.direct
        assert f.fallback_reason and "ramfs" in f.fallback_reason
        a.numpy()[:] = _random(a.nbytes, 5)
        engine.write(f, a.view).wait()
        engine.read(f, b.view).wait()
        assert np.array_equal(a.numpy(), b.numpy())
    assert any("O_DIRECT" in r.getMessage() for r in caplog.records)


def test_direct_false_opens_buffered(engine: IOEngine, tmp_path) -> None:
    """direct=False is honoured (no O_DIRECT) and reports no fallback reason."""
    with IOFile(tmp_path / "b.bin", "rw", direct=False) as f:
        assert not f.direct and f.fallback_reason is None
        engine.write(f, b"abc" * 5000).wait()
        out = bytearray(15000)
        engine.read(f, out).wait()
        assert out == b"abc" * 5000


def test_package_builds_and_imports_without_liburing(tmp_path) -> None:
    """A build without the io_uring core imports, and `tiermem info` says why io_uring is unusable."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TIERMEM_NO_URING="1")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), root],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr
    wheels = [w for w in os.listdir(tmp_path) if w.endswith(".whl")]
    assert len(wheels) == 1
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(tmp_path / wheels[0]), str(site)], check=True)
    assert not any(n.endswith(".so") for _, _, files in os.walk(site) for n in files)
    out = subprocess.run(
        [sys.executable, "-m", "tiermem", "info"], capture_output=True, text=True, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(site)),
    )
    assert out.returncode == 0, out.stderr
    assert "io_uring  no: the native io_uring core is not built" in out.stdout
    assert "threads   yes" in out.stdout


def test_a_raising_callback_does_not_stop_the_engine(engine: IOEngine, tmp_path, caplog) -> None:
    """An exception in a done-callback is logged; later callbacks and later transfers still complete."""
    seen: list[int] = []

    def bad(_fut: object) -> None:
        raise RuntimeError("callback bug")

    with IOFile(tmp_path / "cb.bin", "rw") as f, AlignedBuffer(1 << 20) as buf, \
            caplog.at_level(logging.ERROR, logger="tiermem.io.future"):
        for _ in range(3):
            fut = engine.write(f, buf.view)
            fut.add_done_callback(bad)
            fut.add_done_callback(lambda done: seen.append(done.nbytes))
            fut.wait()
        deadline = time.monotonic() + 10  # the callbacks run on the engine's thread, maybe after wait() returns
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [1 << 20] * 3
        assert engine.read(f, buf.view).wait() == 1 << 20
    assert "callback raised" in caplog.text


def test_close_while_other_threads_queue_work(backend: str, tmp_path) -> None:
    """Closing while four threads keep queueing: each queued transfer completes or is refused with a clear
    error; nothing crashes or hangs."""
    eng = create_engine(backend, block_size=64 << 10, queue_depth=8)
    outcomes: list[str] = []
    first = threading.Event()
    with IOFile(tmp_path / "c.bin", "rw") as f:
        bufs = [AlignedBuffer(256 << 10) for _ in range(4)]

        def worker(buf: AlignedBuffer) -> None:
            for _ in range(200):
                try:
                    eng.write(f, buf.view).wait(timeout=30)
                    outcomes.append("ok")
                    first.set()
                except (OSError, IOEngineError) as exc:
                    assert "closed" in str(exc)
                    outcomes.append("refused")
                    return

        threads = [threading.Thread(target=worker, args=(b,)) for b in bufs]
        for t in threads:
            t.start()
        assert first.wait(timeout=60)  # close while the workers are mid-stream, not before they start
        eng.close()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()
        for b in bufs:
            b.close()
    assert "ok" in outcomes and outcomes.count("refused") <= 4


def test_io_uring_register_from_a_completion_callback(tmp_path) -> None:
    """register_buffers called on the engine's own thread (from a callback) runs there instead of waiting
    for that thread forever."""
    if available_backends()["io_uring"]:
        pytest.skip(f"io_uring: {available_backends()['io_uring']}")
    with create_engine("io_uring", block_size=64 << 10, queue_depth=4) as eng, AlignedBuffer(1 << 20) as buf, \
            IOFile(tmp_path / "r.bin", "rw") as f:
        result: list[bool] = []
        eng.write(f, buf.view).add_done_callback(
            lambda _fut: result.append(eng.register_buffers([(buf.address, buf.nbytes)])))
        for _ in range(500):
            if result:
                break
            time.sleep(0.01)
        assert result == [True]
        eng.write(f, buf.view).wait()
        assert eng.core_stats()["fixed_chunks"] == 16  # type: ignore[attr-defined]
