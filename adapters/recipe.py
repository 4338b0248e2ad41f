"""Gradual pruning of a pretrained transformer: which weights go, how fast, and when the mask moves.

One-shot pruning of an already fine-tuned transformer collapses at high sparsity (oBERT's
table: SQuAD F1 88.5 dense, 57.5 one-shot at 80%), while the recipes that keep its accuracy at
80% (gradual magnitude pruning, oBERT, movement pruning, "sparse transfer") share three choices,
which this module makes the defaults:

1. **What** (:func:`linear_weights`): the weight matrices of the linear layers (attention
   projections and feed-forward). Embeddings, norms, biases and classification or pooling heads
   stay dense: on MiniLM the word embeddings alone are half of the model, and a token's row
   that is pruned is lost to every sentence that uses it.
2. **How fast** (:func:`cubic_milestones`): the cubic schedule of Zhu & Gupta (2017),
   ``s_t = s_f + (s_i - s_f) (1 - t/T)^3``: large steps while the network has redundancy to
   spare, small ones near the end.
3. **When**: the mask moves every ``every`` steps during the first ``steps`` steps and is fixed
   afterwards. Each move is one :func:`~pacmpi.adapters.pruning.prune` with the previous masks
   as ``current_masks``, decided on rank 0 and broadcast (pass ``comm=`` or ``collectives=`` to
   :meth:`~pacmpi.adapters.pruning.GradualPruningSchedule.step`), so masks only grow sparser
   and are bit-identical on every rank.

While a mask moves PacTrain's mask tracker sends dense (``stable_steps`` steps after each move)
and verifies that every rank holds the same new mask; ``sync.stats["dense_fallbacks"]`` counts
what the schedule cost. One-shot pruning stays :func:`~pacmpi.adapters.pruning.prune` itself.

Example (a raw loop; ``enforcer`` a :class:`~pacmpi.adapters.pruning.MaskEnforcer` and
``sync`` a :class:`~pacmpi.adapters.torch_sync.PacTrainSync` built with all-True masks)::

    schedule = gradual_schedule(model, final=0.8, steps=200, every=10)
    for step, (x, y) in enumerate(batches):
        new = schedule.step(model, step, comm=comm)   # collective: every rank, every step
        if new is not None:
            enforcer.update(new)                      # pruned weights and optimizer state to 0
            sync.set_masks(new)                       # dense until the new mask is stable
        ...
"""
from __future__ import annotations

import numbers
from typing import Iterable

from torch import nn

from pacmpi.adapters.pruning import GradualPruningSchedule, Selector, check_ratio

__all__ = ["HEADS", "cubic_milestones", "gradual_schedule", "linear_weights"]

#: Module names whose linear layers are heads, kept dense by :func:`linear_weights`: BERT's
#: pooler and pre-training heads (``cls``), sequence/token classifiers, language-model heads,
#: question answering and reward/score heads (the names transformers gives them).
HEADS = ("pooler", "classifier", "cls", "lm_head", "qa_outputs", "score")


def _is_linear(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2) is a linear layer with its weight transposed; matched by name
    # so that this module does not import transformers.
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def linear_weights(model: nn.Module, *, heads: Iterable[str] = HEADS) -> list[str]:
    """Names of the weight matrices of ``model``'s linear layers (``nn.Linear`` and
    transformers' ``Conv1D``), in ``named_modules()`` order, leaving out every layer inside a
    module named one of ``heads`` (any part of its dotted name). Use it as ``prune``'s
    ``include=``; the names are the logical ones (``"layer.0.fc.weight"`` also for a layer that
    ``torch.nn.utils.prune`` reparametrized)."""
    heads = frozenset(heads)
    names = [f"{name}.weight" for name, module in model.named_modules()
             if name and _is_linear(module) and not heads.intersection(name.split("."))]
    if not names:
        raise ValueError(f"{type(model).__name__} has no linear layer outside the heads "
                         f"{sorted(heads)}: nothing for the recipe to prune")
    return names


def _check_count(value, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return int(value)


def cubic_milestones(final: float, steps: int, every: int, *, initial: float = 0.0,
                     start: int = 0) -> list[tuple[int, float]]:
    """``[(step, ratio), ...]`` for :class:`~pacmpi.adapters.pruning.GradualPruningSchedule`:
    the pruning ratio (fraction removed) of the cubic schedule at ``start + t`` for
    ``t = 0, every, 2 every, ...`` below ``steps`` and at ``t = steps`` itself, where it is
    ``final`` exactly. Milestones that would not prune more than the one before (a ratio of 0 at
    the start, repeats) are left out. Ratios are in [0, 1) with ``initial <= final``; ``steps``
    and ``every`` are positive step counts, ``start`` the step of the first milestone."""
    final, initial = check_ratio(final, "final ratio"), check_ratio(initial, "initial ratio")
    if final < initial:
        raise ValueError(f"the final ratio {final!r} is below the initial ratio {initial!r}: "
                         "a pruning schedule only removes weights")
    steps = _check_count(steps, "steps", 1)
    every = _check_count(every, "every", 1)
    start = _check_count(start, "start", 0)
    milestones, last = [], 0.0
    for t in [*range(0, steps, every), steps]:
        # The ends exactly: the formula's rounding would miss s_i or s_f by an ulp.
        ratio = (initial if t == 0 else final if t == steps
                 else final + (initial - final) * (1.0 - t / steps) ** 3)
        if ratio > last:
            milestones.append((start + t, ratio))
            last = ratio
    if not milestones:
        raise ValueError(f"a final ratio of {final!r} prunes nothing: give one in (0, 1)")
    return milestones


def gradual_schedule(model: nn.Module, final: float, steps: int, every: int, *,
                     initial: float = 0.0, start: int = 0, method: str = "magnitude",
                     include: Selector = None, exclude: Selector = None,
                     scope: str = "global", **criterion) -> GradualPruningSchedule:
    """The recipe as one schedule: :func:`cubic_milestones` over ``include`` (default
    :func:`linear_weights` of ``model``), pruned by ``method`` (``"magnitude"``, or
    ``"taylor"``/``"grasp"`` with ``data=`` at every :meth:`step`) over the selection as a
    whole (``scope="global"``) or per tensor. ``criterion`` takes ``grasp_batches`` and
    ``grasp_temperature``. Call its ``step(model, step, comm=...)`` on every rank at every step;
    it returns the new masks at a milestone, else None."""
    milestones = cubic_milestones(final, steps, every, initial=initial, start=start)
    if include is None:
        include = linear_weights(model)
    return GradualPruningSchedule(milestones, method, scope, include, exclude, **criterion)
