"""Cross-rank agreement: one tiny MAX all-reduce decides, on every rank alike, whether all ranks
contributed the same descriptor; only on disagreement do ranks gather details to explain it."""
import collections
import socket

import numpy as np

from .errors import RankInputError

__all__ = ["agree", "gather_details", "offending_ranks", "raise_together", "run_together"]


def agree(collectives, fields, extra=None):
    """Names of the entries of ``fields`` (name -> int) that differ between ranks.

    All ranks must pass the same field names in the same order. One all-reduce of
    ``[x, -x]`` with MAX yields every field's maximum and minimum, so each rank learns the
    same verdict from the same numbers. Returns ``(mismatched_names, maxima)``. ``extra``
    (int64 values of the same length on every rank, not compared) rides along: its maxima
    replace it in place.
    """
    values = np.fromiter(fields.values(), dtype=np.int64, count=len(fields))
    extra = np.zeros(0, np.int64) if extra is None else extra
    buf = np.concatenate([values, -values, extra])
    collectives.allreduce(buf, "max")
    extra[...] = buf[2 * len(values):]
    maxima, minima = buf[:len(values)], -buf[len(values):2 * len(values)]
    names = list(fields)
    mismatched = [names[i] for i in np.flatnonzero(maxima != minima)]
    return mismatched, dict(zip(names, (int(v) for v in maxima)))


def gather_details(collectives, descriptor):
    """Every rank's ``descriptor`` (a dict), with its host name, indexed by rank."""
    descriptor = dict(descriptor, host=socket.gethostname())
    return dict(enumerate(collectives.allgather_object(descriptor)))


def offending_ranks(details, keys):
    """Ranks whose values at ``keys`` differ from the majority's (ties favour rank 0's)."""
    def signature(rank):
        return tuple(repr(details[rank].get(k)) for k in keys)

    counts = collections.Counter(signature(r) for r in details)
    best = max(counts.values())
    majority = signature(0) if counts[signature(0)] == best else next(
        s for s, c in counts.items() if c == best)
    return [r for r in sorted(details) if signature(r) != majority]


def raise_together(collectives, local_error):
    """Raise on every rank when ``local_error`` (an exception or ``None``) is set on any rank.

    The raised :class:`RankInputError` carries every failing rank's message; on a failing rank
    it is chained to the local exception.
    """
    flag = np.array([0 if local_error is None else 1], dtype=np.int64)
    collectives.allreduce(flag, "max")
    if not flag[0]:
        return
    message = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    messages = collectives.allgather_object(message)
    errors = {rank: m for rank, m in enumerate(messages) if m is not None}
    text = "; ".join(f"rank {rank}: {m}" for rank, m in errors.items())
    raise RankInputError(f"bad input on {len(errors)} rank(s): {text}",
                         errors=errors) from local_error


def run_together(collectives, fn, *args, errors=(TypeError, ValueError)):
    """Call ``fn(*args)`` on every rank; if it raises one of ``errors`` on any rank, raise
    :class:`RankInputError` on all of them (see :func:`raise_together`). Returns fn's result."""
    result = error = None
    try:
        result = fn(*args)
    except errors as exc:
        error = exc
    raise_together(collectives, error)
    return result
