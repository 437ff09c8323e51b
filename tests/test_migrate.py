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
