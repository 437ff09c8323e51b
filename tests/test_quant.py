"""Compressed weights (params.storage int8 / int4): the rounding bound, fewer bytes on NVMe and read, logits
close to the full model's, the device ledger, and the refusals that keep rounded weights from spreading."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import models
from tiermem import ConfigError, OffloadError, quant, tiered_offload
from tiermem.config import load_config
from tiermem.quant import CompressedWeight, Quantization

pytest.importorskip("transformers")

VOCAB = 500


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [4096, 1000, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_come_back_within_half_a_step(bits: int, numel: int, dtype: torch.dtype) -> None:
    """Each value comes back within half its group's step (largest magnitude / 127, or / 7), also in a last,
    padded group and when expanded into bfloat16 (plus bfloat16's own rounding)."""
    q = Quantization(bits, 64)
    w = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.02
    w[:64] = 0.0  # an all-zero group comes back zero
    specs = dict(q.specs("w", w.to(device="meta")))
    values = torch.empty(specs["w#q"].shape, dtype=specs["w#q"].dtype)
    scales = torch.empty(specs["w#scale"].shape)
    assert values.numel() * values.element_size() == q.groups(numel) * 64 * bits // 8
    q.quantize_into(w, values, scales)
    out = torch.empty(numel, dtype=dtype)
    q.dequantize_into(values, scales, out)
    padded = torch.zeros(q.groups(numel) * 64)
    padded[:numel] = w
    step = (padded.view(-1, 64).abs().amax(1) / (127 if bits == 8 else 7)).repeat_interleave(64)[:numel]
    slack = 0.0 if dtype is torch.float32 else 2.0**-7  # bfloat16 keeps 8 bits: the scale and the product round
    err = (out.float() - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + w.abs() * slack + 1e-12).all()), (err - step / 2).max()
    assert not out[:min(64, numel)].any()


def _within_float32_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`got` is F.linear(x, w, bias) in float32 to within the rounding bound of a float32 dot product of
    length K: K * eps * (|x| @ |w|.T + |bias|), against the product in float64."""
    import torch.nn.functional as F

    d = torch.float64
    want = F.linear(x.to(d), w.to(d), None if bias is None else bias.to(d))
    scale = F.linear(x.abs().to(d), w.abs().to(d), None if bias is None else bias.abs().to(d))
    bound = (x.shape[-1] + 1) * torch.finfo(torch.float32).eps * scale
    excess = (got.to(d) - want).abs() - bound
    assert excess.max() <= 0, f"off by {float(excess.max()):.3g} beyond float32's rounding bound"


def _checkpoint(tmp_path: Path, build: Any) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    model = build(layers=2, width=128, vocab=VOCAB).eval()
    model.save_pretrained(tmp_path / "ckpt")
    return model, str(tmp_path / "ckpt" / "model.safetensors")


def _settings(tmp_path: Path, storage: str, budget: str = "4MiB") -> dict[str, Any]:
    return {"device": "cpu", "params.tier": "nvme", "nvme.paths": [str(tmp_path / f"swap-{storage}")],
            "memory.host_budget": budget, "wrap.min_unit_bytes": "16KiB", "params.storage": storage,
            "prefetch.keep_resident": False}


def _run(tmp_path: Path, ref: torch.nn.Module, ckpt: str, storage: str, ids: torch.Tensor,
         budget: str = "4MiB", passes: int = 4) -> tuple[torch.Tensor, dict[str, Any]]:
    """One pass from the checkpoint with `storage`, then `passes` measured; the last one's logits, and the stats
    of the measured ones. A read is counted when it completes, so the reads in flight are waited for at both ends
    of the measurement: a pass's window for the next one, in flight at the reset, otherwise counted on one
    side or the other by timing (under load a single pass of int8 read 0.40 of full's instead of 0.27)."""

    def settle() -> None:
        for part in list(tm.swapper.partitions.values()):
            tm.swapper.wait_idle(part)

    with torch.device("meta"):
        model = type(ref)(ref.config).eval()
    with tiered_offload(model, checkpoint=ckpt, restore=False, **_settings(tmp_path, storage, budget)) as tm:
        with torch.no_grad():
            model(ids)
            settle()
            tm.reset_stats()
            for _ in range(passes):
                logits = model(ids).logits
            settle()
        return logits, tm.stats()


@pytest.mark.usefixtures("compute_device")
@pytest.mark.parametrize("build", [models.gpt2, models.llama], ids=["gpt2", "llama"])
def test_compressed_weights_read_fewer_bytes_and_compute_close_logits(tmp_path, build: Any) -> None:
    """A model built on the meta device and streamed from its checkpoint with int8 (int4) storage holds about
    a quarter (an eighth) of float32's bytes on NVMe and reads that much less per pass under a budget that
    streams every unit; its logits stay close to the full model's (relative error of the logits within 3% with
    int8, 40% with int4 at groups of 128, on these small random models), and the full storage stays exact."""
    ref, ckpt = _checkpoint(tmp_path, build)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    full, s_full = _run(tmp_path, ref, ckpt, "full", ids, budget="1MiB")
    assert torch.equal(full, want)
    # the budget streams the model: each of the 4 passes reads most of it again (measured: 0.91 of it)
    assert s_full["bytes_read"] >= 0.75 * 4 * s_full["peak_bytes"]["nvme"]
    for storage, share, err, budget in (("int8", 0.27, 0.03, "320KiB"), ("int4", 0.15, 0.4, "192KiB")):
        got, s = _run(tmp_path, ref, ckpt, storage, ids, budget=budget)
        assert s["peak_bytes"]["nvme"] <= (share + 0.1) * s_full["peak_bytes"]["nvme"], (storage, s, s_full)
        assert 0 < s["bytes_read"] <= (share + 0.1) * s_full["bytes_read"], (storage, s, s_full)
        rel = ((got - want).norm() / want.norm()).item()  # measured: int8 0.013-0.014, int4 0.23-0.26
        assert rel <= err, (storage, rel)
        if storage == "int8":
            assert torch.equal(got.argmax(-1), want.argmax(-1))  # the same greedy tokens here
    assert not os.listdir(tmp_path / "swap-int8") or all(not os.listdir(tmp_path / "swap-int8" / d)
                                                         for d in os.listdir(tmp_path / "swap-int8"))


def test_the_expanded_unit_counts_on_the_device_ledger(tmp_path, compute_device: Any) -> None:
    """On a device with memory of its own (the copying test device) the expanded copy of a compressed unit is
    on the device's ledger while it computes, and the memory really alive then is what the ledger says."""
    if compute_device is None:
        pytest.skip("the CPU's device memory is its host memory")
    ref, ckpt = _checkpoint(tmp_path, models.gpt2)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    compute_device.reset_peak()  # the device is one for the whole session: its peak from here on
    _, s = _run(tmp_path, ref, ckpt, "int8", ids)
    assert s["peak_bytes"]["device"] >= compute_device.peak_bytes - compute_device.live_bytes > 0, s
    assert s["device_budget"] is not None and s["peak_bytes"]["device"] <= s["device_budget"], s


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"optimizer": "sgd"}, "training needs them whole"),
    ({"restore": True}, "pass restore=False"),
], ids=["training", "restore"])
def test_compressed_storage_refuses_what_it_would_spoil(tmp_path, kwargs: dict[str, Any], named: str) -> None:
    """Training and restore=True are refused at entry with params.storage int8, naming the key and the fix."""
    ref, ckpt = _checkpoint(tmp_path, models.gpt2)
    with torch.device("meta"):
        model = type(ref)(ref.config)
    extra: dict[str, Any] = {"restore": False, **kwargs}
    if extra.get("optimizer") == "sgd":
        extra["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OffloadError, match=f"params.storage: int8 .*{named}"):
        with tiered_offload(model, checkpoint=ckpt, **_settings(tmp_path, "int8"), **extra):
            pass


def test_gathered_and_save_checkpoint_are_refused(tmp_path) -> None:
    """tm.gathered() and tm.save_checkpoint() would edit or write rounded weights: each is an OffloadError
    naming params.storage."""
    ref, ckpt = _checkpoint(tmp_path, models.gpt2)
    with torch.device("meta"):
        model = type(ref)(ref.config)
    with tiered_offload(model, checkpoint=ckpt, restore=False, **_settings(tmp_path, "int4")) as tm:
        with pytest.raises(OffloadError, match="tm.gathered\\(\\): params.storage is int4"):
            with tm.gathered():
                pass
        with pytest.raises(OffloadError, match="tm.save_checkpoint\\(\\): params.storage is int4"):
            tm.save_checkpoint(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "value", "message"), [
    ("params.storage", "int3", "params.storage"),
    ("params.group_size", 12, "params.group_size: expected a multiple of 8"),
    ("params.group_size", 0, "params.group_size"),
])
def test_bad_storage_settings_name_their_key(key: str, value: Any, message: str) -> None:
    """A storage or group size that cannot be used is a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, **{key: value})


@pytest.mark.parametrize("storage", ["int8", "int4"])
@pytest.mark.parametrize("build", [models.gpt2, models.llama], ids=["gpt2", "llama"])
def test_weights_expanded_at_use_compute_what_the_whole_expansion_computes(tmp_path, monkeypatch,
                                                                         build: Any, storage: str) -> None:
    """On the CPU, compressed weights held by Linear, Conv1D and Embedding modules stay compressed while their unit
    computes and are expanded a piece at a time inside the products (see [Note: expanded where used]): every
    unit of GPT-2 (Conv1D, a tied embedding and head) and Llama takes that path, no weight is expanded whole,
    the logits and greedy tokens are those of the units expanded whole, and the Parameters are back after."""
    ref, ckpt = _checkpoint(tmp_path, build)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    calls = {"linear": 0, "conv1d": 0, "embedding": 0, "whole": 0}
    for name in ("as_linear", "as_conv1d", "as_embedding", "whole"):
        original = getattr(CompressedWeight, name)

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            calls[_name.removeprefix("as_")] += 1
            return _original(self, *args)

        monkeypatch.setattr(CompressedWeight, name, counted)
    monkeypatch.setattr(quant, "AT_USE_CHUNK", 4096)  # several pieces per weight at this width

    def run(storage_dir: str) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        with torch.device("meta"):
            model = type(ref)(ref.config).eval()
        settings = {**_settings(tmp_path, storage, "320KiB"), "nvme.paths": [str(tmp_path / storage_dir)]}
        with tiered_offload(model, checkpoint=ckpt, restore=False, **settings) as tm:
            with torch.no_grad():
                logits = model(ids).logits
                tokens = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
            at_use = [u.at_use for u in tm.runtime.units]
        assert all(type(p) is torch.nn.Parameter for p in model.parameters()), "a CompressedWeight was left behind"
        if model.config.tie_word_embeddings:  # both places of a tied weight got the one Parameter back
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        return logits, tokens, at_use

    got, got_tokens, at_use = run("swap-at-use")
    assert all(a is not None for a in at_use[1:]) and any(a is not None for a in at_use), at_use
    assert calls["whole"] == 0, calls
    assert calls["linear"] + calls["conv1d"] > 0 and calls["embedding"] > 0, calls
    monkeypatch.setattr("tiermem.offload.at_use_holders", lambda *a: None)
    want, want_tokens, at_use = run("swap-whole")
    assert all(a is None for a in at_use)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("shape", "group"), [((96, 100), 64), ((130, 256), 128), ((3, 7), 8)],
                         ids=["rows-straddle-groups", "whole-groups", "last-group-padded"])
def test_a_compressed_weight_in_any_use_is_its_expansion(shape: tuple[int, int], group: int, bits: int) -> None:
    """A CompressedWeight gives what its whole expansion gives in its fast products (F.linear, torch.addmm as
    Conv1D uses it, F.embedding) and in any other operation (expanded whole for that call), reports the
    expansion's shape, dtype and device without expanding, and prints without its values."""
    q = Quantization(bits, group)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    specs = dict(q.specs("w", w.to(device="meta")))
    values, scales = torch.empty_like(specs["w#q"], device="cpu"), torch.empty(specs["w#scale"].shape)
    q.quantize_into(w, values, scales)
    whole = torch.empty(shape)
    q.dequantize_into(values, scales, whole)
    cw = CompressedWeight(values, scales, shape, torch.float32, q)
    assert (cw.shape, cw.dtype, cw.device, cw.dim(), cw.numel()) == (whole.shape, torch.float32, whole.device, 2,
                                                                       whole.numel())
    assert "CompressedWeight(shape=" in repr(cw)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, shape[1], generator=g)
    bias = torch.randn(shape[0], generator=g)
    import torch.nn.functional as F

    old = quant.AT_USE_CHUNK
    quant.AT_USE_CHUNK = 2 * shape[1]  # a few rows at a time
    try:
        # a few output rows at a time: the BLAS may block the sum over the input dimension otherwise than for
        # the whole product (MKL on AMD's EPYC does), so the two round apart; each is held to float32's bound
        _within_float32_rounding(F.linear(x, cw, bias), x, whole, bias)
        _within_float32_rounding(F.linear(x, cw), x, whole, None)
        x2 = torch.randn(6, shape[0], generator=g)
        b2 = torch.randn(shape[1], generator=g)
        # Conv1D's product sums the input dimension in pieces: the rounding differs, within a few float32 steps
        torch.testing.assert_close(torch.addmm(b2, x2, cw), torch.addmm(b2, x2, whole), rtol=1e-5, atol=1e-5)
    finally:
        quant.AT_USE_CHUNK = old
    ids = torch.tensor([[0, shape[0] - 1], [1, 1]])
    assert torch.equal(F.embedding(ids, cw), F.embedding(ids, whole))
    assert torch.equal(F.embedding(input=ids, weight=cw), F.embedding(ids, whole))  # torch's keyword names
    torch.testing.assert_close(F.linear(input=x, weight=cw, bias=bias), F.linear(x, whole, bias))
    for bad in (torch.tensor([-1]), torch.tensor([shape[0]])):  # out of range: raised, as F.embedding does
        with pytest.raises((IndexError, RuntimeError)):
            F.embedding(bad, cw)
    for edit in (lambda t: t.mul_(0), lambda t: t.copy_(whole), lambda t: t.__iadd__(1)):
        with pytest.raises(OffloadError, match="read-only while their unit computes"):
            edit(cw)
    assert torch.equal(cw * 2, whole * 2)
    assert torch.equal(cw.t().contiguous(), whole.t().contiguous())
    assert torch.equal(cw.sum(0), whole.sum(0))
    assert type(cw * 2) is torch.Tensor


def test_a_compressed_weight_gives_its_input_the_gradients_the_expansion_gives(monkeypatch) -> None:
    """With gradients wanted for the input (attributions, prompt tuning on a frozen compressed model), each
    fast product keeps the pieces autograd saved instead of reusing one buffer: the input's gradient is the
    whole expansion's."""
    import torch.nn.functional as F

    q = Quantization(8, 32)
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    specs = dict(q.specs("w", w.to(device="meta")))
    values, scales = torch.empty_like(specs["w#q"], device="cpu"), torch.empty(specs["w#scale"].shape)
    q.quantize_into(w, values, scales)
    whole = torch.empty(w.shape)
    q.dequantize_into(values, scales, whole)
    cw = CompressedWeight(values, scales, tuple(w.shape), torch.float32, q)
    monkeypatch.setattr(quant, "AT_USE_CHUNK", 4 * 96)  # several pieces
    uses = {"linear": (96, lambda x, m: F.linear(x, m)),  # weight (out 64, in 96)
            "conv1d": (64, lambda x, m: torch.addmm(torch.zeros(96), x, m))}  # weight (in 64, out 96)
    for name, (width, use) in uses.items():
        grads = []
        for m in (cw, whole):
            x = torch.randn(3, width, generator=torch.Generator().manual_seed(2), requires_grad=True)
            (use(x, m) ** 2).sum().backward()
            grads.append(x.grad)
        # the pieces' products round otherwise than the whole one's (MKL on AMD's EPYC: 1.2e-4 at an element of
        # 9.6 whose sum cancels, of gradients up to 473), so the error is taken against the largest gradient
        # (one buffer reused for every piece fails in backward, at autograd's check of what it saved)
        scale = float(grads[1].abs().max())
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_forwards_that_record_gradients_or_autocast_expand_whole_and_an_interrupt_leaves_no_stand_in(
        tmp_path, monkeypatch) -> None:
    """Expanding where used is for forwards without gradients: one that records them (whose saved pieces would
    add up to the whole weight outside the budget, and whose weights would get no gradient), or one under the
    CPU's autocast, expands its units whole and computes what the whole expansion computes. A KeyboardInterrupt
    in the middle of a unit's forward (which torch's always-call hooks do not see) leaves no CompressedWeight in
    the model after the context ends."""
    ref, ckpt = _checkpoint(tmp_path, models.gpt2)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    products = []
    original = CompressedWeight.as_conv1d

    def counted(self: Any, *args: Any) -> Any:
        products.append(1)
        return original(self, *args)

    monkeypatch.setattr(CompressedWeight, "as_conv1d", counted)
    with torch.device("meta"):
        model = type(ref)(ref.config).eval()
    with tiered_offload(model, checkpoint=ckpt, restore=False, **_settings(tmp_path, "int8")):
        with torch.no_grad():
            at_use = model(ids).logits
        assert products
        products.clear()
        recorded = model(ids).logits  # gradients recorded: expanded whole
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(ids).logits
        assert not products
    with torch.device("meta"):
        model = type(ref)(ref.config).eval()
    monkeypatch.setattr("tiermem.offload.at_use_holders", lambda *a: None)
    with tiered_offload(model, checkpoint=ckpt, restore=False, **_settings(tmp_path / "whole", "int8")):
        with torch.no_grad():
            torch.testing.assert_close(at_use, model(ids).logits, rtol=1e-5, atol=1e-6)
            assert torch.equal(recorded.detach(), model(ids).logits)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(autocast, model(ids).logits)
    monkeypatch.undo()

    with torch.device("meta"):
        model = type(ref)(ref.config).eval()

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    model.transformer.h[1].mlp.c_proj.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        with tiered_offload(model, checkpoint=ckpt, restore=False, **_settings(tmp_path / "cut", "int8")):
            with torch.no_grad():
                model(ids)
    left = [name for name, p in model.named_parameters() if type(p) is not torch.nn.Parameter]
    assert not left, left


def test_a_failing_cupy_kernel_falls_back_to_pytorch_with_one_warning(monkeypatch, caplog) -> None:
    """When cupy's kernel fails to compile or launch, the weight is expanded by PyTorch's operations (the same
    values), with one warning naming the fallback, and cupy is not tried again."""
    calls = []

    def broken(*args: Any) -> None:
        calls.append(1)
        raise RuntimeError("nvrtc: error: invalid value for --gpu-architecture")

    monkeypatch.setattr(quant, "_CUPY_FAILED", [])
    monkeypatch.setattr(quant, "_use_cupy", lambda out: not quant._CUPY_FAILED)  # as on a GPU with cupy
    monkeypatch.setattr(quant, "_cupy_dequantize", broken)
    q = Quantization(8, 64)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    specs = dict(q.specs("w", w.to("meta")))
    values = torch.empty(specs["w#q"].shape, dtype=specs["w#q"].dtype)
    scales = torch.empty(specs["w#scale"].shape)
    q.quantize_into(w, values, scales)
    with monkeypatch.context() as m:
        m.setattr(quant, "_use_cupy", lambda out: False)
        want = torch.empty_like(w)
        q.dequantize_into(values, scales, want)
    with caplog.at_level("WARNING", logger="tiermem.quant"):
        for _ in range(3):
            got = torch.empty_like(w)
            q.dequantize_into(values, scales, got)
            assert torch.equal(got, want)
    assert len(calls) == 1
    warnings = [r for r in caplog.records if "cupy's dequantizing kernel failed" in r.getMessage()]
    assert len(warnings) == 1 and "nvrtc" in warnings[0].getMessage()
