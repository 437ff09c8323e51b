"""`tiermem config from-deepspeed`: DeepSpeed ZeRO configs, as DeepSpeed's docs and tutorials write them."""

from __future__ import annotations

import json

import pytest

from tiermem.cli import main
from tiermem.config import load_config, parse_yaml
from tiermem.migrate import from_deepspeed

# The ZeRO-Infinity tutorial's shape: parameters and optimizer state on NVMe, with its aio section
INFINITY = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_param_persistence_threshold": 1e5,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
}
# ZeRO-Offload to CPU (the ZeRO docs' "offload to CPU" example), bf16
CPU_OFFLOAD = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
}
# ZeRO-2 with the optimizer offloaded to CPU (the ZeRO-Offload tutorial)
ZERO2 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True,
                               "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                               "allgather_bucket_size": 5e8}}


# HF Trainer's ds_config_zero3.json style: "auto" wherever the Trainer fills a value in from its arguments,
# the fp16 loss-scaling keys beside "enabled", both offloads to the host
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# The config-json docs' NVMe offload with each kind on its own drive, the aio section with every documented
# field (use_gds among them) and one that is not, and a static fp16 loss scale
TWO_DRIVES = {
    "fp16": {"enabled": True, "loss_scale": 128},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/nvme0", "buffer_count": 5, "buffer_size": 1e8},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme1", "buffer_count": 4, "ratio": 0.3},
        "stage3_prefetch_bucket_size": "5e7",
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 1, "single_submit": False,
            "overlap_events": True, "use_gds": False, "spin_wait": True},
}


def test_zero_infinity_maps_tiers_paths_io_and_limits_and_warns_for_the_rest() -> None:
    """Both offloads on NVMe become the nvme tiers on the one drive; aio's request size and depth become io.*;
    the prefetch bucket and live-parameter limits become bytes (fp16: 2 per element); every key with no
    equivalent, and every loop setting, gets one warning that says what happens instead."""
    out, warnings = from_deepspeed(INFINITY)
    assert out == {"params.dtype": "float16", "params.tier": "nvme", "optimizer.tier": "nvme",
                   "nvme.paths": ["/local_nvme"], "prefetch.max_bytes": 100_000_000,
                   "memory.device_budget": 2_000_000_000, "io.block_size": 1 << 20, "io.queue_depth": 8}
    cfg = load_config(None, **out)  # a valid swap-config
    assert cfg.nvme.paths == ("/local_nvme",) and cfg.io.queue_depth == 8
    text = "\n".join(warnings)
    for key in ("offload_param.buffer_count", "offload_param.buffer_size", "offload_param.max_in_cpu",
                "offload_optimizer.pin_memory", "overlap_comm", "contiguous_gradients", "sub_group_size",
                "stage3_max_reuse_distance", "stage3_param_persistence_threshold", "aio.thread_count",
                "aio.single_submit", "aio.overlap_events", "gradient_accumulation_steps", "optimizer",
                "train_micro_batch_size_per_gpu"):
        assert sum(f"{key}:" in w for w in warnings) == 1, key
    assert "call tm.clip_grad_norm_(1.0)" in text
    assert len(warnings) == len(set(warnings))


def test_cpu_offload_and_zero2_are_mapped_with_what_differs_said() -> None:
    """ZeRO-Offload to CPU: both tiers cpu, bf16. ZeRO-2: parameters stay on the device, the optimizer state
    in host memory; stage 2 and its bucket settings are warned about."""
    out, warnings = from_deepspeed(CPU_OFFLOAD)
    assert out == {"params.dtype": "bfloat16", "params.tier": "cpu", "optimizer.tier": "cpu"}
    assert [w.split(":")[0] for w in warnings] == ["zero_optimization.offload_param.pin_memory",
                                                   "zero_optimization.offload_optimizer.pin_memory"]
    out, warnings = from_deepspeed(ZERO2)
    assert out == {"params.tier": "device", "optimizer.tier": "cpu"}
    assert any(w.startswith("zero_optimization.stage: 2:") for w in warnings)
    for key in ("reduce_bucket_size", "allgather_bucket_size", "reduce_scatter", "overlap_comm"):
        assert any(w.startswith(f"zero_optimization.{key}:") for w in warnings), key


def test_the_command_prints_a_config_that_loads_and_warns_on_stderr(tmp_path, capsys) -> None:
    """`tiermem config from-deepspeed ds.json` prints YAML that `config check` accepts, the warnings go to
    stderr, one line each; a file that is not JSON is an error naming it."""
    (tmp_path / "ds.json").write_text(json.dumps(INFINITY))
    assert main(["config", "from-deepspeed", str(tmp_path / "ds.json")]) == 0
    captured = capsys.readouterr()
    (tmp_path / "tm.yaml").write_text(captured.out)
    cfg = load_config(str(tmp_path / "tm.yaml"))
    assert cfg.params.tier == "nvme" and cfg.params.dtype == "float16"
    assert parse_yaml(captured.out, "out")["io"]["block_size"] in (1 << 20, "1MiB")
    lines = captured.err.strip().splitlines()
    assert lines and all(line.startswith("tiermem: warning: ") for line in lines)
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["config", "from-deepspeed", str(tmp_path / "bad.json")]) == 2
    assert "bad.json" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [[], {"zero_optimization": 3}])
def test_what_is_not_a_deepspeed_config_is_refused(bad: object) -> None:
    from tiermem.errors import ConfigError

    with pytest.raises(ConfigError):
        from_deepspeed(bad)  # type: ignore[arg-type]


def test_hf_trainer_autos_are_unset_with_one_warning_each_and_fp16_auto_is_not_enabled() -> None:
    """HF Trainer's zero3 config converts: "auto" is unset (fp16/bf16 "auto" leave params.dtype alone, so the
    live-parameter limit counts 4 bytes per element), each "auto" key gets one warning saying it is the
    Trainer's and what tiermem does, and each fp16 loss-scaling key one warning on tiermem's dynamic scaling."""
    out, warnings = from_deepspeed(HF_ZERO3)
    assert out == {"params.tier": "cpu", "optimizer.tier": "cpu", "memory.device_budget": 4_000_000_000}
    load_config(None, **out)
    for key in ("fp16.enabled", "bf16.enabled", "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
                "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                "train_micro_batch_size_per_gpu"):
        mine = [w for w in warnings if w.startswith(f"{key}:")]
        assert len(mine) == 1 and '"auto"' in mine[0] and "HF Trainer" in mine[0], (key, mine)
    assert "prefetch.max_bytes is left unset" in next(w for w in warnings if "prefetch_bucket" in w)
    assert "params.dtype is left unset" in next(w for w in warnings if w.startswith("fp16.enabled"))
    assert "tm.clip_grad_norm_(max_norm)" in next(w for w in warnings if w.startswith("gradient_clipping"))
    for key in ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale"):
        mine = [w for w in warnings if w.startswith(f"fp16.{key}:")]
        assert len(mine) == 1 and ("dynamic scale" in mine[0] or "scales dynamically" in mine[0]), key
    assert not any("not known" in w for w in warnings), warnings
    assert len(warnings) == len(set(warnings))


def test_two_drives_aio_keys_and_a_static_scale_are_warned_about() -> None:
    """Two different nvme_path values both become nvme.paths with one warning naming both keys; every aio
    key with no equivalent and an unknown one get a warning; a number written as a string is read; a
    fixed fp16 loss scale is warned about as unsupported."""
    out, warnings = from_deepspeed(TWO_DRIVES)
    assert out == {"params.dtype": "float16", "params.tier": "nvme", "optimizer.tier": "nvme",
                   "nvme.paths": ["/nvme0", "/nvme1"], "prefetch.max_bytes": 100_000_000,
                   "io.block_size": 262144, "io.queue_depth": 32}
    assert load_config(None, **out).nvme.paths == ("/nvme0", "/nvme1")
    drives = [w for w in warnings if "nvme_path" in w]
    assert len(drives) == 1 and "/nvme0" in drives[0] and "/nvme1" in drives[0]
    assert drives[0].startswith("zero_optimization.offload_optimizer.nvme_path:")
    for key in ("intra_op_parallelism", "single_submit", "overlap_events", "use_gds"):
        assert sum(w.startswith(f"aio.{key}: no equivalent") for w in warnings) == 1, key
    assert any(w.startswith("aio.spin_wait: not known") for w in warnings)
    assert any(w.startswith("zero_optimization.offload_optimizer.ratio: 0.3") for w in warnings)
    assert "a fixed loss scale is not supported" in next(w for w in warnings if w.startswith("fp16.loss_scale:"))


def test_the_command_converts_hf_trainer_configs(tmp_path, capsys) -> None:
    """`tiermem config from-deepspeed` on HF's zero3 config prints a config that loads (before: "could not
    convert string to float: 'auto'")."""
    (tmp_path / "ds.json").write_text(json.dumps(HF_ZERO3))
    assert main(["config", "from-deepspeed", str(tmp_path / "ds.json")]) == 0
    captured = capsys.readouterr()
    (tmp_path / "tm.yaml").write_text(captured.out)
    cfg = load_config(str(tmp_path / "tm.yaml"))
    assert cfg.params.dtype is None and cfg.params.tier == "cpu"
    assert '"auto"' in captured.err


@pytest.mark.parametrize("bad", [{"aio": {"queue_depth": "deep"}}, {"fp16": {"enabled": "yes"}},
                                 {"zero_optimization": {"stage3_max_live_parameters": True}}])
def test_a_value_that_is_neither_a_number_nor_auto_is_an_error_naming_its_key(bad: dict) -> None:
    """A non-number where a number is mapped is a ConfigError naming the key, not a bare ValueError."""
    from tiermem.errors import ConfigError

    key = next(iter(bad)) + "." + next(iter(next(iter(bad.values()))))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        from_deepspeed(bad)
