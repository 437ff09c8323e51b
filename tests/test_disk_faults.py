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
    made: list[tuple[str, str]] = []  # (mount point, loop device) of each filesystem made

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


def gathered_snapshot(tm: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's value inside the context, read through tm.gathered() one unit at a time (a host budget
    smaller than the model cannot gather it whole)."""
    out: dict[str, torch.Tensor] = {}
    for unit in tm.units:
        owners = {model.get_submodule(fqn.rpartition(".")[0]) for fqn, _ in unit.params}
        with tm.gathered(*owners):
            out.update((fqn, model.get_parameter(fqn).detach().clone()) for fqn, _ in unit.params)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["inference", "forward", "backward", "step"])
def test_a_disk_shut_down_mid_run_is_a_clear_error_and_loses_only_what_was_on_it(ext4_mount, compute_device,
                                                                                   where: str) -> None:
    """ext4 shut down mid-run: a StoreError naming partition and file; exit restores all but units only on disk."""
    mount = ext4_mount(16 << 20)
    data = batches(3)
    training = where != "inference"
    refs = reference(data) if training else [snapshot(build())]  # the values after 0, 1, ... steps
    threads = threading.active_count()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if training else None
    # Inference: a budget below the parameters (130 KB), so every forward reads units. Training: gradients on NVMe
    # too, so the forward, the backward and the update each read from the disk.
    budget = {"memory.host_budget": "384KiB", "grads.tier": "nvme"} if training else {"memory.host_budget": "96KiB"}
    errors: list[BaseException] = []
    caught: RestoreError | None = None
    steps: dict[str, int] = {}  # optimizer steps per parameter when the disk goes down, and when leaving
    after: dict[str, int] = {}
    try:
        with tiered_offload(model, optimizer=opt, **cfg(os.path.join(mount, "swap"), **budget)) as tm:
            for ids in data[:2]:
                if training:
                    train_step(tm, model, ids)
                else:
                    with torch.no_grad():
                        model(ids)
            moved = tm.stats()
            assert moved["bytes_read"] > 0 and (moved["bytes_written"] > 0 or not training)  # the disk is in use
            before = gathered_snapshot(tm, model)
            for name, value in refs[2 if training else 0].items():  # so far it is plain PyTorch's, exactly
                assert torch.equal(before[name], value), name
            if training:
                steps = {fqn: n for st in tm.optimizer.units for fqn, n in st.steps.items()}
            else:
                with torch.no_grad():  # writes back what gathered() marked changed, as the units leave
                    model(data[0])
            ids = data[2]
            hook = None
            try:
                if where in ("inference", "forward"):  # block 0 done, block 1 not
                    hook = model.transformer.h[1].register_forward_pre_hook(lambda *_: shut_down(mount))
                if not training:
                    with torch.no_grad():
                        model(ids)
                else:
                    tm.optimizer.zero_grad()
                    loss = model(ids, labels=ids).loss
                    if where == "backward":  # as backward starts
                        loss.register_hook(lambda g: (shut_down(mount), g)[1])
                    tm.backward(loss)
                    if where == "step":  # after the first unit's update
                        update, updates = tm.optimizer._update_unit, []

                        def update_then_shut_down(st: Any, *how: Any) -> None:
                            update(st, *how)
                            updates.append(st)
                            if len(updates) == 1:
                                shut_down(mount)

                        tm.optimizer._update_unit = update_then_shut_down
                    tm.optimizer.step()
            except TiermemError as exc:
                errors.append(exc)
            finally:
                if hook is not None:
                    hook.remove()
            try:  # the model used again: the same kind of error, not a hang or a broken state
                with torch.no_grad():
                    model(ids)
            except TiermemError as exc:
                errors.append(exc)
            on_host = {fqn for u in tm.units if u.partition.has_host_bytes() for fqn, _ in u.params}
    except RestoreError as exc:
        caught = exc
    except StoreError as exc:  # leaving applies what step() recorded: the disk fails it, after the restore
        errors.append(exc)
    if training:  # the updates applied, including any leaving applied
        after = {fqn: n for st in tm.optimizer.units for fqn, n in st.steps.items()}

    lost = {n for n, _ in model.named_parameters()} - on_host
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
        # the value of the last update it got: plain PyTorch's after that many steps (the snapshot if none)
        expected = before[name] if after.get(name) == steps.get(name) else refs[after[name]][name]
        assert torch.equal(p.detach(), expected), name
    assert threading.active_count() == threads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["parameters", "optimizer state"])
def test_a_full_disk_at_entry_is_a_clear_error_and_changes_nothing(ext4_mount, what: str) -> None:
    """A disk too small: StoreError at entry with needed and free bytes; nothing is changed or left behind."""
    mount = ext4_mount(8 << 20)
    swap = os.path.join(mount, "swap")
    os.mkdir(swap, 0o700)
    free = free_bytes(mount)
    # width 256: 7.4 MB of parameters, more than the 6.3 MiB free; width 160: 2.7 MB fit, 5.4 MB of state do not
    model = build(width=256 if what == "parameters" else 160)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if what == "optimizer state" else None
    before = snapshot(model)
    threads = threading.active_count()
    with pytest.raises(StoreError) as caught:
        with tiered_offload(model, optimizer=opt, **cfg(swap, **{"memory.host_budget": "16MiB"})):
            pytest.fail("entered with too little disk")
    msg = str(caught.value)
    found = re.search(r"no space for (\d+) bytes .*, (\d+) bytes \([^)]*\) free", msg)
    assert mount in msg and found, msg
    needed, had = int(found[1]), int(found[2])
    assert had < needed and had <= free
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p.detach(), before[name]), name
    if opt is not None:
        assert not opt.state and "step" not in opt.__dict__  # untouched, and its own step() again
    assert not hasattr(model, "_tiermem_offload")
    assert os.listdir(swap) == []
    assert abs(free_bytes(mount) - free) <= 16 << 10  # a few blocks of directory metadata at most
    assert threading.active_count() == threads


def fill(mount: str) -> str:
    """Write a file on `mount` until the filesystem has no free block left; return its path."""
    path = os.path.join(mount, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for chunk in (1 << 20, 64 << 10, 4 << 10, 1 << 10):
            block = b"\xa5" * chunk
            while True:
                try:
                    os.write(fd, block)
                    os.fsync(fd)  # blocks are taken at write-back (delayed allocation): ENOSPC shows here
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return path


@pytest.mark.timeout(60)
def test_a_disk_filled_by_another_file_after_entry_does_not_stop_training(ext4_mount) -> None:
    """A disk filled by another file after entry: training goes on, bit-exactly, in the preallocated swap."""
    mount = ext4_mount(16 << 20)
    swap = os.path.join(mount, "swap")
    data = batches(4)
    refs = reference(data)
    threads = threading.active_count()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tiered_offload(model, optimizer=opt, **cfg(swap, **{"grads.tier": "nvme"})) as tm:
        train_step(tm, model, data[0])
        fill(mount)
        assert free_bytes(mount) < 4 << 10
        tm.reset_stats()
        for ids in data[1:]:
            train_step(tm, model, ids)
        moved = tm.stats()
        assert moved["bytes_read"] > 0 and moved["bytes_written"] > 0  # the full disk was written and read
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), refs[4][name]), name
    assert os.listdir(swap) == []
    assert threading.active_count() == threads


def leave_with_a_dead_disk(ext4_mount: Callable[[int], str]) -> tuple[set[str], RestoreError, nn.Module]:
    """Inference without prefetch under a budget that holds two of the three units: the two blocks are used last,
    so the embeddings' unit is the one on disk only; the disk is shut down, then the context left. Returns the
    parameters whose bytes were in host memory at that point, the RestoreError and the model."""
    mount = ext4_mount(16 << 20)
    model = build().eval()
    ids = batches(1)[0]
    with pytest.raises(RestoreError) as caught:
        with tiered_offload(model, prefetch=False, **cfg(os.path.join(mount, "swap"), **{
                "memory.host_budget": "120KiB"})) as tm:
            with torch.no_grad():
                model(ids)
                hidden = torch.zeros(2, 8, 32)
                model.transformer.h[1](hidden)
                model.transformer.h[0](hidden)
            on_host = {fqn for u in tm.units if u.partition.has_host_bytes() for fqn, _ in u.params}
            shut_down(mount)
    return on_host, caught.value, model


@pytest.mark.timeout(60)
def test_leaving_with_a_dead_disk_gives_back_what_it_names_as_restored(ext4_mount) -> None:
    """Dead disk at exit: every parameter the RestoreError does not name comes back with its value."""
    before = snapshot(build())
    threads = threading.active_count()
    on_host, err, model = leave_with_a_dead_disk(ext4_mount)
    names = {n for n, _ in model.named_parameters()}
    assert on_host and on_host < names  # the case set up: some in host memory, some not
    assert names - on_host <= set(err.failed)
    assert all(isinstance(e, StoreError) and "Input/output error" in str(e) for e in err.failed.values())
    for name, p in model.named_parameters():
        if name in err.failed:
            assert p.is_meta, name
        else:
            assert torch.equal(p.detach(), before[name]), name
    assert threading.active_count() == threads


@pytest.mark.timeout(60)
def test_leaving_with_a_dead_disk_loses_only_the_units_not_in_host_memory(ext4_mount) -> None:
    """Dead disk at exit: the RestoreError names exactly the parameters whose units were not in host memory."""
    on_host, err, model = leave_with_a_dead_disk(ext4_mount)
    assert set(err.failed) == {n for n, _ in model.named_parameters()} - on_host


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["shut down", "full"])
def test_a_disk_that_fails_as_the_optimizer_shard_begins_is_a_checkpoint_error(ext4_mount, monkeypatch,
                                                                               fault: str) -> None:
    """The checkpoint's disk shut down (every I/O then fails with EIO) or filled up just as the save begins the
    optimizer shard: a CheckpointError naming the shard and the drive's error, with what to do (before, for EIO,
    a bare OSError that `except TiermemError` did not catch); no descriptor or thread is left, and training and
    saving elsewhere go on, the checkpoint equal to one saved with no fault."""
    from tiermem.errors import CheckpointError
    from tiermem.runtime import safetensors_io

    mount = ext4_mount(16 << 20)
    data = batches(3)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    threads = threading.active_count()
    real_init = safetensors_io.SafetensorsWriter.__init__

    def begin(self: Any, path: str, *args: Any, **kwargs: Any) -> None:
        if os.path.basename(path).startswith("optimizer-"):
            shut_down(mount) if fault == "shut down" else fill(mount)
        real_init(self, path, *args, **kwargs)

    swap = os.path.join(os.path.dirname(mount), "swap")  # beside the disk, not on it
    with tiered_offload(model, optimizer=opt, **cfg(swap)) as tm:
        train_step(tm, model, data[0])
        descriptors = _descriptors()
        monkeypatch.setattr(safetensors_io.SafetensorsWriter, "__init__", begin)
        with pytest.raises(TiermemError) as caught:
            tm.save_checkpoint(os.path.join(mount, "ckpt"))
        monkeypatch.undo()
        assert isinstance(caught.value, CheckpointError), repr(caught.value)
        error = "Input/output error" if fault == "shut down" else "No space left on device"
        fix = "The drive failed or went away" if fault == "shut down" else "Free space on that drive"
        assert re.search(rf"{mount}/ckpt\.tmp-\d+/optimizer-00001-of-00001\.safetensors: writing failed "
                         rf"\([^)]*{error}\).*{fix}", str(caught.value)), str(caught.value)
        assert _descriptors() <= descriptors
        train_step(tm, model, data[1])
        tm.save_checkpoint(os.path.dirname(mount) + "/elsewhere")
        with tm.gathered():
            trained = snapshot(model)
    assert threading.active_count() == threads
    for name, value in reference(data[:2])[2].items():
        assert torch.equal(trained[name], value), name
