import json
import subprocess
import sys

import numpy as np
import pytest

from pacmpi.bench.allreduce import METHODS, _count_wrong, parse_size
from mpi_util import run_mpi


def pacmpi_cli(*args):
    return subprocess.run([sys.executable, "-m", "pacmpi.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_lists_commands_and_rejects_unknown_ones():
    assert "bench allreduce" in pacmpi_cli("--help").stdout
    bad = pacmpi_cli("frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr


def test_cli_info_reports_mpi_and_wire_bits():
    result = pacmpi_cli("info")
    assert result.returncode == 0, result.stderr
    assert "Open MPI" in result.stdout and "bits/value" in result.stdout


def test_parse_size():
    assert parse_size("64M") == 64 << 20 and parse_size("1KiB") == 1024
    with pytest.raises(ValueError, match="bad size 'LOTS'"):
        parse_size("lots")


def test_validator_counts_wrong_elements_negative_control():
    mask = np.array([True, True, False, True])
    reference = np.array([3.0, -2.0, 0.0, 1.0])
    assert _count_wrong("pactrain", reference.copy(), reference, mask, 1.0, 2) == 0
    corrupted = reference.copy()
    corrupted[1] += 1
    assert _count_wrong("pactrain", corrupted, reference, mask, 1.0, 2) == 1
    lattice = np.array([0.5, -1.0, 0.0, 1.0])
    assert _count_wrong("pactrain-ternary", lattice, reference, mask, 0.5, 2) == 0
    off = np.array([0.7, -3.0, 0.5, 1.0])  # off-lattice, out of range, pruned non-zero
    assert _count_wrong("pactrain-ternary", off, reference, mask, 0.5, 2) == 3


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_bench_allreduce_validates_every_method(ranks, tmp_path):
    out = tmp_path / "bench.json"
    result = run_mpi("bench_allreduce_small.py", ranks, out, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["method"] for r in rows} == set(METHODS)
    assert all(r["wrong"] == 0 for r in rows)
    assert "busbw" in result.stdout and "#wrong" in result.stdout
    sparse = {r["method"]: r for r in rows if r["density"] == 0.2 and r["count"] == 1 << 18}
    dense = next(r for r in rows if r["method"] == "dense-fp32" and r["count"] == 1 << 18)
    assert sparse["pactrain"]["wire_bytes_per_rank"] < 0.25 * dense["wire_bytes_per_rank"]
    assert (sparse["pactrain-ternary"]["wire_bytes_per_rank"]
            < sparse["pactrain"]["wire_bytes_per_rank"] / 8)
    for r in rows:
        expected = r["algbw_GBps"] * 2 * (ranks - 1) / ranks
        assert r["busbw_GBps"] == pytest.approx(expected)
