"""``pacmpi train --backend ddp`` under torchrun: every DDP method for a few steps in one launch.

Usage: torchrun --standalone --nproc-per-node N ddp_train_job.py TMPDIR. Runs the job through
``pacmpi.cli.main`` (pactrain, with --json) and through ``train.run`` for the other methods;
every rank prints "OK <method> rank <r>" when its result is sane and equal on every rank, and
rank 0 prints "BYTES <method> <bytes per step>".
"""
import json
import os
import sys

import torch.distributed as dist

from pacmpi.adapters import train
from pacmpi.cli import main as cli_main

ARGS = ["--backend", "ddp", "--pretrain-epochs", "1", "--epochs", "1", "--max-steps", "4",
        "--width", "4", "--hidden", "16", "--ratio", "0.8", "--no-progress", "--threads", "1"]


def check(method, result, collectives):
    digests = collectives.allgather_object(result["state_sha256"])
    assert len(set(digests)) == 1, f"{method}: ranks ended with different weights"
    assert len(result["steps"]) == 4 and result["world_size"] == collectives.size, result
    assert 0.15 < result["density"] < 0.3, result["density"]
    if collectives.rank == 0:
        print(f"BYTES {method} {result['summary']['bytes_per_step']:.0f}", flush=True)
    print(f"OK {method} rank {collectives.rank}", flush=True)


def main():
    tmp = sys.argv[1]
    cached = ["--pretrained", os.path.join(tmp, "pretrained.pt")]
    out = os.path.join(tmp, "pactrain.json")
    status = cli_main(["train", *ARGS, *cached, "--method", "pactrain", "--json", out])
    assert status == 0, status
    collectives = train.collectives_for("ddp")
    dist.barrier()
    with open(out) as f:
        check("pactrain", json.load(f), collectives)
    parser = train.build_parser()
    for method, extra in (("pactrain-ternary", []), ("dense", []), ("fp16", []),
                          ("powersgd", ["--powersgd-rank", "1"]),
                          ("powersgd-4", ["--powersgd-rank", "4"])):
        config = parser.parse_args(ARGS + cached + extra +
                                   ["--method", method.partition("-4")[0]])
        check(method, train.run(config, collectives), collectives)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
