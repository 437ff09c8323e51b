#!/usr/bin/env python3
"""Where (c'')'s resident memory goes: glibc's heap against the bytes in use, block by block.

Builds bench/train_offload.py's GPT-2 (use_cache=False) with variant (c'')'s settings (nvme tiers,
lazy updates (the default), activations.tier nvme, 544 MiB host budget, 64 MiB activation buffer), runs --steps
training steps, and prints after every transformer block's forward, and after each forward and backward: VmRSS,
glibc's heap size
(mallinfo2 arena: every byte the heap holds, in use or free) and the bytes in use (uordblks). Memory that
mmap serves on its own (large allocations) is in neither heap figure.

    python3 bench/train_heap.py [--steps 2] [--swap-dir /var/tmp/tiermem-train-bench/swap/heap]

Run it under LD_PRELOAD=libjemalloc.so.2 and the heap figures read 0 (jemalloc does not fill mallinfo2).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
from typing import Any

MiB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--swap-dir", default="/var/tmp/tiermem-train-bench/swap/heap")
    args = p.parse_args(argv)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def line(what: str) -> None:
        rss = next(int(x.split()[1]) // 1024 for x in open("/proc/self/status") if x.startswith("VmRSS"))
        m = libc.mallinfo2()
        print(f"{what:<22} RSS {rss:>5} MiB   heap {m.arena // MiB:>4} MiB, in use {m.uordblks // MiB:>4} MiB")

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import tiermem

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=8192, n_positions=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                     use_cache=False)
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    for i, block in enumerate(model.transformer.h):
        block.register_forward_hook(lambda m, a, o, i=i: line(f"  block {i} forward"))
    os.makedirs(args.swap_dir, exist_ok=True)
    overrides: dict[str, Any] = {
        "device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme", "grads.tier": "cpu",
        "memory.host_budget": "544MiB", "nvme.paths": [args.swap_dir], "io.engine": "io_uring",
        "activations.tier": "nvme", "activations.buffer": "64MiB"}
    gen = torch.Generator().manual_seed(1234)
    try:
        with tiermem.tiered_offload(model, optimizer=opt, **overrides) as tm:
            line("entered")
            step_opt = tm.optimizer
            assert step_opt is not None
            for step in range(args.steps):
                ids = torch.randint(0, 8192, (2, 128), generator=gen)
                step_opt.zero_grad()
                loss = model(ids, labels=ids).loss
                line(f"step {step} forward")
                loss.backward()
                step_opt.step()
                line(f"step {step} backward")
    finally:
        shutil.rmtree(args.swap_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
