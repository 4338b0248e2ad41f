"""Binding user masks (keyed by parameter name) to a list of bound parameters, for the
framework adapters that hand per-parameter masks to :class:`pacmpi.engine.StepEngine`."""
from collections.abc import Mapping
from typing import NamedTuple

import torch

from pacmpi.adapters.convert import as_array, as_tensor
from pacmpi.adapters.pruning import named_prunable_parameters
from pacmpi.engine import JoinedMasks

__all__ = ["MaskBinding"]


class _ReadPlan(NamedTuple):
    """What :meth:`MaskBinding.flats` reads in one concatenation: made for ``masks`` (the
    binding's dict) while the storage of its boolean mask ``tensors`` stays at ``pointers``;
    ``views``: theirs, flat; ``slices``: ``(index, start, stop)`` of each in the concatenation;
    ``others``: the indices read one by one; ``joined``: when the tensors lie back to back in
    one storage, the flats to return every step (views of it: no concatenation), else None."""

    masks: dict
    pointers: list
    tensors: list
    views: list
    slices: list
    others: list
    joined: object


def _every_parameter(name, param):
    """``include=`` for named_prunable_parameters: any parameter may carry a mask here."""
    return True


class MaskBinding:
    """Masks of bound ``(name, parameter)`` pairs, resolved by name.

    A mask key is a bound name or, when ``module`` is given, a logical name of
    :func:`pacmpi.adapters.pruning.named_prunable_parameters` that leads to a bound parameter
    under another name (``"fc.weight"`` of a ``torch.nn.utils.prune`` module names
    ``fc.weight_orig``, the leaf that receives ``.grad``). The mask objects are kept, not
    copied, so in-place changes (gradual pruning) are seen at the next :meth:`flat`.
    """

    def __init__(self, named_parameters, masks, module=None):
        self.names = [name for name, _ in named_parameters]
        self.params = [param for _, param in named_parameters]
        if len(set(self.names)) != len(self.names):
            raise ValueError("parameter names must be unique")
        self._keys = {name: index for index, name in enumerate(self.names)}
        if module is not None:
            index_of = {id(param): index for index, param in enumerate(self.params)}
            for name, param in named_prunable_parameters(module, include=_every_parameter).items():
                if id(param) in index_of:
                    self._keys.setdefault(name, index_of[id(param)])
        self.masks = self.resolve(masks)
        self._plans = {}  # memory_order -> what flats() reads in one concatenation

    def resolve(self, masks):
        """``masks`` (name -> mask) keyed by parameter index; raises naming bad keys."""
        if not isinstance(masks, Mapping):
            raise TypeError(f"masks must be a mapping from parameter name to mask, got "
                            f"{type(masks).__name__}")
        unknown = [key for key in masks if key not in self._keys]
        if unknown:
            aliases = sorted(k for k in self._keys if k not in self.names)
            raise ValueError(f"masks name parameters that are not bound: {unknown}; keys are "
                             f"the bound parameter names or, when the nn.Module is given, "
                             f"torch.nn.utils.prune's logical names (known here: {aliases})")
        resolved, keys = {}, {}
        for key, mask in masks.items():
            index = self._keys[key]
            if index in resolved:
                raise ValueError(f"masks {keys[index]!r} and {key!r} both name parameter "
                                 f"{self.names[index]!r}")
            resolved[index], keys[index] = mask, key
        return resolved

    def flat(self, index, memory_order=False):
        """Parameter ``index``'s current mask as a flat bool NumPy/CuPy array on the
        parameter's device, or ``None``; raises ValueError for a wrong shape or non-0/1.

        ``memory_order``: flatten in the order of the parameter's storage (channels-last
        parameters, as DDP's bucket views lay out their gradients), not its logical order."""
        mask = self.masks.get(index)
        if mask is None:
            return None
        name, param = self.names[index], self.params[index]
        mask = torch.as_tensor(mask, device=param.device)
        if tuple(mask.shape) != tuple(param.shape):
            raise ValueError(f"mask of {name!r} has shape {tuple(mask.shape)}, the parameter "
                             f"has {tuple(param.shape)}")
        if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"mask of {name!r} must be boolean or 0/1")
        mask = mask != 0
        if memory_order and not param.is_contiguous():
            mask = torch.empty_like(param, dtype=torch.bool).copy_(mask).as_strided(
                (param.numel(),), (1,))
        return as_array(mask.reshape(-1))

    def flats(self, memory_order=False):
        """Every parameter's :meth:`flat`: boolean masks of the parameters' shape on their
        device (of contiguous parameters, with ``memory_order``) read in one concatenation of
        flat views made once, so reading them costs one call whatever their number; the others
        one by one. The views are remade when a mask's storage moves (``mask.data = ...``) or
        the masks are replaced.

        When every mask is read that way, they are first laid out back to back in one storage
        (each mask's ``.data`` becomes a view of it, as DDP's ``gradient_as_bucket_view`` does
        for gradients: the tensor objects, shapes and values stay the user's, and in-place
        changes land in it), unless they already are; then the same
        :class:`pacmpi.engine.JoinedMasks` of views is returned every step, nothing copied,
        and the engine compares them as one array."""
        plan = self._plans.get(memory_order)
        if plan is None or plan.masks is not self.masks or plan.pointers != list(
                map(torch.Tensor.data_ptr, plan.tensors)):
            plan = self._plans[memory_order] = self._read_plan(memory_order)
        if plan.joined is not None:
            return plan.joined
        out = [None] * len(self.params)
        if plan.views:
            whole = as_array(torch.cat(plan.views))
            for index, start, stop in plan.slices:
                out[index] = whole[start:stop]
        for index in plan.others:
            out[index] = self.flat(index, memory_order)
        return out

    def _read_plan(self, memory_order):
        tensors, slices, others, start = [], [], [], 0
        for index, mask in self.masks.items():
            param = self.params[index]
            if (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
                    and mask.device == param.device and mask.shape == param.shape
                    and mask.is_contiguous() and (not memory_order or param.is_contiguous())):
                tensors.append(mask)
                slices.append((index, start, start + mask.numel()))
                start += mask.numel()
            else:
                others.append(index)
        joined = None
        if tensors and not others and len({id(mask) for mask in tensors}) == len(tensors):
            joined = self._joined(tensors, slices, start)
        return _ReadPlan(self.masks, [mask.data_ptr() for mask in tensors], tensors,
                         [mask.view(-1) for mask in tensors], slices, others, joined)

    def _joined(self, tensors, slices, total):
        """The masks as views of one storage of ``total`` bools, in order (laid out so here
        unless they already are), as the flats :meth:`flats` returns."""
        first = tensors[0]
        if not all(mask.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   and mask.storage_offset() == start
                   for mask, (_, start, _) in zip(tensors, slices)):
            storage = torch.cat([mask.view(-1) for mask in tensors])
            for mask, (_, start, stop) in zip(tensors, slices):
                mask.data = storage[start:stop].view(mask.shape)
        whole = as_array(tensors[0].as_strided((total,), (1,), 0))
        out = [None] * len(self.params)
        for index, start, stop in slices:
            out[index] = whole[start:stop]
        return JoinedMasks(out, whole, token=object())

    def store(self, index, flat, memory_order=False):
        """Write a flat mask (as :meth:`flat` returns it) into parameter ``index``'s mask."""
        param, target = self.params[index], torch.as_tensor(self.masks[index])
        flat = as_tensor(flat)
        if memory_order and not param.is_contiguous():
            target.copy_(flat.as_strided(param.shape, param.stride()))
        else:
            target.copy_(flat.reshape(param.shape))
