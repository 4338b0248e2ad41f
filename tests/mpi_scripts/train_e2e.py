"""MPI worker: ``pacmpi.experiments.train`` end to end on a small CNN.

``train_e2e.py methods DIR``: one short epoch per method through ``run()`` (and ``main()`` with
``--json`` for the last); checks the result dict, accuracy, identical final models on every rank
and that PacTrain / TopK send fewer bytes than dense.

``train_e2e.py resume DIR``: a gradual-pruning run of 2 epochs uninterrupted, versus the same
run stopped after 15 steps (checkpoint) and resumed: final models must be bit-identical.

Rank 0 prints ``OK ...``; a failure raises on the failing rank (non-zero exit).
"""
import json
import os
import sys

from mpi4py import MPI

from pacmpi.experiments.train import main, run

comm = MPI.COMM_WORLD
mode, directory = sys.argv[1], sys.argv[2]
BASE = {"width": 8, "hidden": "32", "pretrained": os.path.join(directory, "pre.pt"),
        "pretrain_epochs": 3, "epochs": 1, "progress": False, "lr": 0.02}


def same_everywhere(result):
    digests = comm.allgather(result["state_sha256"])
    assert len(set(digests)) == 1, digests


if mode == "methods":
    bytes_per_step = {}
    for method in ("dense", "fp16", "pactrain", "pactrain-ternary", "topk"):
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
        bytes_per_step[method] = result["summary"]["bytes_per_step"]
        if comm.rank == 0:
            print(f"OK {method}: accuracy {result['final_accuracy']:.4f}, "
                  f"{bytes_per_step[method]:.0f} bytes/step", flush=True)
    assert bytes_per_step["pactrain"] < 0.6 * bytes_per_step["dense"], bytes_per_step
    assert bytes_per_step["topk"] < 0.05 * bytes_per_step["dense"], bytes_per_step
    out = os.path.join(directory, "out.json")
    main(["--width", "8", "--hidden", "32", "--pretrained", BASE["pretrained"],
          "--pretrain-epochs", "3", "--epochs", "1", "--max-steps", "4", "--no-progress",
          "--method", "pactrain", "--json", out])
    comm.Barrier()
    with open(out) as f:
        written = json.load(f)
    assert written["config"]["max_steps"] == 4 and len(written["steps"]) == 4, written["config"]
    if comm.rank == 0:
        print("OK json", flush=True)
elif mode == "resume":
    config = dict(BASE, epochs=2, gradual="5:0.3,25:0.6", method="pactrain",
                  optimizer="adamw", stable_steps=2)
    reference = run(config)
    ckpt = os.path.join(directory, "run.ckpt")
    first = run(dict(config, checkpoint=ckpt, checkpoint_every=15, max_steps=15))
    assert len(first["steps"]) == 15 and first["epochs"] == [], first["epochs"]
    resumed = run(dict(config, checkpoint=ckpt, resume=True))
    same_everywhere(resumed)
    assert resumed["state_sha256"] == reference["state_sha256"], "resume is not bit-exact"
    assert resumed["fallbacks"] > 0 and resumed["stats"]["packed_reductions"] > 0
    assert [r["test_accuracy"] for r in resumed["epochs"]] == [
        r["test_accuracy"] for r in reference["epochs"]]
    if comm.rank == 0:
        print(f"OK resume: bit-identical, accuracy {resumed['final_accuracy']:.4f}, "
              f"fallbacks {resumed['fallbacks']}", flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
