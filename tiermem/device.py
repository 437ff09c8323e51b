"""The compute device: resolving the config's `device`, and the copying test device's bookkeeping.

# [Note: copying test device]
A CPU-only machine cannot show the bugs that come from confusing device and host memory, since they are
the same memory there. `copying_device()` (a switch for the tests and bench/gpu_check.py, not a user
setting) makes every swapper whose device is the CPU use `CopyingMover` (swap/transfers.py): a
partition's bytes are copied into a separate tensor per transfer, made by `copy_device_empty`, whose
memory is counted while it is alive (its owner goes with the last view of it). A test can then compare
the ledger's device bytes with the bytes really alive, and `check_host` (called where only host memory
may go: the optimizer's update, the I/O engine, checkpoints) raises when a device tensor arrives there,
as CUDA's device mismatch would.

# [Note: as strict as a GPU]
The copying device is only worth its keep where it is at least as strict as CUDA, so it copies and runs
backward the way a GPU does:
- Copies are asynchronous. Each mover has a copy stream (`CopyStream`): a thread that makes the copies
  in submission order, some after a seeded random delay, and sets the copy's event (`CopyEvent`) when it
  has landed. Until then the destination holds a poison pattern (every byte 0xFF: NaN in every floating
  dtype, -1 in every signed integer one), so a destination read before its event is waited on gives NaN,
  and the source's checksum taken at submission is checked again when the copy is made, so a source
  written (or handed back to the host pool and refilled) before its copy completed is a `CopyRaceError`,
  raised by the event's `synchronize()` and kept in `CopyingDevice.faults` for the tests to check. A source
  that an earlier copy on the same stream still writes is fingerprinted once that copy has landed, as stream
  order allows. The stream keeps both tensors until the copy lands (as CUDA's allocator keeps memory a
  stream still uses) and makes it under the caller's inference mode (CUDA enqueues from the caller).
- Backward runs on another thread. CUDA's autograd engine runs a CUDA graph's backward (hooks, and the
  unpacking of saved tensors) on its own device thread while the caller waits in C++, so thread-local
  state set in forward is absent there and a signal is handled by the caller only once backward returns.
  PyTorch has no setting that makes the CPU engine do so, so while the copying device is open
  `torch.autograd`'s call into the engine is routed through a new thread, the caller waiting on it and
  holding back every signal that has a Python handler until it ends (`_backward_on_device_thread`); the
  thread gets the caller's grad mode, Python dispatch and function modes and context, as CUDA's engine hands
  its device thread the caller's thread-local state. This is the one place tiermem replaces a torch
  function, and only under this switch for tests, never for a user.
- It can have a capacity: allocations past it raise torch.OutOfMemoryError, and `free_bytes()` answers what
  `torch.cuda.mem_get_info` answers on CUDA.
"""

from __future__ import annotations

import contextvars
import queue
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
import torch.autograd
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from tiermem.errors import ConfigError, CopyRaceError, DeviceMismatchError


def resolve_device(spec: str) -> torch.device:
    """The compute device for a config's `device` value (auto | cpu | cuda | cuda:N)."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {spec!r} but CUDA is not available here; set device: auto or cpu")
        dev = torch.device(spec)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device: {spec!r} but only {torch.cuda.device_count()} CUDA device(s) exist; "
                              "pick one of them")
        return torch.device("cuda", index)
    return torch.device("cpu")


class _Block:
    """Owns one copying-device allocation; counted alive until the last tensor over it is freed."""

    __slots__ = ("nbytes", "address", "__weakref__")

    def __init__(self, nbytes: int, address: int) -> None:
        self.nbytes = nbytes
        self.address = address
        _DEVICE.added(self)

    def __del__(self) -> None:
        _DEVICE.freed(self)


class _OwnedArray(np.ndarray):
    """A numpy array that keeps its `_Block` alive (torch.from_numpy keeps the array alive)."""

    block: _Block


class CopyingDevice:
    """Every live copying-device allocation: bytes now and at peak, and which storages are device memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.enabled = 0  # nesting of copying_device(); swappers made while > 0 copy
        self.live: dict[int, int] = {}  # storage address -> bytes, of every live device allocation
        self.live_bytes = 0  # the sum of `live`: what a test compares with the ledger's device bytes
        self.peak_bytes = 0  # the most `live_bytes` since reset_peak()
        self.faults: list[CopyRaceError] = []  # races the copy streams caught; a test fails on any
        self.seed = 0  # the copy streams' delays come from here (each stream its own Random, seeded in turn)
        # a copy lands after a delay drawn from `delay_s`, for a `delayed` share of the copies (the others at once):
        # long windows for races to show in, at a tenth of the time every copy delayed took ([Note: as strict as a GPU])
        self.delay_s = (0.0002, 0.003)
        self.delayed = 0.15
        self.streams_made = 0  # streams made so far: the next one's seed is `seed + streams_made`
        self.backward_threads = 0  # backward passes run on a device thread (a test checks it happened)
        self.capacity: int | None = None  # the device's memory, as a card's (None: unbounded)

    def added(self, block: _Block) -> None:
        with self._lock:
            self.live[block.address] = block.nbytes
            self.live_bytes += block.nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def freed(self, block: _Block) -> None:
        with self._lock:
            if self.live.pop(block.address, None) is not None:
                self.live_bytes -= block.nbytes

    def free_bytes(self) -> int | None:
        """What the device has free, as `torch.cuda.mem_get_info` says it (None: no capacity set)."""
        return None if self.capacity is None else max(0, self.capacity - self.live_bytes)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` views copying-device memory."""
        if not self.live or t.device.type != "cpu" or t.is_meta:
            return False
        return t.untyped_storage().data_ptr() in self.live


_DEVICE = CopyingDevice()


def copying_device_state() -> CopyingDevice:
    """The copying test device's counters (live and peak bytes)."""
    return _DEVICE


@contextmanager
def copying_device(*, seed: int | None = None, delay_s: tuple[float, float] | None = None,
                   capacity: int | None = None) -> Iterator[CopyingDevice]:
    """While open, swappers made for the CPU compute device copy into tracked tensors, asynchronously, and
    backward runs on a device thread (for tests and bench/gpu_check.py; see [Note: copying test device] and
    [Note: as strict as a GPU]). `seed` and `delay_s` (least, most: then every copy is delayed) set the copies'
    random delays while open,
    `capacity` the device's memory in bytes (an allocation past it raises torch.OutOfMemoryError, as CUDA's)."""
    saved = (_DEVICE.seed, _DEVICE.delay_s, _DEVICE.delayed, _DEVICE.streams_made, _DEVICE.capacity)
    if seed is not None:
        _DEVICE.seed, _DEVICE.streams_made = seed, 0
    if delay_s is not None:  # every copy delayed so
        _DEVICE.delay_s, _DEVICE.delayed = delay_s, 1.0
    if capacity is not None:
        _DEVICE.capacity = capacity
    _DEVICE.enabled += 1
    if _DEVICE.enabled == 1 and _ENGINE_RUN_BACKWARD is not None:
        torch.autograd._engine_run_backward = _backward_on_device_thread
    try:
        yield _DEVICE
    finally:
        _DEVICE.enabled -= 1
        if _DEVICE.enabled == 0 and _ENGINE_RUN_BACKWARD is not None:
            torch.autograd._engine_run_backward = _ENGINE_RUN_BACKWARD
        if seed is not None or delay_s is not None or capacity is not None:
            _DEVICE.seed, _DEVICE.delay_s, _DEVICE.delayed, _DEVICE.streams_made, _DEVICE.capacity = saved


POISON = 0xFF  # every byte of a copy's destination until it lands: NaN in floating dtypes, -1 in signed ones


def copy_device_empty(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of `nbytes` in copying-device memory (counted until its last view goes), holding
    the poison pattern, as memory nothing has written yet."""
    free = _DEVICE.free_bytes()
    if free is not None and nbytes > free:
        raise torch.OutOfMemoryError(f"copying device out of memory: tried to allocate {nbytes} bytes with {free} "
                                     f"free of its {_DEVICE.capacity}")
    arr = np.empty(max(nbytes, 1), dtype=np.uint8).view(_OwnedArray)
    arr.fill(POISON)
    arr.block = _Block(arr.nbytes, arr.ctypes.data)
    return torch.from_numpy(arr)[:nbytes]


def _checksum(t: torch.Tensor) -> tuple[int, int]:
    """A cheap fingerprint of a contiguous uint8 tensor's bytes: the wrapping sum of its 8-byte words, and of
    the rest."""
    a = t.numpy()
    n8 = a.size // 8 * 8
    return int(a[:n8].view(np.uint64).sum(dtype=np.uint64)), int(a[n8:].sum())


class CopyEvent:
    """The copying device's event for one copy: done once its stream has made it (see [Note: as strict as a
    GPU])."""

    __slots__ = ("_landed", "error")

    def __init__(self) -> None:
        self._landed = threading.Event()  # set by the stream's thread when the copy has been made or refused
        self.error: Exception | None = None  # the race this copy found (or its failure), raised to its waiter

    def query(self) -> bool:
        return self._landed.is_set()

    def synchronize(self) -> None:
        self._landed.wait()
        if self.error is not None:
            raise self.error


class CopyStream:
    """One copying-device stream: copies made in submission order on a thread of its own, each after a
    seeded random delay (see [Note: as strict as a GPU])."""

    def __init__(self, name: str) -> None:
        self.name = name  # says whose copies raced, in errors
        self._rng = random.Random(_DEVICE.seed + _DEVICE.streams_made)  # the delays, reproducible per seed
        _DEVICE.streams_made += 1
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()  # copies not yet made
        self._thread: threading.Thread | None = None  # started at the first copy, ended by close()
        self._last: CopyEvent | None = None  # the last copy submitted: close() waits for it
        self._pending: dict[CopyEvent, tuple[int, int]] = {}  # destinations (address range) not landed yet
        self._pending_lock = threading.Lock()  # `_pending` is changed by the submitter and the stream's thread

    def copy(self, dst: torch.Tensor, src: torch.Tensor, what: str) -> CopyEvent:
        """Start copying `src` into `dst` (contiguous uint8 tensors of one size); `dst` is poisoned now."""
        if dst.numel() != src.numel():
            raise ValueError(f"{what}: copy of {src.numel()} bytes into {dst.numel()}")
        event = CopyEvent()
        lo = src.data_ptr()
        with self._pending_lock:
            # a source that an earlier copy on this stream still writes is checked from when that one landed
            waits = any(lo < end and start < lo + src.numel() for start, end in self._pending.values())
            self._pending[event] = (dst.data_ptr(), dst.data_ptr() + dst.numel())
        before = None if waits else _checksum(src)
        dst.fill_(POISON)
        delay = self._rng.uniform(*_DEVICE.delay_s) if self._rng.random() < _DEVICE.delayed else 0.0
        # made under the caller's inference mode, as CUDA enqueues the copy from the caller's thread (a tensor made
        # in inference mode may only be written to there)
        self._queue.put((dst, src, before, event, delay, what, torch.is_inference_mode_enabled()))
        self._last = event
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"tiermem-copy-stream-{self.name}", daemon=True)
            self._thread.start()
        return event

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            dst, src, before, event, delay, what, inference = item
            try:
                if before is None:
                    before = _checksum(src)
                if delay:
                    time.sleep(delay)
                if _checksum(src) != before:
                    event.error = CopyRaceError(
                        f"{what}: the source of an asynchronous copy ({src.numel()} bytes) changed before the copy "
                        "completed; on a GPU the copy would have read the new bytes. Wait on the copy's event before "
                        "reusing its source (this is a tiermem bug, please report it)")
                    _DEVICE.faults.append(event.error)
                else:
                    with torch.inference_mode(inference):
                        dst.copy_(src)
            except Exception as exc:  # noqa: BLE001 - the copy failed: its waiter hears it, the stream goes on
                event.error = exc
            with self._pending_lock:
                del self._pending[event]
            event._landed.set()
            del item, dst, src  # memory whose copy has landed is its owners' to free, as CUDA's allocator does

    def synchronize(self) -> None:
        """Wait until every copy submitted so far has landed (their errors stay with their events)."""
        if self._last is not None:
            self._last._landed.wait()

    def close(self) -> None:
        """Wait for the copies submitted and end the thread (a later copy starts another)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None


# torch.autograd's one call into its engine (torch 2.3 on; before it, the copying device runs backward on the
# caller's thread)
_ENGINE_RUN_BACKWARD: Callable[..., Any] | None = getattr(torch.autograd, "_engine_run_backward", None)
_on_device_thread = threading.local()  # `.active`: this thread runs a backward pass for its caller


@contextmanager
def _signals_held() -> Iterator[list[tuple[int, Any]]]:
    """Record every signal that has a Python handler instead of handling it, for the block (main thread only;
    elsewhere Python handles none): the list of those received, for the caller to hand to their handlers."""
    received: list[tuple[int, Any]] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    held = {s: h for s in signal.valid_signals() if callable(h := signal.getsignal(s))}
    for signum in held:
        signal.signal(signum, lambda n, f: received.append((n, f)))
    try:
        yield received
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)


def _backward_on_device_thread(*args: Any, **kwargs: Any) -> Any:
    """`torch.autograd`'s call into its engine, run on a thread of its own as CUDA's device thread runs it (see
    [Note: as strict as a GPU]); a backward started from inside one (reentrant checkpointing) runs there."""
    engine = _ENGINE_RUN_BACKWARD
    assert engine is not None  # installed only where torch has it
    if getattr(_on_device_thread, "active", False):
        return engine(*args, **kwargs)
    outcome: dict[str, Any] = {}
    # what CUDA's engine hands its device thread of the caller's state (its ThreadLocalState): grad mode, the
    # Python dispatch and function modes, and the context torch.compile reads its settings from
    grad_mode = torch.is_grad_enabled()
    modes = [*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack()]
    context = contextvars.copy_context()

    def run() -> None:
        _on_device_thread.active = True
        try:
            with torch.set_grad_enabled(grad_mode), ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                outcome["value"] = context.run(engine, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as the engine hands a hook's error
            outcome["error"] = exc

    _DEVICE.backward_threads += 1
    thread = threading.Thread(target=run, name="tiermem-autograd-device")
    with _signals_held() as received:
        thread.start()
        thread.join()
    if received:  # handled now, as CUDA's caller handles them once the engine returns
        try:
            for signum, frame in received:
                handler = signal.getsignal(signum)
                if callable(handler):  # put back as it was held: a Python function
                    handler(signum, frame)
        except BaseException as exc:
            if "error" in outcome:
                raise exc from outcome["error"]
            raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def check_host(what: str, *tensors: torch.Tensor) -> None:
    """Raise DeviceMismatchError when one of `tensors` is in device memory (CUDA, or the copying device)."""
    for t in tensors:
        if t.device.type == "cuda" or _DEVICE.holds(t):
            raise DeviceMismatchError(f"{what}: expected a host tensor, got one in device memory ({t.device}, "
                                      f"{tuple(t.shape)}); this is a tiermem bug, please report it")
