"""Generation's KV cache in tiers: each attention layer's keys and values in blocks, each block a partition.

# [Note: tiered KV cache]
With kv.tier other than memory, the runtime puts layers of its own into the transformers cache a model's
forward is given (generate() makes a DynamicCache and passes it to every step), so generate() runs
unchanged; `tm.kv_cache()` makes one to pass by hand. Only a cache no forward has filled is taken, and only
its plain full-attention layers (sliding-window layers are bounded and stay as they are); an encoder-decoder's
EncoderDecoderCache has its self-attention cache taken (see `KVStore.adopt`).

A layer's keys and values are cut along the sequence into blocks of kv.block_tokens tokens for the whole
batch, one partition each, laid out token-major ([tokens, batch, heads, key dim + value dim]): appending a
token writes a suffix of the last block, the only one that changes. A block that fills is written once
(with an NVMe home) and from then on only read; the last, partial block is kept in host memory while the
partial blocks of every layer take at most an eighth of the host budget. Where blocks rest:
- cpu: in the host pool for good, counted in memory.host_budget. A block that does not fit beside what the
  parameters need (the partitions homed on the host, and room to read the largest streamed unit) is a
  BudgetError naming kv.tier and memory.host_budget;
- nvme: homed in swap with the host pool as their cache, evicted like the parameters; an update needs two
  of its layer's blocks beside the units computing, and a block size that cannot have that names
  kv.block_tokens;
- auto: cpu while the blocks leave room for two of the largest streamed units (the one computing and one
  read ahead), nvme for the blocks after that.
Each block follows the unit that computes its layer (the unit acquired last among those in use when the
layer first updates): the runtime's schedule orders its eviction by that unit's next use (while that unit
computes and the layer has not updated, by "now": see `Runtime.follow`), and when that unit enters the
prefetch window its blocks are read to the host with it (`Runtime._prefetch`), or, while a unit computing
has a layer still to update, once that update ends (`KVStore.prefetch`). At update
the layer waits for its blocks, copies them and the new tokens into one keys and one values tensor on the
compute device (as DynamicCache makes one by concatenation every step; they go when attention is done with
them), and appends the new tokens to its blocks. A cache the program drops gives its blocks back at the
next update; exit gives back every block, and a layer used after exit raises.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tiermem.errors import BudgetError, OffloadError
from tiermem.io.buffers import align_up
from tiermem.sizes import format_size
from tiermem.swap import Layout, Partition, Tier

try:
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, EncoderDecoderCache
except ImportError as exc:  # transformers is an extra; older ones have no cache layers
    raise OffloadError(f"kv.tier other than memory needs transformers 5 (its cache layers): {exc}; install "
                       "transformers, or set kv.tier: memory") from exc

if TYPE_CHECKING:
    from tiermem.runtime.unit import Unit
    from tiermem.swap import TensorSwapper

log = logging.getLogger(__name__)


class RuntimeFace(Protocol):
    """What the KV store needs of the runtime that owns it (tiermem/runtime/runtime.py imports this module,
    not the other way round): its units, its swapper, and to have a block evicted by a unit's next use."""

    units: list[Unit]
    swapper: TensorSwapper

    def follow(self, part: object, unit: int) -> None: ...

    def unfollow(self, part: object) -> None: ...

    def entered_at(self, unit: int) -> int | None: ...

TAIL_SHARE = 8  # partial blocks kept in host memory take at most 1/TAIL_SHARE of the host budget


class _Block:
    """One partition of a layer's keys and values: kv.block_tokens tokens of the whole batch."""

    __slots__ = ("part", "filled", "dirty_end", "kept")

    def __init__(self, part: Partition) -> None:
        self.part = part
        self.filled = 0  # tokens written so far
        self.dirty_end = part.size  # bytes from the start newer than the NVMe copy (a new block has none)
        self.kept = False  # kept resident as the layer's partial block


class _Group:
    """The layers of one cache, prefetched while it is the cache in use."""

    __slots__ = ("layers", "__weakref__")

    def __init__(self) -> None:
        self.layers: weakref.WeakSet[TieredLayer] = weakref.WeakSet()


class TieredLayer(CacheLayerMixin):
    """A transformers cache layer whose keys and values live in swapper partitions (see [Note: tiered KV cache])."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, store: KVStore, group: _Group, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers cache layer, untyped
        self.store = store
        self.group = group  # the cache this layer belongs to
        self.index = index  # its place in the cache, for messages
        self.blocks: list[_Block] = []  # in sequence order; the list object is kept for the finalizer
        self.length = 0  # tokens cached
        self.read_at = -1  # the swapper's clock when an update last ended (its blocks read and appended to)
        self.unit: int | None = None  # the unit that computes this layer, found at the first update
        self.shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # batch, heads, key dim, value dim
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        group.layers.add(self)
        store.layers.add(self)
        ref = weakref.ref(self, store.dead.append)  # a dropped cache's blocks go back (a builtin callback: see
        store.dying[id(ref)] = (ref, self.blocks)  # _brief_done in runtime.py)

    # -- transformers' cache layer interface ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        if value_states.shape[:2] != (b, h):
            raise OffloadError(f"kv.tier: keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} of "
                               f"layer {self.index} differ in batch or heads; set kv.tier: memory for this model")
        self.shape = (b, h, dk, value_states.shape[-1])
        self.dtype = key_states.dtype
        self.device = key_states.device
        self.is_initialized = True
        self.store.check_block_fits(self)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys and values; return the whole sequence's (on the compute device)."""
        store = self.store
        store.check_open()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store.begin_update(self)
        b, h, dk, dv = self.shape
        n = key_states.shape[-2]
        if key_states.shape != (b, h, n, dk) or value_states.shape != (b, h, n, dv):
            raise OffloadError(f"kv.tier: layer {self.index} was given keys {tuple(key_states.shape)} and values "
                               f"{tuple(value_states.shape)}, its cache holds {(b, h, dk)} and {(b, h, dv)}")
        keys = store.empty((b, h, self.length + n, dk), self.dtype)
        values = store.empty((b, h, self.length + n, dv), self.dtype)
        self._read_into(keys, values)
        keys[:, :, self.length:].copy_(key_states)
        values[:, :, self.length:].copy_(value_states)
        self._append(key_states, value_states)
        self.read_at = store.swapper.clock
        store.run_deferred()
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        """Nothing: the runtime moves the blocks (transformers' own offloading does not apply)."""

    def prefetch(self) -> None:
        """Nothing: the runtime reads the blocks ahead (see [Note: tiered KV cache])."""

    def reset(self) -> None:
        self.store.free(self.blocks)
        self.blocks.clear()
        self.length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as "
                             "transformers' DynamicLayer takes it")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        n = self.store.block_tokens
        keep = -(-self.length // n)
        self.store.free(self.blocks[keep:])
        del self.blocks[keep:]
        if self.blocks:
            self.blocks[-1].filled = self.length - n * (keep - 1)
            self.store.keep_tail(self.blocks[-1])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rewrite(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rewrite(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rewrite(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices, ...])

    # -- the blocks -----------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in a block: keys and values of every sequence and head."""
        b, h, dk, dv = self.shape
        return b * h * (dk + dv) * self.dtype.itemsize

    def block_spec(self) -> list[tuple[str, torch.Tensor]]:
        b, h, dk, dv = self.shape
        return [("kv", torch.empty((self.store.block_tokens, b, h, dk + dv), dtype=self.dtype, device="meta"))]

    def _read_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy every cached token into `keys` and `values` ([batch, heads, tokens, dim]), block by block."""
        store, sw = self.store, self.store.swapper
        dk = self.shape[2]
        for blk in self.blocks:  # every read in flight at once; those that find no room now are read below
            store.fetch(blk)
        pos = 0
        for blk in self.blocks:
            store.note_read(blk)
            t0 = time.perf_counter()
            views = sw.acquire(blk.part, Tier.HOST)
            store.stall_seconds += time.perf_counter() - t0
            try:
                kv = views["kv"][: blk.filled].permute(1, 2, 0, 3)
                keys[:, :, pos:pos + blk.filled].copy_(kv[..., :dk])
                values[:, :, pos:pos + blk.filled].copy_(kv[..., dk:])
            finally:
                sw.release(blk.part, tier=Tier.HOST)
            pos += blk.filled

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        store, sw = self.store, self.store.swapper
        new = torch.cat([key_states, value_states], dim=-1).permute(2, 0, 1, 3)  # [tokens, batch, heads, dk + dv]

        def write(blk: _Block, done: int, take: int) -> None:
            store.note_read(blk)
            views = sw.acquire(blk.part, Tier.HOST)
            try:
                views["kv"][blk.filled:blk.filled + take].copy_(new[done:done + take])
            finally:
                sw.release(blk.part, dirty=True, dirty_end=(blk.filled + take) * self.token_bytes, tier=Tier.HOST)

        self.append_tokens(new.shape[0], write)

    def append_tokens(self, total: int, write: Callable[[_Block, int, int], None]) -> None:
        """Cut `total` new tokens into blocks: a new block whenever the last is full, `write(block, tokens done,
        tokens taken)` for each piece, then the block sealed when it fills or kept as the partial one. The plan
        (tiermem/planning.py) places a generate()'s blocks with it, writing nothing."""
        store, n = self.store, self.store.block_tokens
        done = 0
        while done < total:
            if not self.blocks or self.blocks[-1].filled == n:
                self.blocks.append(store.new_block(self))
            blk = self.blocks[-1]
            take = min(n - blk.filled, total - done)
            write(blk, done, take)
            blk.dirty_end = max(blk.dirty_end, (blk.filled + take) * self.token_bytes)
            blk.filled += take
            done += take
            if blk.filled == n:
                store.seal(blk)
            else:
                store.keep_tail(blk)
        self.length += total

    def _rewrite(self, change: Any) -> None:
        """Apply `change` to the whole keys and values (beam search, batch selection) and store them again."""
        if not self.is_initialized or self.length == 0:
            return
        b, h, dk, dv = self.shape
        keys = torch.empty((b, h, self.length, dk), dtype=self.dtype)
        values = torch.empty((b, h, self.length, dv), dtype=self.dtype)
        self._read_into(keys, values)
        keys, values = change(keys), change(values)
        self.reset()
        self.lazy_initialization(keys, values)
        self._append(keys, values)


class KVStore:
    """The blocks of every tiered cache of one `tiered_offload` context: placement, prefetch, stats, exit."""

    def __init__(self, runtime: RuntimeFace) -> None:
        self.runtime = runtime
        self.swapper = runtime.swapper
        cfg = self.swapper.config.kv
        self.tier = cfg.tier
        self.block_tokens = cfg.block_tokens
        self.layers: weakref.WeakSet[TieredLayer] = weakref.WeakSet()  # every live tiered layer, freed at exit
        # layers the program dropped (their references, appended by the references' callbacks) and, by reference,
        # the blocks of every layer alive
        self.dead: list[weakref.ref[TieredLayer]] = []
        self.dying: dict[int, tuple[weakref.ref[TieredLayer], list[_Block]]] = {}
        self._names = itertools.count()  # partition names kv.0, kv.1, ...
        self.active: _Group | None = None  # the cache updated last: the one whose blocks are prefetched
        self._deferred: list[int] | None = None  # a window whose blocks wait for a layer's update (see prefetch)
        self.host_bytes = 0  # blocks homed on the host (kv.tier cpu or auto)
        self.tail_bytes = 0  # partial blocks kept resident
        self.closed = False
        self.reset_stats()

    def reset_stats(self) -> None:
        self.bytes_read = 0  # bytes of blocks read back from NVMe
        self.bytes_written = 0  # bytes of blocks written to NVMe
        self.stall_seconds = 0.0  # time updates waited for blocks
        self.peak_bytes = self.bytes_now()

    def bytes_now(self) -> int:
        return sum(blk.part.size for layer in list(self.layers) for blk in layer.blocks)

    def streamed(self) -> dict[int, int]:
        """unit -> bytes of the active cache's blocks read from NVMe with it (those not kept in host memory),
        for the resident plan (see [Note: resident units])."""
        out: dict[int, int] = {}
        group = self.active
        if group is None or self.closed:
            return out
        for layer in list(group.layers):
            if layer.unit is None:
                continue
            n = sum(blk.part.size for blk in layer.blocks if blk.part.home is Tier.NVME and not blk.kept)
            if n:
                out[layer.unit] = out.get(layer.unit, 0) + n
        return out

    def collect(self) -> None:
        """Give back the blocks of the caches the program dropped."""
        while self.dead:
            self.free(self.dying.pop(id(self.dead.pop()))[1])

    def stats(self) -> dict[str, Any]:
        self.collect()
        nvme = sum(blk.part.size for layer in list(self.layers) for blk in layer.blocks
                   if blk.part.home is Tier.NVME)
        return {"kv_tier": self.tier, "kv_bytes": self.bytes_now(), "kv_peak_bytes": self.peak_bytes,
                "kv_host_home_bytes": self.host_bytes, "kv_nvme_home_bytes": nvme,
                "kv_bytes_read": self.bytes_read, "kv_bytes_written": self.bytes_written,
                "kv_stall_seconds": self.stall_seconds}

    # -- caches ---------------------------------------------------------------------------------------
    def on_forward(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """The model's forward pre-hook: tier the cache it is given, or make one when asked for use_cache=True."""
        self.collect()
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:
            if kwargs.get("use_cache") is True and "past_key_values" not in kwargs:
                kwargs["cache"] = self.new_cache(getattr(module, "config", None))
                return args, kwargs
            return None
        self.adopt(cache)
        return None

    def new_cache(self, config: Any = None) -> Cache:
        """A DynamicCache (of `config`, a transformers model config, when given) with tiered layers."""
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
        self.adopt(cache)
        return cache

    def adopt(self, cache: Any) -> bool:
        """Give `cache` tiered layers if it is a transformers Cache no forward has filled; True when it has them.
        An encoder-decoder's cache has its decoder's self-attention cache tiered: that one grows with every token,
        while the cross-attention cache holds the encoder's keys and values, whose length the prompt fixes, and
        transformers reads its layers' tensors directly, so it stays as it is (as sliding-window layers do)."""
        self.check_open()
        if getattr(cache, "_tiermem_kv", None) is self:
            return True
        if isinstance(cache, EncoderDecoderCache):
            return self.adopt(cache.self_attention_cache)
        if not isinstance(cache, Cache) or getattr(cache, "offloading", False):
            return False
        if not isinstance(getattr(cache, "layers", None), list):  # a cache class of its own: left as it is
            log.debug("kv.tier: leaving a %s without cache layers as it is", type(cache).__name__)
            return False
        plain = [type(layer) is DynamicLayer for layer in cache.layers]
        filled = any(getattr(layer, "is_initialized", False) for layer in cache.layers)
        if filled or cache.layer_class_to_replicate not in (None, DynamicLayer) or (cache.layers and not any(plain)):
            log.debug("kv.tier: leaving a %s that holds tokens or no plain layers as it is", type(cache).__name__)
            return False
        group = _Group()
        cache.layers = [TieredLayer(self, group, i) if p else layer
                        for i, (layer, p) in enumerate(zip(cache.layers, plain, strict=True))]
        if cache.layer_class_to_replicate is DynamicLayer:
            # transformers calls it with no arguments for each layer it adds: a factory does as well as a class
            cache.layer_class_to_replicate = lambda: TieredLayer(self, group, len(cache.layers))  # type: ignore
        cache._tiermem_kv = self  # type: ignore[attr-defined]
        return True

    def check_open(self) -> None:
        if self.closed:
            raise OffloadError("a tiered KV cache was used after its tiered_offload context ended; make a new "
                               "cache (or call generate) inside the context")

    def begin_update(self, layer: TieredLayer) -> None:
        """Give back dropped caches' blocks; find the unit computing `layer`; make its cache the active one."""
        self.collect()
        if layer.unit is None:
            held = [u for u in self.runtime.units if u.depth > 0]
            if held:
                layer.unit = max(held, key=lambda u: u.partition.last_used).index
                for blk in layer.blocks:
                    self.runtime.follow(blk.part, layer.unit)
        self.active = layer.group

    def prefetch(self, window: list[int]) -> None:
        """Start reading the blocks of the active cache's layers computed by the units in `window`. While a
        unit computing has a layer whose update is still to come, the reads wait for the end of that update:
        read ahead first, the window's blocks would take the room that layer's own blocks need, and its update
        would evict them to read its own (under a tight budget, every step read them twice)."""
        group = self.active
        if group is None or self.closed:
            return
        layers = list(group.layers)
        for layer in layers:
            if layer.unit is not None and layer.blocks:
                entered = self.runtime.entered_at(layer.unit)
                if entered is not None and layer.read_at <= entered:
                    self._deferred = window
                    return
        self._deferred = None
        for layer in layers:
            if layer.unit in window:
                for blk in layer.blocks:
                    self.fetch(blk)

    def run_deferred(self) -> None:
        """A layer's update has read its blocks: start the reads `prefetch` put off for it."""
        if self._deferred is not None:
            self.prefetch(self._deferred)

    # -- blocks ---------------------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor on the compute device for a layer's whole keys or values."""
        mover = self.swapper.mover
        if not mover.has_own_memory:
            return torch.empty(shape, dtype=dtype)
        n = 1
        for s in shape:
            n *= s
        return mover.empty(n * dtype.itemsize).view(dtype).view(shape)

    def _room(self, streamed: int) -> tuple[int, int]:
        """(host bytes left for the KV cache, what the parameters need of the budget): the budget less the
        partitions homed on the host (other than KV blocks) and `streamed` bytes for units read from NVMe."""
        sw = self.swapper
        fixed = sum(p.size for p in sw.partitions.values() if p.home is not Tier.NVME) - self.host_bytes
        return sw.partition_budget - fixed - streamed, fixed + streamed

    def _largest_streamed(self) -> int:
        return max((u.partition.size for u in self.runtime.units if u.partition.home is Tier.NVME), default=0)

    def check_block_fits(self, layer: TieredLayer) -> None:
        """A layer's update holds two of its blocks at once (one read, its partial one): refuse a block size that
        cannot fit beside the parameters, before anything is placed."""
        if self.tier == "cpu":
            return  # every block stays: `_home` refuses the first that does not fit, naming kv.tier
        size = Layout.of(layer.block_spec()).size
        held = sum(u.partition.size for u in self.runtime.units if u.depth > 0 and u.partition.home is Tier.NVME)
        room, need = self._room(held)  # the units computing now, and the two blocks
        if 2 * size > room:
            b, h, dk, dv = layer.shape
            raise BudgetError(
                f"kv.block_tokens: a block of {self.block_tokens} tokens of layer {layer.index} ({b} sequences x {h} "
                f"heads x {dk}+{dv} dims, {format_size(size)}) needs {format_size(2 * size)} of host memory at "
                f"update, and {self.swapper.budget_text} leaves {format_size(max(room, 0))} beside the parameters' "
                f"{format_size(need)}; lower kv.block_tokens or the batch, or raise memory.host_budget")

    def new_block(self, layer: TieredLayer) -> _Block:
        spec = layer.block_spec()
        size = Layout.of(spec).size
        home = self._home(layer, size)
        try:
            part = self.swapper.add(f"kv.{next(self._names)}", spec, home=home, fill=_nothing)
        except BudgetError as exc:
            raise BudgetError(f"kv.tier: {self.tier}: a KV block of layer {layer.index} ({format_size(size)}) does "
                              f"not fit {self.swapper.budget_text}: {exc}; raise memory.host_budget or lower "
                              "kv.block_tokens") from exc
        if home is Tier.HOST:
            self.host_bytes += size
        if layer.unit is not None:
            self.runtime.follow(part, layer.unit)
        self.peak_bytes = max(self.peak_bytes, self.bytes_now() + size)
        return _Block(part)

    def _home(self, layer: TieredLayer, size: int) -> Tier:
        if self.tier == "nvme":
            return Tier.NVME
        # cpu: room for one streamed unit at a time is the least the parameters can run in; auto moves on to NVMe
        # while the streamed units still have room for one read ahead
        room, need = self._room((1 if self.tier == "cpu" else 2) * self._largest_streamed())
        if self.host_bytes + size <= room:
            return Tier.HOST
        if self.tier == "auto":
            return Tier.NVME
        raise BudgetError(
            f"kv.tier: cpu keeps the KV cache in host memory, and layer {layer.index}'s next block "
            f"({format_size(size)}) does not fit: the cache holds {format_size(self.host_bytes)} and "
            f"{self.swapper.budget_text} leaves {format_size(max(room, 0))} beside the parameters' "
            f"{format_size(need)}; raise memory.host_budget, set kv.tier: nvme or auto, or generate fewer tokens "
            "or a smaller batch")

    def fetch(self, blk: _Block) -> None:
        """Start reading `blk` to the host if it is not there (never waits; skipped when there is no room)."""
        sw = self.swapper
        if blk.part.home is Tier.NVME and not sw.holds_host(blk.part):
            if sw.prefetch(blk.part, Tier.HOST) is not None:
                self.note_read(blk, started=True)

    def note_read(self, blk: _Block, *, started: bool = False) -> None:
        """Count the read of `blk` (and the write-back of its eviction) when its bytes left the host."""
        if blk.part.home is not Tier.NVME or (not started and self.swapper.holds_host(blk.part)):
            return
        if blk.dirty_end:  # evicted while newer than its NVMe copy: the eviction wrote it
            self.bytes_written += min(blk.part.size, align_up(blk.dirty_end))
            blk.dirty_end = 0
        self.bytes_read += blk.part.size

    def seal(self, blk: _Block) -> None:
        """A block that filled: no longer kept as a partial one; with an NVMe home written now, once."""
        self._unkeep(blk)
        if blk.part.home is Tier.NVME and blk.dirty_end:
            self.swapper.write_back(blk.part)
            self.bytes_written += min(blk.part.size, align_up(blk.dirty_end))
            blk.dirty_end = 0

    def keep_tail(self, blk: _Block) -> None:
        """Keep a layer's partial block in host memory while partial blocks take under 1/TAIL_SHARE of it."""
        if blk.kept or blk.part.home is not Tier.NVME:
            return
        if self.tail_bytes + blk.part.size <= self.swapper.partition_budget // TAIL_SHARE:
            self.swapper.keep_resident(blk.part, True)
            blk.kept = True
            self.tail_bytes += blk.part.size

    def _unkeep(self, blk: _Block) -> None:
        if blk.kept:
            self.swapper.keep_resident(blk.part, False)
            blk.kept = False
            self.tail_bytes -= blk.part.size

    def free(self, blocks: list[_Block]) -> None:
        """Give back the memory and swap space of `blocks`."""
        for blk in blocks:
            self._unkeep(blk)
            if blk.part.home is Tier.HOST:
                self.host_bytes -= blk.part.size
            self.runtime.unfollow(blk.part)
            if blk.part.name in self.swapper.partitions:
                self.swapper.remove(blk.part)

    def close(self) -> None:
        """Exit: give back every block; the layers left raise if used again."""
        if self.closed:
            return
        self.collect()
        for layer in list(self.layers):
            self.free(layer.blocks)
            layer.blocks.clear()
            layer.length = 0
        self.active = None
        self.closed = True


def _nothing(views: dict[str, torch.Tensor]) -> None:
    """A new block's bytes are written as tokens arrive: nothing to fill."""
