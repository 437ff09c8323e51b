"""Streaming safetensors checkpoints straight into partitions, one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor name to
its dtype, shape and byte range, then the raw bytes. Reading a tensor is one positioned read of its
range into its slot in the partition; nothing else of the file is held in memory, so a model larger
than host RAM loads with memory bounded by the host budget. A sharded checkpoint is a
`*.safetensors.index.json` whose `weight_map` names the file holding each tensor.

The writer computes a CRC-32 (zlib) of the header and of each tensor's bytes as it writes them, and the
reader can compute the same from the file (`checksums`), so a caller that stored the writer's values
(tiermem/checkpointing.py keeps them in a manifest) can tell a damaged file before it loads anything.

Every file is opened by `open_regular` ([Note: opening files that others made] in tiermem/io/files.py): a
FIFO, device, directory or socket under a shard's name is refused without blocking, and an index may name
only plain file names beside it. Symlinks are followed where the reader is made with `follow_links` (the
default: the Hugging Face cache's snapshot folders are symlinks into its blob store), never by
`load_checkpoint`, whose files tiermem wrote itself.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.device import check_host
from tiermem.errors import CheckpointError
from tiermem.io.buffers import ALIGN, AlignedBuffer
from tiermem.io.engine import IOEngine
from tiermem.io.files import IOFile, open_regular

_NAMES = {}  # torch dtype -> safetensors name, filled below
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES.update({v: k for k, v in _DTYPES.items()})
MAX_HEADER = 100 << 20
MAX_JSON = 64 << 20  # the most read of an index (or of a checkpoint's other JSON files): megabytes at most
CHUNK = 4 << 20  # bytes per read when checksumming a file


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are: file, byte offset, length, dtype and shape."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SafetensorsCheckpoint:
    """The tensor index of a safetensors file or sharded index, and reads of single tensors."""

    def __init__(self, path: str | os.PathLike[str], *, follow_links: bool = True) -> None:
        """`path`: a .safetensors file or a *.safetensors.index.json. Without `follow_links`, neither it nor a
        shard may be a symbolic link (a checkpoint tiermem wrote)."""
        self.path = os.fspath(path)
        if not os.path.lexists(self.path):
            raise CheckpointError(f"checkpoint {self.path} does not exist; pass the path of a .safetensors file "
                                  "or of a *.safetensors.index.json")
        self.follow_links = follow_links  # whether the files may be symlinks (to regular files)
        self.entries: dict[str, Entry] = {}
        self.shards: dict[str, dict[str, Entry]] = {}  # file path -> the tensors its header lists
        self.header_crc32: dict[str, int] = {}  # file path -> CRC-32 of its length field and header
        self.metadata: dict[str, dict[str, str]] = {}  # file path -> its header's "__metadata__"
        if self.path.endswith(".json"):
            index = _load_json(self.path, follow_links)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{self.path}: no 'weight_map' object; is this a safetensors index?")
            bad = [f for f in weight_map.values() if not plain_name(f)]
            if bad:  # before any shard is opened
                raise CheckpointError(f"{self.path}: the weight_map names {bad[0]!r} as a shard; shards are named "
                                      "by plain file names beside the index (no folders, no absolute paths). "
                                      "The index is damaged or was made to read other files: use an intact copy")
            base = os.path.dirname(self.path)
            for shard in sorted(set(weight_map.values())):
                self._read_header(os.path.join(base, shard))
            missing = [k for k, f in weight_map.items() if k not in self.entries]
            if missing:
                raise CheckpointError(f"{self.path}: tensors {missing[:5]} are listed in the index but not in their "
                                      "shard files; the checkpoint is incomplete")
        else:
            self._read_header(self.path)
        self._files: dict[str, IOFile] = {}  # open shards, by path
        self.bytes_read = 0  # by read_into, read_range_into and checksums
        self._counting = threading.Lock()  # checksums of several shards run on threads

    def _read_header(self, path: str) -> None:
        try:
            with open(path, "rb", opener=self._opener) as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise CheckpointError(f"{path}: too short to be a safetensors file")
                (n,) = struct.unpack("<Q", raw)
                if n > MAX_HEADER:
                    if raw.startswith(b"PK\x03\x04") or raw[0] == 0x80:  # torch.save's zip archive, a bare pickle
                        raise CheckpointError(
                            f"{path}: a torch.save / pickle file, not safetensors; checkpoint= reads safetensors "
                            "only (they need no unpickling and can be read in place). Convert it once: "
                            "safetensors.torch.save_file(torch.load(PATH), 'model.safetensors'), or save the model "
                            "with save_pretrained() (safetensors by default)")
                    raise CheckpointError(f"{path}: header of {n} bytes; the file is not safetensors or is corrupt")
                raw_header = f.read(n)
                if len(raw_header) != n:
                    raise CheckpointError(f"{path}: the header is cut short; the file is truncated")
                header = json.loads(raw_header)
                size = os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise unreadable_file(path, exc) from None
        except ValueError as exc:
            raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({exc})") from None
        except RecursionError:
            raise CheckpointError(f"{path}: the safetensors header nests too deeply to be one; the file is "
                                  "corrupt") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
        self.header_crc32[path] = zlib.crc32(raw_header, zlib.crc32(raw))
        meta = header.get("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{path}: the header's __metadata__ is not an object of strings; the file is corrupt")
        self.metadata[path] = meta
        base = 8 + n
        tensors = self.shards.setdefault(path, {})
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[meta["dtype"]]
                begin, end = (int(x) for x in meta["data_offsets"])
                shape = tuple(int(d) for d in meta["shape"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
            if base + end > size or not 0 <= begin <= end:
                raise CheckpointError(f"{path}: tensor {name!r} lies past the end of the file; it is truncated")
            if end - begin != _nbytes(dtype, shape):
                raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes, but {list(shape)} of "
                                      f"{meta['dtype']} needs {_nbytes(dtype, shape)}; the header is corrupt")
            tensors[name] = self.entries[name] = Entry(path, base + begin, end - begin, dtype, shape)

    def read_into(self, engine: IOEngine, name: str, target: torch.Tensor) -> int:
        """Read tensor `name` into `target` (a CPU tensor of the same shape), converting its dtype if needed;
        return the CRC-32 of the bytes as stored."""
        e = self._entry(name, tuple(target.shape))
        check_host(f"reading {name!r} from {e.path}", target)
        return _crc32(self._read(e, e.offset, e.nbytes, target, engine))

    def read_range_into(self, engine: IOEngine, name: str, shape: tuple[int, ...], start: int,
                        target: torch.Tensor) -> int:
        """Read elements start .. start + target.numel() of tensor `name` (of `shape`, taken flat) into `target`
        (a CPU tensor), converting its dtype if needed: one rank's chunk, without reading the rest. Returns
        the CRC-32 of the bytes as stored."""
        e = self._entry(name, tuple(shape))
        check_host(f"reading {name!r} from {e.path}", target)
        item = e.dtype.itemsize
        if not target.numel():
            return 0
        return _crc32(self._read(e, e.offset + start * item, target.numel() * item, target, engine))

    def _entry(self, name: str, shape: tuple[int, ...]) -> Entry:
        e = self.entries[name]
        if shape != e.shape:
            raise CheckpointError(f"{e.path}: tensor {name!r} has shape {list(e.shape)} but the model's parameter "
                                  f"has {list(shape)}; the checkpoint was saved from another model config")
        return e

    def _read(self, e: Entry, offset: int, nbytes: int, target: torch.Tensor, engine: IOEngine) -> torch.Tensor:
        """Read `nbytes` at `offset` of `e`'s file into `target`; return them as stored (`target`, or the
        temporary they were converted from)."""
        f = self._files.get(e.path)
        if f is None:
            try:
                f = self._files[e.path] = IOFile(e.path, "r", regular=True, follow_links=self.follow_links)
            except OSError as exc:
                raise unreadable_file(e.path, exc) from None
        self.bytes_read += nbytes
        if target.dtype == e.dtype and target.is_contiguous():
            engine.read(f, target, offset, nbytes).wait()
            return target
        tmp = torch.empty(target.shape, dtype=e.dtype)
        engine.read(f, tmp, offset, nbytes).wait()
        target.copy_(tmp)
        return tmp

    def checksums(self, path: str, parts: int = 1, names: set[str] | None = None) -> dict[str, list[int]]:
        """The CRC-32 of each tensor's bytes in the file at `path` (one of `shards`; only those in `names` if
        given), read front to back in CHUNK-byte pieces, so memory stays small whatever the file's size:
        [whole], or with `parts` > 1 also that of each of the `parts` ranks' chunks of it, [whole, rank 0's,
        rank 1's, ...] (a chunk past the tensor's end is empty: CRC 0)."""
        spans = sorted((e.offset, e.nbytes, name, e.dtype.itemsize) for name, e in self.shards[path].items()
                       if names is None or name in names)
        buf = memoryview(bytearray(min(CHUNK, max((n for _, n, _, _ in spans), default=1)) or 1))
        out: dict[str, list[int]] = {}
        try:
            with open(path, "rb", buffering=0, opener=self._opener) as f:
                for offset, nbytes, name, item in spans:
                    f.seek(offset)
                    step = -(-nbytes // item // parts) * item if parts > 1 else nbytes  # bytes of a rank's chunk
                    crcs = [0] * (1 + (parts if parts > 1 else 0))
                    done = 0
                    while done < nbytes:
                        want = min(nbytes - done, len(buf), step - done % step)  # not across a chunk's end
                        got = f.readinto(buf[:want])
                        if not got:
                            raise CheckpointError(f"{path}: tensor {name!r} ends early; the file is truncated")
                        crcs[0] = zlib.crc32(buf[:got], crcs[0])
                        if parts > 1:
                            crcs[1 + done // step] = zlib.crc32(buf[:got], crcs[1 + done // step])
                        done += got
                    out[name] = crcs
                    with self._counting:
                        self.bytes_read += nbytes
        except OSError as exc:
            raise unreadable_file(path, exc) from None
        return out

    def _opener(self, path: str, flags: int) -> int:
        """For open(): every file read through `open_regular`."""
        return open_regular(path, follow_links=self.follow_links)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = torch.empty(0, dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def _load_json(path: str, follow_links: bool) -> object:
    try:
        with open(path, "rb", opener=lambda p, _: open_regular(p, follow_links=follow_links)) as f:
            raw = f.read(MAX_JSON + 1)
    except OSError as exc:
        raise unreadable_file(path, exc) from None
    return parse_json(path, raw)


def parse_json(path: str, raw: bytes) -> Any:
    """`raw`, the bytes of the JSON file `path` (at most MAX_JSON + 1 of them read), parsed; CheckpointError
    naming the file if it is larger than MAX_JSON, not JSON, or nested too deeply to parse."""
    if len(raw) > MAX_JSON:
        raise CheckpointError(f"{path}: more than {MAX_JSON >> 20} MiB, far more than any index or checkpoint JSON "
                              "file holds; it is damaged or not one. Use an intact copy")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); use an intact copy") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply to parse; no checkpoint file nests more than a few "
                              "levels, so it is damaged. Use an intact copy") from None


def plain_name(name: object) -> bool:
    """Whether `name` is a file name alone: a string without a folder, not '.', '..' or empty, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name
            and "\0" not in name)


def unreadable_file(path: str, exc: OSError) -> CheckpointError:
    """A file of a checkpoint that cannot be opened or read: what it is (a FIFO, a symlink, ...) or the error."""
    if exc.errno in (errno.ELOOP, errno.EISDIR, errno.EINVAL, errno.ESTALE):  # from open_regular: what it is
        fix = ("replace the link with the file it points to (cp --dereference), or use an intact copy"
               if exc.errno == errno.ELOOP else "use an intact copy")
        return CheckpointError(f"{path}: {exc.strerror}; every file of a checkpoint must be a regular file. Nothing "
                               f"was read from it and nothing was loaded; {fix}")
    return CheckpointError(f"{path}: cannot read the checkpoint ({exc.strerror})")


class _Staged:
    """Two aligned STAGE-byte buffers (`_stages`), each written by the engine (`_writes`, to `_io`) while the
    other fills: what the two writers below share."""

    STAGE = 4 << 20
    _stages: list[AlignedBuffer]
    _writes: list[Any]
    _io: IOFile | None

    def _wait(self, stage: int) -> None:
        write, self._writes[stage] = self._writes[stage], None
        if write is not None:
            write.wait()

    def _wait_quietly(self) -> None:
        """Wait for both stages' writes, ignoring their errors: the save has failed already, and its error is the
        one raised."""
        for stage in (0, 1):
            try:
                self._wait(stage)
            except Exception:  # noqa: BLE001, S110
                pass

    def _release(self) -> None:
        for stage in self._stages:
            stage.close()
        self._stages = []
        if self._io is not None:
            self._io.close()
            self._io = None


class SafetensorsWriter(_Staged):
    """Writes one safetensors file tensor by tensor: the header first (from names, dtypes and shapes),
    then each tensor's bytes in the same order, so no more than one tensor is in memory at a time. The CRC-32
    of the header and of each tensor's bytes are taken as they are written (`header_crc32`, `crc32`).

    Given an engine, the bytes go through two aligned STAGE-byte buffers, each written with O_DIRECT (where
    the filesystem allows it) while the other fills, past the page cache: writing a new file through the page
    cache ran at 0.32 GB/s on the machine these figures come from, O_DIRECT at 1.9 GB/s (docs/benchmarks.md,
    "Checkpoint shards written with O_DIRECT, and cold loads"). Without one, plain buffered writes."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, engine: IOEngine | None = None) -> None:
        self.path = path
        head, places, self.size = _header(specs, metadata)  # size: the file's length once every tensor is written
        self.expected: list[tuple[str, int]] = [(name, n) for name, (_, n) in places.items()]  # in write order
        self.header_crc32 = zlib.crc32(head)  # what SafetensorsCheckpoint.header_crc32 reads back
        self.crc32: dict[str, int] = {}  # tensor name -> CRC-32 of its bytes as written
        self._next = 0
        self._engine = engine
        if engine is None:
            try:
                self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
            except OSError as exc:
                raise _write_failed(path, exc) from exc
            try:
                self._file.write(head)
            except OSError as exc:
                self._file.close()
                raise _write_failed(path, exc) from exc
            return
        self._io: IOFile | None = None  # the file, opened for the engine
        self._stages: list[AlignedBuffer] = []
        try:
            self._io = IOFile(path, "w", direct=True)
            os.ftruncate(self._io.buffered_fd, 0)  # a file left by a killed save, if any
            self._stages = [AlignedBuffer(self.STAGE, huge_pages=False) for _ in range(2)]
        except BaseException as exc:
            self._release()
            if isinstance(exc, OSError):  # a disk that failed or filled as the file began
                raise _write_failed(path, exc) from exc
            raise
        self._writes: list[Any] = [None, None]  # each stage's write in flight
        self._stage, self._filled, self._at = 0, 0, 0  # the stage filling, its bytes, its offset in the file
        self._put(memoryview(head))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, nbytes = self.expected[self._next]
        if name != want:
            raise CheckpointError(f"{self.path}: expected tensor {want!r} next, got {name!r}")
        data = tensor.detach().contiguous().cpu()
        view = memoryview(data.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        if len(view) != nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r} has {len(view)} bytes, the header says {nbytes}")
        try:
            if self._engine is None:
                self._file.write(view)
            else:
                self._put(view)
        except OSError as exc:
            raise self._failed(exc) from exc
        self.crc32[name] = zlib.crc32(view)
        self._next += 1

    def _failed(self, exc: OSError) -> CheckpointError:
        return _write_failed(self.path, exc)

    def _put(self, view: memoryview) -> None:
        """Copy bytes into the stages, writing each as it fills."""
        while len(view):
            n = min(len(view), self.STAGE - self._filled)
            self._stages[self._stage].view[self._filled : self._filled + n] = view[:n]
            self._filled += n
            view = view[n:]
            if self._filled == self.STAGE:
                self._send()

    def _send(self) -> None:
        """Write the filling stage (all of it, or the file's tail), then wait for the other one's write."""
        assert self._engine is not None and self._io is not None
        self._writes[self._stage] = self._engine.write(self._io, self._stages[self._stage].view, self._at,
                                                       self._filled)
        self._at += self._filled
        self._filled = 0
        self._stage ^= 1
        self._wait(self._stage)

    def discard(self) -> None:
        """Give up on the file (the save failed): close it unsynced; the caller removes the directory."""
        if self._engine is None:
            self._file.close()
            return
        self._wait_quietly()
        self._release()

    def close(self) -> None:
        if self._next != len(self.expected):
            self.discard()
            raise CheckpointError(f"{self.path}: only {self._next} of {len(self.expected)} tensors were written")
        try:
            if self._engine is None:
                try:
                    self._file.flush()
                    os.fsync(self._file.fileno())
                finally:
                    self._file.close()
                return
            try:
                if self._filled:
                    self._send()  # the tail: unaligned, so the engine writes it through the page cache
                self._wait(0)
                self._wait(1)
                assert self._io is not None
                os.fsync(self._io.buffered_fd)
            except BaseException:
                self.discard()
                raise
            self._release()
        except OSError as exc:
            raise self._failed(exc) from exc


def _header(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
            ) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """A safetensors file's first bytes (length and JSON header) for tensors stored in `specs`' order, each
    tensor's (offset in the file, bytes), and the file's length."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    places = {}  # name -> (offset in the data, bytes)
    for name, dtype, shape in specs:
        if dtype not in _NAMES:
            raise CheckpointError(f"{name}: dtype {dtype} cannot be stored in safetensors")
        nbytes = _nbytes(dtype, shape)
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        places[name] = (offset, nbytes)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    return head, {name: (len(head) + at, n) for name, (at, n) in places.items()}, len(head) + offset


class SafetensorsRangeWriter(_Staged):
    """Writes byte ranges of the tensors of one safetensors file that several processes fill at once: with N
    ranks, each writes its chunk of every tensor straight to where it lies in the file, and no rank gathers
    anything ([Note: each rank writes its own chunks] in tiermem/checkpointing.py).

    `create` (one process, first) writes the header and sets the file's length; then each writer opens it and
    `write`s its ranges, in any order. The page-aligned middle of a range goes with O_DIRECT through the
    engine from two aligned stages, as SafetensorsWriter writes; its unaligned ends go through the page cache,
    so two ranks whose ranges meet inside a page both write it buffered, and no page is written both ways.
    `close` waits and fsyncs this process's writes."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 engine: IOEngine | None) -> None:
        self.path = path
        self.places = _header(specs)[1]  # tensor -> (offset in the file, bytes)
        self.bytes_written = 0
        self._engine = engine
        try:
            self._io = IOFile(path, "w", direct=engine is not None)
        except OSError as exc:
            raise _write_failed(path, exc) from exc
        self._fd = self._io.buffered_fd  # for the unaligned ends
        self._stages: list[AlignedBuffer] = []
        self._writes: list[Any] = [None, None]
        self._stage = 0
        try:
            if engine is not None:
                self._stages = [AlignedBuffer(self.STAGE, huge_pages=False) for _ in range(2)]
        except BaseException:
            self._release()
            raise

    @staticmethod
    def create(path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
        """Make the file: its header, and its whole length (sparse until the ranks write); returns the header's
        CRC-32."""
        head, _, size = _header(specs)
        try:
            with open(path, "wb") as f:
                f.write(head)
                f.truncate(size)
        except OSError as exc:
            raise _write_failed(path, exc) from exc
        return zlib.crc32(head)

    def write(self, name: str, start: int, tensor: torch.Tensor) -> int:
        """Write `tensor`'s bytes as bytes [start, start + its bytes) of tensor `name`; returns their CRC-32."""
        at, nbytes = self.places[name]
        data = tensor.detach().contiguous().cpu()
        view = memoryview(data.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        if start < 0 or start + len(view) > nbytes:
            raise CheckpointError(f"{self.path}: bytes [{start}, {start + len(view)}) are outside tensor {name!r} "
                                  f"({nbytes} bytes)")
        at += start
        try:
            self._put(view, at)
        except OSError as exc:
            raise _write_failed(self.path, exc) from exc
        self.bytes_written += len(view)
        return zlib.crc32(view)

    def _put(self, view: memoryview, at: int) -> None:
        n = len(view)
        if self._engine is None or self._io is None:
            self._pwrite(view, at)
            return
        head = min(n, -at % _BLOCK)  # up to the first block boundary: buffered
        body = (n - head) // _BLOCK * _BLOCK
        self._pwrite(view[:head], at)
        done = head
        while done < head + body:
            k = min(self.STAGE, head + body - done)
            self._wait(self._stage)  # this stage's last write has finished: it may be refilled
            self._stages[self._stage].view[:k] = view[done : done + k]
            self._writes[self._stage] = self._engine.write(self._io, self._stages[self._stage].view, at + done, k)
            self._stage ^= 1
            done += k
        self._pwrite(view[done:], at + done)  # the part of a block at the end: buffered

    def _pwrite(self, view: memoryview, at: int) -> None:
        while len(view):
            n = os.pwrite(self._fd, view, at)
            view, at = view[n:], at + n

    def discard(self) -> None:
        """Give up (the save failed): wait for what is in flight, close unsynced."""
        self._wait_quietly()
        self._release()

    def close(self) -> None:
        try:
            self._wait(0)
            self._wait(1)
            os.fsync(self._fd)
        except OSError as exc:
            self.discard()
            raise _write_failed(self.path, exc) from exc
        except BaseException:
            self.discard()
            raise
        self._release()


# The unaligned ends of a range go through the page cache and its middle with O_DIRECT; two ranks' ranges may
# meet inside one page, so the middle is whole pages (64 KiB on some ARM kernels), never a page written both ways.
_BLOCK = max(ALIGN, mmap.PAGESIZE)


def _write_failed(path: str, exc: OSError) -> CheckpointError:
    return CheckpointError(f"{path}: writing failed ({exc.strerror or exc}); a checkpoint already at the path the "
                           f"save was given is left as it was. {write_fix(exc)}")


def write_fix(exc: OSError) -> str:
    """What to do about a write that failed with `exc`."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "Free space on that drive, or save elsewhere"
    if exc.errno == errno.EIO:
        return "The drive failed or went away (see dmesg): check it, and save elsewhere meanwhile"
    return "Check that the folder can be written, or save elsewhere"


def _crc32(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
