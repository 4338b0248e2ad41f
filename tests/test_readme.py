"""The README's front-end snippets run as written, each on 2 ranks: the raw loop, the Horovod
wrapper, the sharded optimizer and outer steps under mpirun (tests/mpi_scripts/
readme_scenarios.py, readme_hvd_scenarios.py), the DDP two-liners (PacTrain's hook, the sharded
hook) and the DDP loop with outer steps under torchrun (readme_ddp_scenarios.py), in the shared
launches (mpi_util.SHARED_LAUNCHES). The snippets are the blocks marked
``<!-- snippet: NAME -->`` (doc_snippets.py); the user guide's copies are the same code
(test_docs checks), so they run here too."""

import pytest

from doc_snippets import README, marked, snippet
from mpi_util import SHARED_TIMEOUT, run_scenarios

FRONT_ENDS = ["raw-loop", "horovod", "ddp", "sharded", "sharded-ddp", "outer"]


def test_readme_has_one_snippet_per_front_end():
    assert [(name, language) for name, language, _ in marked(README)] == [
        (name, "python") for name in FRONT_ENDS]


# Each front end's snippet and its checks: a scenario in the shared launches (mpi_util).
MPIRUN = {"raw-loop": ("readme_scenarios.py", "test_raw_loop"),
          "horovod": ("readme_hvd_scenarios.py", "test_horovod"),
          "sharded": ("readme_scenarios.py", "test_sharded"),
          "outer": ("readme_scenarios.py", "test_outer")}
TORCHRUN = {"ddp": "test_ddp", "outer-ddp": "test_outer_ddp", "sharded-ddp": "test_sharded_ddp"}


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("front_end", list(MPIRUN))
def test_readme_snippet_runs_on_two_ranks(front_end):
    if front_end == "horovod":
        pytest.importorskip("horovod.torch")
    module, scenario = MPIRUN[front_end]
    run_scenarios(module, 2).check(scenario)


def test_readme_ddp_snippet_is_the_two_liner():
    lines = [line for line in snippet("ddp").splitlines() if line.strip()]
    assert lines[0] == "from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook"
    assert len(lines) == 3 and "register_comm_hook(PacTrainHookState(ddp_model, masks)" in lines[2]


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("front_end", sorted(TORCHRUN))
def test_readme_ddp_snippet_runs_under_torchrun(front_end):
    run_scenarios("readme_ddp_scenarios.py", 2, "torchrun").check(TORCHRUN[front_end])
