"""What a rank keeps of the weights and optimizer state when a with-block raised under several ranks, and
putting the ranks' shares back together into a checkpoint.

# [Note: rescue at several ranks]
With N ranks each keeps 1/N of every parameter and of its optimizer state, and giving the parameters back
on exit means gathering every unit from every rank. After a with-block raised, that cannot be counted on:
the other ranks may be waiting in a collective of the failed step or be gone, and gathering then could pair
the wrong collectives. So the parameters are left on the meta device (`_unpack` in tiermem/offload.py).
But each rank still holds its own chunks, in its host tier or its swap files, and reading them needs no
other rank. So when the context has trained since entry and since its last checkpoint, each rank writes
what it holds, before the swap goes, to a new directory beside its swap,
`<first nvme.paths entry>/tiermem-rescue-rank{R}-of-{N}-<time>`:
- `unit-{K}.safetensors`, one per unit: this rank's chunk (1-D, padded as in the tiers) of each of the
  unit's parameters, and with an optimizer of each of their state tensors ("<param>::<kind>", as a
  checkpoint names them); the header's metadata gives each tensor's whole shape and dtype, and which are
  optimizer state;
- `buffers.safetensors`: the model's persistent buffers, whole; `config.json`: its config (transformers);
- `rescue.json` last: rank, world, the unit files, the units that could not be read (with why), and with an
  optimizer its trainer state (param groups, steps, loss scale: what a checkpoint's trainer_state.json
  holds).
The weights and state are those of the last applied step: exit applies recorded updates before this (the
update of a rank's chunk needs no other rank).

`tiermem rescue DIR_RANK0 DIR_RANK1 ... --out DIR` (or `join(dirs, out)`) checks that the directories are
ranks 0..N-1 of one rescue, puts each tensor together from the N chunks, one tensor in memory at a time,
and writes DIR as `tm.save_checkpoint` would have at the failed step: `tm.load_checkpoint(DIR)` resumes
training with any number of ranks, and transformers' `from_pretrained(DIR)` loads the weights. Directories
of version 1 (weights only, no buffers or optimizer state) join into a checkpoint of the weights alone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from tiermem.checkpointing import CheckpointContents, Spec, persistent_buffers, trainer_state, write_checkpoint
from tiermem.distributed import Ranks
from tiermem.errors import CheckpointError
from tiermem.runtime.safetensors_io import SafetensorsCheckpoint, SafetensorsWriter
from tiermem.swap import Tier

log = logging.getLogger(__name__)

MANIFEST = "rescue.json"
BUFFERS = "buffers.safetensors"
CONFIG = "config.json"
VERSION = 2  # 1: weights only


PREFIX = "tiermem-rescue-rank"  # every rescue folder's name begins so
_OURS = (MANIFEST, BUFFERS, CONFIG)  # with unit-*.safetensors, the files a rescue folder holds


def found_in(paths: Sequence[str]) -> list[tuple[str, int]]:
    """(folder, bytes) of every rescue folder directly under `paths` (earlier runs' shares, kept until joined
    or removed)."""
    found = []
    for base in paths:
        try:
            entries = sorted(os.scandir(base), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False):
                found.append((e.path, _bytes_in(e.path)))
    return found


def _bytes_in(folder: str) -> int:
    total = 0
    try:
        for e in os.scandir(folder):
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def remove(folder: str | os.PathLike[str]) -> int:
    """Delete a rescue folder (only one whose name and files are a rescue's); return the bytes it held."""
    path = os.fspath(folder)
    name = os.path.basename(os.path.normpath(path))
    if os.path.islink(path) or not os.path.isdir(path) or not name.startswith(PREFIX):
        raise CheckpointError(f"{path}: not a rescue folder (a directory named {PREFIX}R-of-N-...); nothing removed")
    others = [e.name for e in os.scandir(path) if not (e.is_file(follow_symlinks=False) and (
        e.name in _OURS or (e.name.startswith("unit-") and e.name.endswith(".safetensors"))
        or e.name.startswith(".")))]
    if others:
        raise CheckpointError(f"{path}: holds {', '.join(sorted(others)[:5])}, which a rescue folder does not; "
                              "nothing removed (remove it yourself if you are sure)")
    size = _bytes_in(path)
    for e in list(os.scandir(path)):
        os.unlink(e.path)
    os.rmdir(path)
    return size


def write(src: CheckpointContents, ranks: Ranks, base: str) -> str:
    """Write this rank's chunks of every unit's weights and optimizer state, and the model's buffers, to a new
    directory under `base`; return it. A unit that cannot be read is named in the manifest, not fatal."""
    folder = os.path.join(base, f"{PREFIX}{ranks.rank}-of-{ranks.world}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(folder, mode=0o700)  # a new directory: fails rather than write into something already there
    opt = src.optimizer
    states: dict[int, list[Any]] = {}
    for t in opt.state_tensors() if opt is not None else ():
        states.setdefault(t.unit, []).append(t)
    written: list[str] = []
    lost: dict[str, str] = {}
    for unit in src.units:
        name = f"unit-{unit.index:04d}.safetensors"
        dtypes = {s.name: s.dtype for s in unit.partition.layout.slots}  # as stored: what a checkpoint holds
        pieces = [(unit.partition, [(fqn, fqn, tuple(shape), dtypes[fqn])
                                    for (fqn, _), shape in zip(unit.params, unit.shapes, strict=True)])]
        if opt is not None and unit.index in states:
            pieces.append((opt.state_partition(unit.index),
                           [(t.slot, t.name, t.shape, torch.float32) for t in states[unit.index]]))
        try:
            _write_unit(os.path.join(folder, name), src, pieces)
            written.append(name)
        except Exception as exc:  # noqa: BLE001 - named in the manifest
            lost[unit.name] = str(exc)
    buffers = "none"
    try:
        if any(True for _ in persistent_buffers(src.model)):
            _create(os.path.join(folder, BUFFERS), [(n, b.detach().cpu()) for n, b in persistent_buffers(src.model)])
            buffers = BUFFERS
    except Exception as exc:  # noqa: BLE001 - named in the manifest; the weights and state are written
        buffers = f"lost: {exc}"
    config = getattr(src.model, "config", None)
    if config is not None and callable(getattr(config, "to_json_file", None)):
        try:
            config.to_json_file(os.path.join(folder, CONFIG))
        except Exception as exc:  # noqa: BLE001 - the weights matter more; from_pretrained then needs one given
            log.warning("tiermem rescue: the model's config could not be written (%s)", exc)
    manifest = {"format": "tiermem-rescue", "version": VERSION, "rank": ranks.rank, "world": ranks.world,
                "files": written, "lost": lost, "buffers": buffers,
                "trainer_state": trainer_state(src) if opt is not None else None}
    with open(os.path.join(folder, MANIFEST), "x", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return folder


def _write_unit(path: str, src: CheckpointContents, pieces: list[tuple[Any, list[Any]]]) -> None:
    """One unit's file: for each (partition, [(slot, name, whole shape, dtype)]) its chunks, read from the
    partition held on the host (weights and state together, as a step holds them) while they are written."""
    held: list[dict[str, torch.Tensor]] = []
    try:
        for part, _ in pieces:
            held.append(src.swapper.acquire(part, Tier.HOST))
        meta = {"shapes": json.dumps({n: list(s) for _, slots in pieces for _, n, s, _ in slots}),
                "dtypes": json.dumps({n: str(d).removeprefix("torch.") for _, slots in pieces for _, n, _, d in slots}),
                "optimizer": json.dumps([n for _, slots in pieces[1:] for _, n, _, _ in slots])}
        _create(path, [(name, views[slot]) for views, (_, slots) in zip(held, pieces, strict=True)
                       for slot, name, _, _ in slots], meta)
    finally:
        for part, _ in pieces[:len(held)]:
            src.swapper.release(part, tier=Tier.HOST)


def _create(path: str, tensors: list[tuple[str, torch.Tensor]], meta: dict[str, str] | None = None) -> None:
    """A new safetensors file at `path` (never one already there), fsynced; removed if writing fails."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    writer = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors], meta)
    try:
        for name, tensor in tensors:
            writer.write(name, tensor)
        writer.close()
    except BaseException:
        writer.discard()
        raise


def join(folders: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> str:
    """Put the ranks' rescued chunks together into the checkpoint directory `out`; return its path."""
    manifests = [_manifest(os.fspath(d)) for d in folders]
    world = manifests[0]["world"]
    ranks = sorted(m["rank"] for m in manifests)
    if ranks != list(range(world)) or any(m["world"] != world for m in manifests):
        raise CheckpointError(f"tiermem rescue: the directories hold ranks {ranks} of {[m['world'] for m in manifests]}"
                              f" ranks; give one directory for each of the {world} ranks of the same rescue")
    by_rank = {m["rank"]: m for m in manifests}
    lost = sorted({u for m in manifests for u in m["lost"]})
    if lost:
        why = next(m["lost"][u] for m in manifests for u in m["lost"])
        raise CheckpointError(f"tiermem rescue: units {lost[:5]} could not be read on some rank ({why}); their "
                              "parameters are lost, the rest cannot be put together without them")
    files = by_rank[0]["files"]
    if any(by_rank[r]["files"] != files for r in range(world)) or len(
            {json.dumps(m.get("trainer_state"), sort_keys=True) for m in manifests}) != 1:
        raise CheckpointError("tiermem rescue: the ranks wrote different units or optimizer steps; the directories "
                              "are not of one rescue")
    first = by_rank[0]["dir"]
    model: list[Spec] = []
    optimizer: list[Spec] = []
    for file in files:
        row = [SafetensorsCheckpoint(os.path.join(by_rank[r]["dir"], file)) for r in range(world)]
        meta = row[0].metadata[row[0].path]
        shapes, dtypes = json.loads(meta["shapes"]), json.loads(meta["dtypes"])
        states = set(json.loads(meta.get("optimizer", "[]")))
        for name, shape in shapes.items():
            dtype = getattr(torch, dtypes[name])
            kept = optimizer if name in states else model
            kept.append((name, dtype, tuple(shape), _whole(row, name, shape, dtype)))
    buffers = by_rank[0].get("buffers", "none")  # rank 0's, as a checkpoint holds
    if buffers == BUFFERS:
        reader = SafetensorsCheckpoint(os.path.join(first, BUFFERS))
        model += [(n, e.dtype, e.shape, partial(_read, reader, n)) for n, e in reader.entries.items()]
    elif buffers != "none":
        log.warning("tiermem rescue: rank 0 could not write the model's buffers (%s); the checkpoint holds the "
                    "weights and optimizer state without them", buffers.removeprefix("lost: "))
    trainer = by_rank[0].get("trainer_state")
    config = os.path.join(first, CONFIG)
    return write_checkpoint(out, model, optimizer if trainer is not None else None, trainer,
                            [config] if os.path.exists(config) else [])


def _whole(row: list[SafetensorsCheckpoint], name: str, shape: list[int],
           dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """What returns tensor `name` whole, from its chunks on every rank."""
    return lambda: torch.cat([_read(r, name) for r in row])[: torch.Size(shape).numel()].reshape(shape).to(dtype)


def _manifest(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {MANIFEST}; not a tiermem rescue directory, or its rank was killed "
                              "before it finished writing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != "tiermem-rescue":
        raise CheckpointError(f"{path}: not a tiermem rescue manifest")
    if m.get("version") not in (1, VERSION):
        raise CheckpointError(f"{path}: rescue version {m.get('version')!r}; this tiermem joins versions 1 and "
                              f"{VERSION}. Join it with the tiermem that wrote it")
    m["dir"] = folder
    return m


def _read(reader: SafetensorsCheckpoint, name: str) -> torch.Tensor:
    e = reader.entries[name]
    with open(e.path, "rb") as f:
        f.seek(e.offset)
        data = bytearray(f.read(e.nbytes))
    return torch.frombuffer(data, dtype=e.dtype).reshape(e.shape) if data else torch.empty(e.shape, dtype=e.dtype)
