"""DeepSpeed ZeRO configs as tiermem swap-configs: `tiermem config from-deepspeed ds_config.json`.

`from_deepspeed` maps what has an equivalent (where parameters and optimizer state are offloaded, the NVMe
paths, the aio request size and depth, the prefetch and live-parameter limits, fp16/bf16) and returns one
warning per key that has none or means something else, saying what tiermem does instead. The training
loop's own settings (batch sizes, accumulation, clipping, the optimizer and scheduler) are the user's code
under tiermem, so their warnings say what to write there.
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
    "optimizer": "build the torch.optim optimizer yourself (AdamW, Adam or SGD) and pass it as optimizer=",
    "scheduler": "attach a torch.optim.lr_scheduler to tm.optimizer",
    "steps_per_print": "no periodic printing: read tm.stats()",
    "wall_clock_breakdown": "use trace.path or tm.trace(path) for a timeline",
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
    paths: list[str] = []
    half = "float16" if _on(ds.get("fp16")) else "bfloat16" if _on(ds.get("bf16")) else None
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
                paths.append(str(off["nvme_path"]))
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
    if paths:
        out["nvme.paths"] = list(dict.fromkeys(paths))  # both sections often name the same drive
    if "stage3_prefetch_bucket_size" in zero:
        out["prefetch.max_bytes"] = int(float(zero["stage3_prefetch_bucket_size"])) * width
    if "stage3_max_live_parameters" in zero:
        out["memory.device_budget"] = int(float(zero["stage3_max_live_parameters"])) * width
    for key, why in _NO_EQUIVALENT.items():
        if key in zero:
            warnings.append(f"zero_optimization.{key}: no equivalent: {why}")
    known = {"stage", "offload_param", "offload_optimizer", "stage3_prefetch_bucket_size",
             "stage3_max_live_parameters", *_NO_EQUIVALENT}
    warnings += [f"zero_optimization.{k}: not known to this converter; ignored" for k in zero if k not in known]
    aio = ds.get("aio") or {}
    if isinstance(aio, Mapping):
        if "block_size" in aio:
            out["io.block_size"] = int(float(aio["block_size"]))
        if "queue_depth" in aio:
            out["io.queue_depth"] = int(aio["queue_depth"])
        warnings += [f"aio.{k}: no equivalent: {why}" for k, why in _AIO_IGNORED.items() if k in aio]
    for key, why in _LOOP.items():
        if key in ds:
            warnings.append(f"{key}: in your training loop: " + why.format(v=ds[key]))
    known_top = {"zero_optimization", "aio", "fp16", "bf16", *_LOOP}
    warnings += [f"{k}: not known to this converter; ignored" for k in ds if k not in known_top]
    return out, warnings


def _on(section: object) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))
