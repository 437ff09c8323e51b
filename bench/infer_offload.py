#!/usr/bin/env python3
"""Inference with the weights on disk: tiermem against accelerate's disk offload and an mmap'd safetensors
file, with the model in memory as the baseline, side by side in one run.

The model has GPT-2 medium's shape (transformers GPT2Config(n_layer=24, n_embd=1024, n_head=16): 355M
parameters, fp32, 1.42 GB) with random weights. Its files are made once and kept under CACHE_DIR:
`save_pretrained` writes model.safetensors, and accelerate's `offload_state_dict` writes the folder of one
.dat file per tensor that `accelerate.disk_offload` reads. Variants:

  memory              GPT2LMHeadModel.from_pretrained(dir): every weight in RAM
  tiermem, no prefetch the model built on the meta device, tiermem.tiered_offload(model, checkpoint=
                      model.safetensors, restore=False, prefetch=False, params.tier=nvme, io.engine=io_uring,
                      memory.host_budget=--host-budget, nvme.paths=[--swap-dir]): the weights are streamed
                      from the checkpoint into tiermem's swap files and read back per unit (O_DIRECT)
  tiermem             the same with prefetch (prefetch.depth=--prefetch-depth)
  accelerate cold     the model built on the meta device, accelerate.disk_offload(model, folder,
                      execution_device=cpu); before every forward each file of the folder is dropped from the
                      page cache with posix_fadvise(POSIX_FADV_DONTNEED)
  accelerate warm     the same without dropping: after the warm-up the folder is in the page cache
  mmap cold / warm    the model built on the meta device; a pre-forward hook on each layer (each GPT2Block,
                      and each other module holding parameters) sets its parameters from
                      safetensors' safe_open(model.safetensors).get_tensor() (a copy out of the mmap'd file),
                      a forward hook sets them back to meta; cold drops the file from the page cache
                      before every forward as above

Every variant runs in its own subprocess (so its peak RSS, getrusage(RUSAGE_SELF).ru_maxrss, is its own),
once per round; the order of the variants rotates from round to round. In its subprocess a variant runs,
for each token shape (--shapes, batch x sequence), one untimed warm-up forward and then --forwards timed
forwards under torch.inference_mode() with use_cache=False. The logits of its last forward are compared
with those of the in-memory model of the same round: tiermem must be bit-exact (fp32). Each round starts
with `python3 -m tiermem bench io --engine io_uring --mode read` on the same disk, the bandwidth the goals
use. "read from disk" is the process's read_bytes in /proc/self/io over the forward (bytes that reached
the block layer, O_DIRECT and page faults included).

# [Note: quiet gate]
The machine is shared: other processes now and then take one or both of its two CPUs for seconds, and a
forward that runs meanwhile can take several times as long (torch's two OpenMP threads wait for each other
at every operator). So before each timed forward the worker waits (at most 10 s) until other processes
have used under --quiet-cores CPUs for 0.3 s, and after it reads /proc/stat again: when other processes
took more than --disturbed-share of the forward's wall time in CPU time, the forward is set aside and run
again (at most --retries times; the last try is kept whatever happened). Whether a forward is rerun depends
only on what other processes did, never on its own time. Set-aside forwards are kept in the JSON
("discarded") and counted in the table; after --gate-seconds from the start nothing is gated or rerun, so
the run ends in bounded time.

    python3 bench/infer_offload.py --json bench/results/infer_offload.json

A quick debug run: --layers 12 --width 512 --heads 8 --host-budget 128MiB --rounds 1 --forwards 1.

# [Note: generation mode]
With --generate the same model files serve greedy generation instead: for each batch of --batches, B
prompts of --prompt random tokens, `model.generate(ids, attention_mask, max_new_tokens=--new-tokens,
do_sample=False, min_new_tokens=--new-tokens)` once per process and batch (after one untimed 2-token
generate of one sequence that records tiermem's order), timed whole and per step by forward hooks on the
model (the first forward is the prompt's prefill, the rest are decoding steps). Variants: (a) in memory,
(c) tiermem with --kv-tier (default nvme: the KV cache in swap, the host pool its cache, see [Note: tiered
KV cache] in tiermem/runtime/kv_cache.py) under --host-budget, (c') the same with `params.storage: int8`
(weights compressed on NVMe, see [Note: compressed weights] in tiermem/quant.py), (d) accelerate cold, its
offload folder dropped from the page cache before every forward (prefill and each step). tokens/s counts
the generated tokens, B x --new-tokens, over the whole generate(); decode tokens/s those of the steps after
the first over the steps' time. Each variant's tokens must equal the in-memory ones, but (c')'s, whose
weights are rounded: for it the share of generated tokens equal to the in-memory ones is reported. With
--gen-rounds R every variant runs R times, in its own process each time, the order rotated by one each
round; each ratio is taken within a round (a paired ratio) and the median of the rounds is reported, with
the rounds' ratios beside it, since one slow in-memory prefill (this machine's moved between 16 and 26 s at
B = 32) moves a single run's ratio by a fifth. With --gen-trace DIR the bench first measures `tiermem bench
io --mode read` on --swap-dir (which caches the figure), and each tiermem variant's generate() is traced
into DIR/VARIANT-B-rROUND.json: the decoding steps' median length, disk busy share, bytes read and the time those
bytes take at that read figure are printed and kept in the JSON (see [Note: passes in a report] in
tiermem/trace.py); tracing adds its own small cost to the times.

    python3 bench/infer_offload.py --generate --json bench/results/infer_generate.json
GB = 1e9 bytes; MB = 1e6 bytes; MiB = 2**20 bytes; GiB = 2**30 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

from _common import (  # bench/ is on sys.path when run as a script
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
    rotated,
    run_worker,
    status_bytes,
    wait_for_quiet,
    worker_main,
    write_json,
)

from tiermem.io.bandwidth import GB, block_device_of, disk_stats
from tiermem.sizes import format_size, parse_size

CACHE_DIR = "/var/tmp/tiermem-bench-cache"
RESULT_TAG = "INFER_OFFLOAD_RESULT "  # marks the worker's JSON line among library output
SUBPROCESS_TIMEOUT_S = 900
SEED = 0  # the model's random weights
INPUT_SEED = 1234  # the token ids
# Goals from the issue.
IO_GOAL = 1.15  # tiermem <= this x max(in memory, parameter bytes / engine read bandwidth)
COLD_GOAL = 0.4  # tiermem <= this x accelerate cold
WARM_GOAL = 1.0  # tiermem <= this x accelerate warm
RSS_SLACK = 400 * 10**6  # tiermem's peak RSS <= host budget + this
MIN_MODEL_TO_BUDGET = 4  # the model's parameters should be at least this x the host budget
# [Note: quiet gate]: wait at most this long before a timed forward, for other processes to stay under
# --quiet-cores over one window of this length
QUIET_LIMIT_S, QUIET_WINDOW_S = 10.0, 0.3


@dataclass(frozen=True)
class Variant:
    """One column of the comparison."""

    key: str  # stable name used in the JSON and the worker's command line
    label: str  # what the tables print
    kind: str  # memory | tiermem | accelerate | mmap
    prefetch: bool = True  # tiermem only
    cold: bool = False  # accelerate and mmap: drop their files from the page cache before every forward
    storage: str = "full"  # tiermem only: params.storage (the generation mode's compressed variant)


VARIANTS = (
    Variant("memory", "(a) in memory", "memory"),
    Variant("tiermem_noprefetch", "(b) tiermem, no prefetch", "tiermem", prefetch=False),
    Variant("tiermem", "(c) tiermem, prefetch", "tiermem"),
    Variant("accelerate_cold", "(d) accelerate cold", "accelerate", cold=True),
    Variant("accelerate_warm", "(d) accelerate warm", "accelerate"),
    Variant("mmap_cold", "(e) mmap safetensors cold", "mmap", cold=True),
    Variant("mmap_warm", "(e) mmap safetensors warm", "mmap"),
)
BY_KEY = {v.key: v for v in VARIANTS}


# -- helpers used on both sides ---------------------------------------------------------------------
def read_bytes_so_far() -> int | None:
    """This process's read_bytes from /proc/self/io (bytes it made the block layer read), or None."""
    io = proc_io()
    return None if io is None else io[0]


def busy_seconds() -> float | None:
    """cpu_busy_seconds without interrupt time: with a cold page cache much of it is our own reads'
    completions, not other processes."""
    return cpu_busy_seconds(interrupts=False)


def drop_from_page_cache(paths: list[str]) -> None:
    """Ask the kernel to drop the cached pages of `paths` (clean, unmapped pages go; nothing is written)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, _, s = item.strip().lower().partition("x")
        out.append((int(b), int(s)))
    return out


def shape_name(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


# -- the model files (made once, in a subprocess, and cached) ----------------------------------------
def model_dir_for(layers: int, width: int, heads: int) -> str:
    return os.path.join(CACHE_DIR, f"gpt2-l{layers}-w{width}-h{heads}-seed{SEED}")


def prepare_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Make model.safetensors (save_pretrained) and accelerate's offload folder from one random model."""
    import torch
    from accelerate.utils import offload_state_dict
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = spec["model_dir"]
    torch.manual_seed(SEED)
    cfg = GPT2Config(n_layer=spec["layers"], n_embd=spec["width"], n_head=spec["heads"])
    model = GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(folder)
    offload_state_dict(os.path.join(folder, "accelerate-offload"), model.state_dict())
    params = sum(p.numel() for p in model.parameters())  # tied weights once
    info = {"parameters": params, "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype)}
    with open(os.path.join(folder, "bench-info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f)
    return info


def ensure_model(layers: int, width: int, heads: int) -> tuple[str, dict[str, Any]]:
    folder = model_dir_for(layers, width, heads)
    info_path = os.path.join(folder, "bench-info.json")
    if not os.path.exists(info_path):  # written last: its presence means both files are complete
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        print(f"making the model files in {folder} (once; random weights, seed {SEED})...", file=sys.stderr,
              flush=True)
        start_worker("_prepare", {"model_dir": folder, "layers": layers, "width": width, "heads": heads})
    with open(info_path, encoding="utf-8") as f:
        info = json.load(f)
    ckpt = os.path.join(folder, "model.safetensors")
    offload = os.path.join(folder, "accelerate-offload")
    info["checkpoint_bytes"] = os.path.getsize(ckpt)
    info["accelerate_offload_bytes"] = sum(os.path.getsize(p) for p in files_under(offload))
    info["accelerate_offload_files"] = len(files_under(offload))
    return folder, info


# -- the variants (run inside the worker subprocess) -------------------------------------------------
def tiermem_overrides(spec: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The config every tiermem variant runs with: params on NVMe in --swap-dir under --host-budget, io_uring,
    --prefetch-depth; `extra` adds to it (the generation mode's kv.tier)."""
    return {"device": "cpu", "params.tier": "nvme", "nvme.paths": [spec["swap_dir"]],
            "memory.host_budget": spec["host_budget"], "prefetch.depth": spec["prefetch_depth"],
            "io.engine": "io_uring", **extra}


def meta_model(model_dir: str) -> Any:
    """The model with every parameter on the meta device and real buffers, as for a model larger than RAM."""
    from accelerate import init_empty_weights
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = GPT2LMHeadModel(cfg)
    model.tie_weights()  # as from_pretrained does; a model built empty here is not tied yet
    return model.eval()


class LazySafetensors:
    """Variant (e): each layer's parameters come from the mmap'd safetensors file in its pre-forward hook
    and go back to the meta device in its forward hook. The file is opened for each forward of the whole
    model and closed after it, so that a cold run can drop its pages from the page cache in between."""

    def __init__(self, model: Any, path: str) -> None:
        import torch
        from safetensors import safe_open
        from torch import nn

        self.path = path
        self._open = safe_open
        self.file: Any = None  # the open safe_open handle during a forward of the whole model
        with safe_open(path, framework="pt") as f:
            stored = set(f.keys())
        first: dict[int, str] = {}  # id(param) -> a name under which the checkpoint stores it (tied weights)
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if fqn in stored:
                first.setdefault(id(p), fqn)
        blocks = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=lambda m: len(m))
        in_block = {id(m) for b in blocks for m in b.modules()}
        layers = list(blocks) + [m for m in model.modules()
                                 if id(m) not in in_block and any(True for _ in m.parameters(recurse=False))]
        owner = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.handles = [model.register_forward_pre_hook(self._begin),
                        model.register_forward_hook(self._end, always_call=True)]
        for layer in layers:
            slots = []  # (module holding the parameter, attribute, name in the checkpoint, meta placeholder)
            for mod in layer.modules():
                for attr, p in mod._parameters.items():
                    if p is None:
                        continue
                    fqn = f"{owner[id(mod)]}.{attr}"
                    key = fqn if fqn in stored else first.get(id(p))
                    if key is None:
                        raise KeyError(f"parameter {fqn} is not in {path}")
                    slots.append((mod, attr, key, nn.Parameter(torch.empty_like(p, device="meta"),
                                                               requires_grad=False)))
            self.handles.append(layer.register_forward_pre_hook(self._loader(slots)))
            self.handles.append(layer.register_forward_hook(self._dropper(slots), always_call=True))

    def _begin(self, module: Any, args: Any) -> None:
        self.file = self._open(self.path, framework="pt").__enter__()

    def _end(self, module: Any, args: Any, output: Any) -> None:
        self.file.__exit__(None, None, None)
        self.file = None

    def _loader(self, slots: list[tuple[Any, str, str, Any]]) -> Callable[[Any, Any], None]:
        from torch import nn

        def load(module: Any, args: Any) -> None:
            for mod, attr, key, _ in slots:
                mod._parameters[attr] = nn.Parameter(self.file.get_tensor(key), requires_grad=False)

        return load

    def _dropper(self, slots: list[tuple[Any, str, str, Any]]) -> Callable[[Any, Any, Any], None]:
        def drop(module: Any, args: Any, output: Any) -> None:
            for mod, attr, _, placeholder in slots:
                mod._parameters[attr] = placeholder

        return drop


def variant_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build one variant, then time its forwards for every shape; return the figures."""
    t_start = time.perf_counter()
    rss_start = status_bytes("VmRSS") or 0
    import torch
    import transformers

    rss_imported = status_bytes("VmRSS") or 0
    v = BY_KEY[spec["variant"]]
    model_dir = spec["model_dir"]
    ckpt = os.path.join(model_dir, "model.safetensors")
    offload_dir = os.path.join(model_dir, "accelerate-offload")
    out: dict[str, Any] = {"variant": v.key, "torch_threads": torch.get_num_threads(),
                           "torch": torch.__version__, "transformers": transformers.__version__}
    cold_files: list[str] = []
    tm = None
    with ExitStack() as stack:
        t0 = time.perf_counter()
        if v.kind == "memory":
            from transformers import GPT2LMHeadModel

            model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
        elif v.kind == "tiermem":
            import tiermem

            model = meta_model(model_dir)
            overrides = tiermem_overrides(spec)
            out["tiermem_overrides"] = overrides
            tm = stack.enter_context(tiermem.tiered_offload(model, checkpoint=ckpt, restore=False,
                                                            prefetch=v.prefetch, **overrides))
            out["units"] = len(tm.units)
            out["largest_unit_bytes"] = max(u.nbytes for u in tm.units)
            out["unit_bytes"] = {u.name: u.nbytes for u in tm.units}
        elif v.kind == "accelerate":
            from accelerate import disk_offload

            model = meta_model(model_dir)
            disk_offload(model, offload_dir, execution_device=torch.device("cpu"))
            cold_files = files_under(offload_dir) if v.cold else []
        elif v.kind == "mmap":
            model = meta_model(model_dir)
            stack.callback(lambda h: [x.remove() for x in h.handles], LazySafetensors(model, ckpt))
            cold_files = [ckpt] if v.cold else []
        else:
            raise ValueError(v.kind)
        out["setup_seconds"] = time.perf_counter() - t0
        out["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        out["rss_after_setup_bytes"] = status_bytes("VmRSS") or 0

        devices = [d for d in {block_device_of(spec["swap_dir"]), block_device_of(model_dir)} if d]
        box: dict[str, Any] = {}

        def forward(ids: Any, warmup: bool) -> dict[str, Any]:
            if cold_files:
                drop_from_page_cache(cold_files)
            if tm is not None:
                tm.reset_stats()
            dev0, busy0, rb0 = disk_stats(devices), busy_seconds(), read_bytes_so_far()
            c0, t0 = time.process_time(), time.perf_counter()
            with torch.inference_mode():
                box["logits"] = model(ids, use_cache=False).logits
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            busy1, rb1, dev1 = busy_seconds(), read_bytes_so_far(), disk_stats(devices)
            own_read = rb1 - rb0 if rb0 is not None and rb1 is not None else None
            dev_bytes = sum((a[1] - dev0[d][1] + a[3] - dev0[d][3]) * 512 for d, a in dev1.items() if d in dev0)
            sample: dict[str, Any] = {
                "seconds": seconds, "cpu_seconds": cpu, "warmup": warmup,
                "disk_read_bytes": own_read,
                # CPU time that other processes (and kernel threads) took during this forward; /proc/stat
                # counts in ticks of 10 ms
                "other_cpu_seconds": other_cpu_seconds(busy0, busy1, cpu),
                # bytes the disk moved (read + written) for others during this forward
                "other_disk_bytes": max(0, dev_bytes - own_read) if dev1 and own_read is not None else None,
            }
            if tm is not None:
                st = tm.stats()
                sample.update({k: st[k] for k in ("bytes_read", "stall_seconds", "prefetch_hits",
                                                  "prefetch_misses", "retraces", "evictions", "passes")})
                sample["peak_host_bytes"] = st["peak_bytes"]["host"]
            return sample

        shapes = []
        for b, s in spec["shapes"]:
            gen = torch.Generator().manual_seed(INPUT_SEED + 7 * b + s)
            ids = torch.randint(0, model.config.vocab_size, (b, s), generator=gen)
            samples = [forward(ids, warmup=True)]  # untimed: records tiermem's order, fills warm caches
            discarded = []  # forwards that other processes disturbed, rerun (see [Note: quiet gate])
            for _ in range(spec["forwards"]):
                for attempt in range(1 + spec["retries"]):
                    gating = time.time() < spec["deadline"]
                    waited = wait_for_quiet(spec["quiet_cores"], QUIET_LIMIT_S, window_s=QUIET_WINDOW_S,
                                            interrupts=False)["waited_seconds"] if gating else 0.0
                    sample = forward(ids, warmup=False)
                    sample["waited_for_quiet_seconds"] = waited
                    other = sample["other_cpu_seconds"]
                    disturbed = other is not None and other > spec["disturbed_share"] * sample["seconds"]
                    sample["disturbed"] = disturbed
                    if not disturbed or not gating or attempt == spec["retries"]:
                        samples.append(sample)
                        break
                    discarded.append(sample)
            logits = box.pop("logits")
            assert logits is not None
            path = os.path.join(spec["logits_dir"], f"r{spec['round']}-{v.key}-{shape_name((b, s))}.pt")
            torch.save(logits.clone(), path)
            shapes.append({"shape": shape_name((b, s)), "samples": samples, "discarded": discarded,
                           "logits_file": path, "vm_hwm_bytes": status_bytes("VmHWM") or 0})
        out["shapes"] = shapes
        out["peak_rss_bytes"] = peak_rss_bytes()  # before any teardown
    out["rss_start_bytes"] = rss_start
    out["rss_after_imports_bytes"] = rss_imported
    out["process_seconds"] = time.perf_counter() - t_start
    return out


# -- generation mode (see [Note: generation mode]) ------------------------------------------------------
GEN_VARIANTS = (Variant("memory", "(a) in memory", "memory"), Variant("tiermem", "(c) tiermem, KV in tiers", "tiermem"),
                Variant("tiermem_int8", "(c') tiermem, KV in tiers, int8", "tiermem", storage="int8"),
                Variant("accelerate_cold", "(d) accelerate cold", "accelerate", cold=True))


def generate_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build one variant, then time one greedy generate() per batch size; return the figures."""
    import torch

    v = next(x for x in GEN_VARIANTS if x.key == spec["variant"])
    model_dir = spec["model_dir"]
    out: dict[str, Any] = {"variant": v.key, "torch_threads": torch.get_num_threads()}
    tm = None
    with ExitStack() as stack:
        t0 = time.perf_counter()
        cold_files: list[str] = []
        if v.kind == "memory":
            from transformers import GPT2LMHeadModel

            model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
        elif v.kind == "tiermem":
            import tiermem

            model = meta_model(model_dir)
            overrides = tiermem_overrides(spec, **{"kv.tier": spec["kv_tier"]},
                                          **({"params.storage": v.storage} if v.storage != "full" else {}))
            out["tiermem_overrides"] = overrides
            tm = stack.enter_context(tiermem.tiered_offload(model, checkpoint=os.path.join(model_dir,
                                                                                           "model.safetensors"),
                                                            restore=False, **overrides))
        else:
            from accelerate import disk_offload

            model = meta_model(model_dir)
            offload_dir = os.path.join(model_dir, "accelerate-offload")
            disk_offload(model, offload_dir, execution_device=torch.device("cpu"))
            cold_files = files_under(offload_dir)
        out["setup_seconds"] = time.perf_counter() - t0
        steps: list[float] = []
        began: list[float] = []

        def before(module: Any, args: Any) -> None:
            if cold_files:
                drop_from_page_cache(cold_files)
            began.append(time.perf_counter())

        def after(module: Any, args: Any, output: Any) -> None:
            steps.append(time.perf_counter() - began.pop())

        stack.callback(model.register_forward_pre_hook(before).remove)
        stack.callback(model.register_forward_hook(after).remove)

        def generate(ids: Any, mask: Any, new: int) -> Any:
            with torch.inference_mode():
                return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, pad_token_id=0)

        gen = torch.Generator().manual_seed(INPUT_SEED)
        warm = torch.randint(0, model.config.vocab_size, (1, spec["prompt"]), generator=gen)
        generate(warm, torch.ones_like(warm), 2)  # untimed: records tiermem's order
        batches = []
        for b in spec["batches"]:
            g = torch.Generator().manual_seed(INPUT_SEED + b)
            ids = torch.randint(0, model.config.vocab_size, (b, spec["prompt"]), generator=g)
            steps.clear()
            if tm is not None:
                tm.reset_stats()
            trace = (os.path.join(spec["trace_dir"], f"{v.key}-{b}-r{spec['round'] + 1}.json")
                     if spec.get("trace_dir") and tm else None)
            rb0, c0, t1 = read_bytes_so_far(), time.process_time(), time.perf_counter()
            with tm.trace(trace) if trace else nullcontext():
                tokens = generate(ids, torch.ones_like(ids), spec["new_tokens"])
            seconds, cpu, rb1 = time.perf_counter() - t1, time.process_time() - c0, read_bytes_so_far()
            new = tokens.shape[1] - spec["prompt"]
            entry: dict[str, Any] = {
                "batch": b, "seconds": seconds, "cpu_seconds": cpu, "new_tokens": new,
                "prefill_seconds": steps[0] if steps else None, "decode_seconds": sum(steps[1:]),
                "steps": len(steps), "tokens_per_second": b * new / seconds,
                "decode_tokens_per_second": b * (new - 1) / sum(steps[1:]) if len(steps) > 1 else None,
                "disk_read_bytes": rb1 - rb0 if rb0 is not None and rb1 is not None else None,
            }
            if trace:  # the decoding steps against their disk's floor (see [Note: passes in a report])
                from tiermem.trace import summarize

                with open(trace, encoding="utf-8") as f:
                    passes = summarize(json.load(f))["passes"]
                entry["trace"] = {"path": trace, "first": passes["first"], "rest": passes["rest"]}
            if tm is not None:
                st = tm.stats()
                entry.update({k: st[k] for k in ("bytes_read", "bytes_written", "stall_seconds")})
                entry.update({k: st[k] for k in ("kv_peak_bytes", "kv_bytes_read", "kv_bytes_written",
                                                  "kv_stall_seconds") if k in st})  # kv.tier memory: none
                entry["peak_host_bytes"] = st["peak_bytes"]["host"]
            path = os.path.join(spec["logits_dir"], f"gen-{v.key}-{b}.pt")
            torch.save(tokens.clone(), path)
            entry["tokens_file"] = path
            batches.append(entry)
            print(f"  {v.label} B={b}: {seconds:.1f} s, {entry['tokens_per_second']:.1f} tok/s", file=sys.stderr,
                  flush=True)
        out["batches"] = batches
        out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def run_generate(args: argparse.Namespace, argv: list[str]) -> int:
    """The generation mode: every variant in its own process, side by side; see [Note: generation mode]."""
    import torch

    t_start = time.perf_counter()
    os.makedirs(args.swap_dir, exist_ok=True)
    logits_dir = os.path.join(CACHE_DIR, f"tokens-{os.getpid()}")
    os.makedirs(logits_dir, exist_ok=True)
    model_dir, info = ensure_model(args.layers, args.width, args.heads)
    system = describe_system([args.swap_dir])
    versions = package_versions("tiermem", "torch", "transformers", "accelerate", "safetensors")
    print_system_header("tiermem generation: KV cache in tiers vs accelerate", system, versions)
    print(f"  model: GPT2LMHeadModel(n_layer={args.layers}, n_embd={args.width}, n_head={args.heads}), "
          f"{_gb(info['parameter_bytes'])} GB; host budget {format_size(args.host_budget_bytes)}; kv.tier "
          f"{args.kv_tier}; batches {args.batches}, prompt {args.prompt}, {args.new_tokens} new tokens\n", flush=True)
    read_bw = None
    if args.gen_trace:  # the floor the traces are set against: tiermem bench io here, now (it caches the figure)
        os.makedirs(args.gen_trace, exist_ok=True)
        read_bw = read_bandwidth(args.swap_dir, args.io_size)
        print(f"  tiermem bench io read on the swap directory: {read_bw['gbps_mean']:.2f} GB/s\n", flush=True)
    runs = []
    chosen = [v for v in GEN_VARIANTS if v.key in args.gen_variant_keys]
    try:
        for rnd in range(args.gen_rounds):
            for v in rotated(chosen, rnd):
                spec = {"variant": v.key, "model_dir": model_dir, "batches": args.batch_list, "prompt": args.prompt,
                        "new_tokens": args.new_tokens, "host_budget": args.host_budget, "kv_tier": args.kv_tier,
                        "prefetch_depth": args.prefetch_depth, "swap_dir": args.swap_dir, "logits_dir": logits_dir,
                        "trace_dir": args.gen_trace, "round": rnd}
                try:
                    run = run_worker(__file__, "_generate", spec, tag=RESULT_TAG, timeout=SUBPROCESS_TIMEOUT_S * 4,
                                     name=f"worker {v.key}")
                except RuntimeError as exc:
                    run = {"variant": v.key, "error": str(exc)}
                    print(f"{v.label} FAILED:\n{exc}", file=sys.stderr, flush=True)
                runs.append({**run, "round": rnd})
        ref = {e["batch"]: torch.load(e["tokens_file"]) for r in runs if r["variant"] == "memory" and r["round"] == 0
               for e in r.get("batches", [])}
        for r in runs:
            for e in r.get("batches", []):
                got = torch.load(e.pop("tokens_file"))
                want = ref.get(e["batch"])
                e["tokens_equal_memory"] = bool(torch.equal(got, want)) if want is not None else None
                if want is not None and got.shape == want.shape:  # the share of generated tokens that agree
                    e["tokens_agree_memory"] = float((got[:, args.prompt:] == want[:, args.prompt:]).float().mean())
    finally:
        shutil.rmtree(logits_dir, ignore_errors=True)
    by = {(r["variant"], e["batch"], r["round"]): e for r in runs for e in r.get("batches", [])}
    head = f"{'B':>3} {'rnd':>3} {'variant':<26} {'s':>7} {'tok/s':>7} {'decode tok/s':>12} {'prefill s':>9} " \
           f"{'read GB':>8} {'KV peak GB':>10} {'same tokens':>11}"
    print(head)
    print("-" * len(head))
    for b in args.batch_list:
        for rnd in range(args.gen_rounds):
            for v in GEN_VARIANTS:
                e = by.get((v.key, b, rnd))
                if e is None:
                    continue
                dec = e["decode_tokens_per_second"]
                kv = _gb(e["kv_peak_bytes"]) if "kv_peak_bytes" in e else "-"
                print(f"{b:>3} {rnd + 1:>3} {v.label:<26} {e['seconds']:>7.1f} {e['tokens_per_second']:>7.2f} "
                      f"{dec if dec is None else f'{dec:.2f}':>12} {e['prefill_seconds']:>9.1f} "
                      f"{_gb(e['disk_read_bytes']):>8} {kv:>10} {str(e['tokens_equal_memory']):>11}")
    for r in runs:
        for e in r.get("batches", []):
            rest = e.get("trace", {}).get("rest")
            if rest:
                floor = (f"; {rest['floor_seconds']:.3f} s at tiermem bench io's read, {rest['of_floor']:.2f}x that"
                         if rest["floor_seconds"] else "")
                print(f"B={e['batch']} round {r['round'] + 1} {r['variant']}: decoding steps (traced) "
                      f"{rest['seconds']:.3f} s median, disk busy {rest['io_busy_share']:.0%}, "
                      f"{rest['read_bytes'] / 1e9:.3f} GB read at {(rest['read_gbps'] or 0):.2f} GB/s in flight{floor}")
    ratios: dict[str, dict[int, dict[str, Any]]] = {}
    for key in ("tiermem", "tiermem_int8"):
        for b in args.batch_list:
            paired: dict[str, list[float]] = {"vs_memory": [], "vs_accelerate_cold": []}
            agree = None
            for rnd in range(args.gen_rounds):
                t = by.get((key, b, rnd))
                if t is None:
                    continue
                agree = t.get("tokens_agree_memory")
                for name, peer in (("vs_memory", "memory"), ("vs_accelerate_cold", "accelerate_cold")):
                    o = by.get((peer, b, rnd))
                    if o is not None:
                        paired[name].append(t["tokens_per_second"] / o["tokens_per_second"])
            if not any(paired.values()) and agree is None:
                continue
            r = ratios.setdefault(key, {})[b] = {name: statistics.median(x) if x else None
                                                 for name, x in paired.items()}
            r.update({f"{name}_rounds": x for name, x in paired.items()})
            rounds = "" if args.gen_rounds == 1 else (
                f" (rounds: {', '.join(f'{x:.2f}' for x in paired['vs_memory'])})" if paired["vs_memory"] else "")
            print(f"B={b}: {key} {r['vs_memory'] or float('nan'):.2f} x in memory{rounds}, "
                  f"{r['vs_accelerate_cold'] or float('nan'):.2f} x accelerate cold (tokens/s"
                  f"{', median of paired rounds' if args.gen_rounds > 1 else ''})"
                  + (f"; {agree:.0%} of its tokens as in memory" if agree is not None else ""))
    wall = time.perf_counter() - t_start
    print(f"\nwhole run {wall:.0f} s")
    if args.json:
        write_json(args.json, {"command": " ".join(["python3", "bench/infer_offload.py", *argv]), "system": system,
                               "versions": versions, "model": {"n_layer": args.layers, "n_embd": args.width,
                                                               "n_head": args.heads, **info},
                               "config": {"batches": args.batch_list, "prompt": args.prompt,
                                          "rounds": args.gen_rounds,
                                          "new_tokens": args.new_tokens, "host_budget": args.host_budget,
                                          "kv_tier": args.kv_tier, "prefetch_depth": args.prefetch_depth},
                               "ratios": ratios, "runs": runs, "wall_seconds": wall,
                               **({"read_bandwidth": read_bw} if read_bw else {})})
    return 0


# -- subprocesses -------------------------------------------------------------------------------------
WORKERS = {"_prepare": prepare_worker, "_variant": variant_worker,  # what this file runs as a worker, by kind
           "_generate": generate_worker}


def start_worker(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One worker process (this file with `kind`); its figures, or RuntimeError."""
    return run_worker(__file__, kind, spec, tag=RESULT_TAG, timeout=SUBPROCESS_TIMEOUT_S, name=f"worker {kind}")


def read_bandwidth(path: str, size: str) -> dict[str, Any]:
    """tiermem's own read bandwidth on the swap disk: `python3 -m tiermem bench io ... --mode read`."""
    bw = engine_bandwidth(path, size, modes=("read",), timeout=SUBPROCESS_TIMEOUT_S)
    return {**bw["read"], "command": bw["command"]}


# -- summary and goals --------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]], variants: list[Variant], shapes: list[str]) -> list[dict[str, Any]]:
    out = []
    for shape in shapes:
        for v in variants:
            mine = [r for r in runs if r["variant"] == v.key]
            ok = [r for r in mine if "error" not in r]
            entry: dict[str, Any] = {"variant": v.key, "label": v.label, "shape": shape, "processes": len(ok),
                                     "failed": len(mine) - len(ok)}
            timed = [s for r in ok for sh in r["shapes"] if sh["shape"] == shape for s in sh["samples"]
                     if not s["warmup"]]
            if not timed:
                entry["error"] = mine[-1]["error"] if mine else "not run"
                out.append(entry)
                continue
            b, s = (int(x) for x in shape.split("x"))
            mean, sd = mean_std([t["seconds"] for t in timed])
            rb = [t["disk_read_bytes"] for t in timed if t["disk_read_bytes"] is not None]
            secs = [t["seconds"] for t in timed]
            entry.update({
                "forwards": len(timed),
                "reruns": sum(len(sh.get("discarded", [])) for r in ok for sh in r["shapes"] if sh["shape"] == shape),
                "disturbed_kept": sum(1 for t in timed if t.get("disturbed")),
                "seconds_median": statistics.median(secs),
                "seconds_min": min(secs),
                "seconds_mean": mean, "seconds_std": sd,
                "seconds_samples": [t["seconds"] for t in timed],
                "tokens_per_second": b * s / mean,
                "cpu_seconds_mean": statistics.fmean(t["cpu_seconds"] for t in timed),
                "other_cpu_cores_mean": statistics.fmean(t["other_cpu_seconds"] / t["seconds"] for t in timed
                                                         if t["other_cpu_seconds"] is not None) if all(
                    t["other_cpu_seconds"] is not None for t in timed) else None,
                "setup_seconds_mean": statistics.fmean(r["setup_seconds"] for r in ok),
                "disk_read_bytes_mean": statistics.fmean(rb) if rb else None,
                "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in ok),
                "peak_rss_bytes_mean": statistics.fmean(r["peak_rss_bytes"] for r in ok),
                "rss_after_imports_bytes_mean": statistics.fmean(r["rss_after_imports_bytes"] for r in ok),
                "torch_threads": sorted({r["torch_threads"] for r in ok}),
            })
            if v.kind == "tiermem":
                for key in ("bytes_read", "stall_seconds", "prefetch_hits", "prefetch_misses", "evictions",
                            "retraces", "peak_host_bytes"):
                    entry[f"{key}_mean"] = statistics.fmean(t[key] for t in timed)
                entry["stall_seconds_std"] = mean_std([t["stall_seconds"] for t in timed])[1]
                entry["units"] = ok[0]["units"]
                entry["largest_unit_bytes"] = ok[0]["largest_unit_bytes"]
            out.append(entry)
    return out


def check_logits(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every variant's last logits against the in-memory model's of the same round and shape."""
    import torch

    ref: dict[tuple[int, str], Any] = {}
    for r in runs:
        if r["variant"] == "memory" and "error" not in r:
            for sh in r["shapes"]:
                ref[(r["round"], sh["shape"])] = torch.load(sh["logits_file"])
    out = []
    for r in runs:
        if r["variant"] == "memory" or "error" in r:
            continue
        for sh in r["shapes"]:
            base = ref.get((r["round"], sh["shape"]))
            if base is None:
                continue
            got = torch.load(sh["logits_file"])
            out.append({"variant": r["variant"], "round": r["round"], "shape": sh["shape"],
                        "bit_exact": bool(torch.equal(got, base)),
                        "max_abs_diff": float((got - base).abs().max()) if got.shape == base.shape else None})
    return out


def goals(summary: list[dict[str, Any]], runs: list[dict[str, Any]], param_bytes: int, read_gbps: float | None,
          host_budget: int, shapes: list[str], exact: list[dict[str, Any]]) -> dict[str, Any]:
    def get(key: str, shape: str) -> dict[str, Any] | None:
        e = next((s for s in summary if s["variant"] == key and s["shape"] == shape), None)
        return e if e is not None and "seconds_mean" in e else None

    cases = []
    for shape in shapes:
        a, c = get("memory", shape), get("tiermem", shape)
        dc, dw = get("accelerate_cold", shape), get("accelerate_warm", shape)
        case: dict[str, Any] = {"shape": shape}
        if c is not None and a is not None and read_gbps:
            io_s = param_bytes / (read_gbps * GB)
            bound = max(a["seconds_mean"], io_s)
            case["io_bound"] = {"tiermem_s": c["seconds_mean"], "memory_s": a["seconds_mean"],
                                "param_bytes_over_bandwidth_s": io_s, "limit_s": IO_GOAL * bound,
                                "ratio": c["seconds_mean"] / bound,
                                "held": c["seconds_mean"] <= IO_GOAL * bound}
        if c is not None and dc is not None:
            case["vs_accelerate_cold"] = {"ratio": c["seconds_mean"] / dc["seconds_mean"],
                                          "held": c["seconds_mean"] <= COLD_GOAL * dc["seconds_mean"],
                                          "paired": _paired(runs, "tiermem", "accelerate_cold", shape)}
        if c is not None and dw is not None:
            case["vs_accelerate_warm"] = {"ratio": c["seconds_mean"] / dw["seconds_mean"],
                                          "held": c["seconds_mean"] <= WARM_GOAL * dw["seconds_mean"],
                                          "paired": _paired(runs, "tiermem", "accelerate_warm", shape)}
        cases.append(case)
    rss = [r["peak_rss_bytes"] for r in runs if r["variant"] == "tiermem" and "error" not in r]
    # What a process holds with the libraries imported and the model built on the meta device, no weights:
    # the accelerate and mmap workers right after their setup.
    base = [r["rss_after_setup_bytes"] for r in runs if "error" not in r and BY_KEY[r["variant"]].kind in
            ("accelerate", "mmap")]
    rss_goal = None
    if rss:
        rss_goal = {"peak_rss_bytes_max": max(rss), "peak_rss_bytes_mean": statistics.fmean(rss),
                    "limit_bytes": host_budget + RSS_SLACK, "held": max(rss) <= host_budget + RSS_SLACK,
                    "baseline_bytes": statistics.fmean(base) if base else None}
        if base:
            rss_goal["above_baseline_plus_budget_bytes"] = max(rss) - rss_goal["baseline_bytes"] - host_budget
    tier_exact = [e for e in exact if e["variant"].startswith("tiermem")]
    return {
        "io_goal": f"(c) <= {IO_GOAL} x max((a), parameter bytes / tiermem io_uring read bandwidth)",
        "cold_goal": f"(c) <= {COLD_GOAL} x (d) cold",
        "warm_goal": f"(c) <= {WARM_GOAL} x (d) warm",
        "rss_goal": f"peak RSS of (c) <= host budget + {RSS_SLACK // 10**6} MB",
        "cases": cases,
        "rss": rss_goal,
        "tiermem_bit_exact": all(e["bit_exact"] for e in tier_exact) if tier_exact else None,
    }


def _paired(runs: list[dict[str, Any]], a: str, b: str, shape: str) -> dict[str, float] | None:
    """Ratio of the mean seconds of `a` and `b` within each round (same stretch of disk and CPU noise)."""
    def mean_in(r: dict[str, Any]) -> float:
        sh = next(x for x in r["shapes"] if x["shape"] == shape)
        return statistics.fmean(s["seconds"] for s in sh["samples"] if not s["warmup"])

    ratios = []
    for rnd in sorted({r["round"] for r in runs}):
        ra = next((r for r in runs if r["round"] == rnd and r["variant"] == a and "error" not in r), None)
        rb = next((r for r in runs if r["round"] == rnd and r["variant"] == b and "error" not in r), None)
        if ra and rb:
            ratios.append(mean_in(ra) / mean_in(rb))
    if not ratios:
        return None
    m, s = mean_std(ratios)
    return {"mean": m, "std": s}


# -- printing -----------------------------------------------------------------------------------------
def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def print_header(system: dict[str, Any], versions: dict[str, str], info: dict[str, Any], args: Any) -> None:
    print_system_header("tiermem inference offload vs accelerate", system, versions)
    print(f"  model: GPT2LMHeadModel(n_layer={args.layers}, n_embd={args.width}, n_head={args.heads}), "
          f"{info['parameters'] / 1e6:.1f}M parameters, {info['dtype']}, {_gb(info['parameter_bytes'])} GB "
          f"({info['parameter_bytes'] / args.host_budget_bytes:.2f} x the host budget "
          f"{format_size(args.host_budget_bytes)})")
    print(f"  shapes {args.shapes}; per process 1 warm-up + {args.forwards} timed forwards per shape; "
          f"{args.rounds} rounds, variants in rotating order; tiermem prefetch.depth {args.prefetch_depth}")
    print(flush=True)


def print_tables(summary: list[dict[str, Any]], verdict: dict[str, Any], bw: dict[str, Any] | None,
                 exact: list[dict[str, Any]], host_budget: int) -> None:
    head = (f"{'shape':<6} {'variant':<27} {'s/forward':>15} {'median':>6} {'tok/s':>7} {'CPU s':>6} {'others':>6} "
            f"{'peak RSS GB':>11} {'read GB':>8} {'stall s':>7} {'hit/miss':>9} {'setup s':>7} {'reruns':>6}")
    print(head)
    print("-" * len(head))
    for s in summary:
        lead = f"{s['shape']:<6} {s['label']:<27}"
        if "seconds_mean" not in s:
            print(f"{lead} failed: {s['error'].splitlines()[0]}")
            continue
        tm = s["variant"].startswith("tiermem")
        stall = f"{s['stall_seconds_mean']:.3f}" if tm else "-"
        hm = f"{s['prefetch_hits_mean']:.0f}/{s['prefetch_misses_mean']:.0f}" if tm else "-"
        t = f"{s['seconds_mean']:.3f} ± {s['seconds_std']:.3f}"
        others = "?" if s["other_cpu_cores_mean"] is None else f"{s['other_cpu_cores_mean']:.2f}"
        reruns = f"{s['reruns']}" + (f"/{s['disturbed_kept']}!" if s["disturbed_kept"] else "")
        print(f"{lead} {t:>15} {s['seconds_median']:>6.3f} {s['tokens_per_second']:>7.1f} "
              f"{s['cpu_seconds_mean']:>6.2f} {others:>6} {_gb(s['peak_rss_bytes_max']):>11} "
              f"{_gb(s['disk_read_bytes_mean']):>8} {stall:>7} {hm:>9} {s['setup_seconds_mean']:>7.1f} {reruns:>6}")
    print("CPU s: the process's CPU seconds per forward; others: CPU cores other processes kept busy meanwhile; "
          "read GB: read_bytes of /proc/self/io per forward; stall s, hit/miss: tiermem's stats() per forward; "
          "reruns: forwards set aside because others disturbed them (/N!: N disturbed ones kept)")
    print()
    if bw:
        print(f"tiermem io_uring read bandwidth on the swap disk: {bw['gbps_mean']:.2f} ± {bw['gbps_std']:.2f} GB/s "
              f"({len(bw['gbps_samples'])} reads of {bw['size']})")
    bad = [e for e in exact if not e["bit_exact"]]
    print(f"logits vs in memory: {len(exact) - len(bad)} of {len(exact)} bit-exact"
          + "".join(f"; NOT {e['variant']} round {e['round']} {e['shape']} (max |diff| {e['max_abs_diff']:.3g})"
                    for e in bad))
    print()
    print("goals:")
    for c in verdict["cases"]:
        if "io_bound" in c:
            g = c["io_bound"]
            print(f"  {c['shape']:<6} {verdict['io_goal']}: {'held' if g['held'] else 'NOT held'} "
                  f"({g['tiermem_s']:.3f} s vs limit {g['limit_s']:.3f} s = {IO_GOAL} x max({g['memory_s']:.3f}, "
                  f"{g['param_bytes_over_bandwidth_s']:.3f}); ratio {g['ratio']:.2f})")
        for key, goal, limit in (("vs_accelerate_cold", "cold_goal", COLD_GOAL),
                                 ("vs_accelerate_warm", "warm_goal", WARM_GOAL)):
            if key in c:
                g = c[key]
                paired = f", paired per round {g['paired']['mean']:.2f} ± {g['paired']['std']:.2f}" if g["paired"] \
                    else ""
                print(f"  {c['shape']:<6} {verdict[goal]}: {'held' if g['held'] else 'NOT held'} "
                      f"({g['ratio']:.2f} x, limit {limit}{paired})")
    r = verdict["rss"]
    if r:
        print(f"  {verdict['rss_goal']}: {'held' if r['held'] else 'NOT held'} (peak {_gb(r['peak_rss_bytes_max'])} GB "
              f"vs limit {_gb(r['limit_bytes'])} GB = {format_size(host_budget)} + 400 MB)")
        if r.get("baseline_bytes"):
            print(f"    a process with the libraries and the meta-device model and no weights holds "
                  f"{_gb(r['baseline_bytes'])} GB (accelerate/mmap workers after setup); tiermem's peak is that + "
                  f"the host budget + {r['above_baseline_plus_budget_bytes'] / 1e6:.0f} MB")


# -- main ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24, help="GPT-2 layers (default 24, GPT-2 medium)")
    p.add_argument("--width", type=int, default=1024, help="GPT-2 n_embd (default 1024)")
    p.add_argument("--heads", type=int, default=16, help="GPT-2 n_head (default 16)")
    p.add_argument("--shapes", default="1x8,1x128", help="batch x tokens per forward, comma-separated "
                   "(default 1x8,1x128: an I/O-bound and a compute-bound shape)")
    p.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=5,
                   help="rounds; each runs every variant once, in its own process (default 5)")
    p.add_argument("--forwards", type=int, default=2, help="timed forwards per shape per process (default 2)")
    p.add_argument("--host-budget", default="320MiB", help="tiermem memory.host_budget (default 320MiB)")
    p.add_argument("--prefetch-depth", type=int, default=2, help="tiermem prefetch.depth for (c) (default 2)")
    p.add_argument("--swap-dir", default=os.path.join(CACHE_DIR, "swap"), help="tiermem nvme.paths entry")
    p.add_argument("--io-size", default="1GiB", help="bytes per read of the bandwidth measurement (default 1GiB)")
    p.add_argument("--variants", default=",".join(v.key for v in VARIANTS),
                   help="comma-separated subset of: " + ", ".join(v.key for v in VARIANTS))
    p.add_argument("--retries", type=int, default=2,
                   help="reruns of a forward that other processes disturbed (default 2; see [Note: quiet gate])")
    p.add_argument("--quiet-cores", type=float, default=0.15,
                   help="wait before each timed forward until other processes use fewer CPUs (default 0.15)")
    p.add_argument("--disturbed-share", type=float, default=0.15,
                   help="a forward is disturbed when others took more than this x its wall time in CPU (default 0.15)")
    p.add_argument("--gate-seconds", type=float, default=600,
                   help="no waiting or reruns after this many seconds from the start (default 600)")
    p.add_argument("--json", metavar="OUT.json", default=None, help="also write every figure to this file")
    p.add_argument("--generate", action="store_true", help="generation mode (see [Note: generation mode])")
    p.add_argument("--batches", default="1,8,32,64", help="--generate: batch sizes (default 1,8,32,64)")
    p.add_argument("--prompt", type=int, default=128, help="--generate: prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=32, help="--generate: tokens generated (default 32)")
    p.add_argument("--kv-tier", default="nvme", help="--generate: tiermem kv.tier (default nvme)")
    p.add_argument("--gen-rounds", type=int, default=1,
                   help="--generate: run every variant this many times, order rotated (default 1)")
    p.add_argument("--gen-trace", metavar="DIR", default=None,
                   help="--generate: trace each tiermem variant's generate() into DIR/VARIANT-B-rROUND.json, report "
                        "its decoding steps against the disk's floor (tiermem report's passes)")
    p.add_argument("--gen-variants", default=",".join(v.key for v in GEN_VARIANTS),
                   help="--generate: comma-separated subset of " + ", ".join(v.key for v in GEN_VARIANTS))
    args = p.parse_args(argv)
    try:
        args.host_budget_bytes = parse_size(args.host_budget, what="--host-budget")
        args.shape_list = parse_shapes(args.shapes)
        args.batch_list = [int(x) for x in args.batches.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    args.variant_list = [BY_KEY[k] for k in check_variants(p, args.variants, list(BY_KEY))]
    args.gen_variant_keys = check_variants(p, args.gen_variants, [v.key for v in GEN_VARIANTS], "--gen-variants")
    if args.gen_rounds < 1:
        p.error("--gen-rounds must be >= 1")
    if args.rounds < 1 or args.forwards < 1 or args.layers < 1 or args.width % args.heads or args.retries < 0:
        p.error("--rounds, --forwards and --layers must be >= 1, --retries >= 0, and --width a multiple of --heads")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] and argv[0] in WORKERS:
        return worker_main(RESULT_TAG, WORKERS[argv[0]], argv[1])
    args = parse_args(argv)
    if args.generate:
        os.makedirs(CACHE_DIR, exist_ok=True)
        return run_generate(args, argv)
    t_start = time.perf_counter()
    os.makedirs(CACHE_DIR, exist_ok=True)
    os.makedirs(args.swap_dir, exist_ok=True)
    io_dir = os.path.join(CACHE_DIR, "io")
    logits_dir = os.path.join(CACHE_DIR, f"logits-{os.getpid()}")
    os.makedirs(logits_dir, exist_ok=True)
    model_dir, info = ensure_model(args.layers, args.width, args.heads)
    if info["parameter_bytes"] < MIN_MODEL_TO_BUDGET * args.host_budget_bytes:
        print(f"warning: the parameters ({format_size(info['parameter_bytes'])}) are less than "
              f"{MIN_MODEL_TO_BUDGET} x the host budget ({format_size(args.host_budget_bytes)})", file=sys.stderr)

    system = describe_system([args.swap_dir])
    system["loadavg_start"] = os.getloadavg()
    versions = package_versions("tiermem", "torch", "transformers", "accelerate", "safetensors")
    print_header(system, versions, info, args)

    variants = args.variant_list
    shapes = [shape_name(s) for s in args.shape_list]
    runs: list[dict[str, Any]] = []
    bandwidth: list[dict[str, Any]] = []
    t_measure = time.perf_counter()
    deadline = time.time() + args.gate_seconds - (time.perf_counter() - t_start)
    try:
        for rnd in range(args.rounds):
            try:
                bw = read_bandwidth(io_dir, args.io_size)
                bandwidth.append({"round": rnd, **bw})
                print(f"[{rnd + 1}/{args.rounds}] tiermem io_uring read: "
                      + ", ".join(f"{g:.2f}" for g in bw["gbps_samples"]) + " GB/s", file=sys.stderr, flush=True)
            except RuntimeError as exc:
                bandwidth.append({"round": rnd, "error": str(exc)})
                print(f"[{rnd + 1}/{args.rounds}] bandwidth failed: {exc}", file=sys.stderr, flush=True)
            for v in rotated(variants, rnd):
                spec = {"variant": v.key, "model_dir": model_dir, "shapes": args.shape_list,
                        "forwards": args.forwards, "host_budget": args.host_budget,
                        "prefetch_depth": args.prefetch_depth, "swap_dir": args.swap_dir,
                        "logits_dir": logits_dir, "round": rnd, "retries": args.retries,
                        "quiet_cores": args.quiet_cores, "disturbed_share": args.disturbed_share,
                        "deadline": deadline}
                t0 = time.perf_counter()
                try:
                    out = start_worker("_variant", spec)
                except RuntimeError as exc:
                    out = {"variant": v.key, "error": str(exc)}
                out["round"] = rnd
                runs.append(out)
                took = time.perf_counter() - t0
                if "error" in out:
                    print(f"[{rnd + 1}/{args.rounds}] {v.label:<27} FAILED ({took:.0f} s):\n{out['error']}",
                          file=sys.stderr, flush=True)
                    continue
                shown = "; ".join(
                    f"{sh['shape']} " + " ".join(f"{s['seconds']:.3f}" for s in sh["samples"] if not s["warmup"])
                    for sh in out["shapes"])
                print(f"[{rnd + 1}/{args.rounds}] {v.label:<27} {shown} s; peak RSS "
                      f"{_gb(out['peak_rss_bytes'])} GB ({took:.0f} s)", file=sys.stderr, flush=True)
        measure_s = time.perf_counter() - t_measure
        exact = check_logits(runs)
    finally:
        shutil.rmtree(logits_dir, ignore_errors=True)
        shutil.rmtree(io_dir, ignore_errors=True)

    ok_bw = [b for b in bandwidth if "error" not in b]
    bw_summary = None
    if ok_bw:
        samples = [g for b in ok_bw for g in b["gbps_samples"]]
        m, s = mean_std(samples)
        bw_summary = {"gbps_mean": m, "gbps_std": s, "gbps_samples": samples, "size": args.io_size,
                      "command": ok_bw[0]["command"]}
    summary = summarize(runs, variants, shapes)
    verdict = goals(summary, runs, info["parameter_bytes"], bw_summary["gbps_mean"] if bw_summary else None,
                    args.host_budget_bytes, shapes, exact)
    print_tables(summary, verdict, bw_summary, exact, args.host_budget_bytes)
    system["loadavg_end"] = os.getloadavg()
    wall_s = time.perf_counter() - t_start
    print(f"\nmeasurements took {measure_s:.0f} s; whole run {wall_s:.0f} s; load average "
          f"{system['loadavg_start'][0]:.1f} at the start, {system['loadavg_end'][0]:.1f} at the end")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        for r in runs:
            for sh in r.get("shapes", []):
                sh.pop("logits_file", None)
        report = {
            "command": " ".join(["python3", "bench/infer_offload.py", *argv]),
            "system": system,
            "versions": versions,
            "model": {"class": "GPT2LMHeadModel", "n_layer": args.layers, "n_embd": args.width,
                      "n_head": args.heads, "dir": model_dir, **info},
            "config": {"shapes": shapes, "rounds": args.rounds, "forwards_per_process": args.forwards,
                       "host_budget_bytes": args.host_budget_bytes, "host_budget": args.host_budget,
                       "prefetch_depth": args.prefetch_depth, "swap_dir": args.swap_dir,
                       "order": "per round every variant once in its own process, rotating order; per process "
                                "and shape 1 warm-up + forwards timed, torch.inference_mode(), use_cache=False",
                       "units": "GB = 1e9 bytes, MB = 1e6 bytes, MiB = 2**20 bytes"},
            "bandwidth": {"summary": bw_summary, "rounds": bandwidth},
            "summary": summary,
            "goals": verdict,
            "logits": exact,
            "runs": runs,
            "measure_seconds": measure_s,
            "wall_seconds": wall_s,
        }
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
