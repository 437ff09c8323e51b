"""Run a function on N ranks of a real torch.distributed process group, each in a process of its own, as
torchrun would: a test tool. A rank that raises fails the call with that rank's traceback.

Two backends: "gloo" on the CPU, and "strict" (tests/strict_group.py), which refuses host tensors as NCCL
does, with the copying test device open in each rank, so tiermem's units and collectives are in device memory
there as on GPUs. Tests take the `rank_backend` fixture (tests/conftest.py) to run on both."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

BACKENDS = ("gloo", "strict")
# Ranks start from a fork server that has imported these once (a rank spawned afresh spent about 4 of its
# 5-10 s importing them); it starts at the first run_ranks, with the environment of that moment.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "transformers.models.gpt2.modeling_gpt2",
                                        "tiermem", "tests.ranks", "tests.strict_group"])


def _entry(rank: int, world: int, fn: Callable[..., Any], folder: str, args: tuple[Any, ...],
           timeout_s: float, backend: str) -> None:
    import torch
    import torch.distributed as dist

    from tests import strict_group
    from tiermem.device import copying_device

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(rank), str(world), str(rank)
    if backend == "strict":
        strict_group.register()
    dist.init_process_group(strict_group.NAME if backend == "strict" else "gloo",
                            init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        with copying_device() if backend == "strict" else contextlib.nullcontext():
            fn(rank, world, Path(folder), *args)
    except BaseException:
        Path(folder, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, folder: Path, *args: Any, timeout_s: float = 60,
              backend: str = "gloo") -> None:
    """Call fn(rank, world, folder, *args) on `world` ranks of `backend` (one of BACKENDS); `fn` must be
    importable (a module-level function)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        mp.start_processes(_entry, args=(world, fn, str(folder), args, timeout_s, backend), nprocs=world,
                           start_method="forkserver")
    except mp.ProcessRaisedException as exc:
        errors = sorted(folder.glob("rank*.error"))
        detail = "\n".join(f"--- {e.name}\n{e.read_text()}" for e in errors)
        raise AssertionError(f"a rank failed:\n{detail or exc}") from None
