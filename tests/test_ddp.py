"""PacTrain's DDP communication hook (``pacmpi.adapters.ddp``) and ``pacmpi train --backend
ddp`` under torchrun (gloo), on 2 and 4 ranks.

Each scenario of tests/mpi_scripts/ddp_scenarios.py is reported on its own; one launch per rank
count runs them (a launch costs seconds), and a hang fails what it had not reported at its
timeout.

match: after k steps the hooked model equals DDP's default all-reduce of masked grads bit for
bit (integer data), with rebuilt buckets, static_graph, gradient_as_bucket_view,
find_unused_parameters and verify_every=2; pruned weights and reduced grads stay 0; ranks end
bit-identical. early_state: a state built of the plain module before DDP wraps it (also in a
process group of its own, or pickled before binding) binds when first used and trains the
same. accumulate: no_sync. prune: torch.nn.utils.prune's logical names. dtypes:
float32 + float64 parameters. ternary: lowers a least-squares loss. unbiased: the mean of 300
decoded ternary averages is within the noise of the exact average, and a biased rounding is
not. checkpoint: state_dict / pickle + bind resume bit for bit (lossless and ternary), a
checkpoint that does not fit fails on every rank. errors: a bad mask shape on one rank and bad
keys raise RankInputError on every rank, at bind() or from backward() when the hook binds; a
bad option raises ValueError at construction; DDP buckets that differ between ranks
raise LayoutMismatchError from backward() on every rank, no hang. resync: on_mismatch="resync"
adopts rank 0's masks. mismatch: the last rank moves its survivors at step 2 (same count):
every rank raises MaskMismatchError naming it, before anything is summed. On 4 ranks: base-9
ternary words, exactness, checkpoints, layout errors, mismatch.
"""
import os
import socket
import subprocess
import sys

import pytest

from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_cases, scenario_names, shared_launches

pytest.importorskip("torch.distributed")

MODULE = "ddp_scenarios.py"
TIMEOUT = 150  # generous: ranks share 2 cores; a hang still fails
LAUNCHES = shared_launches(MODULE, "torchrun")  # at 4 ranks, the scenarios that need more than 2


def output(result):
    return f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, LAUNCHES))
def test_ddp_scenario(ranks, scenario):
    run_scenarios(MODULE, ranks, "torchrun", only=LAUNCHES[ranks,]).check(scenario)


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("scenario", scenario_names("ddp_train_scenarios.py"))
def test_train_job_under_torchrun(scenario):
    """``pacmpi train --backend ddp`` with every DDP method for 4 steps on 2 ranks: weights
    equal on every rank, and the bytes per step in the expected order."""
    run_scenarios("ddp_train_scenarios.py", 2, "torchrun").check(scenario)


def test_train_backend_ddp_without_torchrun(tmp_path):
    """Without torchrun the ddp backend runs as a world of one."""
    with socket.socket() as probe:  # a free port for the one-process rendezvous
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    done = subprocess.run(
        [sys.executable, "-m", "pacmpi.cli", "train", "--backend", "ddp", "--pretrain-epochs",
         "1", "--max-steps", "2", "--epochs", "1", "--width", "4", "--hidden", "16",
         "--no-progress", "--pretrained", str(tmp_path / "p.pt")],
        capture_output=True, text=True, timeout=TIMEOUT,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {
            "MASTER_PORT": port})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 1 ranks, method pactrain" in done.stdout, done.stdout


def test_state_is_built_without_a_process_group():
    """As PowerSGDState: construction checks the options only, before any process group; an
    unbound state pickles with its masks and options and asks for bind(model)."""
    import pickle

    import torch
    import torch.distributed as dist

    from pacmpi.adapters.ddp import PacTrainHookState

    assert not dist.is_initialized()
    model = torch.nn.Linear(3, 2)
    state = PacTrainHookState(model, {"weight": torch.ones(2, 3, dtype=torch.bool)},
                              quantize="ternary")
    assert state.step == 0 and state.engine is None
    # The hook never ran (Lightning drops it without its callback): zero counters, no error.
    assert set(state.stats.values()) == {0} and "bytes_sent" in state.stats
    copy = pickle.loads(pickle.dumps(state))
    assert torch.equal(copy.masks["weight"], state.masks["weight"])
    with pytest.raises(RuntimeError, match=r"call state.bind\(model\)"):
        copy.bind()
    with pytest.raises(ValueError, match="quantize must be one of"):
        PacTrainHookState(model, {}, quantize="fp8")
    with pytest.raises(ValueError, match="ternary_scale must be one of .*got 'layer'"):
        PacTrainHookState(model, {}, quantize="ternary", ternary_scale="layer")
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        PacTrainHookState(model.state_dict(), {})


def test_bad_configurations_are_refused():
    from pacmpi.experiments.train import check_config

    for config, message in (({"backend": "ddp", "method": "topk"}, "--backend ddp supports"),
                            ({"method": "powersgd"}, "use --backend ddp"),
                            ({"backend": "ddp", "checkpoint": "x"}, "--checkpoint"),
                            ({"backend": "ddp", "powersgd_rank": 0}, "--powersgd-rank")):
        with pytest.raises(ValueError, match=message):
            check_config(config)
