"""`tiermem tune`: the coarse-to-fine search of I/O settings, its time limit, the model's plans and the config."""

from __future__ import annotations

import itertools
import json
import math
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests import models
from tiermem.cli import main
from tiermem.cli.bench import SWEEP_BLOCK_SIZES, SWEEP_QUEUE_DEPTHS
from tiermem.config import load_config
from tiermem.sizes import parse_size
from tiermem.tune import BLOCK_SIZES, QUEUE_DEPTHS, Setting, choose_for_model, search

VARIANTS = [("io_uring", False), ("io_uring", True), ("threads", False)]


class FakeDisk:
    """GB/s that rise to one peak along each axis (at `peak`), and a clock that each measurement moves by
    `cost` seconds: the search without a disk, deterministic."""

    def __init__(self, peak: Setting, cost: float = 1.0, bumpy: bool = False) -> None:
        self.peak, self.cost, self.bumpy = peak, cost, bumpy
        self.now = 0.0
        self.calls: list[Setting] = []

    def gbps(self, s: Setting) -> float:
        distance = abs(math.log2(s.block_size / self.peak.block_size)) + abs(math.log2(s.queue_depth /
                                                                                      self.peak.queue_depth))
        rate = 3.0 / (1 + 0.3 * distance) * (1.0 if s.variant == self.peak.variant else 0.9)
        if self.bumpy and (s.block_size, s.queue_depth) == (BLOCK_SIZES[0], QUEUE_DEPTHS[-1]):
            rate *= 1.4  # a lone spike away from the peak, which a coarse point does not hit
        return rate

    def measure(self, s: Setting) -> tuple[float, float]:
        self.calls.append(s)
        self.now += self.cost
        return self.gbps(s), self.gbps(s) * 0.8

    def clock(self) -> float:
        return self.now


def _grid(variants: list[tuple[str, bool]], bss: list[int], qds: list[int]) -> list[Setting]:
    return [Setting(e, b, q, sq) for (e, sq), b, q in itertools.product(variants, bss, qds)]


def test_the_search_reaches_a_single_peak_measuring_a_part_of_the_grid() -> None:
    """On a grid whose GB/s rise to one peak along each axis, coarse-to-fine picks that peak, the best of what
    it measured, having measured fewer than half of the grid's settings, each of them in the grid."""
    peak = Setting("io_uring", 2 << 20, 16, True)
    disk = FakeDisk(peak)
    ranked = search(VARIANTS, BLOCK_SIZES, QUEUE_DEPTHS, disk.measure, time_limit=1e9, clock=disk.clock)
    grid = _grid(VARIANTS, BLOCK_SIZES, QUEUE_DEPTHS)
    assert ranked[0].setting == peak
    assert ranked[0].score == max(m.score for m in ranked)
    assert {m.setting for m in ranked} <= set(grid) and len(ranked) < len(grid) / 2
    assert [m.score for m in ranked] == sorted((m.score for m in ranked), reverse=True)
    assert len(ranked[0].read) == 4  # the best three are measured again in three rounds
    assert ranked[0].score == pytest.approx(2 * 3.0 * 2.4 / 5.4)  # harmonic mean of read and write


@pytest.mark.parametrize("peak", [Setting("threads", 512 << 10, 1), Setting("io_uring", 4 << 20, 32, True),
                                  Setting("io_uring", 128 << 10, 8)])
def test_on_the_sweep_grid_the_pick_is_within_5_percent_of_the_sweeps_best(peak: Setting) -> None:
    """Given `tiermem bench io --sweep`'s grid, the search's pick scores within 5% of the best the exhaustive
    sweep finds (here: the same setting), for peaks at a corner, an edge and inside."""
    disk = FakeDisk(peak)
    bss = [parse_size(b) for b in SWEEP_BLOCK_SIZES]
    ranked = search(VARIANTS, bss, SWEEP_QUEUE_DEPTHS, disk.measure, time_limit=1e9, clock=disk.clock)
    exhaustive = max(_grid(VARIANTS, bss, SWEEP_QUEUE_DEPTHS), key=lambda s: disk.gbps(s))
    assert ranked[0].score >= 0.95 * 2 * disk.gbps(exhaustive) * 0.8 / 1.8
    assert ranked[0].setting == exhaustive


def test_a_spike_the_search_misses_is_not_claimed() -> None:
    """Where the best setting is a lone spike no coarse point nor its neighbours reach, the pick is still the
    best of what was measured, never a setting it did not measure."""
    disk = FakeDisk(Setting("threads", 2 << 20, 8), bumpy=True)
    ranked = search([("threads", False)], BLOCK_SIZES, QUEUE_DEPTHS, disk.measure, time_limit=1e9,
                    clock=disk.clock)
    assert ranked[0].setting in set(disk.calls)
    assert ranked[0].score == max(m.score for m in ranked)


def test_the_time_limit_stops_the_search_before_a_measurement_would_pass_it() -> None:
    """Each measurement takes 1 s on the fake clock: a 10.5 s limit allows 10 of them and the search ends by
    10.5 s; the first one is taken even under a limit shorter than it."""
    disk = FakeDisk(Setting("threads", 1 << 20, 8))
    ranked = search(VARIANTS, BLOCK_SIZES, QUEUE_DEPTHS, disk.measure, time_limit=10.5, clock=disk.clock)
    assert len(disk.calls) == 10 and disk.now <= 10.5
    assert ranked[0].score == max(m.score for m in ranked)
    disk = FakeDisk(Setting("threads", 1 << 20, 8), cost=5.0)
    assert len(search(VARIANTS, BLOCK_SIZES, QUEUE_DEPTHS, disk.measure, time_limit=1.0, clock=disk.clock)) == 1


def _plan(bounds: dict[int, float | None], fits: set[int], nvme_activations: bool = False) -> Any:
    """A stand-in for tiermem.plan: the step bound and fit per prefetch.depth."""

    def plan(model: Any, config: Any, **keys: Any) -> Any:
        depth = keys.get("prefetch.depth", 2)
        cfg = SimpleNamespace(activations=SimpleNamespace(tier="nvme" if nvme_activations else "memory"),
                              memory=SimpleNamespace(host_budget=64 << 20))
        return SimpleNamespace(config=cfg, fits=depth in fits, fixes=[] if depth in fits else ["x"],
                               step_seconds_min=bounds[depth], step_note="")

    return plan


def test_the_model_choice_is_the_lowest_bound_that_fits_and_the_deeper_window_on_a_tie() -> None:
    """Of the plans that fit the one with the lowest step bound wins; on equal bounds the deeper window; a
    plan that does not fit is not chosen however low its bound; with activations on NVMe the host budget's
    split is weighed too (a smaller activations buffer on a tie)."""
    plan = _plan({1: 2.0, 2: 1.5, 3: 1.5, 4: 0.1}, fits={1, 2, 3})
    choice = choose_for_model(None, None, {}, plan_fn=plan)
    assert choice.overrides == {"prefetch.depth": 3} and choice.step_seconds_min == 1.5
    assert len(choice.candidates) == 4
    choice = choose_for_model(None, None, {}, plan_fn=_plan({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, {1, 2, 3, 4}, True))
    assert choice.overrides == {"prefetch.depth": 4, "activations.buffer": (64 << 20) // 16}
    assert len(choice.candidates) == 12


def test_tiermem_tune_measures_writes_a_config_that_loads_and_keeps_its_time_limit(tmp_path, capsys,
                                                                                   monkeypatch) -> None:
    """A real search on a small grid (threads engine, 1 MiB per measurement): the JSON lists what was measured,
    the pick is its best, the YAML it writes loads with the pick's io.* settings and the swap directory, the
    figures are cached for tiermem plan, and it ends within a generous bound of its time limit."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "tiermem.yaml"
    began = time.monotonic()
    assert main(["tune", "--path", str(tmp_path / "swap"), "--engine", "threads", "--size", "1MiB",
                 "--block-size", "64KiB,128KiB,256KiB", "--queue-depth", "1,4,16", "--time-limit", "3s",
                 "--out", str(out), "--json"]) == 0
    elapsed = time.monotonic() - began
    result = json.loads(capsys.readouterr().out)
    assert elapsed < 3 + 20  # the limit, and a generous margin for one measurement and the config
    assert result["elapsed_seconds"] <= 3 + 10
    measured = result["measured"]
    assert measured and result["pick"] == measured[0]
    assert measured[0]["score_gbps"] == max(m["score_gbps"] for m in measured)
    cfg = load_config(str(out))
    pick = result["pick"]
    assert (cfg.io.engine, cfg.io.block_size, cfg.io.queue_depth, cfg.io.sqpoll) == (
        "threads", pick["block_size"], pick["queue_depth"], False)
    assert cfg.nvme.paths == (str(tmp_path / "swap"),)
    assert (tmp_path / "cache" / "tiermem" / "bench-io.json").exists()


def test_tiermem_tune_with_a_model_sets_the_prefetch_depth_from_its_plans(tmp_path, capsys, monkeypatch) -> None:
    """With --model (a transformers config.json), the plans choose prefetch.depth, which the YAML carries
    beside the measured io.* settings; the table and the pick are printed."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    models.llama().config.to_json_file(str(tmp_path / "config.json"))
    out = tmp_path / "tiermem.yaml"
    assert main(["tune", "--path", str(tmp_path / "swap"), "--engine", "threads", "--size", "1MiB",
                 "--block-size", "128KiB", "--queue-depth", "4", "--time-limit", "20s", "--model",
                 str(tmp_path / "config.json"), "--optimizer", "adamw", "--set", "memory.host_budget=3MiB",
                 "--set", "wrap.min_unit_bytes=16KiB", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "pick: threads" in text and "model: prefetch.depth" in text and f"written to {out}" in text
    cfg = load_config(str(out))
    assert cfg.prefetch.depth in (1, 2, 3, 4) and cfg.memory.host_budget == 3 << 20


@pytest.mark.parametrize("argv, named", [
    (["--time-limit", "soon"], "--time-limit: expected a positive duration"),
    (["--block-size", "1000"], "--block-size"),
    (["--queue-depth", "0"], "--queue-depth: expected integers from 1 to 4096"),
])
def test_bad_options_are_errors_naming_them(tmp_path, capsys, argv: list[str], named: str) -> None:
    """A bad option is one error line naming it, exit status 2, before anything is measured."""
    assert main(["tune", "--path", str(tmp_path / "swap"), *argv]) == 2
    assert named in capsys.readouterr().err
