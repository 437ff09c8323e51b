"""Checkpoints: streaming save/load of weights and optimizer state, exact resume, transformers compatibility."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import models
from tests.test_training import batches, cfg, loss_fn, mlp, run_steps
from tiermem import tiered_offload

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
        with pytest.raises(OSError, match="No space"):
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
