#!/usr/bin/env python3
"""Training with the state offloaded: tiermem against DeepSpeed ZeRO-3 NVMe offload, with plain PyTorch in
memory as the baseline, side by side in one run.

The model is a GPT-2 (transformers GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=8192,
n_positions=128, use_cache=False), dropout off, fp32, the embedding and the head tied as transformers ties
them by default; use_cache=False because training never reads the key/value cache, which would otherwise hold
every block's keys and values until the forward returns),
trained with AdamW(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True) on batches of
2 x 128 random tokens, loss = model(ids, labels=ids).loss. Every variant builds the same model from the same
seed, in host memory, and sees the same batches in the same order. Variants:

  (a) plain PyTorch     torch.optim.AdamW, everything in host memory
  (b) tiermem cpu       tiermem.tiered_offload(model, optimizer=AdamW, device=cpu, params/optimizer/grads.tier
                        cpu, memory.host_budget=--cpu-host-budget): every tier in host memory
  (c) tiermem nvme      the same with params.tier nvme, optimizer.tier nvme, grads.tier --grads-tier,
                        memory.host_budget=--host-budget, io.engine io_uring, nvme.paths [--swap-dir/tiermem],
                        optimizer.update step: every unit updated inside step()
  (c') tiermem nvme     (c) with optimizer.update lazy, the default: each unit's update is applied as the
                        next forward fetches it
  (c'') tiermem nvme    (c') with activations.tier nvme and activations.buffer --activations-buffer (part of
                        the same host budget): saved activations go to swap in forward and come back for backward
  (c''/pt) tiermem nvme (c'') with memory.cpu_allocator torch: PyTorch's own CPU allocator in place of
                        tiermem's, which every other tiermem variant uses (the default, auto)
  (e) tiermem defaults  tiermem.tiered_offload(model, optimizer=AdamW, device=cpu, nvme.paths [--swap-dir/tiermem],
                        memory.host_budget=--host-budget) and nothing else: what a user who sets only where and
                        how much gets (issue 14's goals are on it)
  (e/t)                 (e) recording a timeline trace (trace.path), only when named in --variants: its cost
  (a/io)                (a) with fio moving --io-load GB/s (read,write; O_DIRECT, io_uring, 1 MiB requests, 32 in
                        flight, two rate-limited jobs on two 1 GiB files in --swap-dir) for the whole process, only
                        when named in --variants: what disk traffic alone costs the compute on this machine. On a
                        virtual machine whose disk is emulated by the host, I/O takes CPU time from the guest
                        (steal); an offload that moves those bytes pays it whatever its schedule, so (a/io), not
                        (a), is the floor for (e) here. fio's achieved read/write GB/s are in the JSON.
  (a/T), (e/T)          (a) and (e) trained by HF Trainer (Trainer(model, args, optimizers=(AdamW, None)).train(),
                        inside the context for (e/T)): its loop, clipping and accumulation, a constant lr, the
                        same batches in order; only when named in --variants. (e/T)'s losses are compared with
                        (a/T)'s (the Trainer sums an accumulated step's loss over all its tokens)
  (d) DeepSpeed ZeRO-3  deepspeed.initialize with zero_optimization stage 3, offload_param and
                        offload_optimizer on NVMe (--swap-dir/deepspeed), its own AdamW (DeepSpeedCPUAdam),
                        DS_ACCELERATOR=cpu, gloo, one process; offload_param.buffer_count = the number of
                        parameter tensors + 1 and buffer_size = the largest tensor's elements (it asserts
                        otherwise); every other setting its default

Every variant runs in its own subprocess, once per round; the order rotates from round to round. In its
subprocess a variant builds the model and its optimizer (untimed), runs --warmup untimed steps and then
--steps timed steps, with one full collection of Python's garbage collector between them, untimed (see
GcWatch in bench/_common.py; the timed steps' collections are in the JSON). A step is zero_grad, forward,
backward and the optimizer step; the optimizer step is also timed on its own. Before each subprocess starts,
the script waits (up to --quiet-wait seconds) for other processes to leave the CPUs idle, and each step
records how much CPU other processes took meanwhile (this machine may be shared, and with two cores one busy
neighbour slows PyTorch's two threads a lot). A process during whose timed steps other processes kept
--quiet-cores or more busy on average is run again, up to --retries times; the last attempt counts, and the
discarded ones are kept in the JSON.

Each round begins with `python3 -m tiermem bench io --engine io_uring --size --io-size --runs 3` in the swap
directory: its read and write GB/s are the engine bandwidth the I/O goal uses. Bytes moved per step are
tiermem's stats() bytes_read + bytes_written; for every variant the script also records the block-layer
read_bytes/write_bytes of /proc/self/io per step.

Beside issue 14's goals for (e) (<= 1.1 x (a), <= 0.4 x (d)), the report gives (e) against the floor its
budget sets (`budget_floor`): (a)'s step with its forward, timed apart, stretched to the disk time of the
bytes that the budget forces through the disk between the end of one backward and the next forward's use of
each unit, at the engine bandwidth measured in the same run.

Peak RSS is the subprocess's getrusage(RUSAGE_SELF).ru_maxrss, taken after the timed steps and before the
teardown (tiermem's exit restores the parameters and copies the optimizer state back into the user's
AdamW; that is not training). The script also resets the peak after set-up (/proc/self/clear_refs 5) and
reports the peak of the steps alone.

The optimizer goal is measured on the update alone: once a round, after the variants, one more process
builds the model twice from the same seed, runs one forward and backward on each, enters (b)'s
tiered_offload with one of them, and then takes --update-warmup untimed and --update-reps timed turns of
(b)'s tm.optimizer.step() and torch.optim.AdamW.step() on the other, the same gradients, in alternating
order. The goal compares the median times over all turns, and holds only if the two models' parameters are
bit-identical after the last turn. The in-loop optimizer step of (a) and (b) is reported beside it.

Correctness: (a), (b) and (c) see the same seed and data and must produce bit-identical losses at every step
(tiermem's update is PyTorch's own AdamW arithmetic in fp32). DeepSpeed's losses are shown against (a) too;
its CPU Adam is another implementation, so they are not expected to be identical.

    python3 bench/train_offload.py --json bench/results/train_offload.json

The workers inherit the script's environment. The malloc diagnostics that were variants here until issue 17
run that way, every process of the run under the setting: (c''') as MALLOC_MMAP_THRESHOLD_=262144, (a/je) and
(c''/je) as LD_PRELOAD=libjemalloc.so.2 MALLOC_CONF=background_thread:true, (a/mi) and (c''/mi) as
LD_PRELOAD=libmimalloc.so.2, each in front of the command with --variants plain,tiermem_act.

A quick debug run: --layers 2 --width 256 --vocab 1000 --host-budget 32MiB --activations-buffer 4MiB --rounds 1
--warmup 1 --steps 2.
GB = 1e9 bytes; MB = 1e6 bytes; MiB = 2**20 bytes; GiB = 2**30 bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from _common import (  # bench/ is on sys.path when run as a script
    GcWatch,
    check_variants,
    cpu_busy_seconds,
    describe_system,
    engine_bandwidth,
    mean_std,
    other_cpu_seconds,
    package_versions,
    peak_rss_bytes,
    print_system_header,
    proc_io,
    reset_peak_rss,
    rotated,
    run_worker,
    status_bytes,
    wait_for_quiet,
    worker_main,
    write_json,
)

from tiermem.io.bandwidth import GB
from tiermem.sizes import format_size, parse_size

DEFAULT_DIR = "/var/tmp/tiermem-train-bench"
RESULT_TAG = "TRAIN_OFFLOAD_RESULT "  # marks the worker's JSON line; DeepSpeed logs to stdout too
SUBPROCESS_TIMEOUT_S = 900
SEED = 0  # the model's initial weights
INPUT_SEED = 1234  # the token ids
# fused: PyTorch's fastest CPU AdamW kernel, for (a) and, as tiermem runs the kernel the optimizer asks for, (b) and (c)
ADAMW: dict[str, Any] = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "fused": True}
# --optimizers: what the plain and tiermem variants train with instead of AdamW (fused above), each at its
# usual fine-tuning settings; the ones other than AdamW tiermem steps per parameter ([Note: which optimizers])
OPTIMIZERS = ("adamw", "adafactor", "adamw8bit", "lion")


def make_optimizer(name: str, params: list[Any]) -> Any:
    """The optimizer `name` (one of OPTIMIZERS) on `params`."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, **ADAMW)
    if name == "adafactor":  # transformers' defaults: relative step, scaled by each parameter's RMS
        from transformers.optimization import Adafactor

        return Adafactor(params)
    if name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.01)
    if name == "lion":
        from lion_pytorch import Lion

        return Lion(params, lr=1e-5, weight_decay=0.1)
    raise ValueError(name)
STATE_BYTES_PER_PARAM = 16  # fp32 parameter + gradient + exp_avg + exp_avg_sq
# Goals from the issue.
IO_GOAL = 1.3  # (c) <= this x max((a), bytes moved per step / engine bandwidth)
DS_GOAL = 0.5  # (c) <= this x (d)
RSS_SLACK = 600 * 10**6  # (c) peak RSS <= host budget + this
OPTIMIZER_GOAL = 0.9  # (b) tm.optimizer.step() parameters/s >= this x torch.optim.AdamW.step()'s
# Issue 14, for (e) the defaults: <= this x (a) and x (d); peak RSS of the steps above the RSS after imports
DEFAULT_PLAIN_GOAL, DEFAULT_DS_GOAL, DEFAULT_RSS_SLACK = 1.1, 0.4, 300 * 10**6
MIN_STATE_TO_BUDGET = 2  # the training state should be at least this x the host budget of (c)


@dataclass(frozen=True)
class Variant:
    """One column of the comparison."""

    key: str  # stable name used in the JSON and the worker's command line
    label: str  # what the tables print
    kind: str  # plain | tiermem | deepspeed
    default: bool = True  # in the default --variants


VARIANTS = (
    Variant("plain", "(a) plain PyTorch", "plain"),
    Variant("tiermem_cpu", "(b) tiermem cpu tiers", "tiermem"),
    Variant("tiermem_nvme", "(c) tiermem nvme tiers", "tiermem"),
    Variant("tiermem_lazy", "(c') (c) + optimizer.update lazy", "tiermem"),
    Variant("tiermem_act", "(c'') (c') + activations.tier nvme", "tiermem"),
    # the defaults: only the swap folder and the host budget set
    Variant("tiermem_default", "(e) tiermem defaults", "tiermem"),
    # (e) recording a trace (trace.path): what tracing costs, against (e) in the same run
    Variant("tiermem_default_traced", "(e/t) (e) + trace.path", "tiermem", default=False),
    # (e) with activations.tier memory: every saved activation in memory, as auto chose before it minded the budget
    Variant("tiermem_default_actmem", "(e/m) (e) + activations.tier memory", "tiermem", default=False),
    # (c'') with PyTorch's own CPU allocator in place of tiermem's (memory.cpu_allocator: torch)
    Variant("tiermem_act_torchalloc", "(c''/pt) (c'') + memory.cpu_allocator torch", "tiermem"),
    # (e) with PyTorch's own CPU allocator: what the default allocator (auto: tiermem's) does in the defaults
    Variant("tiermem_default_torchalloc", "(e/pt) (e) + memory.cpu_allocator torch", "tiermem", default=False),
    Variant("deepspeed", "(d) DeepSpeed ZeRO-3 NVMe", "deepspeed"),
    # (a) beside fio moving --io-load through the swap disk: the floor the disk traffic sets on this machine
    Variant("plain_io", "(a/io) (a) + fio --io-load", "plain", default=False),
    # (a) and (e) with the loop HF Trainer runs instead of the script's own (see `trainer_steps`)
    Variant("trainer", "(a/T) (a) in HF Trainer", "plain", default=False),
    Variant("tiermem_default_trainer", "(e/T) (e) in HF Trainer", "tiermem", default=False),
)
TRAINER_LOOP = {"trainer", "tiermem_default_trainer"}
BY_KEY = {v.key: v for v in VARIANTS}
GOAL_VARIANTS = (("tiermem_nvme", ""), ("tiermem_lazy", "_lazy"), ("tiermem_default", "_default"),
                 ("tiermem_act", "_act"), ("tiermem_act_torchalloc", "_act_torchalloc"))  # (c) and its kin


def free_port() -> int:
    """A free TCP port on the loopback interface, for DeepSpeed's one-process group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the variants (run inside the worker subprocess) -------------------------------------------------
def build_model(spec: dict[str, Any]) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    cfg = GPT2Config(n_layer=spec["layers"], n_embd=spec["width"], n_head=spec["heads"], vocab_size=spec["vocab"],
                     n_positions=spec["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg).train()


def make_batches(spec: dict[str, Any], n: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(INPUT_SEED)
    return [torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=gen) for _ in range(n)]


def deepspeed_config(model: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer state on NVMe; only what it needs to start is set."""
    tensors = list(model.parameters())
    return {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": spec.get("accumulate", 1),
        **({"gradient_clipping": spec["clip"]} if spec.get("clip") is not None else {}),
        "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                  "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": spec["ds_swap_dir"],
                              "buffer_count": len(tensors) + 1,  # "not enough buffers" otherwise
                              "buffer_size": max(p.numel() for p in tensors)},  # elements of the largest
            "offload_optimizer": {"device": "nvme", "nvme_path": spec["ds_swap_dir"]},
        },
        # the same request size and queue depth as tiermem's io defaults
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def fio_load(spec: dict[str, Any]) -> Any:
    """Start fio reading and writing spec['io_load'] = [read, write] GB/s in spec['io_dir'] until stopped."""
    import subprocess

    os.makedirs(spec["io_dir"], exist_ok=True)
    read_bps, write_bps = (int(g * GB) for g in spec["io_load"])
    job, readfile, writefile = (os.path.join(spec["io_dir"], n) for n in ("load.fio", "read", "write"))
    with open(job, "w", encoding="ascii") as f:
        f.write("[global]\nioengine=io_uring\ndirect=1\nbs=1M\niodepth=32\nsize=1G\ntime_based\nruntime=86400\n"
                f"[read]\nrw=read\nfilename={readfile}\nrate={read_bps}\n"
                f"[write]\nrw=write\nfilename={writefile}\nrate=,{write_bps}\n")
    # the file fio reads is written whole first, so that the load's reads start at once
    subprocess.run(["fio", "--name=layout", "--rw=write", "--bs=1M", "--size=1G", "--direct=1",
                    f"--filename={readfile}"], check=True, capture_output=True)
    proc = subprocess.Popen(["fio", "--output-format=json", job], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(1.0)
    if proc.poll() is not None:
        raise RuntimeError(f"fio exited at once: {proc.communicate()[1].strip()[-500:]}")
    return proc


def fio_stop(proc: Any) -> dict[str, Any]:
    """Stop fio_load's fio; the GB/s it moved each way."""
    import json
    import signal

    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    try:
        jobs = json.loads(out[out.index("{"):])["jobs"]
    except ValueError:
        return {"error": f"fio printed no results: {err.strip()[-500:]}"}
    return {"read_gbps": sum(j["read"]["bw_bytes"] for j in jobs) / GB,
            "write_gbps": sum(j["write"]["bw_bytes"] for j in jobs) / GB}


def variant_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build one variant, run its warm-up and timed steps; return the figures."""
    t_start = time.perf_counter()
    rss_start = status_bytes("VmRSS")
    import torch
    import transformers
    from transformers import GPT2LMHeadModel  # noqa: F401 - its modules (0.15 GB) are imports, not the model

    v = BY_KEY[spec["variant"]]
    out: dict[str, Any] = {"variant": v.key, "torch_threads": torch.get_num_threads()}
    rss_imports = status_bytes("VmRSS")  # after every import the variant needs, before the model is built
    t0 = time.perf_counter()
    model = build_model(spec)
    out["rss_after_model_bytes"] = status_bytes("VmRSS")
    params = list(model.parameters())  # tied weights once
    out["parameters"] = sum(p.numel() for p in params)
    out["parameter_tensors"] = len(params)
    acc, clip = spec["accumulate"], spec["clip"]
    batches = make_batches(spec, (spec["warmup"] + spec["steps"]) * acc)
    tm = engine = None
    opt: Any = None  # what step() is called on: AdamW, tm.optimizer or DeepSpeed's
    stack: list[Any] = []  # context managers to leave at the end
    if v.kind == "plain":
        opt = make_optimizer(spec.get("optimizer", "adamw"), params)
        fwd = model
    elif v.kind == "tiermem":
        import tiermem

        opt0 = make_optimizer(spec.get("optimizer", "adamw"), params)
        overrides = dict(spec["tiermem"])
        out["tiermem_overrides"] = overrides
        ctx = tiermem.tiered_offload(model, optimizer=opt0, **overrides)
        tm = ctx.__enter__()
        stack.append(ctx)
        opt = tm.optimizer
        fwd = model
        out["units"] = len(tm.units)
        out["largest_unit_bytes"] = max(u.nbytes for u in tm.units)
        out["main_arena_bytes"] = tm.swapper.pool.arena_bytes["main"]  # the host pool less the activations arena
        out["cpu_allocator"] = "tiermem" if tiermem.cpu_allocator.cpu_allocator_installed() else "torch"
    elif v.kind == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        ds_cfg = deepspeed_config(model, spec)
        out["deepspeed_config"] = ds_cfg
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_cfg)
        out["deepspeed_optimizer"] = type(getattr(opt, "optimizer", opt)).__name__
        fwd = engine
    else:
        raise ValueError(v.kind)
    out["setup_seconds"] = time.perf_counter() - t0
    out["rss_after_setup_bytes"] = status_bytes("VmRSS")
    out["setup_peak_rss_bytes"] = peak_rss_bytes()
    out["peak_reset"] = reset_peak_rss()

    samples: list[dict[str, Any]] = []
    gcw = GcWatch()  # settled before the first timed step (see GcWatch)
    load = fio_load(spec) if v.key == "plain_io" else None
    try:
        if v.key in TRAINER_LOOP:
            samples = trainer_steps(spec, model, opt0 if tm is not None else opt, batches, tm, gcw)
        for i in range(0 if v.key in TRAINER_LOOP else spec["warmup"] + spec["steps"]):
            micro = batches[i * acc : (i + 1) * acc]
            if i == spec["warmup"]:
                gcw.settle()
            if tm is not None:
                tm.reset_stats()
            busy0, io0 = cpu_busy_seconds(), proc_io()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = torch.zeros(())
            norm = None  # the gradients' norm clip_grad_norm_ returned (not DeepSpeed's, which clips inside)
            forward_s = 0.0  # the forwards alone (with tiermem: the lazy updates they apply included)
            if engine is None:
                opt.zero_grad()
                for ids in micro:
                    f0 = time.perf_counter()
                    part = fwd(ids, labels=ids).loss / acc if acc > 1 else fwd(ids, labels=ids).loss
                    forward_s += time.perf_counter() - f0
                    (tm.backward if tm is not None else torch.Tensor.backward)(part)
                    loss += part.detach()
                if clip is not None:
                    if tm is not None:
                        norm = tm.clip_grad_norm_(clip)
                    else:
                        norm = torch.nn.utils.clip_grad_norm_(params, clip)
                t1 = time.perf_counter()
                opt.step()
            else:
                for ids in micro:  # it scales the loss by 1/acc and updates at the last micro-batch
                    part = fwd(ids, labels=ids).loss
                    engine.backward(part)
                    loss += part.detach() / acc
                    t1 = time.perf_counter()
                    engine.step()  # DeepSpeed zeroes the gradients itself
            t2, c2 = time.perf_counter(), time.process_time()
            busy2, io2 = cpu_busy_seconds(), proc_io()
            sample: dict[str, Any] = {
                "warmup": i < spec["warmup"], "loss": float(loss.detach()), "seconds": t2 - t0,
                "forward_backward_seconds": t1 - t0, "optimizer_seconds": t2 - t1, "cpu_seconds": c2 - c0,
                "forward_seconds": forward_s if engine is None else None,
                # CPU time other processes took during this step (/proc/stat ticks: +-10 ms)
                "other_cpu_seconds": other_cpu_seconds(busy0, busy2, c2 - c0),
                "disk_read_bytes": io2[0] - io0[0] if io0 and io2 else None,
                "disk_write_bytes": io2[1] - io0[1] if io0 and io2 else None,
                "grad_norm": float(norm) if norm is not None else None,  # before clipping
            }
            if tm is not None:
                sample.update(tiermem_sample(tm))
            samples.append(sample)
        out["gc_timed_steps"] = gcw.report()
        out["steps_peak_rss_bytes"] = status_bytes("VmHWM") if out["peak_reset"] else None
        out["peak_rss_bytes"] = max(out["setup_peak_rss_bytes"], peak_rss_bytes())
        out["rss_end_bytes"] = status_bytes("VmRSS")
    finally:
        if load is not None:
            out["io_load"] = fio_stop(load)
        t_down = time.perf_counter()
        for ctx in reversed(stack):
            ctx.__exit__(None, None, None)
        out["teardown_seconds"] = time.perf_counter() - t_down
    out["teardown_peak_rss_bytes"] = peak_rss_bytes()
    out["samples"] = samples
    out["rss_start_bytes"] = rss_start
    out["rss_after_imports_bytes"] = rss_imports
    out["transformers"] = transformers.__version__
    out["process_seconds"] = time.perf_counter() - t_start
    return out


def tiermem_sample(tm: Any) -> dict[str, Any]:
    """A step's figures from tm.stats() (reset at the step's start)."""
    st = tm.stats()
    out = {k: st[k] for k in ("bytes_read", "bytes_written", "stall_seconds", "update_wait_seconds")}
    out.update({k: v for k, v in st.items() if k.startswith("activations_")})
    out["peak_host_bytes"] = st["peak_bytes"]["host"]
    out["peak_device_bytes"] = st["peak_bytes"]["device"]
    return out


def trainer_steps(spec: dict[str, Any], model: Any, opt: Any, batches: list[Any], tm: Any,
                  gcw: GcWatch) -> list[dict[str, Any]]:
    """The variant's steps run by HF Trainer (`Trainer(model, args, optimizers=(opt, None)).train()`), as a user
    of it trains: its own loop, accumulation, clipping (--clip as max_grad_norm; none for None), a constant
    learning rate (the script's AdamW's), the script's batches in their order (its sampler made sequential),
    one log line a step. A step is timed from the Trainer's on_step_begin to its on_step_end callback, the
    optimizer step from on_pre_optimizer_step; the losses and gradient norms are those the Trainer logged
    (its loss over an accumulated step is summed over all its tokens, so they are compared with (a/T), not
    (a)). `opt` is the optimizer tiered_offload was given, for (e/T), as the Trainer is handed it."""
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Rows(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.rows = [row for b in batches for row in b]

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    class InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

    samples: list[dict[str, Any]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if len(samples) == spec["warmup"]:
                gcw.settle()
            if tm is not None:
                tm.reset_stats()
            self.busy0, self.io0 = cpu_busy_seconds(), proc_io()
            self.c0, self.t0 = time.process_time(), time.perf_counter()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t1 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            t2, c2 = time.perf_counter(), time.process_time()
            busy2, io2 = cpu_busy_seconds(), proc_io()
            sample = {"warmup": len(samples) < spec["warmup"], "seconds": t2 - self.t0,
                      "forward_backward_seconds": self.t1 - self.t0, "optimizer_seconds": t2 - self.t1,
                      "cpu_seconds": c2 - self.c0, "other_cpu_seconds": other_cpu_seconds(self.busy0, busy2,
                                                                                         c2 - self.c0),
                      "disk_read_bytes": io2[0] - self.io0[0] if self.io0 and io2 else None,
                      "disk_write_bytes": io2[1] - self.io0[1] if self.io0 and io2 else None}
            if tm is not None:
                sample.update(tiermem_sample(tm))
            samples.append(sample)

    steps = spec["warmup"] + spec["steps"]
    args = TrainingArguments(
        output_dir=os.path.join(spec["ds_swap_dir"], "..", "trainer"), per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=spec["accumulate"], max_grad_norm=spec["clip"] or 0.0, max_steps=steps,
        learning_rate=ADAMW["lr"], lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, seed=SEED)
    trainer = InOrder(model=model, args=args, train_dataset=Rows(), optimizers=(opt, None), callbacks=[Timer()])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    for sample, h in zip(samples, logged, strict=True):
        sample["loss"], sample["grad_norm"] = float(h["loss"]), float(h["grad_norm"])
    return samples


def update_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The optimizer update alone, in one process: tiermem's tm.optimizer.step() over (b)'s cpu tiers and
    torch.optim.AdamW.step() on an in-memory copy of the same model with the same gradients, timed in turns
    (which one goes first alternates), every step repeating the last one's arithmetic on the same data."""
    import torch

    import tiermem

    model, ref = build_model(spec), build_model(spec)  # one seed: the same weights
    ids = make_batches(spec, 1)[0]
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    ref(ids, labels=ids).loss.backward()
    params = sum(p.numel() for p in ref.parameters())
    pairs: list[dict[str, float]] = []
    with tiermem.tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), **ADAMW),
                                **spec["tiermem"]) as tm:
        opt = tm.optimizer
        assert opt is not None
        model(ids, labels=ids).loss.backward()
        for i in range(spec["update_warmup"] + spec["update_reps"]):
            times = {}
            for name, step in (("tiermem", opt.step), ("adamw", ref_opt.step))[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                step()
                times[name] = time.perf_counter() - t0
            if i >= spec["update_warmup"]:
                pairs.append(times)
    # the same arithmetic on the same data: tiermem's exit put its parameters back into the model
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    return {"parameters": params, "pairs": pairs, "parameters_equal": same,
            "steps_each": spec["update_warmup"] + spec["update_reps"]}


# -- subprocesses -------------------------------------------------------------------------------------
def start_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One worker process (this file with `_variant` or spec['worker']); its figures, or RuntimeError."""
    env = dict(os.environ)
    env.setdefault("MKL_CBWR", "AUTO,STRICT")  # reproducible BLAS from process to process (tests/conftest.py)
    if spec["variant"] == "deepspeed":
        env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                   WORLD_SIZE="1", LOCAL_RANK="0")
    return run_worker(__file__, spec.get("worker", "_variant"), spec, tag=RESULT_TAG, timeout=SUBPROCESS_TIMEOUT_S,
                      env=env)


def quiet_before(args: argparse.Namespace) -> dict[str, Any] | None:
    """Wait for other processes to leave the CPUs idle before a process starts (not when --quiet-wait is 0)."""
    if args.quiet_wait <= 0:
        return None
    return wait_for_quiet(args.quiet_cores, args.quiet_wait, pause_s=2.0)


def run_update(base: dict[str, Any], tiers: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The update benchmark's process (update_worker), after waiting for quiet CPUs."""
    quiet_before(args)
    spec = {**base, "variant": "update", "worker": "_update", "tiermem": tiers,
            "update_warmup": args.update_warmup, "update_reps": args.update_reps}
    try:
        out = start_worker(spec)
    except RuntimeError as exc:
        print(f"update benchmark FAILED: {exc}", file=sys.stderr, flush=True)
        return {"error": str(exc)}
    turns = [p["adamw"] / p["tiermem"] for p in out["pairs"]]
    print("update alone, AdamW's time / tiermem's per turn: " + " ".join(f"{r:.2f}" for r in turns),
          file=sys.stderr, flush=True)
    return out


def run_variant(v: Variant, spec: dict[str, Any], args: argparse.Namespace, ds_swap: str) -> dict[str, Any]:
    """One process of one variant, after waiting for quiet CPUs; failures come back as {'error': ...}."""
    quiet = quiet_before(args)
    if v.kind == "deepspeed":  # stale swap files of another size break its start
        shutil.rmtree(ds_swap, ignore_errors=True)
        os.makedirs(ds_swap)
    t0 = time.perf_counter()
    try:
        out = start_worker(spec)
    except RuntimeError as exc:
        out = {"variant": v.key, "error": str(exc)}
    out["took_seconds"] = time.perf_counter() - t0
    out["quiet_before"] = quiet
    return out


# -- summary and goals --------------------------------------------------------------------------------
def _mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(xs) if xs else None


def summarize(runs: list[dict[str, Any]], variants: list[Variant]) -> list[dict[str, Any]]:
    out = []
    for v in variants:
        mine = [r for r in runs if r["variant"] == v.key]
        ok = [r for r in mine if "error" not in r]
        entry: dict[str, Any] = {"variant": v.key, "label": v.label, "processes": len(ok),
                                 "failed": len(mine) - len(ok)}
        timed = [s for r in ok for s in r["samples"] if not s["warmup"]]
        if not timed:
            entry["error"] = mine[-1]["error"] if mine else "not run"
            out.append(entry)
            continue
        mean, sd = mean_std([t["seconds"] for t in timed])
        per_process = [statistics.fmean(s["seconds"] for s in r["samples"] if not s["warmup"]) for r in ok]
        opt_mean, opt_sd = mean_std([t["optimizer_seconds"] for t in timed])
        entry.update({
            "steps": len(timed),
            "seconds_mean": mean, "seconds_std": sd,
            "seconds_samples": [t["seconds"] for t in timed],
            "process_means": per_process,
            "steps_per_second": 1 / mean,
            "forward_backward_seconds_mean": statistics.fmean(t["forward_backward_seconds"] for t in timed),
            "optimizer_seconds_mean": opt_mean, "optimizer_seconds_std": opt_sd,
            "optimizer_parameters_per_second": ok[0]["parameters"] / opt_mean,
            "cpu_seconds_mean": statistics.fmean(t["cpu_seconds"] for t in timed),
            "other_cpu_cores_mean": statistics.fmean(t["other_cpu_seconds"] / t["seconds"] for t in timed)
            if all(t["other_cpu_seconds"] is not None for t in timed) else None,
            "disk_read_bytes_mean": _mean_of(timed, "disk_read_bytes"),
            "disk_write_bytes_mean": _mean_of(timed, "disk_write_bytes"),
            "setup_seconds_mean": statistics.fmean(r["setup_seconds"] for r in ok),
            "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in ok),
            "peak_rss_bytes_mean": statistics.fmean(r["peak_rss_bytes"] for r in ok),
            "steps_peak_rss_bytes_max": max((r["steps_peak_rss_bytes"] or 0) for r in ok) or None,
            "setup_peak_rss_bytes_max": max(r["setup_peak_rss_bytes"] for r in ok),
            "teardown_peak_rss_bytes_max": max(r["teardown_peak_rss_bytes"] for r in ok),
            "rss_after_imports_bytes_mean": statistics.fmean(r["rss_after_imports_bytes"] for r in ok),
            "parameters": ok[0]["parameters"],
            "torch_threads": sorted({r["torch_threads"] for r in ok}),
        })
        if v.kind == "tiermem":
            for key in ("bytes_read", "bytes_written", "stall_seconds", "update_wait_seconds"):
                entry[f"{key}_mean"] = statistics.fmean(t[key] for t in timed)
            entry["bytes_moved_mean"] = entry["bytes_read_mean"] + entry["bytes_written_mean"]
            entry["stall_seconds_std"] = mean_std([t["stall_seconds"] for t in timed])[1]
            entry["peak_host_bytes_max"] = max(t["peak_host_bytes"] for t in timed)
            for key in ("activations_stall_seconds", "activations_bytes_read", "activations_bytes_written",
                        "activations_kept_bytes"):
                if key in timed[0]:
                    entry[f"{key}_mean"] = statistics.fmean(t[key] for t in timed)
            entry["units"] = ok[0]["units"]
            entry["largest_unit_bytes"] = ok[0]["largest_unit_bytes"]
        out.append(entry)
    return out


def check_losses(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every variant's per-step losses against plain PyTorch's of the same round (those run by HF Trainer
    against (a/T)'s, which computes them its own way)."""
    ref = {(r["variant"], r["round"]): [s["loss"] for s in r["samples"]] for r in runs
           if r["variant"] in ("plain", "trainer") and "error" not in r}
    out = []
    for r in runs:
        key = ("trainer" if r["variant"] in TRAINER_LOOP else "plain", r["round"])
        if r["variant"] in ("plain", "trainer") or "error" in r or key not in ref:
            continue
        mine, base = [s["loss"] for s in r["samples"]], ref[key]
        diffs = [abs(a - b) for a, b in zip(mine, base, strict=True)]
        out.append({"variant": r["variant"], "round": r["round"], "steps": len(mine),
                    "bit_exact": mine == base, "max_abs_diff": max(diffs) if diffs else 0.0,
                    "losses": mine, "plain_losses": base})
    return out


def paired(runs: list[dict[str, Any]], a: str, b: str, of: str = "seconds") -> dict[str, float] | None:
    """Mean +- stdev over rounds of (a's mean `of` per step / b's), both from the same round; `of` is
    "seconds" (the step) or "optimizer_seconds" (the optimizer step alone)."""
    def mean_in(r: dict[str, Any]) -> float:
        return statistics.fmean(s[of] for s in r["samples"] if not s["warmup"])

    ratios = []
    for rnd in sorted({r["round"] for r in runs}):
        ra = next((r for r in runs if r["round"] == rnd and r["variant"] == a and "error" not in r), None)
        rb = next((r for r in runs if r["round"] == rnd and r["variant"] == b and "error" not in r), None)
        if ra and rb:
            ratios.append(mean_in(ra) / mean_in(rb))
    if not ratios:
        return None
    m, s = mean_std(ratios)
    return {"mean": m, "std": s, "rounds": len(ratios)}


def update_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every turn of the update benchmark's processes; ratio = tiermem's parameters/s over
    AdamW's. Empty when no process succeeded."""
    pairs = [p for r in runs for p in r["pairs"]]
    if not pairs:
        return {}
    tm = [p["tiermem"] for p in pairs]
    aw = [p["adamw"] for p in pairs]
    turns = [p["adamw"] / p["tiermem"] for p in pairs]
    n = runs[0]["parameters"]
    return {"processes": len(runs), "turns": len(tm), "tiermem_seconds_median": statistics.median(tm),
            "adamw_seconds_median": statistics.median(aw),
            "tiermem_parameters_per_second": n / statistics.median(tm),
            "adamw_parameters_per_second": n / statistics.median(aw),
            "ratio": statistics.median(aw) / statistics.median(tm), "turn_ratio_median": statistics.median(turns),
            "turn_ratio_min": min(turns), "turn_ratio_max": max(turns),
            "process_ratios": [statistics.median(p["adamw"] for p in r["pairs"])
                               / statistics.median(p["tiermem"] for p in r["pairs"]) for r in runs],
            "parameters_equal": all(r["parameters_equal"] for r in runs), "steps_each": runs[0]["steps_each"]}


def budget_floor(e: dict[str, Any], a: dict[str, Any], runs: list[dict[str, Any]], bw: dict[str, Any],
                 model: dict[str, Any]) -> dict[str, Any]:
    """Issue 14's speed goal as far as the budget lets any exact schedule meet it: (a)'s step with its forward
    stretched to the disk time that the budget forces into the forward window (docs/benchmarks.md, "Updated
    state kept in host memory, written in backward"). The clip coefficient is known only when backward ends,
    so every unit's update falls between then and the unit's use in the next forward. At that boundary the
    pool's main arena (the budget less the activations arena) holds at most its size of the parameters,
    accumulators and Adam state, so the forward reads at least the rest; when the last update is done it can
    hold at most its size of the updated parameters and state, so the forward writes at least the rest.
    Reads and writes share the disk (fio here: 0.75 + 0.75 GB/s mixed against 1.46 reading alone), so their
    times add. Kept activations, which take room too, are left out: a lower bound."""
    params = 4 * model["parameters"]
    arena = min(r["main_arena_bytes"] for r in runs if r["variant"] == "tiermem_default" and "main_arena_bytes" in r)
    reads = max(0, model["training_state_bytes"] - arena)  # parameters + accumulators + state - arena
    writes = max(0, 3 * params - arena)  # the updated parameters and state
    disk_s = reads / (bw["read_gbps"] * GB) + writes / (bw["write_gbps"] * GB)
    fwd = [x["forward_seconds"] for r in runs if r["variant"] == "plain" and "error" not in r
           for x in r["samples"] if not x["warmup"] and x.get("forward_seconds") is not None]
    a_fwd = sum(fwd) / len(fwd) if fwd else 0.0  # (a)'s forwards untimed (an older JSON): the disk time alone
    floor = a["seconds_mean"] - a_fwd + max(a_fwd, disk_s)
    r = e["seconds_mean"] / floor
    return {"held": r <= DEFAULT_PLAIN_GOAL, "ratio": r, "goal": DEFAULT_PLAIN_GOAL, "floor_s": floor,
            "plain_forward_s": a_fwd, "forward_disk_s": disk_s, "forced_read_bytes": reads,
            "forced_write_bytes": writes}


def goals(summary: list[dict[str, Any]], runs: list[dict[str, Any]], bw: dict[str, Any] | None,
          host_budget: int, losses: list[dict[str, Any]], update: dict[str, Any] | None,
          model: dict[str, Any] | None = None) -> dict[str, Any]:
    by = {s["variant"]: s for s in summary if "seconds_mean" in s}
    a, b, d = (by.get(k) for k in ("plain", "tiermem_cpu", "deepspeed"))
    out: dict[str, Any] = {
        "io_goal": f"(c) s/step <= {IO_GOAL} x max((a), bytes moved per step / engine bandwidth)",
        "ds_goal": f"(c) s/step <= {DS_GOAL} x (d)",
        "rss_goal": f"(c) peak RSS <= host budget + {RSS_SLACK // 10**6} MB",
        "optimizer_goal": f"(b) tm.optimizer.step() parameters/s >= {OPTIMIZER_GOAL} x torch.optim.AdamW.step()'s",
        "losses_goal": "(b) and (c) losses bit-identical to (a) at every step",
    }
    for key, suffix in GOAL_VARIANTS:
        c = by.get(key)
        if c and a and bw:
            io_s = c["bytes_read_mean"] / (bw["read_gbps"] * GB) + c["bytes_written_mean"] / (bw["write_gbps"] * GB)
            limit = IO_GOAL * max(a["seconds_mean"], io_s)
            out["io_bound" + suffix] = {
                "held": c["seconds_mean"] <= limit, "tiermem_s": c["seconds_mean"], "plain": "plain",
                "plain_s": a["seconds_mean"], "io_seconds": io_s, "limit_s": limit,
                "ratio": c["seconds_mean"] / max(a["seconds_mean"], io_s),
                "paired_vs_plain": paired(runs, key, "plain")}
        if c and d:
            out["vs_deepspeed" + suffix] = {"held": c["seconds_mean"] <= DS_GOAL * d["seconds_mean"],
                                            "ratio": c["seconds_mean"] / d["seconds_mean"],
                                            "paired": paired(runs, key, "deepspeed")}
        if c:
            limit = host_budget + RSS_SLACK
            out["rss" + suffix] = {"held": c["peak_rss_bytes_max"] <= limit,
                                   "peak_rss_bytes_max": c["peak_rss_bytes_max"],
                                   "steps_peak_rss_bytes_max": c["steps_peak_rss_bytes_max"], "limit_bytes": limit}
    e = by.get("tiermem_default")  # issue 14: the defaults, with the loop's clipping and accumulation
    f = by.get("plain_io")
    if e and f:  # against the floor the disk traffic sets on this machine
        r = e["seconds_mean"] / f["seconds_mean"]
        out["default_vs_plain_io"] = {"held": r <= DEFAULT_PLAIN_GOAL, "ratio": r, "goal": DEFAULT_PLAIN_GOAL,
                                      "paired": paired(runs, "tiermem_default", "plain_io")}
    if e and a:
        r = e["seconds_mean"] / a["seconds_mean"]
        out["default_vs_plain"] = {"held": r <= DEFAULT_PLAIN_GOAL, "ratio": r, "goal": DEFAULT_PLAIN_GOAL,
                                   "paired": paired(runs, "tiermem_default", "plain")}
    if e and d:
        r = e["seconds_mean"] / d["seconds_mean"]
        out["default_vs_deepspeed"] = {"held": r <= DEFAULT_DS_GOAL, "ratio": r, "goal": DEFAULT_DS_GOAL,
                                       "paired": paired(runs, "tiermem_default", "deepspeed")}
    et, at = by.get("tiermem_default_trainer"), by.get("trainer")
    if et and at:  # the same goal with the loop HF Trainer runs
        r = et["seconds_mean"] / at["seconds_mean"]
        out["default_vs_plain_trainer"] = {"held": r <= DEFAULT_PLAIN_GOAL, "ratio": r, "goal": DEFAULT_PLAIN_GOAL,
                                           "paired": paired(runs, "tiermem_default_trainer", "trainer")}
    if e and a and bw and model:
        out["default_vs_floor"] = budget_floor(e, a, runs, bw, model)
    if e:
        above = max(r["steps_peak_rss_bytes"] - r["rss_after_imports_bytes"] for r in runs
                    if r["variant"] == "tiermem_default" and "error" not in r and r.get("steps_peak_rss_bytes"))
        out["default_rss_above_imports"] = {"held": above <= host_budget + DEFAULT_RSS_SLACK, "peak": above,
                                            "limit": host_budget + DEFAULT_RSS_SLACK}
    if update is not None:
        # a fast update that computes something else is no update: the parameters must match AdamW's
        out["optimizer"] = {"held": update["ratio"] >= OPTIMIZER_GOAL and update["parameters_equal"],
                            "measured": "update", "parameters_equal": update["parameters_equal"],
                            "tiermem_parameters_per_second": update["tiermem_parameters_per_second"],
                            "adamw_parameters_per_second": update["adamw_parameters_per_second"],
                            "ratio": update["ratio"], "paired": None}
    if a and b:
        mine, theirs = b["optimizer_parameters_per_second"], a["optimizer_parameters_per_second"]
        out["optimizer" if update is None else "optimizer_in_loop"] = {
                            "held": mine >= OPTIMIZER_GOAL * theirs, "measured": "in the training loop",
                            "tiermem_parameters_per_second": mine,
                            "adamw_parameters_per_second": theirs, "ratio": mine / theirs,
                            "paired": paired(runs, "plain", "tiermem_cpu", of="optimizer_seconds")}
    tm = [x for x in losses if x["variant"] != "deepspeed"]
    out["losses"] = {"held": bool(tm) and all(x["bit_exact"] for x in tm), "compared": len(tm)}
    return out


# -- printing -----------------------------------------------------------------------------------------
def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def clip_activity(runs: list[dict[str, Any]], clip: float | None) -> str | None:
    """How often clip_grad_norm_ scaled the gradients in (a)'s steps: what updating during backward as if
    nothing clips, and redoing the update when it does (speculate and validate), would have had to redo."""
    norms = [x["grad_norm"] for r in runs if r["variant"] == "plain" and "error" not in r
             for x in r["samples"] if x.get("grad_norm") is not None]
    if clip is None or not norms:
        return None
    above = sum(n > clip for n in norms)
    return (f"clipping at {clip:g} scaled the gradients in {above} of (a)'s {len(norms)} steps, warm-up included "
            f"(norms {min(norms):.3g} to {max(norms):.3g})")


def print_header(system: dict[str, Any], versions: dict[str, str], model: dict[str, Any], args: Any) -> None:
    print_system_header("tiermem training offload vs DeepSpeed ZeRO-3", system, versions)
    print(f"  model: GPT2LMHeadModel(n_layer={args.layers}, n_embd={args.width}, n_head={args.heads}, "
          f"vocab_size={args.vocab}, n_positions={args.seq}), dropout 0, fp32; "
          f"{model['parameters'] / 1e6:.1f}M parameters ({model['parameters_counting_tied_twice'] / 1e6:.1f}M "
          f"counting the tied embedding/head twice); batch {args.batch}x{args.seq}")
    print(f"  training state (fp32 params + grads + 2 Adam moments): {_gb(model['training_state_bytes'])} GB = "
          f"{model['training_state_bytes'] / args.host_budget_bytes:.2f} x (c)'s host budget "
          f"{format_size(args.host_budget_bytes)}; (b)'s host budget {format_size(args.cpu_host_budget_bytes)}")
    print(f"  per process {args.warmup} warm-up + {args.steps} timed steps; {args.rounds} rounds, variants in "
          f"rotating order; (c) grads.tier {args.grads_tier}")
    print(flush=True)


def print_tables(summary: list[dict[str, Any]], verdict: dict[str, Any], bw: dict[str, Any] | None,
                 losses: list[dict[str, Any]], host_budget: int) -> None:
    head = (f"{'variant':<27} {'s/step':>15} {'steps/s':>7} {'opt s':>6} {'others':>6} {'peak RSS GB':>11} "
            f"{'steps RSS':>9} {'moved GB':>8} {'disk r/w GB':>11} {'stall s':>7} {'upd wait':>8} {'setup s':>7}")
    print(head)
    print("-" * len(head))
    for s in summary:
        lead = f"{s['label']:<27}"
        if "seconds_mean" not in s:
            print(f"{lead} failed: {s['error'].splitlines()[0]}")
            continue
        tm = "bytes_moved_mean" in s
        t = f"{s['seconds_mean']:.3f} ± {s['seconds_std']:.3f}"
        others = "?" if s["other_cpu_cores_mean"] is None else f"{s['other_cpu_cores_mean']:.2f}"
        disk = f"{_gb(s['disk_read_bytes_mean'])}/{_gb(s['disk_write_bytes_mean'])}"
        print(f"{lead} {t:>15} {s['steps_per_second']:>7.3f} {s['optimizer_seconds_mean']:>6.3f} {others:>6} "
              f"{_gb(s['peak_rss_bytes_max']):>11} {_gb(s['steps_peak_rss_bytes_max']):>9} "
              f"{_gb(s['bytes_moved_mean']) if tm else '-':>8} {disk:>11} "
              f"{(format(s['stall_seconds_mean'], '.3f') if tm else '-'):>7} "
              f"{(format(s['update_wait_seconds_mean'], '.3f') if tm else '-'):>8} {s['setup_seconds_mean']:>7.1f}")
    print("opt s: the optimizer step alone; others: CPU cores other processes kept busy during the steps; peak RSS: "
          "ru_maxrss of the process (set-up and steps); steps RSS: peak over the steps alone; moved GB: tiermem "
          "stats() bytes_read + bytes_written per step; disk r/w: /proc/self/io per step; stall s: tiermem's per step "
          "(forward and backward waiting for parameters); upd wait: its updates waiting for their reads, per step")
    print()
    if bw:
        print(f"tiermem io_uring on the swap disk: read {bw['read_gbps']:.2f} ± {bw['read_gbps_std']:.2f} GB/s, "
              f"write {bw['write_gbps']:.2f} ± {bw['write_gbps_std']:.2f} GB/s ({bw['samples']} transfers of "
              f"{bw['size']} each way)")
    bad = [x for x in losses if not x["bit_exact"]]
    print("losses vs (a) (those in HF Trainer vs (a/T)), every step: " + "; ".join(
        f"{x['variant']} r{x['round']} " + ("bit-exact" if x["bit_exact"] else f"max |diff| {x['max_abs_diff']:.3g}")
        for x in losses))
    if any(x["variant"] != "deepspeed" for x in bad):
        print("  NOT bit-exact: " + ", ".join(f"{x['variant']} round {x['round']}" for x in bad
                                               if x["variant"] != "deepspeed"))
    print()
    print("goals:")
    for key, suffix in GOAL_VARIANTS:
        name = BY_KEY[key].label.split(" ", 1)[0]
        g = verdict.get("io_bound" + suffix)
        if g:
            pv = g["paired_vs_plain"]
            print(f"  {name} {verdict['io_goal'][4:]}: {'held' if g['held'] else 'NOT held'} "
                  f"({g['tiermem_s']:.3f} s vs limit {g['limit_s']:.3f} s = {IO_GOAL} x max({g['plain_s']:.3f}, "
                  f"{g['io_seconds']:.3f}); ratio {g['ratio']:.2f}"
                  + (f"; {name}/(a) paired per round {pv['mean']:.2f} ± {pv['std']:.2f}" if pv else "") + ")")
        g = verdict.get("vs_deepspeed" + suffix)
        if g:
            pv = g["paired"]
            print(f"  {name} {verdict['ds_goal'][4:]}: {'held' if g['held'] else 'NOT held'} ({g['ratio']:.2f} x (d), "
                  f"limit {DS_GOAL}" + (f", paired per round {pv['mean']:.2f} ± {pv['std']:.2f}" if pv else "") + ")")
        g = verdict.get("rss" + suffix)
        if g:
            print(f"  {name} {verdict['rss_goal'][4:]}: {'held' if g['held'] else 'NOT held'} "
                  f"(peak {_gb(g['peak_rss_bytes_max'])} GB, steps alone {_gb(g['steps_peak_rss_bytes_max'])} GB, "
                  f"vs limit {_gb(g['limit_bytes'])} GB = {format_size(host_budget)} + {RSS_SLACK // 10**6} MB)")
    for key in ("optimizer", "optimizer_in_loop"):
        g = verdict.get(key)
        if g:
            pv = g["paired"]
            print(f"  {verdict['optimizer_goal']}, {g['measured']}: {'held' if g['held'] else 'NOT held'} "
                  f"({g['tiermem_parameters_per_second'] / 1e6:.0f}M vs {g['adamw_parameters_per_second'] / 1e6:.0f}M "
                  f"parameters/s, ratio {g['ratio']:.2f}" + (f", paired per round {pv['mean']:.2f} ± {pv['std']:.2f}"
                                                             if pv else "") + ")")
    for key, what in (("default_vs_plain", "(a)"), ("default_vs_plain_io", "(a/io)"),
                      ("default_vs_deepspeed", "(d)"), ("default_vs_plain_trainer", "(a/T), both in HF Trainer")):
        g = verdict.get(key)
        if g:
            who = "(e/T)" if key.endswith("_trainer") else "(e)"
            print(f"  {who} the defaults <= {g['goal']} x {what}: {'held' if g['held'] else 'NOT held'} "
                  f"({g['ratio']:.2f} x)")
    g = verdict.get("default_vs_floor")
    if g:
        print(f"  (e) the defaults <= {g['goal']} x the budget's floor: {'held' if g['held'] else 'NOT held'} "
              f"({g['ratio']:.2f} x {g['floor_s']:.3f} s: (a) with its {g['plain_forward_s']:.3f} s forward taking "
              f"{g['forward_disk_s']:.3f} s, the disk time of the {g['forced_read_bytes'] / 1e9:.2f} GB read and "
              f"{g['forced_write_bytes'] / 1e9:.2f} GB written that the budget forces into it, if longer)")
    g = verdict.get("default_rss_above_imports")
    if g:
        print(f"  (e) peak RSS of the steps above the RSS after imports <= host budget + 300 MB: "
              f"{'held' if g['held'] else 'NOT held'} ({g['peak'] / 1e9:.2f} GB, limit {g['limit'] / 1e9:.2f} GB)")
    g = verdict["losses"]
    print(f"  {verdict['losses_goal']}: {'held' if g['held'] else 'NOT held'} ({g['compared']} processes compared)")


# -- main ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12, help="GPT-2 layers (default 12)")
    p.add_argument("--width", type=int, default=768, help="GPT-2 n_embd (default 768)")
    p.add_argument("--heads", type=int, default=None, help="GPT-2 n_head (default: width / 64)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence and n_positions (default 128)")
    p.add_argument("--batch", type=int, default=2, help="sequences per batch (default 2)")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs every variant once, in its own "
                   "process (default 4)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per process (default 3)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per process (default 6)")
    p.add_argument("--host-budget", default="544MiB", help="memory.host_budget of (c) and its kin (default 544MiB; "
                   "in (c'') --activations-buffer of it holds activations, the rest partitions)")
    p.add_argument("--cpu-host-budget", default="2GiB", help="(b)'s memory.host_budget; it must hold the whole "
                   "training state (default 2GiB)")
    p.add_argument("--activations-buffer", default="64MiB",
                   help="activations.buffer of (c''), part of its host budget (default 64MiB)")
    p.add_argument("--clip", type=float, default=None, help="clip_grad_norm_(CLIP) before every optimizer step, in "
                   "every variant (DeepSpeed: gradient_clipping); default: no clipping")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches (backward passes) per optimizer step, "
                   "each of --batch sequences, the loss divided by this (default 1); times are per optimizer step")
    p.add_argument("--grads-tier", default="cpu", choices=("cpu", "nvme"), help="(c)'s grads.tier (default cpu)")
    p.add_argument("--swap-dir", default=os.path.join(DEFAULT_DIR, "swap"),
                   help="folder for tiermem's and DeepSpeed's swap files and the bandwidth test")
    p.add_argument("--io-size", default="1GiB", help="bytes per transfer of the bandwidth test (default 1GiB)")
    p.add_argument("--quiet-wait", type=float, default=120.0, help="seconds to wait at most, before each process, "
                   "for other processes to leave the CPUs idle (default 120; 0: do not wait)")
    p.add_argument("--quiet-cores", type=float, default=0.3, help="'idle' means other processes use fewer CPU "
                   "cores than this (default 0.3)")
    p.add_argument("--retries", type=int, default=2, help="times to run a process again when other processes "
                   "took --quiet-cores or more during its timed steps (default 2; the last attempt is kept)")
    p.add_argument("--variants", default=",".join(v.key for v in VARIANTS if v.default),
                   help="comma-separated subset of: " + ", ".join(v.key for v in VARIANTS)
                   + " (default: " + ",".join(v.key for v in VARIANTS if v.default) + ")")
    p.add_argument("--update-reps", type=int, default=20,
                   help="timed turns of the update benchmark: (b)'s tm.optimizer.step() and torch.optim.AdamW.step() "
                        "on the same data, in one process (default 20; 0: skip it)")
    p.add_argument("--update-warmup", type=int, default=3, help="untimed turns before those (default 3)")
    p.add_argument("--io-load", default="0.38,0.35", metavar="READ,WRITE",
                   help="GB/s fio reads and writes beside (a/io) (default 0.38,0.35: with the default model and "
                        "budget, about the bytes (e) moves per step, 1.17 GB read and 1.10 GB written)")
    p.add_argument("--optimizers", default=None, metavar="LIST",
                   help="comma-separated subset of " + ",".join(OPTIMIZERS) + ": instead of the comparison above, run "
                   "each --variants variant (plain and tiermem ones) with each of these optimizers, every round, and "
                   "report mean step and update times and their ratios to AdamW's in the same variant and to plain "
                   "PyTorch's with the same optimizer")
    p.add_argument("--json", metavar="OUT.json", default=None, help="also write every figure to this file")
    args = p.parse_args(argv)
    if args.heads is None:
        args.heads = max(1, args.width // 64)
    try:
        args.host_budget_bytes = parse_size(args.host_budget, what="--host-budget")
        args.cpu_host_budget_bytes = parse_size(args.cpu_host_budget, what="--cpu-host-budget")
        parse_size(args.io_size, what="--io-size")
        args.io_load_gbps = [float(g) for g in args.io_load.split(",")]
        if len(args.io_load_gbps) != 2 or min(args.io_load_gbps) <= 0:
            raise ValueError(f"--io-load {args.io_load!r}: expected READ,WRITE in GB/s, both above 0, e.g. 0.5,0.5")
    except ValueError as exc:
        p.error(str(exc))
    args.variant_list = [BY_KEY[k] for k in check_variants(p, args.variants, list(BY_KEY))]
    if args.optimizers is not None:
        args.optimizer_list = check_variants(p, args.optimizers, list(OPTIMIZERS), flag="--optimizers")
        if any(v.kind not in ("plain", "tiermem") or v.key in TRAINER_LOOP or v.key == "plain_io"
               for v in args.variant_list):
            p.error("--optimizers: --variants must name plain and tiermem variants only (not deepspeed, the "
                    "Trainer's or plain_io)")
    if min(args.rounds, args.steps, args.layers, args.batch, args.seq) < 1 or args.warmup < 0 \
            or args.width % args.heads:
        p.error("--rounds, --steps, --layers, --batch and --seq must be >= 1, --warmup >= 0, and --width a multiple "
                "of --heads")
    return args


def model_info(args: argparse.Namespace) -> dict[str, Any]:
    """Parameter counts of the model, from its shapes (no weights are made in this process)."""
    w, v, s, n = args.width, args.vocab, args.seq, args.layers
    block = 4 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w)  # 2 LN, attn, MLP
    params = v * w + s * w + n * block + 2 * w  # wte (= lm_head), wpe, blocks, ln_f
    return {"class": "GPT2LMHeadModel", "n_layer": n, "n_embd": w, "n_head": args.heads, "vocab_size": v,
            "n_positions": s, "dtype": "float32", "parameters": params,
            "parameters_counting_tied_twice": params + v * w,
            "training_state_bytes": STATE_BYTES_PER_PARAM * params, "batch": [args.batch, args.seq]}


def optimizer_costs(args: argparse.Namespace, argv: list[str], base: dict[str, Any], tiers: dict[str, Any],
                    system: dict[str, Any], versions: dict[str, str], model: dict[str, Any]) -> int:
    """--optimizers: every variant with every optimizer, once a round in its own process (rotating order);
    mean step and optimizer-step seconds over the timed steps, and their ratios."""
    runs: list[dict[str, Any]] = []
    pairs = [(v, name) for name in args.optimizer_list for v in args.variant_list]
    for rnd in range(args.rounds):
        for v, name in rotated(pairs, rnd):
            out = run_variant(v, {**base, "variant": v.key, "tiermem": tiers.get(v.key), "optimizer": name}, args, "")
            out.pop("took_seconds", None)
            out.update(round=rnd, optimizer=name)
            if "error" in out:
                print(f"[{rnd + 1}/{args.rounds}] {name} {v.label} FAILED:\n{out['error']}", file=sys.stderr)
            else:
                timed = [x for x in out["samples"] if not x["warmup"]]
                print(f"[{rnd + 1}/{args.rounds}] {name:<10} {v.label:<27} "
                      + " ".join(f"{x['seconds']:.3f}" for x in timed) + " s/step", file=sys.stderr, flush=True)
            runs.append(out)
    table: dict[tuple[str, str], dict[str, float]] = {}
    for v, name in pairs:
        timed = [x for r in runs if r["variant"] == v.key and r["optimizer"] == name and "error" not in r
                 for x in r["samples"] if not x["warmup"]]
        if timed:
            table[v.key, name] = {"step_seconds": statistics.fmean(x["seconds"] for x in timed),
                                  "optimizer_seconds": statistics.fmean(x["optimizer_seconds"] for x in timed),
                                  "steps": len(timed)}
    print(f"\n{'optimizer':<10} {'variant':<27} {'step s':>8} {'opt s':>8} {'/ AdamW':>8} {'/ plain':>8}")
    for (key, name), row in table.items():
        adamw, plain = table.get((key, "adamw")), table.get(("plain", name))
        row["step_to_adamw"] = row["step_seconds"] / adamw["step_seconds"] if adamw else float("nan")
        row["step_to_plain"] = row["step_seconds"] / plain["step_seconds"] if plain else float("nan")
        print(f"{name:<10} {BY_KEY[key].label:<27} {row['step_seconds']:>8.3f} {row['optimizer_seconds']:>8.3f} "
              f"{row['step_to_adamw']:>8.2f} {row['step_to_plain']:>8.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_json(args.json, {"command": " ".join(["python3", "bench/train_offload.py", *argv]), "system": system,
                               "versions": versions, "model": model, "tiermem_overrides": tiers,
                               "table": [{"variant": k, "optimizer": n, **row} for (k, n), row in table.items()],
                               "runs": runs})
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["_variant"]:
        return worker_main(RESULT_TAG, variant_worker, argv[1])
    if argv[:1] == ["_update"]:
        return worker_main(RESULT_TAG, update_worker, argv[1])
    args = parse_args(argv)
    t_start = time.perf_counter()
    tm_swap = os.path.join(args.swap_dir, "tiermem")
    ds_swap = os.path.join(args.swap_dir, "deepspeed")
    io_dir = os.path.join(args.swap_dir, "io")
    for d in (tm_swap, ds_swap):
        os.makedirs(d, exist_ok=True)
    model = model_info(args)
    state_ratio = model["training_state_bytes"] / args.host_budget_bytes
    if state_ratio < MIN_STATE_TO_BUDGET:
        print(f"warning: the training state ({format_size(model['training_state_bytes'])}) is less than "
              f"{MIN_STATE_TO_BUDGET} x (c)'s host budget ({format_size(args.host_budget_bytes)})", file=sys.stderr)

    system = describe_system([args.swap_dir])
    system["loadavg_start"] = os.getloadavg()
    versions = package_versions("tiermem", "torch", "transformers", "deepspeed")
    print_header(system, versions, model, args)

    base = {"layers": args.layers, "width": args.width, "heads": args.heads, "vocab": args.vocab, "seq": args.seq,
            "batch": args.batch, "warmup": args.warmup, "steps": args.steps, "ds_swap_dir": ds_swap,
            "accumulate": args.accumulate, "clip": args.clip, "io_load": args.io_load_gbps,
            "io_dir": os.path.join(args.swap_dir, "fio-load")}
    tiers = {
        "tiermem_cpu": {"device": "cpu", "params.tier": "cpu", "optimizer.tier": "cpu", "grads.tier": "cpu",
                        "memory.host_budget": args.cpu_host_budget, "nvme.paths": [tm_swap]},
        "tiermem_nvme": {"device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme",
                         "grads.tier": args.grads_tier, "memory.host_budget": args.host_budget,
                         "nvme.paths": [tm_swap], "io.engine": "io_uring", "optimizer.update": "step"},
    }
    tiers["tiermem_lazy"] = {**tiers["tiermem_nvme"], "optimizer.update": "lazy"}
    tiers["tiermem_default"] = {"device": "cpu", "memory.host_budget": args.host_budget, "nvme.paths": [tm_swap]}
    tiers["tiermem_default_actmem"] = {**tiers["tiermem_default"], "activations.tier": "memory"}
    tiers["tiermem_default_traced"] = {**tiers["tiermem_default"],
                                       "trace.path": os.path.join(args.swap_dir, "trace", "train.json")}
    tiers["tiermem_act"] = {**tiers["tiermem_lazy"], "activations.tier": "nvme",
                            "activations.buffer": args.activations_buffer}
    tiers["tiermem_act_torchalloc"] = {**tiers["tiermem_act"], "memory.cpu_allocator": "torch"}
    tiers["tiermem_default_torchalloc"] = {**tiers["tiermem_default"], "memory.cpu_allocator": "torch"}
    tiers["tiermem_default_trainer"] = tiers["tiermem_default"]
    variants = args.variant_list
    if args.optimizers is not None:
        return optimizer_costs(args, argv, base, tiers, system, versions, model)
    runs: list[dict[str, Any]] = []
    update_runs: list[dict[str, Any]] = []  # one process of the update benchmark per round
    disturbed: list[dict[str, Any]] = []  # processes run again because others took CPU during their steps
    bandwidth: list[dict[str, Any]] = []
    t_measure = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            tag = f"[{rnd + 1}/{args.rounds}]"
            try:
                bw = engine_bandwidth(io_dir, args.io_size)
                bandwidth.append({"round": rnd, **bw})
                print(f"{tag} tiermem io_uring write " + ", ".join(f"{g:.2f}" for g in bw["write"]["gbps_samples"])
                      + "; read " + ", ".join(f"{g:.2f}" for g in bw["read"]["gbps_samples"]) + " GB/s",
                      file=sys.stderr, flush=True)
            except RuntimeError as exc:
                bandwidth.append({"round": rnd, "error": str(exc)})
                print(f"{tag} bandwidth failed: {exc}", file=sys.stderr, flush=True)
            for v in rotated(variants, rnd):
                for attempt in range(args.retries + 1):
                    out = run_variant(v, {**base, "variant": v.key, "tiermem": tiers.get(v.key)}, args, ds_swap)
                    out["round"], out["attempt"] = rnd, attempt
                    took = out.pop("took_seconds")
                    if "error" in out:
                        print(f"{tag} {v.label:<27} FAILED ({took:.0f} s):\n{out['error']}", file=sys.stderr,
                              flush=True)
                        break
                    timed = [s for s in out["samples"] if not s["warmup"]]
                    load = out.get("io_load", {})  # (a/io)'s fio: GB/s each way, and GB per step
                    load_gbps = load.get("read_gbps", 0.0) + load.get("write_gbps", 0.0)
                    others = statistics.fmean((s["other_cpu_seconds"] or 0) / s["seconds"] for s in timed)
                    # (a/io)'s fio is one of the others: it is never run again for them
                    retry = others >= args.quiet_cores and attempt < args.retries and v.key != "plain_io"
                    print(f"{tag} {v.label:<27} " + " ".join(f"{s['seconds']:.2f}" for s in timed) + " s/step (opt "
                          + " ".join(f"{s['optimizer_seconds']:.2f}" for s in timed) + f"); others {others:.2f} "
                          f"cores; peak RSS {_gb(out['peak_rss_bytes'])} GB ({took:.0f} s)"
                          + (f"; fio read {load.get('read_gbps', 0):.2f}, wrote "
                             f"{load.get('write_gbps', 0):.2f} GB/s, "
                             f"{statistics.fmean(s['seconds'] for s in timed) * load_gbps:.2f} GB per step"
                             if load else "")
                          + ("; disturbed, run again" if retry else ""), file=sys.stderr, flush=True)
                    if not retry:
                        break
                    disturbed.append(out)
                runs.append(out)
            if args.update_reps > 0:
                update_runs.append({"round": rnd, **run_update(base, tiers["tiermem_cpu"], args)})
        measure_s = time.perf_counter() - t_measure
    finally:
        shutil.rmtree(io_dir, ignore_errors=True)
        shutil.rmtree(ds_swap, ignore_errors=True)
        shutil.rmtree(base["io_dir"], ignore_errors=True)

    ok_bw = [b for b in bandwidth if "error" not in b]
    bw_summary = None
    if ok_bw:
        reads = [g for b in ok_bw for g in b["read"]["gbps_samples"]]
        writes = [g for b in ok_bw for g in b["write"]["gbps_samples"]]
        bw_summary = {"read_gbps": mean_std(reads)[0], "read_gbps_std": mean_std(reads)[1], "read_samples": reads,
                      "write_gbps": mean_std(writes)[0], "write_gbps_std": mean_std(writes)[1], "write_samples": writes,
                      "samples": len(reads), "size": args.io_size, "command": ok_bw[0]["command"]}
    summary = summarize(runs, variants)
    losses = check_losses(runs)
    update = update_summary([r for r in update_runs if "error" not in r]) or None
    verdict = goals(summary, runs, bw_summary, args.host_budget_bytes, losses, update, model)
    print_tables(summary, verdict, bw_summary, losses, args.host_budget_bytes)
    clipped = clip_activity(runs, args.clip)
    if clipped:
        print(f"\n{clipped}")
    if update:
        print(f"\nthe update alone ({update['turns']} turns in {update['processes']} processes, one a round, after "
              f"{args.update_warmup} untimed each): "
              f"(b) tm.optimizer.step() {update['tiermem_seconds_median'] * 1e3:.1f} ms, torch.optim.AdamW.step() "
              f"{update['adamw_seconds_median'] * 1e3:.1f} ms (medians); per-turn ratio "
              f"{update['turn_ratio_median']:.2f} [{update['turn_ratio_min']:.2f}, {update['turn_ratio_max']:.2f}], "
              f"per process " + ", ".join(f"{r:.2f}" for r in update["process_ratios"]) + "; "
              f"parameters bit-identical after "
              f"{update['steps_each']} steps each: {'yes' if update['parameters_equal'] else 'NO'}")
    system["loadavg_end"] = os.getloadavg()
    wall_s = time.perf_counter() - t_start
    if disturbed:
        print(f"\n{len(disturbed)} process(es) were run again because other processes took CPU during their steps: "
              + ", ".join(f"{r['variant']} round {r['round']}" for r in disturbed))
    print(f"\nmeasurements took {measure_s:.0f} s; whole run {wall_s:.0f} s; load average "
          f"{system['loadavg_start'][0]:.1f} at the start, {system['loadavg_end'][0]:.1f} at the end")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        report = {
            "command": " ".join(["python3", "bench/train_offload.py", *argv]),
            "system": system,
            "versions": versions,
            "model": {**model, "training_state_to_host_budget": state_ratio},
            "config": {"rounds": args.rounds, "warmup_steps": args.warmup, "timed_steps_per_process": args.steps,
                       "host_budget": args.host_budget, "host_budget_bytes": args.host_budget_bytes,
                       "cpu_host_budget": args.cpu_host_budget, "grads_tier": args.grads_tier,
                       "swap_dir": args.swap_dir, "adamw": {**ADAMW, "betas": list(ADAMW["betas"])},
                       "tiermem_overrides": tiers, "quiet_wait_seconds": args.quiet_wait,
                       "quiet_cores": args.quiet_cores,
                       "order": "per round every variant once in its own process, rotating order; per process "
                                "warm-up steps then timed steps (zero_grad, forward, backward, optimizer step)",
                       "units": "GB = 1e9 bytes, MB = 1e6 bytes, MiB = 2**20 bytes"},
            "bandwidth": {"summary": bw_summary, "rounds": bandwidth},
            "summary": summary,
            "goals": verdict,
            "losses": losses,
            "update": {"summary": update, "runs": update_runs},
            "runs": runs,
            "disturbed_runs": disturbed,
            "measure_seconds": measure_s,
            "wall_seconds": wall_s,
        }
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
