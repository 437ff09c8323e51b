"""Fine-tuning what does not fit: a model built on the meta device streamed from its base checkpoint, with
LoRA adapters (PEFT) or a new head the checkpoint lacks, initialised as their modules would."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
from torch import nn

from tiermem import tiered_offload
from tiermem.runtime.safetensors_io import CheckpointError

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


def cfg(tmp_path, **extra: Any) -> dict[str, Any]:
    out = {"device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme", "grads.tier": "nvme",
           "nvme.paths": [str(tmp_path / "swap")], "memory.host_budget": "768KiB", "wrap.min_unit_bytes": 0}
    out.update(extra)
    return out


def gpt2_config() -> Any:
    return transformers.GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=1000, n_positions=64, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def lora_config() -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)


def base_checkpoint(tmp_path) -> tuple[nn.Module, Any]:
    """A base GPT-2 in memory, and its weights as a safetensors file (the tied head left out, as transformers
    saves it)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(gpt2_config())
    path = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in base.state_dict().items() if k != "lm_head.weight"}, str(path))
    return base, path


def train(model: nn.Module, opt: Any, data: list[torch.Tensor], clip: Any) -> None:
    for ids in data:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        clip(1.0)
        opt.step()


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_lora_on_a_meta_base_trains_as_peft_in_memory_and_exports_peft_adapters(tmp_path) -> None:
    """get_peft_model on a meta-device base, streamed from the base checkpoint with the adapters initialised
    from the seed: three clipped AdamW steps give exactly the adapters PEFT trains in memory; the base weights
    stay the checkpoint's; gradients and optimizer state exist for the adapters only, and the update writes
    back no base weight; the exported adapters load with PeftModel.from_pretrained and give the same logits."""
    base, path = base_checkpoint(tmp_path)
    data = [torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    torch.manual_seed(123)
    ref = peft.get_peft_model(base, lora_config())
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, lr=1e-2)
    train(ref, ref_opt, data, lambda c: torch.nn.utils.clip_grad_norm_(trainable, c))

    with torch.device("meta"):
        meta_base = transformers.GPT2LMHeadModel(gpt2_config())
    torch.manual_seed(123)
    model = peft.get_peft_model(meta_base, lora_config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    lora_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
    with tiered_offload(model, checkpoint=path, optimizer=opt, init_missing=["*.lora_*"], init_seed=123,
                        **cfg(tmp_path)) as tm:
        assert len(tm.units) >= 3
        assert sum(st.grads.layout.nbytes for st in tm.optimizer.units) <= lora_bytes + 64 * len(tm.units)
        assert sum(st.state.layout.nbytes for st in tm.optimizer.units) <= 2 * lora_bytes + 64 * len(tm.units)
        train(model, tm.optimizer, data[:1], tm.clip_grad_norm_)
        tm.reset_stats()
        train(model, tm.optimizer, data[1:], tm.clip_grad_norm_)
        written = tm.stats()["bytes_written"]
        params = sum(u.partition.size for u in tm.units)
        # the base's weights are read again in every step (the budget is smaller than the model) but never
        # written: 90 KB in all here; writing back whole units would be 1.5 MB
        assert written < params / 4, f"{written} bytes written in two steps: base weights were written back"
        tm.save_checkpoint(tmp_path / "adapters", adapters_only=True)
    got, want = adapters(model), adapters(ref)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name

    files = sorted(p.name for p in (tmp_path / "adapters").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())["r"] == 4
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel(gpt2_config()), tmp_path / "adapters")
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=data[0]).logits, ref.eval()(input_ids=data[0]).logits)


def test_a_new_head_on_a_meta_encoder_equals_from_pretrained_with_the_seed(tmp_path) -> None:
    """A BertForSequenceClassification on the meta device streamed from a BertModel checkpoint (names without
    the `bert.` prefix, no classifier): the head is initialised as transformers initialises it, from the seed,
    and the logits equal `torch.manual_seed(7); from_pretrained(...)` built in memory; the global generator is
    left as it was."""
    config = transformers.BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=3)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(tmp_path / "base")
    torch.manual_seed(7)
    ref = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "base", config=config).eval()
    with torch.device("meta"):
        model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(0, 500, (2, 10), generator=torch.Generator().manual_seed(1))
    rng = torch.get_rng_state()
    with tiered_offload(model, checkpoint=tmp_path / "base" / "model.safetensors", init_missing=["classifier.*"],
                        init_seed=7, **cfg(tmp_path)):
        assert torch.equal(torch.get_rng_state(), rng)
        with torch.no_grad():
            logits = model(ids).logits
    with torch.no_grad():
        assert torch.equal(logits, ref(ids).logits)
    for (name, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_missing_parameter_is_an_error_unless_allowed(tmp_path) -> None:
    """Without init_missing, a parameter the checkpoint lacks is an error naming it and the argument that
    allows it, before anything is packed; patterns allow only what they match; the model is left as it was."""
    _, path = base_checkpoint(tmp_path)
    with torch.device("meta"):
        meta_base = transformers.GPT2LMHeadModel(gpt2_config())
    model = peft.get_peft_model(meta_base, lora_config())
    for allowed in (None, ["classifier.*"]):
        with pytest.raises(CheckpointError, match=r"lora_A.*init_missing=\['\*\.lora_\*'\]"):
            with tiered_offload(model, checkpoint=path, init_missing=allowed, **cfg(tmp_path)):
                pass
        assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="init_missing"):
        with tiered_offload(model, checkpoint=path, init_missing="all", **cfg(tmp_path)):
            pass
