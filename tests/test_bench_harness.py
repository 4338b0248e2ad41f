"""The shared benchmark harness: timing statistics, spreads, tables and reports, against
hand-computed values."""
import datetime
import json
import shlex
import subprocess
import sys
import time

import numpy as np
import pytest

from pacmpi.bench.harness import (
    Column,
    environment,
    format_spread,
    format_table,
    overlap,
    spread,
    time_op,
    write_report,
)


class FakeClock:
    """``time.perf_counter`` that only moves when the test says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def test_time_op_times_only_the_calls_after_warmup(clock):
    durations = iter([50.0, 10.0, 2.0, 4.0, 3.0, 6.0])
    calls = []

    def fn():
        calls.append(len(calls))
        clock.advance(next(durations))
        return calls[-1]

    timing = time_op(fn, 4, warmup=2)
    assert timing.seconds == (2.0, 4.0, 3.0, 6.0)  # the 50 s and 10 s warm-ups are left out
    assert timing.results == (2, 3, 4, 5)
    assert (timing.mean, timing.median, timing.min, timing.max) == (3.75, 3.5, 2.0, 6.0)


def test_setup_is_untimed_and_sync_is_timed(clock):
    order = []

    def step(name, seconds):
        order.append(name)
        clock.advance(seconds)

    timing = time_op(lambda: step("call", 1.0), 2, warmup=1, setup=lambda: step("setup", 100.0),
                     sync=lambda: step("sync", 0.5))
    assert timing.seconds == (1.5, 1.5)
    assert order == ["setup", "call", "sync"] * 3
    # Negative control: the same calls with the 100 s inside the timed call count it.
    timed = time_op(lambda: clock.advance(101.0), 1, sync=lambda: clock.advance(0.5))
    assert timed.seconds == (101.5,)


class TwoRanks:
    """A transport whose other rank took ``other`` seconds per timed call; records every call."""

    def __init__(self, other):
        self.other = np.asarray(other, dtype=float)
        self.calls = []

    def allreduce(self, buf, op):
        self.calls.append((op, buf.size))
        if buf.size == len(self.other):
            np.maximum(buf, self.other, out=buf)


def test_time_op_reports_the_slowest_rank_per_call(clock):
    durations = iter([9.0, 1.0, 5.0, 2.0])  # the first is a warm-up
    transport = TwoRanks(other=[3.0, 3.0, 3.0])
    timing = time_op(lambda: clock.advance(next(durations)), 3, warmup=1,
                     collectives=transport)
    assert timing.seconds == (3.0, 5.0, 3.0)  # elementwise max of (1, 5, 2) and (3, 3, 3)
    assert timing.mean == pytest.approx(11 / 3)
    # A one-value barrier before each of the 4 calls, then the times exchanged once.
    assert transport.calls == [("max", 1)] * 4 + [("max", 3)]


@pytest.mark.parametrize("iters, warmup", [(0, 0), (-1, 2), (3, -1)])
def test_time_op_refuses_counts_naming_them(iters, warmup):
    with pytest.raises(ValueError, match=f"iters={iters}, warmup={warmup}"):
        time_op(lambda: None, iters, warmup=warmup)


def test_spread_leaves_none_out_of_the_statistics():
    assert spread([4.0, None, 1.0, 3.0, 2.0]) == {
        "values": [4.0, None, 1.0, 3.0, 2.0], "n": 4, "median": 2.5, "min": 1.0, "max": 4.0}
    assert spread([7]) == {"values": [7], "n": 1, "median": 7, "min": 7, "max": 7}
    assert spread([None, None]) == {"values": [None, None], "n": 0, "median": None,
                                    "min": None, "max": None}
    assert spread([]) == {"values": [], "n": 0, "median": None, "min": None, "max": None}


def test_overlap_is_a_tie_of_ranges():
    assert overlap(spread([1, 2]), spread([2, 3]))  # touching ends tie
    assert overlap(spread([1, 5]), spread([2, 3])) and overlap(spread([2, 3]), spread([1, 5]))
    assert not overlap(spread([1, 2]), spread([2.5, 3]))  # negative control: apart
    assert not overlap(spread([None]), spread([1]))


def test_format_spread():
    assert format_spread(spread([3.0, 1.0, 2.0]), ".2f") == "2.00 [1.00, 3.00]"
    assert (format_spread(spread([30.0, None, 10.0]), ".1f", "never")
            == "20.0 [10.0, 30.0] (1 never)")
    assert format_spread(spread([None]), ".1f", "never") == "never"
    assert format_spread(spread([None]), ".1f") == "-"


def test_format_table_lays_out_columns():
    rows = [{"name": "a", "t": 1.25, "n": 3, "ok": True},
            {"name": "longer", "t": None, "n": 12345, "ok": False}]
    columns = [Column("name", "name", "<"), ("t(ms)", lambda r: r["t"] and r["t"] * 1e3, ">8.1f"),
               ("n", "n", ">3"), ("ok", "ok")]
    assert format_table(rows, columns).splitlines() == [
        "name" + " " * 6 + "t(ms)" + " " * 5 + "n" + " " * 4 + "ok",
        "a" + " " * 8 + "1250.0" + " " * 5 + "3" + " " * 2 + "True",
        "longer" + " " * 8 + "- 12345 False"]


def test_format_table_widths_grow_to_fit_and_match_fixed_format_specs():
    rows = [{"x": 1.5, "label": "ab"}, {"x": 123456.789, "label": "abcdefgh"}]
    text = format_table(rows, [("label", "label", "<6"), ("x", "x", ">7.2f")],
                        sep=" | ", indent="  ")
    assert text.splitlines() == ["  label    |         x",
                                 "  ab       |      1.50",
                                 "  abcdefgh | 123456.79"]
    # Within the widths, a column reads as the f-string it replaces.
    row = {"v": 3.14159}
    assert format_table([row], [("v", "v", ">9.3f")]).splitlines()[1] == f"{row['v']:>9.3f}"


def test_format_table_prints_values_as_text_not_numbers():
    # Negative control for the reason: a format spec with a width formats a bool as an int.
    assert format(True, ">5") == "    1"
    lines = format_table([{"ok": True, "ranks": [0, 1]}], [("ok", "ok", ">5"),
                                                          ("ranks", "ranks", ">7")]).splitlines()
    assert lines == ["   ok   ranks", " True  [0, 1]"]


def test_format_table_without_rows_is_its_title_line_without_trailing_spaces():
    assert format_table([], [("a", "a", "<9"), ("b", "b", "<9")]) == "a         b"


def test_environment_records_the_run():
    env = environment("pacmpi bench example")
    assert env["benchmark"] == "pacmpi bench example"
    created = datetime.datetime.fromisoformat(env["created"])
    assert created.tzinfo is not None
    assert abs((datetime.datetime.now(datetime.timezone.utc) - created).total_seconds()) < 60
    assert {"name", "platform", "cpus", "python"} <= set(env["host"])
    assert env["versions"]["numpy"] == np.__version__
    assert env["versions"]["pacmpi"] == __import__("pacmpi").__version__
    assert env["command"] == shlex.join(sys.argv)


def test_write_report_adds_the_environment_and_keeps_the_data(tmp_path):
    data = {"rows": [{"method": "dense-fp32", "wrong": 0}], "ranks": 2}
    written = write_report(tmp_path / "r.json", data, "pacmpi bench example")
    read = json.loads((tmp_path / "r.json").read_text())
    assert read == written
    assert read["rows"] == data["rows"] and read["ranks"] == 2
    assert read["benchmark"] == "pacmpi bench example" and "created" in read
    # A report re-written later keeps when and where its runs were made.
    again = write_report(tmp_path / "again.json", dict(read, created="x", host={"cpus": 99}),
                         "pacmpi bench other")
    assert (again["created"], again["host"], again["benchmark"]) == (
        "x", {"cpus": 99}, "pacmpi bench example")
    write_report(tmp_path / "c.json", data, "b", compact=True)
    compact = (tmp_path / "c.json").read_text()
    # Compact: exactly the separators-only dump (the metadata's own strings may hold ", ").
    report = json.loads(compact)
    assert compact == json.dumps(report, separators=(",", ":")) and report["ranks"] == 2
    assert compact != json.dumps(report)  # negative control: the default dump has spaces


def test_harness_imports_no_framework():
    # The core benchmarks, launch and the experiments all import it: NumPy only.
    code = ("import sys, pacmpi.bench.harness; "
            "print(sorted({'torch', 'numba', 'cupy', 'mpi4py.MPI'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr
