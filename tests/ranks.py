"""Run a function on N ranks of a real torch.distributed process group (gloo, on the CPU), each in a process
of its own, as torchrun would: a test tool. A rank that raises fails the call with that rank's traceback."""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def _entry(rank: int, world: int, fn: Callable[..., Any], folder: str, args: tuple[Any, ...],
           timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(rank), str(world), str(rank)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, Path(folder), *args)
    except BaseException:
        Path(folder, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, folder: Path, *args: Any, timeout_s: float = 60) -> None:
    """Call fn(rank, world, folder, *args) on `world` ranks; `fn` must be importable (a module-level function)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        mp.start_processes(_entry, args=(world, fn, str(folder), args, timeout_s), nprocs=world,
                           start_method="spawn")
    except mp.ProcessRaisedException as exc:
        errors = sorted(folder.glob("rank*.error"))
        detail = "\n".join(f"--- {e.name}\n{e.read_text()}" for e in errors)
        raise AssertionError(f"a rank failed:\n{detail or exc}") from None
