"""PacTrainReducer(hierarchical=True): two-level reduction over real MPI ranks, node
communicators split as rank // ranks-per-node (2 x 1, 2 x 2, uneven 2 + 1) or found by the
reducer itself, also on the node test bed; each run bounded by a timeout."""
import math

import pytest

from pacmpi import PacTrainReducer
from pacmpi.hierarchy import hierarchical_wire_bits

from mpi_util import (
    SHARED_TIMEOUT,
    netns_skip_reason,
    run_scenarios,
    scenario_cases,
    scenario_names,
    scenario_run,
    shared_launches,
)

MODULE = "hierarchical_scenarios.py"


def selected(names):
    """The module's tests named ``test_<name>`` for each of ``names``, in file order."""
    return tuple(test for test in scenario_names(MODULE) if test.removeprefix("test_") in names)


# Two nodes of half the ranks each (4 ranks as 2 x 2, 2 as 2 x 1) run in the shared launches,
# whose module leaves PACMPI_TEST_RANKS_PER_NODE unset.
SHARED = shared_launches(MODULE)
RUNS = {  # (ranks, ranks per node): the tests of one launch; ids such as 4ranks-2-exact
    (4, "2"): SHARED[4,],
    (3, "2"): selected(("exact", "ternary", "ternary_scales_per_tensor", "mismatch")),
    (2, "1"): SHARED[2,],
    (2, "default"): selected(("nodes", "exact", "ternary", "state", "mismatch", "resync")),
}
TESTBED = selected(("nodes", "exact", "ternary", "mismatch"))


def per_node_env(per_node):
    return (("PACMPI_TEST_RANKS_PER_NODE", per_node),)


_NO_TESTBED = netns_skip_reason()


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, per_node, scenario", scenario_cases(MODULE, RUNS))
def test_hierarchical_scenario(ranks, per_node, scenario):
    own = {} if per_node == str(ranks // 2) else {"timeout": 180, "env": per_node_env(per_node)}
    run_scenarios(MODULE, ranks, only=RUNS[ranks, per_node], **own).check(scenario)


@pytest.fixture(scope="module")
def testbed_run():
    """One launch on 2 simulated nodes x 2 ranks, nodes found by default (host name and
    network namespace of each simulated node), across real shaped links."""
    from pacmpi.launch import detect_mpi
    from pacmpi.launch.nodes import NodeTestbed

    with NodeTestbed(2, "1gbit") as bed:
        return scenario_run(
            {MODULE: TESTBED}, 4, lambda command: bed.mpirun_command(
                detect_mpi(), 4, command, tag_output=False,
                env_forward=[f"{name}={value}" for name, value in per_node_env("default")]),
            timeout=150, what="2 nodes x 2 ranks on the node test bed")


@pytest.mark.mpi
@pytest.mark.skipif(_NO_TESTBED is not None, reason=f"no node test bed: {_NO_TESTBED}")
@pytest.mark.parametrize("scenario", TESTBED)
def test_two_nodes_of_two_ranks_on_the_node_test_bed(testbed_run, scenario):
    """The issue's checks across the test bed: nodes found, exact sums, unbiased ternary,
    mismatch."""
    testbed_run.check(scenario)


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
