"""The gradient-synchronization methods, by name: the one table that the front ends, the
training job, the benchmarks and the cost model read.

Each :class:`Method` says which collective carries it and, for the all-reduce methods that
pacmpi's engine runs, how: whether only the mask's survivors travel (``packed``) and the
engine's ``quantize`` mode (one of :data:`pacmpi.QUANTIZE_MODES`, which validates it).

Old spellings: ``"dense-fp32"`` and ``"dense-fp16"`` (the benchmarks' and cost model's names
before one vocabulary) are accepted by :func:`lookup_method` as aliases of ``"dense"`` and
``"fp16"`` for one release; outputs use the canonical names.
"""
from dataclasses import dataclass
from typing import Optional

__all__ = ["ALLREDUCE_METHODS", "METHODS", "Method", "canonical_name", "lookup_method"]


@dataclass(frozen=True)
class Method:
    """One method: its ``name``; ``collective``, what carries it (``"allreduce"``: pacmpi's
    engine or a framework's all-reduce; ``"allgather"``: every rank's compressed gradient,
    the TopK/TernGrad/DGC baselines; ``"powersgd"``: torch's ``powerSGD_hook``); ``packed``:
    only the survivors of the pruning mask travel; ``quantize``: the engine's quantize mode
    (all-reduce methods; None elsewhere); ``lossless``: the result is the exact sum of the
    (masked) gradients."""

    name: str
    collective: str
    packed: bool = False
    quantize: Optional[str] = None
    lossless: bool = False


METHODS = {m.name: m for m in (
    Method("dense", "allreduce", lossless=True),
    Method("fp16", "allreduce", quantize="fp16"),
    Method("pactrain", "allreduce", packed=True, lossless=True),
    Method("pactrain-ternary", "allreduce", packed=True, quantize="ternary"),
    Method("topk", "allgather"),
    Method("terngrad", "allgather"),
    Method("dgc", "allgather"),
    Method("powersgd", "powersgd"),
)}
"""Canonical name -> :class:`Method`, in the order tables list them."""

ALLREDUCE_METHODS = tuple(name for name, m in METHODS.items() if m.collective == "allreduce")
"""What pacmpi's engine (and the cost model, and ``pacmpi bench allreduce``) runs."""

_ALIASES = {"dense-fp32": "dense", "dense-fp16": "fp16"}  # until the next release


def canonical_name(name):
    """``name`` with an old alias replaced by today's name (anything else unchanged: labels
    that carry parameters, such as ``pactrain-0.8``, pass through)."""
    return _ALIASES.get(name, name) if isinstance(name, str) else name


def lookup_method(name, among=None):
    """The :class:`Method` called ``name`` (or an old alias of it); ``among``: the canonical
    names the caller supports (default: all). ``ValueError`` names the bad value and lists the
    choices."""
    among = tuple(METHODS) if among is None else tuple(among)
    canonical = canonical_name(name)
    if canonical in among:
        return METHODS[canonical]
    known = isinstance(canonical, str) and canonical in METHODS
    problem = f"method {name!r} is not available here" if known else f"unknown method {name!r}"
    raise ValueError(f"{problem}; choose from {', '.join(among)}")
