"""Several ranks: each unit's parameters, gradients and optimizer state split across the ranks of a
torch.distributed process group (ZeRO-3), each rank's share in its own tiers.

# [Note: sharding]
With a process group of N ranks (the default group once `torch.distributed` is initialised, e.g. under
`torchrun`, or `process_group=`), every parameter of a unit is cut into N equal chunks of
ceil(numel / N) elements, the last one padded with zeros; rank r keeps chunk r of each. So a rank's
partition of a unit is the unit's parameters as 1-D chunks, laid out as any partition is, and its gradient
and optimizer-state partitions are laid out from the same chunks: the update is the same elementwise
arithmetic on 1/N of the elements, and padding (zero parameters, zero gradients, zero state) stays zero.

Forward and backward gather a unit before it computes: one `all_gather_into_tensor` of the ranks'
partitions (on gloo one broadcast from each rank, this rank's sent from its partition as it is and given no
row), then each parameter is copied out of the rows (this rank's chunk out of its partition) into the
unit's full layout on the device; the full copy goes when the unit is released. Once the order is recorded,
the gather of the unit that comes next in the pass starts (async) as soon as the current unit is bound, so
it runs while that unit computes (`Runtime._gather_ahead`). Collectives must be issued in the same order on
every rank, so what is gathered ahead depends only on the recorded order, never on timing (whether a read
has finished): every rank makes the same prediction and the same mistakes. Nothing is gathered ahead across
the end of a pass: the optimizer step between passes changes the parameters. After a unit's backward its
gradients are laid out in N rows the same way and `reduce_scatter_tensor` leaves each rank the sum of its
chunks, divided by N (the average DDP takes); on the CPU, for a unit with nothing accumulated yet, straight
into its accumulators (see [Note: accumulators handed out unzeroed] in tiermem/optim/optimizer.py); a later
micro-batch's are added to them whole, every rank's chunk holding the other ranks' sums too. A rank may
give gradients to other parameters of a unit than another rank does (a mixture of experts routing each
rank's batch elsewhere): as DDP with find_unused_parameters counts the others' as zeros in the average, a
parameter has a gradient when any rank gave it one, so before clipping, unscaling or the step the ranks
agree on those with one all-reduce of a flag per parameter (`TieredOptimizer._agree_grads`), and all update
the same ones. Every rank must still run each unit's backward (its reduce-scatter is a collective). The
gradient norm for clipping and the float16 overflow check are all-reduced.

Checkpoints hold whole tensors, so any number of ranks (one included) loads them, each reading its chunks;
each rank writes its own chunks into the files when all ranks see the folder, else rank 0 writes them
gathered (see [Note: each rank writes its own chunks] in tiermem/checkpointing.py). Every rank checks at
entry that all ranks run the same config and model shapes.

# [Note: a rank that fails]
A rank whose with-block raises cannot take part in the collectives the others are waiting in. If it stays
alive (its loop caught the error, or it is stuck elsewhere) gloo would leave them waiting until the process
group's timeout, 30 minutes by default, and then say only that an operation timed out. So the failing rank
writes what it raised into the process group's store (`Ranks.announce`, under a key of this entry), and a
rank waiting for a collective on gloo waits in slices of `_POLL` seconds, looking at the store between them
(`Ranks._wait`): it raises a RanksError naming the failed rank and its error within a slice of the
announcement. A rank that died instead breaks gloo's connections, and the wait fails at once; the
timeout given to `init_process_group` bounds everything else (see [Note: a rank that does not arrive]).
NCCL's `wait()` does not block the host (it orders the compute stream after the collective), so a rank
waiting there would only be stopped at its next synchronisation, which would never return: on NCCL
`Ranks._poll` asks the work whether it completed instead, looking at the store between the questions. (gloo's
works cannot be asked: its reduce-scatter's never says it completed, so gloo and other backends wait in
slices.)

# [Note: a rank that does not arrive]
A rank that is alive but never reaches the collective (a deadlock, a hung disk or GPU, a debugger) announces
nothing, and gloo's own timeout does not end a wait made of slices: each slice's "timed out" looks like the
one before. So every wait counts its own time and ends at the process group's timeout (`Ranks.timeout`, read
from the group's options) with a RanksError naming the ranks that never arrived. Which ones: every rank numbers
its waits alike (`Ranks.waits`; the ranks run the same collectives in the same order), and one that has waited
a slice writes the number of the wait it is in to the store; a rank whose last number is below the waiting
rank's never got there. The rank that gives up announces it, so the stuck one, if it ever arrives, ends with
that named rather than waiting out a timeout of its own.

# [Note: collectives on NCCL]
NCCL takes device memory only, and a default `init_process_group("nccl")` has no CPU backend. tiermem's
collectives are right for it by construction rather than by a second, CPU process group: `Ranks` holds the
compute device's mover (`on_device`, at entry), and where the group's backend is device-only (any without
gloo for the CPU: NCCL; tests/strict_group.py stands in for it on the copying test device) a host tensor
goes through a device copy: the small all-reduces (flags, norms, the float16 skip), the gathers of host
partitions (the optimizer's state, checkpoints), and `all_gather_object`, which is two all-gathers of
pickled bytes in device memory (torch's makes its tensors where the backend is registered, on the host for a
backend registered for the CPU). The rows a gather or reduce-scatter fills are made in device memory
(`Ranks.scratch`). A user's `process_group=` and DDP's or the Trainer's groups are used as they are.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import itertools
import logging
import os
import pickle
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem.errors import RanksError
from tiermem.swap import Layout
from tiermem.swap.transfers import DeviceMover

log = logging.getLogger(__name__)


@dataclass
class Traffic:
    """What this rank's collectives moved and how long it waited for them (reported by `tm.stats()`)."""

    gathered_bytes: int = 0  # bytes received by all-gathers (the other ranks' chunks)
    gather_wait_seconds: float = 0.0  # time spent waiting for all-gathers to finish (what compute did not hide)
    gathers_ahead: int = 0  # gathers started ahead of their unit, while the unit before it computed
    reduced_bytes: int = 0  # bytes of gradient sent into reduce-scatters
    reduce_seconds: float = 0.0

    def reset(self) -> None:
        self.__dict__.update(Traffic().__dict__)


def _where() -> str:
    """This host and its process-id namespace: a process id means the same process only within both (two
    containers of one host may share a host name)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "pid:?"
    return f"{socket.gethostname()}/{namespace}".replace(" ", "_")


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs: not gone, and not a zombie waiting for its parent (a killed
    rank stays one until torchrun reaps it). A process still exiting gets a moment to finish."""
    for _ in range(10):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
        except OSError:
            return True  # cannot tell: taken as alive
        if state in (b"Z", b"X"):
            return False
        time.sleep(0.05)
    return True


def _relayed(message: str) -> RanksError:
    """A RanksError that passes on another rank's announced failure (not announced again)."""
    exc = RanksError(message)
    exc.relayed = True  # type: ignore[attr-defined]
    return exc


_POLL = datetime.timedelta(seconds=0.2)  # how often a rank waiting on gloo looks for another's failure
_ENTRIES = itertools.count()  # tiered_offload entries with several ranks: every rank counts the same ones


@dataclass(frozen=True)
class Ranks:
    """The process group tiermem shards over: this rank and how many there are (1: no sharding)."""

    group: Any = None
    rank: int = 0
    world: int = 1
    traffic: Traffic = field(default_factory=Traffic, compare=False, repr=False)
    scope: str = field(default="", compare=False)  # this entry's keys in the store (see [Note: a rank that fails])
    # the compute device's mover: host tensors are staged through its memory where the backend takes device
    # memory only (see [Note: collectives on NCCL])
    mover: DeviceMover | None = field(default=None, compare=False, repr=False)
    # how many waits for a collective this rank has begun: every rank counts the same ones (see [Note: a rank
    # that does not arrive])
    waits: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    @classmethod
    def of(cls, group: Any = None) -> Ranks:
        """`group`, else the default process group when torch.distributed is initialised, else one rank."""
        import torch.distributed as dist

        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def for_entry(self) -> Ranks:
        """These ranks with the store keys of a new tiered_offload entry (see [Note: a rank that fails]);
        every rank enters the same contexts in the same order, so they count alike."""
        if not self.sharded:
            return self
        ranks = dataclasses.replace(self, scope=f"tiermem/entry{next(_ENTRIES)}")
        ranks._say_alive()
        return ranks

    def _say_alive(self) -> None:
        """Write this rank's host and process id to the store, so the others can tell that it died."""
        if self._store is None:
            return
        try:
            self._store.set(f"{self.scope}/pid/{self.rank}", f"{_where()} {os.getpid()}")
        except RuntimeError as err:
            log.debug("could not note rank %d's process in the store: %s", self.rank, err)

    def dead(self) -> list[tuple[int, int]]:
        """(rank, process id) of the other ranks on this host whose process is gone (killed, out of memory);
        ranks on other hosts cannot be looked at from here."""
        gone = []
        host = _where()
        for r in range(self.world):
            key = f"{self.scope}/pid/{r}"
            try:
                if r == self.rank or self._store is None or not self._store.check([key]):
                    continue
                where, pid = self._store.get(key).decode().rsplit(" ", 1)
            except (RuntimeError, ValueError):
                continue
            if where != host:
                continue
            if not _alive(int(pid)):
                gone.append((r, int(pid)))
        return gone

    def on_device(self, mover: DeviceMover) -> Ranks:
        """These ranks, staging host tensors through `mover`'s device memory (see [Note: collectives on NCCL])."""
        return dataclasses.replace(self, mover=mover) if self.sharded else self

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @functools.cached_property
    def device_only(self) -> bool:
        """The group's collectives take device memory only (NCCL; any backend but one with gloo for the CPU):
        host tensors go through device memory (see [Note: collectives on NCCL])."""
        import torch.distributed as dist

        return self.sharded and "gloo" not in str(dist.get_backend(self.group))

    @functools.cached_property
    def nccl(self) -> bool:
        """The group's device collectives are NCCL's, whose `wait()` does not block the host and whose works say
        truly whether they completed (gloo's reduce-scatter work never does)."""
        import torch.distributed as dist

        return self.sharded and str(dist.get_backend(self.group)) == "nccl"

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as this group's collectives take it: itself, or a copy in device memory (to copy back)."""
        if not self.device_only or self.mover is None or self.mover.holds(t):
            return t
        return self.mover.tensor_to_device(t)

    def scratch(self, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        """`nbytes` (uint8) for a collective beside `like`: device memory where the group takes only that or
        `like` is there, else `like`'s memory."""
        if self.mover is not None and (self.device_only or self.mover.holds(like)):
            return self.mover.empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=like.device)

    @property
    def rows_received(self) -> int:
        """Rows a gather of this group receives into: every rank's, or where `by_rank` every other rank's (this
        rank's chunks are read from its partition as they are)."""
        return self.world - 1 if self.by_rank else self.world

    def chunk(self, numel: int) -> int:
        """Elements of each rank's chunk of a tensor of `numel` elements."""
        return -(-numel // self.world)

    def keep_mine(self, whole: torch.Tensor, chunk: torch.Tensor) -> None:
        """Copy this rank's chunk of `whole` into `chunk` (1-D, `chunk(numel)` elements; the padding left as
        it is)."""
        start, end = self.my_range(whole.numel())
        chunk[: end - start].copy_(whole.reshape(-1)[start:end])

    def my_range(self, numel: int) -> tuple[int, int]:
        """[start, end) of this rank's elements of a tensor of `numel` (end - start may be short or 0)."""
        c = self.chunk(numel)
        start = min(self.rank * c, numel)
        return start, min(start + c, numel)

    # -- a rank that fails (see [Note: a rank that fails]) ----------------------------------------------
    @functools.cached_property
    def _store(self) -> Any:
        """The process group's key-value store (None: none to be had, and failures are not announced)."""
        import torch.distributed as dist

        try:
            return dist.distributed_c10d._get_default_store() if self.sharded else None
        except (RuntimeError, AttributeError, ValueError):
            return None

    def announce(self, exc: BaseException) -> None:
        """Tell the other ranks that this one left on `exc`, so their waits end with it named. A RanksError
        relaying another rank's failure is already announced; an announcement that cannot be made is only
        logged."""
        if self._store is None or getattr(exc, "relayed", False):
            return
        try:
            self._store.set(f"{self.scope}/failed/{self.rank}", f"{type(exc).__name__}: {exc}"[:1000])
        except RuntimeError as err:
            log.warning("could not tell the other ranks that rank %d failed: %s", self.rank, err)

    def failure(self) -> tuple[int, str] | None:
        """(rank, what it raised) of another rank that announced a failure in this entry, or None."""
        if self._store is None:
            return None
        for r in range(self.world):
            key = f"{self.scope}/failed/{r}"
            try:
                if r != self.rank and self._store.check([key]):
                    return r, self._store.get(key).decode(errors="replace")
            except RuntimeError:
                return None
        return None

    # -- collectives ----------------------------------------------------------------------------------
    def _run(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        """A collective; its failure (a rank that raised and left, or the process group's timeout) becomes a
        RanksError on this rank instead of torch's backend error."""
        try:
            return call(*args, group=self.group, **kwargs)
        except RuntimeError as exc:
            raise self._failed(what, exc) from exc

    def _wait(self, work: Any, what: str) -> None:
        """Wait for `work`, ending with a RanksError as soon as another rank announces a failure (see [Note: a rank
        that fails]): on NCCL by asking whether it completed, elsewhere in slices of waiting."""
        try:
            if self._store is None:
                work.wait()
                return
            if self.nccl:
                self._poll(work, what, *self._began_waiting())
                work.wait()
                return
            seq, began = self._began_waiting()
            while True:
                try:
                    work.wait(timeout=_POLL)
                    return
                except RuntimeError as exc:  # a slice ended (or gloo's own timeout: ours is checked below)
                    if "timed out" not in str(exc).lower():
                        raise
                self._check_others(what, seq, began)
        except RuntimeError as exc:
            raise self._failed(what, exc) from exc

    def _poll(self, work: Any, what: str, seq: int, began: float) -> None:
        """Return once `work` completed, looking at the store every `_POLL`: NCCL's `wait()` only orders the
        compute stream after the collective, so a rank that left would be noticed at the next synchronisation,
        which would then never return."""
        pause, looked = 1e-4, time.monotonic()
        while not work.is_completed():
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
            if time.monotonic() - looked >= _POLL.total_seconds():
                looked = time.monotonic()
                self._check_others(what, seq, began)

    # -- a rank that does not arrive (see [Note: a rank that does not arrive]) --------------------------------
    @functools.cached_property
    def timeout(self) -> float:
        """The process group's timeout in seconds, as given to init_process_group (torch's default otherwise)."""
        import torch.distributed as dist

        group: Any = self.group if self.group is not None else dist.group.WORLD
        for holder in (lambda: group._get_backend(torch.device("cpu")), lambda: group):  # gloo's; a group of its own
            try:
                return float(holder().options._timeout.total_seconds())
            except (AttributeError, RuntimeError, ValueError, TypeError):
                continue
        return float(dist.distributed_c10d.default_pg_timeout.total_seconds())

    def _began_waiting(self) -> tuple[int, float]:
        """Number this wait (every rank numbers its waits alike) and note when it began."""
        self.waits[0] += 1
        return self.waits[0], time.monotonic()

    def _check_others(self, what: str, seq: int, began: float) -> None:
        """Between slices of a wait: raise a RanksError when another rank announced a failure, or when the wait
        has lasted the process group's timeout, naming the ranks that never arrived at it."""
        failed = self.failure()
        if failed is not None:
            raise _relayed(f"rank {self.rank} of {self.world}: {what}: rank {failed[0]} failed and left the "
                           f"collective: {failed[1]} (its own error says more)")
        if self._store is None:
            return
        try:
            self._store.set(f"{self.scope}/at/{self.rank}", str(seq))  # this rank is here, for the others to see
        except RuntimeError:
            return
        waited = time.monotonic() - began
        if waited < self.timeout:
            return
        missing = [r for r in range(self.world) if r != self.rank and self._arrived(r) < seq]
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive"
               if missing else "the other ranks did not finish it")
        raise RanksError(f"rank {self.rank} of {self.world}: {what}: {who} within the process group's timeout "
                         f"({self.timeout:g} s, waited {waited:.0f} s): a rank stuck in a deadlock, on a hung disk "
                         "or device, or in a debugger. Find what that rank is doing (py-spy dump --pid ...); "
                         "raise the timeout in init_process_group(timeout=...) if it is only slow")

    def _arrived(self, r: int) -> int:
        """The number of the last wait rank `r` was seen in (0: none)."""
        try:
            key = f"{self.scope}/at/{r}"
            return int(self._store.get(key)) if self._store.check([key]) else 0
        except (RuntimeError, ValueError):
            return 0

    def _failed(self, what: str, exc: BaseException) -> RanksError:
        failed = self.failure()
        if failed is not None:
            return _relayed(f"rank {self.rank} of {self.world}: {what}: rank {failed[0]} failed and left the "
                            f"collective: {failed[1]} (its own error says more)")
        dead = self.dead()
        if dead:
            err = RanksError(f"rank {self.rank} of {self.world}: {what}: " + ", ".join(
                f"rank {r} died (its process {pid} is gone: killed, or out of memory)" for r, pid in dead)
                + f" ({exc})")
            err.dead_ranks = [r for r, _ in dead]  # type: ignore[attr-defined]
            return err
        return RanksError(f"rank {self.rank} of {self.world}: {what} with the other ranks failed ({exc}). "
                          "Another rank probably raised (see its error) or did not get here within the "
                          "process group's timeout")

    @functools.cached_property
    def by_rank(self) -> bool:
        """Gather and reduce-scatter as one broadcast and one reduce per rank instead of the single collective:
        on gloo (CPU tensors). Its all_gather_into_tensor and reduce_scatter_tensor go through flat temporaries
        made on its worker threads: with one 28 MB unit, measured on two ranks here, they kept 112 and 67 MB
        more resident than the per-rank forms (46 and 18 MB), and gathered slower (20 gathers: 0.63 s against
        0.43 s). NCCL (GPUs) uses the single collectives."""
        import torch.distributed as dist

        return self.sharded and dist.get_backend(self.group) == "gloo"

    def _global(self, r: int) -> int:
        import torch.distributed as dist

        return r if self.group is None else dist.get_global_rank(self.group, r)

    def start_all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> Any:
        """Start gathering every rank's `mine` into `out` (`rows_received` rows, in rank order); returns the work
        to `wait` on. Where `by_rank`, `out` has no row for this rank: `mine` is sent as it is (see `finish_gather`)."""
        import torch.distributed as dist

        if self.by_rank:
            rows = out.view(self.world - 1, -1)
            work: Any = _AllOf([self._run("gathering a unit", dist.broadcast,
                                          mine if r == self.rank else rows[r - (r > self.rank)],
                                          self._global(r), async_op=True) for r in range(self.world)])
        else:
            work = self._run("gathering a unit", _gather_into_tensor(), out, mine, async_op=True)
        self.traffic.gathered_bytes += (self.world - 1) * mine.numel() * mine.element_size()
        return work

    def wait(self, work: Any, what: str = "gathering a unit") -> None:
        t0 = time.perf_counter()
        try:
            self._wait(work, what)
        finally:
            self.traffic.gather_wait_seconds += time.perf_counter() - t0

    def start_reduce_scatter(self, out: torch.Tensor, rows: torch.Tensor) -> Any:
        """Start summing `rows` (`world` equal rows, flat) over the ranks, this rank's row of the sum into `out`
        (see `finish_reduce_scatter`); `rows` is scratch afterwards."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        what = "reduce-scattering gradients"
        if self.by_rank:
            parts = rows.view(self.world, -1)
            work: Any = _AllOf([self._run(what, dist.reduce, parts[r], self._global(r), async_op=True)
                                for r in range(self.world)])
        else:
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            dst = self._staged(out)
            work = self._run(what, scatter, dst, rows, async_op=True)  # SUM: gloo has no AVG
            if dst is not out:
                work = _CopiedBack(work, [(dst, out)])
        self.traffic.reduced_bytes += rows.numel() * rows.element_size()
        self.traffic.reduce_seconds += time.perf_counter() - t0
        return work

    def finish_reduce_scatter(self, work: Any, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Wait for `work` and leave in `out` the mean over the ranks (the average DDP takes)."""
        t0 = time.perf_counter()
        try:
            self._wait(work, "reduce-scattering gradients")
        finally:
            self.traffic.reduce_seconds += time.perf_counter() - t0
        if self.by_rank:  # this rank's row of the sums, divided on its way out: one pass over it
            torch.div(rows.view(self.world, -1)[self.rank], self.world, out=out)
        else:
            out.div_(self.world)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        what = f"an all-reduce ({op})"
        wire = self._staged(t)
        self._wait(self._run(what, dist.all_reduce, wire, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                             async_op=True), what)
        if wire is not t:
            t.copy_(wire)
        return t

    def barrier(self) -> None:
        import torch.distributed as dist

        self._wait(self._run("a barrier", dist.barrier, async_op=True), "a barrier")

    def all_gather_object(self, what: str, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order."""
        import torch.distributed as dist

        if self.device_only:
            return self._all_gather_pickled(what, obj)
        every: list[Any] = [None] * self.world
        self._run(what, dist.all_gather_object, every, obj)
        return every

    def _all_gather_pickled(self, what: str, obj: Any) -> list[Any]:
        """`all_gather_object` through device memory: torch's makes its tensors where the backend says, which
        a device-only backend registered for the CPU refuses (see [Note: collectives on NCCL])."""
        data = pickle.dumps(obj)
        mine = self._staged(torch.tensor([len(data)], dtype=torch.int64))
        sizes = self.scratch(8 * self.world, mine).view(torch.int64)
        self._wait(self._run(what, _gather_into_tensor(), sizes, mine, async_op=True), what)
        lengths = sizes.tolist()
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = self._staged(padded)
        rows = self.scratch(padded.numel() * self.world, mine)
        self._wait(self._run(what, _gather_into_tensor(), rows, mine, async_op=True), what)
        rows = rows.view(self.world, -1).cpu()
        return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]

    def check_same(self, what: str, value: str) -> None:
        """Raise RanksError on every rank unless all ranks pass the same `value` (e.g. a config's text)."""

        every = self.all_gather_object(f"comparing {what}", hashlib.sha256(value.encode()).hexdigest()[:16])
        odd = [r for r, d in enumerate(every) if d != every[0]]
        if odd:
            raise RanksError(f"{what} differs between ranks: rank 0 and rank(s) {odd} disagree; every rank must "
                             "enter tiered_offload with the same config and the same model")


def _gather_into_tensor() -> Any:
    """torch.distributed's all-gather into one tensor, by its newer name where it has it."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _AllOf:
    """Several collectives' works, waited for together."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        for w in self.works:  # one that timed out is waited for again from the first: the done ones return at once
            w.wait() if timeout is None else w.wait(timeout=timeout)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _CopiedBack:
    """A collective into device copies of host tensors, each (copy, tensor) copied back once it is waited for."""

    def __init__(self, work: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.work = work
        self.pairs = pairs  # emptied once copied back: a later wait has nothing to do

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        for wire, host in self.pairs:
            host.copy_(wire)
        self.pairs = []

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


# -- the layout of a rank's share ------------------------------------------------------------------------
def chunk_specs(ranks: Ranks, specs: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A rank's chunk of each tensor in `specs` (meta tensors): 1-D, ceil(numel / N) elements, same dtype."""
    return [(name, torch.empty(ranks.chunk(t.numel()), dtype=t.dtype, device="meta")) for name, t in specs]


@dataclass
class Gathering:
    """An all-gather of one unit in flight: the rows it fills (`Ranks.rows_received`), the work to wait on, and
    this rank's partition (`mine`), which must stay as it is until `finish_gather` returns."""

    rows: torch.Tensor
    work: Any
    mine: torch.Tensor


def start_gather(ranks: Ranks, mine: torch.Tensor, chunks: Layout) -> Gathering:
    """Start all-gathering the ranks' partitions (`mine`: this rank's, laid out as `chunks`; a host partition
    goes through a device copy where the group takes device memory only)."""
    mine = ranks._staged(mine[: chunks.size])
    rows = ranks.scratch(ranks.rows_received * chunks.size, mine)
    return Gathering(rows, ranks.start_all_gather(rows, mine), mine)


def finish_gather(ranks: Ranks, g: Gathering, chunks: Layout, full: Layout, out: torch.Tensor) -> None:
    """Wait for `g` and write each tensor whole into `out` (uint8, laid out as `full`), on `g`'s device.
    Where the gather went by rank, this rank's chunks come from `g.mine`, which was sent as it is, neither
    copied into the rows nor given a row there: each byte of the unit is moved once here (before, this rank's
    share, half a unit at 2 ranks, went twice: into its row and out of it)."""
    ranks.wait(g.work)
    rows2 = g.rows.view(ranks.rows_received, chunks.size)
    skip = ranks.rank if ranks.by_rank else None
    for c, f in zip(chunks.slots, full.slots, strict=True):
        _rows_to_whole(rows2[:, c.offset : c.offset + c.nbytes], out[f.offset : f.offset + f.nbytes],
                       None if skip is None else (skip, g.mine[c.offset : c.offset + c.nbytes]))


def _rows_to_whole(rows: torch.Tensor, whole: torch.Tensor, own: tuple[int, torch.Tensor] | None = None) -> None:
    """Copy `rows` (rank 0's chunk of a tensor, rank 1's, ...; the last ones padded) into the flat `whole`
    in one strided copy, not through a contiguous temporary: the bytes are moved once. With `own` = (r,
    chunk), `rows` holds every rank's row but r's, in rank order, and `chunk` is rank r's: it is copied on
    its own, the rows before and after it in one strided copy each."""
    n = rows.shape[1]
    full = whole.numel() // n if n else 0  # ranks whose chunk lies whole inside the tensor
    r = rows.shape[0] if own is None else own[0]  # ranks after r sit one row up in `rows`
    for a, b in ((0, min(r, full)), (min(r + 1, full), full)):
        if b > a:
            whole[a * n : b * n].view(b - a, n).copy_(rows[a - (a > r) : b - (b > r)])
    if own is not None and r < full:
        whole[r * n : (r + 1) * n].copy_(own[1])
    if full * n < whole.numel():
        tail = own[1] if own is not None and r == full else rows[full - (full > r)]
        whole[full * n :].copy_(tail[: whole.numel() - full * n])


def _whole_to_rows(whole: torch.Tensor, rows: torch.Tensor) -> None:
    """The inverse of `_rows_to_whole`; the padding of the last rows is zeroed."""
    n = rows.shape[1]
    full = whole.numel() // n if n else 0
    rows[:full].copy_(whole[: full * n].view(full, n))
    if full < rows.shape[0]:
        rest = whole.numel() - full * n
        rows[full, :rest].copy_(whole[full * n :])
        rows[full, rest:].zero_()
        rows[full + 1 :].zero_()


def gather_unit(ranks: Ranks, mine: torch.Tensor, chunks: Layout, full: Layout, out: torch.Tensor) -> None:
    """All-gather the ranks' partitions and write each tensor whole into `out`, now."""
    finish_gather(ranks, start_gather(ranks, mine, chunks), chunks, full, out)


@dataclass
class Reducing:
    """A reduce-scatter of one unit's gradients in flight (see `start_scatter_sum`)."""

    rows: torch.Tensor
    work: Any


def start_scatter_sum(ranks: Ranks, whole: dict[str, torch.Tensor], chunks: Layout, out: torch.Tensor) -> Reducing:
    """Start reduce-scattering whole tensors (by name; `whole` is emptied as they are laid out, so each goes
    as soon as it is copied) into `out` (fp32 bytes laid out as `chunks`): once `finish_scatter_sum` returns,
    it holds this rank's chunk of each, averaged over the ranks. Names missing from `whole` count as zeros."""
    rows = ranks.scratch(ranks.world * (chunks.size // 4) * 4, out)
    rows = rows.view(torch.float32).view(ranks.world, -1)
    for start, end in chunks.outside(whole.keys()):  # the gaps between tensors' chunks are summed too
        rows[:, start // 4 : end // 4].zero_()
    for c in chunks.slots:
        g = whole.pop(c.name, None)
        if g is not None:  # rank r's chunk into row r; padding zeroed
            _whole_to_rows(g.reshape(-1), rows[:, c.offset // 4 : (c.offset + c.nbytes) // 4])
        del g
    return Reducing(rows, ranks.start_reduce_scatter(_fp32(out, chunks), rows.view(-1)))


def finish_scatter_sum(ranks: Ranks, r: Reducing, chunks: Layout, out: torch.Tensor) -> None:
    ranks.finish_reduce_scatter(r.work, _fp32(out, chunks), r.rows.view(-1))


def _fp32(out: torch.Tensor, chunks: Layout) -> torch.Tensor:
    return out.view(torch.float32)[: chunks.size // 4]
