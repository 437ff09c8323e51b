"""Streaming checkpoints of an offloaded model and its optimizer: `tm.save_checkpoint` / `tm.load_checkpoint`.

Layout of a checkpoint directory:
    config.json                                  the model's config, when it has one (transformers)
    model.safetensors.index.json                 {"metadata": {...}, "weight_map": {name: shard}}
    model-00001-of-0000N.safetensors ...         parameters (tied ones once) and persistent buffers
    optimizer.safetensors.index.json             the same for optimizer state, named "<param>::<kind>"
    optimizer-00001-of-0000N.safetensors ...
    trainer_state.json                           optimizer type, param groups (by parameter name), state
                                                 kinds, steps
    manifest.json                                written last: the format, and every other file with its
                                                 size and CRC-32 (for a shard: of its header and of each
                                                 tensor's bytes, taken as they were written)

The optimizer files and trainer_state.json are there when the checkpoint was saved with an optimizer.
Weights are written one unit at a time (with several ranks, each rank its chunks: [Note: each rank writes its
own chunks]), so memory stays within the host budget, through the swap's I/O
engine with O_DIRECT where the filesystem allows it (`SafetensorsWriter`'s two 4 MiB stages, 8 MiB
besides the host budget while a shard is written); transformers'
`from_pretrained(dir)` and `safetensors.torch.load_file` read the model shards directly (they do not
look at manifest.json). The JSON files (indexes, trainer state, manifest) are written and read with
aiofiles, concurrently. A directory without manifest.json is not a complete checkpoint: its save did not
finish, or a tiermem older than the manifest wrote it; `load_checkpoint` refuses it.

# [Note: replacing a checkpoint]
`path` names a complete checkpoint at every moment, or nothing before the first save:
- The new checkpoint is written to `<path>.tmp-<PID>`; every file is fsynced, manifest.json last, then
  the directory itself.
- The first save to `path` renames it into place. A later one exchanges the two directories in one
  step, renameat2(RENAME_EXCHANGE) through ctypes, so the old checkpoint is now `<path>.tmp-<PID>`; the
  parent directory is fsynced, then the old one removed.
- A filesystem without RENAME_EXCHANGE (the kernel answers EINVAL or ENOSYS: NFS, some FUSE
  filesystems, older ZFS) gets two renames, the old checkpoint to `<path>.old-<PID>` and the new one
  in; between them `path` does not exist. This is not atomic, and is logged once per directory. A save
  killed there is repaired by the next save or load of `path`: it renames the dead writer's new
  checkpoint into place (complete, since its manifest.json exists), else its old one.
- Save and load first remove `<path>.tmp-<PID>` and `<path>.old-<PID>` of processes that are gone
  (`os.kill(pid, 0)` says no such process): what killed saves left. Those of a live process are never
  touched. A PID of another PID namespace sharing the filesystem looks dead: do not save to one path from
  two containers at once.

# [Note: checked loading]
`load_checkpoint` changes nothing until the whole checkpoint has been checked, so a damaged one leaves the
model and the optimizer as they were and raises CheckpointError naming the file (and the tensor):
1. manifest.json and the small JSON files are read; every file it lists must be there, a regular file (not a
   symlink, FIFO, device or directory: looked at before it is opened, and opened without following a link or
   blocking; [Note: opening files that others made] in tiermem/io/files.py) with its size, and the JSON files
   (at most MAX_JSON bytes) must match their CRC-32 and parse. An index may name only shards the manifest
   lists, checked before any is opened. trainer_state.json must agree with the optimizer (type, param
   groups by parameter name, each setting of the kind the optimizer's own is and finite, state kinds, steps
   of parameters it trains). A checkpoint folder given as a symlink is followed: the user named it.
2. Every tensor the model and the optimizer need must be in its shard, with its shape and a compatible
   dtype, its byte range inside the file, and its shard's header unchanged.
3. Every shard to load is read once, front to back in 4 MiB pieces, and the CRC-32 of each tensor in it
   compared with the manifest's (up to 4 shards at a time).
Only then is anything loaded, unit by unit. So the checkpoint is read twice; the second read
usually comes from the page cache, and its bytes are checked against the manifest again. With N ranks each
rank checks a run of 1/N of the tensors' bytes (in file order), taking the CRC-32 of each rank's chunk of
them besides, and the ranks share what they found (an error found by any is raised by all); then each reads
only its chunk of every tensor, checked against the CRC-32 taken of it. So each rank reads 1/N of the
checkpoint twice. An I/O error or
changed bytes in that second pass (a drive failing between the two) leave a partial load: it raises a
CheckpointError that says so, and loading again (the checkpoint is unchanged) completes it. Making that
pass all-or-nothing would need a second copy of everything loaded, in memory or in swap.

# [Note: each rank writes its own chunks]
With N ranks, rank r holds chunk r of every tensor: elements [r*c, (r+1)*c) with c = ceil(numel / N), one
contiguous run of the tensor's bytes in a safetensors file. So when every rank sees the folder the save
writes into (one machine, or a filesystem the machines share), nothing is gathered:
1. Rank 0 makes the new folder `<path>.tmp-<PID>` and a file in it named by a random token; every rank looks
   for it. If any rank does not see it, rank 0 writes the whole checkpoint from tensors gathered unit by
   unit (logged).
2. Rank 0 makes each shard, with its header and its whole length (sparse), and config.json.
3. Each rank writes its chunks of every tensor at their place in the shards (`SafetensorsRangeWriter`), the
   persistent buffers (the same on every rank) by rank 0, and fsyncs what it wrote. Each rank reads only its
   own partitions; there is no collective until the end, so the ranks write at once.
4. The ranks give rank 0 their CRC-32s (or their errors: then every rank raises and the folder is removed, the
   checkpoint at `path` untouched). Rank 0 joins the CRC-32s of each tensor's chunks in rank order
   (`crc32_combine`) and writes the indexes, trainer_state.json and manifest.json, and puts the folder in
   place; the ranks return after it has.
The files are the ones rank 0 alone would write, byte for byte; `load_checkpoint`, `from_pretrained` and a
different number of ranks read them as ever. Each rank writes about 1/N of the bytes. A PEFT adapter saved
with `adapters_only` goes the same way into adapter_model.safetensors (no manifest: PEFT's format).
Every error a rank meets in this (any exception, not only the disk's) is shared in the collective that
follows, so every rank raises it and none waits for a collective that will not come. When rank 0 writes
the gathered tensors, a failed write stops the writing but not the gathers, and is raised after them, by
every rank. A rank whose own partition cannot be read mid-way does leave the others in a gather; they
learn of it when its with-block ends ([Note: a rank that fails] in tiermem/distributed.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import logging
import math
import os
import platform
import re
import secrets
import shutil
import sys
import zlib
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, TypeVar

import aiofiles
import torch

from tiermem.device import check_host
from tiermem.distributed import Ranks, gather_unit
from tiermem.errors import CheckpointError, TiermemError
from tiermem.io.files import open_regular, refuse_unless_regular
from tiermem.optim import StateTensor, TieredOptimizer
from tiermem.runtime.safetensors_io import (
    MAX_JSON,
    SafetensorsCheckpoint,
    SafetensorsRangeWriter,
    SafetensorsWriter,
    _header,
    parse_json,
    plain_name,
    unreadable_file,
    write_fix,
)
from tiermem.runtime.unit import Unit
from tiermem.swap import Partition, TensorSwapper, Tier

log = logging.getLogger(__name__)

FORMAT = 2  # 1: before manifest.json and state_kinds
DEFAULT_SHARD = 1 << 30
MANIFEST = "manifest.json"
MODEL_INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
TRAINER_STATE = "trainer_state.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's names (adapters_only)
ADAPTER_CONFIG = "adapter_config.json"
_LEFTOVER = re.compile(r"\.(tmp|old)-(\d+)")  # after "<name>": what a save in progress (or killed) leaves
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_RENAMEAT2_SYSCALL = {"x86_64": 316, "aarch64": 276}  # for a libc without the renameat2 wrapper (< glibc 2.28)
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}  # the filesystem or kernel cannot exchange
_warned_no_exchange: set[str] = set()  # parent directories already logged as lacking RENAME_EXCHANGE



@dataclass(frozen=True)
class CheckpointContents:
    """What a checkpoint holds and where it lives: the model (its config and buffers), its units (whose
    partitions hold the weights), the swapper that reads and writes those partitions, and the optimizer
    (its state tensors, step counts and settings), or None. The handle of `tiered_offload` makes one."""

    model: torch.nn.Module
    units: list[Unit]
    swapper: TensorSwapper
    optimizer: TieredOptimizer | None


@dataclass(frozen=True)
class _InPartition:
    """A tensor's bytes in a partition: unit `unit`'s weights, or with `state` its optimizer state; `slot`
    names it in the partition's layout."""

    unit: int
    state: bool
    slot: str


# name, dtype, whole shape, and its bytes: in a partition, a tensor (a buffer), or a function that returns them
Spec = tuple[str, torch.dtype, tuple[int, ...], "_InPartition | torch.Tensor | Callable[[], torch.Tensor]"]
T = TypeVar("T")


def save_checkpoint(src: CheckpointContents, path: str | os.PathLike[str], max_shard_bytes: int = DEFAULT_SHARD, *,
                    adapters_only: bool = False) -> tuple[str, int]:
    """Write model weights, buffers and optimizer state to the directory `path`; return its absolute path and
    the bytes of tensors this process wrote (with several ranks, its chunks: see [Note: each rank writes its
    own chunks]).

    `path` holds a complete checkpoint at every moment: the old one until the new one has replaced it in
    one step (see [Note: replacing a checkpoint]). Shards are at most `max_shard_bytes` (unless one tensor
    is larger). Example: ``tm.save_checkpoint("ckpt/step-1000")``. With `adapters_only`, only a PEFT
    model's adapters, in PEFT's own format (see `_write_adapters`).
    """
    final = os.path.realpath(os.fspath(path))
    ranks = src.units[0].ranks if src.units else Ranks()
    if adapters_only:
        _adapter(src)  # not a PEFT model: refused on every rank alike, before anything is made
    if ranks.sharded:
        return _save_ranked(src, final, ranks, max_shard_bytes, adapters_only)
    if adapters_only:
        written: list[int] = []
        return _save(final, lambda tmp: written.append(_write_adapters(src, tmp))), sum(written)
    done: list[int] = []
    return _save(final, lambda tmp: done.append(_write(src, tmp, max_shard_bytes))), sum(done)


def write_checkpoint(path: str | os.PathLike[str], model: list[Spec], optimizer: list[Spec] | None = None,
                     trainer: dict[str, Any] | None = None, copied: Sequence[str] = (),
                     max_shard_bytes: int = DEFAULT_SHARD) -> str:
    """Write a checkpoint that `load_checkpoint` loads from tensors that are not in a live context's partitions
    (`tiermem rescue` joining the ranks' shares): `model` and `optimizer` name each tensor with its dtype,
    whole shape and a function that returns it; `trainer` is what `trainer_state` makes, given with
    `optimizer`; `copied` are files put beside them as they are (a model's config.json). Replaces `path` as
    `save_checkpoint` does."""
    def fill(folder: str) -> None:
        for file in copied:
            shutil.copyfile(file, os.path.join(folder, os.path.basename(file)))
        _write_folder(folder, model, optimizer, trainer, max_shard_bytes, None)

    return _save(os.path.realpath(os.fspath(path)), fill)


def _save(final: str, fill: Callable[[str], None]) -> str:
    """Have `fill` write a checkpoint into a new directory, then put it at `final`. An OSError on the way (the
    folder, a JSON file, the rename) is a CheckpointError naming the file, as a shard's failed write is."""
    try:
        return _save_into(final, fill)
    except OSError as exc:
        raise CheckpointError(_said(exc, final)) from exc


def _save_into(final: str, fill: Callable[[str], None]) -> str:
    if os.path.lexists(final) and not os.path.isdir(final):
        raise CheckpointError(f"{final} exists and is not a directory; pass a directory for the checkpoint")
    os.makedirs(os.path.dirname(final), exist_ok=True)
    _settle(final)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, left by a save whose cleanup failed
    os.makedirs(tmp)
    try:
        fill(tmp)
        _install(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the unfinished new one, or the old one after an exchange
        raise
    return final


def _save_ranked(src: CheckpointContents, final: str, ranks: Ranks, max_shard_bytes: int,
                 adapters_only: bool) -> tuple[str, int]:
    """`save_checkpoint` on every rank of a sharded context (see [Note: each rank writes its own chunks]). A
    failure is raised by every rank: those found while writing are shared at the end of it, and rank 0's
    before it has a folder or while it puts the folder in place are told to the others, who wait for it."""
    written: list[int] = []
    stage = ["before"]  # rank 0: "before" the others are told the folder, "writing", "after" every write

    def write(folder: str | None) -> None:
        shared = _shared_folder(ranks, folder)
        stage[0] = "writing"
        finish: Callable[[], None] | None = None
        if shared is not None:
            n, finish = (_write_adapters_by_ranks(src, shared, ranks) if adapters_only
                         else _write_by_ranks(src, shared, ranks, max_shard_bytes))
        elif folder is not None and not adapters_only:  # rank 0 writes whole tensors, gathered by all ranks
            n, finish = _write_whole(src, folder, max_shard_bytes, keep_gathering=True)
        else:
            n = _write_adapters(src, folder) if adapters_only else _write(src, None, max_shard_bytes)
        written.append(n)
        stage[0] = "after"
        if finish is not None:
            finish()

    if ranks.rank != 0:
        write(None)
        _agree(ranks, "waiting for rank 0 to put the checkpoint in place", None)
        return final, sum(written)
    try:
        path = _save(final, write)
    except _Told:
        raise  # every rank raises it
    except BaseException as exc:
        told = _said(exc, final)
        if stage[0] == "before":  # the others wait for the folder's name
            _shared_folder(ranks, None, error=told)
        elif stage[0] == "after":  # they wait to hear that the checkpoint is in place
            _agree(ranks, "waiting for rank 0 to put the checkpoint in place", f"rank 0: {told}")
        if isinstance(exc, OSError):
            raise CheckpointError(told) from exc
        raise
    _agree(ranks, "waiting for rank 0 to put the checkpoint in place", None)
    return path, sum(written)


def _said(exc: BaseException, where: str) -> str:
    """What a failed save says: for an OSError, the file (else `where`), the cause and the fix; a tiermem error
    as it is; anything else with its type."""
    if isinstance(exc, TiermemError):
        return str(exc)
    if not isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc}"
    return (f"{exc.filename or where}: {exc.strerror or exc}; a checkpoint already at the path the save was given "
            f"is left as it was. {write_fix(exc)}")


class _Told(CheckpointError):
    """An error every rank raises, having agreed on it in a collective."""


_MARK = ".tiermem-ranks-"


def _shared_folder(ranks: Ranks, folder: str | None, error: str | None = None) -> str | None:
    """Rank 0 passes the new checkpoint's folder, the others None: the folder when every rank sees it (one
    filesystem), else None. `error`, from rank 0: its save failed before it had a folder; every rank raises."""
    token = mark = None
    if ranks.rank == 0 and folder is not None:
        token = secrets.token_hex(8)
        mark = os.path.join(folder, _MARK + token)
        try:
            with open(mark, "w", encoding="utf-8") as f:
                f.write(token)
        except OSError as exc:
            error, mark = _said(exc, folder), None
    every = ranks.all_gather_object("starting a checkpoint's save", (folder, token, error) if ranks.rank == 0 else None)
    folder, token, error = every[0]
    if error is not None:
        raise _Told(f"rank 0 could not start saving the checkpoint: {error}")
    try:
        with open(os.path.join(folder, _MARK + token), encoding="utf-8") as f:
            sees = f.read() == token
    except OSError:
        sees = False
    seen = ranks.all_gather_object("checking that every rank sees the checkpoint's folder", sees)
    if mark is not None:
        try:
            os.remove(mark)
        except OSError as exc:  # it would be listed in the manifest; the save goes on, and so do the others
            log.warning("could not remove %s (%s); it stays in the checkpoint", mark, exc.strerror)
        if not all(seen):
            log.info("ranks %s do not see %s (not one filesystem): rank 0 writes the whole checkpoint, gathered",
                     [r for r, ok in enumerate(seen) if not ok], folder)
    return folder if all(seen) else None


def _write_by_ranks(src: CheckpointContents, folder: str, ranks: Ranks, max_shard_bytes: int
                    ) -> tuple[int, Callable[[], None] | None]:
    """Write this rank's chunks of every tensor into the shards in `folder`, which every rank sees (rank 0 also
    config.json and the buffers). Returns the bytes this rank wrote and, on rank 0, what writes the rest once
    every rank has written: the JSON files and the manifest, with the shards' CRC-32s joined. Any error is
    shared in the collective that follows it, so every rank raises it and none is left waiting."""
    groups = [("model", list(_model_tensors(src)))]
    if src.optimizer is not None:
        groups.append(("optimizer", list(_optimizer_tensors(src))))
    plans = [(prefix, tensors, _plan_shards(prefix, tensors, max_shard_bytes)) for prefix, tensors in groups]
    error = None
    small: dict[str, bytes] = {}
    if ranks.rank == 0:
        try:
            if src.optimizer is not None:
                small[TRAINER_STATE] = _dumps(trainer_state(src))
            _save_config(src, folder)
            for _, _, shards in plans:
                for name, shard in shards:
                    SafetensorsRangeWriter.create(os.path.join(folder, name), [(n, d, s) for n, d, s, _ in shard])
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised by all
            error = f"rank 0: {_said(exc, folder)}"
    _agree(ranks, "making the checkpoint's shards", error)
    crcs: dict[str, tuple[int, int]] = {}  # tensor -> (CRC-32, bytes) of this rank's chunk
    written, error = 0, None
    try:
        for _, _, shards in plans:
            for name, shard in shards:
                written += _write_my_chunks(src, os.path.join(folder, name), shard, ranks, crcs)
    except Exception as exc:  # noqa: BLE001 - a failed read of a partition is a TiermemError naming its drive
        error = f"rank {ranks.rank}: {_said(exc, folder)}"
    every = ranks.all_gather_object("finishing the checkpoint's shards", (error, crcs))
    _agree(ranks, None, *(e for e, _ in every))
    if ranks.rank != 0:
        return written, None

    def finish() -> None:
        files: dict[str, dict[str, Any]] = {}
        for prefix, tensors, shards in plans:
            weight_map = {}
            for name, shard in shards:
                joined = {}
                for tname, *_ in shard:
                    weight_map[tname] = name
                    crc = 0
                    for _, theirs in every:  # rank order: the tensor's bytes in file order
                        if tname in theirs:
                            crc = crc32_combine(crc, *theirs[tname])
                    joined[tname] = crc
                head, _, size = _header([(n, d, s) for n, d, s, _ in shard])
                files[name] = {"bytes": size, "header_crc32": zlib.crc32(head), "tensors": joined}
            small[MODEL_INDEX if prefix == "model" else OPTIMIZER_INDEX] = _index(tensors, weight_map)
        _finish_folder(folder, files, small)

    return written, finish


def _write_whole(src: CheckpointContents, folder: str, max_shard_bytes: int, *, keep_gathering: bool
                 ) -> tuple[int, Callable[[], None]]:
    """Write the shards of whole tensors into `folder`: one process's save, or rank 0's of a save whose folder
    the other ranks do not see (they take part in the gathers through `_write(src, None, ...)`). Returns the
    tensors' bytes and what writes the rest (the JSON files, config.json and the manifest). With
    `keep_gathering`, a failed write stops the writing but not the gathers, so the other ranks' collectives
    are all met, and the failure is raised by what this returns."""
    model = list(_model_tensors(src))
    optimizer = list(_optimizer_tensors(src)) if src.optimizer is not None else None
    failed: list[Exception] | None = [] if keep_gathering else None
    files: dict[str, dict[str, Any]] = {}
    small = {MODEL_INDEX: _write_sharded(folder, "model", model, max_shard_bytes, src, files, failed)}
    if optimizer is not None:
        small[OPTIMIZER_INDEX] = _write_sharded(folder, "optimizer", optimizer, max_shard_bytes, src, files, failed)

    def finish() -> None:
        if failed:
            raise failed[0]
        if optimizer is not None:
            small[TRAINER_STATE] = _dumps(trainer_state(src))
        _save_config(src, folder)
        _finish_folder(folder, files, small)

    return sum(_nbytes_of(t) for t in model + (optimizer or [])), finish


def _write_my_chunks(src: CheckpointContents, path: str, shard: list[Spec], ranks: Ranks,
                     crcs: dict[str, tuple[int, int]]) -> int:
    writer = SafetensorsRangeWriter(path, [(n, d, s) for n, d, s, _ in shard], src.swapper.engine)
    held: Partition | None = None
    try:
        for tname, dtype, shape, source in shard:
            if isinstance(source, torch.Tensor):  # a buffer, whole on every rank (on the device, if it is one)
                if ranks.rank == 0:
                    host = source.detach().cpu()
                    crcs[tname] = (writer.write(tname, 0, host), host.numel() * host.element_size())
                continue
            assert isinstance(source, _InPartition)
            part = _partition_for(src, (source.unit, source.state))
            if held is not part:
                if held is not None:
                    src.swapper.release(held, tier=Tier.HOST)
                    held = None
                views = src.swapper.acquire(part, Tier.HOST)  # this rank's chunks; a failed read holds nothing
                held = part
            start, end = ranks.my_range(math.prod(shape))
            if end > start:
                chunk = views[source.slot][: end - start]
                check_host(f"saving {tname!r}", chunk)
                if chunk.dtype != dtype:
                    raise CheckpointError(f"{path}: {tname!r} is stored as {chunk.dtype}, its header says {dtype}")
                crcs[tname] = (writer.write(tname, start * chunk.element_size(), chunk),
                               (end - start) * chunk.element_size())
    except BaseException:
        writer.discard()
        raise
    finally:
        if held is not None:
            src.swapper.release(held, tier=Tier.HOST)
    writer.close()  # fsyncs this rank's writes
    return writer.bytes_written


def _agree(ranks: Ranks, what: str | None, *errors: str | None) -> None:
    """Raise on every rank if any rank had an error. With `what`, this rank's one error is shared first."""
    if what is not None:
        errors = tuple(ranks.all_gather_object(what, errors[0] if errors else None))
    found = [e for e in errors if e]
    if found:
        raise _Told(f"saving the checkpoint failed: {'; '.join(found)}")


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 (zlib's) of A + B from crc32(A), crc32(B) and len(B), without the bytes: crc1 is carried
    through len2 zero bytes by the operators of 2**k zero bytes (32 x 32 bits over GF(2), made once each),
    one per bit set in len2, then crc2 is added."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zero_bytes_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    out, k = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[k]
        vector >>= 1
        k += 1
    return out


@cache
def _zero_bytes_operator(k: int) -> tuple[int, ...]:
    """What a CRC-32 register becomes through 2**k zero bytes, as a matrix (column n: the image of bit n)."""
    if k == 0:
        op = (0xEDB88320, *(1 << n for n in range(31)))  # one zero bit: shift right, the polynomial on bit 0
        for _ in range(3):  # 2, 4, 8 bits
            op = tuple(_gf2_times(op, column) for column in op)
        return op
    half = _zero_bytes_operator(k - 1)
    return tuple(_gf2_times(half, column) for column in half)


def load_checkpoint(src: CheckpointContents, path: str | os.PathLike[str]) -> int:
    """Load weights, buffers and optimizer state saved by `save_checkpoint`, all or nothing; return the bytes
    read from its tensors (checking included).

    The whole checkpoint is checked first (files, shapes, checksums, trainer state; see [Note: checked
    loading]); a damaged or foreign one raises CheckpointError and changes nothing. Then it is read unit by
    unit into the partitions, so memory stays within the host budget. With several ranks each rank checks
    and reads 1/N of it (`_verify_checksums`).
    """
    folder = os.path.realpath(os.fspath(path))
    live = _settle(folder)
    if not os.path.isdir(folder):
        if live:
            raise CheckpointError(f"{folder} does not exist right now: process {live[0]} is replacing it on a "
                                  "filesystem without RENAME_EXCHANGE; load again when that save has finished")
        raise CheckpointError(f"{folder} does not exist; pass the directory tm.save_checkpoint wrote")
    checked = _check(src, folder)
    try:
        _load(src, checked)
    except (OSError, TiermemError) as exc:
        raise CheckpointError(
            f"{folder}: loading failed part way, after every check had passed: {exc}. The model and optimizer now "
            "hold part of this checkpoint and part of what they held before; the checkpoint itself is unchanged, "
            "so call load_checkpoint again (it is checked again first), or load an intact copy"
        ) from exc
    finally:
        checked.close()
    return checked.weights.bytes_read + (checked.states.bytes_read if checked.states is not None else 0)


# -- model ------------------------------------------------------------------------------------------
def _model_tensors(src: CheckpointContents) -> Iterator[Spec]:
    """(name, dtype, shape, source) for every tensor to save, in unit order."""
    masters = _with_masters(src)
    for unit in src.units:
        dtypes = {s.name: s.dtype for s in unit.partition.layout.slots}  # stored dtype (params.dtype)
        for (fqn, _), shape in zip(unit.params, unit.shapes, strict=True):
            if fqn in masters:  # the float32 values training arrived at, not their params.dtype rounding
                yield fqn, torch.float32, shape, _InPartition(unit.index, True, f"master.{fqn}")
            else:
                yield fqn, dtypes[fqn], shape, _InPartition(unit.index, False, fqn)
    for name, buf in persistent_buffers(src.model):
        yield name, buf.dtype, tuple(buf.shape), buf


def _with_masters(src: CheckpointContents) -> set[str]:
    """The parameters whose float32 master weights the optimizer keeps (params.dtype bfloat16 or float16): a
    checkpoint holds those as their weights ([Note: master weights are the values] in tiermem/offload.py)."""
    opt = src.optimizer
    if opt is None or not opt.mixed:
        return set()
    return {fqn for st in opt.units if st.state is not None for fqn, _, _ in st.trainable}


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


# -- optimizer ----------------------------------------------------------------------------------------
def _optimizer_tensors(src: CheckpointContents) -> Iterator[Spec]:
    assert src.optimizer is not None
    for t in src.optimizer.state_tensors():
        yield t.name, t.dtype, t.shape, _InPartition(t.unit, True, t.slot)


def trainer_state(src: CheckpointContents) -> dict[str, Any]:
    opt = src.optimizer
    assert opt is not None
    name_of = _param_names(src)
    groups = []
    for group in opt.param_groups:
        saved = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        saved = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in saved.items()}
        saved["params"] = [name_of[id(p)] for p in group["params"]]
        groups.append(saved)
    return {"format": FORMAT, "optimizer": opt.kind.__name__, "param_groups": groups,
            "state_kinds": opt.state_kinds(), "steps": opt.step_counts(), "scalars": opt.scalar_state(),
            "loss_scale": opt.loss_scale_state()}


def _param_names(src: CheckpointContents) -> dict[int, str]:
    return {id(p): fqn for u in src.units for fqn, p in u.params}


# -- writing ----------------------------------------------------------------------------------------
def _write(src: CheckpointContents, folder: str | None, max_shard_bytes: int) -> int:
    """Write the whole checkpoint into the empty directory `folder`, every file fsynced, manifest.json last;
    return the tensors' bytes written. With several ranks whose folders are not shared, the ranks other than 0 pass
    None: they take part in gathering every tensor only."""
    if folder is None:
        _write_sharded(None, "model", list(_model_tensors(src)), max_shard_bytes, src, {})
        if src.optimizer is not None:
            _write_sharded(None, "optimizer", list(_optimizer_tensors(src)), max_shard_bytes, src, {})
        return 0
    written, finish = _write_whole(src, folder, max_shard_bytes, keep_gathering=False)
    finish()
    return written


def _save_config(src: CheckpointContents, folder: str) -> None:
    config = getattr(src.model, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(folder)


def _write_folder(folder: str, model: list[Spec], optimizer: list[Spec] | None, trainer: dict[str, Any] | None,
                  max_shard_bytes: int, src: CheckpointContents | None) -> dict[str, dict[str, Any]]:
    """The shards, their indexes, trainer_state.json (with `optimizer`), and manifest.json last, listing
    these and whatever else is in `folder` already; returns the manifest's entries."""
    files: dict[str, dict[str, Any]] = {}  # manifest entries by file name
    small: dict[str, bytes] = {}  # the JSON files, written together with aiofiles
    small[MODEL_INDEX] = _write_sharded(folder, "model", model, max_shard_bytes, src, files)
    if optimizer is not None:
        small[OPTIMIZER_INDEX] = _write_sharded(folder, "optimizer", optimizer, max_shard_bytes, src, files)
        small[TRAINER_STATE] = _dumps(trainer)
    _finish_folder(folder, files, small)
    return files


def _finish_folder(folder: str, files: dict[str, dict[str, Any]], small: dict[str, bytes]) -> None:
    """Write the JSON files `small`, then manifest.json listing them, `files` (the shards' entries) and whatever
    else is in `folder`; fsync the folder."""
    _run(_write_files(folder, small))
    files.update({name: _whole_file(data) for name, data in small.items()})
    for name in sorted(os.listdir(folder)):  # config.json, and whatever else save_pretrained wrote
        if name not in files:
            files[name] = _fsync_and_sum(os.path.join(folder, name))
    _run(_write_files(folder, {MANIFEST: _dumps({"format": FORMAT, "files": files})}))
    _fsync_dir(folder)


def _adapter(src: CheckpointContents) -> tuple[dict[str, Any], list[Spec]]:
    """A PEFT model's active adapter: its config as PEFT saves it, and its parameters named as
    `get_peft_model_state_dict` names them (without the adapter's name)."""
    configs = getattr(src.model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        raise CheckpointError(f"adapters_only: {type(src.model).__name__} is not a PEFT model (it has no peft_config); "
                              "save the whole checkpoint, or offload the model get_peft_model returned")
    adapter = getattr(src.model, "active_adapter", None)
    adapter = adapter if isinstance(adapter, str) and adapter in configs else next(iter(configs))
    marker = f".{adapter}."
    tensors: list[Spec] = []
    masters = _with_masters(src)
    for unit in src.units:
        dtypes = {slot.name: slot.dtype for slot in unit.partition.layout.slots}
        for (fqn, _), shape in zip(unit.params, unit.shapes, strict=True):
            if marker in fqn and fqn in masters:
                tensors.append((fqn.replace(marker, ".", 1), torch.float32, shape,
                                _InPartition(unit.index, True, f"master.{fqn}")))
            elif marker in fqn:
                tensors.append((fqn.replace(marker, ".", 1), dtypes[fqn], shape, _InPartition(unit.index, False, fqn)))
    if not tensors:
        raise CheckpointError(f"adapters_only: no parameter of adapter {adapter!r} found (names with {marker!r})")
    config = configs[adapter].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}, tensors


def _write_adapters(src: CheckpointContents, folder: str | None) -> int:
    """A PEFT model's active adapter as PEFT's `save_pretrained` writes it, so `PeftModel.from_pretrained(base,
    folder)` loads it: adapter_model.safetensors and adapter_config.json; the base weights stay out. Returns the
    tensors' bytes. With several ranks whose folders are not shared, the ranks other than 0 pass None: they
    take part in gathering the adapter's units only."""
    config, tensors = _adapter(src)
    writer: SafetensorsWriter | _NoWriter = (
        SafetensorsWriter(os.path.join(folder, ADAPTER_WEIGHTS), [(n, d, s) for n, d, s, _ in tensors])
        if folder is not None else _NoWriter())
    held: tuple[int, bool] | None = None
    try:
        for name, _, _, source in tensors:
            assert isinstance(source, _InPartition)
            if held != (source.unit, False):
                _release(src, held)
                held = None
                views = _acquire(src, (source.unit, False))  # whole tensors, gathered with several ranks
                held = (source.unit, False)
            writer.write(name, views[source.slot])
    except BaseException:
        writer.discard()
        raise
    finally:
        _release(src, held)
    writer.close()
    if folder is not None:
        _finish_adapters(folder, config)
    return sum(_nbytes_of(t) for t in tensors) if folder is not None else 0


def _finish_adapters(folder: str, config: dict[str, Any]) -> None:
    _run(_write_files(folder, {ADAPTER_CONFIG: _dumps(config)}))
    _fsync_dir(folder)


def _write_adapters_by_ranks(src: CheckpointContents, folder: str, ranks: Ranks
                             ) -> tuple[int, Callable[[], None] | None]:
    """`_write_adapters` with each rank writing its chunks of the adapter's tensors into the file ([Note: each
    rank writes its own chunks]); rank 0 then writes adapter_config.json."""
    config, tensors = _adapter(src)
    path = os.path.join(folder, ADAPTER_WEIGHTS)
    specs = [(n, d, s) for n, d, s, _ in tensors]
    error = None
    if ranks.rank == 0:
        try:
            SafetensorsRangeWriter.create(path, specs)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised by all
            error = f"rank 0: {_said(exc, folder)}"
    _agree(ranks, "making the adapter's file", error)
    written, error = 0, None
    try:
        written = _write_my_chunks(src, path, tensors, ranks, {})
    except Exception as exc:  # noqa: BLE001
        error = f"rank {ranks.rank}: {_said(exc, folder)}"
    _agree(ranks, "finishing the adapter's file", error)
    return written, (lambda: _finish_adapters(folder, config)) if ranks.rank == 0 else None


def _write_sharded(folder: str | None, prefix: str, tensors: list[Spec], max_shard_bytes: int,
                   src: CheckpointContents | None, files: dict[str, dict[str, Any]],
                   failed: list[Exception] | None = None) -> bytes:
    """Write `tensors` into `<prefix>-k-of-n.safetensors` shards (their manifest entries go into `files`);
    return the index's JSON. With `failed` (rank 0 writing what all ranks gather), a write that fails is put
    there instead of raised, and nothing more is written, but every tensor is still acquired (gathered)."""
    weight_map: dict[str, str] = {}
    for name, shard in _plan_shards(prefix, tensors, max_shard_bytes):
        specs = [(n, d, s) for n, d, s, _ in shard]
        engine = src.swapper.engine if src is not None else None  # O_DIRECT through the swap's engine
        writer: SafetensorsWriter | _NoWriter = _NoWriter()
        if folder is not None and not failed:
            try:
                writer = SafetensorsWriter(os.path.join(folder, name), specs, engine=engine)
            except (OSError, TiermemError) as exc:
                if failed is None:
                    raise
                failed.append(exc)
        held: tuple[int, bool] | None = None  # (unit, state) of the partition acquired
        views: dict[str, torch.Tensor] = {}
        try:
            for tname, _, _, source in shard:
                weight_map[tname] = name
                if isinstance(source, torch.Tensor):  # a buffer
                    tensor = source
                elif not isinstance(source, _InPartition):  # made when it is written (write_checkpoint)
                    tensor = source()
                else:
                    assert src is not None
                    key = (source.unit, source.state)
                    if held != key:
                        _release(src, held)
                        held = None
                        views = _acquire(src, key)  # a failed read holds nothing
                        held = key
                    tensor = views[source.slot]
                    check_host(f"saving {tname!r}", tensor)
                try:
                    writer.write(tname, tensor)
                except (OSError, TiermemError) as exc:
                    if failed is None:
                        raise
                    failed.append(exc)
                    writer.discard()
                    writer = _NoWriter()
        except BaseException:
            writer.discard()
            raise
        finally:
            _release(src, held)
        try:
            writer.close()  # fsyncs the file
        except (OSError, TiermemError) as exc:
            if failed is None:
                raise
            failed.append(exc)
        if isinstance(writer, SafetensorsWriter):
            files[name] = {"bytes": writer.size, "header_crc32": writer.header_crc32, "tensors": writer.crc32}
    return _index(tensors, weight_map)


def _nbytes_of(item: Spec) -> int:
    return torch.empty(0, dtype=item[1]).element_size() * math.prod(item[2])


def _plan_shards(prefix: str, tensors: list[Spec], max_shard_bytes: int) -> list[tuple[str, list[Spec]]]:
    """`tensors` in order, cut into shards of at most `max_shard_bytes` (or one tensor), with their file names."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for item in tensors:
        nbytes = _nbytes_of(item)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return [(f"{prefix}-{k + 1:05d}-of-{len(shards):05d}.safetensors", shard) for k, shard in enumerate(shards)]


def _index(tensors: list[Spec], weight_map: dict[str, str]) -> bytes:
    return _dumps({"metadata": {"total_size": sum(_nbytes_of(t) for t in tensors)}, "weight_map": weight_map})


def _partition_for(src: CheckpointContents, key: tuple[int, bool]) -> Partition:
    index, state = key
    if not state:
        return src.units[index].partition
    assert src.optimizer is not None
    return src.optimizer.state_partition(index)


def _acquire(src: CheckpointContents, key: tuple[int, bool]) -> dict[str, torch.Tensor]:
    """The partition's tensors on the host; with several ranks the tensors whole, gathered from every rank
    (a copy: the partition is released at once, and `_release` has nothing to do)."""
    part = _partition_for(src, key)
    views = src.swapper.acquire(part, Tier.HOST)
    unit = src.units[key[0]]
    if not unit.ranks.sharded:
        return views
    try:
        if key[1]:
            assert src.optimizer is not None
            whole = src.optimizer.state_whole_layout(key[0])
        else:
            whole = unit.whole
        out = torch.empty(whole.size, dtype=torch.uint8)
        gather_unit(unit.ranks, part.flat(Tier.HOST), part.layout, whole, out)
        return whole.views(out)
    finally:
        src.swapper.release(part, tier=Tier.HOST)


def _release(src: CheckpointContents | None, key: tuple[int, bool] | None) -> None:
    if src is not None and key is not None and not src.units[key[0]].ranks.sharded:
        src.swapper.release(_partition_for(src, key), tier=Tier.HOST)


class _NoWriter:
    """What the ranks other than 0 write into while taking part in a save's gathers: nothing."""

    size = header_crc32 = 0
    crc32: dict[str, int] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def discard(self) -> None:
        pass

    def close(self) -> None:
        pass


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1).encode()


def _whole_file(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _fsync_and_sum(path: str) -> dict[str, Any]:
    """The manifest entry of a file written by someone else (transformers' config.json), fsynced."""
    with open(path, "rb") as f:
        data = f.read()
        os.fsync(f.fileno())
    return _whole_file(data)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _write_files(folder: str, contents: dict[str, bytes]) -> None:
    async def one(name: str, data: bytes) -> None:
        async with aiofiles.open(os.path.join(folder, name), "wb") as f:
            await f.write(data)
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())

    await asyncio.gather(*(one(name, data) for name, data in contents.items()))


async def _read_files(folder: str, names: list[str]) -> dict[str, bytes]:
    """The first MAX_JSON + 1 bytes of each file: regular files only, never through a symlink and never
    blocking ([Note: opening files that others made] in tiermem/io/files.py)."""
    async def one(name: str) -> bytes:
        async with aiofiles.open(os.path.join(folder, name), "rb",
                                 opener=lambda path, _: open_regular(path, follow_links=False)) as f:
            return await f.read(MAX_JSON + 1)

    datas = await asyncio.gather(*(one(name) for name in names), return_exceptions=True)
    for name, data in zip(names, datas, strict=True):
        if isinstance(data, OSError):
            raise unreadable_file(os.path.join(folder, name), data) from None
        if isinstance(data, BaseException):
            raise data
    return dict(zip(names, datas, strict=True))  # type: ignore[arg-type]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, also when the caller is itself inside a running event loop (then on a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# -- replacing (see [Note: replacing a checkpoint]) -------------------------------------------------
def _install(tmp: str, final: str) -> None:
    """Put the complete checkpoint `tmp` at `final`; a previous one there is removed once it is replaced."""
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # another save put a checkpoint there meanwhile: replace it like any other
        else:
            _fsync_dir(parent)
            return
    try:
        _exchange(tmp, final)
    except OSError as exc:
        if exc.errno not in _NO_EXCHANGE:
            raise
        if parent not in _warned_no_exchange:
            _warned_no_exchange.add(parent)
            log.warning("%s: the filesystem cannot exchange two directories (RENAME_EXCHANGE: %s); checkpoints "
                        "here are replaced by two renames, and a save killed between them is repaired by the "
                        "next save or load", parent, exc.strerror)
        _replace_by_renames(tmp, final)
        return
    _fsync_dir(parent)
    shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint, now under the temporary name


def _replace_by_renames(tmp: str, final: str) -> None:
    """The fallback without RENAME_EXCHANGE: `final` is missing between the two renames."""
    old = f"{final}.old-{os.getpid()}"
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)  # the previous checkpoint goes back
        raise
    _fsync_dir(os.path.dirname(final))
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: str, b: str) -> None:
    """Swap the directory entries `a` and `b` in one step: renameat2(RENAME_EXCHANGE). Raises OSError with
    EINVAL or ENOSYS where the filesystem or the kernel cannot."""
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, "renameat2 is Linux-only", a)
    libc = _libc()
    fa, fb = os.fsencode(a), os.fsencode(b)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        renameat2.restype = ctypes.c_int
        rc = renameat2(_AT_FDCWD, fa, _AT_FDCWD, fb, _RENAME_EXCHANGE)
    else:
        number = _RENAMEAT2_SYSCALL.get(platform.machine())
        if number is None:
            raise OSError(errno.ENOSYS, f"no renameat2 in libc and no syscall number for {platform.machine()}", a)
        libc.syscall.restype = ctypes.c_long
        rc = libc.syscall(ctypes.c_long(number), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(fa),
                          ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(fb), ctypes.c_uint(_RENAME_EXCHANGE))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a, None, b)


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _settle(final: str) -> list[int]:
    """Remove what dead writers of `final` left; if one died between the fallback's two renames, put a
    checkpoint back at `final` first. Returns the PIDs of live writers, whose leftovers stay."""
    parent, name = os.path.split(final)
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    dead: list[tuple[str, str]] = []  # (tmp | old, path)
    live: list[int] = []
    for entry in entries:
        match = _LEFTOVER.fullmatch(entry[len(name):]) if entry.startswith(name) else None
        if match is None:
            continue
        pid = int(match.group(2))
        if _alive(pid):
            live.append(pid)
        else:
            dead.append((match.group(1), os.path.join(parent, entry)))
    if dead and not live and not os.path.lexists(final):
        _restore(final, dead)
    for _, path in dead:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
    return live


def _restore(final: str, dead: list[tuple[str, str]]) -> None:
    """A writer died between the two renames: its new checkpoint (complete when its manifest is there), else
    its old one, goes back to `final`."""
    def newest(paths: list[str]) -> list[str]:
        return sorted(paths, key=lambda p: os.stat(p).st_mtime, reverse=True)

    complete = newest([p for kind, p in dead if kind == "tmp" and os.path.isfile(os.path.join(p, MANIFEST))])
    previous = newest([p for kind, p in dead if kind == "old" and os.path.isfile(os.path.join(p, MODEL_INDEX))])
    for candidate in complete + previous:
        try:
            os.rename(candidate, final)
        except OSError:
            continue  # gone, or another process restored one first
        _fsync_dir(os.path.dirname(final))
        log.warning("%s was missing: a save was killed while replacing it; %s was put back in its place",
                    final, candidate)
        return


def _alive(pid: int) -> bool:
    """Whether process `pid` may still be writing; unsure counts as alive."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


# -- checking (see [Note: checked loading]) ---------------------------------------------------------
@dataclass
class _Checked:
    """A checkpoint that passed every check: its open readers and parsed trainer state."""

    weights: SafetensorsCheckpoint
    states: SafetensorsCheckpoint | None = None  # the optimizer shards, when the optimizer state is loaded
    trainer: dict[str, Any] = field(default_factory=dict)  # trainer_state.json, when it is loaded
    crc32: dict[str, int] = field(default_factory=dict)  # tensor name -> its CRC-32 in the manifest
    # with several ranks: tensor name -> the CRC-32 of each rank's chunk of it, taken in the check
    chunks: dict[str, list[int]] = field(default_factory=dict)

    def read_into(self, reader: SafetensorsCheckpoint, engine: Any, name: str, target: torch.Tensor) -> None:
        """Read one tensor for loading, checked again against the manifest (the drive may return other bytes
        than in the check's read)."""
        self._same(name, reader.read_into(engine, name, target), self.crc32[name])

    def read_mine(self, reader: SafetensorsCheckpoint, engine: Any, name: str, shape: tuple[int, ...], ranks: Ranks,
                  target: torch.Tensor) -> None:
        """Read this rank's chunk of one tensor into `target` (1-D, padded), checked against its CRC-32 taken in
        the check."""
        start, end = ranks.my_range(math.prod(shape))
        got = reader.read_range_into(engine, name, shape, start, target[: end - start])
        self._same(name, got, self.chunks[name][ranks.rank])

    @staticmethod
    def _same(name: str, got: int, want: int) -> None:
        if got != want:
            raise CheckpointError(f"tensor {name!r} read {got:08x}, not the {want:08x} it was checked with a moment "
                                  "ago: the drive returned other bytes")

    def close(self) -> None:
        self.weights.close()
        if self.states is not None:
            self.states.close()


def _check(src: CheckpointContents, folder: str) -> _Checked:
    """Check everything `_load` will read; raise CheckpointError naming the file (and tensor) otherwise."""
    if not os.path.exists(os.path.join(folder, MODEL_INDEX)):
        raise CheckpointError(f"{folder}: no {MODEL_INDEX}; is this a tiermem checkpoint directory?")
    if not os.path.exists(os.path.join(folder, MANIFEST)):
        raise CheckpointError(f"{folder}: no {MANIFEST}, so nothing says the checkpoint is complete and intact: its "
                              "save did not finish, or a tiermem older than checksums wrote it. Save it again, or "
                              "stream only its weights with tiered_offload(model, "
                              f"checkpoint={os.path.join(folder, MODEL_INDEX)!r})")
    files = _check_manifest(folder)
    small = [n for n, e in files.items() if "crc32" in e]
    large = [n for n in small if files[n]["bytes"] > MAX_JSON]
    if large:
        raise CheckpointError(f"{os.path.join(folder, large[0])}: {files[large[0]]['bytes']} bytes, more than the "
                              f"{MAX_JSON >> 20} MiB any JSON file of a checkpoint holds; the checkpoint is damaged. "
                              "Nothing was loaded; use an intact copy")
    contents = _run(_read_files(folder, small))
    for name in small:
        got = zlib.crc32(contents[name])
        if got != files[name]["crc32"]:
            raise CheckpointError(f"{os.path.join(folder, name)}: its CRC-32 is {got:08x}, {MANIFEST} says "
                                  f"{files[name]['crc32']:08x}: the file was changed or damaged after the save. "
                                  "Nothing was loaded; use an intact copy of the checkpoint")
    _check_index(folder, MODEL_INDEX, files, contents)
    weights = SafetensorsCheckpoint(os.path.join(folder, MODEL_INDEX), follow_links=False)
    checked = _Checked(weights)
    try:
        _check_shards(weights, files)
        _check_model(src, weights)
        if src.optimizer is not None:
            _check_optimizer(src, folder, files, contents, checked)
        ranks = src.units[0].ranks if src.units else Ranks()
        checked.chunks = _verify_checksums([r for r in (checked.weights, checked.states) if r is not None], files,
                                           ranks)
        checked.crc32 = {name: crc for e in files.values() for name, crc in e.get("tensors", {}).items()}
    except BaseException:
        checked.close()
        raise
    return checked


def _check_index(folder: str, name: str, files: dict[str, dict[str, Any]], contents: dict[str, bytes]) -> None:
    """Every shard the index `name` names (its bytes checked against the manifest already) is a shard the
    manifest lists: checked before any shard is opened."""
    path = os.path.join(folder, name)
    index = parse_json(path, contents.get(name, b""))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: no 'weight_map' object; the checkpoint is damaged. Nothing was loaded; use "
                              "an intact copy")
    for shard in weight_map.values():
        if not plain_name(shard) or "tensors" not in files.get(shard, {}):
            raise CheckpointError(f"{path} names the shard {shard!r}, which {MANIFEST} does not list; the index was "
                                  "changed after the save. Nothing was loaded; use an intact copy")


def _check_manifest(folder: str) -> dict[str, dict[str, Any]]:
    """manifest.json's file entries, after checking that each file is there, a regular file, with its size."""
    path = os.path.join(folder, MANIFEST)
    manifest = parse_json(path, _run(_read_files(folder, [MANIFEST]))[MANIFEST])
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(_manifest_entry(n, e) for n, e in files.items()):
        raise CheckpointError(f"{path}: not a tiermem manifest (expected {{'format': {FORMAT}, 'files': {{name: "
                              "{'bytes', 'crc32' or 'header_crc32' and 'tensors'}}}}); the checkpoint is damaged")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}; this tiermem reads format {FORMAT}. Load it "
                              "with the tiermem that saved it, or stream its weights with checkpoint=")
    for name, entry in files.items():
        file = os.path.join(folder, name)
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: missing, but {MANIFEST} lists it; the checkpoint is incomplete. Nothing "
                                  "was loaded; use an intact copy of the checkpoint") from None
        try:
            refuse_unless_regular(st, file)  # before it is opened: a FIFO would block, /dev/zero never end
        except OSError as exc:
            raise unreadable_file(file, exc) from None
        size = st.st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, but {MANIFEST} says {entry['bytes']}: the file was "
                                  "truncated or replaced after the save. Nothing was loaded; use an intact copy")
    return files


def _manifest_entry(name: Any, entry: Any) -> bool:
    if not plain_name(name):
        return False
    if not isinstance(entry, dict) or not _count(entry.get("bytes")):
        return False
    if "crc32" in entry:
        return _count(entry["crc32"])
    tensors = entry.get("tensors")
    return (_count(entry.get("header_crc32")) and isinstance(tensors, dict)
            and all(isinstance(k, str) and _count(v) for k, v in tensors.items()))


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_shards(reader: SafetensorsCheckpoint, files: dict[str, dict[str, Any]]) -> None:
    """Each shard the index names is in the manifest, with the same header and the same tensors."""
    for path, tensors in reader.shards.items():
        entry = files.get(os.path.basename(path))
        if os.path.dirname(path) != os.path.dirname(reader.path) or entry is None or "tensors" not in entry:
            raise CheckpointError(f"{reader.path} names the shard {path}, which {MANIFEST} does not list; the "
                                  "index was changed after the save. Nothing was loaded; use an intact copy")
        if reader.header_crc32[path] != entry["header_crc32"]:
            raise CheckpointError(f"{path}: the safetensors header does not match its CRC-32 in {MANIFEST}: it was "
                                  "changed or damaged after the save. Nothing was loaded; use an intact copy")
        if set(tensors) != set(entry["tensors"]):
            extra = sorted(set(tensors) ^ set(entry["tensors"]))
            raise CheckpointError(f"{path}: tensors {extra[:5]} are in the header or in {MANIFEST} but not in "
                                  "both; the checkpoint is damaged. Nothing was loaded; use an intact copy")


def _check_tensor(reader: SafetensorsCheckpoint, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  what: str) -> None:
    entry = reader.entries.get(name)
    if entry is None:
        raise CheckpointError(f"{reader.path}: no tensor {name!r} ({what}); the checkpoint was saved from another "
                              "model or optimizer, or is incomplete. Nothing was loaded")
    if entry.shape != tuple(shape):
        raise CheckpointError(f"{entry.path}: tensor {name!r} has shape {list(entry.shape)} but {what} has "
                              f"{list(shape)}; the checkpoint was saved from another model config. Nothing was "
                              "loaded")
    if entry.dtype != dtype and not (entry.dtype.is_floating_point and dtype.is_floating_point):
        raise CheckpointError(f"{entry.path}: tensor {name!r} is {entry.dtype} but {what} is {dtype}, which cannot "
                              "be converted; the checkpoint was saved from another model. Nothing was loaded")


def _check_model(src: CheckpointContents, weights: SafetensorsCheckpoint) -> None:
    names = [fqn for u in src.units for fqn, _ in u.params]
    missing = sorted(n for n in names if n not in weights.entries)
    if missing:
        raise CheckpointError(f"{os.path.dirname(weights.path)}: parameters {missing[:5]} are not in the checkpoint; "
                              "it was saved from another model")
    for unit in src.units:
        dtypes = {s.name: s.dtype for s in unit.partition.layout.slots}
        for (fqn, _), shape in zip(unit.params, unit.shapes, strict=True):
            _check_tensor(weights, fqn, shape, dtypes[fqn], f"the model's parameter {fqn!r}")
    for name, buf in persistent_buffers(src.model):
        _check_tensor(weights, name, tuple(buf.shape), buf.dtype, f"the model's buffer {name!r}")


def _check_optimizer(src: CheckpointContents, folder: str, files: dict[str, dict[str, Any]], contents: dict[str, bytes],
                     checked: _Checked) -> None:
    opt = src.optimizer
    assert opt is not None
    state_path = os.path.join(folder, TRAINER_STATE)
    if TRAINER_STATE not in contents:
        raise CheckpointError(f"{folder}: no {TRAINER_STATE}; the checkpoint holds no optimizer state (it was saved "
                              "without an optimizer). Load it into tiered_offload(model) without optimizer=")
    saved = parse_json(state_path, contents[TRAINER_STATE])
    _check_trainer_state(src, saved, state_path)
    checked.trainer = saved
    expected = list(_optimizer_tensors(src))
    if not expected:
        return
    if OPTIMIZER_INDEX not in files:
        raise CheckpointError(f"{os.path.join(folder, OPTIMIZER_INDEX)}: missing, but {TRAINER_STATE} records "
                              f"optimizer state {saved['state_kinds']} for {len(saved['steps'])} parameters. Nothing "
                              "was loaded; use an intact copy of the checkpoint")
    _check_index(folder, OPTIMIZER_INDEX, files, contents)
    checked.states = SafetensorsCheckpoint(os.path.join(folder, OPTIMIZER_INDEX), follow_links=False)
    _check_shards(checked.states, files)
    for name, dtype, shape, _ in expected:
        _check_tensor(checked.states, name, shape, dtype, f"the optimizer state {name!r}")


def _check_trainer_state(src: CheckpointContents, saved: Any, path: str) -> None:
    """trainer_state.json is well-formed and agrees with the optimizer."""
    opt = src.optimizer
    assert opt is not None

    def malformed(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; tm.save_checkpoint did not write this file as it is. Nothing was "
                               "loaded; use an intact copy of the checkpoint")

    if not isinstance(saved, dict):
        raise malformed("expected a JSON object")
    if saved.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {saved.get('format')!r}; this tiermem reads format {FORMAT}")
    if saved.get("optimizer") != opt.kind.__name__:
        raise CheckpointError(f"{path}: saved with {saved.get('optimizer')}, loading into {opt.kind.__name__}; "
                              "use the same optimizer type")
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise malformed("'param_groups' is not a list of objects")
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"{path}: {len(groups)} param groups saved, the optimizer has {len(opt.param_groups)}")
    name_of = _param_names(src)
    for k, (group, stored) in enumerate(zip(opt.param_groups, groups, strict=True)):
        names = stored.get("params")
        if not isinstance(names, list) or sorted(map(str, names)) != sorted(name_of[id(p)] for p in group["params"]):
            raise CheckpointError(f"{path}: param group {k} was saved with other parameters than the optimizer's "
                                  f"group {k} holds; build the optimizer with the param groups it was saved with")
        for key, value in stored.items():
            why = None if key == "params" else _unlike(value, group.get(key))
            if why is not None:
                raise malformed(f"param group {k}: {key!r} is {json.dumps(value)[:80]}, {why}")
    if saved.get("state_kinds") != opt.state_kinds():
        raise CheckpointError(f"{path}: saved with optimizer state {saved.get('state_kinds')}, this optimizer keeps "
                              f"{opt.state_kinds()}; use the settings it was saved with (amsgrad, momentum, "
                              "params.dtype)")
    steps = saved.get("steps")
    if not isinstance(steps, dict) or not all(_count(n) for n in steps.values()):
        raise malformed("'steps' is not an object of step counts")
    scale = saved.get("loss_scale")
    if scale is not None and not (isinstance(scale, dict) and all(
            isinstance(scale.get(k), int | float) and not isinstance(scale.get(k), bool) and math.isfinite(scale[k])
            for k in ("scale", "good_steps", "skipped_steps"))):
        raise malformed("'loss_scale' is not an object with finite scale, good_steps and skipped_steps")
    scalars = saved.get("scalars", {})  # absent before NAdam and ASGD were supported
    if not isinstance(scalars, dict) or not all(
            isinstance(kept, dict) and all(isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
                                           and math.isfinite(v) for k, v in kept.items()) for kept in scalars.values()):
        raise malformed("'scalars' is not an object of per-parameter objects of finite numbers")
    unknown = sorted((set(steps) | set(scalars)) - set(opt.trained()))
    if unknown:
        raise CheckpointError(f"{path}: optimizer state for {unknown[:5]}, which this optimizer does not train; it was "
                              "saved from another model or with other param groups")


def _unlike(value: Any, current: Any) -> str | None:
    """Why `value`, a param-group setting read from trainer_state.json, cannot replace `current`, the optimizer's
    own value for it (None: absent from its group), or None when it can: the same kind of value (a number for a
    number or a tensor, a list of as many numbers for a tuple, a bool, a string), and a finite number unless the
    optimizer's own is not finite. Loading sets it in the group, and torch's step then computes with it."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    def finite(v: Any, like: Any) -> bool:
        return math.isfinite(v) or (number(like) and not math.isfinite(like))

    if isinstance(current, bool):
        return None if isinstance(value, bool) else f"where the optimizer's is a bool ({current})"
    if number(current) or (isinstance(current, torch.Tensor) and current.numel() == 1):
        like = float(current)
        if not number(value):
            return f"where the optimizer's is the number {like}"
        return None if finite(value, like) else f"not a finite number (the optimizer's is {like})"
    if isinstance(current, tuple | list):
        if not (isinstance(value, list) and len(value) == len(current) and all(map(number, value))):
            return f"where the optimizer's is {len(current)} numbers ({list(current)})"
        bad = [v for v, c in zip(value, current, strict=True) if not finite(v, c)]
        return f"not all finite numbers (the optimizer's are {list(current)})" if bad else None
    if isinstance(current, str):
        return None if isinstance(value, str) else f"where the optimizer's is the string {current!r}"
    if value is None or isinstance(value, bool | str):  # the optimizer has None here, or no such setting
        return None
    if number(value):
        return None if math.isfinite(value) else "not a finite number"
    if isinstance(value, list) and all(map(number, value)):
        return None if all(map(math.isfinite, value)) else "not all finite numbers"
    return "not a number, string, boolean, null or list of numbers"


def _verify_checksums(readers: list[SafetensorsCheckpoint], files: dict[str, dict[str, Any]],
                      ranks: Ranks) -> dict[str, list[int]]:
    """Read every tensor of the shards behind `readers` and compare its CRC-32 with the manifest's. With several
    ranks each reads a 1/N run of the tensors (by bytes, in file order), and also takes the CRC-32 of each
    rank's chunk of those; all ranks then share what they found (returned: tensor name -> its chunks'
    CRC-32s), and every rank raises the first error any found, so each reads 1/N of the checkpoint to check
    it and 1/N to load it."""
    shards: list[tuple[SafetensorsCheckpoint, str, set[str] | None]] = [(r, path, None) for r in readers
                                                                         for path in r.shards]
    if ranks.sharded:  # this rank's run of the tensors, in file order
        tensors = [(r, path, name, e.nbytes) for r, path, _ in shards
                   for name, e in sorted(r.shards[path].items(), key=lambda kv: kv[1].offset)]
        total, at = sum(t[3] for t in tensors), 0
        picked: dict[str, tuple[SafetensorsCheckpoint, set[str]]] = {}
        for r, path, name, nbytes in tensors:
            if at * ranks.world // max(total, 1) == ranks.rank or (total == 0 and ranks.rank == 0):
                picked.setdefault(path, (r, set()))[1].add(name)
            at += nbytes
        shards = [(r, path, names) for path, (r, names) in picked.items()]
    parts = ranks.world if ranks.sharded else 1
    found: dict[str, list[int]] = {}
    error = None
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(shards)))) as pool:  # zlib and reads release the GIL
            sums = list(pool.map(lambda rpn: rpn[0].checksums(rpn[1], parts, rpn[2]), shards))
        for (_, path, _), got in zip(shards, sums, strict=True):
            want = files[os.path.basename(path)]["tensors"]
            bad = [name for name in got if got[name][0] != want[name]]
            if bad:
                name = bad[0]
                more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
                raise CheckpointError(f"{path}: tensor {name!r}{more} does not match its CRC-32 in {MANIFEST} (read "
                                      f"{got[name][0]:08x}, saved {want[name]:08x}): its bytes were damaged after "
                                      "the save. Nothing was loaded; use an intact copy of the checkpoint")
            found.update({name: crcs[1:] for name, crcs in got.items()})
    except CheckpointError as exc:
        if not ranks.sharded:
            raise
        error = str(exc)
    if not ranks.sharded:
        return {}
    every = ranks.all_gather_object("sharing what checking the checkpoint found", (error, found))
    errors = [e for e, _ in every if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    return {name: crcs for _, seen in every for name, crcs in seen.items()}


# -- loading ------------------------------------------------------------------------------------------
def _load(src: CheckpointContents, checked: _Checked) -> None:
    """Read a checked checkpoint into the partitions, buffers and optimizer."""
    weights = checked.weights
    engine = src.swapper.engine
    for unit in src.units:
        views = src.swapper.acquire(unit.partition, Tier.HOST)
        try:
            for (fqn, _), shape in zip(unit.params, unit.shapes, strict=True):
                _read(checked, weights, engine, fqn, views[fqn], unit.ranks, shape)
        finally:
            src.swapper.release(unit.partition, dirty=True, tier=Tier.HOST)
    for name, buf in persistent_buffers(src.model):  # buffers live on the device: read on the host, then copy
        staged = torch.empty(buf.shape, dtype=buf.dtype)
        checked.read_into(weights, engine, name, staged)
        with torch.no_grad():
            buf.copy_(staged)
    opt = src.optimizer
    if opt is None:
        return
    saved = checked.trainer
    for group, stored in zip(opt.param_groups, saved["param_groups"], strict=True):
        for k, v in stored.items():
            if k != "params":
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    opt.load_loss_scale_state(saved.get("loss_scale"))
    opt.load_step_counts(saved["steps"])
    opt.load_scalar_state(saved.get("scalars", {}))
    by_unit: dict[int, list[StateTensor]] = {}
    for t in opt.state_tensors():
        by_unit.setdefault(t.unit, []).append(t)
    for index, tensors in by_unit.items():
        assert checked.states is not None  # _check_optimizer opened it: there are tensors to read
        part = opt.state_partition(index)
        views = src.swapper.acquire(part, Tier.HOST)
        try:
            for t in tensors:
                _read(checked, checked.states, engine, t.name, views[t.slot], src.units[index].ranks, t.shape)
        finally:
            src.swapper.release(part, dirty=True, tier=Tier.HOST)


def _read(checked: _Checked, reader: SafetensorsCheckpoint, engine: Any, name: str, target: torch.Tensor,
          ranks: Ranks, shape: tuple[int, ...]) -> None:
    """Load tensor `name` into `target`: whole, or with several ranks this rank's chunk of it."""
    if not ranks.sharded:
        checked.read_into(reader, engine, name, target)
        return
    checked.read_mine(reader, engine, name, shape, ranks, target.reshape(-1))
