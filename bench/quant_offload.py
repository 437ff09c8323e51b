#!/usr/bin/env python3
"""Compressed weights on NVMe (params.storage int8 / int4) against float32 storage and the model in memory:
the I/O-bound forward's time and bytes, and what the rounding costs in logits and greedy tokens.

Speed, side by side in one run: the inference bench's model (GPT-2 medium's shape, random weights, seed 0,
made once by bench/infer_offload.py's code under its CACHE_DIR), built on the meta device and streamed from
its checkpoint by tiermem (`restore=False`, params.tier nvme, io_uring, prefetch, --host-budget) with
params.storage full, int8 and int4, and the model in memory (`from_pretrained`). Each variant runs in its
own subprocess once per round (the order rotates), one untimed warm-up forward of --shape tokens and then
--forwards timed ones under torch.inference_mode(). Each round starts with `tiermem bench io --mode read`
on the swap disk. "read" is tiermem's bytes_read per forward.

Accuracy: the logits of each tiermem variant's last forward against the in-memory model's of the same round
(max |diff| / max |ref| and mean |diff| / mean |ref|), and, in this process, on two transformers
architectures built from configs with random weights (GPT-2 and Llama, --acc-layers x --acc-width): the same
logit figures, and greedy generation of --gen-tokens tokens from one prompt, compressed against full: the
share of positions with the same token and the first position where they differ. Random weights give
flat logits, where greedy choices are close calls; real checkpoints are usually kinder (not measurable here:
no model hub).

    python3 bench/quant_offload.py --json bench/results/quant_offload.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    describe_system,
    engine_bandwidth,
    package_versions,
    print_system_header,
    rotated,
    run_worker,
    worker_main,
    write_json,
)
from infer_offload import CACHE_DIR, ensure_model, meta_model  # noqa: E402

TAG = "QUANT_RESULT "
VARIANTS = ("memory", "full", "int8", "int4")
SEED = 0


def variant_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tiermem

    torch.manual_seed(SEED)
    b, t = spec["shape"]
    ids = torch.randint(0, 50257, (b, t), generator=torch.Generator().manual_seed(1))
    times: list[float] = []
    read: list[int] = []
    with torch.inference_mode():
        if spec["variant"] == "memory":
            from transformers import GPT2LMHeadModel

            model = GPT2LMHeadModel.from_pretrained(spec["model_dir"]).eval()
            model(ids, use_cache=False)
            for _ in range(spec["forwards"]):
                t0 = time.perf_counter()
                logits = model(ids, use_cache=False).logits
                times.append(time.perf_counter() - t0)
        else:
            model = meta_model(spec["model_dir"])
            settings = {"device": "cpu", "params.tier": "nvme", "io.engine": "io_uring",
                        "memory.host_budget": spec["host_budget"], "nvme.paths": [spec["swap_dir"]],
                        "params.storage": spec["variant"]}
            with tiermem.tiered_offload(model, checkpoint=os.path.join(spec["model_dir"], "model.safetensors"),
                                        restore=False, **settings) as tm:
                model(ids, use_cache=False)
                for _ in range(spec["forwards"]):
                    tm.reset_stats()
                    t0 = time.perf_counter()
                    logits = model(ids, use_cache=False).logits
                    times.append(time.perf_counter() - t0)
                    read.append(tm.stats()["bytes_read"])
                nvme = tm.stats()["peak_bytes"]["nvme"]
    torch.save(logits.float(), spec["logits"])
    out: dict[str, Any] = {"seconds": times}
    if read:
        out.update(bytes_read=read, nvme_bytes=nvme)
    return out


def logit_error(got: Any, ref: Any) -> dict[str, float]:
    d = (got - ref).abs()
    return {"max_rel": float(d.max() / ref.abs().max()), "mean_rel": float(d.mean() / ref.abs().mean()),
            "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """Logits and greedy tokens of GPT-2 and Llama (random weights) with int8 and int4 against full storage."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    import tiermem

    L, W = args.acc_layers, args.acc_width
    builds = {"gpt2": (GPT2LMHeadModel, GPT2Config(n_layer=L, n_embd=W, n_head=W // 64, vocab_size=8192)),
              "llama": (LlamaForCausalLM, LlamaConfig(num_hidden_layers=L, hidden_size=W, intermediate_size=4 * W,
                                                      num_attention_heads=W // 64, num_key_value_heads=W // 128,
                                                      vocab_size=8192))}
    out: dict[str, Any] = {}
    for name, (cls, cfg) in builds.items():
        torch.manual_seed(SEED)
        ref = cls(cfg).eval()
        with tempfile.TemporaryDirectory() as d:
            ref.save_pretrained(d)
            ids = torch.randint(0, 8192, (4, 64), generator=torch.Generator().manual_seed(2))
            prompt = ids[:1, :16]
            runs = {}
            for storage in ("full", "int8", "int4"):
                with torch.device("meta"):
                    model = cls(cfg).eval()
                with tiermem.tiered_offload(model, checkpoint=os.path.join(d, "model.safetensors"), restore=False,
                                            **{"device": "cpu", "params.tier": "nvme", "nvme.paths": [d + "/swap"],
                                               "memory.host_budget": "256MiB", "params.storage": storage}):
                    with torch.inference_mode():
                        logits = model(ids, use_cache=False).logits.float()
                        tokens = model.generate(prompt, max_new_tokens=args.gen_tokens, do_sample=False,
                                                pad_token_id=0)[0, prompt.shape[1]:]
                runs[storage] = (logits, tokens)
        entry: dict[str, Any] = {"parameters": sum(p.numel() for p in ref.parameters())}
        for storage in ("int8", "int4"):
            logits, tokens = runs[storage]
            same = (tokens == runs["full"][1]).tolist()
            entry[storage] = {**logit_error(logits, runs["full"][0]), "greedy_same_share": sum(same) / len(same),
                              "greedy_first_difference": same.index(False) if False in same else None}
        out[name] = entry
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for v in VARIANTS:
        mine = [r for r in runs if r["variant"] == v]
        secs = [s for r in mine for s in r["seconds"]]
        entry: dict[str, Any] = {"seconds_mean": statistics.mean(secs),
                                 "seconds_std": statistics.stdev(secs) if len(secs) > 1 else 0.0,
                                 "forwards": len(secs)}
        if v != "memory":
            entry["bytes_read_mean"] = statistics.mean(b for r in mine for b in r["bytes_read"])
            entry["nvme_bytes"] = mine[0]["nvme_bytes"]
            errs = [logit_error(torch.load(r["logits"]), torch.load(m["logits"]))
                    for r in mine for m in runs if m["variant"] == "memory" and m["round"] == r["round"]]
            entry["logits"] = {k: max(e[k] for e in errs) if k != "argmax_agree" else min(e[k] for e in errs)
                               for k in errs[0]}
        out[v] = entry
    full = out["full"]["seconds_mean"]
    for v in ("int8", "int4"):
        out[v]["speedup_vs_full"] = full / out[v]["seconds_mean"]
        out[v]["paired_speedups"] = [
            statistics.mean(f["seconds"]) / statistics.mean(r["seconds"])
            for r in runs if r["variant"] == v for f in runs if f["variant"] == "full" and f["round"] == r["round"]]
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forwards", type=int, default=2)
    p.add_argument("--shape", default="1x8", help="batch x tokens of the timed forward (default 1x8)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--host-budget", default="320MiB")
    p.add_argument("--acc-layers", type=int, default=4)
    p.add_argument("--acc-width", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--swap-dir", default=os.path.join(CACHE_DIR, "swap-quant"))
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    shape = [int(x) for x in args.shape.lower().split("x")]
    os.makedirs(CACHE_DIR, exist_ok=True)
    system = describe_system([args.swap_dir])
    print_system_header("compressed weights on NVMe", system, package_versions("torch", "transformers"))
    model_dir, info = ensure_model(args.layers, args.width, args.heads)
    runs: list[dict[str, Any]] = []
    bandwidth = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as logits_dir:
        for rnd in range(args.rounds):
            bandwidth.append(engine_bandwidth(os.path.join(CACHE_DIR, "io"), "1GiB", modes=("read",)))
            for v in rotated(VARIANTS, rnd):
                spec = {"variant": v, "shape": shape, "forwards": args.forwards, "model_dir": model_dir,
                        "host_budget": args.host_budget, "swap_dir": args.swap_dir,
                        "logits": os.path.join(logits_dir, f"{v}-{rnd}.pt")}
                r = run_worker(__file__, "_variant", spec, tag=TAG, timeout=1800, name=v)
                r.update(variant=v, round=rnd, logits=spec["logits"])
                runs.append(r)
                print(f"round {rnd} {v:>6}: {statistics.mean(r['seconds']):.3f} s/forward"
                      + (f", read {statistics.mean(r['bytes_read']) / 1e9:.3f} GB" if "bytes_read" in r else ""),
                      flush=True)
        summary = summarize(runs)
    acc = accuracy(args)
    read_gbps = statistics.mean(s for b in bandwidth for s in b["read"]["gbps_samples"])
    print(f"\nengine read {read_gbps:.2f} GB/s; {info['parameter_bytes'] / 1e9:.2f} GB of fp32 parameters")
    for v, e in summary.items():
        extra = ""
        if v != "memory":
            extra = (f"  read {e['bytes_read_mean'] / 1e9:.3f} GB ({e['bytes_read_mean'] / e['seconds_mean'] / 1e9:.2f}"
                     f" GB/s)  logits max/mean rel {e['logits']['max_rel']:.4f}/{e['logits']['mean_rel']:.4f}")
        if "speedup_vs_full" in e:
            extra += f"  x{e['speedup_vs_full']:.2f} vs full"
        print(f"{v:>6}: {e['seconds_mean']:.3f} ± {e['seconds_std']:.3f} s/forward{extra}")
    for name, e in acc.items():
        for storage in ("int8", "int4"):
            a = e[storage]
            print(f"{name} ({e['parameters'] / 1e6:.0f}M) {storage}: logits max/mean rel {a['max_rel']:.4f}/"
                  f"{a['mean_rel']:.4f}, argmax agree {a['argmax_agree']:.3f}, greedy same "
                  f"{a['greedy_same_share']:.2f} (first difference at {a['greedy_first_difference']})")
    report = {"system": system, "args": vars(args), "model": info, "engine_read_gbps": read_gbps,
              "summary": summary, "accuracy": acc, "runs": [{k: v for k, v in r.items() if k != "logits"}
                                                           for r in runs],
              "seconds": time.perf_counter() - t_start}
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_variant":
        sys.exit(worker_main(TAG, variant_worker, sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
