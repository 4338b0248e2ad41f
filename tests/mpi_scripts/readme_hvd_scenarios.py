"""The README's Horovod snippet, run verbatim on every rank under mpirun (tests/test_readme.py,
in the shared Horovod launches of tests/mpi_util.py): it gets ``model``, ``masks`` and
``optimizer`` (the same magnitude masks on every rank) and wraps the optimizer; 3 steps with it
leave the ranks' weights identical, the pruned weights as they were (their gradients come back
0) and some tensors packed."""
import horovod.torch as hvd
import torch

from doc_snippets import snippet
from readme_scenarios import pruned_model, train_three_steps


def test_horovod():
    model, masks = pruned_model()
    names = dict(model=model, masks=masks, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    exec(snippet("horovod"), names)
    train_three_steps(model, masks, names["optimizer"], hvd.rank(), hvd.size(),
                      hvd.allgather_object)
    assert names["compression"].stats["packed_reductions"] > 0, names["compression"].stats
