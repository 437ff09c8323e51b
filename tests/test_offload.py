"""tiered_offload: same results as in memory, on transformers models and awkward modules; entry and exit."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests import models
from tiermem import OffloadError, tiered_offload
from tiermem.io.backends import available_backends

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device

pytest.importorskip("transformers")


def cfg(tmp_path, tier: str = "nvme", **extra) -> dict:
    out = {"device": "cpu", "params.tier": tier, "nvme.paths": [str(tmp_path / "swap")],
           "memory.host_budget": "4MiB", "wrap.min_unit_bytes": "16KiB", "io.block_size": "256KiB"}
    out.update(extra)
    return out


def snapshot(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    return dict(model.named_parameters()), {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_restored(model: nn.Module, before: tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]) -> None:
    objects, values = before
    now = dict(model.named_parameters())
    assert now.keys() == objects.keys()
    for name, p in now.items():
        assert p is objects[name], f"{name} is not the same Parameter object"
        assert p.dtype == values[name].dtype and torch.equal(p.detach(), values[name]), f"{name} changed"


@pytest.mark.parametrize("tier", ["nvme", "cpu", "device"])
@pytest.mark.parametrize("build", [models.gpt2, models.llama], ids=["gpt2", "llama"])
def test_forward_and_generate_equal_in_memory(tmp_path, build, tier: str) -> None:
    """Logits are bit-exact and greedy generate() gives the same tokens as the model in memory."""
    model = build()
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model(ids).logits
    ref_gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    before = snapshot(model)
    budget = "512KiB" if tier == "nvme" else "4MiB"  # smaller than the model: units must come from NVMe
    with tiered_offload(model, **cfg(tmp_path, tier, **{"memory.host_budget": budget})) as tm:
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref)
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(gen, ref_gen)
        stats = tm.stats()
        assert stats["units"] >= 3
        if tier == "nvme":
            assert stats["bytes_read"] > 0
    assert_restored(model, before)
    if build is models.gpt2:
        assert model.lm_head.weight is model.transformer.wte.weight


def test_parameters_really_leave_the_model(tmp_path) -> None:
    """Inside the context every offloaded parameter holds no storage between forwards."""
    model = models.gpt2()
    total = sum(p.numel() for p in model.parameters())
    with tiered_offload(model, **cfg(tmp_path)) as tm:
        assert sum(p.numel() for p in model.parameters()) == 0
        assert tm.stats()["now_bytes"]["nvme"] >= total * 4
    assert sum(p.numel() for p in model.parameters()) == total


def test_tricky_module_layer_twice_buffers_kwonly_tied(tmp_path) -> None:
    """A layer called twice, BatchNorm buffers, keyword-only forward, a tied head and a root parameter."""
    model = models.Tricky().eval()
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids=ids)
    before = snapshot(model)
    with tiered_offload(model, **cfg(tmp_path, **{"wrap.min_unit_bytes": 0})) as tm:
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(model(ids=ids), ref)
        assert tm.stats()["units"] >= 6
    assert_restored(model, before)
    assert model.head.weight is model.embed.weight


def test_batchnorm_buffers_update_in_training_mode(tmp_path) -> None:
    """In train mode the BatchNorm running stats (resident buffers) update exactly as in memory."""
    ref_model, model = models.Tricky().train(), models.Tricky().train()
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids=ids)
        with tiered_offload(model, **cfg(tmp_path)):
            out = model(ids=ids)
    assert torch.equal(out, ref)
    assert torch.equal(model.norm.running_mean, ref_model.norm.running_mean)


def test_nested_units_by_class_names(tmp_path) -> None:
    """wrap.classes naming a block and a class nested in it makes nested units that still compute right."""
    model = models.Tricky().eval()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids=ids)
    with tiered_offload(model, **cfg(tmp_path, **{"wrap.classes": ["Block", "Inner"], "wrap.min_unit_bytes": 0})) as tm:
        names = [u.name for u in tm.units]
        assert "blocks.0" in names and "blocks.0.inner" in names
        with torch.inference_mode():
            assert torch.equal(model(ids=ids), ref)


def test_unknown_wrap_class_is_a_clear_error(tmp_path) -> None:
    """A wrap.classes entry that names no module class raises ConfigError listing the classes present."""
    from tiermem import ConfigError

    with pytest.raises(ConfigError, match="wrap.classes: GPT2Blok not found.*GPT2Block"):
        with tiered_offload(models.gpt2(), **cfg(tmp_path, **{"wrap.classes": ["GPT2Blok"]})):
            pass


def test_nested_offload_is_refused(tmp_path) -> None:
    """Entering tiered_offload on a model (or a part of one) already inside it raises OffloadError."""
    model = models.gpt2()
    with tiered_offload(model, **cfg(tmp_path)):
        with pytest.raises(OffloadError, match="already inside tiered_offload"):
            with tiered_offload(model, **cfg(tmp_path)):
                pass
    outer = nn.Sequential(model)
    with tiered_offload(model, **cfg(tmp_path)):
        with pytest.raises(OffloadError, match="submodule '0'"):
            with tiered_offload(outer, **cfg(tmp_path)):
                pass
    with tiered_offload(model, **cfg(tmp_path)):  # after exit it can be entered again
        pass


def test_exception_in_forward_releases_units(tmp_path) -> None:
    """A forward that raises leaves no unit held; the next forward is right and exit restores."""
    model = models.Skippy().eval()
    x = torch.randn(4, 32)
    ref = model(x).detach()
    before = snapshot(model)
    with tiered_offload(model, **cfg(tmp_path)) as tm:
        with pytest.raises(RuntimeError):
            model(torch.randn(4, 31))  # wrong width: the first layer raises
        assert all(u.depth == 0 and u.partition.users == 0 for u in tm.units)
        assert torch.equal(model(x), ref)
    assert_restored(model, before)


def test_gathered_gives_real_parameters_and_keeps_edits(tmp_path) -> None:
    """tm.gathered() makes parameters real outside forward; edits persist through NVMe and exit."""
    model = models.Skippy().eval()
    with tiered_offload(model, **cfg(tmp_path, **{"memory.host_budget": "24KiB", "wrap.min_unit_bytes": 0})) as tm:
        with tm.gathered(model.layers[2]), torch.no_grad():
            assert model.layers[2].weight.shape == (32, 32)
            model.layers[2].weight.zero_()
        for _ in range(3):  # push it out of the small host budget and back
            with torch.no_grad():
                model(torch.randn(2, 32))
        assert tm.stats()["evictions"] > 0
    assert torch.count_nonzero(model.layers[2].weight) == 0


def test_meta_model_without_checkpoint_is_refused(tmp_path) -> None:
    """A model on the meta device with no checkpoint raises OffloadError naming a parameter."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(OffloadError, match="parameter '0.weight'.*checkpoint=PATH"):
        with tiered_offload(model, **cfg(tmp_path)):
            pass


def _save(model: nn.Module, folder: str, shard: str | None = None) -> str:
    model.save_pretrained(folder, max_shard_size=shard) if shard else model.save_pretrained(folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    return index if os.path.exists(index) else os.path.join(folder, "model.safetensors")


@pytest.mark.parametrize("shard", [None, "200KB"], ids=["single", "sharded"])
def test_meta_model_streams_from_checkpoint(tmp_path, shard) -> None:
    """A GPT-2 built on the meta device runs from a (sharded) safetensors checkpoint equal to the original."""
    from accelerate import init_empty_weights

    src = models.gpt2()
    ckpt = _save(src, str(tmp_path / "ckpt"), shard)
    ids = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = src(ids).logits
    with init_empty_weights(include_buffers=False):
        model = models.gpt2().__class__(src.config).eval()
    assert all(p.is_meta for p in model.parameters())
    with tiered_offload(model, checkpoint=ckpt, **cfg(tmp_path)):
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref)
    assert not any(p.is_meta for p in model.parameters())
    for name, p in src.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], p)


def test_restore_false_leaves_meta_parameters(tmp_path) -> None:
    """restore=False ends with every parameter on the meta device, shapes and ties kept."""
    model = models.gpt2()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    with tiered_offload(model, restore=False, **cfg(tmp_path)):
        pass
    assert all(p.is_meta for p in model.parameters())
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert model.lm_head.weight is model.transformer.wte.weight


def test_checkpoint_mismatch_is_a_clear_error(tmp_path) -> None:
    """A checkpoint from another config names the tensor and both shapes; the model is left intact."""
    from accelerate import init_empty_weights

    ckpt = _save(models.gpt2(width=64), str(tmp_path / "ckpt"))
    with init_empty_weights(include_buffers=False):
        other = models.gpt2().__class__(models.gpt2(width=32).config)
    with pytest.raises(Exception, match="shape .* the model's parameter has"):
        with tiered_offload(other, checkpoint=ckpt, **cfg(tmp_path)):
            pass
    with pytest.raises(Exception, match="does not exist"):
        with tiered_offload(other, checkpoint=str(tmp_path / "nope.safetensors"), **cfg(tmp_path)):
            pass


@pytest.mark.parametrize("pickled", ["torch.save", "pickle"])
def test_a_pickle_checkpoint_is_refused_saying_how_to_convert_it(tmp_path, pickled: str) -> None:
    """checkpoint= given a torch.save file (a zip archive) or a bare pickle says that is what it is and how to
    convert it to safetensors (before: "header of 578712552184433488 bytes"); the model is left as it was."""
    import pickle

    from accelerate import init_empty_weights

    from tiermem.errors import CheckpointError

    state = models.gpt2(width=64).state_dict()
    path = tmp_path / "model.bin"
    if pickled == "torch.save":
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps({k: v.numpy() for k, v in state.items()}, protocol=4))
    with init_empty_weights(include_buffers=False):
        model = models.gpt2().__class__(models.gpt2(width=64).config)
    with pytest.raises(CheckpointError, match=r"model.bin: a torch.save / pickle file, not safetensors.*"
                                           r"safetensors.torch.save_file\(torch.load\(PATH\)"):
        with tiered_offload(model, checkpoint=str(path), **cfg(tmp_path)):
            pass
    assert all(p.is_meta for p in model.parameters())


def test_dtype_override_computes_in_that_dtype(tmp_path) -> None:
    """params.dtype bfloat16 stores and computes in bf16 (equal to model.to(bf16)); exit restores fp32."""
    model = models.Skippy().eval()
    x = torch.randn(2, 32)
    ref = models.Skippy().eval().to(torch.bfloat16)(x.to(torch.bfloat16))
    before = snapshot(model)
    with tiered_offload(model, **cfg(tmp_path, **{"params.dtype": "bfloat16"})) as tm:
        assert tm.units[0].partition.layout.slots[0].dtype == torch.bfloat16
        assert torch.equal(model(x.to(torch.bfloat16)), ref)
    objects, values = before
    for name, p in model.named_parameters():
        assert p is objects[name] and p.dtype == torch.float32
        assert torch.equal(p.detach(), values[name].to(torch.bfloat16).float())


def test_host_tier_larger_than_budget_is_refused_up_front(tmp_path) -> None:
    """params.tier cpu with a model above the host budget fails before the model is placed, naming both
    sizes and the fix."""
    from tiermem import BudgetError

    model = models.gpt2()
    before = snapshot(model)
    with pytest.raises(BudgetError, match="params.tier: cpu keeps every parameter in host memory.*params.tier: nvme"):
        with tiered_offload(model, **cfg(tmp_path, "cpu", **{"memory.host_budget": "256KiB"})):
            pass
    assert_restored(model, before)


@pytest.mark.skipif(available_backends()["io_uring"] is not None, reason="needs io_uring")
def test_pool_is_registered_only_after_the_model_is_packed(tmp_path) -> None:
    """Registering the host pool faults in all of it; on entry that waits until the model's own parameters
    are packed and freed, so the two never add up. Packing's writes therefore use plain buffers, and the
    forward's reads the registered ones."""
    model = models.gpt2()
    with tiered_offload(model, **cfg(tmp_path, **{"io.engine": "io_uring", "memory.host_budget": "512KiB"})) as tm:
        stats = tm.swapper.engine.core_stats()  # type: ignore[attr-defined]
        assert stats["chunks"] > 0 and stats["fixed_chunks"] == 0
        model(torch.randint(0, 500, (1, 8)))
        assert tm.stats()["bytes_read"] > 0  # the model is larger than the budget: forward reads it
        assert tm.swapper.engine.core_stats()["fixed_chunks"] > 0  # type: ignore[attr-defined]


def test_deepcopy_inside_the_context_is_refused_by_name_and_works_after(tmp_path) -> None:
    """copy.deepcopy() of the model or a submodule inside the context raises OffloadError saying why and what to
    do (before: "cannot pickle '_thread.RLock' object"); the model is untouched, and after exit deepcopy makes
    a working copy again."""
    import copy

    model = models.gpt2(layers=2, width=64).eval()
    ids = torch.randint(0, 500, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    with tiered_offload(model, **cfg(tmp_path)):
        for what in (model, model.transformer.h[0]):
            with pytest.raises(OffloadError, match=r"copy.deepcopy\(\) of a module inside tiered_offload.*"
                                                   r"Copy the model before entering the context or after it ends"):
                copy.deepcopy(what)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref)
    twin = copy.deepcopy(model)
    assert "__deepcopy__" not in vars(twin) and "__deepcopy__" not in vars(model.transformer.h[0])
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, ref)
