"""Timeline traces (trace.path, tm.trace()): Chrome trace / Perfetto JSON with compute, waits, updates, I/O."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import models
from tiermem import OffloadError, tiered_offload


def _cfg(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme", "grads.tier": "cpu",
                           "nvme.paths": [str(tmp_path / "swap")], "memory.host_budget": "1MiB",
                           "wrap.min_unit_bytes": 0}
    out.update(extra)
    return out


def _model() -> torch.nn.Module:
    model = models.gpt2(layers=2, width=32, vocab=100)
    model.config.use_cache = False
    return model.train()


def _train(model: torch.nn.Module, tm: Any, steps: int) -> None:
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        tm.optimizer.zero_grad()
        tm.backward(model(ids, labels=ids).loss)
        tm.clip_grad_norm_(1.0)
        tm.optimizer.step()


def _tracks(trace: dict[str, Any]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


def _spans(trace: dict[str, Any], track: str) -> list[dict[str, Any]]:
    """The spans of `track`; "read" and "write" gather every directory's track of that direction."""
    tids = {tid for tid, name in _tracks(trace).items() if name == track or name.startswith(f"{track} ")}
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] in tids]


def test_a_trace_of_training_has_every_units_compute_and_update_and_every_transfer(tmp_path) -> None:
    """With trace.path set, leaving the context writes a JSON trace: a forward and a backward span for every
    unit, an update span for every trained unit, the waits, a span per NVMe read and write whose bytes add
    up to what tm.stats() counted, and the bytes held per tier as counters."""
    model = _model()
    path = tmp_path / "out" / "trace.json"
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        **_cfg(tmp_path, **{"trace.path": str(path)})) as tm:
        _train(model, tm, 3)
        stats = tm.stats()
        names = [u.name for u in tm.units]
        trained = [st.unit.name for st in tm.optimizer.units]
    trace = json.loads(path.read_text())
    compute = {e["name"] for e in _spans(trace, "compute")}
    for name in names:
        assert {f"forward {name}", f"backward {name}"} <= compute, (name, compute)
    assert {e["name"] for e in _spans(trace, "optimizer")} == {f"update {n}" for n in trained}
    assert _spans(trace, "wait")
    reads, writes = _spans(trace, "read"), _spans(trace, "write")
    assert reads and writes and all(e["args"]["bytes"] > 0 and e["args"]["ok"] for e in reads + writes)
    # the context's reads and writes until stats(), then exit's: at least what stats() counted
    assert sum(e["args"]["bytes"] for e in reads) >= stats["bytes_read"] > 0
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
    held = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "bytes held"]
    assert held and max(e["args"]["host"] for e in held) > 0


def test_each_swap_directory_has_a_read_and_a_write_track_with_its_pieces(tmp_path, compute_device) -> None:
    """With two nvme.paths (striped), every transfer has a span on "read DIR" / "write DIR" of each directory
    its stripes touch, with the bytes, tier, swap file and offset there; each transfer's spans add up to what
    stats() counts; copies to and from the device are spans on "copy" exactly on a device with memory of its
    own (none on the CPU); waits name their partition, updates that waited for their state say so; the bytes
    held include NVMe and are sampled at each acquisition and each transfer's completion."""
    model = _model()
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    path = tmp_path / "t.json"
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        **_cfg(tmp_path, **{"nvme.paths": dirs, "nvme.stripe_size": "4KiB"})) as tm:
        _train(model, tm, 1)
        tm.reset_stats()
        with tm.trace(path):
            _train(model, tm, 2)
            for st in tm.optimizer.units:  # the recorded updates' state back on NVMe: the next forward waits
                tm.swapper.evict(st.state).wait()  # for it, however early the last backward read it ahead
            _train(model, tm, 1)
        stats = tm.stats()
    trace = json.loads(path.read_text())
    names = set(_tracks(trace).values())
    assert {f"{op} {d}" for op in ("read", "write") for d in dirs} <= names, names
    assert trace["otherData"]["io_tracks"][f"read {dirs[1]}"] == {"op": "read", "path": dirs[1]}
    reads, writes = _spans(trace, "read"), _spans(trace, "write")
    for e in reads + writes:
        d = _tracks(trace)[e["tid"]].split(" ", 1)[1]
        assert e["args"]["file"].startswith(d + "/") and e["args"]["offset"] % 4096 == 0 and e["args"]["ok"]
        assert e["args"]["tier"] == ("nvme->host" if e in reads else "host->nvme")
    assert sum(e["args"]["bytes"] for e in reads) <= stats["bytes_read"]
    per_read: dict[tuple[str, float], int] = {}  # a transfer: its partition and when it began
    for e in reads:
        per_read[(e["name"], e["ts"])] = per_read.get((e["name"], e["ts"]), 0) + 1
    assert max(per_read.values()) == 2  # a partition over 4 KiB is striped over both directories
    copies = _spans(trace, "copy")
    if compute_device is None:
        assert not copies
    else:
        assert {e["args"]["to"] for e in copies} >= {"device"} and all(e["args"]["bytes"] > 0 for e in copies)
    waits = _spans(trace, "wait")
    assert all("partition" in e["args"] for e in waits if e["args"].get("kind") != "state")
    assert any(e["args"].get("kind") == "state" for e in waits)
    held = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "bytes held"]
    assert max(e["args"]["nvme"] for e in held) > 0
    assert len(held) >= len(_spans(trace, "compute")) + len(per_read)


def test_tm_trace_records_a_block_and_its_reads_are_what_stats_counts(tmp_path) -> None:
    """tm.trace(path) records the transfers its block starts, all of them, and nothing from before it (a read
    that began before the block and ended in it counts in stats() only); a second trace inside is refused,
    and an unwritable path is an error naming it."""
    model = _model()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **_cfg(tmp_path)) as tm:
        _train(model, tm, 1)  # not traced
        tm.swapper.evict_idle()  # the block reads what it needs: updated states may stay in host memory otherwise
        tm.reset_stats()
        with tm.trace(tmp_path / "block.json"):
            _train(model, tm, 2)
            with pytest.raises(OffloadError, match="already being recorded"):
                with tm.trace(tmp_path / "other.json"):
                    pass
        stats = tm.stats()
    trace = json.loads((tmp_path / "block.json").read_text())
    assert 0 < sum(e["args"]["bytes"] for e in _spans(trace, "read")) <= stats["bytes_read"]
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X") >= 0
    assert not (tmp_path / "other.json").exists()
    with tiered_offload(model, **_cfg(tmp_path)) as tm:
        with pytest.raises(OffloadError, match=r"tm.trace\(\): could not write the trace to .*a-dir"):
            (tmp_path / "a-dir").mkdir()
            with tm.trace(tmp_path / "a-dir"):
                pass


def test_an_unwritable_trace_path_is_a_clear_error_after_the_parameters_come_back(tmp_path) -> None:
    """trace.path naming a directory: leaving raises an OffloadError that names trace.path, once every
    parameter has been given back."""
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (tmp_path / "a-dir").mkdir()
    with pytest.raises(OffloadError, match="trace.path: could not write the trace"):
        with tiered_offload(model, **_cfg(tmp_path, **{"trace.path": str(tmp_path / "a-dir")})):
            with torch.no_grad():
                model(torch.zeros(1, 4, dtype=torch.long))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def _synthetic() -> dict[str, Any]:
    """A trace with known spans (microseconds): compute 0-100 and 150-250, a wait 100-150, reads 50-200."""
    from tiermem.trace import Tracer

    t = Tracer({"prefetch": {"depth": 2}})
    t.span("compute", "forward a", 0, 100)
    t.span("compute", "forward b", 150, 250)
    t.span("wait", "wait b", 100, 150, unit=1)
    t.span("read /nvme", "b", 50, 200, bytes=3_000_000, ok=True)
    return {"traceEvents": json.loads(json.dumps(t.events)) + [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": n}}
        for n, tid in t._tids.items()], "otherData": {"config": t.config}}


def test_the_report_measures_overlap_and_waits_exactly_and_names_the_setting() -> None:
    """summarize() on known spans: 250 µs recorded, 200 of compute, 50 of waiting, reads in flight 150 of which
    100 overlap compute, 3 MB read at 20 GB/s; a wait of a fifth of the time with the disk idle most of it
    advises raising prefetch.depth from 2 to 3."""
    from tiermem.trace import summarize

    s = summarize(_synthetic())
    assert s["wall_seconds"] == pytest.approx(250e-6) and s["compute_seconds"] == pytest.approx(200e-6)
    assert s["wait_seconds"] == pytest.approx(50e-6) and s["io_busy_seconds"] == pytest.approx(150e-6)
    assert s["io_overlapped_with_compute"] == pytest.approx(100 / 150)
    assert s["read_bytes"] == 3_000_000 and s["read_gbps"] == pytest.approx(20.0)
    assert s["waits_by_unit"] == {"b": pytest.approx(50e-6)}
    assert s["wait_reasons"] == [{"reason": "in_flight", "what": pytest.approx(s["wait_reasons"][0]["what"]),
                                  "seconds": pytest.approx(50e-6), "waits": 1, "share": 1.0}]
    assert s["deeper_window"]["hidden_seconds"] == 0  # b's read began before anything else was fetched
    assert "I/O-bound: 5e-05 s of the waits were reads in flight" in s["advice"][0]


def _trace_of(spans: list[tuple[str, str, float, float, dict[str, Any]]], depth: int = 1) -> dict[str, Any]:
    from tiermem.trace import Tracer

    t = Tracer({"prefetch": {"depth": depth}, "nvme": {"paths": ["/nvme"]}})
    for track, name, a, b, args in spans:
        t.span(track, name, a, b, **args)
    return {"traceEvents": json.loads(json.dumps(t.events)) + [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": n}}
        for n, tid in t._tids.items()], "otherData": {"config": t.config}}


def test_waits_are_put_down_to_their_reasons_and_a_deeper_window_is_estimated_from_the_disk_idle() -> None:
    """Five units, window 1 (microseconds): c's read was issued at b's fetch and d's at c's, both in flight
    when needed; e's only at its own fetch (not issued); a state wait and a gather are their own reasons. One
    unit deeper issues each read one fetch earlier, as far as the disk was idle: c's at a's fetch (idle 60 of
    the 100 before, its wait 60: hides 60), d's not at all (c's read kept the disk busy), e's at d's fetch
    (idle 100, its wait 50: hides 50): 110 of the 200 waited in all."""
    from tiermem.trace import summarize

    r = {"bytes": 1_000_000, "ok": True}
    s = summarize(_trace_of([
        ("compute", "forward a", 0, 100, {"unit": 0}),
        ("read /nvme", "b", 0, 40, r),
        ("compute", "forward b", 100, 200, {"unit": 1}),
        ("read /nvme", "c", 100, 260, r),
        ("wait", "wait c", 200, 260, {"unit": 2, "partition": "c"}),
        ("compute", "forward c", 260, 360, {"unit": 2}),
        ("read /nvme", "d", 200, 400, r),
        ("wait", "wait d", 360, 400, {"unit": 3, "partition": "d"}),
        ("compute", "forward d", 400, 500, {"unit": 3}),
        ("wait", "wait e", 500, 550, {"unit": 4, "partition": "e"}),
        ("read /nvme", "e", 500, 550, r),
        ("compute", "forward e", 550, 600, {"unit": 4}),
        ("wait", "wait state a", 600, 630, {"unit": 0, "kind": "state"}),
        ("wait", "wait f", 630, 650, {"unit": 5, "partition": "f", "gather": True}),
        ("compute", "forward f", 650, 700, {"unit": 5}),
    ]))
    reasons = {w["reason"]: (w["seconds"], w["waits"]) for w in s["wait_reasons"]}
    assert reasons == {"in_flight": (pytest.approx(100e-6), 2), "not_issued": (pytest.approx(50e-6), 1),
                       "state": (pytest.approx(30e-6), 1), "gather": (pytest.approx(20e-6), 1)}
    assert [w["reason"] for w in s["wait_reasons"]] == ["in_flight", "not_issued", "state", "gather"]
    assert s["deeper_window"] == {"depth": 1, "to": 2, "hidden_seconds": pytest.approx(110e-6),
                                  "wait_seconds": pytest.approx(200e-6)}
    assert s["advice"][0].startswith("prefetch.depth 1 -> 2 would have hidden 0.00011 s of 0.0002 s stall")


def test_bandwidth_per_direction_and_directory_is_set_against_the_cached_bench_figure(tmp_path) -> None:
    """Each directory's reads are measured while in flight and set beside what `tiermem bench io` cached for its
    filesystem (two directories on one filesystem share it); with nothing cached, each says which bench io to
    run; the direction's figure covers both directories (in flight on either)."""
    from tiermem.io.bandwidth import save_bench_results
    from tiermem.trace import summarize

    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.mkdir()
    cache = str(tmp_path / "cache" / "bench-io.json")
    save_bench_results([str(fast)], [{"mode": "read", "gbps_mean": 4.0, "engine": "io_uring", "block_size": 1 << 20,
                                      "queue_depth": 32, "direct": True}], cache)
    trace = _trace_of([("read " + str(fast), "a", 0, 1000, {"bytes": 2_000_000}),
                       ("read " + str(slow), "a", 0, 2000, {"bytes": 2_000_000})])
    trace["otherData"]["io_tracks"] = {f"read {fast}": {"op": "read", "path": str(fast)},
                                       f"read {slow}": {"op": "read", "path": str(slow)}}
    os_slow = str(slow)
    s = summarize(trace, bench_cache=cache)
    rows = {r["paths"][0]: r for r in s["bandwidth"]["by_path"]}
    assert rows[str(fast)]["gbps"] == pytest.approx(2.0) and rows[str(fast)]["bench_gbps"] == 4.0
    assert rows[str(fast)]["of_bench"] == pytest.approx(0.5) and "bench_note" not in rows[str(fast)]
    assert rows[os_slow]["gbps"] == pytest.approx(1.0) and rows[os_slow]["of_bench"] == pytest.approx(0.25)
    assert s["read_bytes"] == 4_000_000 and s["read_gbps"] == pytest.approx(2.0)
    assert s["bandwidth"]["read"]["bench_gbps"] == 4.0
    s = summarize(trace, bench_cache=str(tmp_path / "none.json"))
    rows = {r["paths"][0]: r for r in s["bandwidth"]["by_path"]}
    assert rows[os_slow]["bench_gbps"] is None
    assert rows[os_slow]["bench_note"] == f"run tiermem bench io --path {os_slow}"
    assert s["bandwidth"]["read"]["bench_note"] == f"run tiermem bench io --path {fast} --path {os_slow}"
    assert s["bandwidth"]["read"]["paths"] == [str(fast), os_slow]


def test_each_pass_is_given_with_its_transfers_and_the_time_they_take_at_the_bench_figures(tmp_path) -> None:
    """Three passes (microseconds): the first 0-1000 reads 2 MB in 500 and writes 1 MB in 100; the second
    1000-1500 reads 4 MB in 400; the third 1500-2100 reads two of 2 MB in flight together over 400. At a
    cached 4 GB/s read and 2 GB/s write, the floors are 1000, 1000 and 1000: the first at 1.0x its floor, the
    others 0.5x and 0.6x, of which the report gives the first apart and the median of the rest. A read that
    began before the first pass counts in none, one begun between two passes in the later; with no bench
    figure there is no floor; a trace without passes has none to give."""
    from tiermem.io.bandwidth import save_bench_results
    from tiermem.trace import summarize

    d = tmp_path / "d"
    d.mkdir()
    cache = str(tmp_path / "bench-io.json")
    save_bench_results([str(d)], [{"mode": m, "gbps_mean": g, "engine": "io_uring", "block_size": 1 << 20,
                                   "queue_depth": 32, "direct": True} for m, g in (("read", 4.0), ("write", 2.0))],
                       cache)
    rd, wr = f"read {d}", f"write {d}"
    spans = [("pass", "pass 1", 0, 1000, {"backward": False}), ("pass", "pass 2", 1000, 1500, {"backward": True}),
             ("pass", "pass 3", 1500, 2100, {"backward": False}),
             (rd, "early", -50, 10, {"bytes": 7}), (rd, "a", 0, 500, {"bytes": 2_000_000}),
             (wr, "w", 600, 700, {"bytes": 1_000_000}), (rd, "b", 1000, 1400, {"bytes": 4_000_000}),
             (rd, "c", 1500, 1700, {"bytes": 2_000_000}), (rd, "e", 1600, 1900, {"bytes": 2_000_000})]
    trace = _trace_of(spans)
    trace["otherData"]["io_tracks"] = {rd: {"op": "read", "path": str(d)}, wr: {"op": "write", "path": str(d)}}
    p = summarize(trace, bench_cache=cache)["passes"]
    assert p["count"] == 3 and [r["backward"] for r in p["each"]] == [False, True, False]
    first = p["first"]
    assert first["seconds"] == pytest.approx(1e-3) and first["io_busy_share"] == pytest.approx(0.6)
    assert first["read_bytes"] == 2_000_000 and first["read_gbps"] == pytest.approx(4.0)
    assert first["write_bytes"] == 1_000_000 and first["write_gbps"] == pytest.approx(10.0)
    assert first["floor_seconds"] == pytest.approx(1e-3) and first["of_floor"] == pytest.approx(1.0)
    assert [r["of_floor"] for r in p["each"][1:]] == [pytest.approx(0.5), pytest.approx(0.6)]
    rest = p["rest"]
    assert rest["count"] == 2 and rest["seconds"] == pytest.approx(5.5e-4)
    assert (rest["seconds_min"], rest["seconds_max"]) == (pytest.approx(5e-4), pytest.approx(6e-4))
    assert rest["io_busy_share"] == pytest.approx((0.8 + 400 / 600) / 2)
    assert rest["read_bytes"] == 4_000_000 and rest["read_gbps"] == pytest.approx(10.0)
    assert rest["write_bytes"] == 0 and rest["write_gbps"] is None
    assert rest["floor_seconds"] == pytest.approx(1e-3) and rest["of_floor"] == pytest.approx(0.55)
    unbenched = summarize(trace, bench_cache=str(tmp_path / "none.json"))["passes"]
    assert unbenched["first"]["floor_seconds"] is None and unbenched["rest"]["of_floor"] is None
    assert summarize(_trace_of([s for s in spans if s[0] != "pass"]), bench_cache=cache)["passes"] is None
    later = _trace_of([*spans, (rd, "between", 2200, 2300, {"bytes": 5}),
                       ("pass", "pass 4", 2400, 2900, {"backward": False})])
    later["otherData"]["io_tracks"] = trace["otherData"]["io_tracks"]
    each = summarize(later, bench_cache=cache)["passes"]["each"]  # begun between passes 3 and 4: in pass 4
    assert [r["read_bytes"] for r in each] == [2_000_000, 4_000_000, 4_000_000, 5]


def test_a_traced_generate_has_a_pass_per_forward_holding_every_read(tmp_path, capsys) -> None:
    """generate() of 5 tokens with the KV cache on NVMe, traced after a first generate recorded the order: a
    pass per forward (the prefill and 4 decoding steps, none with a backward), every byte tm.stats() counts as
    read issued in one of them, each decoding step reading the model's streamed units again; `tiermem report`
    prints the first pass and the median of the rest."""
    from tiermem.cli import main
    from tiermem.trace import summarize

    pytest.importorskip("transformers")
    model = models.gpt2().eval()
    ids = torch.randint(1, 500, (2, 6), generator=torch.Generator().manual_seed(0))
    gen = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False,
           "pad_token_id": 0}
    cfg = _cfg(tmp_path, **{"kv.tier": "nvme", "kv.block_tokens": 4, "io.block_size": "256KiB",
                            "memory.host_budget": "640KiB"})
    del cfg["optimizer.tier"], cfg["grads.tier"]
    with tiered_offload(model, **cfg) as tm:
        model.generate(ids, **gen)
        tm.swapper.forget_parked()  # a read-ahead of the first generate that a write-back would start later,
        tm.swapper.flush()  # before the traced one's first pass: counted in stats, in no pass
        tm.reset_stats()
        with tm.trace(tmp_path / "g.json"):
            model.generate(ids, **gen)
        read = tm.stats()["bytes_read"]
    p = summarize(json.loads((tmp_path / "g.json").read_text()))["passes"]
    assert p["count"] == 5 and not any(r["backward"] for r in p["each"])
    assert sum(r["read_bytes"] for r in p["each"]) == read > 0
    streamed = sum(u.partition.size for u in tm.runtime.units if u.partition.home.name == "NVME"
                   and u.index not in tm.runtime.schedule.resident)
    assert streamed > 0 and all(r["read_bytes"] >= streamed for r in p["each"][1:])
    assert main(["report", str(tmp_path / "g.json")]) == 0
    out = capsys.readouterr().out
    assert "passes: 5; the first " in out and "the other 4, median: " in out


def test_tiermem_report_reads_a_real_trace_and_refuses_what_is_not_one(tmp_path, capsys) -> None:
    """`tiermem report` on a training trace prints its figures (and --json the same as summarize); a file that
    is not a trace is an error naming it."""
    from tiermem.cli import main
    from tiermem.trace import summarize

    model = _model()
    with tiered_offload(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **_cfg(tmp_path)) as tm:
        with tm.trace(tmp_path / "t.json"):
            _train(model, tm, 2)
    assert main(["report", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "computing (forward and backward)" in out and "advice:" in out and "why compute waited:" in out
    assert "GB/s while in flight" in out
    assert main(["report", "--json", str(tmp_path / "t.json")]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(summarize(
        json.loads((tmp_path / "t.json").read_text()))))
    (tmp_path / "no.json").write_text('{"a": 1}')
    assert main(["report", str(tmp_path / "no.json")]) == 2
    assert "no.json: cannot read it as a tiermem trace" in capsys.readouterr().err
    # --plot draws the same trace into a PNG of the figure's size; an unwritable path is an error naming it
    assert main(["report", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png")]) == 0
    assert f"drawn into {tmp_path / 't.png'}" in capsys.readouterr().out
    png = (tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1200, 650)
    assert main(["report", str(tmp_path / "t.json"), "--plot", str(tmp_path / "none" / "t.png")]) == 2
    assert f"--plot {tmp_path / 'none' / 't.png'}: cannot write it" in capsys.readouterr().err


def _broken(event: object) -> str:
    """A synthetic trace's JSON with its compute span replaced by `event` (NaN written as JSON's NaN)."""
    trace = _synthetic()
    trace["traceEvents"][0] = event
    return json.dumps(trace)


_SPAN = {"name": "forward a", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 100, "args": {"unit": 0}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("text", "named"), [
    ('{"traceEvents": [1, 2, 3]}', "traceEvents[0]: expected an event object, got 1"),
    (_broken({k: v for k, v in _SPAN.items() if k != "tid"}), "traceEvents[0].tid: expected the thread id"),
    (_broken({k: v for k, v in _SPAN.items() if k != "dur"}), "traceEvents[0].dur: expected microseconds, a "
                                                              "finite number from 0 to 1e+15; it is missing"),
    (_broken({k: v for k, v in _SPAN.items() if k != "name"}), "traceEvents[0].name: expected the span's name"),
    (_broken({**_SPAN, "ts": "0"}), "traceEvents[0].ts: expected microseconds, a finite number from -1e+15 to "
                                    "1e+15; got '0'"),
    (_broken({**_SPAN, "dur": float("nan")}), "traceEvents[0].dur: expected microseconds, a finite number from 0 "
                                              "to 1e+15; got nan"),
    (_broken({**_SPAN, "dur": 1e308}), "traceEvents[0].dur: expected microseconds"),
    (_broken({**_SPAN, "args": {"bytes": "3MB"}}), "traceEvents[0].args.bytes: expected a byte count"),
    (_broken({**_SPAN, "args": {"partition": ["b"]}}), "traceEvents[0].args.partition: expected a name"),
    (_broken({"name": "thread_name", "ph": "M", "pid": 1, "tid": 1}), "traceEvents[0].args: expected "
                                                                      '{"name": TRACK}, naming the track'),
    (json.dumps({**_synthetic(), "otherData": {"config": {"nvme": {"paths": 5}}}}),
     "otherData.config.nvme.paths: expected a list of directories, got 5"),
    ('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested deeper than Python's reader follows"),
    ("[" * 100_000 + "]" * 100_000, "not a trace: it begins with b'[', not a JSON object"),
    ("/dev/zero", "not a trace: it begins with b'\\x00', not a JSON object"),
    ("", "not a trace: it is empty"),
], ids=["numbers", "no-tid", "no-dur", "no-name", "string-ts", "nan-dur", "huge-dur", "string-bytes",
        "list-partition", "track-without-args", "paths-a-number", "nested-100000", "nested-array", "dev-zero",
        "empty"])
def test_tiermem_report_on_a_malformed_trace_is_one_line_naming_what_is_wrong(tmp_path, capsys, text: str,
                                                                               named: str) -> None:
    """`tiermem report` on events that are numbers, that lack tid, dur or name, hold strings or NaN where
    numbers belong, on JSON nested 100,000 deep or on /dev/zero (read without bound before) exits 2 with one
    line naming the file and the event's field, never a traceback or a hang."""
    from tiermem.cli import main

    path = text if text.startswith("/dev/") else str(tmp_path / "bad.json")
    if path != text:
        Path(path).write_text(text)
    assert main(["report", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tiermem: error: {path}: cannot read it as a tiermem trace: "), err[:300]
    assert named in err and len(err.splitlines()) == 1, err[:300]


def test_a_trace_larger_than_the_bound_is_refused_before_it_is_read(tmp_path, capsys) -> None:
    """A trace file larger than MAX_TRACE_BYTES (a sparse file here) is refused from its size, naming the
    bound, exit 2."""
    from tiermem.cli import main
    from tiermem.trace import MAX_TRACE_BYTES

    path = tmp_path / "big.json"
    path.write_text('{"traceEvents": [')
    os.truncate(path, MAX_TRACE_BYTES + 1)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{MAX_TRACE_BYTES + 1} bytes, more than the 1 GiB a report reads" in err and len(err.splitlines()) == 1


def test_the_plot_draws_every_span_and_the_waits_per_unit(tmp_path, monkeypatch) -> None:
    """plot() on known spans: one timeline row per track that has spans, a bar per span on it, and below one
    bar per unit waited for, its height the unit's waits in seconds (50 µs for b), as plot() returns them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tiermem.trace import plot

    drawn = []
    real_savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):  # look at what is drawn before the figure is closed
        drawn.append(fig)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    stalls = plot(_synthetic(), tmp_path / "s.png")
    assert stalls == {"b": pytest.approx(50e-6)}
    timeline, bars = drawn[0].axes
    rows = [t.get_text() for t in timeline.get_yticklabels()]
    assert rows == ["compute", "wait", "read /nvme"]
    spans = {row: len(c.get_paths()) for row, c in zip(rows, timeline.collections, strict=True)}
    events = _synthetic()["traceEvents"]
    tid = {e["args"]["name"]: e["tid"] for e in events if e.get("ph") == "M"}
    assert spans == {row: sum(1 for e in events if e.get("ph") == "X" and e["tid"] == tid[row]) for row in rows}
    assert [p.get_height() for p in bars.patches] == [pytest.approx(50e-6)]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["b"]
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
