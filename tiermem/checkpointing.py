"""Streaming checkpoints of an offloaded model and its optimizer: `tm.save_checkpoint` / `tm.load_checkpoint`.

Layout of a checkpoint directory:
    config.json                                  the model's config, when it has one (transformers)
    model.safetensors.index.json                 {"metadata": {...}, "weight_map": {name: shard}}
    model-00001-of-0000N.safetensors ...         parameters (tied ones once) and persistent buffers
    optimizer.safetensors.index.json             the same for optimizer state, named "<param>::<kind>"
    optimizer-00001-of-0000N.safetensors ...
    trainer_state.json                           optimizer type, param groups (by parameter name), steps

Weights are written one unit at a time, so memory stays within the host budget; transformers'
`from_pretrained(dir)` and `safetensors.torch.load_file` read the model shards directly. The whole
directory is written under a temporary name and renamed into place, so a crash mid-save leaves the
previous checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from tiermem.device import check_host
from tiermem.runtime.checkpoint import CheckpointError, SafetensorsCheckpoint, SafetensorsWriter

if TYPE_CHECKING:
    from tiermem.offload import OffloadHandle

FORMAT = 1
DEFAULT_SHARD = 1 << 30


def save_checkpoint(tm: OffloadHandle, path: str | os.PathLike[str], max_shard_bytes: int = DEFAULT_SHARD) -> str:
    """Write model weights, buffers and optimizer state to `path` (atomically); return the path."""
    final = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        model = tm.model
        config = getattr(model, "config", None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(tmp)
        _write_sharded(tmp, "model", list(_model_tensors(tm)), max_shard_bytes, tm)
        if tm.optimizer is not None:
            _write_sharded(tmp, "optimizer", list(_optimizer_tensors(tm)), max_shard_bytes, tm)
            with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
                json.dump(_trainer_state(tm), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_checkpoint(tm: OffloadHandle, path: str | os.PathLike[str]) -> None:
    """Load weights, buffers and optimizer state saved by `save_checkpoint` (streaming, unit by unit)."""
    folder = os.fspath(path)
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        raise CheckpointError(f"{folder}: no model.safetensors.index.json; is this a tiermem checkpoint directory?")
    weights = SafetensorsCheckpoint(index)
    engine = tm.swapper.engine
    try:
        names = {fqn for u in tm.units for fqn, _ in u.params}
        missing = sorted(n for n in names if n not in weights.entries)
        if missing:
            raise CheckpointError(f"{folder}: parameters {missing[:5]} are not in the checkpoint; it was saved from "
                                  "another model")
        for unit in tm.units:
            views = tm.swapper.acquire(unit.partition, "host")
            try:
                for fqn, _ in unit.params:
                    weights.read_into(engine, fqn, views[fqn])
            finally:
                tm.swapper.release(unit.partition, dirty=True, tier="host")
        for name, buf in _persistent_buffers(tm.model):
            if name in weights.entries:  # buffers live on the device: read on the host, then copy
                staged = torch.empty(buf.shape, dtype=buf.dtype)
                weights.read_into(engine, name, staged)
                with torch.no_grad():
                    buf.copy_(staged)
    finally:
        weights.close()
    if tm.optimizer is not None:
        _load_optimizer(tm, folder)


# -- model ------------------------------------------------------------------------------------------
def _model_tensors(tm: OffloadHandle) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], Any]]:
    """(name, dtype, shape, reader) for every tensor to save, in unit order; reader(name) gives the data."""
    for unit in tm.units:
        dtypes = {s.name: s.dtype for s in unit.partition.layout.slots}  # stored dtype (params.dtype)
        for (fqn, _), shape in zip(unit.params, unit.shapes, strict=True):
            yield fqn, dtypes[fqn], shape, ("unit", unit.index)
    for name, buf in _persistent_buffers(tm.model):
        yield name, buf.dtype, tuple(buf.shape), ("buffer", buf)


def _persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


# -- optimizer ----------------------------------------------------------------------------------------
def _optimizer_tensors(tm: OffloadHandle) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], Any]]:
    opt = tm.optimizer
    assert opt is not None
    kinds = opt._state_kinds()
    for st in opt.units:
        if st.state is None:
            continue
        shapes = dict(zip([f for f, _ in st.unit.params], st.unit.shapes, strict=True))
        for kind in kinds:
            for fqn, _, _ in st.trainable:
                yield f"{fqn}::{kind}", torch.float32, shapes[fqn], ("state", st.unit.index, f"{kind}.{fqn}")


def _trainer_state(tm: OffloadHandle) -> dict[str, Any]:
    opt = tm.optimizer
    assert opt is not None
    name_of = {id(p): fqn for u in tm.units for fqn, p in u.params}
    groups = []
    for group in opt.param_groups:
        saved = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        saved = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in saved.items()}
        saved["params"] = [name_of[id(p)] for p in group["params"]]
        groups.append(saved)
    steps = {fqn: n for st in opt.units for fqn, n in st.steps.items()}
    return {"format": FORMAT, "optimizer": opt.kind.__name__, "param_groups": groups, "steps": steps}


def _load_optimizer(tm: OffloadHandle, folder: str) -> None:
    opt = tm.optimizer
    assert opt is not None
    state_path = os.path.join(folder, "trainer_state.json")
    if not os.path.exists(state_path):
        raise CheckpointError(f"{folder}: no trainer_state.json; the checkpoint holds no optimizer state")
    with open(state_path, encoding="utf-8") as f:
        saved = json.load(f)
    if saved.get("optimizer") != opt.kind.__name__:
        raise CheckpointError(f"{folder}: saved with {saved.get('optimizer')}, loading into {opt.kind.__name__}; "
                              "use the same optimizer type")
    if len(saved["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"{folder}: {len(saved['param_groups'])} param groups saved, the optimizer has "
                              f"{len(opt.param_groups)}")
    for group, stored in zip(opt.param_groups, saved["param_groups"], strict=True):
        for k, v in stored.items():
            if k != "params":
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    index = os.path.join(folder, "optimizer.safetensors.index.json")
    states = SafetensorsCheckpoint(index) if os.path.exists(index) else None
    try:
        for st in opt.units:
            st.steps = {f: int(saved["steps"][f]) for f, _, _ in st.trainable if f in saved["steps"]}
            if st.state is None or states is None:
                continue
            views = tm.swapper.acquire(st.state, "host")
            try:
                for kind in opt._state_kinds():
                    for fqn, _, _ in st.trainable:
                        states.read_into(tm.swapper.engine, f"{fqn}::{kind}", views[f"{kind}.{fqn}"])
            finally:
                tm.swapper.release(st.state, dirty=True)
    finally:
        if states is not None:
            states.close()


# -- writing ----------------------------------------------------------------------------------------
def _write_sharded(folder: str, prefix: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...], Any]],
                   max_shard_bytes: int, tm: OffloadHandle) -> None:
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...], Any]]] = [[]]
    size = 0
    total = 0
    for item in tensors:
        nbytes = torch.empty(0, dtype=item[1]).element_size()
        for d in item[2]:
            nbytes *= d
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
        total += nbytes
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        name = f"{prefix}-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(os.path.join(folder, name), [(n, d, s) for n, d, s, _ in shard])
        held: tuple[str, int] | None = None
        views: dict[str, torch.Tensor] = {}
        try:
            for tname, _, _, source in shard:
                weight_map[tname] = name
                if source[0] == "buffer":
                    writer.write(tname, source[1])
                    continue
                key = (source[0], source[1])
                if held != key:
                    _release(tm, held)
                    held, views = key, _acquire(tm, key)
                tensor = views[tname if source[0] == "unit" else source[2]]
                check_host(f"saving {tname!r}", tensor)
                writer.write(tname, tensor)
        finally:
            _release(tm, held)
        writer.close()
    with open(os.path.join(folder, f"{prefix}.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _partition_for(tm: OffloadHandle, key: tuple[str, int]) -> Any:
    kind, index = key
    if kind == "unit":
        return tm.units[index].partition
    assert tm.optimizer is not None
    return tm.optimizer.by_unit[index].state


def _acquire(tm: OffloadHandle, key: tuple[str, int]) -> dict[str, torch.Tensor]:
    return tm.swapper.acquire(_partition_for(tm, key), "host")


def _release(tm: OffloadHandle, key: tuple[str, int] | None) -> None:
    if key is not None:
        tm.swapper.release(_partition_for(tm, key), tier="host")


def _replace_dir(tmp: str, final: str) -> None:
    """Put `tmp` in place of `final`; the old one is removed only once the new one is in place."""
    fd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        if os.path.exists(final):
            old = f"{final}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        os.fsync(fd)
    finally:
        os.close(fd)
