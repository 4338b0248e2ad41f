"""PacTrain inside Hugging Face Accelerate and the Transformers ``Trainer``, on 2 ranks under
torchrun (CPU, gloo); each scenario of tests/mpi_scripts/huggingface_scenarios.py is reported on
its own, one launch runs them all (the imports alone cost seconds per rank).

accelerate lossless: the hooked model's reduced gradients and weights equal DDP's default
all-reduce of masked gradients bit for bit at every step (AdamW with weight decay). ternary:
lowers a held-out loss. Both: packed all-reduces happened, pruned weights stay exactly 0, ranks
end identical. kwargs route: ``DistributedDataParallelKwargs(comm_hook=<callable>)`` registers
nothing (DDP still takes our hook; a second one is refused). trainer: ``PacTrainCallback`` gives
the same checks through ``Trainer.train()``, lossless equal to a Trainer with the default
all-reduce of masked gradients; without it the pruned weights drift. snippets: the docs page's
two scripts as written, with the same checks on their objects.
"""
from types import SimpleNamespace

import pytest

from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_cases, shared_launches

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

MODULE = "huggingface_scenarios.py"


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario waits for the whole launch
@pytest.mark.parametrize("ranks, scenario",
                         scenario_cases(MODULE, shared_launches(MODULE, "torchrun")))
def test_huggingface_scenario(ranks, scenario):
    run_scenarios(MODULE, ranks, "torchrun").check(scenario)


# ------------------------------------------------------------------ the callback in one process
def begin_training(wrapped, callback=True):
    """A pruned linear layer that a stand-in Trainer wrapped with ``wrapped(layer)``, after
    ``on_train_begin`` (unless not ``callback``) and one SGD step on all-ones gradients."""
    from pacmpi.adapters.ddp import PacTrainHookState
    from pacmpi.adapters.huggingface import PacTrainCallback
    from pacmpi.adapters.pruning import prune

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    masks = prune(layer, 0.5)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5, momentum=0.9)
    trainer = SimpleNamespace(model=layer, model_wrapped=wrapped(layer))
    added = PacTrainCallback(trainer, PacTrainHookState(layer, masks)) if callback else None
    if added:
        added.on_train_begin(None, None, None, optimizer=optimizer)
    layer(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return layer, masks["weight"], added


def test_a_world_of_one_only_enforces_the_masks():
    layer, keep, callback = begin_training(lambda layer: layer)
    assert callback.state.engine is None  # no DDP: the hook never ran, the state never bound
    assert layer.weight[~keep].eq(0).all() and layer.weight[keep].ne(0).all()
    layer, keep, _ = begin_training(lambda layer: layer, callback=False)  # negative control
    assert layer.weight[~keep].ne(0).any()


def test_other_wrappers_are_refused():
    with pytest.raises(TypeError, match="wrapped the model in a DataParallel"):
        begin_training(torch.nn.DataParallel)
