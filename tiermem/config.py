"""The swap-config: where each kind of training state rests, and how tiermem moves it.

One dataclass per component (`ParamsConfig`, `NvmeConfig`, `IOConfig`, ...) nested under `Config`,
after torchtitan's job config. Each component checks its own fields in ``__post_init__``; `Config`
checks the rules that span components. `load_config` builds a `Config` from a YAML file, a mapping
or another `Config`, rejecting unknown keys and wrong types with the dotted key path, what was
expected and what was got. docs/config.md is the reference for every key and rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import yaml

from tiermem.errors import ConfigError
from tiermem.sizes import IO_ALIGN, SIZE_HINT, format_size, parse_size, short_repr

__all__ = [
    "Config",
    "ParamsConfig",
    "OptimizerConfig",
    "GradsConfig",
    "ActivationsConfig",
    "NvmeConfig",
    "MemoryConfig",
    "PrefetchConfig",
    "WrapConfig",
    "IOConfig",
    "KVConfig",
    "load_config",
    "format_config",
]

logger = logging.getLogger(__name__)

PARAM_TIERS = ("device", "cpu", "nvme")
STATE_TIERS = ("cpu", "nvme")
UPDATES = ("lazy", "step")
PARAM_STORAGES = ("full", "int8", "int4")  # params.storage: see tiermem/quant.py
ACTIVATION_TIERS = ("auto", "memory", "nvme")
KV_TIERS = ("memory", "cpu", "nvme", "auto")
CPU_ALLOCATORS = ("auto", "tiermem", "torch")
DTYPES = ("float32", "bfloat16", "float16")
# Spellings people carry over from other tools; suggested, not accepted.
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
}
ENGINES = ("auto", "io_uring", "threads")

MAX_QUEUE_DEPTH = 4096

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:[0-9]+)$")
_UNEXPANDED_VAR_RE = re.compile(r"\$(\w+|\{[^}]*\})")

# Field metadata marking a byte count: parsed with parse_size, written back as "1MiB" by to_dict.
_BYTES: dict[str, Any] = {"bytes": True}


# ---------------------------------------------------------------------------------------------
# Value checks shared by the components. Each takes the dotted key path first so that every
# message starts with it.


def _describe(value: object) -> str:
    """Name a wrong value for a message: its YAML-ish type and its repr, cut short (see short_repr)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return f"a string {short_repr(value)}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return f"a list {short_repr(list(value))}"
    return f"{type(value).__name__} {short_repr(value)}"


def _key_text(key: object) -> str:
    """A mapping key as it appears in a dotted key path, cut short like a value."""
    text = key if isinstance(key, str) else short_repr(key)
    return text if len(text) <= 80 else text[:77] + "..."


def _suggest(word: str, options: Sequence[str]) -> str:
    """Return "; did you mean 'x'?" for a close option, else ""."""
    if len(word) > 80:  # no option is that long, and difflib's cost grows with the length
        return ""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _int(key: str, value: object, lo: int, hi: int | None = None) -> int:
    """Return `value` if it is an int within [lo, hi]; bools and floats are refused."""
    want = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected {want}, got {_describe(value)}")
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{key}: expected {want}, got {short_repr(value)}")
    return value


def _bool(key: str, value: object) -> bool:
    """Return `value` if it is a bool; 0/1 and "yes" strings are refused."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
    return value


def _choice(key: str, value: object, options: Sequence[str], aliases: Mapping[str, str] | None = None) -> str:
    """Return `value` if it is one of `options`, else say which it might have meant.

    `aliases` maps common other spellings to the option to suggest; they are still refused so
    that one config has one spelling.
    """
    listed = ", ".join(options)
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected one of {listed}, got {_describe(value)}")
    if value not in options:
        alias = (aliases or {}).get(value.lower())
        hint = f"; did you mean {alias!r}?" if alias else _suggest(value, options)
        raise ConfigError(f"{key}: expected one of {listed}, got {short_repr(value)}{hint}")
    return value


def _size(key: str, value: object, *, minimum: int = 0, align: int = 1) -> int:
    """Return `value` as bytes (human strings allowed), at least `minimum`, a multiple of `align`."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{key}: expected {SIZE_HINT}, got {_describe(value)}")
    try:
        nbytes = parse_size(value, what=key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if nbytes < minimum:
        raise ConfigError(f"{key}: expected a size of at least {minimum} bytes, got {short_repr(value)}")
    if nbytes % align:
        down = nbytes // align * align
        near = " or ".join(str(_human_size(n)) for n in (down, down + align) if n)
        raise ConfigError(
            f"{key}: expected a multiple of {align} bytes for direct I/O, got {short_repr(value)} ({nbytes} bytes);"
            f" use {near}"
        )
    return nbytes


def _optional_size(key: str, value: object, *, minimum: int = 0) -> int | None:
    """Like `_size`, but null stays None."""
    return None if value is None else _size(key, value, minimum=minimum)


def _path(key: str, value: object) -> str:
    """Return `value` as an absolute path with ~ and $VARS expanded."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: expected a non-empty path string, got {_describe(value)}")
    expanded = os.path.expanduser(os.path.expandvars(value))
    unset = _UNEXPANDED_VAR_RE.search(expanded)
    if unset:
        raise ConfigError(
            f"{key}: environment variable {_key_text(unset.group(0))} in {short_repr(value)} is not set;"
            " set it or write the path out"
        )
    return os.path.abspath(expanded)


def _str_list(key: str, value: object, what: str) -> tuple[str, ...]:
    """Return `value` as a tuple of strings; a bare string is refused, not split into letters."""
    if isinstance(value, str):
        fix = f"write [{value}]" if len(value) <= 80 else "put it in a list"
        raise ConfigError(f"{key}: expected a list of {what}, got a string {short_repr(value)}; {fix}")
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list of {what}, got {_describe(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{key}[{i}]: expected a non-empty string, got {_describe(item)}")
    return tuple(value)


def _path_weights(value: object, n: int) -> str | tuple[int, ...]:
    """nvme.path_weights: "auto", or one integer from 1 to 64 per directory."""
    key = "nvme.path_weights"
    if value == "auto":
        return "auto"
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected \"auto\" or a list of one integer per nvme.paths entry, got "
                          f"{_describe(value)}")
    weights = tuple(_int(f"{key}[{i}]", w, 1, 64) for i, w in enumerate(value))
    if len(weights) != n:
        raise ConfigError(f"{key}: {len(weights)} weights for {n} nvme.paths entries; give one per directory, "
                          "in the same order, or \"auto\"")
    return weights


def _check_writable_dir(key: str, path: str) -> None:
    """Fail unless `path` is a writable directory or could be created as one."""
    if os.path.lexists(path) and not os.path.exists(path):
        raise ConfigError(f"{key}: {short_repr(path)} is a dangling symlink; fix or remove it")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(
                f"{key}: expected a directory, got {short_repr(path)} which exists and is not one;"
                " point it at a directory"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(
                f"{key}: expected a writable directory, got {short_repr(path)} which this user cannot"
                " write; fix its permissions or choose another directory"
            )
        return
    # tiermem creates missing run directories, so the nearest existing ancestor decides.
    ancestor = os.path.dirname(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(
            f"{key}: {short_repr(path)} cannot be created because {short_repr(ancestor)} is not a directory;"
            " choose a path under a directory"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}: {short_repr(path)} does not exist and cannot be created because {short_repr(ancestor)} is not"
            " writable by this user; create it first or choose another directory"
        )


def _physical_memory() -> int | None:
    """Bytes of RAM in this machine, or None where the OS does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or a name this OS lacks
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def _human_size(nbytes: int) -> int | str:
    """Return `nbytes` as an exact human string ("1MiB", "1GB") or the int if no unit divides it."""
    if nbytes == 0:
        return 0
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    for unit, scale in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return nbytes


# ---------------------------------------------------------------------------------------------
# Components. Each names its section in SECTION so that its own checks can print the key path.


@dataclass
class ParamsConfig:
    """Model parameters: where they rest between the forward/backward uses of their unit."""

    SECTION: ClassVar[str] = "params"

    tier: str = "nvme"
    """Where parameters rest between uses: ``device`` (stay resident), ``cpu`` or ``nvme``."""

    dtype: str | None = None
    """Storage and compute dtype override (``float32``, ``bfloat16``, ``float16``);
    None keeps each parameter's own dtype."""

    storage: str = "full"
    """How weights are stored in their tier: ``full`` (as computed), or compressed for inference, ``int8``
    (a quarter of float32's bytes, plus a float32 scale per group) or ``int4`` (an eighth): read smaller,
    expanded into the compute dtype after the read. Lossy, so inference only, with ``restore=False``; see
    [Note: compressed weights] in tiermem/quant.py and docs/benchmarks.md for the error."""

    group_size: int = 128
    """Values that share one scale with ``storage`` int8/int4 (consecutive elements of a weight); smaller is
    more exact and stores more scales (4 bytes per group)."""

    def __post_init__(self) -> None:
        self.tier = _choice("params.tier", self.tier, PARAM_TIERS)
        if self.dtype is not None:
            self.dtype = _choice("params.dtype", self.dtype, DTYPES, _DTYPE_ALIASES)
        self.storage = _choice("params.storage", self.storage, PARAM_STORAGES)
        self.group_size = _int("params.group_size", self.group_size, 8, 1 << 20)
        if self.group_size % 8:
            raise ConfigError(f"params.group_size: expected a multiple of 8, got {self.group_size}")


@dataclass
class OptimizerConfig:
    """Optimizer state: fp32 master weights plus the optimizer's own tensors (e.g. Adam moments)."""

    SECTION: ClassVar[str] = "optimizer"

    tier: str = "nvme"
    """Where master weights and optimizer states rest: ``cpu`` or ``nvme``. The step runs on the
    host either way."""

    update: str = "lazy"
    """When a step's update is applied to each unit: ``lazy`` (``step()`` records the update, with the
    learning rates, clip coefficient and loss scale of that moment, and each unit is updated when it is
    next fetched, before the next forward uses it, so the state's I/O hides behind that forward; anything
    that reads weights or state first applies what is pending) or ``step`` (every unit inside ``step()``,
    the weights and state up to date when it returns). Both give PyTorch's results exactly, with clipping,
    accumulation, schedulers and loss scaling."""

    def __post_init__(self) -> None:
        self.tier = _choice("optimizer.tier", self.tier, STATE_TIERS)
        self.update = _choice("optimizer.update", self.update, UPDATES)


@dataclass
class GradsConfig:
    """Gradient accumulators, from the end of backward until the optimizer step consumes them."""

    SECTION: ClassVar[str] = "grads"

    tier: str = "auto"
    """Where gradients rest after backward: ``cpu``, ``nvme``, or ``auto``: host memory when every
    accumulator fits the host budget beside a step's working set, else NVMe (with optimizer.tier nvme)."""

    def __post_init__(self) -> None:
        self.tier = _choice("grads.tier", self.tier, ("auto", *STATE_TIERS))


@dataclass
class ActivationsConfig:
    """The tensors autograd saves in a training forward for use in backward (activations)."""

    SECTION: ClassVar[str] = "activations"

    tier: str = "auto"
    """Where saved activations wait for backward: ``memory`` (where autograd keeps them), ``nvme`` (written
    to swap as forward makes them, read back ahead of backward's use, newest first), or ``auto``: entry
    picks ``nvme`` when training with another tier on NVMe and a step's activations, taken as the
    parameters' size, would be more than a quarter of memory.host_budget (at most 128 MiB with the CPU
    computing) or than the host memory left beside it; else ``memory`` (see docs/config.md)."""

    keep: int | None = field(default=None, metadata=_BYTES)
    """With ``tier: nvme``: bytes of each forward's saved activations that stay in memory, outside the host
    budget: the newest ones (backward needs them first), sized from the forward before; the rest go to
    NVMe. Null (the default): none when ``tier`` is ``nvme`` as set, a quarter of memory.host_budget (at
    most 128 MiB with the CPU computing) when ``auto`` picked ``nvme``, so a step holds at most that much
    beside the budget."""

    min_bytes: int = field(default=256 * 1024, metadata=_BYTES)
    """Saved tensors whose storage is smaller than this stay in memory (with ``tier: nvme``), as do views of
    less than a quarter of their storage."""

    buffer: int = field(default=64 * 1024**2, metadata=_BYTES)
    """The most host memory saved activations hold in the host cache at once (with ``tier: nvme``); part of
    memory.host_budget, so the other partitions are planned to fit the budget minus this."""

    def __post_init__(self) -> None:
        self.tier = _choice("activations.tier", self.tier, ACTIVATION_TIERS)
        self.min_bytes = _size("activations.min_bytes", self.min_bytes, minimum=1)
        self.buffer = _size("activations.buffer", self.buffer, minimum=IO_ALIGN, align=IO_ALIGN)
        self.keep = _optional_size("activations.keep", self.keep)

    @property
    def host_bytes(self) -> int:
        """Bytes of memory.host_budget the activations may take (none unless they go to NVMe)."""
        return self.buffer if self.tier == "nvme" else 0


@dataclass
class NvmeConfig:
    """The directories that hold the NVMe tier and how data is laid out across them."""

    SECTION: ClassVar[str] = "nvme"

    paths: tuple[str, ...] = ("/var/tmp/tiermem",)
    """Directories for swap files, stored absolute with ~ and $VARS expanded. With several,
    data is striped across them in stripe_size chunks, dealt by path_weights."""

    stripe_size: int = field(default=1024**2, metadata=_BYTES)
    """Bytes written to one directory before moving to the next; a multiple of 4 KiB."""

    path_weights: str | tuple[int, ...] = "auto"
    """Share of the stripe chunks each directory gets, one positive integer per nvme.paths entry: [1, 3]
    puts three chunks on the second for every one on the first, so a drive three times as fast carries
    three times the bytes of every transfer and both finish together (bandwidths add up). "auto" weighs
    the directories by the read GB/s `tiermem bench io --path DIR` cached for each one's filesystem, when
    every directory has such a figure and no two share a filesystem; otherwise it deals chunks equally."""

    checksum: bool = False
    """One CRC-32 per partition, taken over its bytes (up to the end of its last tensor) each time it is
    written back and kept in memory, not in the swap files; every read of it is checked against it."""

    keep_files: bool = False
    """Leave swap files in place on exit (for inspection) instead of deleting them."""

    def __post_init__(self) -> None:
        raw = _str_list("nvme.paths", self.paths, "directories")
        paths = tuple(_path(f"nvme.paths[{i}]", p) for i, p in enumerate(raw))
        for i, p in enumerate(paths):
            if p in paths[:i]:
                raise ConfigError(
                    f"nvme.paths[{i}]: {short_repr(p)} is listed twice; striping needs distinct"
                    " directories, so remove the duplicate"
                )
        self.paths = paths
        self.stripe_size = _size("nvme.stripe_size", self.stripe_size, minimum=1, align=IO_ALIGN)
        self.path_weights = _path_weights(self.path_weights, len(paths))
        self.checksum = _bool("nvme.checksum", self.checksum)
        self.keep_files = _bool("nvme.keep_files", self.keep_files)


@dataclass
class MemoryConfig:
    """Budgets that bound how much memory tiermem itself may hold."""

    SECTION: ClassVar[str] = "memory"

    host_budget: int = field(default=4 * 1024**3, metadata=_BYTES)
    """Host bytes tiermem holds: one pool, mapped at start (pinned with CUDA), that every partition's host
    copy comes from (parameters, gradients, optimizer state, saved activations and staging buffers)."""

    device_budget: int | None = field(default=None, metadata=_BYTES)
    """Cap on the device working set in bytes; None derives it from the prefetch settings."""

    cpu_allocator: str = "auto"
    """PyTorch's CPU allocator inside the context: ``auto`` tiermem's, which keeps glibc's heap from
    growing with holes that the compute's freed tensors leave (built at first use with the system's C++
    compiler; PyTorch's, with a warning, when it cannot be built), ``tiermem`` the same but an error when
    it cannot be built, ``torch`` PyTorch's own."""

    def __post_init__(self) -> None:
        self.host_budget = _size("memory.host_budget", self.host_budget, minimum=1)
        # The pool is one mmap of the whole budget (io/buffers.py); past the RAM it fails with a bare ENOMEM, or
        # succeeds under overcommit and swaps, neither of which names this key.
        ram = _physical_memory()
        if ram is not None and self.host_budget > ram:
            raise ConfigError(
                f"memory.host_budget: expected at most this machine's physical memory ({format_size(ram)}),"
                f" got {_human_size(self.host_budget)}; lower memory.host_budget"
            )
        self.device_budget = _optional_size("memory.device_budget", self.device_budget, minimum=1)
        self.cpu_allocator = _choice("memory.cpu_allocator", self.cpu_allocator, CPU_ALLOCATORS)


@dataclass
class PrefetchConfig:
    """How far ahead of the computing unit tiermem fetches (see docs/config.md)."""

    SECTION: ClassVar[str] = "prefetch"

    depth: int = 2
    """Units fetched ahead of the one computing; 0 fetches each unit only when it is needed."""

    max_bytes: int | None = field(default=None, metadata=_BYTES)
    """Cap in bytes on the prefetch window; None means only depth limits it."""

    keep_resident: bool = True
    """For inference, keep the largest units in host memory from pass to pass when the budget leaves room
    to stream the rest, instead of reading every unit on every pass; the window may shrink to fit."""

    def __post_init__(self) -> None:
        self.depth = _int("prefetch.depth", self.depth, 0)
        self.max_bytes = _optional_size("prefetch.max_bytes", self.max_bytes, minimum=1)
        self.keep_resident = _bool("prefetch.keep_resident", self.keep_resident)


@dataclass
class WrapConfig:
    """How modules are grouped into units, the granule that is fetched and released together."""

    SECTION: ClassVar[str] = "wrap"

    classes: tuple[str, ...] = ()
    """Module class names (e.g. ``LlamaDecoderLayer``) whose instances form units;
    empty uses the automatic size-based policy."""

    min_unit_bytes: int = field(default=1024**2, metadata=_BYTES)
    """Units smaller than this are merged with their neighbours; 0 never merges."""

    def __post_init__(self) -> None:
        self.classes = _str_list("wrap.classes", self.classes, "module class names")
        self.min_unit_bytes = _size("wrap.min_unit_bytes", self.min_unit_bytes)


@dataclass
class IOConfig:
    """The I/O engine that moves bytes between host buffers and the NVMe tier."""

    SECTION: ClassVar[str] = "io"

    engine: str = "auto"
    """Backend: ``io_uring``, ``threads``, or ``auto`` (io_uring when available, else threads)."""

    block_size: int = field(default=1024**2, metadata=_BYTES)
    """Bytes per read/write request: a transfer is split into requests of at most this size, each
    into or from its own piece of the host pool (no extra buffer); a multiple of 4 KiB."""

    queue_depth: int = 32
    """Requests kept in flight at once, 1 to 4096."""

    direct: bool = True
    """Open swap files with O_DIRECT, bypassing the page cache."""

    sqpoll: bool = False
    """Let a kernel thread poll the io_uring submission queue (io_uring only; costs a core)."""

    def __post_init__(self) -> None:
        self.engine = _choice("io.engine", self.engine, ENGINES)
        self.block_size = _size("io.block_size", self.block_size, minimum=1, align=IO_ALIGN)
        self.queue_depth = _int("io.queue_depth", self.queue_depth, 1, MAX_QUEUE_DEPTH)
        self.direct = _bool("io.direct", self.direct)
        self.sqpoll = _bool("io.sqpoll", self.sqpoll)


@dataclass
class TraceConfig:
    """A timeline of the run for ui.perfetto.dev or chrome://tracing (see [Note: traces] in tiermem/trace.py)."""

    SECTION: ClassVar[str] = "trace"

    path: str | None = None
    """File to write a Chrome trace / Perfetto JSON timeline to when the context ends: a span per unit's
    forward, backward and update, per read and write, per wait, and the bytes each tier holds; ``{rank}``
    is filled in under several ranks. null records nothing (``tm.trace(path)`` traces a block)."""

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path = _path("trace.path", self.path)


@dataclass
class KVConfig:
    """The KV cache of generation (each attention layer's keys and values), see [Note: tiered KV cache]."""

    SECTION: ClassVar[str] = "kv"

    tier: str = "memory"
    """Where a generation's keys and values rest between decoding steps: ``memory`` (transformers' own cache,
    outside memory.host_budget), ``cpu`` (in blocks in the host pool, counted in memory.host_budget; an error
    names this key when they do not fit), ``nvme`` (blocks homed in swap, the host pool their cache, read back
    ahead of the layer that needs them), or ``auto``: ``cpu`` while the blocks fit the host budget beside the
    parameters' working set, ``nvme`` for the blocks after that."""

    block_tokens: int = 16
    """Tokens per block: each layer's keys and values are cut along the sequence into blocks of this many
    tokens for the whole batch, one partition each; a full block is written once, the last one is appended to."""

    def __post_init__(self) -> None:
        self.tier = _choice("kv.tier", self.tier, KV_TIERS)
        self.block_tokens = _int("kv.block_tokens", self.block_tokens, 1, 1 << 20)


_SECTIONS: tuple[type[Any], ...] = (
    ParamsConfig,
    OptimizerConfig,
    GradsConfig,
    ActivationsConfig,
    NvmeConfig,
    MemoryConfig,
    PrefetchConfig,
    WrapConfig,
    IOConfig,
    TraceConfig,
    KVConfig,
)



@dataclass
class Config:
    """The whole swap-config. Build it with `load_config`; every field is checked on construction.

    Example::

        cfg = load_config("configs/nvme.yaml", prefetch__depth=4)
        cfg.params.tier        # 'nvme'
        cfg.io.block_size      # 1048576
    """

    device: str = "auto"
    """Compute device: ``auto`` (cuda if present, else cpu), ``cpu``, ``cuda`` or ``cuda:N``.
    Whether CUDA is really there is checked by the runtime, not here."""

    params: ParamsConfig = field(default_factory=ParamsConfig)
    """Where parameters rest and in which dtype."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Where master weights and optimizer states rest."""

    grads: GradsConfig = field(default_factory=GradsConfig)
    """Where gradients rest after backward."""

    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    """Where saved activations wait for backward."""

    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    """The NVMe tier's directories and layout."""

    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Host and device memory budgets."""

    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """The prefetch window."""

    wrap: WrapConfig = field(default_factory=WrapConfig)
    """How modules are grouped into units."""

    io: IOConfig = field(default_factory=IOConfig)
    """The I/O engine."""

    trace: TraceConfig = field(default_factory=TraceConfig)
    """The timeline trace."""

    kv: KVConfig = field(default_factory=KVConfig)
    """Where generation's KV cache rests."""

    origin: str = field(default="defaults", init=False, compare=False, repr=False)
    """Where this config came from (a file path, "a mapping", "defaults", plus overrides);
    format_config writes it in its header. Not a config key."""

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ConfigError(f"device: expected auto, cpu, cuda or cuda:N (N >= 0), got {_describe(self.device)}")
        for f in dataclasses.fields(self):
            cls = _section_class(f.name)
            value = getattr(self, f.name)
            if cls is not None and not isinstance(value, cls):
                raise ConfigError(
                    f"{f.name}: expected a {cls.__name__}, got {_describe(value)};"
                    " build configs from mappings with load_config"
                )
        self._check_combinations()

    @property
    def uses_nvme(self) -> bool:
        """True when any tier is ``nvme``, i.e. the NVMe directories and I/O engine are used."""
        return "nvme" in (self.params.tier, self.optimizer.tier, self.grads.tier, self.activations.tier, self.kv.tier)

    def _check_combinations(self) -> None:
        """Rules spanning components; each is explained under "Combination rules" in docs/config.md."""
        # Rule 1: the step reads gradients next to the optimizer state; with that state on the
        # host, spilling gradients to disk writes and rereads every byte for no saving at the step.
        if self.grads.tier == "nvme" and self.optimizer.tier != "nvme":
            raise ConfigError(
                f"grads.tier: 'nvme' needs optimizer.tier 'nvme', got optimizer.tier"
                f" {self.optimizer.tier!r}; set grads.tier: cpu or optimizer.tier: nvme"
            )
        # Rule 2: SQ polling is an io_uring feature; the thread pool has nothing to poll.
        if self.io.sqpoll and self.io.engine == "threads":
            raise ConfigError(
                "io.sqpoll: true needs io.engine 'io_uring' or 'auto', got io.engine 'threads';"
                " set io.sqpoll: false or change io.engine"
            )
        # Rule 3: a prefetch window larger than the device cap can never be filled.
        budget, window = self.memory.device_budget, self.prefetch.max_bytes
        if budget is not None and window is not None and window > budget:
            raise ConfigError(
                f"prefetch.max_bytes: expected at most memory.device_budget"
                f" ({_human_size(budget)}), got {_human_size(window)}; the prefetch window lives"
                " in device memory, so lower prefetch.max_bytes or raise memory.device_budget"
            )
        # Rule 4: the activations' buffer is carved out of the host budget; the partitions need the rest.
        if self.activations.host_bytes >= self.memory.host_budget:
            raise ConfigError(
                f"activations.buffer: expected less than memory.host_budget"
                f" ({_human_size(self.memory.host_budget)}), got {_human_size(self.activations.buffer)};"
                " it is part of the host budget, so lower activations.buffer or raise memory.host_budget"
            )
        if not self.uses_nvme:
            return
        # Rule 5: with an NVMe tier there must be somewhere to write it.
        if not self.nvme.paths:
            raise ConfigError(
                "nvme.paths: expected at least one directory because a tier is 'nvme', got [];"
                " add a directory or move every tier off nvme"
            )
        for i, path in enumerate(self.nvme.paths):
            _check_writable_dir(f"nvme.paths[{i}]", path)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain YAML-able values: sizes as exact strings like ``"1MiB"``
        (ints where no unit divides them), tuples as lists. ``load_config(cfg.to_dict()) == cfg``."""
        return _to_dict(self)


def _section_class(name: str) -> type[Any] | None:
    """Return the component class for section `name`, or None for scalar top-level keys."""
    for cls in _SECTIONS:
        if cls.SECTION == name:
            return cls
    return None


def _to_dict(obj: object) -> dict[str, Any]:
    """Turn one config dataclass into plain values (see Config.to_dict)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if not f.init:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _to_dict(value)
        elif f.metadata.get("bytes") and value is not None:
            out[f.name] = _human_size(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


# ---------------------------------------------------------------------------------------------
# Loading.

_T = TypeVar("_T")


# [Note: bounded YAML]
# A config file or a --set value is hostile input as far as the loader knows, so what it may cost is bounded:
# - size: at most MAX_CONFIG_BYTES of a file are read, before anything is parsed;
# - nesting: at most MAX_YAML_DEPTH levels (a swap-config needs 3). PyYAML composes nodes recursively, so the
#   depth is checked on the way down, long before Python's recursion limit;
# - aliases: PyYAML makes each alias a second reference to the node it names, so a "billion laughs" file
#   parses in microseconds into a small graph that is a billion values once something walks it (validation,
#   an error message's repr). Counting alias events would not bound that (each alias in a chain can double
#   the size), and refusing aliases would break anchors and merge keys, which a config may use to share a
#   section. So as each node is composed, its size and depth with every alias expanded are worked out from
#   its children's (a sum and a max, cheap however large the expansion), and a value past MAX_YAML_VALUES
#   values or MAX_YAML_DEPTH levels is refused where it starts. That also bounds the aliases themselves (each
#   counts at least one value). An alias used inside the value it names would make a value that contains
#   itself, and is refused;
# - integers: at most MAX_YAML_INT_CHARS characters. Python refuses to read one past 4300 digits with a bare
#   ValueError, and YAML 1.1's base-60 integers (1:30:00) take time quadratic in their length.
# Every limit is far above what a swap-config needs, and each failure is a ConfigError naming the file (or the
# --set key), line and column. The values themselves are checked, and named by key, by the components.

MAX_CONFIG_BYTES = 1024**2
MAX_YAML_DEPTH = 32
MAX_YAML_VALUES = 10_000
MAX_YAML_INT_CHARS = 64


def _at(mark: yaml.Mark) -> str:
    """Where a YAML mark points, as source:line:column."""
    return f"{mark.name}:{mark.line + 1}:{mark.column + 1}"


class _StrictLoader(yaml.SafeLoader):
    """A safe YAML loader with the bounds of [Note: bounded YAML] that refuses a key given twice in one
    mapping (PyYAML keeps the last)."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self.name = source  # marks, and so every message, name the file or --set key, not "<unicode string>"
        self._depth = 0  # levels down to the node being composed; the document's top is 1
        self._expanded: dict[int, tuple[int, int]] = {}  # id(node) -> (values, levels) with aliases expanded

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        mark = self.peek_event().start_mark
        alias = self.check_event(yaml.AliasEvent)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise ConfigError(f"{_at(mark)}: nested deeper than {MAX_YAML_DEPTH} levels; a swap-config needs 3")
            node = super().compose_node(parent, index)
            if node is None:
                return None
            expanded = self._expanded.get(id(node))
            if expanded is None:
                if alias:  # named by an anchor whose value is still being composed, around this alias
                    raise ConfigError(f"{_at(mark)}: this alias is inside the value it names, so that value"
                                      " contains itself; write the value out")
                expanded = self._expand(node)
                self._expanded[id(node)] = expanded
            values, levels = expanded
            if values > MAX_YAML_VALUES:
                raise ConfigError(f"{_at(mark)}: this holds more than {MAX_YAML_VALUES} values once its aliases"
                                  " are expanded; a swap-config has about 40")
            if self._depth - 1 + levels > MAX_YAML_DEPTH:
                raise ConfigError(f"{_at(mark)}: nested deeper than {MAX_YAML_DEPTH} levels once its aliases are"
                                  " expanded; a swap-config needs 3")
            return node
        finally:
            self._depth -= 1

    def _expand(self, node: yaml.Node) -> tuple[int, int]:
        """(values, levels) of a node just composed, from its children's (composed before it)."""
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            return 1, 1
        sizes = [self._expanded[id(child)] for child in children]
        return 1 + sum(v for v, _ in sizes), 1 + max((lv for _, lv in sizes), default=0)


def _construct_mapping_no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
    seen: dict[str, yaml.Node] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
            continue  # merge keys (<<) and non-string keys are left to PyYAML and _build
        key = key_node.value
        if key in seen:
            line = key_node.start_mark.line + 1
            first = seen[key].start_mark.line + 1
            raise ConfigError(
                f"{key_node.start_mark.name}:{line}: key {short_repr(key)} is given twice (first on line {first});"
                " keep one"
            )
        seen[key] = key_node
    return loader.construct_mapping(node)


def _construct_bounded_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    if len(node.value) > MAX_YAML_INT_CHARS:
        raise ConfigError(
            f"{_at(node.start_mark)}: integer {short_repr(node.value)} is too long ({len(node.value)} characters,"
            f" at most {MAX_YAML_INT_CHARS})"
        )
    return loader.construct_yaml_int(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_no_duplicates)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_bounded_int)


def parse_yaml(text: str, source: str) -> Any:
    """Parse one YAML document within the bounds of [Note: bounded YAML].

    `source` names the text in messages: a file path, or the key a ``--set`` value is for. Every failure is
    a ConfigError that starts with it (and the line and column when there are some).
    """
    try:
        loader = _StrictLoader(text, source)  # PyYAML's Reader refuses control characters here, before parsing
    except yaml.reader.ReaderError as exc:
        raise ConfigError(_unprintable(text, source, exc)) from None
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(f"{_at(mark) if mark else source}: not valid YAML: {_clip(problem)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_clip(str(exc))}") from None
    finally:
        loader.dispose()


def _unprintable(text: str, source: str, exc: yaml.reader.ReaderError) -> str:
    """The message for a character YAML does not allow (a NUL byte, another control character), at its line and
    column."""
    position = exc.position if isinstance(exc.position, int) else 0
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    char = exc.character if isinstance(exc.character, int) else ord(text[position]) if position < len(text) else 0
    control = char < 0x20 or 0x7F <= char <= 0x9F
    what = "a NUL byte" if char == 0 else f"the {'control ' if control else ''}character U+{char:04X}"
    return (f"{source}:{line}:{column}: not valid YAML: {what}, which YAML does not allow in text; remove it (a "
            "swap-config is plain text: check that this is the file meant)")


def _clip(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters; PyYAML's problems quote the input, which may be long."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_yaml(path: str) -> Any:
    """Parse YAML file `path`; every failure becomes a ConfigError naming the path (and line)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)  # no more, whatever the path turns out to be
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist; check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: expected a YAML file, got a directory") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: config file is larger than {format_size(MAX_CONFIG_BYTES)}; a swap-config is a few hundred"
            " bytes, so check the path"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 text ({exc.reason})") from None
    return parse_yaml(text, path)


_REPLACED = {  # keys of earlier versions: what to write instead
    "optimizer.overlap_backward": "was replaced by optimizer.update; its default, lazy, hides the update behind "
                                  "the next forward and works with clipping and accumulation: delete the key",
}


def _build(cls: type[_T], raw: object, prefix: str) -> _T:
    """Construct dataclass `cls` from mapping `raw`, refusing unknown keys; `prefix` is its key path."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    if raw is None:  # "params:" with everything under it commented out means all defaults
        raw = {}
    if not isinstance(raw, Mapping):
        where = prefix or "top level"
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(names)}, got {_describe(raw)}")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}.{_key_text(key)}" if prefix else _key_text(key)
        if path in _REPLACED:
            raise ConfigError(f"{path}: {_REPLACED[path]}")
        if not isinstance(key, str) or key not in names:
            hint = _suggest(str(key), names) or f"; expected one of {', '.join(names)}"
            raise ConfigError(f"{path}: unknown key{hint}")
        section = _section_class(key) if cls is Config else None
        kwargs[key] = _build(section, value, path) if section is not None else value
    return cls(**kwargs)


def _normalise_override_key(key: str) -> list[str]:
    """Split an override key, ``"prefetch.depth"`` or ``"prefetch__depth"``, into segments."""
    parts = key.replace("__", ".").split(".")
    if not all(parts):
        raise ConfigError(f"{key}: malformed override key; write section.key or section__key, e.g. prefetch.depth")
    return parts


def _merge(into: dict[str, Any], value: Mapping[str, Any]) -> None:
    """Deep-merge `value` into `into`, so an override of a whole section keeps unnamed keys."""
    for k, v in value.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), Mapping):
            inner = dict(into[k])
            _merge(inner, v)
            into[k] = inner
        else:
            into[k] = v


def _apply_override(raw: dict[str, Any], key: str, value: object) -> None:
    """Set dotted `key` in the raw mapping; validation happens later with everything else."""
    parts = _normalise_override_key(key)
    names = {f.name for f in dataclasses.fields(Config) if f.init}
    if len(parts) > 1 and parts[0] in names and _section_class(parts[0]) is None:
        raise ConfigError(
            f"{'.'.join(parts[:2])}: unknown key; {parts[0]} takes a value, not keys, so override it as {parts[0]}=..."
        )
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, Mapping):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"{where}: cannot apply override {'.'.join(parts)} because {where} is {_describe(child)}, not a mapping"
            )
        child = dict(child)
        node[part] = child
        node = child
    _merge(node, {parts[-1]: value})  # a mapping value merges into its section, anything else replaces


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    **overrides: Any,
) -> Config:
    """Build and validate a `Config`.

    Args:
        source: None for the defaults; a YAML file path (str or PathLike); a mapping shaped like
            the YAML; or a `Config`, which is copied. Keys left out take their defaults.
        **overrides: values set after reading `source`, keyed by dotted path
            (``**{"prefetch.depth": 4}``) or, as plain keywords, with ``__`` for the dots
            (``prefetch__depth=4``). They are checked exactly like YAML values, so
            ``io__block_size="4MiB"`` works. A mapping value is merged into its section.

    Returns:
        The validated config; byte counts are ints, ``nvme.paths`` a tuple of absolute paths.

    Raises:
        ConfigError: the message starts with the key path (or the file path for a file that
            cannot be read or parsed) and says what was expected and what was got.

    Example::

        cfg = load_config("configs/nvme.yaml", prefetch__depth=4, **{"io.queue_depth": 64})
    """
    raw: Any
    if source is None:
        raw, origin = {}, "defaults"
    elif isinstance(source, Config):
        raw, origin = source.to_dict(), source.origin
    elif isinstance(source, Mapping):
        raw, origin = dict(source), "a mapping"
    elif isinstance(source, (str, os.PathLike)):
        origin = os.fspath(source)
        raw = _read_yaml(origin)
        if raw is None:  # an empty (or all-comment) file means all defaults
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{origin}: expected a mapping of config keys at the top level, got {_describe(raw)}")
    else:
        raise ConfigError(f"source: expected None, a YAML path, a mapping or a Config, got {_describe(source)}")
    if overrides:
        raw = dict(raw)
        for key, value in overrides.items():
            _apply_override(raw, key, value)
        shown = ", ".join(f"{'.'.join(_normalise_override_key(k))}={short_repr(v)}" for k, v in overrides.items())
        origin = f"{origin} with overrides {shown}"
    cfg = _build(Config, raw, "")
    cfg.origin = origin
    logger.debug("loaded tiermem config from %s", origin)
    return cfg


def format_config(cfg: Config) -> str:
    """Return `cfg` as YAML text with every key filled in, headed by a comment naming its origin.

    ``load_config`` reads the text back to an equal `Config`.
    """
    body = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)
    origin = " ".join(cfg.origin.split())  # keep the header on one comment line
    return f"# tiermem config from {origin}; defaults filled in\n{body}"
