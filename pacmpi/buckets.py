"""Fusion buckets: many gradient arrays flattened into a few contiguous buffers and back."""
from dataclasses import dataclass

import numpy as np

from .arrays import check_float_dtype

__all__ = ["Bucket", "BucketLayout", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Like PyTorch DDP's default: big enough to amortize latency, small enough to overlap."""


@dataclass(frozen=True)
class Member:
    """One array inside a bucket: its position in the caller's list and its flat slice."""

    index: int
    offset: int
    size: int
    shape: tuple


@dataclass(frozen=True)
class Bucket:
    """A run of same-dtype arrays that are reduced as one flat buffer."""

    index: int
    dtype: np.dtype
    members: tuple
    size: int

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize

    def flat_view(self, arrays):
        """The bucket's only array as a flat view when it has one contiguous member, else None.

        Reducing through the view skips two copies; the reduction is in place anyway.
        """
        if len(self.members) != 1:
            return None
        array = arrays[self.members[0].index]
        return array.reshape(-1) if array.flags.c_contiguous else None

    def flatten(self, arrays, out):
        """Copy this bucket's arrays into the flat buffer ``out`` (length ``size``)."""
        for m in self.members:
            out[m.offset:m.offset + m.size] = arrays[m.index].reshape(-1)
        return out

    def unflatten(self, flat, arrays):
        """Write the flat buffer back into this bucket's arrays, in place."""
        for m in self.members:
            arrays[m.index][...] = flat[m.offset:m.offset + m.size].reshape(m.shape)


class BucketLayout:
    """Assigns arrays, in the given order, to buckets of at most ``bucket_bytes`` per dtype.

    Arrays keep their order inside a bucket; an array larger than ``bucket_bytes`` gets a bucket
    of its own. Buckets are numbered by their first member, so every rank that sees the same
    shapes and dtypes builds the same layout.
    """

    def __init__(self, shapes, dtypes, bucket_bytes=DEFAULT_BUCKET_BYTES):
        if not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        shapes = [tuple(int(d) for d in s) for s in shapes]
        dtypes = [check_float_dtype(d) for d in dtypes]
        if len(shapes) != len(dtypes):
            raise ValueError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
        self.bucket_bytes = int(bucket_bytes)
        open_runs = {}
        closed = []
        for index, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            size = int(np.prod(shape, dtype=np.int64))
            run = open_runs.get(dtype)
            overflows = run is not None and (run["size"] + size) * dtype.itemsize > bucket_bytes
            if overflows and run["size"]:
                closed.append(run)
                run = None
            if run is None:
                run = {"dtype": dtype, "members": [], "size": 0}
                open_runs[dtype] = run
            run["members"].append(Member(index, run["size"], size, shape))
            run["size"] += size
        closed.extend(open_runs.values())
        closed.sort(key=lambda r: r["members"][0].index)
        self.buckets = tuple(
            Bucket(i, r["dtype"], tuple(r["members"]), r["size"]) for i, r in enumerate(closed)
        )
        self.shapes = tuple(shapes)
        self.dtypes = tuple(dtypes)
        self._bucket_of = {m.index: b.index for b in self.buckets for m in b.members}

    def __len__(self):
        return len(self.buckets)

    def bucket_of(self, array_index):
        """The bucket index holding the caller's array number ``array_index``."""
        return self._bucket_of[array_index]

    def describe(self):
        """A hashable description of the layout, identical on ranks with identical layouts."""
        return [(str(b.dtype), b.size, tuple(m.shape for m in b.members)) for b in self.buckets]
