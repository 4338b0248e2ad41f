"""PacTrain's DDP communication hook (``pacmpi.adapters.ddp``) and ``pacmpi train --backend
ddp`` under torchrun (gloo), on 2 and 4 ranks.

Each launch runs several scenarios of tests/mpi_scripts/ddp_scenarios.py (a launch costs
seconds); a hang fails the test at its timeout, and every rank must report its outcome.
"""
import os
import re
import socket
import subprocess
import sys

import pytest

from mpi_util import assert_mismatch_reported, run_torchrun

pytest.importorskip("torch.distributed")

SCRIPT = "ddp_scenarios.py"
TIMEOUT = 150  # generous: ranks share 2 cores; a hang still fails
SCENARIOS = ("match", "accumulate", "prune", "dtypes", "ternary", "unbiased", "checkpoint",
             "errors", "resync")


def output(result):
    return f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def assert_passed(result, scenarios, n):
    for scenario in scenarios:
        for rank in range(n):
            assert f"OK {scenario} rank {rank}" in result.stdout, output(result)


def test_scenarios_on_two_ranks():
    """match: after k steps the hooked model equals DDP's default all-reduce of masked grads bit
    for bit (integer data), with rebuilt buckets, static_graph, gradient_as_bucket_view,
    find_unused_parameters and verify_every=2; pruned weights and reduced grads stay 0; ranks
    end bit-identical. accumulate: no_sync. prune: torch.nn.utils.prune's logical names.
    dtypes: float32 + float64 parameters. ternary: lowers a least-squares loss. unbiased: the
    mean of 300 decoded ternary averages is within the noise of the exact average, and a
    biased rounding is not. checkpoint: state_dict / pickle + bind resume bit for bit (lossless
    and ternary), a checkpoint that does not fit fails on every rank. errors: a bad mask shape
    on one rank, bad keys, bad options raise RankInputError on every rank; DDP buckets that
    differ between ranks raise LayoutMismatchError from backward() on every rank, no hang.
    resync: on_mismatch="resync" adopts rank 0's masks."""
    result = run_torchrun(SCRIPT, 2, *SCENARIOS, timeout=TIMEOUT)
    assert result.returncode == 0, output(result)
    assert_passed(result, SCENARIOS, 2)


def test_divergent_masks_fail_on_every_rank():
    """The last rank moves its survivors at step 2 (same count): every rank raises
    MaskMismatchError naming it, before anything is summed, and the job exits non-zero."""
    result = run_torchrun(SCRIPT, 2, "mismatch", timeout=TIMEOUT)
    assert_mismatch_reported(result, 2, "b.weight")


def test_four_ranks():
    """Base-9 ternary words on 4 ranks, exactness, checkpoints, layout errors, mismatch."""
    scenarios = ("match", "ternary", "unbiased", "checkpoint", "errors")
    result = run_torchrun(SCRIPT, 4, *scenarios, "mismatch", timeout=2 * TIMEOUT)
    assert_passed(result, scenarios, 4)
    assert_mismatch_reported(result, 4, "b.weight")


def test_train_job_under_torchrun(tmp_path):
    """``pacmpi train --backend ddp`` with every DDP method for 4 steps on 2 ranks: weights
    equal on every rank, and the bytes per step in the expected order."""
    result = run_torchrun("ddp_train_job.py", 2, tmp_path, timeout=TIMEOUT)
    assert result.returncode == 0, output(result)
    methods = ("pactrain", "pactrain-ternary", "dense", "fp16", "powersgd", "powersgd-4")
    assert_passed(result, methods, 2)
    sent = {m: int(b) for m, b in re.findall(r"BYTES (\S+) (\d+)", result.stdout)}
    assert sent["fp16"] * 2 == sent["dense"], sent
    assert sent["pactrain-ternary"] < sent["pactrain"] < sent["dense"], sent
    assert sent["powersgd"] < sent["powersgd-4"] < sent["dense"], sent
    assert "method pactrain" in result.stdout and "bytes sent per step" in result.stdout


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


def test_bad_configurations_are_refused():
    from pacmpi.adapters.train import _config

    for config, message in (({"backend": "ddp", "method": "topk"}, "--backend ddp supports"),
                            ({"method": "powersgd"}, "use --backend ddp"),
                            ({"backend": "ddp", "checkpoint": "x"}, "--checkpoint"),
                            ({"backend": "ddp", "powersgd_rank": 0}, "--powersgd-rank")):
        with pytest.raises(ValueError, match=message):
            _config(config)
