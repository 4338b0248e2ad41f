"""EngineOptions: every knob of a PacTrain step, with its default and its check, written once.

Each front end (:class:`pacmpi.PacTrainReducer`, :class:`pacmpi.sharded.ShardedReducer`, the DDP
hook's state, Horovod's compressor, the raw-loop sync) takes ``options=EngineOptions(...)``
and the same knobs as keywords, which replace the object's (or the defaults') values; the
engine keeps the validated object. Like ``PowerSGDState``'s knobs, it is a plain value: it
pickles, compares and prints as one.
"""
from dataclasses import dataclass, fields, replace

import numpy as np

__all__ = ["EngineOptions", "QUANTIZE_MODES", "MISMATCH_POLICIES", "TERNARY_SCALES",
           "check_options", "knob"]

QUANTIZE_MODES = (None, "fp16", "ternary")
MISMATCH_POLICIES = ("raise", "resync")
# Ternary scale granularity: one per tensor of a bucket (BucketSpec.segments), or per bucket;
# a positive int n instead: one per n consecutive elements of each tensor.
TERNARY_SCALES = ("tensor", "bucket")


def _is_block(ternary_scale):
    return (isinstance(ternary_scale, (int, np.integer)) and not isinstance(ternary_scale, bool)
            and ternary_scale >= 1)


@dataclass(frozen=True)
class EngineOptions:
    """The knobs of a step, as documented on :class:`pacmpi.PacTrainReducer`; checked once,
    here (ValueError naming the value). ``word_dtype`` ``"auto"`` picks uint64 where the
    transport sums it (MPI), else int64."""

    quantize: object = None
    average: bool = True
    verify_every: int = 1
    on_mismatch: str = "raise"
    stable_steps: int = 1
    error_feedback: bool = False
    seed: int = 0
    word_dtype: str = "auto"
    ternary_scale: object = "tensor"

    def __post_init__(self):
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}")
        if not (self.ternary_scale in TERNARY_SCALES or _is_block(self.ternary_scale)):
            raise ValueError(f"ternary_scale must be one of {TERNARY_SCALES} or a positive int "
                             f"(elements per scale), got {self.ternary_scale!r}")
        if self.on_mismatch not in MISMATCH_POLICIES:
            raise ValueError(f"on_mismatch must be one of {MISMATCH_POLICIES}, "
                             f"got {self.on_mismatch!r}")
        if not isinstance(self.verify_every, int) or self.verify_every < 1:
            raise ValueError(f"verify_every must be a positive integer, "
                             f"got {self.verify_every!r}")
        if not isinstance(self.stable_steps, int) or self.stable_steps < 0:
            raise ValueError(f"stable_steps must be a non-negative integer, "
                             f"got {self.stable_steps!r}")
        # Frozen: the normalized values are set once, here.
        normal = dict(average=bool(self.average), error_feedback=bool(self.error_feedback),
                      seed=int(self.seed))
        if _is_block(self.ternary_scale):
            normal["ternary_scale"] = int(self.ternary_scale)
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @classmethod
    def check_names(cls, knobs, *, who, takes=None):
        """TypeError, as for an unknown keyword argument, unless every name of ``knobs`` is
        one ``who`` takes (``takes``; default: every knob)."""
        names = [f.name for f in fields(cls)] if takes is None else takes
        unknown = [name for name in knobs if name not in names]
        if unknown:
            raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")

    @classmethod
    def build(cls, options, knobs, *, who, takes=None, **defaults):
        """The options of front end ``who``: ``options`` (default: ``cls(**defaults)``, the
        front end's own defaults where they differ) with the keyword ``knobs`` replaced
        (:meth:`check_names` first)."""
        cls.check_names(knobs, who=who, takes=takes)
        if options is None:
            options = cls(**defaults)
        elif not isinstance(options, cls):
            raise TypeError(f"options must be an EngineOptions, got {type(options).__name__}")
        return replace(options, **knobs) if knobs else options

    def replace(self, **changes):
        """A copy with ``changes``, checked again."""
        return replace(self, **changes)


def check_options(**knobs):
    """Raise ValueError for a bad knob (see :class:`EngineOptions`); for callers that check a
    configuration before building anything."""
    EngineOptions(**knobs)


def knob(name):
    """A read-only property for knob ``name`` of the owner's ``options``."""
    return property(lambda self: getattr(self.options, name), doc=f"The ``{name}`` option.")
