"""DeepSpeed ZeRO configs as tiermem swap-configs: `tiermem config from-deepspeed ds_config.json`.

`from_deepspeed` maps what has an equivalent (where parameters and optimizer state are offloaded, the NVMe
paths, the aio request size and depth, the prefetch and live-parameter limits, fp16/bf16) and returns one
warning per key that has none or means something else, saying what tiermem does instead. The training
loop's own settings (batch sizes, accumulation, clipping, the optimizer and scheduler) are the user's code
under tiermem, so their warnings say what to write there.

HF Trainer's DeepSpeed configs write ``"auto"`` for what the Trainer fills in at run time from its own
arguments; there is no Trainer here to fill it in, so an ``"auto"`` is read as unset, with one warning that
says what tiermem does instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiermem.errors import ConfigError

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
    "zero_optimization.stage3_prefetch_bucket_size": "prefetch.max_bytes is left unset: the read-ahead is bounded "
                                                     "by prefetch.depth units and memory.device_budget",
    "zero_optimization.stage3_max_live_parameters": "memory.device_budget is left unset: the device holds what "
                                                    "the prefetch window needs",
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


def from_deepspeed(ds: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """tiermem config overrides ("section.key": value) for DeepSpeed config `ds`, and the warnings."""
    if not isinstance(ds, Mapping):
        raise ConfigError("the DeepSpeed config must be a JSON object")
    out: dict[str, Any] = {}
    warnings: list[str] = []
    paths: list[tuple[str, str]] = []  # (nvme_path, the key that named it)
    fp16, bf16 = _on(ds.get("fp16"), "fp16", warnings), _on(ds.get("bf16"), "bf16", warnings)
    half = "float16" if fp16 else "bfloat16" if bf16 else None
    warnings += _half_keys(ds)
    width = 2 if half else 4  # DeepSpeed counts parameters in elements; tiermem's limits are bytes
    if half:
        out["params.dtype"] = half
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError("zero_optimization: expected an object")
    stage = zero.get("stage", 0)
    if stage != 3:
        warnings.append(f"zero_optimization.stage: {stage}: tiermem shards parameters, gradients and optimizer "
                        "state across ranks as stage 3 does, whenever torch.distributed is initialised")
    for key, tier_key in (("offload_param", "params.tier"), ("offload_optimizer", "optimizer.tier")):
        off = zero.get(key) or {}
        device = off.get("device", "none") if isinstance(off, Mapping) else "none"
        where = f"zero_optimization.{key}"
        if device == "nvme":
            out[tier_key] = "nvme"
            if off.get("nvme_path"):
                paths.append((str(off["nvme_path"]), f"{where}.nvme_path"))
        elif device == "cpu":
            out[tier_key] = "cpu"
        elif key == "offload_param":
            out[tier_key] = "device"
        else:
            out[tier_key] = "cpu"
            warnings.append(f"{where}.device: none: tiermem's optimizer state rests in host memory at least "
                            "(optimizer.tier cpu); the step runs on the host")
        for sub in ("buffer_count", "buffer_size", "pin_memory", "fast_init"):
            if isinstance(off, Mapping) and sub in off:
                warnings.append(f"{where}.{sub}: no equivalent: tiermem sizes and pins its buffers itself "
                                "within memory.host_budget")
        if isinstance(off, Mapping) and "max_in_cpu" in off:
            warnings.append(f"{where}.max_in_cpu: no equivalent: set memory.host_budget, which bounds everything "
                            "tiermem holds in host memory")
        if isinstance(off, Mapping) and off.get("ratio", 1) != 1:
            warnings.append(f"{where}.ratio: {off['ratio']}: partial offload is not supported; all of the "
                            "optimizer state goes to optimizer.tier")
        if isinstance(off, Mapping):
            warnings += [f"{where}.{k}: not known to this converter; ignored" for k in off if k not in _OFFLOAD]
    if paths:
        out["nvme.paths"] = list(dict.fromkeys(p for p, _ in paths))  # both sections often name the same drive
        if len(out["nvme.paths"]) > 1:
            (first, first_key), (second, second_key) = paths
            warnings.append(f"{second_key}: {second} differs from {first_key} {first}: both become nvme.paths, "
                            "and tiermem stripes parameters and optimizer state alike across them (nvme.stripe_size "
                            "per directory), not one kind per drive")
    for key, target in (("stage3_prefetch_bucket_size", "prefetch.max_bytes"),
                        ("stage3_max_live_parameters", "memory.device_budget")):
        count = _number(zero, key, "zero_optimization", warnings)
        if count is not None:
            out[target] = int(count) * width
    for key, why in _NO_EQUIVALENT.items():
        if key in zero:
            auto = " (\"auto\", set by HF Trainer at run time)" if _is_auto(zero[key]) else ""
            warnings.append(f"zero_optimization.{key}: no equivalent{auto}: {why}")
    known = {"stage", "offload_param", "offload_optimizer", "stage3_prefetch_bucket_size",
             "stage3_max_live_parameters", *_NO_EQUIVALENT}
    warnings += [f"zero_optimization.{k}: not known to this converter; ignored" for k in zero if k not in known]
    aio = ds.get("aio") or {}
    if isinstance(aio, Mapping):
        for key, target in (("block_size", "io.block_size"), ("queue_depth", "io.queue_depth")):
            value = _number(aio, key, "aio", warnings)
            if value is not None:
                out[target] = int(value)
        warnings += [f"aio.{k}: no equivalent: {why}" for k, why in _AIO_IGNORED.items() if k in aio]
        warnings += [f"aio.{k}: not known to this converter; ignored" for k in aio
                     if k not in {"block_size", "queue_depth", *_AIO_IGNORED}]
    for key, why in _LOOP.items():
        if key in ds:
            if _is_auto(ds[key]):
                why = why.replace("({v})", "(max_norm)")  # the Trainer's max_grad_norm
                warnings.append(f"{key}: \"auto\" (set by HF Trainer at run time): in your training loop: {why}")
            else:
                warnings.append(f"{key}: in your training loop: " + why.format(v=ds[key]))
    known_top = {"zero_optimization", "aio", "fp16", "bf16", *_LOOP}
    warnings += [f"{k}: not known to this converter; ignored" for k in ds if k not in known_top]
    return out, warnings


_OFFLOAD = {"device", "nvme_path", "buffer_count", "buffer_size", "pin_memory", "fast_init", "max_in_cpu", "ratio"}


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
    if isinstance(enabled, str):
        raise ConfigError(f"{where}.enabled: expected true, false or \"auto\", got {enabled!r}")
    return bool(enabled)


def _half_keys(ds: Mapping[str, Any]) -> list[str]:
    """One warning per fp16 loss-scaling key and per other key of the fp16/bf16 sections."""
    warnings: list[str] = []
    for name in ("fp16", "bf16"):
        section = ds.get(name)
        if not isinstance(section, Mapping):
            continue
        for key, value in section.items():
            if key == "enabled":
                continue
            if name == "fp16" and key == "loss_scale":  # 0 is DeepSpeed's dynamic scaling, others a fixed scale
                what = "dynamic" if value == 0 else "a fixed loss scale is not supported"
                warnings.append(f"fp16.loss_scale: {value} ({what}): {_SCALING}")
            elif name == "fp16" and key in _FP16:
                warnings.append(f"fp16.{key}: {value}: {_FP16[key]}")
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
        raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}.{key}: expected a number or \"auto\", got {value!r}") from None
