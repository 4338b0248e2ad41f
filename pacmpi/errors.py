"""Exceptions raised by pacmpi. Every consistency error is raised on all ranks in the same step."""

__all__ = [
    "PacmpiError",
    "ConsistencyError",
    "MaskMismatchError",
    "LayoutMismatchError",
    "RankInputError",
]


class PacmpiError(Exception):
    """Base class of pacmpi's errors."""


class ConsistencyError(PacmpiError):
    """Ranks disagree on something they must share; raised on every rank together.

    ``details`` maps each rank to the descriptor it contributed, ``offending_ranks`` lists the
    ranks whose descriptor differs from the majority (ties resolved in favour of rank 0's).
    """

    def __init__(self, message, *, details=None, offending_ranks=()):
        super().__init__(message)
        self.details = details or {}
        self.offending_ranks = tuple(offending_ranks)


class MaskMismatchError(ConsistencyError):
    """Ranks would pack different gradient coordinates (different mask fingerprints or versions)."""


class LayoutMismatchError(ConsistencyError):
    """Ranks disagree on bucket count, sizes, dtypes, quantization or averaging."""


class RankInputError(PacmpiError):
    """Bad input on one or more ranks, re-raised on every rank with each rank's message."""

    def __init__(self, message, *, errors=None):
        super().__init__(message)
        self.errors = errors or {}
