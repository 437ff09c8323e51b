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
# the HF Trainer's fp16 section ("auto", with DeepSpeed's loss-scaling keys) and ZeRO-3 offloads to the host, as
# the two Trainer configs below both write them
FP16_AUTO = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1}
HOST_OFFLOADS = {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                 "offload_param": {"device": "cpu", "pin_memory": True},
                 "overlap_comm": True, "contiguous_gradients": True}

# the fp16 loss-scaling keys beside "enabled", both offloads to the host
HF_ZERO3 = {
    "fp16": {**FP16_AUTO},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        **HOST_OFFLOADS,
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
    the prefetch bucket (below the live-parameter limit) becomes prefetch.max_bytes (fp16: 2 per element), the
    live limit no device budget (DeepSpeed fetches the computing unit whatever it says); every key with no
    equivalent, and every loop setting, gets one warning that says what happens instead."""
    out, warnings = from_deepspeed(INFINITY)
    assert out == {"params.dtype": "float16", "params.tier": "nvme", "optimizer.tier": "nvme",
                   "nvme.paths": ["/local_nvme"], "prefetch.max_bytes": 100_000_000,
                   "io.block_size": 1 << 20, "io.queue_depth": 8}
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
    live-parameter limit, which caps the read-ahead, counts 4 bytes per element), each "auto" key gets one
    warning saying it is the Trainer's and what tiermem does, and each fp16 loss-scaling key one warning on
    tiermem's dynamic scaling."""
    out, warnings = from_deepspeed(HF_ZERO3)
    assert out == {"params.tier": "cpu", "optimizer.tier": "cpu", "prefetch.max_bytes": 4_000_000_000}
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


# transformers' own tests/deepspeed/ds_config_zero3.json shape: fp16 with the loss-scaling keys, both offloads to
# the host, no prefetching (stage3_prefetch_bucket_size 0, which DeepSpeed accepts), zero buckets, the old name
# of the gather-on-save flag, and "auto" where the Trainer fills values in
TRANSFORMERS_ZERO3 = {
    "fp16": {**FP16_AUTO},
    "zero_optimization": {
        "stage": 3,
        **HOST_OFFLOADS,
        "sub_group_size": 1e14,
        "reduce_bucket_size": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_fp16_weights_on_model_save": True,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.8, 0.999], "eps": 1e-8,
                                              "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                 "warmup_num_steps": 500}},
    "gradient_accumulation_steps": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}


def _cli(tmp_path, capsys, text: str) -> tuple[int, str, str]:
    """Run `tiermem config from-deepspeed` on a ds_config.json holding `text`: (exit status, stdout, stderr)."""
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    status = main(["config", "from-deepspeed", str(path)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_transformers_test_config_maps_prefetch_bucket_zero_to_no_prefetching(tmp_path, capsys) -> None:
    """stage3_prefetch_bucket_size 0 is DeepSpeed's "no prefetching": prefetch.depth 0 with no byte cap (before:
    prefetch.max_bytes 0, refused by tiermem); every unmapped key gets exactly one warning, the old gather flag
    among them (before: "not known")."""
    out, warnings = from_deepspeed(TRANSFORMERS_ZERO3)
    assert out == {"params.tier": "cpu", "optimizer.tier": "cpu", "prefetch.depth": 0}
    cfg = load_config(None, **out)
    assert cfg.prefetch.depth == 0 and cfg.prefetch.max_bytes is None
    keys = [w.split(":")[0] for w in warnings]
    assert len(keys) == len(set(keys)), keys
    for key in ("sub_group_size", "reduce_bucket_size", "stage3_param_persistence_threshold",
                "stage3_max_reuse_distance", "stage3_gather_fp16_weights_on_model_save", "overlap_comm"):
        assert f"zero_optimization.{key}" in keys, key
    assert "no equivalent" in warnings[keys.index("zero_optimization.stage3_gather_fp16_weights_on_model_save")]
    assert {"fp16.enabled", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu"} <= set(keys)
    assert not any("prefetch_bucket" in w or "not known" in w for w in warnings), warnings

    status, stdout, stderr = _cli(tmp_path, capsys, json.dumps(TRANSFORMERS_ZERO3, indent=4))
    assert status == 0, stderr
    (tmp_path / "tm.yaml").write_text(stdout)
    cfg = load_config(str(tmp_path / "tm.yaml"))
    assert cfg.prefetch.depth == 0 and cfg.params.tier == "cpu" and cfg.optimizer.tier == "cpu"
    assert all(line.startswith("tiermem: warning: ") for line in stderr.strip().splitlines())


def test_a_prefetch_bucket_above_the_live_limit_is_capped_as_deepspeed_caps_it() -> None:
    """DeepSpeed prefetches at most stage3_max_live_parameters elements, so a larger bucket becomes
    prefetch.max_bytes = the live limit in bytes, with a line saying so (before: a max_bytes above
    memory.device_budget, which tiermem refuses); a live limit of 0 is no prefetching too."""
    ds = {"bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e8, "stage3_max_live_parameters": 1e8}}
    out, warnings = from_deepspeed(ds)
    assert out["prefetch.max_bytes"] == 200_000_000 and "memory.device_budget" not in out
    assert load_config(None, **out).prefetch.max_bytes == 200_000_000
    assert [w.split(":")[0] for w in warnings] == ["zero_optimization.stage3_prefetch_bucket_size"]
    out, _ = from_deepspeed({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0}})
    assert out["prefetch.depth"] == 0 and "memory.device_budget" not in out


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
@pytest.mark.parametrize("device", ["NVMe", "CPU", "gpu", None])
def test_an_offload_device_deepspeed_refuses_is_refused_naming_the_key(tmp_path, capsys, section: str,
                                                                        device: object) -> None:
    """An offload device other than DeepSpeed's lowercase none/cpu/nvme is a ConfigError naming the key and the
    accepted values, and the command's one-line error, exit 2 (before: silently no offload)."""
    from tiermem.errors import ConfigError

    ds = {"zero_optimization": {"stage": 3, section: {"device": device, "nvme_path": "/local_nvme"}}}
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{section}\.device: .*'none', 'cpu' or 'nvme'"):
        from_deepspeed(ds)
    status, stdout, stderr = _cli(tmp_path, capsys, json.dumps(ds))
    assert status == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert f"zero_optimization.{section}.device" in stderr and "DeepSpeed" in stderr and repr(device) in stderr
    if device == "NVMe":
        assert "write 'nvme'" in stderr


def test_fp16_and_bf16_both_enabled_are_refused_with_deepspeeds_rule(tmp_path, capsys) -> None:
    """fp16 and bf16 (or its old name bfloat16) both enabled is refused with DeepSpeed's rule (before: float16)."""
    from tiermem.errors import ConfigError

    for bf16 in ("bf16", "bfloat16"):
        ds = {"fp16": {"enabled": True}, bf16: {"enabled": True}, "zero_optimization": {"stage": 3}}
        with pytest.raises(ConfigError, match=rf"fp16\.enabled and {bf16}\.enabled: .*cannot be simultaneously"):
            from_deepspeed(ds)
    status, _, stderr = _cli(tmp_path, capsys, json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    assert status == 2 and "fp16.enabled and bf16.enabled" in stderr and "Traceback" not in stderr
    out, _ = from_deepspeed({"bfloat16": {"enabled": True}})  # DeepSpeed's old name for bf16 is read as bf16
    assert out["params.dtype"] == "bfloat16"


def test_legacy_cpu_offload_flags_map_to_what_they_mean(tmp_path, capsys) -> None:
    """cpu_offload: true is offload_optimizer.device cpu and cpu_offload_param: true offload_param.device cpu, each
    with one line saying so, and no line about an offload_optimizer block the config does not have (before:
    "not known; ignored" plus "offload_optimizer.device: none", and parameters left on the device)."""
    ds = {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                "cpu_offload_use_pin_memory": True}}
    out, warnings = from_deepspeed(ds)
    assert out == {"params.tier": "cpu", "optimizer.tier": "cpu"}
    assert [w.split(":")[0] for w in warnings] == ["zero_optimization.cpu_offload_param",
                                                   "zero_optimization.cpu_offload",
                                                   "zero_optimization.cpu_offload_use_pin_memory"]
    assert "deprecated form of offload_optimizer.device cpu" in warnings[1]
    assert not any("not known" in w or "offload_optimizer.device" in w.split(":")[0] for w in warnings)
    status, stdout, stderr = _cli(tmp_path, capsys, json.dumps(ds))
    assert status == 0 and load_config(None, **out).params.tier == "cpu"
    assert "offload_optimizer.device: none" not in stderr and "not known" not in stderr


def test_only_what_the_config_says_is_reported() -> None:
    """A config without an offload_optimizer block or a stage gets no line about them (before: lines about
    offload_optimizer.device none and stage 0 that the user never wrote); an explicit none still gets its line,
    and an nvme_path beside device cpu gets one saying it is ignored."""
    out, warnings = from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert out == {"params.tier": "cpu", "optimizer.tier": "cpu"} and warnings == []
    assert from_deepspeed({"train_micro_batch_size_per_gpu": 1})[1] == [
        "train_micro_batch_size_per_gpu: in your training loop: the batch size is your data loader's"]
    _, warnings = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}})
    assert [w.split(":")[0] for w in warnings] == ["zero_optimization.offload_optimizer.device"]
    _, warnings = from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                                      "nvme_path": "/nvme"}}})
    assert warnings == ["zero_optimization.offload_param.nvme_path: ignored with device cpu, as DeepSpeed ignores it"]


@pytest.mark.parametrize("zero, key, rule", [
    ({"stage": 4}, "zero_optimization.stage", "0, 1, 2 or 3"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "zero_optimization.offload_optimizer.ratio",
     "partial offloading below stage 3"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "zero_optimization.offload_optimizer.ratio",
     "from 0 to 1"),
    ({"stage": 3, "stage3_prefetch_bucket_size": -1}, "zero_optimization.stage3_prefetch_bucket_size", ">= 0"),
    ({"stage": 3, "stage3_max_live_parameters": 2.5}, "zero_optimization.stage3_max_live_parameters", ">= 0"),
    ({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.cpu_offload",
     "deprecated key beside zero_optimization.offload_optimizer"),
    ({"stage": 3, "cpu_offload_param": False, "offload_param": {"device": "cpu"}},
     "zero_optimization.cpu_offload_param", "deprecated key beside zero_optimization.offload_param"),
])
def test_what_deepspeed_refuses_is_refused_with_its_rule(zero: dict, key: str, rule: str) -> None:
    """A value DeepSpeed's config validation refuses is a ConfigError naming the key and the rule (before: a
    warning, a silent choice, or tiermem's own key only)."""
    from tiermem.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        from_deepspeed({"zero_optimization": zero})
    assert str(info.value).startswith(f"{key}: ") and rule in str(info.value) and "DeepSpeed" in str(info.value)


def test_a_mapped_value_tiermem_refuses_names_the_deepspeed_key(tmp_path, capsys) -> None:
    """A mapped value that tiermem's config refuses is an error naming the DeepSpeed key and tiermem's (before:
    from_deepspeed returned it, and the command named only io.block_size or nvme.paths[0])."""
    from tiermem.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^aio\.block_size \(as io\.block_size\): .*4096"):
        from_deepspeed({"aio": {"block_size": 1000}})
    (tmp_path / "file").write_text("")
    path = str(tmp_path / "file" / "swap")  # under a regular file: cannot be created
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path}}}
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_param\.nvme_path \(as nvme\.paths\[0\]\)"):
        from_deepspeed(ds)
    status, _, stderr = _cli(tmp_path, capsys, json.dumps(ds))
    assert status == 2 and "zero_optimization.offload_param.nvme_path (as nvme.paths[0])" in stderr


def test_the_command_refuses_a_key_given_twice(tmp_path, capsys) -> None:
    """A key given twice in one JSON object is refused, as DeepSpeed refuses it (before: the last one won)."""
    status, stdout, stderr = _cli(tmp_path, capsys, '{"zero_optimization": {"stage": 3, "stage": 2}}')
    assert status == 2 and stdout == "" and "stage: given twice" in stderr and "DeepSpeed" in stderr


_BIG = "1" + "0" * 400  # an integer json reads whole, past float's range
_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, named", [
    ('{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": ' + _BIG + '}}',
     "zero_optimization.stage3_prefetch_bucket_size: expected a number within float range (about 1.8e308), got "
     "<an integer of about 401 digits>"),
    ('{"aio": {"block_size": ' + _BIG + '}}', "aio.block_size: expected a number within float range"),
    ('{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ' + _BIG + '}}}',
     "zero_optimization.offload_optimizer.ratio: expected a number from 0 to 1 (DeepSpeed's rule), got <an "
     "integer of about 401 digits>"),
    ('{"zero_optimization": ' + _DEEP + '}', "JSON nested deeper than Python's reader follows"),
    ('{"zero_optimization": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001,
     "JSON nested deeper than Python's reader follows"),
    (json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ["/a", "/b"]}}}),
     "zero_optimization.offload_param.nvme_path: expected one directory (a string), got ['/a', '/b']"),
    (json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": 5}}}),
     "zero_optimization.offload_optimizer.nvme_path: expected one directory (a string), got 5"),
    (json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/proc"}}}),
     "zero_optimization.offload_param.nvme_path: '/proc' is on the kernel's proc filesystem, which cannot hold "
     "swap files"),
    (json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                     "nvme_path": "/proc/tiermem/swap"}}}),
     "zero_optimization.offload_param.nvme_path: '/proc/tiermem/swap' is on the kernel's proc filesystem"),
    (json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": ["nvme"]}}}),
     "zero_optimization.offload_param.device: expected 'none', 'cpu' or 'nvme'"),
    (json.dumps({"aio": [1]}), "aio: expected an object"),
    (json.dumps({"fp16": {"enabled": [1]}}), "fp16.enabled: expected true, false or \"auto\", got [1]"),
], ids=["int-past-float", "aio-int-past-float", "ratio-int-past-float", "nested-arrays", "nested-objects",
        "nvme-path-list", "nvme-path-number", "nvme-path-proc", "nvme-path-under-proc", "device-list", "aio-list",
        "enabled-list"])
def test_every_bad_input_is_one_line_naming_the_key_and_exit_2(tmp_path, capsys, text: str, named: str) -> None:
    """Numbers past float range, nesting 100,000 deep, an nvme_path that is a list (before: the path
    "['/a', '/b']") or on /proc (before: accepted as root), a device, aio section or fp16.enabled that is a list:
    one line on stderr naming the file and the key, nothing on stdout, exit 2 (before: OverflowError
    tracebacks, or a config printed that could not run)."""
    status, stdout, stderr = _cli(tmp_path, capsys, text)
    assert status == 2 and stdout == ""
    assert stderr.startswith(f"{tmp_path / 'ds_config.json'}: ") and named in stderr, stderr[:400]
    assert len(stderr.splitlines()) == 1 and len(stderr) < 400


def test_a_huge_value_in_a_warning_is_quoted_short(tmp_path, capsys) -> None:
    """A gradient_clipping past float's range is quoted in a short warning line (before: all 401 digits)."""
    status, _, stderr = _cli(tmp_path, capsys, '{"gradient_clipping": ' + _BIG + '}')
    assert status == 0
    assert stderr.strip() == ("tiermem: warning: gradient_clipping: in your training loop: call "
                              "tm.clip_grad_norm_(<an integer of about 401 digits>) before tm.optimizer.step()")
