"""PacTrainReducer(hierarchical=True): two-level reduction over real MPI ranks, node
communicators split as rank // ranks-per-node (2 x 1, 2 x 2, uneven 2 + 1) or found by the
reducer itself, also on the node test bed; each run bounded by a timeout."""
import math
import os
import sys

import pytest

from mpi_util import (MPI_SCRIPTS, assert_scenarios_passed, netns_skip_reason, run_bounded,
                      run_mpi)
from pacmpi import PacTrainReducer
from pacmpi.hierarchy import hierarchical_wire_bits

ALL = ("exact", "ternary", "state", "mismatch", "resync", "bad_node_comm")
RUNS = [
    (4, "2", ALL),
    (3, "2", ("exact", "ternary", "mismatch")),
    (2, "1", ("exact", "ternary", "mismatch", "bad_node_comm")),
    (2, "default", ("nodes", "exact", "ternary", "state", "mismatch", "resync")),
]


_NO_TESTBED = netns_skip_reason()


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, per_node, scenarios", RUNS,
                         ids=[f"{n}ranks-{p}pernode" for n, p, _ in RUNS])
def test_hierarchical_scenarios(ranks, per_node, scenarios):
    result = run_mpi("hierarchical_scenarios.py", ranks, per_node, *scenarios, timeout=180)
    assert_scenarios_passed(result, ranks, scenarios)


@pytest.mark.mpi
@pytest.mark.skipif(_NO_TESTBED is not None, reason=f"no node test bed: {_NO_TESTBED}")
def test_two_nodes_of_two_ranks_on_the_node_test_bed():
    """Nodes found by default (host name and network namespace of each simulated node), then
    the issue's checks across real shaped links: exact sums, unbiased ternary, mismatch."""
    from pacmpi.launch import detect_mpi
    from pacmpi.launch.nodes import NodeTestbed

    scenarios = ("nodes", "exact", "ternary", "mismatch")
    script = str(MPI_SCRIPTS / "hierarchical_scenarios.py")
    with NodeTestbed(2, "1gbit") as bed:
        argv = bed.mpirun_command(detect_mpi(), 4, [sys.executable, script, "default",
                                                    *scenarios], tag_output=False)
        result = run_bounded(argv, timeout=150, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                             what="hierarchical_scenarios.py on 2 nodes x 2 ranks")
    assert_scenarios_passed(result, 4, scenarios)


def test_ternary_digits_grow_with_nodes_not_ranks():
    big = hierarchical_wire_bits(8, 128)  # 8 GPUs per node, 128 nodes
    assert big["flat"]["ranks"] == 1024 and big["hierarchical"]["ranks"] == 128
    assert big["flat"]["log2_2n_plus_1"] == math.log2(2049)
    assert big["hierarchical"]["log2_2n_plus_1"] == math.log2(257)
    assert (big["hierarchical"]["bits_per_value"], big["flat"]["bits_per_value"]) == (64 / 7, 12.8)
    small = hierarchical_wire_bits(2, 2)
    assert (small["hierarchical"]["bits_per_value"], small["flat"]["bits_per_value"]) == (
        64 / 27, 3.2)
    one = hierarchical_wire_bits(1, 4)  # one rank per node: nothing to gain
    assert one["flat"]["bits_per_value"] == one["hierarchical"]["bits_per_value"]


def test_hierarchical_options_are_checked_before_any_communication():
    with pytest.raises(ValueError, match="pass hierarchical=True or collectives=, not both"):
        PacTrainReducer([None], collectives=object(), hierarchical=True)
    with pytest.raises(ValueError, match="node_comm= needs hierarchical=True"):
        PacTrainReducer([None], node_comm=object())
