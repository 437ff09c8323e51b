"""Code written for PyTorch, accelerate and transformers, run as its users write it: under tiered_offload it
gives what it gives without tiermem, or is refused by a tiermem error that names what and why and the fix."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tiermem import OffloadError, tiered_offload

on_each_device = pytest.mark.usefixtures("compute_device")  # the test on the CPU and the copying device


def cfg(tmp_path, **extra) -> dict:
    out = {"device": "cpu", "params.tier": "nvme", "nvme.paths": [str(tmp_path / "swap")],
           "memory.host_budget": "4MiB", "wrap.min_unit_bytes": "64B", "io.block_size": "256KiB"}
    out.update(extra)
    return out


class ModelForTest(nn.Module):
    """The shape of accelerate's big-modeling test model: Linear, BatchNorm1d, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


def _trained_batchnorm_model() -> ModelForTest:
    """A ModelForTest whose running statistics are far from their initial values (as a trained model's are)."""
    torch.manual_seed(0)
    model = ModelForTest()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(16, 3) * 3 + 2)
    return model.eval()


@on_each_device
def test_init_empty_weights_model_loads_the_checkpoints_buffers(tmp_path) -> None:
    """accelerate's init_empty_weights() leaves buffers real (freshly initialised): with checkpoint= the
    checkpoint's running statistics are used, as from_pretrained / load_checkpoint_and_dispatch would (before:
    the fresh ones, outputs off by 0.43 with no warning)."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    src = _trained_batchnorm_model()
    save_file(src.state_dict(), str(tmp_path / "model.safetensors"))
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = src(x)
    with init_empty_weights():
        model = ModelForTest().eval()
    assert model.linear1.weight.is_meta and not model.batchnorm.running_mean.is_meta
    with tiered_offload(model, checkpoint=str(tmp_path / "model.safetensors"), **cfg(tmp_path)):
        with torch.no_grad():
            assert torch.equal(model(x), ref)
    for name, buf in src.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name


@on_each_device
def test_resnet_built_under_init_empty_weights_equals_from_pretrained(tmp_path) -> None:
    """transformers' ResNetForImageClassification (BatchNorm in every block) from its checkpoint (before:
    logits off by 1.24)."""
    from accelerate import init_empty_weights
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    torch.manual_seed(0)
    src = ResNetForImageClassification(config)
    with torch.no_grad():  # running statistics away from their initial values
        src.train()
        for _ in range(3):
            src(torch.randn(4, 3, 32, 32) * 2 + 1)
    src.eval()
    src.save_pretrained(str(tmp_path / "resnet"))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = ResNetForImageClassification.from_pretrained(str(tmp_path / "resnet")).eval()(pixels).logits
    with init_empty_weights():
        model = ResNetForImageClassification(config).eval()
    with tiered_offload(model, checkpoint=str(tmp_path / "resnet" / "model.safetensors"), **cfg(tmp_path)):
        with torch.no_grad():
            assert torch.equal(model(pixels).logits, ref)


@on_each_device
@pytest.mark.parametrize("convert", ["to(float64)", "half()", "to(meta)", "float() under bf16"])
def test_a_conversion_inside_the_context_is_refused_and_the_model_is_intact(tmp_path, convert: str) -> None:
    """model.to(dtype) / .half() / .to(device) inside the context is refused before it touches anything, naming
    params.dtype (before: accepted, the next forward failed, and after exit the weights were float32 and the
    buffers float64). A conversion that changes nothing runs (the HF Trainer's model.to(args.device))."""
    model = _trained_batchnorm_model()
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    values = {n: t.clone() for n, t in model.state_dict().items()}
    extra = {"params.dtype": "bfloat16"} if "bf16" in convert else {}
    call = {"to(float64)": lambda m: m.to(torch.float64), "half()": lambda m: m.half(),
            "to(meta)": lambda m: m.to("meta"), "float() under bf16": lambda m: m.float()}[convert]
    with tiered_offload(model, **cfg(tmp_path, **extra)):
        with pytest.raises(OffloadError, match=r"inside tiered_offload would make its parameters .*params.dtype"):
            call(model)
        with pytest.raises(OffloadError, match="params.dtype"):
            call(model.linear1)  # a submodule too
        assert model.to(torch.device("cpu")) is model  # no change: runs
        if not extra:
            with torch.no_grad():
                assert torch.equal(model(x), ref)
    assert {n: t.dtype for n, t in model.state_dict().items()} == {n: t.dtype for n, t in values.items()}
    for name, t in model.state_dict().items():  # (without an optimizer, params.dtype's rounding stays)
        want = values[name].to(torch.bfloat16).float() if extra and t.is_floating_point() else values[name]
        assert torch.equal(t, want), name
    assert model.double().linear1.weight.dtype == torch.float64  # after exit, as ever


def test_a_4bit_bitsandbytes_base_is_refused_by_name(tmp_path) -> None:  # refused at entry: on the CPU alone
    """A QLoRA base (transformers' load_in_4bit with bitsandbytes, PEFT LoRA on top) is refused naming the
    parameter, why and what to load instead (before: it trained and diverged from the same steps in memory
    at step 2, with no error); the model is left as it was."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests import models

    models.llama(layers=2).save_pretrained(str(tmp_path / "llama"))
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"), quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(OffloadError, match=r"parameter '.*layers\.0\..*weight' is a bitsandbytes 4-bit weight .*"
                                           r"refused .*bfloat16.*load_in_8bit"):
        with tiered_offload(model, optimizer=opt, **cfg(tmp_path)):
            pass
    for name, p in model.named_parameters():
        assert not p.is_meta and torch.equal(p.detach(), before[name]), name


PLAN_SCRIPT = """
import logging, sys, torch
from tests import models
from tiermem import tiered_offload
if sys.argv[1] == "quiet":
    logging.getLogger("tiermem.plan").setLevel(logging.WARNING)
model = models.Skippy()
with tiered_offload(model, device="cpu", **{"params.tier": "cpu", "wrap.min_unit_bytes": "1KiB"}):
    model(torch.randn(2, 32))
"""


def test_the_plan_line_shows_once_at_entry_without_logging_set_up_and_can_be_silenced(tmp_path) -> None:
    """A script that never configured logging sees at entry what went where (before: a log record default
    logging hides); the "tiermem.plan" logger's level silences it."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "plan.py"
    script.write_text(PLAN_SCRIPT)
    root = str(Path(__file__).resolve().parents[1])
    shown = {}
    for mode in ("plain", "quiet"):
        done = subprocess.run([sys.executable, str(script), mode], cwd=root, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": root})
        assert done.returncode == 0, done.stderr
        shown[mode] = [line for line in done.stderr.splitlines() if "plan:" in line]
    assert len(shown["plain"]) == 1 and shown["plain"][0].startswith("tiermem: tiered_offload plan: ")
    assert "units on cpu; params" in shown["plain"][0]
    assert shown["quiet"] == []


@on_each_device
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batchnorm_under_params_dtype_bfloat16_equals_model_bfloat16(tmp_path, mode: str) -> None:
    """params.dtype bfloat16 casts floating buffers as model.bfloat16() does, so BatchNorm runs (before: PyTorch's
    dtype error, whatever the input's dtype); its running statistics come back in their own dtype at exit."""
    import copy

    model = _trained_batchnorm_model().train(mode == "train")
    ref = copy.deepcopy(model).bfloat16()
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        want = [ref(x), ref(x)]
    with tiered_offload(model, **cfg(tmp_path, **{"params.dtype": "bfloat16"})):
        with torch.no_grad():
            assert torch.equal(model(x), want[0]) and torch.equal(model(x), want[1])
    for name, buf in model.named_buffers():
        assert buf.dtype == dict(_trained_batchnorm_model().named_buffers())[name].dtype, name
        assert torch.equal(buf, dict(ref.named_buffers())[name].to(buf.dtype)), name


class ModuleWithUnusedSubModules(nn.Module):
    """The shape of accelerate's test module that reads its child's weight without calling the child."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.linear.weight.t() + self.linear.bias


class ModelWithUnusedSubModules(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = ModuleWithUnusedSubModules(3, 4)
        self.linear2 = ModuleWithUnusedSubModules(4, 5)
        self.batchnorm = nn.BatchNorm1d(5)
        self.linear3 = ModuleWithUnusedSubModules(5, 6)
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the model's own forward reads a weight too
        h = self.linear3(self.batchnorm(self.linear2(self.linear1(x))))
        return torch.nn.functional.linear(h, self.head.weight) * self.head.weight.dtype.itemsize


class ReadsThroughGetattr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ getattr(self, "b").weight  # noqa: B009 - a read the source does not show plainly


@on_each_device
def test_modules_reading_their_childrens_weights_train_as_in_memory(tmp_path) -> None:
    """accelerate's ModelWithUnusedSubModulesForTest (each module reads its child's weight and bias without
    calling it) and a model whose forward applies a head's weight itself: forward, backward and AdamW steps
    equal the same loop in memory (before: "size mismatch ... vec (0)" from PyTorch)."""
    import copy

    torch.manual_seed(0)
    ref = ModelWithUnusedSubModules()
    model = copy.deepcopy(ref)
    data = [torch.randn(8, 3, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def train(m: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        losses = []
        for x in data:
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    want = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        assert len(tm.units) >= 4  # the children are units of their own: their parents fetch them
        got = train(model, opt)
    assert got == want
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


@on_each_device
def test_a_read_the_source_does_not_show_is_named_with_the_fix(tmp_path) -> None:
    """A weight read through getattr (which the source does not show plainly) is an OffloadError naming the
    module, the parameters and the fix; the model is given back intact."""
    model = ReadsThroughGetattr()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(OffloadError, match=r"ReadsThroughGetattr \(the model\) used a parameter of a submodule it "
                                           r"did not call .*one of a\.weight, a\.bias, b\.weight, b\.bias.*"
                                           r"vec \(0\).*self\.<submodule>\.<parameter>.*call the submodule"):
        with tiered_offload(model, **cfg(tmp_path)):
            model(torch.randn(2, 4))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), values[name]), name


class TiedWithBuffers(nn.Module):
    """Tied input and output embeddings, a non-persistent buffer (never saved) and a persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(1, 9, dtype=torch.float32), persistent=False)
        self.register_buffer("shift", torch.full((8,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids) * self.scale + self.shift))


@on_each_device
@pytest.mark.parametrize("buffers", ["real", "meta"])
def test_tied_weights_and_buffers_from_a_checkpoint_equal_the_model_in_memory(tmp_path, buffers: str) -> None:
    """accelerate's big-modeling cases: a model built under init_empty_weights() and given checkpoint=: the tie
    is kept, the persistent buffers come from the checkpoint (before, a real persistent buffer kept its fresh
    value), the non-persistent one from the module; train and eval outputs equal the model in memory. With
    include_buffers=True the non-persistent buffer is on the meta device with nothing to initialise it from:
    an OffloadError naming it and include_buffers=False, the model left as it was."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = TiedWithBuffers()
    with torch.no_grad():
        src.shift.fill_(-0.25)
        src.train()(torch.randint(0, 50, (16,)))  # running statistics away from their initial values
    state = {k: v for k, v in src.state_dict().items() if k != "head.weight"}  # a tie is saved once
    save_file(state, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(1))
    with init_empty_weights(include_buffers=buffers == "meta"):
        model = TiedWithBuffers()
    model.head.weight = model.embed.weight  # init_empty_weights re-registers each assignment: tie after it
    if buffers == "meta":
        with pytest.raises(OffloadError, match=r"buffer 'scale' is on the meta device .*include_buffers=False"):
            with tiered_offload(model, checkpoint=str(tmp_path / "model.safetensors"), **cfg(tmp_path)):
                pass
        assert model.embed.weight.is_meta and model.scale.is_meta
        return
    with tiered_offload(model, checkpoint=str(tmp_path / "model.safetensors"), **cfg(tmp_path)):
        with torch.no_grad():
            assert torch.equal(model.eval()(ids), src.eval()(ids))
            assert torch.equal(model.train()(ids), src.train()(ids))
    assert model.head.weight is model.embed.weight
    for name, value in src.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(model.scale, src.scale)
