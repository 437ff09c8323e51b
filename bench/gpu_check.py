#!/usr/bin/env python3
"""The checks that need a GPU, in one run of a few minutes: tiermem on CUDA against the same model plainly on
the GPU. scripts/gpu_check.sh runs it (after the CUDA tests) on a machine lent with a GPU; with --device cpu
--small the same code runs end to end on any machine, to prove the script itself works.

Inference: a GPT-2-medium-shaped model (GPT2Config(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257),
355M parameters) in float16 with random weights (seed 0) is built on the CPU and saved with `save_pretrained`
(safetensors) in a temporary directory. The same model, moved plainly to the device, gives the reference:
the logits of a --prompt-token forward and --tokens greedily generated tokens. Then the model is built again
on the meta device and run under `tiered_offload(model, checkpoint=model.safetensors, restore=False)` with
params.tier nvme, memory.host_budget below the model's size and memory.device_budget --device-units times
the largest block's or embedding's bytes, once with prefetch and once with prefetch=False. Each run compares
its first forward's logits (max abs difference, argmax per position) and its generated tokens with the
reference, and reports tokens/s (per-token seconds mean ± stdev), bytes read, stall time, prefetch misses,
the ledger's peak device bytes (tm.stats()["peak_bytes"]["device"]) against the device budget and the largest
unit, and on CUDA torch.cuda.max_memory_allocated over generate() (peak reset before it), counted from what
was allocated before the context was entered.

Training: a small GPT-2 (4 layers, width 256, vocab 1000, dropout 0, use_cache False; seed 0) takes --steps
AdamW steps (lr 1e-4) with clip_grad_norm_(1.0) on seeded batches of 2 x 64 tokens, plainly on the device and
under `tiered_offload(model, optimizer=opt)` (params.tier nvme, optimizer.tier nvme, using tm.optimizer,
tm.backward and tm.clip_grad_norm_), once in float32 and once with params.dtype bfloat16. The plain bfloat16
run keeps fp32 master weights as tiermem does (bf16 model, fp32 copies that AdamW updates, gradients upcast
before clipping). Reported: the largest loss difference per step and the largest parameter difference.

Transfers: host-to-device and device-to-host GB/s of --transfer-size bytes, by torch's own copies from pinned
and from pageable memory, and by tiermem's (a swapper's host pool and its mover, the side stream on CUDA);
whether the pool was really page-locked (a refused registration leaves it pageable and makes every copy
synchronous); and on CUDA how much of a copy on tiermem's side stream hides behind a compute kernel running
at the same time ((compute alone + copy alone - both) / the shorter of the two; 1 is full overlap).

Disk: `tiermem bench io` on the work directory (io.engine auto, 2 runs of --io-size): read and write GB/s,
set beside the inference's streaming read rate (bytes read / generate()'s seconds).

Every check has a tolerance (the constants below); the exit status is 0 when every section ran and every
check held, 1 when a check failed, 2 when a section raised. A summary of one line per figure is printed and
the report is written as JSON to --json, else $OUT/gpu_check.json when $OUT is set, else a temporary file,
after each section (a run stopped at its time limit keeps what it measured).

    PYTHONPATH=. python3 bench/gpu_check.py                  # on a GPU machine (scripts/gpu_check.sh)
    PYTHONPATH=. python3 bench/gpu_check.py --device cpu --small  # anywhere, about a minute
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from _common import (  # bench/ is on sys.path when run as a script
    cpu_model,
    package_versions,
    print_system_header,
    tiermem_tree,
    write_json,
)

import tiermem
from tiermem.device import copying_device, copying_device_state
from tiermem.io.backends import available_backends
from tiermem.io.bandwidth import GIB, system_info
from tiermem.sizes import parse_size
from tiermem.swap import TensorSwapper, Tier

SEED = 0  # the models' initial weights
INPUT_SEED = 1  # the token ids
LR = 1e-4
CLIP = 1.0
# Tolerances. Inference runs the same kernels on the same fp16 weights, so the logits should agree exactly;
# argmax and the generated tokens must. Training runs the AdamW update on the host (tiermem) against the
# device's kernel, so float32 results agree to rounding; bfloat16 parameters may differ by one bf16 ulp where
# the fp32 master weights round differently (2**-7 at 1.0, LayerNorm's weights).
LOGITS_ATOL = 1e-2
OVERLAP_MIN = 0.5  # of the shorter of a copy and a kernel, hidden when both run at once (CUDA)
LOSS_ATOL = {"float32": 1e-4, "bfloat16": 2e-2}
PARAM_ATOL = {"float32": 1e-5, "bfloat16": 1e-2}


@dataclass(frozen=True)
class Sizes:
    """The shapes and budgets of one run (the full GPU check, or --small)."""

    layers: int
    width: int
    vocab: int
    positions: int
    prompt: int
    tokens: int
    host_budget: str
    train_layers: int
    train_width: int
    train_vocab: int
    train_seq: int
    train_budget: str


FULL = Sizes(layers=24, width=1024, vocab=50257, positions=1024, prompt=32, tokens=16, host_budget="256MiB",
             train_layers=4, train_width=256, train_vocab=1000, train_seq=64, train_budget="40MiB")
SMALL = Sizes(layers=4, width=256, vocab=8192, positions=128, prompt=16, tokens=8, host_budget="8MiB",
              train_layers=2, train_width=128, train_vocab=1000, train_seq=32, train_budget="16MiB")


# -- helpers ------------------------------------------------------------------------------------------
def gpt2_config(layers: int, width: int, vocab: int, positions: int, **extra: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab,
                      n_positions=positions, bos_token_id=0, eos_token_id=0, pad_token_id=0, **extra)


def token_ids(shape: tuple[int, ...], vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    """Seeded token ids, drawn on the CPU (the same on every device) and placed on `device`."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (float("nan"), 0.0)


class TokenClock:
    """A transformers streamer that notes when each generated token arrives (the first put is the prompt)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def per_token(self) -> list[float]:
        """Seconds between consecutive generated tokens (the prompt's forward excluded)."""
        return [b - a for a, b in zip(self.times[1:], self.times[2:], strict=False)]


def generate(model: Any, ids: torch.Tensor, tokens: int, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """Greedy generation of exactly `tokens` tokens; the output (on the CPU) and its timings."""
    clock = TokenClock(device)
    synchronize(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, streamer=clock)
    synchronize(device)
    elapsed = time.perf_counter() - t0
    m, s = mean_std(clock.per_token())
    return out.cpu(), {"seconds": elapsed, "tokens_per_s": tokens / elapsed, "per_token_s_mean": m,
                       "per_token_s_std": s}


def compare_logits(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    same = got.argmax(-1) == ref.argmax(-1)
    return {"max_abs_diff": float((got - ref).abs().max()), "argmax_equal": int(same.sum()),
            "positions": same.numel()}


@contextmanager
def cuda_peak(device: torch.device, base: int) -> Iterator[dict[str, Any]]:
    """torch.cuda.max_memory_allocated over the block, less `base`; on the copying test device (--device copy)
    the peak of its device memory really alive; None on the plain CPU."""
    out: dict[str, Any] = {"bytes": None}
    copying = copying_device_state()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    elif copying.enabled:
        gc.collect()
        copying.reset_peak()
    yield out
    if device.type == "cuda":
        synchronize(device)
        out["bytes"] = torch.cuda.max_memory_allocated(device) - base
    elif copying.enabled:
        out["bytes"] = copying.peak_bytes - base


# -- transfers and the disk -----------------------------------------------------------------------------
def _gbps(fn: Callable[[], Any], nbytes: int, device: torch.device, reps: int = 5) -> float:
    """GB/s of `fn` (one transfer of `nbytes`, waited for), after one untimed call."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def check_transfers(sz: Sizes, device: torch.device, work: str, args: argparse.Namespace) -> dict[str, Any]:
    """Host<->device GB/s by torch's copies (pinned, pageable) and tiermem's, the pool's page-locking, overlap."""
    size = parse_size(args.transfer_size or ("16MiB" if args.small else "256MiB"))
    out: dict[str, Any] = {"bytes": size}
    if device.type == "cuda":
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        for kind, host in (("pinned", torch.empty(size, dtype=torch.uint8, pin_memory=True)),
                           ("pageable", torch.empty(size, dtype=torch.uint8))):
            out[f"torch_h2d_{kind}_gbps"] = _gbps(lambda h=host: dev.copy_(h, non_blocking=True), size, device)
            out[f"torch_d2h_{kind}_gbps"] = _gbps(lambda h=host: h.copy_(dev, non_blocking=True), size, device)
        del dev
    overrides = {"device": str(device), "nvme.paths": [os.path.join(work, "swap-transfers")],
                 "memory.host_budget": 2 * size}
    with TensorSwapper(None, **overrides) as sw:
        part = sw.add("transfer", {"w": torch.empty(size, dtype=torch.uint8, device="meta")}, home="cpu", zero=True)
        sw.register_pool()
        out["pool_page_locked"] = sw.pool.pinned if device.type == "cuda" else None
        mover, host = sw.mover, part.flat(Tier.HOST)
        out["tiermem_h2d_gbps"] = _gbps(lambda: mover.synchronize(mover.to_device(host)[1]), size, device)
        dev_t, event = mover.to_device(host)
        mover.synchronize(event)
        out["tiermem_d2h_gbps"] = _gbps(lambda: mover.synchronize(mover.to_host(dev_t, host)), size, device)
        if device.type == "cuda":
            out.update(_overlap(mover, host, dev_t, device))
    return out


def _overlap(mover: Any, host: torch.Tensor, dev_t: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """Seconds of a kernel alone, of tiermem's copy alone, of both at once, and the fraction hidden."""
    a = torch.randn(4096, 4096, device=device)

    def compute() -> None:
        for _ in range(8):
            a @ a

    def copy() -> None:
        mover.synchronize(mover.to_device_into(host, dev_t))

    def timed(fn: Callable[[], None]) -> float:
        fn()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - t0

    def both() -> None:
        compute()  # queued on the compute stream, not waited for: the copy starts while it runs
        copy()

    tc, tx, tb = timed(compute), timed(copy), timed(both)
    return {"compute_seconds": tc, "copy_seconds": tx, "both_seconds": tb,
            "overlap_fraction": (tc + tx - tb) / min(tc, tx)}


def check_disk(sz: Sizes, device: torch.device, work: str, args: argparse.Namespace) -> dict[str, Any]:
    """`tiermem bench io` on the work directory (io.engine auto): read and write GB/s."""
    size = args.io_size or ("64MiB" if args.small else "1GiB")
    cmd = [sys.executable, "-m", "tiermem", "bench", "io", "--path", os.path.join(work, "bench-io"), "--size", size,
           "--engine", "auto", "--runs", "2", "--json", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {res.returncode}: {res.stderr.strip()[-2000:]}")
    report = json.loads(res.stdout)
    rates = {r["mode"]: r for r in report["results"]}
    return {"command": " ".join(["tiermem", *cmd[3:]]), "read_gbps": rates["read"]["gbps_mean"],
            "write_gbps": rates["write"]["gbps_mean"], "engine": rates["read"].get("engine"), "results": report}


# -- inference ----------------------------------------------------------------------------------------
def check_inference(sz: Sizes, device: torch.device, work: str, args: argparse.Namespace) -> dict[str, Any]:
    """GPT-2-shaped fp16 model from a safetensors checkpoint under tiered_offload against it plainly on the device."""
    from transformers import GPT2LMHeadModel

    cfg = gpt2_config(sz.layers, sz.width, sz.vocab, sz.positions)
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(cfg).to(torch.float16).eval()
    ckpt_dir = os.path.join(work, "checkpoint")
    model.save_pretrained(ckpt_dir)
    ckpt = os.path.join(ckpt_dir, "model.safetensors")
    if not os.path.exists(ckpt):
        ckpt += ".index.json"
    params = {id(p): p for p in model.parameters()}.values()
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    blocks = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in model.transformer.h]
    largest_module = max(max(blocks), model.transformer.wte.weight.nbytes)
    made_s = time.perf_counter() - t0

    ids = token_ids((1, sz.prompt), sz.vocab, INPUT_SEED, device)
    model.to(device)
    with torch.no_grad():
        ref_logits = model(ids).logits.float().cpu()
    ref_tokens, ref_timing = generate(model, ids, sz.tokens, device)
    del model
    free_device(device)

    host_budget = parse_size(sz.host_budget)
    # slack for packing: 4 KiB-aligned partitions, 64-byte aligned tensors, small modules merged in (ln_f)
    device_budget = args.device_units * (largest_module + (256 << 10))
    swap = os.path.join(work, "swap-infer")
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # the copying device: 0, no buffers
    runs = []
    for prefetch in (True, False):
        with torch.device("meta"):
            meta = GPT2LMHeadModel(cfg).to(torch.float16).eval()
        overrides: dict[str, Any] = {"device": str(device), "params.tier": "nvme", "nvme.paths": [swap],
                                     "memory.host_budget": host_budget, "memory.device_budget": device_budget,
                                     "prefetch.depth": args.depth}
        t1 = time.perf_counter()
        with tiermem.tiered_offload(meta, checkpoint=ckpt, restore=False, prefetch=prefetch,
                                    **overrides) as tm:
            pack_s = time.perf_counter() - t1
            x = ids.to(tm.device)
            with torch.no_grad():
                logits = meta(x).logits.float().cpu()  # the first forward also records the execution order
            tm.reset_stats()
            with cuda_peak(device, base) as peak:
                out, timing = generate(meta, x, sz.tokens, device)
            s = tm.stats()
        runs.append({
            "prefetch": prefetch, "pack_seconds": pack_s, "logits": compare_logits(logits, ref_logits),
            "tokens_equal": bool(torch.equal(out, ref_tokens)), **timing,
            "bytes_read": s["bytes_read"], "read_gbps": s["bytes_read"] / timing["seconds"] / 1e9,
            "stall_seconds": s["stall_seconds"],
            "prefetch_hits": s["prefetch_hits"], "prefetch_misses": s["prefetch_misses"],
            "peak_bytes": s["peak_bytes"], "largest_unit_bytes": s["largest_unit_bytes"], "units": s["units"],
            "resident_bytes": s["resident_bytes"], "cuda_max_allocated_bytes": peak["bytes"],
        })
        del meta
        free_device(device)
    shutil.rmtree(swap, ignore_errors=True)
    return {"model": {"layers": sz.layers, "width": sz.width, "vocab": sz.vocab, "dtype": "float16",
                      "parameter_bytes": model_bytes, "made_seconds": made_s},
            "host_budget": host_budget, "device_budget": device_budget, "prompt": sz.prompt, "tokens": sz.tokens,
            "plain": ref_timing, "runs": runs}


# -- training -----------------------------------------------------------------------------------------
def train_model(sz: Sizes) -> Any:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(SEED)
    cfg = gpt2_config(sz.train_layers, sz.train_width, sz.train_vocab, sz.train_seq, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(cfg).train()


def train_plain(sz: Sizes, dtype: torch.dtype, batches: list[torch.Tensor], device: torch.device
                ) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """AdamW on the device; for a 16-bit dtype with fp32 master weights, as tiermem keeps them."""
    model = train_model(sz).to(device=device, dtype=dtype)
    params = list(model.parameters())
    master = params if dtype == torch.float32 else [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(master, lr=LR)
    losses, seconds = [], []
    for ids in batches:
        synchronize(device)
        t0 = time.perf_counter()
        x = ids.to(device)
        loss = model(x, labels=x).loss
        loss.backward()
        if master is not params:
            for p, m in zip(params, master, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(master, CLIP)
        opt.step()
        opt.zero_grad()
        if master is not params:
            with torch.no_grad():
                for p, m in zip(params, master, strict=True):
                    p.copy_(m)
        losses.append(float(loss.detach()))
        seconds.append(time.perf_counter() - t0)
    return losses, {n: p.detach().float().cpu() for n, p in model.named_parameters()}, seconds


def train_tiered(sz: Sizes, dtype: str, batches: list[torch.Tensor], device: torch.device, work: str
                 ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    """The same steps under tiered_offload with tm.optimizer, tm.backward and tm.clip_grad_norm_."""
    model = train_model(sz)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    swap = os.path.join(work, f"swap-train-{dtype}")
    overrides: dict[str, Any] = {"device": str(device), "params.tier": "nvme", "optimizer.tier": "nvme",
                                 "grads.tier": "cpu", "params.dtype": None if dtype == "float32" else dtype,
                                 "nvme.paths": [swap], "memory.host_budget": sz.train_budget}
    losses, seconds = [], []
    with tiermem.tiered_offload(model, optimizer=opt, **overrides) as tm:
        optimizer = tm.optimizer
        assert optimizer is not None  # training: tiered_offload was given the optimizer
        for ids in batches:
            synchronize(device)
            t0 = time.perf_counter()
            x = ids.to(tm.device)
            loss = model(x, labels=x).loss
            tm.backward(loss)
            tm.clip_grad_norm_(CLIP)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            seconds.append(time.perf_counter() - t0)
        s = tm.stats()
    shutil.rmtree(swap, ignore_errors=True)
    stats = {"bytes_read": s["bytes_read"], "bytes_written": s["bytes_written"], "peak_bytes": s["peak_bytes"],
             "step_seconds": seconds}
    # on exit the parameters are restored to their own dtype (float32): round as the plain run stores them
    named = {n: p.detach().to(getattr(torch, dtype)).float() for n, p in model.named_parameters()}
    return losses, named, stats


def check_training(sz: Sizes, device: torch.device, work: str, args: argparse.Namespace) -> dict[str, Any]:
    """Training steps under tiered_offload against plain device training, in float32 and bfloat16."""
    g = torch.Generator().manual_seed(INPUT_SEED)
    batches = [torch.randint(0, sz.train_vocab, (2, sz.train_seq), generator=g) for _ in range(args.steps)]
    out: dict[str, Any] = {"model": {"layers": sz.train_layers, "width": sz.train_width, "vocab": sz.train_vocab},
                           "batch": [2, sz.train_seq], "steps": args.steps, "lr": LR, "clip": CLIP,
                           "host_budget": parse_size(sz.train_budget), "dtypes": {}}
    for dtype in ("float32", "bfloat16"):
        ref_losses, ref_params, ref_seconds = train_plain(sz, getattr(torch, dtype), batches, device)
        free_device(device)
        losses, params, stats = train_tiered(sz, dtype, batches, device, work)
        free_device(device)
        out["dtypes"][dtype] = {
            "plain_losses": ref_losses, "tiermem_losses": losses,
            "loss_diff_per_step": [abs(a - b) for a, b in zip(losses, ref_losses, strict=True)],
            "max_param_diff": max(float((params[n] - p).abs().max()) for n, p in ref_params.items()),
            "plain_step_seconds": ref_seconds, **stats,
        }
    return out


# -- report -------------------------------------------------------------------------------------------
def check_compressed(sz: Sizes, device: torch.device, work: str, args: argparse.Namespace) -> dict[str, Any]:
    """params.storage int8 / int4 on the device: the expansion (cupy's fused kernel for int8 when cupy is
    installed, PyTorch's operations otherwise) against the same expansion on the CPU, and its time."""
    from tiermem.quant import Quantization, _cupy

    out: dict[str, Any] = {"cupy": _cupy() is not None and device.type == "cuda"}
    w = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(3)) * 0.02
    for bits in (8, 4):
        q = Quantization(bits, 128)
        specs = dict(q.specs("w", w.to("meta")))
        values = torch.empty(specs["w#q"].shape, dtype=specs["w#q"].dtype)
        scales = torch.empty(specs["w#scale"].shape)
        q.quantize_into(w, values, scales)
        ref = torch.empty_like(w)
        q.dequantize_into(values, scales, ref)
        dv, ds = values.to(device), scales.to(device)
        for dtype in (torch.float32, torch.bfloat16):
            got = torch.empty(w.shape, dtype=dtype, device=device)
            q.dequantize_into(dv, ds, got)
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(10):
                q.dequantize_into(dv, ds, got)
            synchronize(device)
            diff = (got.float().cpu() - ref).abs().max().item()
            out[f"int{bits}_{str(dtype).split('.')[-1]}"] = {"max_abs_diff_vs_cpu": diff,
                                                             "ms": (time.perf_counter() - t0) / 10 * 1e3}
    return out


def judge(report: dict[str, Any]) -> list[tuple[str, bool]]:
    """Each check by name, and whether it held."""
    checks: list[tuple[str, bool]] = []
    inf = report.get("inference")
    if inf:
        for r in inf["runs"]:
            tag = "prefetch" if r["prefetch"] else "no prefetch"
            lg = r["logits"]
            checks.append((f"inference ({tag}): logits within {LOGITS_ATOL}", lg["max_abs_diff"] <= LOGITS_ATOL))
            checks.append((f"inference ({tag}): argmax equal at every position", lg["argmax_equal"] == lg["positions"]))
            checks.append((f"inference ({tag}): generated tokens equal", r["tokens_equal"]))
            checks.append((f"inference ({tag}): ledger peak device <= device budget",
                           r["peak_bytes"]["device"] <= inf["device_budget"]))
            if report.get("device") == "copy":  # there nothing but tiermem's units is device memory
                checks.append((f"inference ({tag}): device memory alive <= the ledger's peak",
                               r["cuda_max_allocated_bytes"] <= r["peak_bytes"]["device"]))
    if "copy_faults" in report:
        checks.append(("copying device: no copy's source changed before it landed", not report["copy_faults"]))
    tx = report.get("transfers")
    if tx and tx.get("pool_page_locked") is not None:  # CUDA: copies are asynchronous only from page-locked memory
        checks.append(("transfers: tiermem's host pool is page-locked", bool(tx["pool_page_locked"])))
        checks.append((f"transfers: a copy on tiermem's side stream overlaps compute (>= {OVERLAP_MIN})",
                       bool(tx["pool_page_locked"]) and tx["overlap_fraction"] >= OVERLAP_MIN))
    comp = report.get("compressed")
    if comp:
        for key, r in comp.items():
            if isinstance(r, dict):  # fp32 equal to the CPU's expansion; bfloat16 within its own rounding
                bound = 0.0 if key.endswith("float32") else 2e-3
                checks.append((f"compressed {key}: expansion within {bound} of the CPU's",
                               r["max_abs_diff_vs_cpu"] <= bound))
    tr = report.get("training")
    if tr:
        for dtype, d in tr["dtypes"].items():
            checks.append((f"training {dtype}: loss within {LOSS_ATOL[dtype]} at every step",
                           max(d["loss_diff_per_step"]) <= LOSS_ATOL[dtype]))
            checks.append((f"training {dtype}: parameters within {PARAM_ATOL[dtype]}",
                           d["max_param_diff"] <= PARAM_ATOL[dtype]))
    return checks


def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1e6:.1f} MB"


def print_summary(report: dict[str, Any]) -> None:
    print("\nsummary (MB = 1e6 bytes)")
    inf = report.get("inference")
    if inf:
        m = inf["model"]
        print(f"inference model: {m['layers']} layers x {m['width']}, vocab {m['vocab']}, fp16, "
              f"{_mb(m['parameter_bytes'])}; host budget {_mb(inf['host_budget'])}, device budget "
              f"{_mb(inf['device_budget'])}")
        p = inf["plain"]
        print(f"plain on device: {p['tokens_per_s']:.2f} tokens/s (per token {p['per_token_s_mean'] * 1e3:.1f} ± "
              f"{p['per_token_s_std'] * 1e3:.1f} ms)")
        for r in inf["runs"]:
            tag = "prefetch   " if r["prefetch"] else "no prefetch"
            lg = r["logits"]
            print(f"tiermem {tag}: logits max abs diff {lg['max_abs_diff']:.3g}, argmax equal "
                  f"{lg['argmax_equal']}/{lg['positions']}, {inf['tokens']} generated tokens equal: "
                  f"{r['tokens_equal']}")
            print(f"tiermem {tag}: {r['tokens_per_s']:.2f} tokens/s (per token {r['per_token_s_mean'] * 1e3:.1f} ± "
                  f"{r['per_token_s_std'] * 1e3:.1f} ms), read {_mb(r['bytes_read'])}, stall "
                  f"{r['stall_seconds']:.2f} s, misses {r['prefetch_misses']}/"
                  f"{r['prefetch_hits'] + r['prefetch_misses']}, packed in {r['pack_seconds']:.1f} s")
            print(f"tiermem {tag}: peak device (ledger) {_mb(r['peak_bytes']['device'])}, device memory at peak "
                  f"{_mb(r['cuda_max_allocated_bytes'])}, largest unit {_mb(r['largest_unit_bytes'])} of {r['units']}, "
                  f"peak host {_mb(r['peak_bytes']['host'])}")
        runs = {r["prefetch"]: r for r in inf["runs"]}
        if True in runs and False in runs:
            print(f"speed-up from prefetch: {runs[True]['tokens_per_s'] / runs[False]['tokens_per_s']:.2f}x")
    tx = report.get("transfers")
    if tx:
        line = ", ".join(f"{k[:-5]} {v:.2f}" for k, v in tx.items() if k.endswith("_gbps"))
        print(f"transfers of {_mb(tx['bytes'])} (GB/s): {line}; pool page-locked: {tx['pool_page_locked']}"
              + (f"; overlap {tx['overlap_fraction']:.2f} (compute {tx['compute_seconds'] * 1e3:.1f} ms, copy "
                 f"{tx['copy_seconds'] * 1e3:.1f} ms, both {tx['both_seconds'] * 1e3:.1f} ms)"
                 if "overlap_fraction" in tx else ""))
    disk = report.get("disk")
    if disk:
        print(f"disk ({disk['command']}): read {disk['read_gbps']:.2f} GB/s, write {disk['write_gbps']:.2f} GB/s "
              f"({disk['engine']})")
        if inf:
            for r in inf["runs"]:
                tag = "prefetch" if r["prefetch"] else "no prefetch"
                print(f"inference {tag}: streamed {r['read_gbps']:.2f} GB/s, {r['read_gbps'] / disk['read_gbps']:.0%} "
                      f"of the disk's read, stall {r['stall_seconds']:.2f} s")
    tr = report.get("training")
    if tr:
        m = tr["model"]
        for dtype, d in tr["dtypes"].items():
            diffs = " ".join(f"{x:.2e}" for x in d["loss_diff_per_step"])
            print(f"training {dtype} ({m['layers']} layers x {m['width']}, {tr['steps']} AdamW steps): loss diff per "
                  f"step {diffs}; max param diff {d['max_param_diff']:.2e}; tiermem losses "
                  f"{' '.join(f'{x:.4f}' for x in d['tiermem_losses'])}")
            later = slice(1, None) if len(d["step_seconds"]) > 1 else slice(None)  # the first records the order
            mine, plain = statistics.fmean(d["step_seconds"][later]), statistics.fmean(d["plain_step_seconds"][later])
            print(f"training {dtype}: step {mine * 1e3:.1f} ms under tiermem against {plain * 1e3:.1f} ms in device "
                  f"memory ({mine / plain:.2f}x; steps after the first)")
    for name, err in report["errors"].items():
        print(f"{name}: FAILED with {err.splitlines()[-1]}")
    for name, ok in report["checks"]:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")


def header(device: torch.device, work: str) -> dict[str, Any]:
    """The system header: machine, swap directory, versions, GPU and the I/O backend tiermem uses."""

    system = system_info([work])
    system["cpu_model"] = cpu_model()
    system["memory_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    system["tiermem_tree"] = tiermem_tree()
    versions = {"torch": torch.__version__, **package_versions("transformers", "safetensors")}
    reason = available_backends()["io_uring"]  # io.engine auto: io_uring when usable, else threads
    system["io_backend"] = "io_uring" if reason is None else "threads"
    system["io_uring_unusable"] = reason
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        system["gpu"] = {"name": props.name, "memory_bytes": props.total_memory, "cuda": torch.version.cuda,
                         "capability": f"{props.major}.{props.minor}"}
    else:
        system["gpu"] = None
    print_system_header("tiermem GPU check", system, versions)
    gpu = system["gpu"]
    print(f"  compute device: {device}" + (f" ({gpu['name']}, {gpu['memory_bytes'] / GIB:.0f} GiB, CUDA {gpu['cuda']}, "
                                           f"sm {gpu['capability']})" if gpu else " (no GPU)"))
    print(f"  io backend: {system['io_backend']}" + (f" (io_uring not usable: {reason})" if reason else ""))
    return {"system": system, "versions": versions}


def default_json() -> str:
    out = os.environ.get("OUT")
    if out:
        return os.path.join(out, "gpu_check.json")
    fd, path = tempfile.mkstemp(prefix="gpu_check-", suffix=".json")
    os.close(fd)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda",
                   help="compute device: cuda, cuda:N, cpu, or copy (the CPU with tiermem's copying test device, "
                        "which counts the device memory really alive; default cuda)")
    p.add_argument("--small", action="store_true", help="small shapes, to try the script on the CPU")
    p.add_argument("--dir", default=None, help="work directory for the checkpoint and swap (default: a temporary one)")
    p.add_argument("--json", default=None, help="report path (default $OUT/gpu_check.json, else a temporary file)")
    p.add_argument("--tokens", type=int, default=None, help="tokens to generate (default 16, 8 with --small)")
    p.add_argument("--depth", type=int, default=2, help="prefetch.depth (default 2)")
    p.add_argument("--device-units", type=int, default=4,
                   help="memory.device_budget in units of the largest block or embedding (default 4)")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--transfer-size", default=None, help="bytes per transfer measured (default 256MiB, 16MiB small)")
    p.add_argument("--io-size", default=None, help="bytes per `tiermem bench io` run (default 1GiB, 64MiB small)")
    p.add_argument("--only", choices=["transfers", "disk", "infer", "compressed", "train"], default=None,
                   help="run one section")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        print("transformers is not installed: nothing to check", file=sys.stderr)
        return 2
    if args.device == "copy":
        with copying_device():
            return _run(args, torch.device("cpu"), "copy")
    return _run(args, torch.device(args.device), args.device)


def _run(args: argparse.Namespace, device: torch.device, label: str) -> int:
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available here; use --device cpu (with --small)", file=sys.stderr)
        return 2
    sz = SMALL if args.small else FULL
    if args.tokens is not None:
        sz = Sizes(**{**sz.__dict__, "tokens": args.tokens})
    json_path = args.json or default_json()
    work = args.dir or tempfile.mkdtemp(prefix="tiermem-gpu-check-")
    os.makedirs(work, exist_ok=True)
    report: dict[str, Any] = {**header(device, work), "device": label, "small": args.small, "errors": {}}
    sections: list[tuple[str, Callable[..., dict[str, Any]]]] = [("transfers", check_transfers),
                                                                 ("disk", check_disk),
                                                                 ("inference", check_inference),
                                                                 ("compressed", check_compressed),
                                                                 ("training", check_training)]
    t0 = time.perf_counter()
    for name, fn in sections:
        if args.only is not None and not name.startswith(args.only):
            continue
        print(f"\n{name} ...", flush=True)
        t1 = time.perf_counter()
        try:
            report[name] = fn(sz, device, work, args)
        except Exception:  # a failed section is reported, the others still run
            report["errors"][name] = traceback.format_exc()
            print(report["errors"][name], file=sys.stderr)
        print(f"{name} took {time.perf_counter() - t1:.1f} s", flush=True)
        free_device(device)
        report["seconds"] = time.perf_counter() - t0
        if label == "copy":  # races its copy streams caught (see [Note: as strict as a GPU] in tiermem/device.py)
            report["copy_faults"] = [str(f) for f in copying_device_state().faults]
        report["checks"] = judge(report)
        write_json(json_path, report)  # after each section: a run stopped at its limit keeps what it measured
    print_summary(report)
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    if report["errors"]:
        return 2
    return 0 if all(ok for _, ok in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
