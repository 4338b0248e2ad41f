"""The ``pacmpi`` command (sub-commands registered as entry points) and ``pacmpi bench
allreduce``."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from pacmpi import MPICollectives
from pacmpi.bench.allreduce import BENCH_METHODS, _bench_one, _count_wrong, run
from pacmpi.buckets import BucketLayout
from pacmpi.cli import GROUP, commands
from pacmpi.costmodel import PEER_DEFAULTS, PEERS, _peer_traffic, powersgd_values
from pacmpi.methods import ALLREDUCE_METHODS, METHODS
from pacmpi.units import parse_size

from mpi_util import SHARED_TIMEOUT, run_scenarios, shared_workdir

CORE_COMMANDS = {("info",): "pacmpi.info:main",
                 ("bench", "allreduce"): "pacmpi.bench.allreduce:main",
                 ("train",): "pacmpi.experiments.train:main",
                 ("bench", "train"): "pacmpi.experiments.bench_train:main",
                 ("doctor",): "pacmpi.launch.doctor:main",
                 ("tune",): "pacmpi.launch.tune:main"}


def pacmpi_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pacmpi.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_packages_register_their_commands_as_entry_points():
    registered = {words: command.target for words, command in commands().items()}
    assert CORE_COMMANDS.items() <= registered.items()
    # Longest first, so that `bench train` wins over a command named `bench`.
    lengths = [len(words) for words in commands()]
    assert lengths == sorted(lengths, reverse=True)


def test_help_lists_commands_with_one_line_help_without_importing_torch():
    code = ("import sys; from pacmpi.cli import main; main(['--help']); "
            "sys.exit(3 if {'torch', 'horovod'} & set(sys.modules) else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for words in CORE_COMMANDS:
        line = next(line for line in lines if line.startswith(f"  {' '.join(words)}  "))
        summary = line[20:].strip()
        assert summary and "cannot read" not in summary and not summary.startswith("``"), line
    assert "  info              versions, the MPI library and its CUDA-awareness" in done.stdout


def test_stale_egg_info_in_the_working_directory_hides_no_command(tmp_path):
    # `python -m build` leaves pacmpi.egg-info in the checkout; from there it comes first on
    # sys.path. Commands must still come from every registration, not only from it.
    stale = tmp_path / "pacmpi.egg-info"
    stale.mkdir()
    (stale / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: pacmpi\nVersion: 0.0.1\n")
    (stale / "entry_points.txt").write_text("[console_scripts]\npacmpi = pacmpi.cli:main\n")
    done = subprocess.run([sys.executable, "-m", "pacmpi.cli", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    for words in CORE_COMMANDS:
        assert f"  {' '.join(words)}  " in done.stdout, done.stdout


def test_cli_rejects_unknown_commands():
    for argv, name in ((["frobnicate"], "frobnicate"), (["bench", "frob"], "bench frob")):
        bad = pacmpi_cli(*argv)
        assert bad.returncode == 2 and f"unknown command {name!r}" in bad.stderr
        assert "bench allreduce" in bad.stderr  # the usage follows


@pytest.fixture
def plugin(tmp_path):
    """A separately installed package registering `pacmpi hello` and `pacmpi broken`."""
    (tmp_path / "hello_cmd.py").write_text(
        '"""``pacmpi hello``: greet. Second sentence is not shown."""\n'
        "def main(argv):\n"
        "    if argv == ['--fail']:\n"
        "        raise RuntimeError('hello failed on purpose')\n"
        "    print('hello', *argv)\n"
        "    return 0\n")
    info = tmp_path / "hello_cmd-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-cmd\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{GROUP}]\nhello = hello_cmd:main\nbroken = no_such_module_xyz:main\n")
    return dict(os.environ, PYTHONPATH=str(tmp_path))


def test_another_package_adds_a_command(plugin):
    done = pacmpi_cli("hello", "a", "b", env=plugin)
    assert (done.returncode, done.stdout) == (0, "hello a b\n")
    listing = pacmpi_cli("--help", env=plugin).stdout
    assert "  hello             greet\n" in listing
    assert "  broken            (cannot read no_such_module_xyz: " in listing


def test_commands_run_through_run_main(plugin):
    # An exception, or a target that cannot be imported, is reported with the rank prefix
    # and becomes exit status 1 (under MPI with several ranks: MPI_Abort for all).
    for argv, message in ((["hello", "--fail"], "RuntimeError: hello failed on purpose"),
                          (["broken"], "No module named 'no_such_module_xyz'")):
        done = pacmpi_cli(*argv, env=plugin)
        assert done.returncode == 1, done.stderr
        assert "[pacmpi rank 0/1 on " in done.stderr and message in done.stderr


def test_cli_info_reports_mpi_and_wire_bits():
    result = pacmpi_cli("info")
    assert result.returncode == 0, result.stderr
    assert "Open MPI" in result.stdout and "bits/value" in result.stdout


def test_parse_size():
    assert parse_size("64M") == 64 << 20 and parse_size("1KiB") == 1024
    with pytest.raises(ValueError, match="bad size 'lots'"):
        parse_size("lots")


def test_validator_counts_wrong_elements_negative_control():
    mask = np.array([True, True, False, True])
    reference = np.array([3.0, -2.0, 0.0, 1.0])
    assert _count_wrong("pactrain", reference.copy(), reference, mask, 1.0, 2) == 0
    corrupted = reference.copy()
    corrupted[1] += 1
    assert _count_wrong("pactrain", corrupted, reference, mask, 1.0, 2) == 1
    assert _count_wrong("topk", corrupted, reference, mask, 1.0, 2) == 1
    lattice = np.array([0.5, -1.0, 0.0, 1.0])
    assert _count_wrong("pactrain-ternary", lattice, reference, mask, 0.5, 2) == 0
    off = np.array([0.7, -3.0, 0.5, 1.0])  # off-lattice, out of range, pruned non-zero
    assert _count_wrong("pactrain-ternary", off, reference, mask, 0.5, 2) == 3
    for peer in PEERS:
        assert _count_wrong(peer, corrupted, reference, mask, 1.0, 2) == 1
    # PowerSGD's approximations: within their tolerance, not beyond it, and a NaN never.
    tolerance = np.array([0.0, 0.0, 1e-3, 1e-3])
    close = reference + np.array([0.0, 0.0, 1e-4, -1e-4])
    assert _count_wrong("powersgd", close, reference, mask, 1.0, 2, tolerance) == 0
    far = reference + np.array([0.0, 1e-4, 1e-2, np.nan])
    assert _count_wrong("powersgd", far, reference, mask, 1.0, 2, tolerance) == 3


class CorruptingCollectives(MPICollectives):
    """Adds 1 to the first value of every float32 or uint8 payload once it has arrived: what
    the peers send (values, codes, scales, factors), not the benchmark's own float64 and int64
    bookkeeping (barriers, references, counts)."""

    def allreduce(self, buf, op="sum", name=None):
        super().allreduce(buf, op, name)
        self._corrupt(buf)

    def allgather(self, buf, counts, name=None):
        super().allgather(buf, counts, name)
        self._corrupt(buf)

    @staticmethod
    def _corrupt(buf):
        if buf.dtype in (np.float32, np.uint8) and buf.size:
            buf[0] += 1


# A conv kernel and a matrix PowerSGD compresses, a matrix it would not shrink, vectors.
PEER_SHAPES = [(16, 8, 3, 3), (12,), (8, 8), (40, 300)]


@pytest.mark.parametrize("method", PEERS)
def test_peer_validation_counts_a_corrupted_payload(method):
    layout = BucketLayout(PEER_SHAPES, [np.float32] * len(PEER_SHAPES), 16 << 10)
    mask = np.ones(sum(math.prod(s) for s in PEER_SHAPES), dtype=bool)
    rows = {kind: _bench_one(kind(comm=MPI.COMM_SELF), method, layout, mask, 1.0, 2, 1, 0, np)
            for kind in (MPICollectives, CorruptingCollectives)}
    assert rows[MPICollectives]["wrong"] == 0
    assert rows[CorruptingCollectives]["wrong"] > 0
    assert rows[MPICollectives]["wire_bytes_per_rank"] == _peer_traffic(
        method, PEER_SHAPES, len(layout.buckets), **PEER_DEFAULTS)[2]


@pytest.mark.parametrize("knob, value, message", [
    ("topk_ratio", 0, "topk_ratio must be in \\(0, 1\\], got 0"),
    ("dgc_ratio", 0, "dgc_ratio must be in \\(0, 1\\], got 0"),
    ("dgc_ratio", 1.5, "dgc_ratio must be in \\(0, 1\\], got 1.5"),
    ("powersgd_rank", 0, "powersgd_rank must be an integer >= 1, got 0")])
def test_bench_allreduce_rejects_bad_knobs_naming_them(knob, value, message):
    with pytest.raises(ValueError, match=message):
        run([1024], [1.0], ["dense"], **{knob: value})


def test_bench_allreduce_powersgd_needs_a_model():
    with pytest.raises(ValueError, match="powersgd compresses matrices: give a model"):
        run([1024], [1.0], ["dense", "powersgd"])


def test_bench_allreduce_command_checks_its_knobs():
    done = pacmpi_cli("bench", "allreduce", "--sizes", "4K", "--methods", "dgc",
                      "--dgc-ratio", "1.5")
    assert done.returncode == 1 and "dgc_ratio must be in (0, 1], got 1.5" in done.stderr


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks", [2, 4])
def test_bench_allreduce_validates_every_method(ranks):
    run_scenarios("bench_allreduce_scenarios.py", ranks).check(
        "test_small_sizes_and_a_models_tensors")
    reports = Path(shared_workdir())
    report = json.loads((reports / f"bench_allreduce_sizes_{ranks}.json").read_text())
    rows = report["rows"]
    assert set(BENCH_METHODS) == set(METHODS) == set(ALLREDUCE_METHODS) | set(PEERS)
    assert {r["method"] for r in rows} == set(BENCH_METHODS) - {"powersgd"}
    # The peers' sums are checked against every rank's own selection (TopK, DGC) or codes
    # (TernGrad) added up: #wrong counts the all-gathered exchange too.
    assert all(r["wrong"] == 0 for r in rows)
    knobs = {name: report[name] for name in PEER_DEFAULTS}
    for r in (r for r in rows if r["method"] == "topk"):
        k = math.ceil(0.01 * r["count"])
        assert (r["density"], r["kept"], r["wire_bytes_per_rank"]) == (0.01, k, 12 * k)
    for r in (r for r in rows if r["method"] in PEERS):  # a --sizes buffer is one tensor
        assert r["wire_bytes_per_rank"] == _peer_traffic(r["method"], [(r["count"],)],
                                                         r["buckets"], **knobs)[2]
    # On a model's kinds of tensor, in four buckets, PowerSGD included.
    shaped = json.loads((reports / f"bench_allreduce_tensors_{ranks}.json").read_text())
    shapes = [tuple(s) for s in shaped["shapes"]]
    assert shaped["buckets"] == 4
    assert [r["method"] for r in shaped["rows"]] == ["topk", "dgc", "terngrad", "powersgd"]
    for r in shaped["rows"]:
        assert r["wrong"] == 0, r
        assert r["wire_bytes_per_rank"] == _peer_traffic(r["method"], shapes, shaped["buckets"],
                                                         **shaped["knobs"])[2], r
        assert r["wire_bytes_per_rank"] < r["size_bytes"] / 3
    powersgd = shaped["rows"][-1]
    assert powersgd["kept"] == powersgd_values(shapes, 4) < powersgd["count"]
    sparse = {r["method"]: r for r in rows if r["density"] == 0.2 and r["count"] == 1 << 18}
    dense = next(r for r in rows if r["method"] == "dense" and r["count"] == 1 << 18)
    assert sparse["pactrain"]["wire_bytes_per_rank"] < 0.25 * dense["wire_bytes_per_rank"]
    assert (sparse["pactrain-ternary"]["wire_bytes_per_rank"]
            < sparse["pactrain"]["wire_bytes_per_rank"] / 8)
    for r in rows:
        expected = r["algbw_GBps"] * 2 * (ranks - 1) / ranks
        assert r["busbw_GBps"] == pytest.approx(expected)
