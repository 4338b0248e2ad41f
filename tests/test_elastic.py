"""Elastic restarts of a DDP job with PacTrain's hook under ``torchrun`` (gloo, CPU), and a
checkpoint resumed at another world size (tests/mpi_scripts/elastic_train.py).

restart: ``torchrun --standalone --nnodes 1 --nproc-per-node 2 --max-restarts 1``; two pruned
models (lossless float32, ternary) checkpoint every 3 steps; the last rank SIGKILLs itself at
step 7 of the first attempt; torchrun restarts both workers, which resume from step 6 and finish
10 steps. The restarted run must equal, bit for bit, the uninterrupted run (trained from scratch
in the restarted process group): at 2 ranks a coordinate's sum is one addition, the same in any
order, so DDP's rebuilt buckets of the resumed run change nothing, even in float32. Masks come
back from the checkpoint (the restart builds others), are verified every step, pruned weights
stay 0, ranks end identical. Negative control: the same resume with the ternary residuals
cleared ends elsewhere.

resize: the 2-rank checkpoint resumed at 3 ranks: every rank starts from the mean of the 2
ranks' ternary residuals (and says so), masks and tracker carry over, training goes on with
identical ranks; a hook state's checkpoint without masks= fails on every rank.

snippet: docs/trainers/elastic.md's script, unchanged, under the same torchrun with a worker
killed after the first checkpoint: it resumes and finishes.

Every launch is bounded (a hang fails) and runs in a session of its own, killed whole on timeout.
"""
import glob
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from doc_snippets import snippet
from mpi_util import MPI_SCRIPTS, run_bounded

pytest.importorskip("torch.distributed")

STEPS, EVERY, KILL_AT, RESUMED_AT = 10, 3, 7, 6
RESIZED_STEPS, RESIZED_AT = 12, 9
MODES = ("lossless", "ternary")
TIMEOUT = 120  # ranks share 2 cores; a hang still fails
# torch 2.13's c10d rendezvous keeps its TCPStore across restarts, and the restarted workers
# read the dead ones' gloo addresses from it ("Gloo connectFullMesh failed ... Connection
# refused"); opting out of the shared store gives each attempt a fresh one.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


def torchrun(n, restarts, *command):
    tool = Path(sys.executable).parent / "torchrun"
    return [str(tool), "--standalone", "--nnodes", "1", "--nproc-per-node", str(n),
            "--max-restarts", str(restarts), "--no-python", sys.executable, *map(str, command)]


def launch(argv, workdir, what):
    """Run ``argv`` bounded, in ``workdir``; afterwards no process may still name ``workdir``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **ELASTIC_ENV)
    done = run_bounded(["bash", "-c", 'cd "$0" && exec "$@"', str(workdir), *argv],
                       timeout=TIMEOUT, env=env, what=what)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _names(pid, workdir)]
    assert not left, f"{what}: processes left behind: {left}"
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _names(pid, workdir):
    try:
        return str(workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def results(workdir, ranks):
    return [torch.load(workdir / f"result.rank{r}.pt", weights_only=False) for r in range(ranks)]


def same(a, b):
    """Exact, recursive equality of state dicts (tensors and arrays bit for bit)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (torch.Tensor, np.ndarray)):
        return np.array_equal(np.asarray(a), np.asarray(b)) and np.asarray(a).dtype == \
            np.asarray(b).dtype
    return a == b


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("elastic")
    done = launch(torchrun(2, 1, MPI_SCRIPTS / "elastic_train.py", workdir, STEPS, EVERY,
                           KILL_AT), workdir, "the elastic run")
    return done, workdir, results(workdir, 2)


@pytest.fixture(scope="module")
def resized(restarted):
    _, source, _ = restarted
    workdir = source.parent / "resized"
    for mode in MODES:
        shutil.copytree(source / mode, workdir / mode)
    done = launch(torchrun(3, 0, MPI_SCRIPTS / "elastic_train.py", workdir, RESIZED_STEPS,
                           EVERY, -1), workdir, "the resumed run at 3 ranks")
    files = {mode: [torch.load(f, weights_only=False) for f in
                    sorted(glob.glob(str(workdir / mode / "ckpt.pt.*.rank*")))]
             for mode in MODES}
    return done, files, results(workdir, 3)


def test_a_worker_was_killed_and_the_group_restarted(restarted):
    _, workdir, ranks = restarted
    assert (workdir / "killed").read_text() == f"rank 1 at step {KILL_AT}"
    for result in ranks:
        assert result["attempt"] == 1 and result["world_size"] == 2, result.keys()
        assert [result[mode]["start"] for mode in MODES] == [RESUMED_AT] * 2
        assert all(result[mode]["warnings"] == [] for mode in MODES)  # same world: nothing


@pytest.mark.parametrize("mode", MODES)
def test_restarted_run_equals_the_uninterrupted_one(restarted, mode):
    _, _, ranks = restarted
    for result in ranks:
        assert same(result[mode]["weights"], result[f"reference-{mode}"]["weights"]), mode
        assert same(result[mode]["weights"], ranks[0][mode]["weights"])  # ranks identical
        # The hook state too: step, tracker, residuals, counters (timings aside).
        state, reference = result[mode]["state"], result[f"reference-{mode}"]["state"]
        assert same({k: v for k, v in state.items() if k != "stats"},
                    {k: v for k, v in reference.items() if k != "stats"})


def test_cleared_residuals_change_the_result(restarted):
    """Negative control: the comparison above sees the hook state that came back."""
    _, _, ranks = restarted
    for result in ranks:
        assert result["reference-ternary"]["state"]["residuals"]
        assert not same(result["control"]["weights"], result["reference-ternary"]["weights"])


@pytest.mark.parametrize("mode", MODES)
def test_masks_come_back_and_are_verified_every_step(restarted, mode):
    _, _, ranks = restarted
    for result in ranks:
        run = result[mode]
        assert same(run["masks"], result[f"reference-{mode}"]["masks"])
        assert not same(run["built_masks"], run["masks"])  # the restart built other masks
        assert run["stats"]["steps"] == run["stats"]["verifications"] == STEPS, run["stats"]
        for name, keep in run["masks"].items():
            assert not run["weights"][name][~keep].any() and run["weights"][name][keep].all()


def test_resumed_at_another_world_size(resized):
    _, files, ranks = resized
    old = {mode: [f["sync"] for f in sorted(files[mode], key=lambda f: f["rank"])]
           for mode in MODES}
    assert [len(old[mode]) for mode in MODES] == [2, 2]
    r0, r1 = (state["residuals"] for state in old["ternary"])
    assert r0.keys() == r1.keys() and r0
    for result in ranks:
        assert result["world_size"] == 3 and result["ternary"]["start"] == RESIZED_AT
        loaded = result["ternary"]["loaded"]
        for name in r0:  # each rank starts from the mean of the 2 ranks' residuals
            assert not np.array_equal(r0[name], r1[name])
            assert np.array_equal(loaded["residuals"][name], (r0[name] + r1[name]) / 2), name
        assert (re.search(r"resuming at world size 3 from a checkpoint taken at 2: each rank "
                          rf"starts from the mean of the 2 ranks' error-feedback residuals "
                          rf"\({len(r0)} arrays\); per-rank RNG states are reseeded",
                          "\n".join(result["ternary"]["warnings"])))
        assert result["lossless"]["loaded"]["residuals"] == {}
        for mode in MODES:
            run = result[mode]
            assert same(run["loaded"]["tracker"], old[mode][0]["tracker"])
            assert run["loaded"]["step"] == RESIZED_AT
            assert run["stats"]["verifications"] == RESIZED_STEPS, run["stats"]
            assert same(run["weights"], ranks[0][mode]["weights"])  # ranks identical
            for name, keep in run["masks"].items():
                assert not run["weights"][name][~keep].any()


def test_snippet_restarts_and_finishes(tmp_path):
    """docs/trainers/elastic.md's script, run as written; a wrapper SIGKILLs the last worker
    right after its first checkpoint, on the first attempt only."""
    script = tmp_path / "train.py"
    script.write_text(snippet("elastic"))
    done = launch(torchrun(2, 1, MPI_SCRIPTS / "elastic_kill_after_save.py", script),
                  tmp_path, "the elastic snippet")
    assert (tmp_path / "killed").read_text() == "rank 1 after a checkpoint"
    for rank in range(2):
        # Both workers print to one pipe unbuffered, each line's text and newline in two
        # writes, so a line may run into the other rank's: "step 4rank 0: ...".
        assert re.search(rf"rank {rank}: resumed at step 4(?!\d)", done.stdout), done.stdout
        assert f"rank {rank}: done at step 12" in done.stdout, done.stdout
