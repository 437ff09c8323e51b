"""The demo feeds the model on the compute device (`tm.device`), so it runs where parameters are bound on CUDA."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tiermem import OffloadHandle
from tiermem.demo import add_arguments, run

pytest.importorskip("transformers")

SENTINEL = torch.device("meta")  # what tm.device claims in the first test: a device the CPU never defaults to

# the smallest shapes the demo accepts: a 1-layer, 64-wide GPT-2 (its 50257-token vocabulary is fixed)
TINY = ["--layers", "1", "--width", "64", "--host-budget", "64MiB", "--prompt", "6", "--tokens", "2",
        "--train-layers", "1", "--train-width", "64", "--train-budget", "32MiB", "--train-steps", "2"]


def _args(tmp_path: Any, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--dir", str(tmp_path / "demo"), *TINY, *extra])


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from ((f"argument {i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    yield from ((k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor))


@pytest.fixture
def fed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, torch.device]]:
    """Make tm.device claim SENTINEL and record the device of every tensor the demo hands the model.

    The model's own calls (forward, generate) then run on CPU stand-ins for the sentinel tensors (ones of the
    same shape and dtype: valid token ids, labels and attention masks), so the whole demo runs and prints.
    """
    from transformers import GPT2LMHeadModel

    seen: list[tuple[str, str, torch.device]] = []  # (call, argument, device) for each tensor the demo passed
    inside = [0]  # > 0 while generate() runs: its own forward calls are transformers', not the demo's

    def real(t: Any) -> Any:
        return torch.ones(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) and t.device == SENTINEL else t

    def spy(name: str, original: Any) -> Any:
        @functools.wraps(original)  # generate() inspects forward's signature: keep it
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not inside[0]:
                seen.extend((name, arg, t.device) for arg, t in _tensors(args, kwargs))
            inside[0] += name == "generate"
            try:
                return original(self, *map(real, args), **{k: real(v) for k, v in kwargs.items()})
            finally:
                inside[0] -= name == "generate"

        return call

    monkeypatch.setattr(OffloadHandle, "device", property(lambda self: SENTINEL))
    monkeypatch.setattr(GPT2LMHeadModel, "forward", spy("forward", GPT2LMHeadModel.forward))
    monkeypatch.setattr(GPT2LMHeadModel, "generate", spy("generate", GPT2LMHeadModel.generate))
    return seen


def test_demo_puts_every_model_input_on_tm_device(tmp_path, fed) -> None:
    """Inference and training hand the model only tensors on tm.device (token ids, masks, labels)."""
    assert run(_args(tmp_path)) == 0
    calls = {call for call, _, _ in fed}
    assert calls == {"forward", "generate"}, f"the demo called {calls}"
    off = [(call, arg, str(device)) for call, arg, device in fed if device != SENTINEL]
    assert not off, f"the demo fed the model tensors off tm.device ({SENTINEL}): {off}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_demo_runs_on_cuda(tmp_path, capsys) -> None:
    """With CUDA present (device: auto), the demo's inference and training run to the end on the GPU."""
    assert run(_args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "both runs generated the same tokens: True" in out
    assert "checkpoint written to" in out
