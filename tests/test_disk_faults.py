"""Real disk faults under a running offload: an ext4 filesystem shut down mid-run (every later I/O fails with EIO,
as a drive that dropped off the bus), and a small ext4 filesystem that is full, or fills up after entry."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import struct
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from tests import models
from tiermem import tiered_offload
from tiermem.errors import StoreError, TiermemError
from tiermem.offload import RestoreError
from tiermem.store.store import RUN_PREFIX


def _ior(kind: str, nr: int, size: int) -> int:
    """The kernel's _IOR(type, nr, size) (include/uapi/asm-generic/ioctl.h: dir 2 at bit 30, size at 16)."""
    return (2 << 30) | (size << 16) | (ord(kind) << 8) | nr


# linux/ext4.h (not always installed): EXT4_IOC_SHUTDOWN _IOR('X', 125, __u32), the number XFS_IOC_GOINGDOWN and
# F2FS_IOC_SHUTDOWN (linux/f2fs.h) share; NOLOGFLUSH: stop at once, without flushing the journal.
EXT4_IOC_SHUTDOWN = _ior("X", 125, 4)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2
assert EXT4_IOC_SHUTDOWN == 0x8004587D


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def ext4_mount(tmp_path) -> Iterator[Callable[[int], str]]:
    """Makes real ext4 filesystems of a given size on loop devices (`mount = ext4_mount(16 << 20)`); unmounts
    them and detaches their loop devices afterwards, whatever the test did to them."""
    if os.geteuid() != 0:
        pytest.skip("setting up a loop device needs root")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    made: list[tuple[str, str | None]] = []  # (mount point, loop device or None while not mounted)

    def make(size: int) -> str:
        n = len(made)
        image, target = tmp_path / f"ext4-{n}.img", tmp_path / f"ext4-{n}"
        with open(image, "wb") as f:
            f.truncate(size)
        target.mkdir()
        res = _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)])
        if res.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed here: {res.stderr.strip()}")
        res = _run(["losetup", "--find", "--show", str(image)])
        if res.returncode != 0:
            pytest.skip(f"no loop device here: {res.stderr.strip()}")
        dev = res.stdout.strip()
        made.append((str(target), dev))
        res = _run(["mount", "-t", "ext4", dev, str(target)])
        if res.returncode != 0:
            pytest.skip(f"cannot mount ext4 from {dev} here: {res.stderr.strip()}")
        return str(target)

    try:
        yield make
    finally:
        for target, dev in reversed(made):
            if os.path.ismount(target) and _run(["umount", target]).returncode != 0:
                _run(["umount", "-l", target])  # still open somewhere: detached now, freed when closed
            _run(["losetup", "-d", dev])  # after a lazy unmount this only marks it to go when released


def shut_down(mount: str) -> None:
    """EXT4_IOC_SHUTDOWN on the filesystem at `mount`: from now on its reads and writes fail with EIO."""
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    except OSError as exc:
        if exc.errno in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL):
            pytest.skip(f"this kernel's ext4 has no EXT4_IOC_SHUTDOWN: {exc.strerror}")
        raise
    finally:
        os.close(fd)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def cfg(swap: str, **extra: Any) -> dict[str, Any]:
    out = {"device": "cpu", "params.tier": "nvme", "nvme.paths": [swap], "memory.host_budget": "384KiB",
           "wrap.min_unit_bytes": "16KiB", "io.block_size": "256KiB"}
    out.update(extra)
    return out


def build(width: int = 32, vocab: int = 100) -> nn.Module:
    model = models.gpt2(layers=2, width=width, vocab=vocab)
    model.config.use_cache = False
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
    return model.train()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def batches(n: int) -> list[torch.Tensor]:
    return [torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(n)]


def reference(data: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The parameters of the same model trained in memory: after 0, 1, ... len(data) steps."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = [snapshot(model)]
    for ids in data:
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
        out.append(snapshot(model))
    return out


def train_step(tm: Any, model: nn.Module, ids: torch.Tensor) -> None:
    tm.optimizer.zero_grad()
    tm.backward(model(ids, labels=ids).loss)
    tm.optimizer.step()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_a_disk_shut_down_mid_run_is_a_clear_error_and_loses_only_what_was_on_it(ext4_mount, where: str) -> None:
    """ext4 shut down in the forward, backward or step of a training run: a StoreError naming the partition and the
    swap file; leaving neither hangs nor leaks a thread, and raises one RestoreError naming exactly the parameters
    whose units were not in host memory, every other parameter coming back with its value."""
    mount = ext4_mount(16 << 20)
    data = batches(3)
    refs = reference(data)
    threads = threading.active_count()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # gradients on NVMe too: the forward, the backward and the step each read units from the disk
    run = cfg(os.path.join(mount, "swap"), **{"grads.tier": "nvme", "memory.host_budget": "256KiB"})
    errors: list[BaseException] = []
    hook = None
    caught: RestoreError | None = None
    try:
        with tiered_offload(model, optimizer=opt, **run) as tm:
            for ids in data[:2]:
                train_step(tm, model, ids)
            moved = tm.stats()
            assert moved["bytes_read"] > 0 and moved["bytes_written"] > 0  # units really went to and came back
            with tm.gathered():
                before = snapshot(model)
            for name, value in refs[2].items():  # the run so far is plain PyTorch's, exactly
                assert torch.equal(before[name], value), name
            steps = {fqn: n for st in tm.optimizer.units for fqn, n in st.steps.items()}

            ids = data[2]
            try:
                tm.optimizer.zero_grad()
                if where == "forward":  # in the middle of the forward: block 0 done, block 1 not
                    hook = model.transformer.h[1].register_forward_pre_hook(lambda *_: shut_down(mount))
                    loss = model(ids, labels=ids).loss
                else:
                    loss = model(ids, labels=ids).loss
                if where == "backward":  # when backward starts
                    loss.register_hook(lambda g: (shut_down(mount), g)[1])
                tm.backward(loss)
                if where == "step":  # after the first unit's update
                    update = tm.optimizer._update_unit
                    calls = {"n": 0}

                    def update_then_shut_down(st: Any) -> None:
                        update(st)
                        calls["n"] += 1
                        if calls["n"] == 1:
                            shut_down(mount)

                    tm.optimizer._update_unit = update_then_shut_down
                tm.optimizer.step()
            except TiermemError as exc:
                errors.append(exc)
            finally:
                if hook is not None:
                    hook.remove()
            try:  # using the model again: the same kind of error, not a hang or a broken state
                with torch.no_grad():
                    model(ids)
            except TiermemError as exc:
                errors.append(exc)
            on_host = {fqn for u in tm.units if tm.swapper.holds_host(u.partition) for fqn, _ in u.params}
            after = {fqn: n for st in tm.optimizer.units for fqn, n in st.steps.items()}
    except RestoreError as exc:
        caught = exc

    names = {n for n, _ in model.named_parameters()}
    print("\nOBS", where, [str(e)[:300] for e in errors], "lost", sorted(names - on_host), "caught", str(caught)[:300], "steps", steps, after)
    lost = names - on_host
    assert errors, "the disk was needed after it went down, and nothing said so"
    for err in errors:
        assert isinstance(err, StoreError), repr(err)
        assert mount in str(err) and "Input/output error" in str(err), str(err)
        assert re.search(r"partition '[^']+'", str(err)), str(err)
    if lost:
        assert caught is not None and set(caught.failed) == lost
        assert all(model.get_parameter(n).is_meta for n in lost)
    else:
        assert caught is None
    for name, p in model.named_parameters():
        if name in lost:
            continue
        assert p.device.type == "cpu" and not p.is_meta, name
        # a parameter keeps the value of the last update it got: plain PyTorch's after that many steps
        expected = before[name] if after.get(name) == steps.get(name) else refs[after[name]][name]
        assert torch.equal(p.detach(), expected), name
    assert threading.active_count() == threads
