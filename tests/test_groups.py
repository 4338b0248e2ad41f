"""Buckets sent as one group (a DDP bucket's parameters: one payload, one call), the
verification's comparison of many small masks at once (run by run, or as one JoinedMasks) and
the DDP hook's masks laid out in one storage, on one process, against the bucket-by-bucket path
and the masked identity; the multi-rank checks are the DDP scenarios
(tests/mpi_scripts/ddp_scenarios.py: equality with DDP's all-reduce at 2 and 4 ranks, a mask
moved on one rank raising everywhere, resync)."""
import tracemalloc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from pacmpi import MPICollectives, kernels
from pacmpi.adapters.masks import MaskBinding
from pacmpi.arrays import supported_float_dtypes
from pacmpi.engine import BucketSpec, JoinedMasks, StepEngine
from pacmpi.payloads import Compacted, Gathered, TernaryWords
from pacmpi.ternary import ternary_key

DTYPES = [d.name for d in supported_float_dtypes()]


@pytest.fixture(params=["numpy", "numba"])
def route(request):
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(None)


def _engine(sizes, dtype, **kw):
    specs = [BucketSpec(f"t{i}", np.dtype(dtype), n) for i, n in enumerate(sizes)]
    return StepEngine(MPICollectives(comm=MPI.COMM_SELF), specs, **kw)


def _bits(array):
    """Bit patterns, so NaN compares equal to the same NaN."""
    return array.view(f"u{array.dtype.itemsize}")


member = st.tuples(st.integers(0, 40), st.sampled_from([None, 0.0, 0.3, 1.0]))


@settings(max_examples=60, deadline=None,  # the route holds for every example
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(member, min_size=1, max_size=8), dtype=st.sampled_from(DTYPES),
       quantize=st.sampled_from([None, "fp16"]), in_place=st.booleans(),
       stable_steps=st.integers(0, 1), nonfinite=st.booleans(), seed=st.integers(0, 2**31))
def test_a_group_sends_and_restores_what_its_buckets_would_one_by_one(
        route, members, dtype, quantize, in_place, stable_steps, nonfinite, seed):
    """Members of any size (0 and 1 included), unmasked, with no survivor, some or all;
    packed or sent dense with their mask (``stable_steps``); NaN and Inf among the values:
    the group's payload is its members' payloads back to back, bit for bit, with the same
    counters, and its decode leaves each member as the bucket's own decode does: the masked
    gradient (float16's rounding with quantize="fp16")."""
    rng = np.random.default_rng(seed)
    sizes = [n for n, _ in members]
    masks = [None if d is None else rng.random(n) < d for n, d in members]
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    options = dict(quantize=quantize, stable_steps=stable_steps)
    grouped, alone = _engine(sizes, dtype, **options), _engine(sizes, dtype, **options)
    slots = tuple(range(len(sizes)))
    for step in range(2):
        grad = rng.integers(-50, 50, size=int(offsets[-1])).astype(np.float32)
        if nonfinite and grad.size:
            grad[rng.integers(0, grad.size, size=2)] = [np.nan, np.inf]
        grad = grad.astype(dtype)
        for engine in (grouped, alone):
            engine.begin_step(lambda: masks)
        flat, each = grad.copy(), grad.copy()
        wire, ctx = grouped.encode(slots, flat, in_place=in_place)
        parts = [alone.encode(b, each[offsets[b]:offsets[b + 1]], in_place=in_place) + (b,)
                 for b in slots]
        np.testing.assert_array_equal(
            _bits(wire), _bits(np.concatenate([w for w, _, _ in parts]).astype(wire.dtype)))
        grouped.decode(wire, ctx, flat)
        for w, c, b in parts:
            alone.decode(w, c, each[offsets[b]:offsets[b + 1]])
        np.testing.assert_array_equal(_bits(flat), _bits(each))
        kept = np.concatenate([np.ones(n, bool) if m is None else m
                               for n, m in zip(sizes, masks)] + [np.zeros(0, bool)])
        wanted = np.where(kept, grad.astype(np.float16) if quantize else grad, 0).astype(dtype)
        np.testing.assert_array_equal(_bits(flat), _bits(wanted))
        for engine in (grouped, alone):
            engine.end_step()
    counters = ("bytes_sent", "packed_reductions", "dense_reductions", "dense_fallbacks",
                "dense_elements_equivalent", "dense_bytes_equivalent")
    assert {k: grouped.stats[k] for k in counters} == {k: alone.stats[k] for k in counters}


def test_a_groups_positions_are_built_once_per_mask_change():
    """The group's survivor positions are rebuilt when a member's mask changes, not per step;
    a group not sent in a step lets go of them at its end (DDP rebuilt its buckets)."""
    sizes = [30, 5, 40]
    rng = np.random.default_rng(1)
    masks = [rng.random(30) < 0.5, None, rng.random(40) < 0.5]
    engine = _engine(sizes, np.float32, stable_steps=0)
    grad = np.ones(75, np.float32)
    built = []
    for step in range(4):
        if step == 2:
            masks[2][:] = ~masks[2]
        engine.begin_step(lambda: masks)
        wire, ctx = engine.encode((0, 1, 2), grad.copy())
        built.append(engine.groups[(0, 1, 2)])
        assert wire.size == masks[0].sum() + 5 + masks[2].sum()
        engine.end_step()
    assert built[0] is built[1] and built[1] is not built[2] and built[2] is built[3]
    engine.begin_step(lambda: masks)
    engine.encode((0,), grad[:30].copy())
    engine.end_step()
    assert list(engine.groups.keys()) == [(0,)]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(member, min_size=1, max_size=8), dtype=st.sampled_from(DTYPES),
       error_feedback=st.booleans(), stable_steps=st.integers(0, 2),
       regroup=st.sampled_from(["none", "split", "reverse"]), in_place=st.booleans(),
       seed=st.integers(0, 2**31),
       ternary_scale=st.sampled_from(["tensor", 1, 3, 16]), positions=st.booleans())
# Sent dense when DDP rebuilds (nothing pruned), as the hook's first steps are: the group's
# residual is then reversed in place and sliced, not copied.
@example(members=[(5, None), (7, 1.0), (1, None), (9, None)], dtype="float32",
         error_feedback=True, stable_steps=0, regroup="reverse", in_place=False, seed=1,
         ternary_scale="tensor", positions=False)
@example(members=[(33, None), (2, None), (17, 1.0)], dtype="float64", error_feedback=True,
         stable_steps=1, regroup="reverse", in_place=True, seed=2, ternary_scale=3,
         positions=False)
# A mask checked dense for two steps (the second with a residual) and through the rebuild.
@example(members=[(40, 0.5), (9, None), (70, 0.3), (5, 0.6)], dtype="float32",
         error_feedback=True, stable_steps=2, regroup="reverse", in_place=True, seed=4,
         ternary_scale="tensor", positions=False)
def test_a_ternary_group_sends_what_its_buckets_would_one_by_one(
        route, members, dtype, error_feedback, stable_steps, regroup, in_place, seed,
        ternary_scale, positions):
    """Ternary: each member its own scale, key and residual, so the group's words are its
    members' words back to back and its decode theirs, step after step, through a mask
    change, error feedback on and off, and the groups changing (DDP rebuilding its buckets:
    ``regroup`` splits the group in two at step 2, the residuals following their buckets, its
    members in their order or, as DDP's rebuilt buckets take them, reversed);
    the checkpointed residuals are the buckets' own (zeros for one that never sent a value).
    The grouped engine agrees its first group's scales inside the verification (as the DDP
    hook does for its bucket 0), the other engine in an all-reduce of their own; with
    ``in_place`` the grouped engine quantizes a packed group from its compacted front, reading
    the scales through the mask's bits and updating the residuals at the encode (no positions,
    no spare), and every word, value and residual is still the same; ``positions``: in place
    through survivor positions instead, as a group at low density is (the residual still
    updated at the encode). While a member's mask is checked dense, the grouped engine keeps
    the residual of its survivors only (the other engine every coordinate's, 0 where pruned)
    and still sends the same words. With blocks of
    ``ternary_scale`` elements a scale, a member's blocks go on along its own key's numbers
    as the bucket's do alone."""
    rng = np.random.default_rng(seed)
    sizes = [n for n, _ in members]
    masks = [None if d is None else rng.random(n) < d for n, d in members]
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    options = dict(quantize="ternary", error_feedback=error_feedback,
                   stable_steps=stable_steps, seed=7, ternary_scale=ternary_scale)
    grouped, alone = _engine(sizes, dtype, **options), _engine(sizes, dtype, **options)
    grouped.ternary.POSITIONS_AT_MOST = np.inf if positions else 0.0
    alone.packing.residual_of_survivors = False  # sent dense, its residual covers every coordinate
    everything = tuple(range(len(sizes)))
    for step in range(4):
        if step == 3 and masks[0] is not None:
            masks[0][:] = ~masks[0]
        groups, order = [everything], everything  # order: the grouped engine's flat layout
        if regroup != "none" and step >= 2 and len(sizes) > 1:
            order = everything[::-1] if regroup == "reverse" else everything
            groups = [order[:len(sizes) // 2], order[len(sizes) // 2:]]
        grad = (rng.standard_normal(int(offsets[-1])) * 10.0).astype(dtype)
        each = grad.copy()
        flat = np.concatenate([grad[offsets[b]:offsets[b + 1]] for b in order])
        at = dict(zip(order, np.concatenate([[0], np.cumsum([sizes[b] for b in order])])))

        def span(group):
            return flat[at[group[0]]:at[group[-1]] + sizes[group[-1]]]
        first = groups[0]
        if regroup == "reverse" and step == 2 and len(first) > 1:
            grouped.reverse_residuals(everything)  # as the DDP hook says when DDP rebuilds
        grouped.begin_step(lambda: masks, scale_units=(first,),
                           scale_flats=lambda: {first: span(first)})
        alone.begin_step(lambda: masks)
        for group in groups:
            grouped.agree_scales({group: span(group)})
            wire, ctx = grouped.encode(group, span(group), in_place=in_place)
            views = {b: each[offsets[b]:offsets[b + 1]] for b in group}
            alone.agree_scales(views)
            parts = [alone.encode(b, views[b]) + (b,) for b in group]
            # (A bucket that sends nothing sends its empty flat: not a word type to join.)
            sent = [w for w, _, _ in parts if w.size] or [wire[:0]]
            np.testing.assert_array_equal(_bits(wire), _bits(np.concatenate(sent)))
            grouped.decode(wire, ctx, span(group))
            for w, c, b in parts:
                alone.decode(w, c, views[b])
        back = np.concatenate([flat[at[b]:at[b] + sizes[b]] for b in everything])
        np.testing.assert_array_equal(_bits(back), _bits(each))
        for engine in (grouped, alone):
            engine.end_step()
        if in_place:
            report = grouped.memory_report()
            if not positions:
                assert all(g.arrays()[0] is None for g in grouped.groups), "positions"
            assert report["residuals"] == sum(  # one array per group, no spare
                e.values.nbytes for e in grouped.residuals.entries().values())
        saved, wanted = grouped.state_dict()["residuals"], alone.state_dict()["residuals"]
        assert set(wanted) <= set(saved)  # a bucket that sent nothing alone kept no residual
        for b in saved:
            # Where the mask now prunes, a member's residual is dropped; a bucket that sends
            # nothing at all (every coordinate pruned) keeps the residual it had.
            kept = np.ones(sizes[b], bool) if masks[b] is None else masks[b]
            want = wanted.get(b, np.zeros(sizes[b], saved[b].dtype))
            np.testing.assert_array_equal(_bits(saved[b][kept]), _bits(want[kept]))


def _rebuild_then_pack(engines, sizes, masks, extra, steps=6, reversing=()):
    """Steps as DDP's hook takes them: one group of every bucket, DDP's reversed rebuild into
    two groups at step 2 (dense: no masks yet; the engines named in ``reversing`` told so, as
    the hook tells its engine), ``masks`` from step 3 on (packed at once);
    each step's peak allocation above its start per engine, as a ratio of the gradient bytes,
    into ``extra[step, name]``. Returns the rebuilt groups' bucket order."""
    total, everything = sum(sizes), tuple(range(len(sizes)))
    for step in range(steps):
        grad = np.random.default_rng(step).standard_normal(total).astype(np.float32)
        order = everything if step < 2 else everything[::-1]
        groups = [order] if step < 2 else [order[:2], order[2:]]
        given = [None] * len(sizes) if step < 3 else masks
        flats = []
        for name, engine in engines.items():
            flat = np.concatenate([grad[sum(sizes[:b]):sum(sizes[:b + 1])] for b in order])
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            if step == 2 and name in reversing:
                engine.reverse_residuals(everything)
            engine.begin_step(lambda: given)
            lo = 0
            for group in groups:
                hi = lo + sum(sizes[b] for b in group)
                engine.agree_scales({group: flat[lo:hi]})
                wire, ctx = engine.encode(group, flat[lo:hi], in_place=True)  # as the hook
                engine.decode(wire, ctx, flat[lo:hi])
                lo = hi
            engine.end_step()
            extra[step, name] = (tracemalloc.get_traced_memory()[1] - before) / grad.nbytes
            flats.append(flat)
        for flat in flats[1:]:
            np.testing.assert_array_equal(flats[0], flat)
    return order


def test_ddps_reversed_rebuild_slices_the_residual_instead_of_copying_it():
    """DDP's first bucket holds every parameter in the model's order, its rebuilt buckets in
    the reverse: the first group's residual is reversed in place and the new groups take
    slices of it, so the rebuild allocates no second residual (the hook peaked at 1.9x the
    gradient bytes), and the new groups send what the old path's copies sent."""
    sizes = [1 << 18, 1000, 1 << 17, 7, 1 << 16]
    options = dict(quantize="ternary", error_feedback=True, seed=3)
    sliced, copied = _engine(sizes, "float32", **options), _engine(sizes, "float32", **options)
    extra = {}
    tracemalloc.start()
    try:
        # The copying path: not told of the reversal, each new group copies.
        _rebuild_then_pack({True: sliced, False: copied}, sizes, None, extra, steps=3,
                           reversing={True})
    finally:
        tracemalloc.stop()
    assert extra[2, True] < 0.5 < extra[2, False], extra  # the copies: a second residual
    residuals = [e.values for e in sliced.residuals.entries().values()]
    assert len(residuals) == 2 and residuals[0].base is residuals[1].base is not None
    for b, residual in sliced.state_dict()["residuals"].items():
        np.testing.assert_array_equal(residual, copied.state_dict()["residuals"][b])


def test_groups_sharing_one_residual_are_cut_together_when_packing_starts():
    """After DDP's reversed rebuild the groups' residuals are slices of one array. When their
    masks start being packed, each group compacts its slice in place and keeps it as a slice
    (no copy beside the whole array: the hook peaked at 1.4x the gradient bytes at density
    0.5); at the step's end the parts move to the array's front and it is cut to the
    survivors. Every value and residual equals the copying path's (each new group its own
    array, cut alone in place), and the transition allocates no more than that path does; the
    control that never cuts keeps the whole array."""
    sizes = [1 << 18, 1000, 1 << 17, 7, 1 << 16]
    rng = np.random.default_rng(5)
    masks = [rng.random(n) < 0.5 for n in sizes]
    options = dict(quantize="ternary", error_feedback=True, seed=3, stable_steps=0)

    def engines():
        made = {name: _engine(sizes, "float32", **options)
                for name in ("uncut", "copied", "shared")}  # (the first in a step pays more)
        made["uncut"].residuals.shrink_shared = lambda: None
        return made

    extra = {}
    tracemalloc.start()
    try:
        # "copied" is not told of the reversal: each new group its own array.
        _rebuild_then_pack(engines(), sizes, masks, {}, reversing={"uncut", "shared"})
        measured = engines()  # (the first run compiled every kernel)
        order = _rebuild_then_pack(measured, sizes, masks, extra, reversing={"uncut", "shared"})
    finally:
        tracemalloc.stop()
    survivors = sum(int(m.sum()) for m in masks)
    shared = [e.values for e in measured["shared"].residuals.entries().values()]
    assert len(shared) == 2 and shared[0].base is shared[1].base is not None
    assert shared[0].base.size == survivors  # cut to the survivors
    assert measured["uncut"].residuals[order[:2]].values.base.size == sum(sizes)  # control
    # (The old path copied each packed slice out beside the whole array: +0.43 here.)
    assert extra[3, "shared"] < extra[3, "copied"] + 0.15, extra
    for b, residual in measured["shared"].state_dict()["residuals"].items():
        np.testing.assert_array_equal(residual, measured["copied"].state_dict()["residuals"][b])


class _Counting(MPICollectives):
    """MPICollectives counting its all-reduces."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.allreduces = 0

    def allreduce(self, *args, **kw):
        self.allreduces += 1
        return super().allreduce(*args, **kw)


@pytest.mark.parametrize("fused", [True, False])
def test_a_steady_groups_scales_ride_in_the_verification(fused):
    """Once a group's layout is fixed (packed, from the step after a mask is agreed), its
    scales are agreed in the verification all-reduce: one all-reduce per step, not two; the
    first step (no agreed layout yet) and a step whose mask changes take their own. The
    control (``fused=False``) takes two every step."""
    sizes = [30, 5, 12]
    masks = [np.arange(30) % 3 > 0, None, np.arange(12) < 4]
    specs = [BucketSpec(f"t{i}", np.dtype(np.float32), n) for i, n in enumerate(sizes)]
    collectives = _Counting(comm=MPI.COMM_SELF)
    engine = StepEngine(collectives, specs, quantize="ternary", stable_steps=0)
    group, counts = (0, 1, 2), []
    for step in range(5):
        if step == 3:
            masks[0][0] = not masks[0][0]
        flat = np.random.default_rng(step).standard_normal(47).astype(np.float32)
        before = collectives.allreduces
        options = dict(scale_units=(group,), scale_flats=lambda: {group: flat}) if fused else {}
        engine.begin_step(lambda: masks, **options)
        engine.agree_scales({group: flat})
        wire, ctx = engine.encode(group, flat)
        engine.decode(wire, ctx, flat)
        engine.end_step()
        counts.append(collectives.allreduces - before)
    assert counts == ([2, 1, 1, 2, 1] if fused else [2] * 5)


def test_a_nonfinite_value_sends_its_ternary_group_unquantized():
    """A NaN or Inf in one member: the whole group travels as it is (its payload is one
    array), so the non-finite values reach every rank's result as on the dense path."""
    engine = _engine([6, 5], np.float32, quantize="ternary", stable_steps=0)
    engine.begin_step(lambda: [np.array([1, 0, 1, 1, 0, 1], bool), None])
    grad = np.arange(11, dtype=np.float32)
    grad[7] = np.inf
    flat = grad.copy()
    engine.agree_scales({(0, 1): flat})
    wire, ctx = engine.encode((0, 1), flat)
    assert isinstance(ctx, Gathered) and wire.dtype == np.float32
    engine.decode(wire, ctx, flat)
    np.testing.assert_array_equal(flat, grad * np.array([1, 0, 1, 1, 0, 1] + [1] * 5))
    assert engine.stats["nonfinite_fallbacks"] == 1


def test_a_nonfinite_value_sends_a_compacted_ternary_group_as_lossless():
    """In place, the unquantized payload of a packed group is its compacted front."""
    engine = _engine([6, 5], np.float32, quantize="ternary", stable_steps=0,
                     error_feedback=True)
    mask = np.array([1, 0, 1, 1, 0, 1], bool)
    for value, kind in ((1.0, TernaryWords), (np.inf, Compacted)):
        engine.begin_step(lambda: [mask, None])
        grad = np.arange(11, dtype=np.float32)
        grad[7] = value
        flat = grad.copy()
        engine.agree_scales({(0, 1): flat})
        wire, ctx = engine.encode((0, 1), flat, in_place=True)
        assert type(ctx) is kind and (wire.base is flat) == (kind is Compacted)
        engine.decode(wire, ctx, flat)
        engine.end_step()
        if kind is Compacted:
            np.testing.assert_array_equal(flat, grad * np.concatenate([mask, [1] * 5]))
    assert engine.stats["nonfinite_fallbacks"] == 1


def test_a_groups_keys_are_its_buckets_keys():
    members = np.array([0, 1, 7, 400, 65535], dtype=np.uint64)
    assert list(ternary_key(3, 12, members, 5)) == [ternary_key(3, 12, int(b), 5)
                                                    for b in members]


def test_mask_binding_reads_every_mask_as_one_by_one():
    """MaskBinding.flats: boolean masks read in one concatenation, 0/1 float masks and a
    channels-last parameter (memory order) one by one; the same arrays as flat(i), and a mask
    changed in place or given new storage is read as it is now."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(5, 6),
                                torch.nn.Linear(6, 2))
    model[0].to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(0)
    masks = {"0.weight": torch.rand(4, 3, 3, 3, generator=gen) < 0.5,
             "1.weight": torch.rand(6, 5, generator=gen) < 0.5,
             "1.bias": (torch.rand(6, generator=gen) < 0.5).float(),
             "2.weight": torch.rand(2, 6, generator=gen) < 0.5}
    binding = MaskBinding(list(model.named_parameters()), masks, model)
    for memory_order in (False, True):
        fused = binding.flats(memory_order)
        for index, flat in enumerate(fused):
            one = binding.flat(index, memory_order)
            assert (flat is None) == (one is None)
            if flat is not None:
                assert flat.dtype == np.bool_
                np.testing.assert_array_equal(flat, one)
    for _ in range(2):  # kept, not copied: an in-place change is seen at the next read
        masks["1.weight"][0, 0] = ~masks["1.weight"][0, 0]
        assert binding.flats()[2][0] == bool(masks["1.weight"][0, 0])
    masks["2.weight"].data = ~masks["2.weight"]  # new storage: seen too
    np.testing.assert_array_equal(binding.flats()[4], masks["2.weight"].numpy().reshape(-1))


def _linear_masks(model, density=0.5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.rand(p.shape, generator=gen) < density
            for name, p in model.named_parameters() if name.endswith("weight")}


def test_mask_binding_lays_the_masks_out_in_one_storage():
    """Boolean masks of contiguous parameters become views of one storage (the tensor objects,
    shapes and values the user's), read every step as the same JoinedMasks of views: an
    in-place change through the user's tensor is read, new storage (``.data =``) too, and masks
    already back to back in one storage of the user's are not moved."""
    model = torch.nn.Sequential(*[torch.nn.Linear(5, 5) for _ in range(4)])
    masks = _linear_masks(model)
    objects, values = dict(masks), {n: m.clone() for n, m in masks.items()}
    binding = MaskBinding(list(model.named_parameters()), masks, model)
    flats = binding.flats(memory_order=True)
    assert isinstance(flats, JoinedMasks) and binding.flats(memory_order=True) is flats
    storage = {m.untyped_storage().data_ptr() for m in masks.values()}
    assert len(storage) == 1 and all(masks[n] is objects[n] for n in masks)
    for name, mask in masks.items():
        assert torch.equal(mask, values[name]) and mask.shape == values[name].shape
    np.testing.assert_array_equal(flats.whole, np.concatenate([f for f in flats if f is not None]))
    masks["2.weight"][1, 3] = ~masks["2.weight"][1, 3]  # in place, through the user's tensor
    assert binding.flats(memory_order=True)[4][8] == bool(masks["2.weight"][1, 3])
    masks["2.weight"].data = ~masks["2.weight"].clone()  # new storage: a new plan, laid out again
    again = binding.flats(memory_order=True)
    assert again is not flats and again.token is not flats.token
    np.testing.assert_array_equal(again[4], masks["2.weight"].numpy().reshape(-1))
    # Already back to back in one storage (as laid out here, or by the user): not moved.
    pointers = [m.data_ptr() for m in masks.values()]
    fresh = MaskBinding(list(model.named_parameters()), masks, model).flats(memory_order=True)
    assert [m.data_ptr() for m in masks.values()] == pointers
    np.testing.assert_array_equal(fresh.whole, again.whole)


def test_mask_binding_joins_only_masks_it_can():
    """One tensor masking two parameters, a 0/1 float mask: a plain list, read as before."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    shared = torch.rand(4, 4) < 0.5
    for masks in ({"0.weight": shared, "1.weight": shared},
                  {"0.weight": shared.clone(), "1.weight": shared.float()}):
        pointers = {n: m.data_ptr() for n, m in masks.items()}
        binding = MaskBinding(list(model.named_parameters()), masks, model)
        flats = binding.flats()
        assert not isinstance(flats, JoinedMasks)
        assert {n: m.data_ptr() for n, m in masks.items()} == pointers  # not moved
        np.testing.assert_array_equal(flats[0], shared.numpy().reshape(-1))
        np.testing.assert_array_equal(flats[2], masks["1.weight"].numpy().reshape(-1) != 0)


def test_snapshots_of_joined_masks_are_views_of_their_bits_where_aligned():
    """The engine keeps the joined masks' bits (to compare them as one array each step); the
    snapshot of a mask starting and ending on a byte of them is a view of those bits, not a
    second copy, and stays one when another mask changes (the old bits then let go): the
    memory report counts the bits once. A 13-coordinate mask puts the ones after it off the
    bytes: those keep their own bits (the control). Fingerprints and packing as before."""
    sizes = [64, 3, 24, 13, 40, 16]
    masked = [0, 2, 3, 4, 5]
    rng = np.random.default_rng(4)
    whole = rng.random(sum(sizes[b] for b in masked)) < 0.5
    flats, at = [None] * len(sizes), 0
    for b in masked:
        flats[b] = whole[at:at + sizes[b]]
        at += sizes[b]
    reference = _engine(sizes, np.float32, stable_steps=1)
    engine = _engine(sizes, np.float32, stable_steps=1)

    def shared(engine):
        bits = engine.check._observed.joined.bitmap.bits
        return [b for b in masked if engine.tracker.buckets[b].mask.bits.base is bits]

    old = None
    for step in range(4):
        if step == 2:  # a mask changes in place: compared one by one, bits joined anew
            old = weakref.ref(engine.check._observed.joined.bitmap.bits)
            whole[70] = not whole[70]
        engine.begin_step(lambda: JoinedMasks(flats, whole, token=object()))
        reference.begin_step(lambda: [None if f is None else f.copy() for f in flats])
        assert shared(engine) == [0, 2]
        for b in masked:
            state, expected = engine.tracker.buckets[b], reference.tracker.buckets[b]
            assert (state.fingerprint, state.packed) == (expected.fingerprint, expected.packed)
            np.testing.assert_array_equal(state.mask.bits, expected.mask.bits)
        copies = sum((sizes[b] + 7) // 8 for b in (3, 4, 5))
        assert engine.memory_report()["snapshots"] == (whole.size + 7) // 8 + copies
        engine.end_step()
        reference.end_step()
    assert old() is None


@pytest.mark.parametrize("read", ["list", "joined", "joined anew"])
@pytest.mark.parametrize("changed", [None, 0, 17, 39])
def test_one_coordinate_moved_among_many_small_masks_is_seen(changed, read):
    """Forty small masks (unmasked buckets between them), read as a list (compared a run at a
    time) or as one JoinedMasks (compared as one array; "anew": a new token, so compared run by
    run): moving one coordinate of one of them in place changes that bucket's fingerprint only,
    and the step then sends it dense with its new mask. ``None``: nothing moved (the control;
    the engine then hands the tracker its very list of the last commit)."""
    rng = np.random.default_rng(2)
    sizes = [n for _ in range(40) for n in (int(rng.integers(1, 60)), 3)]
    masked = [b for b in range(len(sizes)) if b % 2 == 0]
    whole = rng.random(sum(sizes[b] for b in masked)) < 0.5
    flats, at = [None] * len(sizes), 0
    for b in masked:
        flats[b] = whole[at:at + sizes[b]]
        at += sizes[b]
    joined = JoinedMasks(flats, whole, token=object())
    engine = _engine(sizes, np.float32, stable_steps=1)
    for _ in range(2):
        engine.begin_step(lambda: joined if read != "list" else list(flats))
        engine.end_step()
    before = [state.fingerprint for state in engine.tracker.buckets]
    version, committed = engine.tracker.version, engine.tracker._committed
    if changed is not None:
        flats[2 * changed][0] = not flats[2 * changed][0]
    engine.begin_step(lambda: {"list": list(flats), "joined": joined,
                               "joined anew": JoinedMasks(flats, whole, token=object())}[read])
    after = [state.fingerprint for state in engine.tracker.buckets]
    moved = [b for b, (x, y) in enumerate(zip(before, after)) if x != y]
    assert moved == ([] if changed is None else [2 * changed])
    assert engine.tracker.version == version + (changed is not None)
    assert (engine.tracker._committed is committed) == (changed is None)
    for b in masked:
        np.testing.assert_array_equal(engine.tracker.buckets[b].mask.unpack(), flats[b])
        assert engine.tracker.buckets[b].packed == (b not in moved)


def test_unchanged_steps_add_to_stable_steps_as_one_by_one():
    """The tracker's unchanged commits owe their steps to every bucket at once: what it
    saves, and when a bucket waiting for stable_steps=3 is packed, are as if added each step."""
    masks = [np.arange(10) % 2 == 0, np.arange(6) < 6, None]
    engine = _engine([10, 6, 4], np.float32, stable_steps=3)
    packed = []
    for _ in range(6):
        engine.begin_step(lambda: masks)
        packed.append(engine.tracker.buckets[0].packed)
        engine.end_step()
    assert packed == [False, False, False, True, True, True]
    saved = engine.tracker.state_dict()["buckets"]
    assert [b["stable_steps"] for b in saved] == [5, 5, 5]
