"""PacTrain's DDP hook inside Hugging Face Accelerate and the Transformers ``Trainer`` on 2 ranks
under ``torchrun`` (CPU, gloo), with a tiny BERT randomly initialised from a fixed seed and
synthetic tokens; every rank runs these tests in this order (tests/test_huggingface.py).

On 2 ranks a sum of two float32 values does not depend on order and halving is exact, so the
lossless hook must equal DDP's default all-reduce of masked gradients bit for bit. The docs
page's two scripts run here as written (docs/trainers/huggingface.md), sharing this launch.
"""
import hashlib
import os
import tempfile

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook
from pacmpi.adapters.huggingface import PacTrainCallback
from pacmpi.adapters.pruning import MaskEnforcer, prune

from doc_snippets import snippet

torch.set_num_threads(1)
ACCELERATOR = Accelerator(cpu=True)  # starts the gloo process group from torchrun's env
SIZE = dist.get_world_size()
VOCAB, LENGTH = 32, 8


def pruned_bert(ratio=0.7):
    """A tiny BERT classifier, the same on every rank, magnitude-pruned: (model, masks)."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))  # no dropout: runs compare
    return model, prune(model, ratio)


def tokens(count, seed):
    """``count`` synthetic sequences and learnable labels (is the first token in the low half)."""
    ids = torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(seed))
    return ids, (ids[:, 0] < VOCAB // 2).long()


def held_out_loss(model):
    ids, labels = tokens(64, seed=99)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels).loss)


def assert_pruned_zero_and_ranks_identical(model, masks):
    params = dict(model.named_parameters())
    for name, keep in masks.items():
        assert torch.all(params[name].detach()[~keep] == 0), f"pruned weight of {name} moved"
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    digests = [None] * SIZE
    dist.all_gather_object(digests, digest)
    assert len(set(digests)) == 1, f"ranks differ: {digests}"


# ------------------------------------------------------------------ Accelerate
def accelerate_run(hook, steps=4, **options):
    """Train a pruned BERT with ``Accelerator.prepare``: with the PacTrain hook (``hook``) or
    DDP's default all-reduce, its result masked afterwards (the reference). Returns the model,
    masks, each step's reduced gradients and the hook state (or None)."""
    model, masks = pruned_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    enforcer = MaskEnforcer(model, masks)
    enforcer.attach(optimizer)  # decoupled weight decay and Adam state keep pruned weights 0
    ids, labels = tokens(8 * SIZE * steps, seed=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels),
                                         batch_size=8)
    ddp, optimizer, loader = ACCELERATOR.prepare(model, optimizer, loader)
    state = PacTrainHookState(ddp, masks, **options) if hook else None
    if hook:
        ddp.register_comm_hook(state, pactrain_hook)
    grads = []
    for x, y in loader:
        ACCELERATOR.backward(ddp(input_ids=x, labels=y).loss)
        if not hook:
            enforcer.apply_to_grads()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    assert len(grads) == steps
    return model, masks, grads, state


def test_accelerate_lossless_equals_default_allreduce_of_masked_grads():
    model, masks, grads, state = accelerate_run(hook=True)
    reference, _, expected, _ = accelerate_run(hook=False)
    for step, (got, want) in enumerate(zip(grads, expected)):
        for param, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {step}, parameter {param}: reduced gradients differ"
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert state.stats["packed_reductions"] > 0 and state.step == 4
    assert_pruned_zero_and_ranks_identical(model, masks)


def test_accelerate_ternary_trains():
    before = held_out_loss(pruned_bert()[0])
    model, masks, _, state = accelerate_run(hook=True, steps=12, quantize="ternary")
    assert held_out_loss(model) < before
    assert state.stats["packed_reductions"] > 0 and state.step == 12
    assert_pruned_zero_and_ranks_identical(model, masks)


def test_accelerate_kwargs_route_ignores_a_custom_hook():
    """``DistributedDataParallelKwargs(comm_hook=...)`` takes only its built-in hook names; a
    callable passes construction and registers nothing (so register the hook by hand)."""
    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        DistributedDataParallelKwargs(comm_hook=pactrain_hook)])
    model, masks = pruned_bert()
    ddp = accelerator.prepare(model)
    state = PacTrainHookState(ddp, masks)
    ddp.register_comm_hook(state, pactrain_hook)  # DDP takes one hook: none was registered
    try:  # negative control: a second registration is refused
        ddp.register_comm_hook(state, pactrain_hook)
    except RuntimeError as exc:
        assert "only be called once" in str(exc), exc
    else:
        raise AssertionError("DDP accepted a second comm hook")


# ------------------------------------------------------------------ Transformers Trainer
class MaskedReference(TrainerCallback):
    """DDP's default all-reduce, then the masks on the reduced gradients (the reference)."""

    def __init__(self, trainer, masks):
        self.trainer, self.masks = trainer, masks

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.enforcer = MaskEnforcer(self.trainer.model, self.masks)
        self.enforcer.attach(optimizer.optimizer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.enforcer.apply_to_grads()


OUT = tempfile.TemporaryDirectory()  # the Trainers' output_dir (they save nothing there)


def pactrain(**options):
    """``PacTrainCallback`` with a ``PacTrainHookState(options)``, for :func:`trainer_run`."""
    return lambda trainer, masks: PacTrainCallback(
        trainer, PacTrainHookState(trainer.model, masks, **options))


def trainer_run(callback, steps=4, **arguments):
    """Train a pruned BERT with a Trainer and ``callback(trainer, masks)`` (None: none);
    returns the Trainer, masks and the callback."""
    model, masks = pruned_bert()
    ids, labels = tokens(8 * SIZE * steps, seed=1)
    data = [{"input_ids": x, "labels": y} for x, y in zip(ids, labels)]
    args = TrainingArguments(
        OUT.name, use_cpu=True, ddp_backend="gloo", max_steps=steps, learning_rate=1e-2,
        per_device_train_batch_size=8, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True, ddp_find_unused_parameters=False, **arguments)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    added = callback(trainer, masks) if callback else None
    if added:
        trainer.add_callback(added)
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    return trainer, masks, added


def test_trainer_lossless_equals_default_allreduce_of_masked_grads():
    # max_grad_norm=0: the Trainer clips before any event a reference could mask the grads in
    trainer, masks, callback = trainer_run(pactrain(), max_grad_norm=0.0)
    reference, _, _ = trainer_run(MaskedReference, max_grad_norm=0.0)
    model = trainer.model
    for a, b in zip(model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)
    assert callback.state.stats["packed_reductions"] > 0 and callback.state.step == 4
    assert_pruned_zero_and_ranks_identical(model, masks)


def test_trainer_ternary_trains():
    before = held_out_loss(pruned_bert()[0])
    trainer, masks, callback = trainer_run(pactrain(quantize="ternary"), steps=12)
    model = trainer.model
    assert held_out_loss(model) < before
    assert callback.state.stats["packed_reductions"] > 0 and callback.state.step == 12
    assert_pruned_zero_and_ranks_identical(model, masks)


def test_trainer_trains_again_on_the_hooked_model():
    """A second ``train()`` re-uses the DDP model the hook is on (DDP takes one hook)."""
    trainer, masks, callback = trainer_run(pactrain(), steps=2)
    hooked = trainer.model_wrapped
    trainer.train()
    assert trainer.model_wrapped is hooked and callback.state.step == 4
    assert_pruned_zero_and_ranks_identical(trainer.model, masks)


def test_trainer_without_the_callback_pruned_weights_drift():
    trainer, masks, _ = trainer_run(None)
    params = dict(trainer.model.named_parameters())
    assert any(torch.any(params[name].detach()[~keep] != 0) for name, keep in masks.items())


# ------------------------------------------------------------------ the docs page's scripts
def run_snippet(name):
    """Run the docs page's script ``name`` on this rank from a scratch directory (the Trainer
    writes its output folder there); returns the script's globals."""
    namespace, cwd = {"__name__": "__main__"}, os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            exec(snippet(name), namespace)
        finally:
            os.chdir(cwd)
    return namespace


def test_accelerate_snippet():
    script = run_snippet("accelerate")
    assert script["state"].stats["packed_reductions"] > 0 and script["state"].step == 8
    assert_pruned_zero_and_ranks_identical(script["model"].module, script["masks"])


def test_trainer_snippet():
    script = run_snippet("hf-trainer")
    state = script["state"]
    assert state.stats["packed_reductions"] > 0 and state.step == 8
    assert_pruned_zero_and_ranks_identical(script["model"], script["masks"])
