"""Worker: ``pacmpi.experiments.train`` with ``--backend horovod``, under ``horovodrun --gloo`` (no
MPI world) or ``mpirun``.

``train_hvd_job.py OUT PRETRAINED BACKEND:METHOD ...``: one short fine-tuning per entry (in the
order given; ``BACKEND`` is ``horovod`` or ``mpi``), each through :func:`fine_tune` on the
transport of its backend. Checks, per entry: every rank ends with the same weights (digests
all-gathered), the run really trained (weights differ from the pruned pretrained model), and
every weight the rank-0 pruning removed is exactly zero. Rank 0 saves the final ``state_dict``
to ``OUT/<backend>-<method>.pt`` for the pytest side to compare backends, prints
``OK <backend> <method> <digest>``, and finally runs ``main()`` (the CLI) once with ``--json``.

A failing check raises on its rank (non-zero exit).
"""
import os
import sys

import torch

from pacmpi.adapters.pruning import prune
from pacmpi.experiments.models import build_model
from pacmpi.experiments.train import collectives_for, fine_tune, main

out, pretrained, entries = sys.argv[1], sys.argv[2], sys.argv[3:]
RATIO = 0.5
BASE = {"width": 8, "hidden": "32", "pretrained": pretrained, "pretrain_epochs": 3,
        "epochs": 1, "max_steps": 8, "ratio": RATIO, "lr": 0.02, "progress": False}


def reference_masks():
    """The masks rank 0 decides: magnitude pruning of the cached pretrained model."""
    model = build_model("digits_cnn", width=8, hidden=32)
    model.load_state_dict(torch.load(pretrained, map_location="cpu", weights_only=False)["state"])
    return model, prune(model, RATIO)


for entry in entries:
    backend, method = entry.split(":")
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
        torch.save(model.state_dict(), os.path.join(out, f"{backend}-{method}.pt"))
        print(f"OK {backend} {method} {result['state_sha256']}", flush=True)

backend = entries[0].split(":")[0]
main(["--backend", backend, "--method", "pactrain", "--width", "8", "--hidden", "32",
      "--pretrained", pretrained, "--pretrain-epochs", "3", "--epochs", "1", "--max-steps", "4",
      "--no-progress", "--json", os.path.join(out, "cli.json")])
