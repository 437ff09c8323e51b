"""The tiermem exception hierarchy: every error tiermem raises on purpose derives from TiermemError.

All of them are defined here, and this module imports nothing from tiermem, so any module can import from it
without a cycle. The modules that raise them import them from here (and so still offer them under their
old names, e.g. `tiermem.offload.RestoreError`)::

    TiermemError
    ├── ConfigError (also ValueError)
    ├── IOEngineError
    ├── IOTimeoutError (also TimeoutError)
    ├── ReadPastEndError (also EOFError)
    ├── StoreError
    │   └── CorruptDataError
    ├── BudgetError
    ├── StateError
    ├── DeviceMismatchError
    ├── CPUAllocatorError
    ├── CheckpointError
    ├── OffloadError
    │   └── RestoreError
    ├── OptimizerError
    ├── RanksError
    ├── BenchArgError
    └── DemoArgError
"""

from __future__ import annotations


class TiermemError(Exception):
    """Root of every error tiermem raises deliberately; catch this to handle them all."""


class ConfigError(TiermemError, ValueError):
    """A configuration value is wrong; the message names the key path and the fix.

    Raised while loading or validating a config (YAML file, overrides, `Config` fields) and when a setting
    cannot be met on this machine (e.g. `device: cuda` without CUDA)."""


class IOEngineError(TiermemError):
    """The I/O engine cannot be set up as asked (missing backend, bad setting), or was used after close."""


class IOTimeoutError(TiermemError, TimeoutError):
    """`IOFuture.wait(timeout)`: the timeout elapsed before the transfer finished."""


class ReadPastEndError(TiermemError, EOFError):
    """An I/O engine read asked for bytes beyond the end of the file; the message names file, offset and size."""


class StoreError(TiermemError):
    """The swap store cannot place or find data (full disk, locked or corrupt run directory), or a partition's
    bytes could not be read from or written to its swap file."""


class CorruptDataError(StoreError):
    """With `nvme.checksum` on, bytes read back from NVMe do not match the CRC-32 taken (and kept in memory)
    when the partition was last written; the message names the partition."""


class BudgetError(TiermemError):
    """A memory budget can never be met by the request that was made (a unit, buffer or arena larger than the
    budget allows)."""


class StateError(TiermemError):
    """A partition was used in a state that does not allow it (e.g. its tensors read while on NVMe, evicted
    while in use, released more often than acquired), or the swapper was used after close."""


class DeviceMismatchError(TiermemError):
    """A device tensor reached code that takes host memory (or the other way round); a tiermem bug."""


class CopyRaceError(DeviceMismatchError):
    """A host/device copy's source changed before the copy completed (caught by the copying test device's
    checksums); a tiermem bug."""


class CPUAllocatorError(TiermemError):
    """tiermem's CPU allocator could not be built or put in place; raised with `memory.cpu_allocator: tiermem`
    (with `auto`, tiermem logs it and uses PyTorch's allocator)."""


class CheckpointError(TiermemError):
    """A checkpoint is missing, unreadable, corrupt, or does not match the model; raised when reading weights at
    entry (`checkpoint=`, including parameters it lacks that `init_missing` does not name), by
    `tm.load_checkpoint`, and by `tm.save_checkpoint` when it cannot write what was asked."""


class OffloadError(TiermemError):
    """The model cannot be offloaded as asked (already wrapped, meta parameters without a checkpoint,
    unsupported optimizer...), or the handle was used after the context ended."""


class RestoreError(OffloadError):
    """Leaving the context, some parameters could not be given back (their bytes could not be read); every
    other parameter was. `failed` maps each such parameter's name to the error."""

    def __init__(self, message: str, failed: dict[str, BaseException]) -> None:
        super().__init__(message)
        self.failed = failed


class OptimizerError(TiermemError):
    """The optimizer cannot be offloaded as given (unsupported type, parameters outside the model, training
    state larger than the host budget allows), or was used in a way the tiered optimizer does not support
    (add_param_group inside the context, a load_state_dict of other param groups)."""


class RanksError(TiermemError):
    """The ranks of a torch.distributed process group disagree at entry (configs, model shapes), so sharding
    across them would silently mix different models; or a collective with the other ranks failed: another
    rank raised (the message names it and its error) or did not arrive within the process group's timeout."""


class BenchArgError(TiermemError):
    """`tiermem bench`: a command-line value is wrong; the message names the option and the fix."""


class DemoArgError(TiermemError):
    """`tiermem demo`: a command-line value is wrong; the message names the flag."""
