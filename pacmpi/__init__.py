"""pacmpi: PacTrain's mask-aware packed all-reduce for data-parallel training on slow networks.

The core needs only NumPy and mpi4py; CuPy arrays are handled when the caller uses CuPy.
:class:`PacTrainReducer` is the front end for arrays; :class:`StepEngine` and
:class:`BucketSpec` are what a framework adapter builds on; :class:`EngineOptions` holds the
knobs every front end takes; :class:`Collectives` is the transport interface
(:class:`MPICollectives` over mpi4py). Everything else lives in submodules that the front ends
use (``pacmpi.ternary``, ``pacmpi.kernels``, ``pacmpi.tracker``, ...).
"""
from .buckets import DEFAULT_BUCKET_BYTES
from .collectives import Collectives, MPICollectives
from .engine import BucketSpec, StepEngine
from .errors import (
                     ConsistencyError,
                     LayoutMismatchError,
                     MaskMismatchError,
                     PacmpiError,
                     RankInputError,
)
from .options import EngineOptions
from .reducer import MISMATCH_POLICIES, QUANTIZE_MODES, PacTrainReducer

__version__ = "0.1.0"

__all__ = [
    "PacTrainReducer", "StepEngine", "BucketSpec", "EngineOptions", "Collectives",
    "MPICollectives", "PacmpiError", "ConsistencyError", "MaskMismatchError", "LayoutMismatchError",
    "RankInputError", "QUANTIZE_MODES", "MISMATCH_POLICIES", "DEFAULT_BUCKET_BYTES",
    "__version__",
]
