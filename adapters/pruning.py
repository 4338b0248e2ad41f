"""Unstructured pruning and gradient sparsity enforcement (GSE) for PacTrain.

PacTrain prunes a (pretrained) model once to a fixed sparsity mask, then enforces
``G = mask * G`` after every backward pass. Because every worker holds the *same* mask,
only the surviving gradient coordinates need to be all-reduced, packed densely.
This module provides the pieces that make that possible:

* :func:`prune` -- magnitude, GraSP or first-order Taylor pruning, global or per-layer,
  returning bool masks
  keyed by parameter name (``True`` = kept). With ``comm=`` the decision is taken on
  rank 0 and broadcast, so every rank ends with bit-identical masks (``collectives=``: the
  same over any :class:`pacmpi.Collectives`, e.g. Horovod's).
* :class:`GradualPruningSchedule` -- prune to increasing ratios at given steps; masks
  only ever become sparser.
* :class:`MaskEnforcer` -- masks gradients, weights and optimizer state so pruned
  weights stay exactly zero under SGD(momentum, weight decay), Adam and AdamW.
* :func:`masks_from_torch_prune` / :func:`named_prunable_parameters` -- interop with
  ``torch.nn.utils.prune``'s ``weight_orig``/``weight_mask`` reparametrization.

Naming: masks are keyed by the *logical* parameter name (``"fc.weight"``), also for a
module reparametrized by ``torch.nn.utils.prune``; that name is resolved to the leaf
Parameter that actually receives ``.grad`` (``fc.weight_orig``).

Tie breaking: weights are ranked by a removal priority and sorted with
``torch.argsort(..., descending=True, stable=True)`` on the flattened scores (in
``named_parameters()`` order for global scope), so among equal scores the coordinate with
the lower flat index is pruned first. Identical weights therefore give identical masks on
every rank and every run.
"""
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PRUNING_CRITERIA", "DensityReport", "GradualPruningSchedule", "MaskEnforcer",
           "masks_digest", "masks_from_torch_prune", "named_prunable_parameters", "prune"]

# prune(method=...): what decides which weights go; "grasp" and "taylor" need data.
PRUNING_CRITERIA = ("magnitude", "grasp", "taylor")
SCOPES = ("global", "layer")

#: Name selector: a glob (``fnmatch``), several globs, or ``callable(name, param) -> bool``.
Selector = Union[str, Iterable[str], Callable[[str, nn.Parameter], bool], None]

# Norm layers keep their (possibly >1-D) affine parameters dense by default.
_NORM_TYPES = tuple(
    t
    for t in (
        # torch's private base: the one class every BatchNorm*, SyncBatchNorm and InstanceNorm*
        # derives from (torch exports no public one), so new norm variants are covered too.
        nn.modules.batchnorm._NormBase,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)


# --------------------------------------------------------------------------------------
# Parameter discovery (incl. torch.nn.utils.prune reparametrization)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Slot:
    """One logical parameter: the leaf that gets ``.grad`` and, if reparametrized by
    ``torch.nn.utils.prune``, the module, attribute and ``<attr>_mask`` buffer."""

    param: nn.Parameter
    module: nn.Module
    attr: str
    torch_mask: Optional[torch.Tensor]

    def effective(self) -> torch.Tensor:
        """The weight the forward pass sees (``orig * mask`` when reparametrized)."""
        weight = self.param.detach()
        return weight if self.torch_mask is None else weight * self.torch_mask


def _slots(model: nn.Module) -> OrderedDict[str, _Slot]:
    """All parameters by logical name, in ``named_parameters()`` order."""
    slots: OrderedDict[str, _Slot] = OrderedDict()
    for name, param in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        torch_mask = None
        if attr.endswith("_orig"):
            base = attr[: -len("_orig")]
            # _buffers, not getattr: torch.nn.utils.prune keeps the mask as a buffer of that name,
            # and only the buffer table tells a buffer from a plain attribute (no public lookup).
            buffer = module._buffers.get(base + "_mask")
            if buffer is not None:
                attr, torch_mask = base, buffer
        logical = f"{module_name}.{attr}" if module_name else attr
        slots[logical] = _Slot(param, module, attr, torch_mask)
    return slots


def _matches(selector: Selector, name: str, param: nn.Parameter) -> bool:
    if callable(selector):
        return bool(selector(name, param))
    patterns = [selector] if isinstance(selector, str) else list(selector)
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _is_prunable_by_default(slot: _Slot) -> bool:
    # Biases and other 1-D params are tiny and sensitive; norm affines are per-channel.
    return slot.param.dim() > 1 and not isinstance(slot.module, _NORM_TYPES)


def _prunable_slots(
    model: nn.Module, include: Selector, exclude: Selector
) -> OrderedDict[str, _Slot]:
    selected: OrderedDict[str, _Slot] = OrderedDict()
    for name, slot in _slots(model).items():
        if include is None:
            chosen = _is_prunable_by_default(slot)
        else:
            chosen = _matches(include, name, slot.param)
        if chosen and not (exclude is not None and _matches(exclude, name, slot.param)):
            selected[name] = slot
    return selected


def named_prunable_parameters(
    model: nn.Module, include: Selector = None, exclude: Selector = None
) -> OrderedDict[str, nn.Parameter]:
    """Map logical names of prunable parameters to the leaf Parameter receiving ``.grad``.

    Default rule (``include=None``): every parameter with ``dim() > 1`` that does not
    belong to a norm layer (BatchNorm/InstanceNorm/LayerNorm/GroupNorm/LocalResponseNorm/
    RMSNorm), i.e. biases and norm affines are excluded. ``include`` *replaces* the
    default rule (so ``include="*.bias"`` does select biases); ``exclude`` is applied last.
    Both take a glob, a list of globs (matched with ``fnmatch.fnmatchcase`` against the
    logical name) or ``callable(name, param) -> bool``. For a module reparametrized by
    ``torch.nn.utils.prune`` the name is ``"fc.weight"`` and the value is ``fc.weight_orig``.
    """
    slots = _prunable_slots(model, include, exclude)
    return OrderedDict((name, slot.param) for name, slot in slots.items())


def masks_from_torch_prune(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """Bool masks of every ``torch.nn.utils.prune``-reparametrized parameter.

    The mask comes from the ``<name>_mask`` buffer (``<name>_orig`` is *not* zero at pruned
    coordinates), keyed by the original name (``"fc.weight"``); :class:`MaskEnforcer`
    resolves that name to the ``weight_orig`` Parameter, which is what receives gradients.
    """
    return OrderedDict(
        (name, slot.torch_mask.detach().to(device=slot.param.device, dtype=torch.bool, copy=True))
        for name, slot in _slots(model).items()
        if slot.torch_mask is not None
    )


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------
def check_ratio(ratio: float, what: str = "ratio") -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 <= ratio < 1.0:
        raise ValueError(f"{what} must be a number in [0, 1), got {ratio!r}")
    return float(ratio)


def _check_choice(what: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {choices}")


# --------------------------------------------------------------------------------------
# Scores. Convention: a larger *priority* means "remove first".
# --------------------------------------------------------------------------------------
def _magnitude_priorities(slots: Mapping[str, _Slot]) -> OrderedDict[str, torch.Tensor]:
    return OrderedDict((name, -slot.effective().abs().float()) for name, slot in slots.items())


def _loss(model, batch, loss_fn, temperature: float) -> torch.Tensor:
    x, y = batch
    return loss_fn(model(x) / temperature, y)


def _mean_gradient(model, params, batches, loss_fn, temperature) -> list:
    total = [torch.zeros_like(p) for p in params]
    for batch in batches:
        grads = torch.autograd.grad(_loss(model, batch, loss_fn, temperature), params,
                                    allow_unused=True)
        for acc, grad in zip(total, grads):
            if grad is not None:
                acc.add_(grad)
    return [acc / len(batches) for acc in total]


def _hessian_gradient_product(model, params, batches, loss_fn, temperature, g) -> list:
    """Mean over batches of ``H_b g`` via double backprop: ``d/dθ (∇L_b(θ) · g)``."""
    total = [torch.zeros_like(p) for p in params]
    for batch in batches:
        loss = _loss(model, batch, loss_fn, temperature)
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        terms = [(grad * const).sum() for grad, const in zip(grads, g) if grad is not None]
        z = sum(terms[1:], terms[0]) if terms else None
        if z is None or not z.requires_grad:
            continue  # the loss is at most linear in these weights: H g = 0
        for acc, hv in zip(total, torch.autograd.grad(z, params, allow_unused=True)):
            if hv is not None:
                acc.add_(hv)
    return [acc / len(batches) for acc in total]


def _grasp_priorities(
    model: nn.Module, slots: Mapping[str, _Slot], data, loss_fn, n_batches: int, temperature: float
) -> OrderedDict[str, torch.Tensor]:
    """GraSP score ``S(-θ) = -θ ⊙ H g`` (Wang, Zhang & Grosse, ICLR 2020, Eq. 8).

    Removing weight q is the perturbation δ = -θ_q e_q; to first order it changes the squared
    gradient norm ``gᵀg`` by ``2 δᵀ H g = 2 · (-θ ⊙ H g)_q``. A *high* score therefore means
    removing the weight preserves (or even increases) gradient flow, and -- as in the
    reference implementation (alecwangcq/GraSP, ``keep = score <= threshold``) -- the
    weights with the HIGHEST scores are removed. ``g`` and ``H g`` are means over the
    first ``n_batches`` batches, the model runs in eval mode (no BatchNorm running-stat
    updates, no dropout), and ``torch.autograd.grad`` is used so existing ``.grad`` fields
    are left untouched.
    """
    params = [slot.param for slot in slots.values()]
    with _scoring(model, params, data, n_batches, "grasp") as batches:
        g = _mean_gradient(model, params, batches, loss_fn, temperature)
        hg = _hessian_gradient_product(model, params, batches, loss_fn, temperature, g)
    return OrderedDict(
        (name, (-slot.effective() * h).float()) for (name, slot), h in zip(slots.items(), hg)
    )


def _taylor_priorities(
    model: nn.Module, slots: Mapping[str, _Slot], data, loss_fn, n_batches: int, temperature: float
) -> OrderedDict[str, torch.Tensor]:
    """First-order Taylor saliency ``|θ ⊙ g|`` (Molchanov et al., CVPR 2019; SNIP's connection
    sensitivity at initialization): to first order, how much the loss changes when the weight is
    removed. The weights with the LOWEST saliency go (priority ``-|θ ⊙ g|``). Unlike GraSP it
    keeps what a pretrained model relies on now, which is what fine-tuning wants; ``g`` is the
    mean over the first ``n_batches`` batches in eval mode, of the plain loss (no temperature)."""
    params = [slot.param for slot in slots.values()]
    with _scoring(model, params, data, n_batches, "taylor") as batches:
        g = _mean_gradient(model, params, batches, loss_fn, 1.0)
    return OrderedDict(
        (name, -(slot.effective() * gi).abs().float()) for (name, slot), gi in zip(slots.items(), g)
    )


@contextlib.contextmanager
def _scoring(model, params, data, n_batches, method):
    """The first ``n_batches`` batches on the parameters' device, with the model in eval mode
    (no BatchNorm running-stat updates, no dropout) for the duration."""
    device = params[0].device
    batches = [(x.to(device), y.to(device)) for x, y in islice(iter(data), n_batches)]
    if not batches:
        raise ValueError(f"method={method!r} got an empty data iterable")
    was_training = model.training
    model.eval()
    try:
        yield batches
    finally:
        model.train(was_training)


# --------------------------------------------------------------------------------------
# Mask selection
# --------------------------------------------------------------------------------------
def _keep_mask(priority: torch.Tensor, ratio: float) -> torch.Tensor:
    """Bool keep-mask removing exactly ``round(ratio * numel)`` highest-priority entries."""
    flat = priority.flatten()
    n_remove = int(round(ratio * flat.numel()))
    order = torch.argsort(flat, descending=True, stable=True)
    keep = torch.ones_like(flat, dtype=torch.bool)
    keep[order[:n_remove]] = False
    return keep.view_as(priority)


def _select(
    priorities: Mapping[str, torch.Tensor], ratio: float, scope: str
) -> OrderedDict[str, torch.Tensor]:
    if scope == "layer":
        return OrderedDict((name, _keep_mask(p, ratio)) for name, p in priorities.items())
    device = next(iter(priorities.values())).device
    flat = torch.cat([p.flatten().to(device) for p in priorities.values()])
    keep = _keep_mask(flat, ratio)
    masks: OrderedDict[str, torch.Tensor] = OrderedDict()
    chunks = keep.split([p.numel() for p in priorities.values()])
    for (name, p), chunk in zip(priorities.items(), chunks):
        masks[name] = chunk.view_as(p).to(p.device)
    return masks


def _previous_masks(slots: Mapping[str, _Slot], current_masks) -> dict[str, torch.Tensor]:
    """Already-pruned coordinates: torch-prune buffers AND the caller's current masks."""
    unknown = sorted(set(current_masks or {}) - set(slots))
    if unknown:
        raise ValueError(f"current_masks has names that are not prunable parameters: {unknown}")
    previous = {}
    for name, slot in slots.items():
        mask = None
        if slot.torch_mask is not None:
            mask = slot.torch_mask.detach().to(torch.bool)
        if current_masks is not None and name in current_masks:
            given = torch.as_tensor(current_masks[name]).to(device=slot.param.device,
                                                             dtype=torch.bool)
            mask = given if mask is None else mask & given
        if mask is not None:
            previous[name] = mask
    return previous


def _decide(
    model, slots, ratio, method, scope, previous, grasp_args
) -> OrderedDict[str, torch.Tensor]:
    if method == "magnitude":
        priorities = _magnitude_priorities(slots)
    elif method == "taylor":
        priorities = _taylor_priorities(model, slots, *grasp_args)
    else:
        priorities = _grasp_priorities(model, slots, *grasp_args)
    for name, mask in previous.items():
        # Already-pruned weights go first, so a later ratio only adds to the pruned set.
        priorities[name] = priorities[name].masked_fill(~mask, math.inf)
    masks = _select(priorities, ratio, scope)
    for name, mask in previous.items():
        masks[name] &= mask
    return masks


# --------------------------------------------------------------------------------------
# Rank-0 decision + broadcast
# --------------------------------------------------------------------------------------
def _pack(masks: Mapping[str, torch.Tensor]) -> np.ndarray:
    bits = torch.cat([m.detach().flatten().cpu() for m in masks.values()]).numpy()
    return np.packbits(bits.astype(np.uint8))


def _unpack(buffer: np.ndarray, slots: Mapping[str, _Slot]) -> OrderedDict[str, torch.Tensor]:
    sizes = [slot.param.numel() for slot in slots.values()]
    bits = torch.from_numpy(np.unpackbits(buffer, count=sum(sizes)).astype(np.bool_))
    return OrderedDict(
        (name, chunk.view_as(slot.param).to(slot.param.device))
        for (name, slot), chunk in zip(slots.items(), bits.split(sizes))
    )


def _decide_on_root(collectives, slots, decide: Callable[[], OrderedDict[str, torch.Tensor]]):
    """Run ``decide`` on rank 0 only and broadcast its masks as packed bits.

    Every rank's parameter layout and rank 0's error, if any, are all-gathered first, so a
    failure on rank 0 or a model mismatch raises on every rank instead of leaving the others
    blocked in the broadcast.
    """
    layout = [(name, tuple(slot.param.shape)) for name, slot in slots.items()]
    masks, error = None, None
    if collectives.rank == 0:
        try:
            masks = decide()
        except Exception as exc:  # re-raised below, after the other ranks were told
            error = exc
    headers = collectives.allgather_object((layout, None if error is None else repr(error)))
    root_error = headers[0][1]
    differing = [rank for rank, (other, _) in enumerate(headers) if other != headers[0][0]]
    if differing or root_error is not None:
        if error is not None:
            raise error
        if root_error is not None:
            raise RuntimeError(f"pruning failed on rank 0: {root_error}")
        here = "differs from" if collectives.rank in differing else "matches"
        raise ValueError(f"prunable parameters differ across ranks: ranks {differing} differ "
                         f"from rank 0 (rank {collectives.rank} {here} rank 0)")
    n_bytes = (sum(slot.param.numel() for slot in slots.values()) + 7) // 8
    buffer = _pack(masks) if masks is not None else np.empty(n_bytes, dtype=np.uint8)
    collectives.bcast(buffer, root=0)
    return _unpack(buffer, slots)


@torch.no_grad()
def _apply(slots: Mapping[str, _Slot], masks: Mapping[str, torch.Tensor]) -> None:
    for name, mask in masks.items():
        slot = slots[name]
        slot.param.masked_fill_(~mask, 0)
        if slot.torch_mask is not None:
            # Keep torch's reparametrization consistent with ours and refresh the cached
            # effective weight (the forward pre-hook recomputes it on the next call anyway).
            slot.torch_mask.mul_(mask.to(slot.torch_mask.dtype))
            setattr(slot.module, slot.attr, slot.param * slot.torch_mask)


def prune(
    model: nn.Module,
    ratio: float,
    method: str = "magnitude",
    scope: str = "global",
    include: Selector = None,
    exclude: Selector = None,
    *,
    data: Optional[Iterable] = None,
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    grasp_batches: int = 1,
    grasp_temperature: float = 200.0,
    current_masks: Optional[Mapping[str, torch.Tensor]] = None,
    comm=None,
    collectives=None,
) -> OrderedDict[str, torch.Tensor]:
    """Unstructured pruning in place; returns bool keep-masks keyed by logical name.

    Args:
        model: the (pretrained) model; pruned weights are set to exactly 0 in place.
        ratio: fraction in [0, 1) of the selected weights to remove: exactly
            ``round(ratio * n)`` over all selected weights (``scope="global"``) or per
            parameter (``scope="layer"``).
        method: ``"magnitude"`` removes the smallest ``|W|``; ``"taylor"`` the smallest
            first-order saliency ``|W ⊙ g|`` (see :func:`_taylor_priorities`); ``"grasp"`` the
            highest GraSP scores ``-W ⊙ (H g)`` (see :func:`_grasp_priorities` for the sign).
        scope: ``"global"`` ranks all selected weights together, ``"layer"`` each tensor.
        include, exclude: parameter selection, see :func:`named_prunable_parameters`.
        data: iterable of ``(x, y)`` batches, required for GraSP and Taylor. With ``comm``
            only rank 0 uses it, but every rank must pass one (arguments are validated
            everywhere).
        loss_fn: ``loss_fn(logits, y)``; default ``F.cross_entropy``.
        grasp_batches: how many batches of ``data`` GraSP averages ``g`` and ``H g`` over
            (Taylor: ``g``).
        grasp_temperature: logits are divided by this before the loss, as in the GraSP
            reference implementation (T=200); use 1 for the plain loss.
        current_masks: already-pruned coordinates (``False``) that stay pruned; they are
            ranked first for removal, so the result is ``current AND new`` and the ratio is
            exact unless more than ``round(ratio * n)`` weights were already pruned.
            ``torch.nn.utils.prune`` masks (``weight_mask``) are always honoured the same way
            and are updated in place.
        comm: optional mpi4py communicator. When given, rank 0 decides and broadcasts the
            masks (packed bits) so all ranks end bit-identical even when GraSP sees different
            local data. Collective: call on every rank.
        collectives: instead of ``comm``, any :class:`pacmpi.Collectives` transport (e.g.
            Horovod's, where there is no MPI world); same rank-0 decision and broadcast.
    """
    ratio = check_ratio(ratio)
    _check_choice("method", method, PRUNING_CRITERIA)
    _check_choice("scope", scope, SCOPES)
    if method != "magnitude" and data is None:
        raise ValueError(f"method={method!r} needs data=<iterable of (x, y) batches>")
    if isinstance(grasp_batches, bool) or not isinstance(grasp_batches, int) or grasp_batches < 1:
        raise ValueError(f"grasp_batches must be a positive int, got {grasp_batches!r}")
    if not grasp_temperature > 0:
        raise ValueError(f"grasp_temperature must be > 0, got {grasp_temperature!r}")
    slots = _prunable_slots(model, include, exclude)
    if not slots:
        raise ValueError("no prunable parameters selected (check include/exclude)")
    previous = _previous_masks(slots, current_masks)
    grasp_args = (data, loss_fn or F.cross_entropy, grasp_batches, float(grasp_temperature))

    def decide():
        return _decide(model, slots, ratio, method, scope, previous, grasp_args)

    if comm is None and collectives is None:
        masks = decide()
    else:
        # Imported here: torch_sync imports this module, and local pruning needs no MPI.
        from pacmpi.adapters.torch_sync import transport

        masks = _decide_on_root(transport(comm, collectives), slots, decide)
    _apply(slots, masks)
    return masks


def masks_digest(masks: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over a dict of named masks, their sorted names, shapes and bits: equal iff
    the masks are equal. (:func:`pacmpi.hashing.mask_fingerprint` is the engine's cheap
    per-array verification fingerprint, not a digest.)"""
    digest = hashlib.sha256()
    for name in sorted(masks):
        mask = masks[name].detach().to(torch.bool).cpu()
        digest.update(f"{name}:{tuple(mask.shape)};".encode())
        digest.update(np.packbits(mask.flatten().numpy().astype(np.uint8)).tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------
# Gradual pruning
# --------------------------------------------------------------------------------------
class GradualPruningSchedule:
    """Prune to ratio r_i at step s_i: ``milestones=[(s1, r1), (s2, r2), ...]``.

    Steps must be non-negative ints, strictly increasing; ratios in [0, 1), non-decreasing.
    Each milestone calls :func:`prune` with the previous masks as ``current_masks``, so
    masks only grow sparser (already-pruned weights are removed first, then ANDed).
    ``method``, ``scope``, ``include``, ``exclude``, ``grasp_batches`` and
    ``grasp_temperature`` are passed to :func:`prune`. After a change, hand the new masks
    to :meth:`MaskEnforcer.update`.
    """

    def __init__(
        self,
        milestones: Iterable[tuple],
        method: str = "magnitude",
        scope: str = "global",
        include: Selector = None,
        exclude: Selector = None,
        *,
        grasp_batches: int = 1,
        grasp_temperature: float = 200.0,
    ):
        _check_choice("method", method, PRUNING_CRITERIA)
        _check_choice("scope", scope, SCOPES)
        self.milestones = self._validated(milestones)
        self.method, self.scope, self.include, self.exclude = method, scope, include, exclude
        self._grasp = {"grasp_batches": grasp_batches, "grasp_temperature": grasp_temperature}
        self.masks: Optional[OrderedDict[str, torch.Tensor]] = None
        self._next = 0  # index of the first milestone not applied yet

    @staticmethod
    def _validated(milestones) -> list[tuple[int, float]]:
        checked: list[tuple[int, float]] = []
        for item in milestones:
            step, ratio = item
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"milestone step must be a non-negative int, got {step!r}")
            ratio = check_ratio(ratio, "milestone ratio")
            if checked and step <= checked[-1][0]:
                raise ValueError(f"milestone steps must be strictly increasing, got {step!r} "
                                 f"after {checked[-1][0]!r}")
            if checked and ratio < checked[-1][1]:
                raise ValueError(f"milestone ratios must be non-decreasing, got {ratio!r} "
                                 f"after {checked[-1][1]!r}")
            checked.append((step, ratio))
        if not checked:
            raise ValueError("milestones must not be empty")
        return checked

    def step(
        self,
        model: nn.Module,
        step_index: int,
        *,
        data: Optional[Iterable] = None,
        loss_fn=None,
        comm=None,
        collectives=None,
    ) -> Optional[OrderedDict[str, torch.Tensor]]:
        """Prune if a milestone is due at ``step_index``; return the new masks, else None.

        If several milestones were skipped (e.g. after resuming), the latest due one is
        applied once. Collective when ``comm`` or ``collectives`` is given (see :func:`prune`):
        call on every rank every step.
        """
        due = [i for i in range(self._next, len(self.milestones))
               if self.milestones[i][0] <= step_index]
        if not due:
            return None
        self._next = due[-1] + 1
        self.masks = prune(
            model,
            self.milestones[due[-1]][1],
            self.method,
            self.scope,
            self.include,
            self.exclude,
            data=data,
            loss_fn=loss_fn,
            current_masks=self.masks,
            comm=comm,
            collectives=collectives,
            **self._grasp,
        )
        return self.masks


# --------------------------------------------------------------------------------------
# Gradient sparsity enforcement
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DensityReport:
    """Kept/total counts over all masked parameters and the density of each one."""

    kept: int
    total: int
    per_parameter: OrderedDict[str, float]

    @property
    def overall(self) -> float:
        return self.kept / self.total if self.total else 1.0


class MaskEnforcer:
    """Keep pruned coordinates at zero in gradients, weights and optimizer state.

    ``masks`` maps logical names (see :func:`named_prunable_parameters`) to bool keep-masks;
    they are copied to bool tensors on each parameter's device and exposed as
    :attr:`masks` in ``named_parameters()`` order. Construction zeros the pruned weights.

    Which hook should an adapter use? Call :meth:`apply_to_grads` explicitly after
    ``loss.backward()`` and *before* the packed all-reduce (PacTrain's GSE step): the order
    is then obvious. :meth:`register_grad_hooks` masks each gradient as soon as it is
    accumulated and is meant for hook-driven communication (gradients all-reduced from
    autograd hooks while backward runs); register it before the communication hooks
    (e.g. before wrapping in a distributed optimizer), since hooks on a tensor run in
    registration order. In both cases also :meth:`attach` the optimizer.
    """

    def __init__(self, model: nn.Module, masks: Mapping[str, torch.Tensor]):
        self._model = model
        self._entries: OrderedDict[
            str, tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._optimizers: list = []  # (optimizer, its step hook's handle)
        self._grad_hooks: list = []
        self.update(masks)

    @property
    def masks(self) -> OrderedDict[str, torch.Tensor]:
        """Bool keep-masks (``True`` = kept), in ``named_parameters()`` order."""
        return OrderedDict((name, keep) for name, (_, keep, _) in self._entries.items())

    @property
    def parameters(self) -> OrderedDict[str, nn.Parameter]:
        """The leaf Parameter each mask applies to (``weight_orig`` when reparametrized)."""
        return OrderedDict((name, param) for name, (param, _, _) in self._entries.items())

    def update(self, masks: Mapping[str, torch.Tensor]) -> None:
        """Replace the masks (e.g. after a schedule milestone) and re-apply them to the
        weights, the state of attached optimizers and, if active, the grad hooks."""
        slots = _slots(self._model)
        unknown = sorted(set(masks) - set(slots))
        if unknown:
            raise ValueError(f"masks name parameters the model does not have: {unknown}")
        entries = OrderedDict()
        for name, slot in slots.items():
            if name not in masks:
                continue
            keep = torch.as_tensor(masks[name]).to(device=slot.param.device, dtype=torch.bool)
            if keep.shape != slot.param.shape:
                raise ValueError(f"mask for {name!r} has shape {tuple(keep.shape)}, "
                                 f"parameter has {tuple(slot.param.shape)}")
            entries[name] = (slot.param, keep, ~keep)  # ~keep cached: used every step
        self._entries = entries
        self.apply_to_weights()
        for optimizer, _ in self._optimizers:
            self._zero_state(optimizer)
        if self._grad_hooks:
            self.remove_grad_hooks()
            self.register_grad_hooks()

    @torch.no_grad()
    def apply_to_grads(self) -> None:
        """GSE: ``G = mask * G`` in place for every masked parameter with a dense grad.

        ``masked_fill_`` rather than ``mul_`` so that inf/NaN at pruned coordinates
        become 0 too (``inf * 0`` would be NaN)."""
        for param, _, pruned in self._entries.values():
            if param.grad is not None:
                param.grad.masked_fill_(pruned, 0)

    @torch.no_grad()
    def apply_to_weights(self) -> None:
        """Set pruned weights to exactly 0 in place."""
        for param, _, pruned in self._entries.values():
            param.masked_fill_(pruned, 0)

    @torch.no_grad()
    def _zero_state(self, optimizer: torch.optim.Optimizer) -> None:
        # Any per-parameter state shaped like the parameter (momentum_buffer, exp_avg,
        # exp_avg_sq, max_exp_avg_sq, ...) would otherwise push pruned weights off zero.
        for param, _, pruned in self._entries.values():
            for value in optimizer.state.get(param, {}).values():
                if torch.is_tensor(value) and value.shape == param.shape:
                    value.masked_fill_(pruned, 0)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.apply_to_weights()
        self._zero_state(optimizer)

    def attach(self, optimizer: torch.optim.Optimizer):
        """Zero pruned weights and optimizer state after every ``optimizer.step()``.

        Needed because momentum buffers and (decoupled) weight decay built before the
        masks existed, or fed by unmasked gradients, would resurrect pruned weights. The
        current state is zeroed immediately. Returns the hook's removable handle (the same one
        when the optimizer was attached before: the hook runs once per step).
        """
        self._zero_state(optimizer)
        for known, handle in self._optimizers:
            if known is optimizer:
                return handle
        handle = optimizer.register_step_post_hook(self._after_step)
        self._optimizers.append((optimizer, handle))
        return handle

    def register_grad_hooks(self) -> list:
        """Mask each gradient right after it is accumulated into ``.grad``
        (``Tensor.register_post_accumulate_grad_hook``). Returns the handles."""
        for name, (param, _, _) in self._entries.items():
            self._grad_hooks.append(param.register_post_accumulate_grad_hook(self._grad_hook(name)))
        return list(self._grad_hooks)

    def remove_grad_hooks(self) -> None:
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []

    def _grad_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            with torch.no_grad():
                param.grad.masked_fill_(self._entries[name][2], 0)

        return hook

    def density(self) -> DensityReport:
        """Fraction of kept coordinates, overall and per masked parameter."""
        per = OrderedDict()
        kept = total = 0
        for name, (_, keep, _) in self._entries.items():
            k, n = int(keep.sum()), keep.numel()
            per[name] = k / n if n else 1.0
            kept, total = kept + k, total + n
        return DensityReport(kept, total, per)
