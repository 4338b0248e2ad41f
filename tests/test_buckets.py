import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pacmpi.arrays import supported_float_dtypes
from pacmpi.buckets import BucketLayout

from xp_util import ARRAY_MODULES, asnumpy

DTYPES = [np.dtype(d) for d in supported_float_dtypes()]
shapes = st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple),
                  min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, dtype_ids=st.lists(st.integers(0, len(DTYPES) - 1), min_size=8,
                                         max_size=8), bucket_bytes=st.integers(1, 400))
def test_layout_covers_every_array_once_in_same_dtype_buckets(shapes, dtype_ids, bucket_bytes):
    dtypes = [DTYPES[i] for i in dtype_ids[:len(shapes)]]
    layout = BucketLayout(shapes, dtypes, bucket_bytes)
    seen = sorted(m.index for b in layout.buckets for m in b.members)
    assert seen == list(range(len(shapes)))
    for bucket in layout.buckets:
        assert all(dtypes[m.index] == bucket.dtype for m in bucket.members)
        nonempty = [m for m in bucket.members if m.size]
        assert len(nonempty) <= 1 or bucket.nbytes <= bucket_bytes
        offsets = [m.offset for m in bucket.members]
        assert offsets == sorted(offsets) and bucket.size == sum(m.size for m in bucket.members)
    assert BucketLayout(shapes, dtypes, bucket_bytes).describe() == layout.describe()


@pytest.mark.parametrize("xp", ARRAY_MODULES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=25, deadline=None)
@given(shapes=shapes, bucket_bytes=st.integers(1, 256), seed=st.integers(0, 2**32 - 1))
def test_flatten_unflatten_round_trip(xp, dtype, shapes, bucket_bytes, seed):
    rng = np.random.default_rng(seed)
    arrays = [xp.asarray(rng.integers(-100, 100, size=s).astype(dtype)) for s in shapes]
    originals = [asnumpy(a).copy() for a in arrays]
    layout = BucketLayout(shapes, [dtype] * len(shapes), bucket_bytes)
    flats = [b.flatten(arrays, xp.empty(b.size, dtype=dtype)) for b in layout.buckets]
    for a in arrays:
        a[...] = 0
    for bucket, flat in zip(layout.buckets, flats):
        bucket.unflatten(flat, arrays)
    for a, original in zip(arrays, originals):
        assert asnumpy(a).shape == original.shape
        np.testing.assert_array_equal(asnumpy(a), original)


def test_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer, got 0"):
        BucketLayout([(2,)], [np.float32], 0)
    with pytest.raises(TypeError, match="dtype int32 is not supported"):
        BucketLayout([(2,)], [np.int32])
    bucket = BucketLayout([(4,)], [np.float32]).buckets[0]
    assert bucket.flat_view([np.zeros((4, 2))[:, 0]]) is None
