"""``pacmpi.experiments.train`` with ``--backend horovod``, under ``horovodrun --gloo`` (no MPI
world) or ``mpirun``: every rank runs these tests in this order (tests/test_train_horovod.py),
and each is reported on its own; a launch runs the ones the outer test names.

Each ``test_<backend>_<method>`` is one short fine-tuning through :func:`fine_tune` on the
transport of its backend. Checks: every rank ends with the same weights (digests all-gathered),
the run really trained (weights differ from the pruned pretrained model), and every weight the
rank-0 pruning removed is exactly zero. Rank 0 saves the final ``state_dict`` to
``$PACMPI_TEST_WORKDIR/<backend>-<method>.pt`` for the outer test to compare backends.
``test_cli`` runs ``main()`` (the CLI) once with ``--backend horovod --json``.

The pretrained model is cached at $PACMPI_TEST_PRETRAINED (shared by the launches).
"""
import json
import os

import torch

from pacmpi.adapters.pruning import prune
from pacmpi.experiments.models import build_model
from pacmpi.experiments.train import collectives_for, fine_tune, main

OUT = os.environ["PACMPI_TEST_WORKDIR"]
PRETRAINED = os.environ["PACMPI_TEST_PRETRAINED"]
RATIO = 0.5
BASE = {"width": 8, "hidden": "32", "pretrained": PRETRAINED, "pretrain_epochs": 3,
        "epochs": 1, "max_steps": 8, "ratio": RATIO, "lr": 0.02, "progress": False}


def reference_masks():
    """The masks rank 0 decides: magnitude pruning of the cached pretrained model."""
    model = build_model("digits_cnn", width=8, hidden=32)
    model.load_state_dict(torch.load(PRETRAINED, map_location="cpu", weights_only=False)["state"])
    return model, prune(model, RATIO)


def check_entry(backend, method):
    entry = f"{backend}:{method}"
    collectives = collectives_for(backend)
    model, result = fine_tune(dict(BASE, backend=backend, method=method), collectives)
    digests = collectives.allgather_object(result["state_sha256"])
    assert len(set(digests)) == 1, (entry, digests)
    assert result["world_size"] == collectives.size == 2, result["world_size"]
    assert len(result["steps"]) == BASE["max_steps"], len(result["steps"])
    pruned_pretrained, masks = reference_masks()
    final = dict(model.named_parameters())
    assert any(not torch.equal(final[name], p) for name, p in pruned_pretrained.named_parameters())
    for name, keep in masks.items():
        assert int(keep.sum()) < keep.numel(), name  # the zero check below has something to check
        assert torch.count_nonzero(final[name].detach()[~keep]) == 0, (entry, name)
    assert abs(result["density"] - (1 - RATIO)) < 1e-3, result["density"]
    if collectives.rank == 0:
        torch.save(model.state_dict(), os.path.join(OUT, f"{backend}-{method}.pt"))


def test_horovod_pactrain():
    check_entry("horovod", "pactrain")


def test_horovod_pactrain_ternary():
    check_entry("horovod", "pactrain-ternary")


def test_horovod_fp16():
    check_entry("horovod", "fp16")


def test_horovod_dense():
    check_entry("horovod", "dense")


def test_mpi_pactrain():
    check_entry("mpi", "pactrain")


def test_cli(capsys):
    """``pacmpi train --backend horovod`` prints its summary on rank 0 only, and rank 0 writes
    the ``--json`` of a 2-rank job of 4 steps."""
    out = os.path.join(OUT, "cli.json")
    assert main(["--backend", "horovod", "--method", "pactrain", "--width", "8", "--hidden",
                 "32", "--pretrained", PRETRAINED, "--pretrain-epochs", "3", "--epochs", "1",
                 "--max-steps", "4", "--no-progress", "--json", out]) == 0
    rank = collectives_for("horovod").rank
    printed = capsys.readouterr().out
    assert printed.count("pacmpi train:") == (1 if rank == 0 else 0), printed
    if rank == 0:  # the rank that wrote it
        with open(out) as f:
            written = json.load(f)
        assert written["world_size"] == 2 and written["config"]["backend"] == "horovod"
        assert len(written["steps"]) == 4
