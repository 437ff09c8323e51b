"""DeepSpeed ZeRO configs as tiermem swap-configs: `tiermem config from-deepspeed ds_config.json`.

`from_deepspeed` maps what has an equivalent (where parameters and optimizer state are offloaded, the NVMe
paths, the aio request size and depth, the prefetch and live-parameter limits, fp16/bf16) with DeepSpeed's
meaning, and returns one warning per key that has none or means something else, saying what tiermem does
instead. The training loop's own settings (batch sizes, accumulation, clipping, the optimizer and
scheduler) are the user's code under tiermem, so their warnings say what to write there.

What DeepSpeed itself refuses for the keys read here (an offload device other than "none", "cpu" or
"nvme", fp16 and bf16 both enabled, a ZeRO stage other than 0 to 3, a negative element count, a partial
optimizer offload below stage 3, a deprecated key beside the one replacing it) is a ConfigError that names
the DeepSpeed key and states DeepSpeed's rule. A mapped value that tiermem's config refuses is a
ConfigError naming the DeepSpeed key it came from as well as tiermem's.

HF Trainer's DeepSpeed configs write ``"auto"`` for what the Trainer fills in at run time from its own
arguments; there is no Trainer here to fill it in, so an ``"auto"`` is read as unset, with one warning that
says what tiermem does instead.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from tiermem.config import load_config
from tiermem.errors import ConfigError
from tiermem.sizes import short_repr

# ZeRO keys with no tiermem setting, and what happens instead.
_NO_EQUIVALENT = {
    "stage3_max_reuse_distance": "a released unit stays on the device while the recorded order needs it again "
                                 "within the prefetch window",
    "stage3_param_persistence_threshold": "small modules are merged into units of at least wrap.min_unit_bytes",
    "sub_group_size": "the optimizer steps one unit at a time",
    "reduce_bucket_size": "gradients are reduce-scattered one unit at a time",
    "allgather_bucket_size": "parameters are all-gathered one unit at a time",
    "overlap_comm": "the next unit's all-gather and the last unit's reduce-scatter always overlap compute",
    "contiguous_gradients": "each unit's gradients are one flat buffer already",
    "reduce_scatter": "gradients are always reduce-scattered under several ranks",
    "stage3_gather_16bit_weights_on_model_save": "tm.save_checkpoint always writes whole tensors",
    "stage3_gather_fp16_weights_on_model_save": "tm.save_checkpoint always writes whole tensors",  # its old name
    "round_robin_gradients": "not needed: gradients are reduce-scattered per unit",
    "load_from_fp32_weights": "not needed: fp32 master weights are kept for 16-bit parameters",
}
_LOOP = {  # top-level keys that are the training loop's business under tiermem
    "train_batch_size": "the batch size is your data loader's",
    "train_micro_batch_size_per_gpu": "the batch size is your data loader's",
    "gradient_accumulation_steps": "call backward that many times before tm.optimizer.step() (exact, any number)",
    "gradient_clipping": "call tm.clip_grad_norm_({v}) before tm.optimizer.step()",
    "optimizer": "build the torch.optim optimizer yourself (AdamW, Adam, SGD, RMSprop, ...) and pass it as optimizer=",
    "scheduler": "attach a torch.optim.lr_scheduler to tm.optimizer",
    "steps_per_print": "no periodic printing: read tm.stats()",
    "wall_clock_breakdown": "use trace.path or tm.trace(path) for a timeline",
}
# What tiermem does where an "auto" setting of HF Trainer's is left unset.
_AUTO = {
    "fp16.enabled": "params.dtype is left unset (each parameter keeps its own dtype); set params.dtype: float16 "
                    "for float16 with dynamic loss scaling",
    "bf16.enabled": "params.dtype is left unset (each parameter keeps its own dtype); set params.dtype: bfloat16",
    "bfloat16.enabled": "params.dtype is left unset (each parameter keeps its own dtype); set params.dtype: bfloat16",
    "zero_optimization.stage3_prefetch_bucket_size": "prefetch.max_bytes is left unset: the read-ahead is bounded "
                                                     "by prefetch.depth units and memory.device_budget",
    "zero_optimization.stage3_max_live_parameters": "the read-ahead is not capped by it: prefetch.depth units "
                                                    "and memory.device_budget bound it",
    "aio.block_size": "io.block_size keeps its default (1MiB); tiermem tune measures the best",
    "aio.queue_depth": "io.queue_depth keeps its default (32); tiermem tune measures the best",
}
# DeepSpeed's fp16 loss-scaling keys; tiermem's dynamic scaling is torch.amp.GradScaler's, with its defaults.
_SCALING = ("tiermem scales dynamically as torch.amp.GradScaler does (from 2**16, halved on a step with inf/nan "
            "gradients, which is skipped, doubled after 2000 good steps)")
_FP16 = {
    "initial_scale_power": "tiermem's dynamic scale starts at 2**16 (torch.amp.GradScaler's default)",
    "loss_scale_window": "tiermem's dynamic scale doubles after 2000 good steps (torch.amp.GradScaler's "
                         "default), not after this window",
    "hysteresis": "tiermem's dynamic scale is halved at the first step with inf/nan gradients (the step is "
                  "skipped); there is no hysteresis",
    "min_loss_scale": "tiermem's dynamic scale has no lower bound (torch.amp.GradScaler's has none either)",
}
_AIO_IGNORED = {
    "thread_count": "the io_uring engine drives its ring from one thread",
    "single_submit": "the engine submits each batch with one system call",
    "overlap_events": "submission and completion always overlap",
    "intra_op_parallelism": "the engine drives its ring from one thread",
    "use_gds": "GPUDirect Storage is not used: reads land in pinned host memory",
}
# DeepSpeed's OffloadDeviceEnum: its only offload devices, matched as written (it refuses "NVMe", "CPU").
_DEVICES = ("none", "cpu", "nvme")
# Each offload section's keys as DeepSpeed defines them, and the deprecated flag that stood for the section.
_OFFLOAD_KEYS = {
    "offload_param": {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"},
    "offload_optimizer": {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                          "fast_init", "ratio"},
}
_LEGACY = {"offload_param": "cpu_offload_param", "offload_optimizer": "cpu_offload"}


def from_deepspeed(ds: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """tiermem config overrides ("section.key": value) for DeepSpeed config `ds`, and the warnings.

    The overrides are checked with `load_config`, so they make a valid swap-config on this machine (the NVMe
    paths among them). Raises ConfigError, naming the DeepSpeed key, for what DeepSpeed refuses and for a
    mapped value that tiermem refuses.

    Example::

        overrides, warnings = from_deepspeed(json.load(open("ds_config.json")))
        cfg = load_config(None, **overrides)
    """
    if not isinstance(ds, Mapping):
        raise ConfigError("the DeepSpeed config must be a JSON object")
    out: dict[str, Any] = {}
    source: dict[str, str] = {}  # tiermem key -> the DeepSpeed key it came from, for errors tiermem raises
    warnings: list[str] = []
    fp16, bf16_key = _on(ds.get("fp16"), "fp16", warnings), _bf16_key(ds)
    bf16 = _on(ds.get(bf16_key), bf16_key, warnings)
    if fp16 and bf16:
        raise ConfigError(f"fp16.enabled and {bf16_key}.enabled: both true, which DeepSpeed refuses (bfloat16 and "
                          "fp16 modes cannot be simultaneously enabled); enable one of them")
    half = "float16" if fp16 else "bfloat16" if bf16 else None
    warnings += _half_keys(ds, bf16_key)
    width = 2 if half else 4  # DeepSpeed counts parameters in elements; tiermem's limits are bytes
    if half:
        out["params.dtype"] = half
        source["params.dtype"] = f"{'fp16' if fp16 else bf16_key}.enabled"
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError("zero_optimization: expected an object")
    stage = _stage(zero)
    if "stage" in zero and stage != 3:  # without the key DeepSpeed runs no ZeRO; reported only where written
        warnings.append(f"zero_optimization.stage: {stage}: tiermem shards parameters, gradients and optimizer "
                        "state across ranks as stage 3 does, whenever torch.distributed is initialised")
    paths: list[tuple[str, str]] = []  # (nvme_path, the key that named it)
    for key, tier_key in (("offload_param", "params.tier"), ("offload_optimizer", "optimizer.tier")):
        off, said = _offload_section(zero, key, warnings)
        where = f"zero_optimization.{key}"
        device = _device(off, where) if off is not None else "none"
        if device == "nvme":
            out[tier_key] = "nvme"
            if off is not None and off.get("nvme_path") is not None:
                paths.append((_nvme_path(off["nvme_path"], f"{where}.nvme_path"), f"{where}.nvme_path"))
            else:
                warnings.append(f"{where}.device: nvme without {where}.nvme_path, which DeepSpeed needs to offload "
                                "there: nvme.paths keeps tiermem's default; set it to a directory on the drive")
        elif device == "cpu":
            out[tier_key] = "cpu"
        elif key == "offload_param":
            out[tier_key] = "device"
        else:
            out[tier_key] = "cpu"  # tiermem's optimizer state is never on the device
            if said:  # only what the user wrote is reported: a config without the section gets no line
                warnings.append(f"{said}: tiermem's optimizer state rests in host memory at least (optimizer.tier "
                                "cpu); the step runs on the host")
        if off is not None:
            warnings += _offload_keys(off, key, where, device, stage)
    if paths:
        out["nvme.paths"] = list(dict.fromkeys(p for p, _ in paths))  # both sections often name the same drive
        for i, path in enumerate(out["nvme.paths"]):
            source[f"nvme.paths[{i}]"] = next(k for p, k in paths if p == path)
        if len(out["nvme.paths"]) > 1:
            (first, first_key), (second, second_key) = paths
            warnings.append(f"{second_key}: {second} differs from {first_key} {first}: both become nvme.paths, "
                            "and tiermem stripes parameters and optimizer state alike across them (nvme.stripe_size "
                            "per directory), not one kind per drive")
    _prefetch(zero, width, out, source, warnings)
    for key, why in _NO_EQUIVALENT.items():
        if key in zero:
            auto = " (\"auto\", set by HF Trainer at run time)" if _is_auto(zero[key]) else ""
            warnings.append(f"zero_optimization.{key}: no equivalent{auto}: {why}")
    if "cpu_offload_use_pin_memory" in zero:
        warnings.append("zero_optimization.cpu_offload_use_pin_memory: no equivalent (deprecated by DeepSpeed): "
                        "tiermem pins its host memory itself when CUDA is present")
    known = {"stage", *_OFFLOAD_KEYS, *_LEGACY.values(), "cpu_offload_use_pin_memory", "stage3_prefetch_bucket_size",
             "stage3_max_live_parameters", *_NO_EQUIVALENT}
    warnings += [f"zero_optimization.{k}: not known to this converter; ignored" for k in zero if k not in known]
    aio = ds.get("aio") or {}
    if not isinstance(aio, Mapping):
        raise ConfigError(f"aio: expected an object such as {{\"block_size\": 1048576}}, got {short_repr(aio)}")
    for key, target in (("block_size", "io.block_size"), ("queue_depth", "io.queue_depth")):
        value = _number(aio, key, "aio", warnings)
        if value is not None:
            if value != int(value):
                raise ConfigError(f"aio.{key}: expected a whole number, got {short_repr(aio[key])}")
            out[target] = int(value)
            source[target] = f"aio.{key}"
    warnings += [f"aio.{k}: no equivalent: {why}" for k, why in _AIO_IGNORED.items() if k in aio]
    warnings += [f"aio.{k}: not known to this converter; ignored" for k in aio
                 if k not in {"block_size", "queue_depth", *_AIO_IGNORED}]
    for key, why in _LOOP.items():
        if key in ds:
            if _is_auto(ds[key]):
                why = why.replace("({v})", "(max_norm)")  # the Trainer's max_grad_norm
                warnings.append(f"{key}: \"auto\" (set by HF Trainer at run time): in your training loop: {why}")
            else:
                warnings.append(f"{key}: in your training loop: " + why.format(v=short_repr(ds[key])))
    known_top = {"zero_optimization", "aio", "fp16", "bf16", "bfloat16", *_LOOP}
    warnings += [f"{k}: not known to this converter; ignored" for k in ds if k not in known_top]
    _check(out, source)
    return out, warnings


def _stage(zero: Mapping[str, Any]) -> object:
    """zero_optimization.stage, refused unless it is one of DeepSpeed's stages (0 to 3) or "auto"."""
    stage = zero.get("stage", 0)
    if _is_auto(stage):
        return stage
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage: expected 0, 1, 2 or 3 (DeepSpeed's ZeRO stages; it refuses "
                          f"any other), got {short_repr(stage)}")
    return int(stage)


def _bf16_key(ds: Mapping[str, Any]) -> str:
    """The section DeepSpeed reads bf16 from: ``bf16``, else its old name ``bfloat16``."""
    return "bfloat16" if "bfloat16" in ds and "bf16" not in ds else "bf16"


def _offload_section(zero: Mapping[str, Any], key: str, warnings: list[str]) -> tuple[Mapping[str, Any] | None, str]:
    """The offload section `key` as DeepSpeed reads it (None: not offloaded, DeepSpeed's default) and how the
    user wrote "no offload" if they did ("" when they wrote nothing about it), for the line that reports it.

    DeepSpeed's deprecated flag (``cpu_offload`` for offload_optimizer, ``cpu_offload_param`` for
    offload_param) stands for ``{"device": "cpu"}`` when true and for no section when false; DeepSpeed refuses
    it beside the section that replaces it."""
    where, legacy = f"zero_optimization.{key}", _LEGACY[key]
    if legacy in zero:
        flag = zero[legacy]
        if key in zero:
            raise ConfigError(f"zero_optimization.{legacy}: DeepSpeed refuses this deprecated key beside {where}, "
                              f"which replaces it; remove {legacy} and keep {key}")
        if _is_auto(flag):  # DeepSpeed drops "auto" values, leaving the default: no offload
            return None, f"zero_optimization.{legacy}: \"auto\" (DeepSpeed reads it as unset: no offload)"
        if isinstance(flag, bool) or flag in (0, 1):
            if flag:
                warnings.append(f"zero_optimization.{legacy}: true: DeepSpeed's deprecated form of {key}.device "
                                f"cpu; mapped as that")
                return {"device": "cpu"}, ""
            return None, f"zero_optimization.{legacy}: false (no offload)"
        raise ConfigError(f"zero_optimization.{legacy}: expected true or false, got {short_repr(flag)}")
    off = zero.get(key)
    if off is None:
        return None, ""
    if not isinstance(off, Mapping):
        raise ConfigError(f"{where}: expected an object such as {{\"device\": \"cpu\"}}, got {short_repr(off)}")
    if "device" not in off:
        return off, f"{where}: no device (DeepSpeed's default, none)"
    if _is_auto(off["device"]):
        return off, f"{where}.device: \"auto\" (DeepSpeed reads it as unset: none)"
    return off, f"{where}.device: {off['device']}"


def _device(off: Mapping[str, Any], where: str) -> str:
    """The section's offload device, refused unless it is one DeepSpeed accepts (as written: "NVMe" is not)."""
    device = off.get("device", "none")
    if _is_auto(device):  # DeepSpeed drops "auto" values, leaving the default
        return "none"
    if isinstance(device, str) and device in _DEVICES:
        return device
    hint = f"; write {device.lower()!r}" if isinstance(device, str) and device.lower() in _DEVICES else ""
    raise ConfigError(f"{where}.device: expected 'none', 'cpu' or 'nvme' (DeepSpeed's offload devices, lowercase; "
                      f"it refuses any other), got {short_repr(device)}{hint}")


# Kernel filesystems that show processes, devices and settings as files: a directory on one may pass the
# permission check (as root, /proc does) but cannot hold a swap file.
_PSEUDO_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "securityfs", "debugfs", "tracefs",
                                 "bpf", "pstore", "configfs", "fusectl", "mqueue", "efivarfs", "binfmt_misc",
                                 "autofs", "nsfs", "rpc_pipefs", "selinuxfs", "hugetlbfs"})


def _nvme_path(value: object, key: str) -> str:
    """An offload section's nvme_path: one directory, as DeepSpeed reads it (a path, not a list), refused on a
    kernel filesystem such as /proc."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: expected one directory (a string), got {short_repr(value)}; DeepSpeed takes "
                          "one nvme_path per offload section: convert with one, then list the others in nvme.paths")
    fstype = _filesystem_type(value)
    if fstype in _PSEUDO_FILESYSTEMS:
        raise ConfigError(f"{key}: {short_repr(value)} is on the kernel's {fstype} filesystem, which cannot hold "
                          "swap files; choose a directory on the NVMe drive")
    return value


def _filesystem_type(path: str) -> str | None:
    """The type of the filesystem `path` (or, where it does not exist yet, its nearest existing ancestor) is on,
    from /proc/self/mountinfo; None where that cannot be read."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 22).splitlines()
    except OSError:
        return None
    best, fstype = "", None
    for line in lines:  # "ID PARENT DEV ROOT MOUNTPOINT OPTIONS [TAGS...] - TYPE SOURCE SUPEROPTIONS"
        fields, _, rest = line.partition(" - ")
        parts, kind = fields.split(), rest.split()
        if len(parts) < 5 or not kind:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # "\040" is a space
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):  # the deepest mount; of several at one point, the last
            best, fstype = mount, kind[0]
    return fstype


def _offload_keys(off: Mapping[str, Any], key: str, where: str, device: str, stage: object) -> list[str]:
    """One warning per key of an offload section other than `device`; DeepSpeed's rules on `ratio` enforced."""
    warnings: list[str] = []
    if "nvme_path" in off and device != "nvme":
        warnings.append(f"{where}.nvme_path: ignored with device {device}, as DeepSpeed ignores it")
    for sub in ("buffer_count", "buffer_size", "pin_memory", "fast_init"):
        if sub in off:
            warnings.append(f"{where}.{sub}: no equivalent: tiermem sizes and pins its buffers itself "
                            "within memory.host_budget")
    if "max_in_cpu" in off:
        warnings.append(f"{where}.max_in_cpu: no equivalent: set memory.host_budget, which bounds everything "
                        "tiermem holds in host memory")
    for sub in ("pipeline_read", "pipeline_write"):
        if sub in off:
            warnings.append(f"{where}.{sub}: no equivalent: with optimizer.update lazy, tiermem reads and writes "
                            "each unit's optimizer state behind the next forward")
    if key == "offload_optimizer" and "ratio" in off:
        ratio = off["ratio"]
        if _is_auto(ratio):
            warnings.append(f"{where}.ratio: \"auto\": DeepSpeed reads it as 1: all of the optimizer state goes to "
                            "optimizer.tier")
        elif isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise ConfigError(f"{where}.ratio: expected a number from 0 to 1 (DeepSpeed's rule), got "
                              f"{short_repr(ratio)}")
        elif ratio < 1 and stage != 3:
            raise ConfigError(f"{where}.ratio: {ratio} needs zero_optimization.stage 3: DeepSpeed refuses partial "
                              f"offloading below stage 3, got stage {stage}")
        elif ratio < 1:
            warnings.append(f"{where}.ratio: {ratio}: partial offload is not supported; all of the optimizer "
                            "state goes to optimizer.tier")
    warnings += [f"{where}.{k}: not known to this converter; ignored" for k in off if k not in _OFFLOAD_KEYS[key]]
    return warnings


def _prefetch(zero: Mapping[str, Any], width: int, out: dict[str, Any], source: dict[str, str],
              warnings: list[str]) -> None:
    """Map stage3_prefetch_bucket_size and stage3_max_live_parameters as DeepSpeed reads them.

    DeepSpeed prefetches at most min(bucket, live - parameters already on the device) elements, and none when
    either is 0; the unit computing is fetched in any case, whatever the live limit. So 0 in either is
    prefetch.depth 0, and prefetch.max_bytes is the smaller of the two in bytes; the live limit is not a
    memory.device_budget, which would refuse a unit larger than it."""
    bucket_key, live_key = "stage3_prefetch_bucket_size", "stage3_max_live_parameters"
    bucket = _count(zero, bucket_key, warnings)
    live = _count(zero, live_key, warnings)
    if bucket == 0 or live == 0:
        out["prefetch.depth"] = 0
        source["prefetch.depth"] = f"zero_optimization.{bucket_key if bucket == 0 else live_key}"
    if bucket and live and bucket > live:
        warnings.append(f"zero_optimization.{bucket_key}: {bucket} is more than {live_key} {live}, which "
                        f"bounds DeepSpeed's prefetch as well: prefetch.max_bytes is set from {live}")
        bucket = live
    if (bucket or live) and out.get("prefetch.depth") != 0:
        out["prefetch.max_bytes"] = (bucket or live or 0) * width
        source["prefetch.max_bytes"] = f"zero_optimization.{bucket_key if bucket else live_key}"


def _count(zero: Mapping[str, Any], key: str, warnings: list[str]) -> int | None:
    """A ZeRO element count as DeepSpeed reads it (an integer >= 0); None when absent or "auto"."""
    value = _number(zero, key, "zero_optimization", warnings)
    if value is None:
        return None
    if value < 0 or value != int(value):
        raise ConfigError(f"zero_optimization.{key}: expected a whole number of parameter elements >= 0 "
                          f"(DeepSpeed's rule), got {short_repr(zero[key])}")
    return int(value)


def _check(out: dict[str, Any], source: dict[str, str]) -> None:
    """Load `out` as a swap-config; an error about a mapped key names the DeepSpeed key it came from."""
    try:
        load_config(None, **out)
    except ConfigError as exc:
        key, sep, rest = str(exc).partition(": ")
        if not sep or key not in source:
            raise
        raise ConfigError(f"{source[key]} (as {key}): {rest}") from None


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _auto_warning(where: str) -> str:
    return f"{where}: \"auto\" (set by HF Trainer at run time): unset here; " + _AUTO[where]


def _on(section: object, where: str, warnings: list[str]) -> bool:
    """Whether an fp16/bf16 section is enabled; "auto" is not (with its warning), nor is a missing one."""
    if not isinstance(section, Mapping):
        return False
    enabled = section.get("enabled", False)
    if _is_auto(enabled):
        warnings.append(_auto_warning(f"{where}.enabled"))
        return False
    if not isinstance(enabled, bool) and enabled not in (0, 1):
        raise ConfigError(f"{where}.enabled: expected true, false or \"auto\", got {short_repr(enabled)}")
    return bool(enabled)


def _half_keys(ds: Mapping[str, Any], bf16_key: str) -> list[str]:
    """One warning per fp16 loss-scaling key and per other key of the fp16/bf16 sections."""
    warnings: list[str] = []
    if "bf16" in ds and "bfloat16" in ds:
        warnings.append("bfloat16: ignored, as DeepSpeed ignores this old name of bf16 when bf16 is present")
    for name in ("fp16", bf16_key):
        section = ds.get(name)
        if not isinstance(section, Mapping):
            continue
        for key, value in section.items():
            if key == "enabled":
                continue
            if name == "fp16" and key == "loss_scale":  # 0 is DeepSpeed's dynamic scaling, others a fixed scale
                what = "dynamic" if value == 0 else "a fixed loss scale is not supported"
                warnings.append(f"fp16.loss_scale: {short_repr(value)} ({what}): {_SCALING}")
            elif name == "fp16" and key in _FP16:
                warnings.append(f"fp16.{key}: {short_repr(value)}: {_FP16[key]}")
            else:
                warnings.append(f"{name}.{key}: not known to this converter; ignored")
    return warnings


def _number(section: Mapping[str, Any], key: str, where: str, warnings: list[str]) -> float | None:
    """`section[key]` as a number; None when absent or "auto" (with its warning); an error naming the key for
    anything else that is not a number."""
    if key not in section:
        return None
    value = section[key]
    if _is_auto(value):
        warnings.append(_auto_warning(f"{where}.{key}"))
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: expected a number, got {short_repr(value)}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}.{key}: expected a number or \"auto\", got {short_repr(value)}") from None
    except OverflowError:  # an int past float's range, which json reads whole
        raise ConfigError(f"{where}.{key}: expected a number within float range (about 1.8e308), got "
                          f"{short_repr(value)}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{where}.{key}: expected a finite number, got {short_repr(value)}")
    return number
