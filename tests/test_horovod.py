"""PacTrainCompressor and HorovodCollectives on 2 Horovod ranks, under both controllers.

Each scenario of tests/mpi_scripts/hvd_compressor.py runs under ``horovodrun --gloo`` (Gloo
controller) and under plain ``mpirun`` (``hvd.init()`` picks the MPI controller); a hang fails
the test at its timeout, and every rank must report its outcome.
"""

import pytest

from mpi_util import assert_mismatch_reported, run_horovod_gloo, run_mpi

pytest.importorskip("horovod.torch")

SCRIPT = "hvd_compressor.py"
RANKS = 2
TIMEOUT = 120  # generous: ranks share 2 cores; a hang still fails


LAUNCHERS = {
    "gloo": lambda script, n, *args: run_horovod_gloo(script, n, *args, timeout=TIMEOUT),
    "mpi": lambda script, n, *args: run_mpi(script, n, *args, timeout=TIMEOUT),
}


def output(result):
    return f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


SCENARIOS = ("match", "gradual", "ternary", "reducer", "checkpoint", "prune", "interrupt")


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_scenarios_pass_on_every_rank(launcher):
    """One launch runs every scenario (a launch costs seconds). match: packed training equals
    Horovod's dense training on masked grads (Average and Sum), also through a bare
    hvd.allreduce, and a stray tensor fails on every rank; gradual: a mask change mid-run
    falls back to dense, then packs again, still exact; ternary: op=hvd.Sum decodes to exactly
    scale * (integer sum of codes), op=hvd.Average is refused; reducer: PacTrainReducer over
    HorovodCollectives sums exactly; checkpoint: state_dict / load_state_dict (and pickling
    with the model) into a new DistributedOptimizer resumes bit for bit, lossless and ternary,
    residuals are dropped with a warning at another world size, and a checkpoint of another
    quantize mode, other parameters or other masks (on one rank) fails on every rank;
    prune: torch.nn.utils.prune's logical mask names pack and equal the dense run, bad keys
    fail on every rank; interrupt: backward raising mid-step, then reset_step() or the
    automatic reset, retries the step bit-identically to an uninterrupted run."""
    result = LAUNCHERS[launcher](SCRIPT, RANKS, *SCENARIOS)
    assert result.returncode == 0, output(result)
    for scenario in SCENARIOS:
        for rank in range(RANKS):
            assert f"OK {scenario} rank {rank}" in result.stdout, output(result)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_divergent_masks_fail_on_every_rank(launcher):
    """The last rank moves its survivors at step 2 (same count): every rank raises
    MaskMismatchError naming it, before anything is summed, and the job exits non-zero."""
    assert_mismatch_reported(LAUNCHERS[launcher](SCRIPT, RANKS, "mismatch"), RANKS,
                             "2.weight")


def test_four_ranks_ternary_reducer_and_mismatch():
    """Base-9 ternary words on 4 ranks still decode exactly; the reducer over Horovod sums
    exactly; a divergent mask on rank 3 stops all four ranks."""
    result = run_mpi(SCRIPT, 4, "ternary", "reducer", "mismatch", timeout=TIMEOUT)
    for scenario in ("ternary", "reducer"):
        for rank in range(4):
            assert f"OK {scenario} rank {rank}" in result.stdout, output(result)
    assert_mismatch_reported(result, 4, "2.weight")
