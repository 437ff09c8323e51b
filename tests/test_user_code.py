"""Code written for PyTorch, accelerate and transformers, run as its users write it: under tiered_offload it
gives what it gives without tiermem, or is refused by a tiermem error that names what and why and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiermem import tiered_offload

pytestmark = pytest.mark.usefixtures("compute_device")  # each test on the CPU and the copying device


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
