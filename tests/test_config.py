"""Tests for the swap-config: loading, defaults, sizes, overrides, round trip, validation, CLI."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem import config as config_module
from tiermem.cli import config_cmd
from tiermem.config import (
    Config,
    GradsConfig,
    IOConfig,
    MemoryConfig,
    NvmeConfig,
    OptimizerConfig,
    ParamsConfig,
    PrefetchConfig,
    WrapConfig,
    format_config,
    load_config,
)
from tiermem.errors import ConfigError, TiermemError
from tiermem.sizes import parse_size

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
MiB = 1024**2
GiB = 1024**3

HOST_ONLY: dict[str, Any] = {
    "params": {"tier": "cpu"},
    "optimizer": {"tier": "cpu"},
    "grads": {"tier": "cpu"},
}


def _write(path: pathlib.Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def _nvme_at(directory: pathlib.Path | str, **extra: Any) -> dict[str, Any]:
    """A mapping using the NVMe tier at `directory`, so tests do not depend on /var/tmp."""
    return {"nvme": {"paths": [str(directory)]}, **extra}


# ---------------------------------------------------------------------------------------------
# Shipped configs and defaults


def test_configs_directory_has_the_four_documented_files() -> None:
    """configs/ ships default, cpu, nvme and nvme-2drives."""
    assert {p.name for p in CONFIGS} >= {
        "default.yaml",
        "cpu.yaml",
        "nvme.yaml",
        "nvme-2drives.yaml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: pathlib.Path) -> None:
    """Every YAML file in configs/ passes load_config."""
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.origin == str(path)


def test_default_yaml_equals_builtin_defaults() -> None:
    """configs/default.yaml spells out exactly the built-in defaults."""
    assert load_config(REPO / "configs" / "default.yaml") == load_config()


def test_shipped_configs_mean_what_their_names_say() -> None:
    """cpu.yaml uses no NVMe tier; nvme.yaml puts params+optimizer on NVMe; 2drives stripes two."""
    cpu = load_config(REPO / "configs" / "cpu.yaml")
    assert (cpu.params.tier, cpu.optimizer.tier, cpu.grads.tier) == ("cpu", "cpu", "cpu")
    assert not cpu.uses_nvme
    nvme = load_config(REPO / "configs" / "nvme.yaml")
    assert (nvme.params.tier, nvme.optimizer.tier) == ("nvme", "nvme")
    two = load_config(REPO / "configs" / "nvme-2drives.yaml")
    assert len(two.nvme.paths) == 2


def test_defaults_match_the_contract() -> None:
    """load_config() with no source gives the documented default of every key."""
    cfg = load_config()
    assert cfg.device == "auto"
    assert cfg.params == ParamsConfig(tier="nvme", dtype=None)
    assert cfg.optimizer == OptimizerConfig(tier="nvme")
    assert cfg.grads == GradsConfig(tier="auto")
    assert cfg.nvme.paths == ("/var/tmp/tiermem",)
    assert (cfg.nvme.stripe_size, cfg.nvme.checksum, cfg.nvme.keep_files) == (MiB, False, False)
    assert cfg.memory == MemoryConfig(host_budget=4 * GiB, device_budget=None)
    assert cfg.prefetch == PrefetchConfig(depth=2, max_bytes=None)
    assert cfg.wrap == WrapConfig(classes=(), min_unit_bytes=MiB)
    assert cfg.io == IOConfig(engine="auto", block_size=MiB, queue_depth=32, direct=True, sqpoll=False)
    assert cfg.trace.path is None and cfg.optimizer.update == "lazy"
    assert cfg == Config()
    assert cfg.origin == "defaults"


def test_empty_file_and_empty_sections_mean_defaults(tmp_path: pathlib.Path) -> None:
    """An empty YAML file, or a section with nothing under it, takes the defaults."""
    assert load_config(_write(tmp_path / "empty.yaml", "# nothing\n")) == Config()
    assert load_config(_write(tmp_path / "bare.yaml", "prefetch:\nio:\n")) == Config()


# ---------------------------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64MiB", 64 * MiB),
        ("1.5GiB", 1536 * MiB),
        ("1e9", 10**9),
        (4096, 4096),
        ("4096", 4096),
        ("2 GB", 2 * 10**9),
        (1e9, 10**9),
    ],
)
def test_sizes_accept_human_strings(text: object, expected: int) -> None:
    """Byte-count keys accept ints, floats and strings like 64MiB, 1.5GiB, 1e9; stored as int."""
    cfg = load_config({"prefetch": {"max_bytes": text}})
    assert cfg.prefetch.max_bytes == expected
    assert type(cfg.prefetch.max_bytes) is int


def test_sizes_from_yaml_file(tmp_path: pathlib.Path) -> None:
    """Size strings in a YAML file (including PyYAML's string 1e9) parse to ints."""
    path = _write(
        tmp_path / "c.yaml",
        "memory:\n  host_budget: 1.5GiB\n  device_budget: 1e9\nio:\n  block_size: 4096\n",
    )
    cfg = load_config(path)
    assert (cfg.memory.host_budget, cfg.memory.device_budget) == (1536 * MiB, 10**9)
    assert cfg.io.block_size == 4096


def test_to_dict_writes_exact_human_sizes() -> None:
    """to_dict writes sizes as exact unit strings where one divides them, else as ints."""
    cfg = load_config(
        {
            "memory": {"device_budget": "1e9"},
            "wrap": {"min_unit_bytes": 1_000_001},
            "io": {"block_size": 12 * 4096},
        }
    )
    out = cfg.to_dict()
    assert out["memory"] == {"host_budget": "4GiB", "device_budget": "1GB", "cpu_allocator": "auto"}
    assert out["wrap"]["min_unit_bytes"] == 1_000_001
    assert out["io"]["block_size"] == "48KiB"
    assert out["nvme"]["paths"] == ["/var/tmp/tiermem"]
    assert out["wrap"]["classes"] == []


@settings(max_examples=50, deadline=None)
@given(
    blocks=st.integers(min_value=1, max_value=2**20),
    budget=st.integers(min_value=1, max_value=2**44),
)
def test_size_round_trip_is_exact(blocks: int, budget: int) -> None:
    """Any valid byte count survives to_dict and back unchanged."""
    cfg = load_config({**HOST_ONLY, "io": {"block_size": blocks * 4096}, "memory": {"device_budget": budget}})
    again = load_config(cfg.to_dict())
    assert again.io.block_size == blocks * 4096
    assert again.memory.device_budget == budget


# ---------------------------------------------------------------------------------------------
# Sources and overrides


def test_mapping_source_and_path_source_agree(tmp_path: pathlib.Path) -> None:
    """A dict and a YAML file with the same content give equal configs; PathLike works too."""
    data = {**HOST_ONLY, "prefetch": {"depth": 5}, "wrap": {"classes": ["Block"]}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    from_dict = load_config(data)
    assert from_dict == load_config(str(path)) == load_config(path)
    assert from_dict.wrap.classes == ("Block",)
    assert from_dict.origin == "a mapping"


def test_config_source_is_copied() -> None:
    """load_config(cfg) returns an equal but independent copy, keeping the origin."""
    cfg = load_config(REPO / "configs" / "cpu.yaml")
    copy = load_config(cfg)
    assert copy == cfg and copy is not cfg and copy.prefetch is not cfg.prefetch
    copy.prefetch.depth = 9
    assert cfg.prefetch.depth == 2
    assert copy.origin == cfg.origin


def test_mapping_source_is_not_mutated() -> None:
    """Overrides never write into the caller's mapping."""
    data: dict[str, Any] = {"prefetch": {"depth": 1}}
    load_config(data, prefetch__depth=3)
    assert data == {"prefetch": {"depth": 1}}


def test_dotted_and_double_underscore_overrides_are_equivalent() -> None:
    """**{"prefetch.depth": 4} and prefetch__depth=4 set the same key."""
    path = REPO / "configs" / "nvme.yaml"
    dotted = load_config(path, **{"prefetch.depth": 4})
    keyword = load_config(path, prefetch__depth=4)
    assert dotted.prefetch.depth == keyword.prefetch.depth == 4
    assert dotted == keyword
    assert "prefetch.depth=4" in keyword.origin


def test_overrides_are_validated_like_yaml() -> None:
    """Override values go through the same parsing and checks, so "64MiB" strings work."""
    cfg = load_config(None, io__block_size="4MiB", **{"memory.device_budget": "64MiB"})
    assert (cfg.io.block_size, cfg.memory.device_budget) == (4 * MiB, 64 * MiB)
    with pytest.raises(ConfigError, match=r"^io\.queue_depth: expected an integer"):
        load_config(None, io__queue_depth=0)


def test_override_on_config_source_and_top_level_key() -> None:
    """Overrides apply on top of a Config source, including top-level keys like device."""
    base = load_config(REPO / "configs" / "cpu.yaml")
    cfg = load_config(base, device="cuda:1", params__dtype="float16")
    assert (cfg.device, cfg.params.dtype) == ("cuda:1", "float16")
    assert base.device == "auto"


def test_section_override_merges() -> None:
    """A mapping override of a section merges into it rather than replacing it."""
    cfg = load_config({"io": {"queue_depth": 8}}, io={"block_size": "2MiB"})
    assert (cfg.io.queue_depth, cfg.io.block_size) == (8, 2 * MiB)


@pytest.mark.parametrize(
    ("overrides", "prefix"),
    [
        ({"prefetch.dpeth": 4}, "prefetch.dpeth: unknown key; did you mean 'depth'?"),
        ({"prefetch__dpeth": 4}, "prefetch.dpeth: unknown key; did you mean 'depth'?"),
        ({"prefetch.": 4}, "prefetch.: malformed override key"),
        ({"device.x": 1}, "device.x: unknown key; device takes a value"),
        ({"nosuch.x": 1}, "nosuch: unknown key"),
        (
            {"memory.host_budget": "lots"},
            "memory.host_budget: expected a byte count such as 4096, 1e9, 64MiB or 1.5GiB, got 'lots'",
        ),
    ],
)
def test_bad_overrides_name_the_key(overrides: dict[str, Any], prefix: str) -> None:
    """A bad override key or value fails with the dotted key path first."""
    with pytest.raises(ConfigError) as info:
        load_config(None, **overrides)
    assert str(info.value).startswith(prefix), str(info.value)


def test_override_into_non_mapping_section() -> None:
    """An override below a section the source gave as a non-mapping names that section."""
    with pytest.raises(ConfigError) as info:
        load_config({"params": "nvme"}, params__tier="cpu")
    assert str(info.value).startswith("params: cannot apply override params.tier"), str(info.value)


def test_unsupported_source_type() -> None:
    """A source that is not None, a path, a mapping or a Config is refused."""
    with pytest.raises(ConfigError, match=r"^source: expected"):
        load_config(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_format_config_round_trips_shipped_configs(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """format_config output loads back to an equal Config for every shipped file."""
    cfg = load_config(path)
    text = format_config(cfg)
    assert load_config(_write(tmp_path / "out.yaml", text)) == cfg


def test_format_config_round_trips_unusual_values(tmp_path: pathlib.Path) -> None:
    """Round trip holds for non-unit sizes, class lists, cuda:N and two drives."""
    cfg = load_config(
        {
            "device": "cuda:3",
            "params": {"dtype": "bfloat16"},
            "nvme": {"paths": [str(tmp_path / "a"), str(tmp_path / "b")], "checksum": True},
            "memory": {"device_budget": 123_456_789},
            "prefetch": {"depth": 0, "max_bytes": "1e8"},
            "wrap": {"classes": ["GPT2Block", "Embedding"], "min_unit_bytes": 0},
            "io": {"engine": "io_uring", "sqpoll": True, "queue_depth": 4096},
        }
    )
    text = format_config(cfg)
    again = load_config(_write(tmp_path / "out.yaml", text))
    assert again == cfg
    assert load_config(cfg.to_dict()) == cfg


def test_format_config_header_names_origin() -> None:
    """format_config starts with one comment line saying where the config came from."""
    path = REPO / "configs" / "nvme.yaml"
    text = format_config(load_config(path, prefetch__depth=4))
    first, rest = text.split("\n", 1)
    assert first.startswith("# ") and str(path) in first and "prefetch.depth=4" in first
    assert not rest.startswith("#")
    assert yaml.safe_load(text)["prefetch"]["depth"] == 4


# ---------------------------------------------------------------------------------------------
# Validation table


BAD_CONFIGS: list[tuple[str, dict[Any, Any], str]] = [
    # unknown keys, with and without a close match
    ("typo-in-section", {"prefetch": {"dpeth": 3}}, "prefetch.dpeth: unknown key; did you mean 'depth'?"),
    ("unknown-top", {"bogus": 1}, "bogus: unknown key; expected one of device"),
    ("typo-top", {"optimiser": {"tier": "cpu"}}, "optimiser: unknown key; did you mean 'optimizer'?"),
    ("unknown-nested", {"nvme": {"zzz": 1}}, "nvme.zzz: unknown key; expected one of paths"),
    ("non-string-key", {1: 2}, "1: unknown key"),
    # sections that are not mappings
    ("section-string", {"params": "nvme"}, "params: expected a mapping with keys tier, dtype"),
    ("section-list", {"io": [1]}, "io: expected a mapping"),
    # integers
    ("qd-zero", {"io": {"queue_depth": 0}}, "io.queue_depth: expected an integer from 1 to 4096, got 0"),
    ("qd-huge", {"io": {"queue_depth": 5000}}, "io.queue_depth: expected an integer from 1 to 4096, got 5000"),
    ("qd-bool", {"io": {"queue_depth": True}}, "io.queue_depth: expected an integer from 1 to 4096, got a boolean"),
    ("qd-string", {"io": {"queue_depth": "32"}}, "io.queue_depth: expected an integer from 1 to 4096, got a string"),
    ("qd-float", {"io": {"queue_depth": 32.0}}, "io.queue_depth: expected an integer"),
    ("depth-negative", {"prefetch": {"depth": -1}}, "prefetch.depth: expected an integer >= 0, got -1"),
    # sizes
    ("size-garbage", {"nvme": {"stripe_size": "lots"}}, "nvme.stripe_size: expected a byte count"),
    (
        "size-unaligned",
        {"nvme": {"stripe_size": "1000"}},
        "nvme.stripe_size: expected a multiple of 4096 bytes for direct I/O, got '1000' (1000 bytes); use 4KiB",
    ),
    ("size-zero", {"nvme": {"stripe_size": 0}}, "nvme.stripe_size: expected a size of at least 1 bytes, got 0"),
    ("weights-count", {"nvme": {"paths": ["/var/tmp/a", "/var/tmp/b"], "path_weights": [1, 2, 3]}},
     "nvme.path_weights: 3 weights for 2 nvme.paths entries; give one per directory"),
    ("weights-zero", {"nvme": {"paths": ["/var/tmp/a", "/var/tmp/b"], "path_weights": [1, 0]}},
     "nvme.path_weights[1]: expected an integer from 1 to 64, got 0"),
    ("weights-word", {"nvme": {"path_weights": "fast"}}, 'nvme.path_weights: expected "auto" or a list'),
    (
        "block-unaligned",
        {"io": {"block_size": "6KiB"}},
        "io.block_size: expected a multiple of 4096 bytes for direct I/O, got '6KiB' (6144 bytes); use 4KiB or 8KiB",
    ),
    (
        "block-bool",
        {"io": {"block_size": True}},
        "io.block_size: expected a byte count such as 4096, 1e9, 64MiB or 1.5GiB, got a boolean (true)",
    ),
    ("size-negative", {"memory": {"host_budget": -5}}, "memory.host_budget: expected a size >= 0"),
    (
        "size-null",
        {"memory": {"host_budget": None}},
        "memory.host_budget: expected a byte count such as 4096, 1e9, 64MiB or 1.5GiB, got null",
    ),
    ("size-fraction", {"prefetch": {"max_bytes": 1.5}}, "prefetch.max_bytes: 1.5 is not a whole number"),
    (
        "device-budget-zero",
        {"memory": {"device_budget": 0}},
        "memory.device_budget: expected a size of at least 1 bytes",
    ),
    ("min-unit-list", {"wrap": {"min_unit_bytes": [1]}}, "wrap.min_unit_bytes: expected a byte count"),
    # enums
    ("tier-bad", {"params": {"tier": "disk"}}, "params.tier: expected one of device, cpu, nvme, got 'disk'"),
    (
        "tier-typo",
        {"params": {"tier": "nvm"}},
        "params.tier: expected one of device, cpu, nvme, got 'nvm'; did you mean 'nvme'?",
    ),
    ("opt-device", {"optimizer": {"tier": "device"}}, "optimizer.tier: expected one of cpu, nvme"),
    ("grads-int", {"grads": {"tier": 3}}, "grads.tier: expected one of auto, cpu, nvme, got int 3"),
    (
        "dtype-alias",
        {"params": {"dtype": "fp16"}},
        "params.dtype: expected one of float32, bfloat16, float16, got 'fp16'; did you mean 'float16'?",
    ),
    ("dtype-64", {"params": {"dtype": "float64"}}, "params.dtype: expected one of"),
    (
        "engine-typo",
        {"io": {"engine": "uring"}},
        "io.engine: expected one of auto, io_uring, threads, got 'uring'; did you mean 'io_uring'?",
    ),
    ("device-gpu", {"device": "gpu"}, "device: expected auto, cpu, cuda or cuda:N"),
    ("device-index", {"device": "cuda:x"}, "device: expected auto, cpu, cuda or cuda:N"),
    ("device-negative", {"device": "cuda:-1"}, "device: expected auto, cpu, cuda or cuda:N"),
    ("device-int", {"device": 0}, "device: expected auto, cpu, cuda or cuda:N"),
    # booleans
    ("bool-string", {"io": {"direct": "yes"}}, "io.direct: expected true or false, got a string 'yes'"),
    ("bool-int", {"nvme": {"checksum": 1}}, "nvme.checksum: expected true or false, got int 1"),
    # lists and paths
    ("paths-string", {"nvme": {"paths": "/var/tmp/x"}}, "nvme.paths: expected a list of directories, got a string"),
    ("paths-item", {"nvme": {"paths": [1]}}, "nvme.paths[0]: expected a non-empty string"),
    ("paths-empty", {"nvme": {"paths": []}}, "nvme.paths: expected at least one directory"),
    (
        "paths-duplicate",
        {"nvme": {"paths": ["/var/tmp/tm", "/var/tmp/tm/"]}},
        "nvme.paths[1]: '/var/tmp/tm' is listed twice",
    ),
    (
        "paths-unset-var",
        {"nvme": {"paths": ["$TIERMEM_TEST_UNSET_VAR/x"]}},
        "nvme.paths[0]: environment variable $TIERMEM_TEST_UNSET_VAR",
    ),
    (
        "classes-string",
        {"wrap": {"classes": "Block"}},
        "wrap.classes: expected a list of module class names, got a string 'Block'; write [Block]",
    ),
    ("classes-empty-name", {"wrap": {"classes": [""]}}, "wrap.classes[0]: expected a non-empty string"),
    ("trace-path-number", {"trace": {"path": 3}}, "trace.path: expected a non-empty path string, got"),
    ("update-unknown", {"optimizer": {"update": "backward"}}, "optimizer.update: expected one of"),
    ("overlap-backward-replaced", {"optimizer": {"overlap_backward": True}},
     "optimizer.overlap_backward: was replaced by optimizer.update"),
    # combination rules (docs/config.md, "Combination rules")
    (
        "rule-grads-nvme-opt-cpu",
        {**HOST_ONLY, "grads": {"tier": "nvme"}},
        "grads.tier: 'nvme' needs optimizer.tier 'nvme'",
    ),
    ("rule-sqpoll-threads", {"io": {"engine": "threads", "sqpoll": True}}, "io.sqpoll: true needs io.engine"),
    (
        "rule-window-vs-device",
        {"memory": {"device_budget": "1GiB"}, "prefetch": {"max_bytes": "2GiB"}},
        "prefetch.max_bytes: expected at most memory.device_budget (1GiB), got 2GiB",
    ),
]


@pytest.mark.parametrize(("raw", "prefix"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_key_path(raw: dict[Any, Any], prefix: str) -> None:
    """Each bad config raises a ConfigError (a TiermemError and ValueError) led by its key path."""
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert isinstance(info.value, TiermemError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith(prefix), str(info.value)


def test_nvme_rules_do_not_apply_without_an_nvme_tier(tmp_path: pathlib.Path) -> None:
    """With every tier off NVMe, nvme.paths may be empty or unwritable and host_budget small."""
    afile = tmp_path / "file"
    afile.write_text("x")
    cfg = load_config({**HOST_ONLY, "nvme": {"paths": [str(afile)]}, "memory": {"host_budget": "1MiB"}})
    assert not cfg.uses_nvme
    assert load_config({**HOST_ONLY, "nvme": {"paths": []}}).nvme.paths == ()


def test_allowed_combinations_load(tmp_path: pathlib.Path) -> None:
    """The combinations the rules leave open (device params, nvme grads with nvme optimizer) load."""
    assert load_config({"params": {"tier": "device"}, "optimizer": {"tier": "cpu"}}).params.tier == "device"
    cfg = load_config(_nvme_at(tmp_path, grads={"tier": "nvme"}))
    assert cfg.grads.tier == "nvme"
    assert load_config(None, io__sqpoll=True).io.sqpoll


# ---------------------------------------------------------------------------------------------
# Files and directories


def test_missing_file_names_path(tmp_path: pathlib.Path) -> None:
    """A config file that does not exist fails with its path."""
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=rf"^{re.escape(missing)}: config file does not exist"):
        load_config(missing)


def test_directory_as_file(tmp_path: pathlib.Path) -> None:
    """A directory given as the config file is refused with its path."""
    with pytest.raises(ConfigError, match=r"expected a YAML file, got a directory"):
        load_config(tmp_path)


def test_invalid_yaml_names_path_and_line(tmp_path: pathlib.Path) -> None:
    """Broken YAML fails with path:line:column, not a yaml traceback."""
    path = _write(tmp_path / "bad.yaml", "io:\n  queue_depth: 4\n  block_size: [1MiB\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert re.match(rf"^{re.escape(path)}:\d+:\d+: not valid YAML", message), message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_tab_indented_yaml_is_reported(tmp_path: pathlib.Path) -> None:
    """A tab-indented file reports the line of the tab."""
    path = _write(tmp_path / "tab.yaml", "io:\n\tqueue_depth: 4\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}:2:"):
        load_config(path)


def test_duplicate_key_is_refused(tmp_path: pathlib.Path) -> None:
    """A key given twice in one mapping fails naming both lines (PyYAML would keep the last)."""
    path = _write(tmp_path / "dup.yaml", "prefetch:\n  depth: 1\n  depth: 2\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}:3: key 'depth' is given twice \(first on line 2\)"):
        load_config(path)


def test_yaml_anchors_and_merge_keys_work(tmp_path: pathlib.Path) -> None:
    """Ordinary YAML features (anchors, merge keys) still load."""
    path = _write(
        tmp_path / "anchor.yaml",
        "params: &host {tier: cpu}\noptimizer: *host\ngrads:\n  <<: *host\n",
    )
    cfg = load_config(path)
    assert (cfg.params.tier, cfg.optimizer.tier, cfg.grads.tier) == ("cpu", "cpu", "cpu")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_mapping(tmp_path: pathlib.Path, text: str) -> None:
    """A file whose top level is not a mapping fails with the file path."""
    path = _write(tmp_path / "top.yaml", text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: expected a mapping of config keys"):
        load_config(path)


def test_missing_nvme_dir_is_fine_under_writable_parent(tmp_path: pathlib.Path) -> None:
    """A path that does not exist yet is accepted when its nearest existing ancestor is writable."""
    target = tmp_path / "not" / "yet" / "there"
    cfg = load_config(_nvme_at(target))
    assert cfg.nvme.paths == (str(target),)
    assert not target.exists()


def test_nvme_path_that_is_a_file(tmp_path: pathlib.Path) -> None:
    """An nvme path that exists as a regular file is refused."""
    afile = tmp_path / "swap"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"^nvme\.paths\[0\]: expected a directory, got .* which exists"):
        load_config(_nvme_at(afile))


def test_nvme_path_under_a_file(tmp_path: pathlib.Path) -> None:
    """An nvme path whose nearest existing ancestor is a regular file cannot be created."""
    afile = tmp_path / "swap"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"^nvme\.paths\[0\]: .* cannot be created because .* is not a directory"):
        load_config(_nvme_at(afile / "sub" / "dir"))


def test_second_nvme_path_is_named(tmp_path: pathlib.Path) -> None:
    """A bad entry in a list of paths is named by its index."""
    afile = tmp_path / "swap"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"^nvme\.paths\[1\]: "):
        load_config({"nvme": {"paths": [str(tmp_path / "ok"), str(afile)]}})


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write a chmod 0500 directory; see the os.access test")
def test_nvme_path_not_writable_chmod(tmp_path: pathlib.Path) -> None:
    """A chmod 0500 directory (existing, or as the parent of a new one) is refused."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"^nvme\.paths\[0\]: expected a writable directory"):
            load_config(_nvme_at(locked))
        with pytest.raises(ConfigError, match=r"^nvme\.paths\[0\]: .* cannot be created because .* is not\s+writable"):
            load_config(_nvme_at(locked / "new"))
    finally:
        locked.chmod(0o700)


def test_nvme_path_not_writable_per_os_access(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writability is decided by os.access, so a directory it reports unwritable is refused (even as root)."""
    locked = str(tmp_path / "locked")
    os.mkdir(locked)
    real_access = os.access

    def fake_access(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
        if os.fspath(path) == locked:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", fake_access)
    with pytest.raises(ConfigError, match=r"^nvme\.paths\[0\]: expected a writable directory"):
        load_config(_nvme_at(locked))
    with pytest.raises(ConfigError, match=r"^nvme\.paths\[0\]: .* cannot be created because .* is not writable"):
        load_config(_nvme_at(os.path.join(locked, "new")))


def test_paths_are_expanded_and_absolute(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvme.paths expand ~ and $VARS and become absolute."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TIERMEM_TEST_DIR", str(tmp_path / "env"))
    monkeypatch.chdir(tmp_path)
    cfg = load_config({"nvme": {"paths": ["~/swap", "${TIERMEM_TEST_DIR}/swap", "rel/swap"]}})
    assert cfg.nvme.paths == (
        str(tmp_path / "swap"),
        str(tmp_path / "env" / "swap"),
        str(tmp_path / "rel" / "swap"),
    )
    assert isinstance(cfg.nvme.paths, tuple)


# ---------------------------------------------------------------------------------------------
# Hostile and odd input: every test here is bounded in time, and every message in length


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """YAML "billion laughs": each level lists the previous one `width` times, so the last is width**levels."""
    rows = ["  - &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        rows.append(f"  - &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "params:\n" + "\n".join(rows) + "\n"


def _flow_alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The same bomb as one flow-style YAML value, for --set."""
    items = ["&a0 [" + ", ".join(["lol"] * width) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def _check_short(message: str) -> None:
    assert len(message) < 400, f"{len(message)} characters: {message[:200]}..."


@pytest.mark.timeout(20)
def test_yaml_alias_bomb_is_refused_at_once(tmp_path: pathlib.Path) -> None:
    """A "billion laughs" alias bomb fails fast, naming the file and line, in a short message."""
    path = _write(tmp_path / "bomb.yaml", _alias_bomb())
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert re.match(rf"^{re.escape(path)}:\d+:\d+: .*more than 10000 values", message), message
    _check_short(message)


@pytest.mark.timeout(20)
def test_recursive_yaml_alias_is_refused(tmp_path: pathlib.Path) -> None:
    """An alias inside the value it names (a value that contains itself) is refused, naming the line."""
    path = _write(tmp_path / "loop.yaml", "wrap:\n  classes: &x [a, *x]\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}:2:\d+: .*contains itself"):
        load_config(path)


@pytest.mark.timeout(20)
def test_python_override_bomb_is_described_briefly() -> None:
    """A shared-reference structure passed from Python (2**40 leaves) is described in a bounded message."""
    bomb: list[Any] = ["lol"]
    for _ in range(40):
        bomb = [bomb, bomb]
    with pytest.raises(ConfigError) as info:
        load_config(None, wrap__classes=bomb)
    assert str(info.value).startswith("wrap.classes[0]: expected a non-empty string, got a list")
    _check_short(str(info.value))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("levels", [33, 5000])
def test_deep_yaml_nesting_is_refused(tmp_path: pathlib.Path, levels: int) -> None:
    """YAML nested deeper than 32 levels fails with path:line:column, never a RecursionError."""
    path = _write(tmp_path / "deep.yaml", "wrap:\n  classes: " + "[" * levels + "]" * levels + "\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}:2:\d+: .*deeper than 32 levels"):
        load_config(path)


@pytest.mark.timeout(20)
def test_deep_nesting_through_aliases_is_refused(tmp_path: pathlib.Path) -> None:
    """Aliases that stack shallow values into one deeper than 32 levels are refused too."""
    text = "wrap:\n  classes:\n    - &a " + "[" * 20 + "x" + "]" * 20 + "\n    - " + "[" * 20 + "*a" + "]" * 20 + "\n"
    path = _write(tmp_path / "stacked.yaml", text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}:\d+:\d+: .*deeper than 32 levels"):
        load_config(path)


def test_oversized_config_file_is_refused(tmp_path: pathlib.Path) -> None:
    """A config file over 1 MiB is refused with its path and the limit, before it is parsed."""
    path = _write(tmp_path / "big.yaml", "# padding\n" * (MiB // 10 + 1))
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: config file is larger than 1 MiB"):
        load_config(path)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("digits", ["9" * 5000, "1" + ":1" * 300_000], ids=["decimal", "base-60"])
def test_overlong_yaml_integer_is_refused(tmp_path: pathlib.Path, digits: str) -> None:
    """An integer too long for any key (5000 digits, or a 300,000-part base-60 one) fails fast with its line."""
    path = _write(tmp_path / "long.yaml", f"prefetch:\n  depth: {digits}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert re.match(rf"^{re.escape(path)}:2:\d+: .*integer .*too long", str(info.value)), str(info.value)
    _check_short(str(info.value))


NON_FINITE_YAML = [".inf", "-.inf", ".nan", ".NaN", "1e400", "1.0e+400", "1e300TiB", "-1e400"]


@pytest.mark.parametrize("text", NON_FINITE_YAML)
@pytest.mark.parametrize("key", ["memory.host_budget", "memory.device_budget", "prefetch.max_bytes",
                                 "io.block_size", "wrap.min_unit_bytes", "activations.buffer"])
def test_non_finite_size_in_yaml_names_the_key(tmp_path: pathlib.Path, key: str, text: str) -> None:
    """.inf, .nan and numbers past any byte count give a ConfigError led by the key, never OverflowError."""
    section, name = key.split(".")
    path = _write(tmp_path / "c.yaml", f"{section}:\n  {name}: {text}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{key}: expected "), str(info.value)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 10**40, "1e400", "9" * 5000],
                         ids=["inf", "-inf", "nan", "10**40", "'1e400'", "'9'*5000"])
def test_non_finite_size_from_python_names_the_key(value: object) -> None:
    """The same holds for values given from Python: each error names the key and is short."""
    with pytest.raises(ConfigError) as info:
        load_config(None, **{"memory.host_budget": value})
    assert str(info.value).startswith("memory.host_budget: expected "), str(info.value)
    _check_short(str(info.value))


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan"])
@pytest.mark.parametrize("key", ["prefetch.depth", "io.queue_depth"])
def test_non_finite_integer_names_the_key(tmp_path: pathlib.Path, key: str, text: str) -> None:
    """Integer keys refuse .inf and .nan naming the key."""
    section, name = key.split(".")
    path = _write(tmp_path / "c.yaml", f"{section}:\n  {name}: {text}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: expected an integer"):
        load_config(path)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("inf"), "disk: expected a byte count such as 4096, 1e9, 64MiB or 1.5GiB, got inf, which is not finite"),
        (float("nan"), "disk: expected a byte count such as 4096, 1e9, 64MiB or 1.5GiB, got nan, which is not finite"),
        ("1e400", "disk: expected at most 9223372036854775807 bytes (8 EiB), got '1e400'"),
        ("1e300TiB", "disk: expected at most 9223372036854775807 bytes (8 EiB), got '1e300TiB'"),
        (2**63, "disk: expected at most 9223372036854775807 bytes (8 EiB), got 9223372036854775808"),
    ],
    ids=["inf", "nan", "'1e400'", "'1e300TiB'", "2**63"],
)
def test_parse_size_refuses_non_finite_and_overflow(value: object, message: str) -> None:
    """parse_size raises a ValueError naming `what` for inf, nan and sizes past 2**63 - 1 bytes."""
    with pytest.raises(ValueError) as info:
        parse_size(value, what="disk")
    assert str(info.value) == message


def test_parse_size_keeps_the_largest_sizes() -> None:
    """Sizes up to 2**63 - 1 bytes (the largest file offset) still parse, exactly."""
    assert parse_size(2**63 - 1) == 2**63 - 1
    assert parse_size("8388607TiB") == (2**23 - 1) * 2**40
    assert parse_size(9.2e18) == 9_200_000_000_000_000_000


def test_long_values_are_shortened_in_messages() -> None:
    """A wrong value is shown cut to about 80 characters, however long it is."""
    long = "x" * 100_000
    for raw in ({"params": {"tier": long}}, {"nvme": {"paths": [long + "$NOPE_UNSET_VAR"]}},
                {"wrap": {"classes": long}}, {"prefetch": {long: 1}}, {"io": {"block_size": long}}):
        with pytest.raises(ConfigError) as info:
            load_config(raw)
        _check_short(str(info.value))


@pytest.mark.timeout(20)
def test_long_duplicate_key_is_shortened(tmp_path: pathlib.Path) -> None:
    """A key given twice is named in a short message even when the key is long (YAML allows 1024 characters)."""
    key = "k" * 1000
    path = _write(tmp_path / "dup.yaml", f"{key}: 1\n{key}: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:2: key 'kkk"), str(info.value)[:200]
    _check_short(str(info.value))


def test_host_budget_above_physical_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """memory.host_budget larger than this machine's RAM fails naming the key and both figures."""
    monkeypatch.setattr(config_module, "_physical_memory", lambda: 8 * GiB)
    with pytest.raises(ConfigError) as info:
        load_config({**HOST_ONLY, "memory": {"host_budget": "16GiB"}})
    assert str(info.value).startswith(
        "memory.host_budget: expected at most this machine's physical memory (8 GiB), got 16GiB"
    ), str(info.value)
    assert load_config({**HOST_ONLY, "memory": {"host_budget": "8GiB"}}).memory.host_budget == 8 * GiB


def test_absurd_host_budget_is_refused_here() -> None:
    """On the real machine, a host budget of 1 PiB is refused at load, not left to fail in mmap."""
    with pytest.raises(ConfigError, match=r"^memory\.host_budget: expected at most this machine's physical memory"):
        load_config({**HOST_ONLY, "memory": {"host_budget": "1024TiB"}})


# ---------------------------------------------------------------------------------------------
# Direct construction


def test_components_check_themselves_on_construction() -> None:
    """Building a component directly runs the same checks and normalisation as load_config."""
    with pytest.raises(ConfigError, match=r"^io\.queue_depth: expected an integer from 1 to 4096, got 0"):
        IOConfig(queue_depth=0)
    nvme = NvmeConfig(paths=["/var/tmp/a"], stripe_size="2MiB")  # type: ignore[arg-type]
    assert (nvme.paths, nvme.stripe_size) == (("/var/tmp/a",), 2 * MiB)


def test_config_refuses_raw_mapping_sections() -> None:
    """Config(params={...}) is refused with a pointer to load_config."""
    with pytest.raises(ConfigError, match=r"^params: expected a ParamsConfig, got a mapping; build configs"):
        Config(params={"tier": "cpu"})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Docs


def test_docs_cover_every_key() -> None:
    """docs/config.md mentions every key by its dotted path."""
    text = (REPO / "docs" / "config.md").read_text(encoding="utf-8")

    def paths(d: dict[str, Any], prefix: str = "") -> list[str]:
        out: list[str] = []
        for k, v in d.items():
            out += paths(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
        return out

    missing = [p for p in paths(Config().to_dict()) if f"`{p}`" not in text]
    assert not missing, missing


# ---------------------------------------------------------------------------------------------
# CLI


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tiermem")
    subparsers = parser.add_subparsers(dest="command")
    config_cmd.register(subparsers)
    return parser.parse_args(argv)


def test_cli_check_ok(capsys: pytest.CaptureFixture[str]) -> None:
    """`tiermem config check FILE...` prints "FILE: ok" per file and exits 0."""
    files = [str(p) for p in CONFIGS]
    args = _cli(["config", "check", *files])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{f}: ok" for f in files]


def test_cli_check_bad(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tiermem config check` prints the ConfigError to stderr and exits 2."""
    bad = _write(tmp_path / "bad.yaml", "io:\n  queue_depth: 0\n")
    good = str(REPO / "configs" / "cpu.yaml")
    args = _cli(["config", "check", bad, good])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"{bad}: io.queue_depth: expected an integer from 1 to 4096, got 0"
    assert captured.out.strip() == f"{good}: ok"


def test_cli_check_missing_file_is_not_doubled(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file-level error is printed once with the path, not prefixed twice."""
    missing = str(tmp_path / "nope.yaml")
    args = _cli(["config", "check", missing])
    assert args.func(args) == 2
    assert capsys.readouterr().err.strip() == f"{missing}: config file does not exist; check the path"


@pytest.mark.parametrize(("text", "where", "what"), [
    ("memory:\n  host_budget: 1GiB\0\n", "2:20", "a NUL byte"),
    ("\0" * 64, "1:1", "a NUL byte"),
    ("prefetch:\n  depth: 2\x07\n", "2:11", "the control character U+0007"),
], ids=["nul-in-a-value", "nul-only", "bell"])
def test_cli_check_a_control_character_is_one_line_naming_where(tmp_path: pathlib.Path, text: str, where: str,
                                                                what: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A NUL byte or another control character in a swap-config is one line with file:line:column, exit 2."""
    path = _write(tmp_path / "nul.yaml", text)
    args = _cli(["config", "check", path])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:{where}: not valid YAML: {what}, which YAML does not allow"), err
    assert len(err.splitlines()) == 1
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}:{where}: "):
        load_config(path)


def test_cli_set_value_with_a_control_character_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    """A control character in a --set value is an argparse usage error naming the key, not a ReaderError."""
    with pytest.raises(SystemExit) as info:
        _cli(["config", "show", "--set", "prefetch.depth=2\x01"])
    assert info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "argument --set: prefetch.depth:1:2: not valid YAML: the control character U+0001" in last, last


def test_cli_show_prints_loadable_effective_config(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tiermem config show FILE` prints the full config, which loads back equal."""
    path = str(REPO / "configs" / "nvme.yaml")
    args = _cli(["config", "show", path])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("# tiermem config from ")
    assert "queue_depth: 32" in out and "sqpoll: false" in out  # defaults filled in
    assert load_config(_write(tmp_path / "shown.yaml", out)) == load_config(path)


def test_cli_show_defaults_and_set(capsys: pytest.CaptureFixture[str]) -> None:
    """`tiermem config show` without FILE prints defaults; --set applies YAML-typed overrides."""
    args = _cli(["config", "show", "--set", "prefetch.depth=4", "--set", "io.block_size=4MiB"])
    assert args.func(args) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["prefetch"]["depth"] == 4
    assert shown["io"]["block_size"] == "4MiB"


def test_cli_show_bad_override(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --set value is reported like a bad file value, with exit status 2."""
    args = _cli(["config", "show", "--set", "prefetch.depth=-1"])
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith("prefetch.depth: expected an integer >= 0, got -1")


def test_cli_set_needs_key_value(capsys: pytest.CaptureFixture[str]) -> None:
    """--set without '=' is an argparse usage error."""
    with pytest.raises(SystemExit) as info:
        _cli(["config", "show", "--set", "prefetch.depth"])
    assert info.value.code == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[" * 5000 + "]" * 5000, "deeper than 32 levels"),
        (_flow_alias_bomb(), "more than 10000 values"),
        ("9" * 5000, "too long"),
    ],
    ids=["deep", "alias-bomb", "long-integer"],
)
def test_cli_set_value_is_bounded_like_a_file(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A hostile --set value is an argparse usage error (exit 2) with a short message naming the key."""
    with pytest.raises(SystemExit) as info:
        _cli(["config", "show", "--set", f"wrap.classes={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert re.search(r"argument --set: wrap\.classes:1:\d+: ", last) and message in last, err[-500:]
    _check_short(last)


def test_cli_show_non_finite_set_value_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    """`config show --set memory.host_budget=.inf` exits 2 naming the key, not with an OverflowError."""
    args = _cli(["config", "show", "--set", "memory.host_budget=.inf"])
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith("memory.host_budget: expected ")


def test_cli_config_needs_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """`tiermem config` alone is a usage error naming check and show."""
    with pytest.raises(SystemExit):
        _cli(["config"])
    assert "check,show" in capsys.readouterr().err


def test_params_on_nvme_with_optimizer_on_host_is_allowed():
    """params.tier nvme with optimizer.tier cpu loads (ZeRO-Infinity's parameter-only offload)."""
    cfg = load_config({"params": {"tier": "nvme"}, "optimizer": {"tier": "cpu"}})
    assert (cfg.params.tier, cfg.optimizer.tier) == ("nvme", "cpu")


def test_small_host_budget_with_nvme_is_allowed():
    """Requests read straight into partition buffers, so the host budget need not cover block x depth."""
    cfg = load_config({"memory": {"host_budget": "2MiB"}})
    assert cfg.memory.host_budget == 2 << 20
