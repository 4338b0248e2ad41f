"""PacTrainReducer on a communicator of size 1 (COMM_SELF): the defined single-rank behaviour,
pickling without the communicator, and NumPy/CuPy agreement."""
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from pacmpi import EngineOptions, MPICollectives, PacTrainReducer, RankInputError
from pacmpi.arrays import check_float_dtype, supported_float_dtypes

from xp_util import ARRAY_MODULES, asnumpy


def local(masks, **kwargs):
    return PacTrainReducer(masks, comm=MPI.COMM_SELF, **kwargs)


def grads_for(xp, step):
    rng = np.random.default_rng(step)
    return [xp.asarray(rng.integers(-8, 9, size=s).astype(np.float32)) for s in [(6, 7), (5,)]]


@pytest.mark.parametrize("xp", ARRAY_MODULES)
@pytest.mark.parametrize("quantize", [None, "fp16"])
def test_single_rank_reduce_is_the_masked_identity(xp, quantize):
    mask = np.random.default_rng(3).random((6, 7)) < 0.3
    reducer = local([xp.asarray(mask), None], quantize=quantize, stable_steps=0)
    for step in range(3):
        grads = grads_for(xp, step)
        expected = [asnumpy(grads[0]) * mask, asnumpy(grads[1])]
        reducer.reduce(grads)
        for g, e in zip(grads, expected):
            np.testing.assert_array_equal(asnumpy(g), e)
    assert reducer.stats["packed_reductions"] == 3


@pytest.mark.parametrize("xp", ARRAY_MODULES)
@pytest.mark.parametrize("quantize", [None, "ternary"])
@pytest.mark.parametrize("dtype", [d.name for d in supported_float_dtypes()])
def test_numpy_and_array_module_reducers_agree(xp, quantize, dtype):
    mask = np.random.default_rng(4).random((6, 7)) < 0.5
    dtype = check_float_dtype(dtype)
    results = []
    for module in (np, xp):
        reducer = local([module.asarray(mask), None], quantize=quantize, seed=11)
        out = []
        for step in range(3):
            grads = [module.asarray(np.random.default_rng(step).standard_normal(s)
                                    .astype(dtype)) for s in [(6, 7), (5,)]]
            reducer.reduce(grads)
            out.append([asnumpy(g) for g in grads])
        results.append(out)
    for a, b in zip(*results):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_reducer_pickles_without_its_communicator():
    mask = np.ones((6, 7), bool)
    mask[0] = False
    reducer = local([mask, None], quantize="ternary")
    reducer.reduce(grads_for(np, 0))
    clone = pickle.loads(pickle.dumps(reducer))
    assert clone.__dict__["_collectives"] is None and clone.step == 1
    assert clone.state_dict()["tracker"] == reducer.state_dict()["tracker"]
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(MPICollectives(comm=MPI.COMM_SELF))


def test_bad_arguments_name_the_bad_value():
    with pytest.raises(RankInputError, match="verify_every must be a positive integer, got 0"):
        local([None], verify_every=0)
    with pytest.raises(RankInputError, match="stable_steps must be a non-negative integer"):
        local([None], stable_steps=-1)
    with pytest.raises(ValueError, match="cuda_aware must be 'auto', True or False"):
        MPICollectives(comm=MPI.COMM_SELF, cuda_aware="yes")


@pytest.mark.parametrize("library, forced_ok", [(False, False), (None, True), (True, True)])
def test_cuda_aware_true_is_refused_where_the_library_says_no(monkeypatch, library, forced_ok):
    """MPI handed device pointers by a library without CUDA support reads them as host
    memory (a segmentation fault on a GPU): cuda_aware=True is refused where the library says
    no, kept where it says yes or cannot say; "auto" follows the answer."""
    from pacmpi import collectives
    monkeypatch.setattr(collectives, "cuda_support", lambda MPI: (library, "the query"))
    assert MPICollectives(comm=MPI.COMM_SELF, cuda_aware="auto").cuda_aware is bool(library)
    assert MPICollectives(comm=MPI.COMM_SELF, cuda_aware=False).cuda_aware is False
    if forced_ok:
        assert MPICollectives(comm=MPI.COMM_SELF, cuda_aware=True).cuda_aware is True
    else:
        with pytest.raises(ValueError, match=r"cuda_aware=True, but the MPI library has no "
                                             r"CUDA support \(the query says so\)"):
            MPICollectives(comm=MPI.COMM_SELF, cuda_aware=True)
    reducer = local([None])
    with pytest.raises(RankInputError, match="gradient 0: expected a numpy.ndarray"):
        reducer.reduce([np.float32(1.0)])


DTYPES = [np.float16, np.float32, np.float64]


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1,
                       max_size=5),
       dtype=st.sampled_from(DTYPES), density=st.floats(0, 1), seed=st.integers(0, 2**31),
       bucket_bytes=st.integers(1, 300))
def test_pack_unpack_round_trip_sends_exactly_the_survivors(shapes, dtype, density, seed,
                                                             bucket_bytes):
    rng = np.random.default_rng(seed)
    masks = [np.asarray(rng.random(s) < density) for s in shapes]
    reducer = local(masks, stable_steps=0, bucket_bytes=bucket_bytes)
    grads = [np.asarray(rng.integers(-50, 50, size=s), dtype=dtype) for s in shapes]
    expected = [g * m for g, m in zip(grads, masks)]
    reducer.reduce(grads)
    for g, e in zip(grads, expected):
        np.testing.assert_array_equal(g, e)
    itemsize = np.dtype(dtype).itemsize
    packed = sum(int(m.sum()) if m.sum() < m.size else m.size for m in
                 _bucket_masks(reducer, masks))
    assert reducer.stats["bytes_sent"] == packed * itemsize


def _bucket_masks(reducer, masks):
    """Each bucket's flat mask: a fully kept bucket is sent dense, others exactly packed."""
    return [np.concatenate([masks[m.index].reshape(-1) for m in b.members])
            for b in reducer.layout.buckets]


def test_resume_at_another_world_size_warns_and_drops_residuals():
    mask = np.random.default_rng(5).random((6, 7)) < 0.5
    reducer = local([mask, None], quantize="ternary", error_feedback=True, shapes=[(6, 7), (5,)],
                    dtypes=[np.float32] * 2)
    reducer.reduce(grads_for(np, 0))
    saved = reducer.state_dict()
    assert saved["residuals"], "ternary with error feedback keeps residuals"
    same = local([mask, None], quantize="ternary", error_feedback=True, shapes=[(6, 7), (5,)],
                 dtypes=[np.float32] * 2)
    same.load_state_dict(saved)
    assert same.state_dict()["residuals"].keys() == saved["residuals"].keys()
    saved["world_size"] = 4
    other = local([mask, None], quantize="ternary", error_feedback=True, shapes=[(6, 7), (5,)],
                  dtypes=[np.float32] * 2)
    with pytest.warns(RuntimeWarning, match="checkpoint was written on 4 ranks"):
        other.load_state_dict(saved)
    assert other.state_dict()["residuals"] == {} and other.step == 1


class _CountingCollectives(MPICollectives):
    """COMM_SELF transport that records each all-reduce's op and length."""

    def __init__(self):
        super().__init__(comm=MPI.COMM_SELF)
        self.calls = []

    def allreduce(self, buf, op="sum", name=None):
        self.calls.append((op, buf.size))
        super().allreduce(buf, op, name=name)


def test_ternary_scales_ride_on_the_verification_allreduce():
    """Once packing is agreed, a verified ternary step makes one MAX all-reduce (verification
    with every bucket's scale) and one SUM per bucket; an unverified step agrees all scales
    in one MAX all-reduce. Results equal a reducer that agrees scales separately."""
    mask = np.random.default_rng(6).random((6, 7)) < 0.5
    collectives = _CountingCollectives()
    fused = PacTrainReducer([mask, None], collectives=collectives, quantize="ternary",
                            stable_steps=0, verify_every=2, bucket_bytes=64)
    separate = local([mask, None], quantize="ternary", stable_steps=0, verify_every=2,
                     bucket_bytes=64, shapes=[(6, 7), (5,)], dtypes=[np.float32] * 2)
    max_calls = []
    for step in range(4):
        grads, again = grads_for(np, step), grads_for(np, step)
        collectives.calls.clear()
        fused.reduce(grads)
        for b in range(len(separate.layout)):  # bucket by bucket: a scale all-reduce each
            separate.mark_ready(b, again)
        separate.wait(again)
        max_calls.append(sum(op == "max" for op, _ in collectives.calls))
        for g, a in zip(grads, again):
            np.testing.assert_array_equal(g, a)
    # step 0: verification, then the first agreed packing's scales on their own;
    # step 2 (verified): fused; steps 1 and 3: one all-reduce for both buckets' scales.
    assert max_calls == [2, 1, 1, 1], max_calls
    assert sum(op == "sum" for op, _ in collectives.calls) == len(fused.layout)


def test_one_options_object_for_every_front_end():
    """EngineOptions holds each knob and its default once: a front end given the object or
    the same knobs as keywords runs the same engine; keywords replace the object's values;
    an unknown knob is a TypeError naming the front end, a bad value a ValueError naming it,
    and a front end refuses the knobs it does not take."""
    from pacmpi.sharded import ShardedReducer

    options = EngineOptions(quantize="ternary", error_feedback=True, seed=5, ternary_scale=64)
    assert options == EngineOptions(quantize="ternary", error_feedback=True, seed=np.int64(5),
                                    ternary_scale=np.int64(64))
    by_object, by_keywords = local([None], options=options), local(
        [None], quantize="ternary", error_feedback=True, seed=5, ternary_scale=64)
    assert by_object.options == by_keywords.options == by_object.engine.options
    replaced = local([None], options=options, seed=6)
    assert (replaced.seed, replaced.quantize, options.seed) == (6, "ternary", 5)
    assert pickle.loads(pickle.dumps(options)) == options
    with pytest.raises(TypeError, match="PacTrainReducer\\(\\) got an unexpected keyword "
                                        "argument 'quantise'"):
        PacTrainReducer([None], collectives=MPICollectives(comm=MPI.COMM_SELF), quantise=None)
    with pytest.raises(ValueError, match="verify_every must be a positive integer, got 0"):
        EngineOptions(verify_every=0)
    with pytest.raises(TypeError, match="ShardedReducer\\(\\) got an unexpected keyword "
                                        "argument 'stable_steps'"):
        ShardedReducer([None], shapes=[(3,)], dtypes=[np.float32], comm=MPI.COMM_SELF,
                       stable_steps=2)
    # A bad value is raised on every rank together, as the reducer's other input errors.
    with pytest.raises(RankInputError, match="verify_every must be a positive integer"):
        ShardedReducer([None], shapes=[(3,)], dtypes=[np.float32], comm=MPI.COMM_SELF,
                       verify_every=0)
