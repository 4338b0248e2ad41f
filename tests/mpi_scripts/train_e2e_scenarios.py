"""``pacmpi.experiments.train`` end to end on a small CNN under mpirun: every rank runs these
tests in this order (tests/test_train.py), and each is reported on its own.

Methods: one short epoch per method through ``run()``; checks the result dict, accuracy,
identical final models on every rank, then that PacTrain / TopK send fewer bytes than dense,
and ``main()`` with ``--json``. Resume: a gradual-pruning run of 2 epochs uninterrupted, versus
the same run stopped after 15 steps (checkpoint) and resumed: final models must be
bit-identical. Every file (the pretrained model cache included) is in $PACMPI_TEST_WORKDIR.
"""
import json
import os

import pytest
from mpi4py import MPI

from pacmpi.collectives import allreduce_algorithm
from pacmpi.experiments.train import main, run

comm = MPI.COMM_WORLD
WORKDIR = os.environ["PACMPI_TEST_WORKDIR"]
BASE = {"width": 8, "hidden": "32", "pretrained": os.path.join(WORKDIR, "pre.pt"),
        "pretrain_epochs": 3, "epochs": 1, "progress": False, "lr": 0.02}
BYTES_PER_STEP = {}  # method -> bytes sent per step, filled by the method tests


def same_everywhere(result):
    digests = comm.allgather(result["state_sha256"])
    assert len(set(digests)) == 1, digests


def check_method(method):
    result = run(dict(BASE, method=method, ratio=0.5))
    same_everywhere(result)
    assert [r["epoch"] for r in result["epochs"]] == [0], result["epochs"]
    epoch = result["epochs"][0]
    assert epoch["wall_seconds"] > 0 and epoch["samples_per_second"] > 0
    assert result["final_accuracy"] > 0.85, (method, result["final_accuracy"])
    assert result["pretrained_accuracy"] > 0.85
    assert abs(result["density"] - 0.5) < 1e-3
    split = result["summary"]["step_seconds"]
    assert set(split) >= {"compute", "pack", "comm", "unpack"}, split
    assert len(result["steps"]) == epoch["steps"] > 0
    BYTES_PER_STEP[method] = result["summary"]["bytes_per_step"]


def test_dense():
    check_method("dense")


def test_fp16():
    check_method("fp16")


def test_pactrain():
    check_method("pactrain")


def test_pactrain_ternary():
    check_method("pactrain-ternary")


def test_topk():
    check_method("topk")


def test_sharded_pactrain_trains_as_replicated_pactrain():
    """``--sharded``: ShardedOptimizer's reduce-scatter, Adam over this rank's shard of the
    survivors and the all-gather end with replicated PacTrain's weights (2 ranks: every sum is
    one addition, exact in any order) and keep a shard's worth of Adam state."""
    config = dict(BASE, method="pactrain", ratio=0.5, optimizer="adam", lr=0.002)
    replicated, sharded = run(config), run(dict(config, sharded=True))
    same_everywhere(sharded)
    assert sharded["state_sha256"] == replicated["state_sha256"]
    assert sharded["final_accuracy"] == replicated["final_accuracy"] > 0.85
    survivors = round(sharded["summary"]["weight_bytes_per_step"]) // 4  # the all-gather's
    assert survivors == round(sharded["summary"]["bytes_per_step"]) // 4  # = reduce-scatter's
    pruned = round(sharded["prunable_parameters"] * (1 - sharded["density"]))
    assert survivors == sharded["parameters"] - pruned
    # Adam's two moments: every parameter's replicated, half the survivors' (rounded up) here
    assert replicated["optimizer_state_elements"] == 2 * replicated["parameters"]
    assert sharded["optimizer_state_elements"] == 2 * -(-survivors // comm.size)


def test_pactrain_and_topk_send_fewer_bytes_than_dense():
    missing = {"dense", "pactrain", "topk"} - set(BYTES_PER_STEP)
    if missing:
        pytest.fail(f"no bytes per step of {sorted(missing)}: their tests failed")
    assert BYTES_PER_STEP["pactrain"] < 0.6 * BYTES_PER_STEP["dense"], BYTES_PER_STEP
    assert BYTES_PER_STEP["topk"] < 0.05 * BYTES_PER_STEP["dense"], BYTES_PER_STEP


def test_json_output():
    out = os.path.join(WORKDIR, "out.json")
    main(["--width", "8", "--hidden", "32", "--pretrained", BASE["pretrained"],
          "--pretrain-epochs", "3", "--epochs", "1", "--max-steps", "4", "--no-progress",
          "--method", "pactrain", "--json", out])
    comm.Barrier()
    with open(out) as f:
        written = json.load(f)
    assert written["config"]["max_steps"] == 4 and len(written["steps"]) == 4, written["config"]
    # What the library was told for each all-reduce, read back: Open MPI names both.
    assert written["mpi_algorithms"] == {
        "allreduce": allreduce_algorithm(MPI),
        "iallreduce": allreduce_algorithm(MPI, nonblocking=True)}
    assert None not in written["mpi_algorithms"].values()


def test_resumed_run_is_bit_identical():
    config = dict(BASE, epochs=2, gradual="5:0.3,25:0.6", method="pactrain",
                  optimizer="adamw", stable_steps=2)
    reference = run(config)
    ckpt = os.path.join(WORKDIR, "run.ckpt")
    first = run(dict(config, checkpoint=ckpt, checkpoint_every=15, max_steps=15))
    assert len(first["steps"]) == 15 and first["epochs"] == [], first["epochs"]
    resumed = run(dict(config, checkpoint=ckpt, resume=True))
    same_everywhere(resumed)
    assert resumed["state_sha256"] == reference["state_sha256"], "resume is not bit-exact"
    assert resumed["fallbacks"] > 0 and resumed["stats"]["packed_reductions"] > 0
    assert [r["test_accuracy"] for r in resumed["epochs"]] == [
        r["test_accuracy"] for r in reference["epochs"]]
