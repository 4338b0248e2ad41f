"""pacmpi: PacTrain's mask-aware packed all-reduce for data-parallel training on slow networks.

The core needs only NumPy and mpi4py; CuPy arrays are handled when the caller uses CuPy.
"""
from .arrays import array_module, is_device_array, supported_float_dtypes
from .buckets import DEFAULT_BUCKET_BYTES, Bucket, BucketLayout
from .collectives import Collectives, MPICollectives, default_collectives
from .engine import BucketSpec, StepEngine
from .errors import (ConsistencyError, LayoutMismatchError, MaskMismatchError, PacmpiError,
                     RankInputError)
from .hashing import mask_fingerprint
from .reducer import MISMATCH_POLICIES, QUANTIZE_MODES, PacTrainReducer
from .ternary import TernaryCodec, stochastic_ternary, ternary_key, wire_bits_table
from .tracker import MaskTracker

__version__ = "0.1.0"

__all__ = [
    "PacTrainReducer", "StepEngine", "BucketSpec", "MaskTracker", "TernaryCodec", "BucketLayout", "Bucket",
    "Collectives", "MPICollectives", "default_collectives",
    "PacmpiError", "ConsistencyError", "MaskMismatchError", "LayoutMismatchError",
    "RankInputError", "QUANTIZE_MODES", "MISMATCH_POLICIES", "DEFAULT_BUCKET_BYTES",
    "array_module", "is_device_array", "supported_float_dtypes", "mask_fingerprint",
    "stochastic_ternary", "ternary_key", "wire_bits_table", "__version__",
]
