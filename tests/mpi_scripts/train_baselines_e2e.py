"""MPI worker: ``pacmpi.experiments.train`` with the all-gather baselines, error feedback off and
the bias probe, one short epoch each on a small CNN (``train_baselines_e2e.py DIR``).

- terngrad, dgc: train to a sane accuracy, identical final models on every rank, fewer bytes
  than a dense all-reduce;
- --bias-probe: lossless PacTrain's averaged gradient is the exact average up to float32
  rounding (the negative control), ternary without error feedback is off by its noise;
- --no-error-feedback reaches the engine: the final model differs from the default's.

Rank 0 prints ``OK ...``; a failure raises on the failing rank (non-zero exit).
"""
import os
import sys

from mpi4py import MPI

from pacmpi.experiments.train import run

comm = MPI.COMM_WORLD
directory = sys.argv[1]
BASE = {"width": 8, "hidden": "32", "pretrained": os.path.join(directory, "pre.pt"),
        "pretrain_epochs": 3, "epochs": 1, "progress": False, "lr": 0.02, "ratio": 0.5}


def same_everywhere(result):
    digests = comm.allgather(result["state_sha256"])
    assert len(set(digests)) == 1, digests
    return digests[0]


for method in ("terngrad", "dgc"):
    result = run(dict(BASE, method=method, topk_ratio=0.01))
    same_everywhere(result)
    assert result["final_accuracy"] > 0.85, (method, result["final_accuracy"])
    summary = result["summary"]
    assert summary["bytes_per_step"] < 0.1 * summary["dense_bytes_per_step"], summary
    if comm.rank == 0:
        print(f"OK {method}: accuracy {result['final_accuracy']:.4f}", flush=True)

lossless = run(dict(BASE, method="pactrain", bias_probe=True))["bias"]
assert lossless["steps"] > 0 and lossless["kept_coordinates"] > 0, lossless
assert lossless["median_relative_error"] < 1e-6, lossless
assert lossless["bias_p99_abs"] < 1e-6 * lossless["median_mean_abs_exact"] + 1e-12, lossless
noisy = run(dict(BASE, method="pactrain-ternary", bias_probe=True, error_feedback=False))
bias = noisy["bias"]
assert bias["steps"] == len(noisy["steps"]) == len(bias["per_step"]), bias["steps"]
assert bias["median_relative_error"] > 0.05, bias
assert bias["median_p99_abs_error"] >= bias["median_mean_abs_error"] > 0, bias
if comm.rank == 0:
    print(f"OK bias probe: lossless {lossless['median_relative_error']:.2e}, ternary without "
          f"error feedback {bias['median_relative_error']:.3f}", flush=True)

with_ef = same_everywhere(run(dict(BASE, method="pactrain-ternary")))
assert with_ef != same_everywhere(noisy), "--no-error-feedback changed nothing"
if comm.rank == 0:
    print("OK error feedback off", flush=True)
