"""``pacmpi.experiments.train`` with the all-gather baselines, error feedback off and the bias
probe, one short epoch each on a small CNN under mpirun: every rank runs these tests in this
order (tests/test_train.py), and each is reported on its own.

- terngrad, dgc: train to a sane accuracy, identical final models on every rank, fewer bytes
  than a dense all-reduce;
- --bias-probe: lossless PacTrain's averaged gradient is the exact average up to float32
  rounding (the negative control), ternary without error feedback is off by its noise;
- --no-error-feedback reaches the engine: the final model differs from the default's.

The pretrained model cache is in $PACMPI_TEST_WORKDIR.
"""
import os

from mpi4py import MPI

from pacmpi.experiments.train import run

comm = MPI.COMM_WORLD
WORKDIR = os.environ["PACMPI_TEST_WORKDIR"]
BASE = {"width": 8, "hidden": "32", "pretrained": os.path.join(WORKDIR, "pre.pt"),
        "pretrain_epochs": 3, "epochs": 1, "progress": False, "lr": 0.02, "ratio": 0.5}
NOISY = []  # the ternary run without error feedback, kept by the bias probe test


def same_everywhere(result):
    digests = comm.allgather(result["state_sha256"])
    assert len(set(digests)) == 1, digests
    return digests[0]


def check_baseline(method):
    result = run(dict(BASE, method=method, topk_ratio=0.01))
    same_everywhere(result)
    assert result["final_accuracy"] > 0.85, (method, result["final_accuracy"])
    summary = result["summary"]
    assert summary["bytes_per_step"] < 0.1 * summary["dense_bytes_per_step"], summary


def test_terngrad():
    check_baseline("terngrad")


def test_dgc():
    check_baseline("dgc")


def test_bias_probe():
    lossless = run(dict(BASE, method="pactrain", bias_probe=True))["bias"]
    assert lossless["steps"] > 0 and lossless["kept_coordinates"] > 0, lossless
    assert lossless["median_relative_error"] < 1e-6, lossless
    assert lossless["bias_p99_abs"] < 1e-6 * lossless["median_mean_abs_exact"] + 1e-12, lossless
    noisy = run(dict(BASE, method="pactrain-ternary", bias_probe=True, error_feedback=False))
    NOISY.append(noisy)
    bias = noisy["bias"]
    assert bias["steps"] == len(noisy["steps"]) == len(bias["per_step"]), bias["steps"]
    assert bias["median_relative_error"] > 0.05, bias
    assert bias["median_p99_abs_error"] >= bias["median_mean_abs_error"] > 0, bias


def test_error_feedback_off():
    """The ternary run without error feedback (test_bias_probe's; run here if that test failed
    before it) ends with another model than the default run with error feedback."""
    if not NOISY:
        NOISY.append(run(dict(BASE, method="pactrain-ternary", bias_probe=True,
                              error_feedback=False)))
    with_ef = same_everywhere(run(dict(BASE, method="pactrain-ternary")))
    assert with_ef != same_everywhere(NOISY[0]), "--no-error-feedback changed nothing"
