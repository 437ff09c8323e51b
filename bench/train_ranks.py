#!/usr/bin/env python3
"""Training on several ranks: tiermem's ZeRO-3 sharding with NVMe tiers against DeepSpeed ZeRO-3 with NVMe
offload, with PyTorch's DistributedDataParallel in memory as the baseline, side by side in one run.

Every variant is launched the way its users launch it, with torchrun (`python3 -m torch.distributed.run
--standalone --nproc-per-node N`), gloo as the backend and one PyTorch thread per rank (OMP_NUM_THREADS=1: N
ranks share this machine's cores). The model, optimizer and batches are bench/train_offload.py's: GPT-2
(n_embd 768, 12 layers, vocab 8192, 128 positions, dropout off, fp32), AdamW(lr=1e-4, weight_decay=0.01,
fused=True), each rank its own batches of 2 x 128 random tokens (seeded by rank), loss = model(ids,
labels=ids).loss. Variants:

  ddp       torch.nn.parallel.DistributedDataParallel, everything in each rank's memory
  ddp_io    ddp while fio moves --io-load GB/s (read,write) through the swap disk: the floor that tiermem's disk
            traffic sets where that traffic takes the compute's CPU (bench/train_offload.py's (a/io));
            not run unless named in --variants
  tiermem   tiermem.tiered_offload(model, optimizer=AdamW) on every rank: params/optimizer on NVMe
            (nvme.paths [--swap-dir/tiermem/rank{rank}]), grads.tier auto, optimizer.update lazy,
            activations.tier nvme with --activations-buffer, memory.host_budget --host-budget per rank
            (the settings of configs/train-lowmem.yaml); each rank keeps 1/N of every unit
  tiermem_one  the same on one rank (torchrun --nproc-per-node 1, one batch per step): what sharding costs
            or saves per rank, in time, bytes and RSS
  tiermem_default  tiermem with its defaults: only memory.host_budget --host-budget and nvme.paths set (the
            tiers, activations.tier auto and its activations.keep chosen at entry); not run unless named
  tiermem_ddp  tiermem_default with the model called through DistributedDataParallel(model), made inside
            the context as HF Trainer and accelerate make it (the tiers do DDP's job); not run unless named
  deepspeed deepspeed.initialize with ZeRO stage 3, offload_param and offload_optimizer on NVMe
            (--swap-dir/deepspeed), DS_ACCELERATOR=cpu, train_offload.py's config otherwise
  fsdp      PyTorch's own ZeRO-3, FSDP2 (torch.distributed.fsdp.fully_shard on each GPT-2 block, then on the
            model) on a CPU device mesh, everything in memory: each rank holds 1/N of the parameters,
            gradients and AdamW state and all-gathers each block before it computes, as tiermem does, with
            nothing on disk: what PyTorch's own sharding costs against DDP on this machine (its
            CPUOffloadPolicy changes nothing where the device is the CPU); not run unless named

Each rank builds the model from the same seed (untimed), runs --warmup untimed steps and --steps timed steps,
with one full collection of Python's garbage collector between them (untimed; see GcWatch in
bench/_common.py; the timed steps' collections are in the JSON); a step is zero_grad, forward, backward and
the optimizer step (DeepSpeed: engine(ids), engine.backward, engine.step). A step's time is the slowest
rank's (the ranks meet in every collective). Peak RSS per rank is reported for set-up (building the model in
memory and entering) and, after resetting the peak (/proc/self/clear_refs 5), for the steps alone. tiermem's
stats() give each rank's bytes read and written per step, bytes all-gathered and reduce-scattered, and the
time spent waiting for gathers.

Goals (issue 13): tiermem's step <= 0.5 x DeepSpeed's, and every rank's peak RSS during the steps <= its
host budget + 0.5 GB. The report ends with a projection, on paper, of tiermem's step time for N ranks on N
drives from the measured per-rank figures (see `project`).

    python3 bench/train_ranks.py --json bench/results/train_ranks.json

A quick debug run: --layers 2 --width 256 --vocab 1000 --host-budget 32MiB --activations-buffer 4MiB
--rounds 1 --warmup 1 --steps 2.
GB = 1e9 bytes; MB = 1e6 bytes; MiB = 2**20 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import (  # bench/ is on sys.path when run as a script
    GcWatch,
    check_variants,
    cpu_busy_seconds,
    describe_system,
    drop_page_cache,
    engine_bandwidth,
    package_versions,
    peak_rss_bytes,
    print_system_header,
    reset_peak_rss,
    rotated,
    status_bytes,
    thread_cpu_seconds,
    wait_for_quiet,
    write_json,
)
from train_offload import ADAMW, INPUT_SEED, build_model, deepspeed_config, fio_load, fio_stop

from tiermem.sizes import format_size, parse_size

DEFAULT_DIR = "/var/tmp/tiermem-ranks-bench"
VARIANTS = ("ddp", "tiermem", "tiermem_one", "deepspeed", "ddp_io", "tiermem_default", "tiermem_ddp", "fsdp")
DEFAULT_VARIANTS = VARIANTS[:4]
LABELS = {"ddp": "PyTorch DDP, in memory", "tiermem": "tiermem, NVMe tiers", "tiermem_one": "tiermem, one rank",
          "deepspeed": "DeepSpeed ZeRO-3 NVMe", "ddp_io": "DDP beside fio --io-load",
          "tiermem_default": "tiermem, its defaults", "tiermem_ddp": "tiermem defaults, DDP-wrapped",
          "fsdp": "PyTorch FSDP2, in memory"}
DS_GOAL = 0.5  # tiermem's step <= this x DeepSpeed's
RSS_SLACK = 500 * 10**6  # a rank's peak RSS in the steps <= its host budget + this
LAUNCH_TIMEOUT_S = 1800
TRAFFIC = ("bytes_read", "bytes_written", "gathered_bytes", "gather_wait_seconds", "gathers_ahead", "reduced_bytes",
           "reduce_seconds", "stall_seconds", "update_wait_seconds", "activations_bytes_read",
           "activations_bytes_written")


# -- one rank (run by torchrun) ---------------------------------------------------------------------------
def rank_batches(spec: dict[str, Any], rank: int, n: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(INPUT_SEED + 1000 * rank)
    return [torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=gen) for _ in range(n)]


def rank_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of one variant: build, step, measure; the figures go to spec['out']/rank{R}.json."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel  # noqa: F401 - its modules (0.15 GB) are imports, not the model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {"variant": spec["variant"], "rank": rank, "world": world,
                           "torch_threads": torch.get_num_threads(), "rss_after_imports_bytes": status_bytes("VmRSS")}
    t0 = time.perf_counter()
    model = build_model(spec)
    params = list(model.parameters())
    out["parameters"] = sum(p.numel() for p in params)
    batches = rank_batches(spec, rank, spec["warmup"] + spec["steps"])
    tm = engine = ctx = None
    if spec["variant"] == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=params,
                                                 config=deepspeed_config(model, spec))
        fwd: Any = engine
    else:
        dist.init_process_group("gloo")
        if spec["variant"] in ("ddp", "ddp_io"):
            fwd = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(params, **ADAMW)
        elif spec["variant"] == "fsdp":
            fwd = fsdp2(model, world)
            opt = torch.optim.AdamW(model.parameters(), **ADAMW)  # its sharded parameters (DTensors)
        else:
            import tiermem

            config = spec["tiermem" if spec["variant"] in ("tiermem", "tiermem_one") else "tiermem_default"]
            ctx = tiermem.tiered_offload(model, optimizer=torch.optim.AdamW(params, **ADAMW), **config)
            tm = ctx.__enter__()
            opt, fwd = tm.optimizer, model
            if spec["variant"] == "tiermem_ddp":  # wrapped inside the context, as HF Trainer and accelerate do
                fwd = torch.nn.parallel.DistributedDataParallel(model)
            out["units"] = len(tm.units)
            out["plan"] = tm.plan_summary()
    out["setup_seconds"] = time.perf_counter() - t0
    out["setup_peak_rss_bytes"] = peak_rss_bytes()
    out["peak_reset"] = reset_peak_rss()
    samples = []
    gcw = GcWatch()  # settled before the first timed step (see GcWatch)
    cpu0: tuple[float, dict[str, float] | None, float | None] | None = None
    try:
        for i, ids in enumerate(batches):
            if i == spec["warmup"]:
                gcw.settle()
                dist.barrier()
                cpu0 = (time.perf_counter(), thread_cpu_seconds(), cpu_busy_seconds())
            if tm is not None:
                tm.reset_stats()
            dist.barrier()  # every rank starts the step together: its time is the step's, not a wait for others
            s0 = time.perf_counter()
            if engine is None:
                opt.zero_grad()
                loss = fwd(ids, labels=ids).loss
                loss.backward()
                opt.step()
            else:
                loss = fwd(ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
            sample: dict[str, Any] = {"warmup": i < spec["warmup"], "seconds": time.perf_counter() - s0,
                                      "loss": float(loss.detach())}
            if tm is not None:
                st = tm.stats()
                sample.update({k: st.get(k, 0) for k in TRAFFIC})
                sample["peak_host_bytes"] = st["peak_bytes"]["host"]
            samples.append(sample)
        out["gc_timed_steps"] = gcw.report()
        if cpu0 is not None:
            dist.barrier()
            out["cpu"] = cpu_split(cpu0, (time.perf_counter(), thread_cpu_seconds(), cpu_busy_seconds()),
                                   len(batches) - spec["warmup"])
        out["steps_peak_rss_bytes"] = status_bytes("VmHWM") if out["peak_reset"] else None
        if spec.get("checkpoint_dir") and spec["variant"] != "fsdp":  # its DTensors need torch.distributed.checkpoint
            out["checkpoint"] = checkpoint_round_trip(spec, rank, tm, engine, model, opt)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    out["samples"] = samples
    dist.barrier()
    return out


def cpu_split(before: tuple[float, dict[str, float] | None, float | None],
              after: tuple[float, dict[str, float] | None, float | None], steps: int) -> dict[str, Any] | None:
    """Where a rank's CPU went in the timed steps (between barriers), per step: its main thread, its
    collectives' threads, the rest of the process (I/O and helpers), and the whole machine's busy CPU seconds
    (every process, the other ranks' included) against the cores' seconds in that time."""
    (t0, own0, busy0), (t1, own1, busy1) = before, after
    if own0 is None or own1 is None or steps <= 0:
        return None
    own = {k: (own1[k] - own0[k]) / steps for k in own0}
    split: dict[str, Any] = {"main": own["main"], "collectives": own["collectives"],
                             # threads are read a tick apart from the process: never below 0
                             "rest": max(0.0, own["total"] - own["main"] - own["collectives"]), "total": own["total"]}
    if busy0 is not None and busy1 is not None:
        split["machine_busy"] = (busy1 - busy0) / steps
        split["machine_cores"] = (os.cpu_count() or 1) * (t1 - t0) / steps
    return split


def fsdp2(model: Any, world: int) -> Any:
    """`model` sharded by FSDP2 over `world` CPU ranks, each GPT-2 block a unit, the rest one more (as tiermem
    wraps it); parameters are resharded after forward (ZeRO-3) and gathered again in backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def checkpoint_round_trip(spec: dict[str, Any], rank: int, tm: Any, engine: Any, model: Any,
                          opt: Any) -> dict[str, Any]:
    """Save the model and optimizer state as each tool's users do, then load it back cold (the page cache
    dropped, where this process may), every rank timing both (between barriers): tm.save_checkpoint /
    tm.load_checkpoint; DeepSpeed's engine.save_checkpoint /
    load_checkpoint (its per-rank ZeRO files); DDP's rank 0 torch.save of both state dicts, every rank
    torch.load + load_state_dict. Bytes written and read are tiermem's (stats()['checkpoint_bytes_written'] and
    ['checkpoint_bytes_read'])."""
    import torch
    import torch.distributed as dist

    folder = os.path.join(spec["checkpoint_dir"], spec["variant"])
    out: dict[str, Any] = {}
    try:
        dist.barrier()
        t0 = time.perf_counter()
        if tm is not None:
            tm.save_checkpoint(folder)
        elif engine is not None:
            engine.save_checkpoint(folder)
        elif rank == 0:
            os.makedirs(folder, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(folder, "ckpt.pt"))
        dist.barrier()
        out["save_seconds"] = time.perf_counter() - t0
        out["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
        if rank == 0:  # a cold load for every tool, as after a restart: not from what the save left in the cache
            out["cold"] = drop_page_cache()
        dist.barrier()
        if tm is not None and "checkpoint_bytes_written" in tm.stats():  # absent before each rank wrote its chunks
            out["bytes_written"] = tm.stats()["checkpoint_bytes_written"]
        read = tm.stats().get("checkpoint_bytes_read") if tm is not None else None  # absent before ece209f
        t0 = time.perf_counter()
        if tm is not None:
            tm.load_checkpoint(folder)
        elif engine is not None:
            engine.load_checkpoint(folder)
        else:
            saved = torch.load(os.path.join(folder, "ckpt.pt"), weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        dist.barrier()
        out["load_seconds"] = time.perf_counter() - t0
        if read is not None:
            out["bytes_read"] = tm.stats()["checkpoint_bytes_read"] - read
    except Exception as exc:  # noqa: BLE001 - reported, the steps' figures stand
        out["error"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def checkpoint_summary(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, dict[str, Any]]:
    """Per variant: save and load seconds (the slowest rank's, mean over rounds), the checkpoint's bytes and,
    for tiermem, the bytes each rank read to load it."""
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        trips = [[r["checkpoint"] for r in run["ranks"] if "checkpoint" in r] for run in runs
                 if run.get("variant") == v and "error" not in run]
        trips = [t for t in trips if t]
        if not trips:
            continue
        errors = [c["error"] for t in trips for c in t if "error" in c]
        if errors:
            out[v] = {"error": errors[0]}
            continue
        out[v] = {"save_seconds": _mean([max(c["save_seconds"] for c in t) for t in trips]),
                  "load_seconds": _mean([max(c["load_seconds"] for c in t) for t in trips]),
                  "bytes": trips[-1][0]["bytes"],
                  "bytes_read_per_rank": [c.get("bytes_read") for c in trips[-1]],
                  "bytes_written_per_rank": [c.get("bytes_written") for c in trips[-1]]}
    return out


def rank_main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    import traceback

    try:
        out = rank_worker(spec)
    except Exception as exc:  # reported to the parent with its traceback
        out = {"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


# -- the parent ---------------------------------------------------------------------------------------------
def launch(spec: dict[str, Any], ranks: int) -> dict[str, Any]:
    """Run one variant on `ranks` ranks with torchrun; returns every rank's figures (or an error)."""
    folder = tempfile.mkdtemp(prefix=f"ranks-{spec['variant']}-")
    spec = {**spec, "out": folder}
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    env = {"MKL_CBWR": "AUTO,STRICT", **os.environ, "OMP_NUM_THREADS": "1"}  # reproducible BLAS (tests/conftest.py)
    if spec["variant"] == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        shutil.rmtree(spec["ds_swap_dir"], ignore_errors=True)  # stale swap files of another size break its start
        os.makedirs(spec["ds_swap_dir"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           os.path.abspath(__file__), "_rank", spec_path]
    t0 = time.perf_counter()
    load = fio_load(spec) if spec["variant"] == "ddp_io" else None  # beside every rank, for the whole launch
    io_load = None
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)
        finally:
            if load is not None:
                io_load = fio_stop(load)
        results = []
        for r in range(ranks):
            path = os.path.join(folder, f"rank{r}.json")
            if not os.path.exists(path):
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-30:])
                return {"variant": spec["variant"], "error": f"rank {r} wrote no result (torchrun exited "
                        f"{proc.returncode}):\n{tail}"}
            with open(path, encoding="utf-8") as f:
                results.append(json.load(f))
        errors = [f"rank {x['rank']}: {x['error']}" for x in results if "error" in x]
        if errors:
            return {"variant": spec["variant"], "error": "\n".join(errors)}
        return {"variant": spec["variant"], "ranks": results, "took_seconds": time.perf_counter() - t0,
                "command": " ".join(["python3", *cmd[1:]]), **({"io_load": io_load} if io_load else {})}
    except subprocess.TimeoutExpired:
        return {"variant": spec["variant"], "error": f"timed out after {LAUNCH_TIMEOUT_S} s"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def step_seconds(run: dict[str, Any]) -> list[float]:
    """Each timed step's time: the slowest rank's."""
    per_rank = [[s["seconds"] for s in r["samples"] if not s["warmup"]] for r in run["ranks"]]
    return [max(xs) for xs in zip(*per_rank, strict=True)]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        ok = [r for r in runs if r["variant"] == v and "error" not in r]
        if not ok:
            failed = [r for r in runs if r["variant"] == v]
            out[v] = {"error": failed[-1]["error"] if failed else "not run"}
            continue
        secs = [s for r in ok for s in step_seconds(r)]
        ranks = [x for r in ok for x in r["ranks"]]
        entry: dict[str, Any] = {
            "processes": len(ok), "ranks_per_process": len(ok[0]["ranks"]), "steps": len(secs),
            "seconds_mean": _mean(secs),
            "seconds_std": statistics.stdev(secs) if len(secs) > 1 else 0.0,
            "round_means": [_mean(step_seconds(r)) for r in ok],
            "steps_peak_rss_bytes_max": max((x["steps_peak_rss_bytes"] or 0) for x in ranks) or None,
            # above the RSS right after the imports (torch, transformers' GPT-2, tiermem: 0.4 GB here)
            "steps_peak_above_imports_bytes_max": max((x["steps_peak_rss_bytes"] or 0) - x["rss_after_imports_bytes"]
                                                      for x in ranks),
            "setup_peak_rss_bytes_max": max(x["setup_peak_rss_bytes"] for x in ranks),
            "setup_seconds_mean": _mean([x["setup_seconds"] for x in ranks]),
        }
        cpus = [x["cpu"] for x in ranks if x.get("cpu")]
        if cpus:  # a rank's mean per step; the machine's from rank 0's readings
            entry["cpu_per_rank_step"] = {k: _mean([c[k] for c in cpus]) for k in ("main", "collectives", "rest",
                                                                                     "total")}
            machine = [x["cpu"] for x in ranks if x["rank"] == 0 and "machine_busy" in (x.get("cpu") or {})]
            if machine:
                entry["cpu_machine_step"] = {k: _mean([c[k] for c in machine]) for k in ("machine_busy",
                                                                                          "machine_cores")}
        loads = [r["io_load"] for r in ok if "error" not in r.get("io_load", {"error": None})]
        if loads:  # fio's GB per step: its rates times the step
            entry["io_load_bytes_per_step"] = _mean([(x["read_gbps"] + x["write_gbps"]) * 1e9 for x in loads]) * \
                entry["seconds_mean"]
        if v.startswith("tiermem"):
            timed = [s for x in ranks for s in x["samples"] if not s["warmup"]]
            for key in TRAFFIC:
                entry[f"{key}_per_rank_mean"] = _mean([s[key] for s in timed])
            entry["peak_host_bytes_max"] = max(s["peak_host_bytes"] for s in timed)
            entry["plan"] = ranks[0]["plan"]
        out[v] = entry
    return out


def compare_losses(runs: list[dict[str, Any]],
                   variants: tuple[str, ...] = ("tiermem", "tiermem_default", "tiermem_ddp")) -> dict[str, Any] | None:
    """`variants`' losses against DDP's of the same round, rank by rank (not bit-exact: DDP all-reduces in
    buckets, tiermem reduce-scatters per unit, so the gradients' sums round differently)."""
    by = {(r["variant"], r["round"]): r for r in runs if "error" not in r}
    diffs = []
    for (v, rnd), run in by.items():
        ref = by.get(("ddp", rnd))
        if v not in variants or ref is None:
            continue
        for a, b in zip(run["ranks"], ref["ranks"], strict=True):
            diffs += [abs(x["loss"] - y["loss"]) for x, y in zip(a["samples"], b["samples"], strict=True)]
    return {"steps": len(diffs), "max_abs_diff": max(diffs)} if diffs else None


def project(tm: dict[str, Any], bw: dict[str, Any] | None, ranks: int, upto: int = 8) -> list[dict[str, Any]]:
    """tiermem's step time for N ranks on N drives, on paper, from the measured per-rank figures.

    Each rank keeps its batch (data parallel), so its compute stays what it was, and so do the bytes of its
    saved activations that go to NVMe and back; the rest of its NVMe bytes per step (parameters, gradients,
    optimizer state) scale with 1/N (each rank holds 1/N of every unit), its collective bytes with (N-1)/N.
    The measured step is split into what was not waiting for a collective (compute plus I/O, which the
    measured run hid behind compute or counted as stall) and the time spent waiting for gathers and in
    reduce-scatters. The projection keeps the first part, or the I/O time at the measured engine bandwidth
    if that is longer, and scales the collective time with its bytes at the rate measured here (loopback
    between two processes: another network has another rate, so this part is the one to redo with its
    figures)."""
    step = tm["seconds_mean"]
    coll = tm["gather_wait_seconds_per_rank_mean"] + tm["reduce_seconds_per_rank_mean"]
    rest = step - coll
    acts = (tm.get("activations_bytes_read_per_rank_mean", 0.0), tm.get("activations_bytes_written_per_rank_mean", 0.0))
    sharded = (tm["bytes_read_per_rank_mean"] - acts[0], tm["bytes_written_per_rank_mean"] - acts[1])
    out = []
    for n in [ranks, *[k for k in (2, 4, 8) if k != ranks and k <= upto]]:
        scaled_io = [b * ranks / n + a for b, a in zip(sharded, acts, strict=True)]
        io_s = (scaled_io[0] / (bw["read"]["gbps_mean"] * 1e9) + scaled_io[1] / (bw["write"]["gbps_mean"] * 1e9)
                if bw and "read" in bw else None)
        coll_n = coll * ((n - 1) / n) / ((ranks - 1) / ranks)
        out.append({"ranks": n, "nvme_bytes_per_rank": sum(scaled_io), "activation_bytes_per_rank": sum(acts),
                    "io_seconds": io_s, "collective_seconds": coll_n, "step_seconds": max(rest, io_s or 0.0) + coll_n})
    return sorted(out, key=lambda x: x["ranks"])


def goals(summary: dict[str, dict[str, Any]], budget: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tm, ds, floor = summary.get("tiermem", {}), summary.get("deepspeed", {}), summary.get("ddp_io", {})
    if "seconds_mean" in tm and "seconds_mean" in ds:
        ratio = tm["seconds_mean"] / ds["seconds_mean"]
        out["vs_deepspeed"] = {"held": ratio <= DS_GOAL, "ratio": ratio, "goal": DS_GOAL}
    default = summary.get("tiermem_default", {})
    if "seconds_mean" in default and "seconds_mean" in ds:
        ratio = default["seconds_mean"] / ds["seconds_mean"]
        out["default_vs_deepspeed"] = {"held": ratio <= DS_GOAL, "ratio": ratio, "goal": DS_GOAL}
    for name in ("tiermem", "tiermem_default", "fsdp"):  # measurements, not the issue's goals
        for base in ("ddp", "fsdp"):
            a, b = summary.get(name, {}), summary.get(base, {})
            if name != base and "seconds_mean" in a and "seconds_mean" in b:
                out.setdefault("ratios", {})[f"{name}/{base}"] = a["seconds_mean"] / b["seconds_mean"]
    if "seconds_mean" in tm and "seconds_mean" in floor:  # a measurement, not one of the issue's goals
        out["vs_ddp_io"] = {"ratio": tm["seconds_mean"] / floor["seconds_mean"],
                            "fio_bytes_per_step": floor.get("io_load_bytes_per_step"),
                            "tiermem_bytes_per_step": tm["ranks_per_process"] * (tm["bytes_read_per_rank_mean"]
                                                                                 + tm["bytes_written_per_rank_mean"])}
    if tm.get("steps_peak_rss_bytes_max"):
        limit = budget + RSS_SLACK
        out["rss"] = {"held": tm["steps_peak_rss_bytes_max"] <= limit, "peak": tm["steps_peak_rss_bytes_max"],
                      "limit": limit}
        above = tm["steps_peak_above_imports_bytes_max"]
        out["rss_above_imports"] = {"held": above <= limit, "peak": above, "limit": limit}
    return out


def print_report(summary: dict[str, dict[str, Any]], verdict: dict[str, Any], losses: dict[str, Any] | None,
                 fsdp_losses: dict[str, Any] | None, projection: list[dict[str, Any]] | None, ranks: int) -> None:
    print(f"\n{ranks} ranks | variant | s/step (mean ± sd) | per round | peak RSS per rank, steps GB | set-up GB")
    for v, e in summary.items():
        if "error" in e:
            print(f"  {LABELS[v]:<24} FAILED: {e['error'].splitlines()[0]}")
            continue
        steps_peak = e["steps_peak_rss_bytes_max"]
        print(f"  {LABELS[v]:<24} {e['seconds_mean']:.3f} ± {e['seconds_std']:.3f}  "
              + " ".join(f"{x:.3f}" for x in e["round_means"])
              + f"  {steps_peak / 1e9 if steps_peak else float('nan'):.2f}  {e['setup_peak_rss_bytes_max'] / 1e9:.2f}")
    cpu = {v: e for v, e in summary.items() if "cpu_per_rank_step" in e}
    if cpu:
        print("\nCPU s per rank and step (main thread + collectives' threads + I/O and helpers = the rank's); the "
              "machine's busy s per step of its cores' s")
        for v, e in cpu.items():
            c, m = e["cpu_per_rank_step"], e.get("cpu_machine_step")
            print(f"  {LABELS[v]:<24} {c['main']:.3f} + {c['collectives']:.3f} + {c['rest']:.3f} = {c['total']:.3f}"
                  + (f"   machine {m['machine_busy']:.2f} of {m['machine_cores']:.2f}" if m else ""))
    for key in ("tiermem", "tiermem_one", "tiermem_default", "tiermem_ddp"):
        tm = summary.get(key, {})
        if "seconds_mean" not in tm:
            continue
        mb = {k: tm[f"{k}_per_rank_mean"] / 1e6 for k in ("bytes_read", "bytes_written", "gathered_bytes",
                                                          "reduced_bytes")}
        print(f"\n{LABELS[key]}, per rank per step: read {mb['bytes_read']:.0f} MB, written {mb['bytes_written']:.0f} "
              f"MB, all-gathered {mb['gathered_bytes']:.0f} MB (waited {tm['gather_wait_seconds_per_rank_mean']:.3f} "
              f"s; {tm['gathers_ahead_per_rank_mean']:.0f} gathers started ahead), reduce-scattered "
              f"{mb['reduced_bytes']:.0f} MB in {tm['reduce_seconds_per_rank_mean']:.3f} s, stalled "
              f"{tm['stall_seconds_per_rank_mean']:.3f} s, updates waited "
              f"{tm['update_wait_seconds_per_rank_mean']:.3f} s; host tier peak "
              f"{format_size(tm['peak_host_bytes_max'])}")
        print(f"  plan (rank 0): {tm['plan']}")
    for who, diff in (("tiermem", losses), ("FSDP2", fsdp_losses)):
        if diff:
            print(f"losses, {who} against DDP: max |diff| {diff['max_abs_diff']:.2e} over {diff['steps']} rank-steps")
    for name, g in verdict.items():
        if name in ("vs_deepspeed", "default_vs_deepspeed"):
            who = "tiermem's defaults" if name == "default_vs_deepspeed" else "tiermem"
            print(f"goal {who} <= {g['goal']} x DeepSpeed: {'held' if g['held'] else 'NOT held'} ({g['ratio']:.2f}x)")
        elif name == "ratios":
            print("step time ratios: " + ", ".join(f"{k} {r:.2f}x" for k, r in g.items()))
        elif name == "vs_ddp_io":
            fio = g["fio_bytes_per_step"]
            print(f"tiermem against DDP beside fio: {g['ratio']:.2f}x (fio {fio / 1e9 if fio else float('nan'):.2f} GB "
                  f"per step, tiermem's ranks {g['tiermem_bytes_per_step'] / 1e9:.2f} GB per step)")
        else:
            what = "above the RSS after imports " if name == "rss_above_imports" else ""
            print(f"goal peak RSS per rank {what}<= host budget + 0.5 GB: {'held' if g['held'] else 'NOT held'} "
                  f"({g['peak'] / 1e9:.2f} GB, limit {g['limit'] / 1e9:.2f} GB)")
    if projection:
        print("projection (paper) for N ranks on N drives: " + "; ".join(
            f"N={p['ranks']}: {p['step_seconds']:.2f} s/step, NVMe {p['nvme_bytes_per_rank'] / 1e6:.0f} MB/rank, "
            f"collectives {p['collective_seconds']:.2f} s" for p in projection))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks per variant (default 2)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=None, help="default: width / 64")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every variant once (default 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--host-budget", default="384MiB", help="tiermem's memory.host_budget per rank (default 384MiB)")
    p.add_argument("--activations-buffer", default="64MiB", help="tiermem's activations.buffer (default 64MiB)")
    p.add_argument("--swap-dir", default=os.path.join(DEFAULT_DIR, "swap"))
    p.add_argument("--io-size", default="1GiB", help="bytes per transfer of the bandwidth test (default 1GiB)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated subset of " + ",".join(VARIANTS) + " (default: all but ddp_io)")
    p.add_argument("--io-load", default="0.4,0.44", metavar="READ,WRITE",
                   help="GB/s fio reads and writes through the swap disk beside ddp_io's ranks (default 0.4,0.44: "
                   "tiermem's two ranks' 1.36 GB read and 1.49 GB written per 3.41 s step, measured here)")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait at most, before each launch, "
                   "for other processes to leave the CPUs idle (default 60; 0: do not wait)")
    p.add_argument("--checkpoint", action="store_true", help="after the steps, save and load the model and "
                   "optimizer state as each tool does, timed (under --swap-dir/checkpoint; the load cold when "
                   "run as root)")
    p.add_argument("--json", metavar="OUT.json", default=None)
    args = p.parse_args(argv)
    args.heads = args.heads or max(1, args.width // 64)
    try:
        args.io_load_gbps = [float(g) for g in args.io_load.split(",")]
        if len(args.io_load_gbps) != 2 or min(args.io_load_gbps) <= 0:
            raise ValueError
    except ValueError:
        p.error(f"--io-load {args.io_load!r}: expected READ,WRITE in GB/s, both above 0, e.g. 0.4,0.44")
    try:
        args.host_budget_bytes = parse_size(args.host_budget, what="--host-budget")
    except ValueError as exc:
        p.error(str(exc))
    check_variants(p, args.variants, VARIANTS)
    if args.ranks < 2:
        p.error("--ranks must be at least 2")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["_rank"]:
        return rank_main(argv[1])
    args = parse_args(argv)
    tm_swap, ds_swap, io_dir = (os.path.join(args.swap_dir, d) for d in ("tiermem", "deepspeed", "io"))
    os.makedirs(tm_swap, exist_ok=True)
    system = describe_system([args.swap_dir])
    versions = package_versions("tiermem", "torch", "transformers", "deepspeed")
    print_system_header(f"train_ranks: {args.ranks} ranks", system, versions)
    base = {"layers": args.layers, "width": args.width, "heads": args.heads, "vocab": args.vocab, "seq": args.seq,
            "batch": args.batch, "warmup": args.warmup, "steps": args.steps, "ds_swap_dir": ds_swap,
            "checkpoint_dir": os.path.join(args.swap_dir, "checkpoint") if args.checkpoint else None,
            "io_load": args.io_load_gbps, "io_dir": os.path.join(args.swap_dir, "fio-load"),
            "tiermem": {"device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme",
                        "memory.host_budget": args.host_budget, "nvme.paths": [os.path.join(tm_swap, "rank{rank}")],
                        "io.engine": "io_uring", "activations.tier": "nvme",
                        "activations.buffer": args.activations_buffer},
            "tiermem_default": {"device": "cpu", "memory.host_budget": args.host_budget,
                                "nvme.paths": [os.path.join(tm_swap, "rank{rank}")]}}
    variants = args.variants.split(",")
    runs: list[dict[str, Any]] = []
    bandwidth = None
    t_start = time.perf_counter()
    try:
        bandwidth = engine_bandwidth(io_dir, args.io_size)
        print(f"tiermem io_uring on the swap folder: read {bandwidth['read']['gbps_mean']:.2f} GB/s, write "
              f"{bandwidth['write']['gbps_mean']:.2f} GB/s", file=sys.stderr, flush=True)
    except RuntimeError as exc:
        print(f"bandwidth failed: {exc}", file=sys.stderr)
    for rnd in range(args.rounds):
        for v in rotated(variants, rnd):
            quiet = wait_for_quiet(0.3, args.quiet_wait, pause_s=2.0) if args.quiet_wait > 0 else None
            run = launch({**base, "variant": v}, 1 if v == "tiermem_one" else args.ranks)
            run.update(round=rnd, quiet_before=quiet)
            runs.append(run)
            if "error" in run:
                print(f"[{rnd + 1}/{args.rounds}] {LABELS[v]}: FAILED\n{run['error']}", file=sys.stderr, flush=True)
            else:
                print(f"[{rnd + 1}/{args.rounds}] {LABELS[v]}: " + " ".join(f"{x:.3f}" for x in step_seconds(run))
                      + f" s/step ({run['took_seconds']:.0f} s)", file=sys.stderr, flush=True)
    shutil.rmtree(base["io_dir"], ignore_errors=True)  # ddp_io's fio files
    summary = summarize(runs, variants)
    verdict = goals(summary, args.host_budget_bytes)
    losses, fsdp_losses = compare_losses(runs), compare_losses(runs, ("fsdp",))
    projection = project(summary["tiermem"], bandwidth, args.ranks) if "seconds_mean" in summary.get(
        "tiermem", {}) else None
    print_report(summary, verdict, losses, fsdp_losses, projection, args.ranks)
    checkpoints = checkpoint_summary(runs, variants) if args.checkpoint else None
    for v, c in (checkpoints or {}).items():
        if "error" in c:
            print(f"checkpoint, {LABELS[v]}: FAILED {c['error']}")
        else:
            read = ", ".join(f"{b / 1e6:.0f}" for b in c["bytes_read_per_rank"] if b is not None)
            wrote = ", ".join(f"{b / 1e6:.0f}" for b in c.get("bytes_written_per_rank", []) if b is not None)
            print(f"checkpoint, {LABELS[v]}: save {c['save_seconds']:.2f} s, load {c['load_seconds']:.2f} s, "
                  f"{c['bytes'] / 1e9:.2f} GB" + (f", written per rank {wrote} MB" if wrote else "")
                  + (f", read per rank {read} MB" if read else ""))
    if args.json:
        write_json(args.json, {"system": system, "versions": versions, "args": vars(args), "bandwidth": bandwidth,
                               "summary": summary, "goals": verdict, "losses": losses, "fsdp_losses": fsdp_losses,
                               "projection": projection,
                               "checkpoints": checkpoints,
                               "runs": runs, "seconds": time.perf_counter() - t_start,
                               "command": "python3 bench/train_ranks.py " + " ".join(argv)})
    return 0 if all("error" not in e for e in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
