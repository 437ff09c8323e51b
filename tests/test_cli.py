"""The command line: `tiermem bench io` smoke runs, its JSON contract, `tiermem info`, and bad options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiermem.cli import main

RESULT_KEYS = {"engine", "mode", "block_size", "queue_depth", "bytes", "gbps_mean", "gbps_std",
               "cpu_seconds_per_gib", "direct"}


def _tiermem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiermem", *args], capture_output=True, text=True, timeout=300)


def test_bench_io_json_has_the_contract_keys_and_positive_figures(tmp_path) -> None:
    """A small run prints one JSON object with system info and a result per engine and mode, all positive."""
    res = _tiermem("bench", "io", "--path", str(tmp_path), "--size", "8MiB", "--runs", "2",
                   "--block-size", "1MiB", "--queue-depth", "4", "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert {"kernel", "paths", "engines"} <= set(doc["system"])
    results = doc["results"]
    usable = [k for k, v in doc["system"]["engines"].items() if v == "available"]
    assert {(r["engine"], r["mode"]) for r in results} == {(e, m) for e in usable for m in ("write", "read")}
    for r in results:
        assert RESULT_KEYS <= set(r)
        assert r["gbps_mean"] > 0 and r["gbps_std"] >= 0 and r["cpu_seconds_per_gib"] >= 0
        assert r["bytes"] == 8 << 20 and r["block_size"] == 1 << 20 and r["queue_depth"] == 4
        assert r["direct"] is True
    assert os.listdir(tmp_path) == []  # the benchmark's files are gone


def test_bench_io_human_output_and_plot(tmp_path) -> None:
    """Human mode prints the header and table and writes the PNG plot; stderr is not a terminal here, so no
    progress bar is drawn into it."""
    plot = tmp_path / "bw.png"
    res = _tiermem("bench", "io", "--path", str(tmp_path / "d"), "--size", "4MiB", "--runs", "1",
                   "--engine", "threads", "--mode", "read", "--block-size", "256KiB", "--plot", str(plot))
    assert res.returncode == 0, res.stderr
    assert "tiermem bench io" in res.stdout and "GB/s" in res.stdout and "CPU s/GiB" in res.stdout
    assert "threads   read" in res.stdout
    assert "%|" not in res.stderr and "progress" not in res.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_io_sweep_covers_the_grid(tmp_path) -> None:
    """--sweep measures every block size x queue depth of the grid."""
    res = _tiermem("bench", "io", "--path", str(tmp_path), "--size", "4MiB", "--runs", "1", "--sweep",
                   "--engine", "threads", "--mode", "write", "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    grid = {(r["block_size"], r["queue_depth"]) for r in json.loads(res.stdout)["results"]}
    assert grid == {(b, q) for b in (128 << 10, 512 << 10, 1 << 20, 4 << 20) for q in (1, 8, 32)}


def test_bench_io_without_o_direct_says_cache_dropped(ramfs_dir: str) -> None:
    """On a filesystem without O_DIRECT the results say direct=false and that the cache was dropped."""
    res = _tiermem("bench", "io", "--path", ramfs_dir, "--size", "4MiB", "--runs", "1", "--engine", "threads",
                   "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    for r in json.loads(res.stdout)["results"]:
        assert r["direct"] is False and r["cache"] == "dropped"


@pytest.mark.parametrize(("args", "message"), [
    (["--size", "lots"], "--size: expected a byte count"),
    (["--size", "0"], "--size: expected a positive size"),
    (["--block-size", "1000"], "--block-size: expected a positive multiple of 4096"),
    (["--queue-depth", "0"], "--queue-depth: expected integers from 1 to 4096"),
    (["--queue-depth", "x"], "--queue-depth: expected integers >= 1"),
    (["--runs", "0"], "--runs: expected an integer >= 1"),
    (["--sweep", "--block-size", "1MiB"], "--sweep chooses block sizes"),
    (["--size", "1e400"], "--size: expected at most 9223372036854775807 bytes (8 EiB), got '1e400'"),
    (["--size", "1e300TiB"], "--size: expected at most 9223372036854775807 bytes (8 EiB)"),
    (["--block-size", "1e400"], "--block-size: expected at most"),
    (["--stripe-size", "1e400"], "--stripe-size: expected at most"),
    (["--queue-depth", "1e400"], "--queue-depth: expected integers >= 1, got '1e400'"),
])
def test_bench_io_bad_options_name_the_option(args: list[str], message: str, capsys, tmp_path) -> None:
    """Each bad option exits 2 with a message naming the option and what it expects."""
    assert main(["bench", "io", "--path", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--size", "9" * 5000], ["--queue-depth", "9" * 5000],
                                  ["--block-size", "x" * 5000]], ids=["size", "queue-depth", "block-size"])
def test_bench_io_long_bad_option_gives_a_short_message(args: list[str], capsys, tmp_path) -> None:
    """A bad option thousands of characters long is quoted cut short, in one line."""
    assert main(["bench", "io", "--path", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tiermem: error: {args[0]}: ") and err.count("\n") == 1 and len(err) < 300, err[:300]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "flag"), [
    (["bench", "io", "--size", "1e400"], "--size"),
    (["bench", "io", "--block-size", "1e400"], "--block-size"),
    (["demo", "--host-budget", "1e400"], "--host-budget"),
    (["demo", "--only", "train", "--train-budget", "1e400"], "--train-budget"),
    (["demo", "--host-budget", "lots"], "--host-budget"),
], ids=["bench-size", "bench-block-size", "demo-host-budget", "demo-train-budget", "demo-garbage"])
def test_size_flag_overflow_is_one_line_exit_2(args: list[str], flag: str, tmp_path) -> None:
    """A size flag such as `--size 1e400` exits 2 with one `tiermem: error:` line naming the flag, no traceback."""
    res = _tiermem(*args, "--path" if args[0] == "bench" else "--dir", str(tmp_path))
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.startswith(f"tiermem: error: {flag}: ") and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_bench_io_unwritable_path_is_a_clear_error(tmp_path, capsys) -> None:
    """A --path under a regular file fails with exit 2 and a message naming the option and path."""
    (tmp_path / "f").write_text("x")
    bad = str(tmp_path / "f" / "sub")
    assert main(["bench", "io", "--path", bad, "--size", "1MiB", "--runs", "1", "--no-progress"]) == 2
    assert f"--path {bad}: cannot create the directory" in capsys.readouterr().err


def test_info_reports_backends(capsys) -> None:
    """`tiermem info --json` lists each backend as available or with the reason it is not."""
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["engines"]) == {"io_uring", "threads"}
    assert info["engines"]["threads"] == "available"
    assert info["torch"]


def test_demo_runs_small_and_matches_itself(tmp_path) -> None:
    """`tiermem demo` on a tiny shape prints the summary and both runs generate the same tokens."""
    pytest.importorskip("transformers")
    res = _tiermem("demo", "--only", "infer", "--dir", str(tmp_path), "--layers", "2", "--width", "64",
                   "--host-budget", "16MiB", "--tokens", "3", "--prompt", "4")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "with prefetch" in res.stdout and "without prefetch" in res.stdout
    assert "both runs generated the same tokens: True" in res.stdout
    assert not (tmp_path / "swap").exists()


def test_training_demo_runs_small(tmp_path) -> None:
    """`tiermem demo --only train` on a tiny GPT trains from NVMe, prints the summary and writes a checkpoint."""
    pytest.importorskip("transformers")
    res = _tiermem("demo", "--only", "train", "--dir", str(tmp_path), "--train-layers", "1", "--train-width", "64",
                   "--train-budget", "16MiB", "--train-steps", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step time" in res.stdout and "checkpoint written to" in res.stdout
    assert (tmp_path / "train-checkpoint" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "swap-train").exists()


def test_the_demo_prints_its_figures_as_json(tmp_path) -> None:
    """`tiermem demo --json` prints one JSON object and nothing else: both parts' figures, the training's as
    tm.stats() counted them (a falling loss on its repeated batch, bytes moved, a checkpoint that exists)."""
    pytest.importorskip("transformers")
    res = _tiermem("demo", "--json", "--dir", str(tmp_path), "--layers", "2", "--width", "64", "--host-budget",
                   "16MiB", "--tokens", "3", "--prompt", "4", "--train-layers", "1", "--train-width", "64",
                   "--train-budget", "16MiB", "--train-steps", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    figures = json.loads(res.stdout)
    infer, train = figures["inference"], figures["training"]
    assert [r["run"] for r in infer["runs"]] == ["with prefetch", "without prefetch"] and infer["same_tokens"]
    # at this size the whole model fits the budget and stays resident: nothing needs reading back
    runs = infer["runs"]
    assert all(r["tokens_per_second"] > 0 and r["peak_bytes"]["nvme"] >= infer["parameter_bytes"] for r in runs)
    assert len(train["losses"]) == 3 and train["losses"][-1] < train["losses"][0]
    assert train["bytes_read"] > 0 and train["bytes_written"] > 0 and train["host_budget"] == 16 << 20
    assert os.path.isdir(train["checkpoint"]) and train["steps_peak_rss_bytes"] > 0


def test_the_progress_bar_draws_on_a_terminal_only() -> None:
    """On a terminal the bar (tqdm) shows the label and reaches 100%; anywhere else it writes nothing."""
    import io

    from tiermem.cli.progress import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term, pipe = Terminal(), io.StringIO()
    for stream in (term, pipe):
        bar = ProgressBar(stream)
        for k in range(1, 5):
            bar(k, 4, f"read {k}/4")
        bar.close()
    assert "read 4/4" in term.getvalue() and "100%" in term.getvalue() and "4/4" in term.getvalue()
    assert pipe.getvalue() == ""
