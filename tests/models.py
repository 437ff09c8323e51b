"""Small models for the offload tests: transformers models built from configs, and plain nn.Modules
that exercise the awkward cases (a layer used twice, nested units, buffers, keyword-only forwards)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn


def gpt2(layers: int = 4, width: int = 64, vocab: int = 500) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=64,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def gpt2_training_matches(offload: dict[str, Any], *, width: int, vocab: int, shape: tuple[int, int], steps: int,
                          check: Callable[[Any], None] | None = None) -> None:
    """Train a 2-layer GPT-2 (tied embedding and head, dropout off) with AdamW in memory and under
    tiered_offload(**offload) from the same seed on the same batches: losses and weights must be bit-identical.
    `check(tm)` runs inside the context after the last step."""
    from tiermem import tiered_offload

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, shape, generator=g) for _ in range(steps)]
    results = []
    for offloaded in (False, True):
        model = gpt2(layers=2, width=width, vocab=vocab)
        model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
        model.train()
        assert model.lm_head.weight is model.transformer.wte.weight
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        with tiered_offload(model, optimizer=opt, **offload) if offloaded else nullcontext() as tm:
            step_opt = tm.optimizer if tm is not None else opt
            for ids in data:
                step_opt.zero_grad()
                loss = model(ids, labels=ids).loss
                loss.backward()
                step_opt.step()
                losses.append(float(loss.detach()))
            if tm is not None and check is not None:
                check(tm)
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert torch.equal(results[1][1][name], value), name


def llama(layers: int = 3, width: int = 64, vocab: int = 500) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = Inner(width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.out(self.inner(x)))


class Inner(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Tricky(nn.Module):
    """Shared layer used twice per forward, BatchNorm buffers, keyword-only forward, a tied head."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(50, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.shared = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.scale = nn.Parameter(torch.tensor(0.5))  # a parameter the root module uses directly

    def forward(self, *, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = self.shared(x)
        for block in self.blocks:
            x = block(x)
        x = self.shared(x) * self.scale  # the same layer again
        x = self.norm(x.transpose(1, 2)).transpose(1, 2).contiguous()
        return self.head(x)


class Skippy(nn.Module):
    """Skips layers, or runs them backwards, depending on its arguments: dynamic control flow."""

    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = (), reverse: bool = False) -> torch.Tensor:
        order = list(enumerate(self.layers))
        for i, layer in reversed(order) if reverse else order:
            if i not in skip:
                x = torch.tanh(layer(x))
        return x


class Sleepy(nn.Module):
    """Equal layers whose forward also sleeps, standing in for compute time."""

    def __init__(self, width: int = 256, depth: int = 6, compute_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList(SleepyLayer(width, compute_s) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SleepyLayer(nn.Module):
    def __init__(self, width: int, compute_s: float) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.compute_s = compute_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.compute_s)
        return torch.tanh(self.lin(x))
