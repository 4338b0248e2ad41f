"""``pacmpi train --backend ddp`` under torchrun, every DDP method for a few steps: every rank
runs these tests in this order (tests/test_ddp.py), and each is reported on its own.

The job runs through ``pacmpi.cli.main`` for pactrain (with --json) and through ``train.run``
for the other methods, all sharing one pretrained model cached in $PACMPI_TEST_WORKDIR.
"""
import json
import os

import torch.distributed as dist

from pacmpi.cli import main as cli_main
from pacmpi.experiments import train

WORKDIR = os.environ["PACMPI_TEST_WORKDIR"]
ARGS = ["--backend", "ddp", "--pretrain-epochs", "1", "--epochs", "1", "--max-steps", "4",
        "--width", "4", "--hidden", "16", "--ratio", "0.8", "--no-progress", "--threads", "1",
        "--pretrained", os.path.join(WORKDIR, "pretrained.pt")]
OTHER_METHODS = {"pactrain-ternary": [], "dense": [], "fp16": [],
                 "powersgd": ["--powersgd-rank", "1"], "powersgd-4": ["--powersgd-rank", "4"]}

COLLECTIVES = train.collectives_for("ddp")
BYTES_PER_STEP = {}  # method -> bytes sent per step (rank 0's summary), filled by the tests


def check(method, result):
    """Sane and equal on every rank: the same weights, 4 steps, the density --ratio asks for."""
    digests = COLLECTIVES.allgather_object(result["state_sha256"])
    assert len(set(digests)) == 1, f"{method}: ranks ended with different weights"
    assert len(result["steps"]) == 4 and result["world_size"] == COLLECTIVES.size, result
    assert 0.15 < result["density"] < 0.3, (method, result["density"])
    if COLLECTIVES.rank == 0:
        BYTES_PER_STEP[method] = result["summary"]["bytes_per_step"]


def test_pactrain_through_the_cli(capsys):
    out = os.path.join(WORKDIR, "pactrain.json")
    assert cli_main(["train", *ARGS, "--method", "pactrain", "--json", out]) == 0
    if COLLECTIVES.rank == 0:  # rank 0 prints the summary and writes the JSON
        printed = capsys.readouterr().out
        assert "method pactrain" in printed and "bytes sent per step" in printed, printed
    dist.barrier()
    with open(out) as f:
        check("pactrain", json.load(f))


def test_other_methods_through_train_run():
    parser = train.build_parser()
    for method, extra in OTHER_METHODS.items():
        config = parser.parse_args(ARGS + extra + ["--method", method.partition("-4")[0]])
        check(method, train.run(config, COLLECTIVES))


def test_sharded_optimizers_train_as_the_replicated_ones():
    """``--sharded`` under DDP: pactrain through sharded_hook, dense through torch's
    ZeroRedundancyOptimizer, each ending where its replicated run ends (2 ranks: every sum is
    one addition, exact in any order), with less Adam state on every rank."""
    parser = train.build_parser()
    for method in ("pactrain", "dense"):
        args = ARGS + ["--method", method, "--optimizer", "adam", "--lr", "0.001"]
        replicated = train.run(parser.parse_args(args), COLLECTIVES)
        sharded = train.run(parser.parse_args(args + ["--sharded"]), COLLECTIVES)
        check(f"{method}-sharded", sharded)
        assert sharded["state_sha256"] == replicated["state_sha256"], method
        full, mine = (r["optimizer_state_elements"] for r in (replicated, sharded))
        assert full == 2 * replicated["parameters"], (method, full)
        summary = sharded["summary"]
        if method == "pactrain":  # the all-gather brings back what the reduce-scatter sent
            assert summary["weight_bytes_per_step"] == summary["bytes_per_step"], summary
            assert mine == 2 * -(-round(summary["bytes_per_step"]) // 4 // COLLECTIVES.size)
        else:  # ZeRO: whole parameters per rank, its broadcasts carry every weight
            assert summary["weight_bytes_per_step"] == summary["dense_bytes_per_step"]
            assert mine < full, (mine, full)


def test_bytes_per_step_in_expected_order():
    if COLLECTIVES.rank != 0:
        return  # the summaries are rank 0's
    sent = BYTES_PER_STEP
    assert sent["fp16"] * 2 == sent["dense"], sent
    assert sent["pactrain-ternary"] < sent["pactrain"] < sent["dense"], sent
    assert sent["powersgd"] < sent["powersgd-4"] < sent["dense"], sent
