"""PacTrain in PyTorch Lightning under ``torchrun`` (gloo, CPU): every rank runs these tests in
this order (tests/test_lightning.py). Lightning starts the process group in the first
``Trainer.fit``; the state of the first scenario is built before that, at import.

The oracle of a lossless run is the same Lightning run without the hook, its all-reduced
gradients masked afterwards (``on_after_backward``): masking commutes with the sum, and on 2
ranks a sum of two floats does not depend on order, so the two must agree bit for bit. A resumed
run must equal the uninterrupted one bit for bit (lossless and ternary).
"""
import hashlib
import os
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook
from pacmpi.adapters.lightning import PacTrainCallback

WORKDIR = Path(os.environ["PACMPI_TEST_WORKDIR"])
SIZE = int(os.environ["WORLD_SIZE"])
MASK = torch.rand(4, 30, generator=torch.Generator().manual_seed(1)) < 0.5
TEACHER = torch.randn(4, 30, generator=torch.Generator().manual_seed(2)) * MASK
torch.set_num_threads(1)


class Fit(L.LightningModule):
    """A pruned least-squares fit; ``reference``: mask the all-reduced gradients afterwards."""

    def __init__(self, reference=False):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(30, 4)
        with torch.no_grad():
            self.layer.weight.mul_(MASK)
        self.reference, self.losses = reference, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.layer(x) - y) ** 2).mean()
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self):
        if self.reference:
            self.layer.weight.grad.masked_fill_(~MASK, 0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)

    def train_dataloader(self):  # this rank's 4 batches, the same in every epoch
        x = torch.randn(64, 30, generator=torch.Generator().manual_seed(100 + self.global_rank))
        return DataLoader(TensorDataset(x, x @ TEACHER.T), batch_size=16)


def masks():
    return {"layer.weight": MASK}


def fit(model, state=None, callback=True, epochs=2, checkpoints=None, ckpt_path=None):
    """``trainer.fit`` with the hook (``state``) or DDP's all-reduce; ``checkpoints``: a folder
    for a ModelCheckpoint of each epoch's end, ``pac.ckpt``."""
    hook = dict(ddp_comm_state=state, ddp_comm_hook=pactrain_hook) if state else {}
    callbacks = [PacTrainCallback(state)] if state and callback else []
    if checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, filename="pac"))
    trainer = L.Trainer(strategy=DDPStrategy(**hook), accelerator="cpu", devices=SIZE,
                        max_epochs=epochs, callbacks=callbacks, logger=False,
                        enable_checkpointing=bool(checkpoints), enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        default_root_dir=WORKDIR)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_pruned_and_identical(model):
    assert torch.all(model.layer.weight[~MASK] == 0), "a pruned weight is not 0"
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    digests = [None] * SIZE
    dist.all_gather_object(digests, digest)
    assert len(set(digests)) == 1, "ranks ended with different weights"


assert not dist.is_initialized()
EARLY_MODEL = Fit()
EARLY_STATE = PacTrainHookState(EARLY_MODEL, masks())  # before init_process_group


# ---------------------------------------------------------------------------------- scenarios
def test_lossless():
    """A state built before the process group trains as DDP's all-reduce of masked grads."""
    trainer = fit(EARLY_MODEL, EARLY_STATE)
    assert EARLY_STATE.step == trainer.global_step == 8, (EARLY_STATE.step, trainer.global_step)
    assert EARLY_STATE.stats["packed_reductions"] > 0, EARLY_STATE.stats
    reference = Fit(reference=True)
    fit(reference)
    for got, want in zip(weights(EARLY_MODEL), weights(reference), strict=True):
        assert torch.equal(got, want), "the hooked run differs from DDP on masked gradients"
    assert_pruned_and_identical(EARLY_MODEL)


def test_ternary():
    """Ternary lowers the loss, sends under half the dense bytes; pruned weights stay 0."""
    model = Fit()
    state = PacTrainHookState(model, masks(), quantize="ternary")
    fit(model, state, epochs=8)
    assert model.losses[-1] < 0.1 * model.losses[0], model.losses
    stats = state.stats
    assert stats["bytes_sent"] < stats["dense_bytes_equivalent"] / 2, stats
    assert_pruned_and_identical(model)


def test_without_callback():
    """Negative control: on CPU Lightning drops ddp_comm_hook, so without the callback the
    hook never runs and DDP's all-reduce of unmasked gradients revives pruned weights."""
    model = Fit()
    state = PacTrainHookState(model, masks())
    fit(model, state, callback=False)
    assert state.step == 0, state.step
    assert torch.any(model.layer.weight[~MASK] != 0)


def test_resume():
    """ModelCheckpoint after epoch 1 of 2, then ``fit(ckpt_path=)``: the resumed run equals the
    uninterrupted one bit for bit (lossless and ternary); for ternary, a checkpoint without
    pacmpi's state (residuals, step, RNG key) resumes to other weights."""
    for quantize in (None, "ternary"):
        whole = Fit()
        fit(whole, PacTrainHookState(whole, masks(), quantize=quantize,
                                     error_feedback=quantize is not None))
        folder = WORKDIR / f"resume-{quantize}"
        first = Fit()
        fit(first, PacTrainHookState(first, masks(), quantize=quantize,
                                     error_feedback=quantize is not None), epochs=1,
            checkpoints=folder)
        saved = torch.load(folder / "pac.ckpt", weights_only=True)  # Lightning's default load
        pac = saved["callbacks"]["PacTrainCallback"]
        assert pac["step"] == 4 and len(pac["residuals"]) == SIZE, pac
        assert all(len(mine) == (2 if quantize else 0) for mine in pac["residuals"]), pac
        resumed = Fit()
        state = PacTrainHookState(resumed, masks(), quantize=quantize,
                                  error_feedback=quantize is not None)
        fit(resumed, state, ckpt_path=folder / "pac.ckpt")
        assert state.step == 8 and state.stats["steps"] == 8, state.stats
        for got, want in zip(weights(resumed), weights(whole), strict=True):
            assert torch.equal(got, want), f"{quantize}: the resumed run differs"
        assert_pruned_and_identical(resumed)
    del saved["callbacks"]["PacTrainCallback"]
    if dist.get_rank() == 0:
        torch.save(saved, folder / "bare.ckpt")
    dist.barrier()
    bare = Fit()
    fit(bare, PacTrainHookState(bare, masks(), quantize="ternary", error_feedback=True),
        ckpt_path=folder / "bare.ckpt")
    assert not all(map(torch.equal, weights(bare), weights(whole)))



def test_resume_at_another_world_size():
    """test_resume's ternary checkpoint with a third rank's residuals added, as a 3-rank run
    would have written it: loaded here, every rank starts from the mean of the three (the rule
    of pacmpi.adapters.checkpoint) and says so; at this world size each keeps its own."""
    saved = torch.load(WORKDIR / "resume-ternary" / "pac.ckpt", weights_only=True)
    pac = saved["callbacks"]["PacTrainCallback"]
    old = [*pac["residuals"], {name: 3 * r for name, r in pac["residuals"][0].items()}]
    for ranks, want in ((old, {name: ((old[0][name].double() + old[1][name].double()
                                       + old[2][name].double()) / 3).float() for name in old[0]}),
                        (pac["residuals"], pac["residuals"][dist.get_rank()])):
        state = PacTrainHookState(Fit(), masks(), quantize="ternary", error_feedback=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PacTrainCallback(state).load_state_dict(dict(pac, residuals=ranks))
        said = [str(w.message) for w in caught if "world size" in str(w.message)]
        assert len(said) == (len(ranks) != SIZE), said
        got = state.state_dict()["residuals"]
        assert want and got.keys() == want.keys(), (got.keys(), want.keys())
        for name, values in want.items():
            assert np.array_equal(got[name], values.numpy()), name
        assert state.step == pac["step"]
