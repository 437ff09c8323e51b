"""`tiermem demo`: a GPT-2-shaped transformer several times larger than the host budget, generating text
from NVMe, with execution-order prefetch and without it, side by side; then a GPT whose Adam training
state is several times the host budget, trained for a few steps from NVMe, ending with a checkpoint.

Both models are built on the meta device (no weights in RAM) and streamed from a safetensors checkpoint
straight into swap files; only the host budget's worth of parameters is ever in memory. Each checkpoint
is made once, in a child process, and cached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

from tiermem.cli.progress import ProgressBar
from tiermem.sizes import format_size, parse_size

DEFAULT_DIR = "/var/tmp/tiermem-demo"


def model_config(layers: int, width: int, *, train: bool = False) -> Any:
    """GPT-2's shape for generation; for training a smaller vocabulary and context, dropout off."""
    from transformers import GPT2Config

    if train:
        return GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=8192, n_positions=256,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                          use_cache=False)
    return GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=50257, n_positions=1024,
                      bos_token_id=50256, eos_token_id=50256, pad_token_id=50256)


def make_checkpoint(folder: str, layers: int, width: int, *, train: bool = False) -> str:
    """Save a randomly initialised model (in this process) as safetensors; return the weights path."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(model_config(layers, width, train=train)).save_pretrained(folder)
    return folder


def ensure_checkpoint(folder: str, layers: int, width: int, *, train: bool = False) -> str:
    """The cached checkpoint for this shape, made in a child process so this one never holds the model."""
    tag = os.path.join(folder, f"{'gpt-train' if train else 'gpt2'}-{layers}x{width}")
    weights = os.path.join(tag, "model.safetensors")
    index = os.path.join(tag, "model.safetensors.index.json")
    if not (os.path.exists(weights) or os.path.exists(index)):
        print(f"making a random {layers}-layer, {width}-wide checkpoint in {tag} (once)", file=sys.stderr)
        os.makedirs(folder, exist_ok=True)
        subprocess.run([sys.executable, "-m", "tiermem.demo", "--make-checkpoint", tag, "--layers", str(layers),
                        "--width", str(width), *(["--train-shape"] if train else [])], check=True,
                       stdout=sys.stderr)  # what it prints is a notice: stdout stays the demo's (--json)
    return index if os.path.exists(index) else weights


def _token_ids(shape: tuple[int, ...], vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    """Random token ids from a seeded CPU generator (so every device gets the same ids), placed on `device`,
    the compute device the model's parameters are bound on (`tm.device`)."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS mark of this process (Linux: /proc/self/clear_refs), where it can."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status_kib(field: str) -> int:
    """A KiB figure of /proc/self/status (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _peak_rss() -> int:
    """Peak RSS since the last reset (VmHWM), else since the process started (ru_maxrss)."""
    return _status_kib("VmHWM") * 1024 or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _TokenProgress:
    """A transformers streamer that advances a progress bar per generated token."""

    def __init__(self, total: int, label: str) -> None:
        self.bar = ProgressBar()
        self.total, self.label, self.count = total, label, -1

    def put(self, value: torch.Tensor) -> None:
        self.count += 1  # the first put is the prompt
        self.bar(max(self.count, 0), self.total, self.label)

    def end(self) -> None:
        self.bar.close()


def run(args: argparse.Namespace) -> int:
    status = 0
    figures: dict[str, Any] = {}
    # with --json the JSON is all of stdout: whatever else prints there (a library's notices) goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        if args.only in (None, "infer"):
            status |= run_inference(args, figures)
        if args.only in (None, "train"):
            status |= run_training(args, figures)
    if args.json:
        print(json.dumps(figures, indent=2))
    return status


def run_training(args: argparse.Namespace, figures: dict[str, Any]) -> int:
    """Train a GPT whose Adam state is several times the host budget, from NVMe; save a checkpoint. As with a
    model larger than RAM, it is built on the meta device and streamed from its checkpoint (made once)."""
    from transformers import GPT2LMHeadModel

    import tiermem

    budget = parse_size(args.train_budget, what="--train-budget")
    weights = ensure_checkpoint(os.path.join(args.dir, "checkpoints"), args.train_layers, args.train_width,
                                train=True)
    with torch.device("meta"):
        model = GPT2LMHeadModel(model_config(args.train_layers, args.train_width, train=True)).train()
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = n_params * 16  # fp32 weights, gradients and two Adam moments
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)  # on the meta parameters
    swap = os.path.join(args.dir, "swap-train")
    ckpt = os.path.join(args.dir, "train-checkpoint")
    overrides: dict[str, Any] = {"device": "auto", "params.tier": "nvme", "optimizer.tier": "nvme",
                                 "nvme.paths": [swap], "memory.host_budget": budget}
    times, losses = [], []
    # restore=False: the trained weights are in the checkpoint saved below; the model ends on the meta device
    with tiermem.tiered_offload(model, checkpoint=weights, optimizer=opt, restore=False, **overrides) as tm:
        plan = tm.plan_summary()
        if not args.json:
            print(f"plan: {plan}")
        batch = _token_ids((2, 128), 8192, 3, tm.device)
        data = [batch] * args.train_steps  # one batch again and again: the falling loss shows that updates land
        tm.reset_stats()
        optimizer = tm.optimizer
        assert optimizer is not None
        _reset_peak_rss()
        bar = ProgressBar()
        for step, ids in enumerate(data):
            t0 = time.perf_counter()
            loss = model(ids, labels=ids).loss
            tm.backward(loss)
            tm.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            bar(step + 1, len(data), f"training step {step + 1}/{len(data)}  loss {losses[-1]:.3f}")
        bar.close()
        steps_rss = _peak_rss()
        s = tm.stats()
        saved = tm.save_checkpoint(ckpt)
        _reset_peak_rss()
        entry_rss = _status_kib("VmRSS") * 1024
    exit_rss = _peak_rss()  # leaving: the swap goes; the weights and optimizer state are in the checkpoint
    peak = s["peak_bytes"]
    steady = times[1:] or times
    moved = s["bytes_read"] + s["bytes_written"]
    figures["training"] = {
        "layers": args.train_layers, "width": args.train_width, "parameters": n_params, "state_bytes": state_bytes,
        "host_budget": budget, "plan": plan, "step_seconds": sum(steady) / len(steady), "first_step_seconds": times[0],
        "losses": losses, "bytes_read": s["bytes_read"], "bytes_written": s["bytes_written"],
        "stall_seconds": s["stall_seconds"], "peak_bytes": peak, "steps_peak_rss_bytes": steps_rss,
        "exit_rss_before_bytes": entry_rss, "exit_peak_rss_bytes": exit_rss, "checkpoint": saved}
    if not args.keep:
        shutil.rmtree(swap, ignore_errors=True)
    if args.json:
        return 0
    print(f"\nGPT training: {args.train_layers} layers x {args.train_width}, {n_params / 1e6:.1f}M parameters, "
          f"Adam training state {format_size(state_bytes)} = {state_bytes / budget:.1f}x the host budget "
          f"({format_size(budget)}); params and optimizer state on NVMe in {swap}")
    print(f"step time {sum(steady) / len(steady):.2f} s (first step {times[0]:.2f} s), losses "
          f"{' '.join(f'{x:.3f}' for x in losses)}")
    print(f"moved {format_size(moved / len(times))} per step (read {format_size(s['bytes_read'])}, written "
          f"{format_size(s['bytes_written'])} in all), stall {s['stall_seconds']:.2f} s")
    print(f"peak device {format_size(peak['device'])}, peak host {format_size(peak['host'])}, NVMe "
          f"{format_size(peak['nvme'])}; peak RSS of this process during the steps {format_size(steps_rss)}; "
          f"leaving the context took it from {format_size(entry_rss)} to a peak of {format_size(exit_rss)}")
    print(f"checkpoint written to {saved} (weights and optimizer state; the weights load with transformers' "
          "from_pretrained)")
    return 0


def run_inference(args: argparse.Namespace, figures: dict[str, Any]) -> int:
    """Generate with a GPT-2-shaped model several times the host budget, with and without prefetch."""
    from transformers import GPT2LMHeadModel

    import tiermem

    budget = parse_size(args.host_budget, what="--host-budget")
    ckpt = ensure_checkpoint(os.path.join(args.dir, "checkpoints"), args.layers, args.width)
    swap = os.path.join(args.dir, "swap")
    results = []
    for prefetch in (True, False):
        with torch.device("meta"):
            model = GPT2LMHeadModel(model_config(args.layers, args.width)).eval()
        params = sum(p.numel() * 4 for p in model.parameters())
        overrides = {"device": "auto", "params.tier": "nvme", "nvme.paths": [swap], "memory.host_budget": budget,
                     "prefetch.depth": args.depth}
        label = "with prefetch" if prefetch else "without prefetch"
        with tiermem.tiered_offload(model, checkpoint=ckpt, restore=False, prefetch=prefetch, **overrides) as tm:
            ids = _token_ids((1, args.prompt), 50257, 1, tm.device)
            with torch.no_grad():
                model(ids[:, :4])  # records the execution order
            tm.reset_stats()
            streamer = _TokenProgress(args.tokens, label)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                 min_new_tokens=args.tokens, do_sample=False, streamer=streamer)
            elapsed = time.perf_counter() - t0
            s = tm.stats()
        results.append((label, args.tokens / elapsed, elapsed, s, out))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    same = torch.equal(results[0][4], results[1][4])
    if not args.keep:
        shutil.rmtree(swap, ignore_errors=True)
    figures["inference"] = {
        "layers": args.layers, "width": args.width, "parameter_bytes": params, "host_budget": budget,
        "tokens": args.tokens, "runs": [
            {"run": label, "tokens_per_second": tps, "seconds": elapsed, "bytes_read": s["bytes_read"],
             "stall_seconds": s["stall_seconds"], "prefetch_misses": s["prefetch_misses"],
             "peak_bytes": s["peak_bytes"]}
            for label, tps, elapsed, s, _ in results],
        "peak_rss_bytes": rss, "same_tokens": same, "prefetch_speedup": results[0][1] / results[1][1]}
    if args.json:
        return 0 if same else 1
    print(f"\nGPT-2-shaped model: {args.layers} layers x {args.width}, {format_size(params)} of fp32 parameters, "
          f"host budget {format_size(budget)} ({params / budget:.1f}x smaller), swap in {swap}")
    print(f"{'':<18}{'tokens/s':>9}{'time':>8}{'read':>11}{'stall':>8}{'misses':>8}{'peak device':>13}"
          f"{'peak host':>11}{'nvme':>11}")
    for label, tps, elapsed, s, _ in results:
        peak = s["peak_bytes"]
        print(f"{label:<18}{tps:>9.2f}{elapsed:>7.1f}s{format_size(s['bytes_read']):>11}"
              f"{s['stall_seconds']:>7.1f}s{s['prefetch_misses']:>8}{format_size(peak['device']):>13}"
              f"{format_size(peak['host']):>11}{format_size(peak['nvme']):>11}")
    print(f"peak RSS of this process: {format_size(rss)}; both runs generated the same tokens: {same}")
    print(f"speed-up from prefetch: {results[0][1] / results[1][1]:.2f}x")
    return 0 if same else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"checkpoint cache and swap directory (default {DEFAULT_DIR})")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--host-budget", default="320MiB", help="memory.host_budget (default 320MiB)")
    p.add_argument("--depth", type=int, default=2, help="prefetch.depth")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=12, help="tokens to generate")
    p.add_argument("--keep", action="store_true", help="keep the swap directories")
    p.add_argument("--only", choices=["infer", "train"], default=None, help="run one part of the demo")
    p.add_argument("--train-layers", type=int, default=12)
    p.add_argument("--train-width", type=int, default=768)
    p.add_argument("--train-budget", default="512MiB", help="memory.host_budget for training (default 512MiB)")
    p.add_argument("--train-steps", type=int, default=4)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of the summary")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiermem.demo")
    add_arguments(p)
    p.add_argument("--make-checkpoint", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--train-shape", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.layers, args.width, train=args.train_shape)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
