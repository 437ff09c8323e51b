"""What a rank keeps of the weights when a with-block raised under several ranks, and putting the ranks'
shares back together.

# [Note: rescue at several ranks]
With N ranks each keeps 1/N of every parameter, and giving the parameters back on exit means gathering
every unit from every rank. After a with-block raised, that cannot be counted on: the other ranks may be
waiting in a collective of the failed step or be gone, and gathering then could pair the wrong collectives.
So the parameters are left on the meta device (`_unpack` in tiermem/offload.py). But each rank still holds
its own chunks, in its host tier or its swap files, and reading them needs no other rank. So when the
context has trained since entry and since its last checkpoint, each rank writes its chunks, before the
swap goes, to a new directory beside its swap, `<first nvme.paths entry>/tiermem-rescue-rank{R}-of-{N}-<time>`:
- one safetensors file per unit, `unit-{K}.safetensors`: each parameter's chunk of this rank (1-D,
  padded as in the tiers), with its whole shape and its dtype before the context in the header metadata;
- `rescue.json` last: rank, world, the units written, and those that could not be read, with why.
The weights are those of the last applied step: exit applies recorded updates before this (the update of a
rank's chunk needs no other rank). Optimizer state is not written.

`tiermem rescue DIR_RANK0 DIR_RANK1 ... --out DIR` (or `join(dirs, out)`) checks that the directories are
ranks 0..N-1 of one rescue, puts each parameter together from the N chunks, one parameter in memory at a
time, and writes `DIR/model.safetensors`, which `tiered_offload(..., checkpoint=...)` and safetensors'
`load_file` + `load_state_dict` load (and transformers' `from_pretrained`, given the model's config.json
in DIR).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from tiermem.errors import CheckpointError
from tiermem.runtime.safetensors_io import SafetensorsCheckpoint, SafetensorsWriter
from tiermem.swap import Tier

MANIFEST = "rescue.json"


def write(handle: Any) -> str:
    """Write this rank's chunks of every unit of `handle` (a sharded context leaving on an error); return the
    directory. A unit that cannot be read is named in the manifest, not fatal."""
    ranks = handle.ranks
    base = handle.config.nvme.paths[0]
    folder = os.path.join(base, f"tiermem-rescue-rank{ranks.rank}-of-{ranks.world}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(folder, mode=0o700)  # a new directory: fails rather than write into something already there
    written: list[str] = []
    lost: dict[str, str] = {}
    for unit in handle.units:
        name = f"unit-{unit.index:04d}.safetensors"
        try:
            tensors = handle.swapper.acquire(unit.partition, Tier.HOST)
        except Exception as exc:  # noqa: BLE001 - named in the manifest
            lost[unit.name] = str(exc)
            continue
        writer = None
        try:
            params = [(fqn, shape, dtype) for (fqn, _), shape, (dtype, _) in
                      zip(unit.params, unit.shapes, unit.orig, strict=True)]
            meta = {"shapes": json.dumps({f: list(s) for f, s, _ in params}),
                    "dtypes": json.dumps({f: str(d).removeprefix("torch.") for f, _, d in params})}
            path = os.path.join(folder, name)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            writer = SafetensorsWriter(path, [(f, tensors[f].dtype, tuple(tensors[f].shape)) for f, _, _ in params],
                                       meta)
            for fqn, _, _ in params:
                writer.write(fqn, tensors[fqn])
            writer.close()
            written.append(name)
        except Exception as exc:  # noqa: BLE001 - named in the manifest
            if writer is not None:
                writer.discard()
            lost[unit.name] = str(exc)
        finally:
            handle.swapper.release(unit.partition, tier=Tier.HOST)
    manifest = {"format": "tiermem-rescue", "version": 1, "rank": ranks.rank, "world": ranks.world,
                "files": written, "lost": lost}
    with open(os.path.join(folder, MANIFEST), "x", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return folder


def join(folders: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> str:
    """Put the ranks' rescued chunks together into `out`/model.safetensors; return its path."""
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
    if any(by_rank[r]["files"] != files for r in range(world)):
        raise CheckpointError("tiermem rescue: the ranks wrote different units; the directories are not of one rescue")
    os.makedirs(out, exist_ok=True)
    target = os.path.join(os.fspath(out), "model.safetensors")
    readers = [[SafetensorsCheckpoint(os.path.join(by_rank[r]["dir"], f)) for r in range(world)] for f in files]
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    plan: list[tuple[list[SafetensorsCheckpoint], str, torch.dtype, tuple[int, ...]]] = []
    for row in readers:
        shapes, dtypes = _metadata(row[0].path)
        for fqn, shape in shapes.items():
            dtype = getattr(torch, dtypes[fqn])
            specs.append((fqn, dtype, tuple(shape)))
            plan.append((row, fqn, dtype, tuple(shape)))
    writer = SafetensorsWriter(target, specs, {"tiermem": "rescued"})
    try:
        for row, fqn, dtype, whole in plan:
            chunks = [_read(reader, fqn) for reader in row]
            writer.write(fqn, torch.cat(chunks)[: torch.Size(whole).numel()].reshape(whole).to(dtype))
        writer.close()
    except BaseException:
        writer.discard()
        os.unlink(target)
        raise
    return target


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
    m["dir"] = folder
    return m


def _metadata(path: str) -> tuple[dict[str, list[int]], dict[str, str]]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n)).get("__metadata__", {})
    return json.loads(meta["shapes"]), json.loads(meta["dtypes"])


def _read(reader: SafetensorsCheckpoint, name: str) -> torch.Tensor:
    e = reader.entries[name]
    with open(e.path, "rb") as f:
        f.seek(e.offset)
        data = bytearray(f.read(e.nbytes))
    return torch.frombuffer(data, dtype=e.dtype).reshape(e.shape) if data else torch.empty(e.shape, dtype=e.dtype)
