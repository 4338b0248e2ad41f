"""The scenario runner (mpi_util.run_scenarios) reports every scenario of a launch on its own:
a failure names its scenario, ranks and traceback and hides no other scenario; a rank that
dies or hangs fails its launch's scenarios, with how the launch ended and its output; in a
launch of several modules, a scenario is its module's, and a rank that dies fails the scenarios
it had not gone past."""
import os
from pathlib import Path

import pytest

from mpi_util import ScenarioRun, mpirun_argv, run_scenarios, scenario_names, scenario_run

MODULE, LATER = "control_scenarios.py", "control_later_scenarios.py"
FAILING, EXITING, HANGING = "test_fails_on_rank_1", "test_exits_on_rank_1", "test_hangs"


def failure(run, test):
    with pytest.raises(pytest.fail.Exception) as caught:
        run.check(test)
    return str(caught.value)


def test_scenarios_are_listed_without_importing_the_module():
    assert scenario_names(MODULE) == ["test_passes", FAILING, EXITING, HANGING,
                                      "test_passes_after_them"]


@pytest.mark.mpi
def test_a_failure_on_one_rank_is_named_and_hides_nothing():
    run = run_scenarios(MODULE, 2, only=("test_passes", FAILING, "test_passes_after_them"),
                        timeout=120)
    run.check("test_passes")
    run.check("test_passes_after_them")
    message = failure(run, FAILING)
    assert message.startswith(f"scenario {MODULE}::{FAILING} on 2 ranks (mpirun -n 2): "
                              "passed on ranks [0], failed on [1], skipped on [], "
                              "not reported by []"), message
    assert "--- rank 1 ---" in message and "--- rank 0 ---" not in message, message
    assert "AssertionError: deliberate failure on rank 1 (rank sum 1)" in message, message
    assert "launcher output" not in message, message


@pytest.mark.mpi
def test_a_rank_that_dies_fails_every_scenario_of_its_launch():
    """What rank 1 did not report fails as unreported; what every rank passed still fails,
    as the job did not end well."""
    run = run_scenarios(MODULE, 2, only=("test_passes", EXITING, "test_passes_after_them"),
                        timeout=120)
    # Rank 0 passes the barrier before rank 1 exits, but may be stopped before it reports.
    for test, unreported in (("test_passes", ["[]"]), (EXITING, ["[1]", "[0, 1]"]),
                             ("test_passes_after_them", ["[0, 1]"])):
        message = failure(run, test)
        assert f"{MODULE}::{test} on 2 ranks" in message, message
        assert any(f"not reported by {ranks}\n" in message for ranks in unreported), message
        assert "the launch exited with status 3" in message, message
        assert "launcher output" in message, message


@pytest.mark.mpi
def test_a_launch_that_hangs_fails_what_it_did_not_report(launcher_tmpdir):
    run = run_scenarios(MODULE, 2, only=("test_passes", HANGING), timeout=10,
                        env=(("TMPDIR", str(launcher_tmpdir)),))
    message = failure(run, HANGING)
    assert f"{MODULE}::{HANGING} on 2 ranks" in message, message
    assert "not reported by [0, 1]\n" in message, message
    assert "the launch did not finish within 10s (hang?)" in message, message
    # Every rank was killed with the launcher (Open MPI gives ranks process groups of their own).
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and HANGING.encode() in
            _cmdline(pid)]
    assert not left, left
    # Nor did the killed launcher leave its session directory, where a later launcher with
    # its pid would fail to start (tests/test_launch.py shows how).
    assert not list(launcher_tmpdir.glob("ompi.*"))


def shared(modules):
    return scenario_run(modules, 2, lambda command: mpirun_argv(2) + command, timeout=120,
                        what="mpirun -n 2")


@pytest.mark.mpi
def test_in_a_shared_launch_a_scenario_is_its_modules():
    """The same name in two modules: the first module's fails on rank 1, the later one's
    passes; each is read for its own module."""
    run = shared({MODULE: ("test_passes", FAILING), LATER: (FAILING,)})
    run.part(LATER).check(FAILING)
    message = failure(run.part(MODULE), FAILING)
    assert message.startswith(f"scenario {MODULE}::{FAILING} on 2 ranks (mpirun -n 2): "
                              "passed on ranks [0], failed on [1]"), message
    with pytest.raises(ValueError, match="control_scenarios.py was not run by this launch"):
        ScenarioRun({LATER: None}, 2, "mpirun -n 2", {}, None, "").part(MODULE)


@pytest.mark.mpi
def test_in_a_shared_launch_a_rank_that_dies_fails_only_what_it_had_not_gone_past():
    run = shared({MODULE: ("test_passes",), LATER: (FAILING, EXITING)})
    run.part(MODULE).check("test_passes")  # every rank went on to the later module
    for test in (FAILING, EXITING):  # the later module's: the job did not end well
        message = failure(run.part(LATER), test)
        assert "the launch exited with status 3" in message, message


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
