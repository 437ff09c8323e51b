"""Checkpoints: streaming save/load of weights and optimizer state, exact resume, transformers compatibility."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests import models
from tests.test_training import batches, cfg, loss_fn, mlp, run_steps
from tiermem import tiered_offload
from tiermem.runtime.safetensors_io import CheckpointError

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device


def test_save_load_round_trip_in_process(tmp_path) -> None:
    """Weights and optimizer state saved, scrambled, and loaded back give the same next steps."""
    data = batches(8)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        run_steps(model, tm.optimizer, data[:4])
        tm.save_checkpoint(tmp_path / "ckpt", max_shard_bytes=8 << 10)
        ref = run_steps(model, tm.optimizer, data[4:])
        tm.load_checkpoint(tmp_path / "ckpt")
        again = run_steps(model, tm.optimizer, data[4:])
    assert ref == again
    shards = [f for f in os.listdir(tmp_path / "ckpt") if f.startswith("model-")]
    assert len(shards) > 1  # the small shard size forced several files


RESUME = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from tests.test_training import batches, cfg, mlp, run_steps
    from tiermem import tiered_offload
    import pathlib
    mode, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    data = batches(20)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    with tiered_offload(model, optimizer=opt, **cfg(folder / mode)) as tm:
        if mode == "straight":
            run_steps(model, tm.optimizer, data)
        elif mode == "first":
            run_steps(model, tm.optimizer, data[:10])
            tm.save_checkpoint(folder / "ckpt")
        else:
            tm.load_checkpoint(folder / "ckpt")
            run_steps(model, tm.optimizer, data[10:])
    torch.save({{n: p.detach() for n, p in model.named_parameters()}}, folder / (mode + ".pt"))
""")


def test_resume_in_a_new_process_is_exact(tmp_path) -> None:
    """10 steps, save, a new process loads and runs 10 more: equal to 20 steps straight, bit for bit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = RESUME.format(root=root)
    for mode in ("straight", "first", "second"):
        res = subprocess.run([sys.executable, "-c", script, mode, str(tmp_path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
    straight = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "second.pt")
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name


def test_checkpoint_loads_with_transformers_from_pretrained(tmp_path) -> None:
    """A GPT-2 checkpoint written by tiermem loads with from_pretrained into an equal model."""
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    model = models.gpt2()
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        loss = model(ids, labels=ids).loss
        loss.backward()
        tm.optimizer.step()
        tm.save_checkpoint(tmp_path / "hf", max_shard_bytes=256 << 10)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    for name, p in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], p), name
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
    from safetensors.torch import load_file

    shard = next(f for f in os.listdir(tmp_path / "hf") if f.startswith("model-00001"))
    assert "transformer.wte.weight" in load_file(tmp_path / "hf" / shard)


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    """If writing fails part-way, the earlier checkpoint is intact and no temporary directory is left."""
    import tiermem.checkpointing as ck

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batches(1)[0]
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        loss_fn(model, x, y).backward()
        tm.optimizer.step()
        tm.save_checkpoint(tmp_path / "ckpt")
        before = sorted(os.listdir(tmp_path / "ckpt"))
        tm.optimizer.zero_grad()
        loss_fn(model, x, y).backward()
        tm.optimizer.step()

        def boom(*args, **kwargs):
            raise OSError(28, "No space left on device (simulated)")

        monkeypatch.setattr(ck, "_write_sharded", boom)
        with pytest.raises(CheckpointError, match=r"No space left on device \(simulated\).*Free space"):
            tm.save_checkpoint(tmp_path / "ckpt")
        monkeypatch.undo()
        assert sorted(os.listdir(tmp_path / "ckpt")) == before
        assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
        tm.load_checkpoint(tmp_path / "ckpt")  # still loadable


def test_loading_a_foreign_checkpoint_is_a_clear_error(tmp_path) -> None:
    """A checkpoint of another model names the missing parameters; a non-checkpoint folder says so."""
    with tiered_offload(models.Skippy(), optimizer=None, **cfg(tmp_path)) as tm:
        tm.save_checkpoint(tmp_path / "skippy")
    with tiered_offload(mlp(), **cfg(tmp_path)) as tm:
        with pytest.raises(Exception, match="not in the checkpoint"):
            tm.load_checkpoint(tmp_path / "skippy")
        with pytest.raises(Exception, match="no model.safetensors.index.json"):
            tm.load_checkpoint(tmp_path)


# -- replacing a checkpoint: atomic, and nothing left behind by a killed save -------------------------
CRASH = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {root!r})
    import tiermem.checkpointing as ck
    from tests.test_training import batches, cfg, mlp, run_steps
    from tiermem import tiered_offload
    import pathlib
    mode, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    final = str(folder / "ckpt")
    data = batches(4)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(folder / "writer")) as tm:
        run_steps(model, tm.optimizer, data[:2])
        tm.save_checkpoint(final)
        run_steps(model, tm.optimizer, data[2:])
        with tm.gathered():
            torch.save({{n: p.detach().clone() for n, p in model.named_parameters()}}, folder / "new.pt")
        if mode == "fallback":  # a filesystem without RENAME_EXCHANGE; killed between the two renames
            def no_exchange(a, b):
                raise OSError(22, "Invalid argument (simulated)")
            ck._exchange = no_exchange
            real_rename = os.rename
            def rename(a, b):
                real_rename(a, b)
                if os.fspath(a) == final:
                    os._exit(3)
            os.rename = rename
        else:  # killed right after the exchange, before the old directory is removed
            real_exchange = ck._exchange
            def exchange(a, b):
                try:
                    real_exchange(a, b)
                except OSError:
                    os._exit(4)  # this filesystem has no RENAME_EXCHANGE
                os._exit(3)
            ck._exchange = exchange
        tm.save_checkpoint(final)
""")


@pytest.mark.parametrize("mode", ["fallback", "exchange"])
def test_a_save_killed_while_replacing_leaves_a_complete_checkpoint(tmp_path, mode, compute_device) -> None:
    """A save killed between its renames (or after the exchange) leaves a loadable checkpoint; leftovers go."""
    if compute_device is not None:
        pytest.skip("the killed writer runs on the CPU; the copying device changes nothing here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", CRASH.format(root=root), mode, str(tmp_path)], capture_output=True,
                         text=True)
    if res.returncode == 4:
        pytest.skip("the filesystem of tmp_path has no RENAME_EXCHANGE")
    assert res.returncode == 3, res.stderr[-3000:]
    assert [p for p in os.listdir(tmp_path) if p.startswith("ckpt.")]  # the dead writer's leftovers
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        tm.load_checkpoint(tmp_path / "ckpt")
    expected = torch.load(tmp_path / "new.pt")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), expected[name]), name
    assert not [p for p in os.listdir(tmp_path) if p.startswith("ckpt.")]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_leftovers_of_dead_writers_are_removed_and_live_ones_kept(tmp_path) -> None:
    """`<name>.tmp-PID` / `<name>.old-PID` of dead processes go at the next save and load; others stay."""
    dead, live = _dead_pid(), os.getppid()
    kept = [f"ckpt.tmp-{live}", f"ckpt.old-{live}", f"ckpt2.tmp-{dead}", "ckpt.tmp-x"]

    def litter() -> None:
        for name in [f"ckpt.tmp-{dead}", f"ckpt.old-{dead}", *kept]:
            os.makedirs(tmp_path / name, exist_ok=True)
            (tmp_path / name / "model-00001-of-00001.safetensors").write_bytes(b"partial")

    litter()
    with tiered_offload(mlp(), **cfg(tmp_path)) as tm:
        tm.save_checkpoint(tmp_path / "ckpt")
        assert sorted(p for p in os.listdir(tmp_path) if p.startswith("ckpt")) == sorted(["ckpt", *kept])
        litter()
        tm.load_checkpoint(tmp_path / "ckpt")
        assert sorted(p for p in os.listdir(tmp_path) if p.startswith("ckpt")) == sorted(["ckpt", *kept])


def test_without_rename_exchange_a_save_still_replaces_the_checkpoint(tmp_path, monkeypatch) -> None:
    """Where RENAME_EXCHANGE is refused (EINVAL), saving over a checkpoint renames twice and loads the same."""
    import tiermem.checkpointing as ck

    def no_exchange(a: str, b: str) -> None:
        raise OSError(22, "Invalid argument (simulated)")

    monkeypatch.setattr(ck, "_exchange", no_exchange, raising=False)
    data = batches(4)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        run_steps(model, tm.optimizer, data[:2])
        tm.save_checkpoint(tmp_path / "ckpt")
        run_steps(model, tm.optimizer, data[2:3])
        tm.save_checkpoint(tmp_path / "ckpt")
        ref = run_steps(model, tm.optimizer, data[3:])
        tm.load_checkpoint(tmp_path / "ckpt")
        assert run_steps(model, tm.optimizer, data[3:]) == ref
    assert not [p for p in os.listdir(tmp_path) if p.startswith("ckpt.")]


# -- loading: checked first, then all or nothing --------------------------------------------------------
def _files(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def _last_tensor(path) -> str:
    """The name of the tensor whose bytes end the safetensors file at `path`."""
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    return max(header, key=lambda k: header[k]["data_offsets"][1])


def _flip_last_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x40
    path.write_bytes(bytes(raw))


def _rewrite(path, data: bytes) -> None:
    """Replace the checkpoint file at `path` with `data` and enter its new size and CRC-32 in manifest.json, as a
    crafted checkpoint would, so only what `data` holds can give it away."""
    path.write_bytes(data)
    manifest = json.loads((path.parent / "manifest.json").read_text())
    manifest["files"][path.name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (path.parent / "manifest.json").write_text(json.dumps(manifest))


def _set_group_value(key: str, value: object) -> Callable[[Path], None]:
    def damage(path) -> None:
        state = json.loads(path.read_text())
        state["param_groups"][0][key] = value
        _rewrite(path, json.dumps(state).encode())

    return damage


def _listed_directory(path) -> None:
    path.mkdir()
    manifest = json.loads((path.parent / "manifest.json").read_text())
    manifest["files"][path.name] = {"bytes": path.stat().st_size, "crc32": 0}
    (path.parent / "manifest.json").write_text(json.dumps(manifest))


def _symlink_to_a_copy(path) -> None:
    copy = path.parent.parent / f"copy-of-{path.name}"
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)


DAMAGE = {
    "truncated optimizer shard": ("optimizer-00001-of-00001.safetensors",
                                 lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
    "corrupt trainer_state.json": ("trainer_state.json", lambda p: p.write_text('{"format": 1, "optimi')),
    "missing optimizer index": ("optimizer.safetensors.index.json", lambda p: p.unlink()),
    "flipped byte in a weight shard": ("model-00001-of-00001.safetensors", _flip_last_byte),
    "flipped byte in an optimizer shard": ("optimizer-00001-of-00001.safetensors", _flip_last_byte),
    "lr a string in trainer_state.json": ("trainer_state.json", _set_group_value("lr", "0.001")),
    "lr NaN in trainer_state.json": ("trainer_state.json", _set_group_value("lr", math.nan)),
    "betas of three numbers in trainer_state.json": ("trainer_state.json", _set_group_value("betas", [0.9, 0.99, 1])),
    "amsgrad a number in trainer_state.json": ("trainer_state.json", _set_group_value("amsgrad", 0)),
    "a manifest entry that is a directory": ("notes.txt", _listed_directory),
    "manifest.json nested 200,000 deep": ("manifest.json",
                                          lambda p: p.write_text('{"files": ' + "[" * 200_000 + "]" * 200_000 + "}")),
    "trainer_state.json a symlink to a copy of itself": ("trainer_state.json", _symlink_to_a_copy),
    "a model shard a symlink to a copy of itself": ("model-00001-of-00001.safetensors", _symlink_to_a_copy),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_and_changes_nothing(tmp_path, damage) -> None:
    """A damaged file raises CheckpointError naming it, and weights, optimizer state and groups stay as they were."""
    file, damage_fn = DAMAGE[damage]
    data = batches(6)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        run_steps(model, tm.optimizer, data[:3])
        tm.save_checkpoint(tmp_path / "ckpt")
        run_steps(model, tm.optimizer, data[3:])  # weights, moments and steps move on from the checkpoint
        tm.optimizer.param_groups[0]["lr"] = 5e-4
        tm.save_checkpoint(tmp_path / "before")
        target = tmp_path / "ckpt" / file
        flipped = _last_tensor(target) if "flipped" in damage else ""
        damage_fn(target)
        with pytest.raises(CheckpointError, match=re.escape(file)) as info:
            tm.load_checkpoint(tmp_path / "ckpt")
        assert flipped in str(info.value)
        tm.save_checkpoint(tmp_path / "after")
        assert tm.optimizer.param_groups[0]["lr"] == 5e-4
    assert _files(tmp_path / "after") == _files(tmp_path / "before")


# Checkpoints from elsewhere (a tar archive can carry FIFOs, device nodes and symlinks): each case in one child
# process, so that a load that blocks (opening a FIFO: not even Ctrl-C ends it) fails the test instead of hanging
# it, and a read that never ends (/dev/zero) meets the child's memory limit instead of the machine's.
UNTRUSTED = textwrap.dedent("""
    import json, os, shutil, sys, torch
    sys.path.insert(0, {root!r})
    import pathlib
    from tests.test_checkpoint import _files, _rewrite
    from tests.test_training import batches, cfg, mlp, run_steps
    from tiermem import tiered_offload
    from tiermem.errors import CheckpointError
    folder = pathlib.Path(sys.argv[1])
    INDEX = "model.safetensors.index.json"
    SHARD = "model-00001-of-00001.safetensors"

    def outside_fifo(name):
        fifo = folder / name
        os.mkfifo(fifo)
        return str(fifo)

    def names_in_index(ckpt, shard, rewrite=True):
        index = json.loads((ckpt / INDEX).read_text())
        index["weight_map"] = {{k: shard for k in index["weight_map"]}}
        data = json.dumps(index).encode()
        _rewrite(ckpt / INDEX, data) if rewrite else (ckpt / INDEX).write_bytes(data)

    def fifo_for(path):
        path.unlink()
        os.mkfifo(path)

    def link_to_zero(path):
        path.unlink()
        path.symlink_to("/dev/zero")

    def link_to_copy(path):
        copy = folder / ("blob-" + path.name)
        shutil.copyfile(path, copy)
        path.unlink()
        path.symlink_to(copy)

    LOAD = {{  # damage done to a copy of the checkpoint, then tm.load_checkpoint(copy)
        "manifest.json a FIFO": lambda c: fifo_for(c / "manifest.json"),
        "manifest.json a symlink to /dev/zero": lambda c: link_to_zero(c / "manifest.json"),
        "trainer_state.json a FIFO": lambda c: fifo_for(c / "trainer_state.json"),
        "a model shard a FIFO": lambda c: fifo_for(c / SHARD),
        "the index names a FIFO outside by its absolute path": lambda c: names_in_index(c, outside_fifo("load.fifo")),
    }}
    WEIGHTS = {{  # the same, then tiered_offload(mlp(), checkpoint=copy / INDEX)
        "checkpoint=: a shard a FIFO": lambda c: fifo_for(c / SHARD),
        "checkpoint=: a shard a symlink to /dev/zero": lambda c: link_to_zero(c / SHARD),
        "checkpoint=: the index names a FIFO outside by its absolute path":
            lambda c: names_in_index(c, outside_fifo("weights.fifo"), rewrite=False),
        "checkpoint=: the index names a shard in a subfolder": lambda c: names_in_index(c, "sub/" + SHARD, False),
        "checkpoint=: a shard a symlink to a regular file (as the Hugging Face cache keeps them)":
            lambda c: link_to_copy(c / SHARD),
    }}
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outcome = {{}}
    with tiered_offload(model, optimizer=opt, **cfg(folder)) as tm:
        run_steps(model, tm.optimizer, batches(2))
        tm.save_checkpoint(folder / "ckpt")
        run_steps(model, tm.optimizer, batches(3)[2:])
        tm.save_checkpoint(folder / "before")
        for k, (case, damage) in enumerate(LOAD.items()):
            copy = folder / f"load-{{k}}"
            shutil.copytree(folder / "ckpt", copy)
            damage(copy)
            try:
                tm.load_checkpoint(copy)
                error = None
            except CheckpointError as exc:
                error = str(exc)
            tm.save_checkpoint(folder / "after")
            outcome[case] = (error, _files(folder / "after") == _files(folder / "before"))
        with tm.gathered():
            trained = {{n: p.detach().clone() for n, p in model.named_parameters()}}
    for k, (case, damage) in enumerate(WEIGHTS.items()):
        copy = folder / f"weights-{{k}}"
        shutil.copytree(folder / "before", copy)
        damage(copy)
        fresh = mlp()
        try:
            with tiered_offload(fresh, checkpoint=str(copy / INDEX), **cfg(folder / f"w{{k}}")):
                pass
            error = None
        except CheckpointError as exc:
            error = str(exc)
        same = all(torch.equal(p.detach(), trained[n]) for n, p in fresh.named_parameters())
        outcome[case] = (error, same)
    print("OUTCOME", json.dumps(outcome))
""")


def test_files_of_a_checkpoint_that_are_not_regular_files_are_refused_without_blocking(tmp_path,
                                                                                     compute_device) -> None:
    """A FIFO or a symlink to /dev/zero under a checkpoint file's name, or an index naming a file outside its
    folder (a FIFO here), is a CheckpointError naming the file, raised at once without opening it (before: the
    load blocked forever, or read until memory ran out), and the model and optimizer stay as they were; for
    checkpoint= likewise, while a shard that is a symlink to a regular file (the Hugging Face cache) loads."""
    if compute_device is not None:
        pytest.skip("the child process runs on the CPU; the copying device changes nothing here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def limit_memory() -> None:  # before the fix, /dev/zero was read until memory ran out
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    try:
        res = subprocess.run([sys.executable, "-c", UNTRUSTED.format(root=root), str(tmp_path)], capture_output=True,
                             text=True, timeout=90, preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a checkpoint with a FIFO in it blocked")
    assert res.returncode == 0, res.stderr[-3000:]
    outcome = json.loads(res.stdout.split("OUTCOME ", 1)[1])
    expected = {  # case -> (what the error says, naming the file), or None: it loads
        "manifest.json a FIFO": r"load-0/manifest.json: a FIFO, not a regular file",
        "manifest.json a symlink to /dev/zero": r"load-1/manifest.json: a symbolic link, not a regular file",
        "trainer_state.json a FIFO": r"load-2/trainer_state.json: a FIFO, not a regular file",
        "a model shard a FIFO": r"load-3/model-00001-of-00001.safetensors: a FIFO, not a regular file",
        "the index names a FIFO outside by its absolute path":
            r"load-4/model.safetensors.index.json names the shard '/.*/load.fifo', which manifest.json does not list",
        "checkpoint=: a shard a FIFO": r"weights-0/model-00001-of-00001.safetensors: a FIFO, not a regular file",
        "checkpoint=: a shard a symlink to /dev/zero":
            r"weights-1/model-00001-of-00001.safetensors: a character device, not a regular file",
        "checkpoint=: the index names a FIFO outside by its absolute path":
            r"weights-2/model.safetensors.index.json: the weight_map names '/.*/weights.fifo' as a shard; shards are "
            r"named by plain file names",
        "checkpoint=: the index names a shard in a subfolder":
            r"weights-3/model.safetensors.index.json: the weight_map names 'sub/model-00001-of-00001.safetensors'",
        "checkpoint=: a shard a symlink to a regular file (as the Hugging Face cache keeps them)": None,
    }
    assert set(outcome) == set(expected)
    for case, (error, unchanged) in outcome.items():
        if expected[case] is None:
            assert error is None, (case, error)
            assert unchanged, f"{case}: the weights loaded are not the ones saved"
        else:
            assert error is not None and re.search(expected[case], error), (case, error)
            if not case.startswith("checkpoint="):
                assert unchanged, f"{case}: the refused load changed the model or the optimizer"


def _sigterm_from_backward(module: torch.nn.Module) -> Callable[[], None]:
    """Until the returned function is called, each forward of `module` registers a hook on its output that sends
    this process SIGTERM when backward reaches it; returns what removes that."""
    def on_output(mod, args, out) -> None:
        out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGTERM))

    return module.register_forward_hook(on_output).remove


@pytest.mark.parametrize("handler", ["catches the error", "lets it end the backward"])
def test_a_save_from_a_signal_handler_during_backward_says_to_save_after_the_step(tmp_path, compute_device,
                                                                                  handler: str) -> None:
    """A save (or load) from a SIGTERM handler during backward is a CheckpointError saying to save after the step,
    the checkpoint unchanged (before: it ran mid-backward); the step and the save after it are as without the signal."""
    data = batches(3)

    def train(folder, signalled: bool) -> list[CheckpointError]:
        errors: list[CheckpointError] = []
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with tiered_offload(model, optimizer=opt, **cfg(folder)) as tm:
            run_steps(model, tm.optimizer, data[:2])
            tm.save_checkpoint(folder / "ckpt")
            saved = _files(folder / "ckpt")

            def on_sigterm(signum, frame) -> None:
                try:
                    tm.save_checkpoint(folder / "ckpt")
                except CheckpointError as exc:
                    errors.append(exc)
                    if handler != "catches the error":
                        raise
                    try:  # loading there is refused alike
                        tm.load_checkpoint(folder / "ckpt")
                    except CheckpointError as again:
                        errors.append(again)

            x, y = data[2]
            tm.optimizer.zero_grad()
            remove = _sigterm_from_backward(model[2]) if signalled else lambda: None  # half-way through backward
            before = signal.signal(signal.SIGTERM, on_sigterm)
            try:
                loss = loss_fn(model, x, y)
                remove()
                try:
                    tm.backward(loss)
                except CheckpointError:
                    assert errors and handler != "catches the error"
                    tm.optimizer.zero_grad()  # the step again, whole
                    tm.backward(loss_fn(model, x, y))
            finally:
                signal.signal(signal.SIGTERM, before)
                remove()
            if errors:
                assert _files(folder / "ckpt") == saved
            assert not [p for p in os.listdir(folder) if ".tmp-" in p]
            tm.optimizer.step()
            tm.save_checkpoint(folder / "ckpt")  # what the message says to do: save after the step
        return errors

    assert not train(tmp_path / "plain", signalled=False)
    errors = train(tmp_path / "signalled", signalled=True)
    if compute_device is None:
        assert len(errors) == (2 if handler == "catches the error" else 1)
        assert re.search(r"save_checkpoint\(\) cannot run inside a backward pass.*Nothing was saved.*save after the "
                         r"step", str(errors[0]))
        if len(errors) == 2:
            assert re.search(r"load_checkpoint\(\) cannot run inside a backward pass.*Nothing was loaded",
                             str(errors[1]))
    else:  # backward runs on the device's thread there, and Python calls the handler once it has returned (as
        assert not errors  # with CUDA): the handler's save runs after the backward, where it may
    assert _files(tmp_path / "signalled" / "ckpt") == _files(tmp_path / "plain" / "ckpt")


def test_the_float16_loss_scale_is_saved_and_loaded(tmp_path) -> None:
    """With float16 parameters, the dynamic loss scale and its counters come back from a checkpoint, so a
    resume does not start again from 2**16 and skip steps it had already learned to avoid."""
    model = mlp()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        **cfg(tmp_path, **{"params.dtype": "float16"})) as tm:
        x, y = batches(1)[0]
        tm.backward(loss_fn(model, x.half(), y.half()))
        tm.optimizer.step()
        tm.optimizer.scale, tm.optimizer.loss_scale.good_steps, tm.optimizer.skipped_steps = 1024.0, 7, 3
        tm.save_checkpoint(tmp_path / "ckpt")
        tm.optimizer.scale, tm.optimizer.loss_scale.good_steps, tm.optimizer.skipped_steps = 2.0**16, 0, 0
        tm.load_checkpoint(tmp_path / "ckpt")
        assert (tm.optimizer.scale, tm.optimizer.loss_scale.good_steps, tm.optimizer.skipped_steps) == (1024.0, 7, 3)


@pytest.mark.parametrize("fault", ["read error", "bytes changed after the check"])
def test_a_fault_while_loading_after_the_checks_says_so_and_a_second_load_completes(tmp_path, monkeypatch,
                                                                                    fault) -> None:
    """The drive fails, or returns other bytes, between the check's read and the load's: a CheckpointError that
    says the load stopped part way and to load again; loading again, once the drive reads, gives exactly
    what was saved."""
    import errno

    from tests.faults import FaultyEngine
    from tiermem import checkpointing
    from tiermem.io.backends import create_engine

    data = batches(6)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with create_engine("auto", block_size=256 << 10, queue_depth=8) as inner:
        engine = FaultyEngine(inner)
        with tiered_offload(model, optimizer=opt, engine=engine, **cfg(tmp_path)) as tm:
            run_steps(model, tm.optimizer, data[:3])
            tm.save_checkpoint(tmp_path / "ckpt")
            tm.save_checkpoint(tmp_path / "saved")  # the same state, never damaged: what a load must give
            run_steps(model, tm.optimizer, data[3:])
            shard = tmp_path / "ckpt" / "optimizer-00001-of-00001.safetensors"
            intact = shard.read_bytes()
            real_check = checkpointing._check

            def check_then_fault(*args):
                checked = real_check(*args)
                if fault == "read error":
                    engine.fail("read", {3}, errno.EIO)
                else:
                    _flip_last_byte(shard)
                return checked

            monkeypatch.setattr(checkpointing, "_check", check_then_fault)
            with pytest.raises(CheckpointError, match="part way") as info:
                tm.load_checkpoint(tmp_path / "ckpt")
            assert ("Input/output error" if fault == "read error" else "other bytes") in str(info.value)
            monkeypatch.undo()
            engine.heal()
            shard.write_bytes(intact)
            tm.load_checkpoint(tmp_path / "ckpt")
            tm.save_checkpoint(tmp_path / "after")
    saved, after = _files(tmp_path / "saved"), _files(tmp_path / "after")
    assert {k: v for k, v in saved.items() if k != "manifest.json"} == \
        {k: v for k, v in after.items() if k != "manifest.json"}


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_ranges_written_by_several_writers_make_the_file_one_writer_makes(tmp_path, monkeypatch, backend: str) -> None:
    """SafetensorsRangeWriter: three writers (as three ranks) each write their chunk of every tensor, in an order
    of their own, with chunk ends inside 4 KiB blocks and 8 KiB stages, middles with O_DIRECT; the file and the
    CRC-32s joined with crc32_combine equal SafetensorsWriter's. A write outside a tensor is refused, and a
    disk that fails a write gives a CheckpointError naming the file."""
    from tests.faults import FaultyEngine
    from tiermem.checkpointing import crc32_combine
    from tiermem.io.backends import available_backends, create_engine
    from tiermem.runtime.safetensors_io import SafetensorsRangeWriter, SafetensorsWriter

    if backend not in available_backends():
        pytest.skip(f"{backend} is not usable here")
    monkeypatch.setattr(SafetensorsRangeWriter, "STAGE", 8192)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) for n in (3, 1000, 5003, 1, 9000, 0, 777, 3072)]
    specs = [(f"t{k}", t.dtype, tuple(t.shape)) for k, t in enumerate(tensors)]
    whole = SafetensorsWriter(str(tmp_path / "one.safetensors"), specs)
    for (name, _, _), t in zip(specs, tensors, strict=True):
        whole.write(name, t)
    whole.close()
    path = str(tmp_path / "ranks.safetensors")
    world = 3
    with create_engine(backend, block_size=4096, queue_depth=4) as engine:
        assert SafetensorsRangeWriter.create(path, specs) == whole.header_crc32
        writers = [SafetensorsRangeWriter(path, specs, engine) for _ in range(world)]
        crcs: dict[str, list[tuple[int, int]]] = {name: [] for name, _, _ in specs}
        for r in (2, 0, 1):
            order = list(zip(specs, tensors, strict=True))
            for (name, _, _), t in order[::-1] if r == 1 else order:
                c = -(-t.numel() // world)
                piece = t[r * c : (r + 1) * c]
                crc = writers[r].write(name, r * c * 4, piece) if piece.numel() else 0
                crcs[name].append((r, crc, piece.numel() * 4))
        for w in writers:
            w.close()
        assert Path(path).read_bytes() == (tmp_path / "one.safetensors").read_bytes()
        for name, pieces in crcs.items():
            joined = 0
            for _, crc, n in sorted(pieces):
                joined = crc32_combine(joined, crc, n)
            assert joined == whole.crc32[name], name
        assert sum(w.bytes_written for w in writers) == sum(t.numel() * 4 for t in tensors)
        writer = SafetensorsRangeWriter(path, specs, engine)
        with pytest.raises(CheckpointError, match=r"outside tensor 't0'"):
            writer.write("t0", 4, tensors[0])
        writer.close()
        writer = SafetensorsRangeWriter(path, specs, FaultyEngine(engine))
        writer._engine.fail("write", None, 28)  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match=r"ranks.safetensors: writing failed \(No space left on device\)"):
            writer.write("t4", 0, tensors[4])  # 36 KB: its aligned middle goes through the engine
            writer.close()
        writer.discard()


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_the_staged_writer_writes_what_the_buffered_one_writes(tmp_path, monkeypatch, backend: str) -> None:
    """SafetensorsWriter given an engine (two aligned stages written with O_DIRECT, the unaligned tail through
    the page cache) writes the same bytes and CRC-32s as the buffered writer, for tensors of odd sizes that
    cross the stages' ends, one larger than both stages together, and a file shorter than one stage; a disk
    that fails a write gives a CheckpointError naming the file."""
    from tests.faults import FaultyEngine
    from tiermem.io.backends import available_backends, create_engine
    from tiermem.runtime.safetensors_io import SafetensorsCheckpoint, SafetensorsWriter

    if backend not in available_backends():
        pytest.skip(f"{backend} is not usable here")
    monkeypatch.setattr(SafetensorsWriter, "STAGE", 8192)
    g = torch.Generator().manual_seed(0)
    cases = {"many": [torch.randn(n, generator=g) for n in (3, 1000, 2047, 1, 5000, 0, 777)],
             "short": [torch.randn(5, generator=g).half()]}
    with create_engine(backend, block_size=4096, queue_depth=4) as engine:
        for case, tensors in cases.items():
            specs = [(f"t{k}", t.dtype, tuple(t.shape)) for k, t in enumerate(tensors)]
            written = []
            for use in (None, engine):
                path = str(tmp_path / f"{case}-{'staged' if use else 'plain'}.safetensors")
                writer = SafetensorsWriter(path, specs, {"k": "v"}, engine=use)
                for (name, _, _), t in zip(specs, tensors, strict=True):
                    writer.write(name, t)
                writer.close()
                written.append((Path(path).read_bytes(), writer.crc32, writer.size))
            assert written[0] == written[1], case
            assert len(written[0][0]) == written[0][2]
            reader = SafetensorsCheckpoint(str(tmp_path / f"{case}-staged.safetensors"))
            assert {n: c[0] for n, c in reader.checksums(reader.path).items()} == written[1][1]
        faulty = FaultyEngine(engine)
        faulty.fail("write", None, 28)
        tensors = cases["many"]
        specs = [(f"t{k}", t.dtype, tuple(t.shape)) for k, t in enumerate(tensors)]
        writer = SafetensorsWriter(str(tmp_path / "full.safetensors"), specs, engine=faulty)
        with pytest.raises(CheckpointError, match=r"full.safetensors: writing failed \(No space left on device\)"):
            for (name, _, _), t in zip(specs, tensors, strict=True):
                writer.write(name, t)  # the first stage's write fails when the second one fills
            writer.close()
        writer.discard()  # as _write_sharded does after a failed write: nothing left open
