"""``python -m pacmpi.launch.bench_spread``: the test bed's run-to-run spread. The summary
against hand-computed numbers, and two tiny real runs on a 2-node bed (skipped, with the
reason, where network namespaces are unavailable); the long measurement is for a quiet machine."""
import pytest

from pacmpi.launch.bench_spread import format_table, measure, model_seconds, summarize

from mpi_util import netns_skip_reason

_SKIP = netns_skip_reason()


def test_model_and_spread_by_hand():
    # 1 MB on 4 nodes at 100 Mbit/s: each star link carries 1.5 MB, 0.12 s; shared 4x.
    assert model_seconds(4, "star", 1_000_000, 1e8) == pytest.approx(0.12)
    assert model_seconds(4, "shared", 1_000_000, 1e8) == pytest.approx(0.48)
    got = summarize([0.10, 0.12, 0.15], 0.12, [0.97, 0.99])
    assert got["times_s"]["median"] == 0.12 and got["spread"] == pytest.approx(0.05 / 0.12)
    assert got["of_model"]["min"] == pytest.approx(0.8) and got["of_model"]["max"] == 1.2
    assert (got["calibration"]["min"], got["calibration"]["max"]) == (0.97, 0.99)
    # Negative control: runs that repeat themselves have no spread.
    assert summarize([0.12] * 5, 0.12)["spread"] == 0


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_two_tiny_runs_on_a_two_node_star():
    points = measure([2], ["1gbit"], ["star"], runs=2, seconds=0.02, iters=2, calibrate=False)
    (point,) = points
    assert (point["nodes"], point["runs"], point["times_s"]["n"]) == (2, 2, 2)
    assert point["nbytes"] == 2_500_000  # 0.02 s x 125 MB/s over 2(K-1)/K = 1
    assert 0 < point["of_model"]["median"] < 1.5  # not faster than the link allows
    assert format_table(points).splitlines()[2].startswith("| star | 1.0 Gbit/s | 2 | 2500000 |")
