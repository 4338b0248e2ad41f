"""MaskCheck: what a verification reads, compares and agrees on, and the errors it raises.

At a verified step every rank reads its masks, keeps a snapshot of each (a
:class:`pacmpi.bitmaps.Bitmap`, 1 bit per coordinate: what the step packs with, not the
caller's array) with its fingerprint and survivor count, and digests them with the layout and
the options into a few int64 fields that one tiny MAX all-reduce compares
(:func:`pacmpi.verify.agree`). A difference raises on every rank together, naming the ranks
and buckets; ``on_mismatch="resync"`` adopts rank 0's masks instead.

Reading is the cost that grows with the number of tensors, so unchanged masks are found
cheaply: masks read as one :class:`JoinedMasks` are compared as one array; small masks read
as a list are compared a run at a time (:meth:`MaskCheck.observe`); an unchanged mask keeps
its snapshot and fingerprint, and when nothing changed the last read's result is returned
as it was (the tracker then sees the very list it committed).
"""
from typing import NamedTuple

import numpy as np

from .arrays import array_module
from .bitmaps import CHUNK, Bitmap
from .errors import LayoutMismatchError
from .hashing import digest_ints
from .options import TERNARY_SCALES
from .tracker import MaskTracker
from .verify import agree, gather_details, offending_ranks, raise_together

__all__ = ["MaskCheck", "JoinedMasks", "STRUCTURE_FIELDS", "MASK_FIELDS"]

_MAGIC = 0x7AC9
_QUANTIZE_CODES = {None: 0, "fp16": 1, "ternary": 2}
_LAYOUT_FIELDS = ("layout0", "layout1", "layout2", "layout3")
STRUCTURE_FIELDS = ("magic", "step", "buckets", "elements") + _LAYOUT_FIELDS + (
    "quantize", "scales", "average", "word")
MASK_FIELDS = ("mask0", "mask1", "mask2", "mask3", "survivors", "version")


class JoinedMasks(list):
    """What ``read_masks()`` may return instead of a plain list: the same flat masks (one per
    bucket, ``None`` for an unmasked one), every one a view of ``whole``, one boolean array
    holding the masked buckets' masks back to back in bucket order. ``token`` is an object that
    stays the same exactly as long as the views partition ``whole`` the same way. The engine
    then checks and compares the masks as one array per step, whatever their number."""

    __slots__ = ("whole", "token")

    def __init__(self, flats, whole, token):
        super().__init__(flats)
        self.whole, self.token = whole, token


class Snapshot(NamedTuple):
    """One bucket's agreed mask: its bits and ``(fingerprint, survivors)``."""
    bitmap: object
    observation: tuple


_NO_SNAPSHOT = Snapshot(None, None)


class Run(NamedTuple):
    """Small masks compared together: their bits as last read, and the snapshots those
    matched."""
    bits: object
    snapshots: list


class JoinedRead(NamedTuple):
    """The last JoinedMasks read: its token and its whole array's bits."""
    token: object
    bitmap: object


class Observed(NamedTuple):
    """The last read's result: the unmasked buckets, each bucket's snapshot (``None``:
    unmasked) and observation, and how it was read (``None``: as a list)."""
    unmasked: list
    snapshots: list
    observations: list
    joined: object


class MaskDigest(NamedTuple):
    """The observations last digested, as values, and their fields."""
    observations: list
    values: tuple
    fields: dict


class MaskCheck:
    """Snapshots, fingerprints and digests of the masks of ``buckets`` (their
    :class:`pacmpi.engine.BucketSpec`) under the front end's ``layout`` description. Its
    caches are rebuilt on demand, so never pickled."""

    def __init__(self, buckets, layout):
        self.buckets, self.layout = buckets, layout
        self.clear()

    def clear(self):
        self._snapshots = {}  # bucket -> Snapshot
        self._runs = {}  # buckets tuple -> Run
        self._observed = self._digest = self._layout_fields = None
        self._checked = None  # the JoinedMasks token whose sizes were checked

    def __getstate__(self):
        return {"buckets": self.buckets, "layout": self.layout}

    def __setstate__(self, state):
        self.__init__(state["buckets"], state["layout"])

    def forget_snapshots(self):
        """After a resync: every mask is read anew."""
        self._snapshots.clear()

    # ------------------------------------------------------------------ reading
    def checked(self, flats):
        """``flats`` as a list of one flat mask (or ``None``) per bucket, sizes checked
        (ValueError)."""
        token = getattr(flats, "token", None)
        if token is not None and token is self._checked:
            return flats  # the same partition, sizes checked already
        flats = flats if isinstance(flats, list) else list(flats)
        if len(flats) != len(self.buckets):
            raise ValueError(f"{len(flats)} masks for {len(self.buckets)} buckets")
        for spec, flat in zip(self.buckets, flats):
            if flat is not None and flat.size != spec.size:
                raise ValueError(f"mask of {spec.name} has {flat.size} elements, the bucket "
                                 f"has {spec.size}")
        if token is not None:
            self._checked = token
        return flats

    def observe(self, flats):
        """Agreed-upon snapshots of ``flats`` with their (fingerprint, survivors).

        An unchanged mask costs one comparison pass and reuses the previous snapshot's
        fingerprint; the snapshot, not the caller's array, is what the step packs with.
        """
        last, joined = self._observed, None
        if isinstance(flats, JoinedMasks):
            if (last is not None and last.joined is not None and last.joined.token is flats.token
                    and last.joined.bitmap.matches(flats.whole)):
                return last.snapshots, last.observations  # as at the last read, as one array
            joined = JoinedRead(flats.token, Bitmap(flats.whole))
        if joined:
            # Compared one by one when not read as before (a mask changed, or a new layout):
            # the runs' bits, another copy of the masks, are not kept for them.
            runs, unchanged = [], {
                b for b, flat in enumerate(flats) if flat is not None and b in self._snapshots
                and self._snapshots[b].bitmap.matches(flat)}
        else:
            runs = list(self._mask_runs(flats))
            unchanged = self._unchanged(runs)
        unmasked = [b for b, flat in enumerate(flats) if flat is None]
        if last is not None and last.unmasked == unmasked and len(unchanged) + len(
                unmasked) == len(flats):  # every mask as its snapshot: the last result holds
            self._observed = last._replace(joined=joined)
            if joined:
                joined.bitmap.lend(last.snapshots)
            return last.snapshots, last.observations
        snapshots, observations = [], []
        for b, flat in enumerate(flats):
            previous = self._snapshots.get(b)
            if flat is None:
                self._snapshots.pop(b, None)
                snapshots.append(None)
                observations.append((None, None))
                continue
            if b not in unchanged:
                if flat.dtype != np.bool_:
                    flat = flat != 0
                # (joined masks not unchanged were compared above already)
                if previous is None or joined or not previous.bitmap.matches(flat):
                    bitmap = Bitmap(flat)
                    previous = self._snapshots[b] = Snapshot(bitmap, MaskTracker.observe(bitmap))
            snapshots.append(previous.bitmap)
            observations.append(previous.observation)
        # Each run kept with the snapshots its masks now match.
        self._runs = {run: Run(bits, [self._snapshots[b].bitmap for b in run])
                      for run, bits in runs}
        if joined:  # the snapshots hold views of the masks' bits where they can
            joined.bitmap.lend(snapshots)
        self._observed = Observed(unmasked, snapshots, observations, joined)
        return snapshots, observations

    def _mask_runs(self, flats):
        """Runs of small masked buckets (under :data:`pacmpi.bitmaps.CHUNK` coordinates
        together; unmasked ones between them skipped) with boolean masks of one module: the
        masks a step compares with one concatenation and one ``packbits`` per run instead of
        one per bucket, so the comparison's cost does not grow with the number of tensors.
        Yields ``(buckets, bits)``."""
        run, size = [], 0
        for b, flat in enumerate(flats + [False]):
            if flat is None:  # an unmasked bucket does not end a run
                continue
            small = flat is not False and flat.dtype == np.bool_ and flat.size < CHUNK
            if run and (not small or size + flat.size > CHUNK
                        or type(flat) is not type(flats[run[0]])):
                if len(run) > 1:
                    xp = array_module(flats[run[0]])
                    yield tuple(run), xp.packbits(xp.concatenate([flats[r] for r in run]))
                run, size = [], 0
            if small:
                run.append(b)
                size += flat.size

    def _unchanged(self, runs):
        """Buckets whose masks are those of their snapshots, found run by run of
        :meth:`_mask_runs`: the runs that read exactly as when they last matched."""
        same = set()
        for run, bits in runs:
            cached = self._runs.get(run)
            if (cached is not None
                    and all(self._snapshots.get(b, _NO_SNAPSHOT).bitmap is snapshot
                            for b, snapshot in zip(run, cached.snapshots))
                    and bool(array_module(bits).array_equal(bits, cached.bits))):
                same.update(run)
        return same

    # ------------------------------------------------------------------ digests
    def fields(self, observations, step, options, word, version):
        """The fields every rank compares: the structure (layout, ``options``, ``word``: the
        ternary word type's number, 0 for none) and the masks' digest at ``step``."""
        scale = options.ternary_scale
        fields = {
            "magic": _MAGIC, "step": step, "buckets": len(self.buckets),
            "quantize": _QUANTIZE_CODES[options.quantize], "average": int(options.average),
            "scales": (0 if options.quantize != "ternary" else
                       TERNARY_SCALES.index(scale) + 1 if isinstance(scale, str) else
                       len(TERNARY_SCALES) + scale),
            "word": word, "version": version,
        }
        fields.update(self._layout_digest())
        fields.update(self._mask_digest(observations))
        return fields

    def _layout_digest(self):
        """The element count and the digest of the buckets and the front end's layout: fixed
        for the engine's life, computed once."""
        if self._layout_fields is None:
            describe = [(str(b.dtype), b.size, tuple(b.segments)) for b in self.buckets]
            self._layout_fields = dict(zip(_LAYOUT_FIELDS, digest_ints(describe + self.layout)),
                                       elements=sum(b.size for b in self.buckets))
        return self._layout_fields

    def _mask_digest(self, observations):
        """The survivor count and the observations' digest, kept for the next step's (mostly
        the very same list: :meth:`observe` returns it again when no mask changed)."""
        cached = self._digest
        if cached is not None and cached.observations is observations:
            return cached.fields
        values = tuple(o for pair in observations for o in pair)
        if cached is None or cached.values != values:
            fields = dict(zip(("mask0", "mask1", "mask2", "mask3"), digest_ints(values)),
                          survivors=sum(b.size if s is None else s
                                        for b, (_, s) in zip(self.buckets, observations)))
            cached = MaskDigest(observations, values, fields)
        self._digest = cached._replace(observations=observations)
        return cached.fields

    # ------------------------------------------------------------------ disagreement
    def raise_mismatch(self, collectives, error_type, fields, observations, step, options,
                       version):
        """Raise ``error_type`` on every rank, naming the ``fields`` that differ, the
        offending ranks and, for each, what it has (gathered from every rank)."""
        details = gather_details(collectives, self._descriptor(observations, step, options,
                                                               version))
        bad = offending_ranks(details, ["buckets", "layout", "version", "quantize",
                                        "ternary_scale", "average", "step"])
        lines = [f"ranks disagree on {', '.join(fields)} at step {step}; "
                 f"offending ranks: {bad}"]
        reference = {bk["name"]: bk for bk in details[0]["buckets"]}
        unknown = {"fingerprint": None, "survivors": None}

        def mask_of(bk):
            return bk["fingerprint"], bk["survivors"]

        def on_rank0(bk):
            return mask_of(reference.get(bk["name"], unknown))

        for rank in sorted({0, *bad}):
            d = details[rank]
            sizes = [(bk["dtype"], bk["elements"], bk["survivors"]) for bk in d["buckets"]]
            lines.append(f"rank {rank} on {d['host']}: version {d['version']}, "
                         f"quantize {d['quantize']}, ternary_scale {d['ternary_scale']}, "
                         f"(dtype, elements, survivors) {sizes}")
            if rank == 0:
                continue
            differing = [bk for bk in d["buckets"] if mask_of(bk) != on_rank0(bk)]
            if differing:
                lines.append(
                    f"rank {rank} on {d['host']}: masks differ from rank 0's for "
                    f"{[bk['name'] for bk in differing]}; (fingerprint, survivors) here "
                    f"{[mask_of(bk) for bk in differing]}, on rank 0 "
                    f"{[on_rank0(bk) for bk in differing]}")
        raise error_type("\n".join(lines), details=details, offending_ranks=bad)

    def _descriptor(self, observations, step, options, version):
        return {
            "step": step, "quantize": options.quantize, "average": options.average,
            "ternary_scale": options.ternary_scale,
            "version": version, "layout": repr(self.layout),
            "buckets": [
                {"name": b.name, "dtype": str(b.dtype), "elements": b.size,
                 "fingerprint": None if fp is None else f"{fp:032x}", "survivors": s}
                for b, (fp, s) in zip(self.buckets, observations)
            ],
        }

    def broadcast_rank0(self, collectives, snapshots, stats):
        """``on_mismatch="resync"``: rank 0's masks (each masked bucket's snapshot bits,
        broadcast; their bytes counted in ``stats["resync_bytes"]``), as flat boolean masks."""
        received = []
        for b, snapshot in enumerate(snapshots):
            if snapshot is None:
                received.append(None)
                continue
            wire = snapshot.bits.copy()
            collectives.bcast(wire, root=0, name=f"pacmpi.resync.{self.buckets[b].name}")
            stats["resync_bytes"] += wire.nbytes
            xp = array_module(wire)
            received.append(xp.unpackbits(wire)[:snapshot.size].view(xp.bool_))
        return received

    def restored_tracker(self, saved, flats, stable_steps):
        """The :class:`MaskTracker` of a checkpoint's tracker state ``saved``, once the current
        flat masks ``flats`` are shown to carry the fingerprints it verified (ValueError naming
        the buckets whose masks differ)."""
        snapshots, observations = self.observe(self.checked(flats))
        if saved["last_commit_step"] is not None:
            changed = [spec.name for spec, (fp, _), entry in
                       zip(self.buckets, observations, saved["buckets"])
                       if entry["fingerprint"] is not None and fp != entry["fingerprint"]]
            if changed:
                raise ValueError(f"masks of {changed} differ from those verified at step "
                                 f"{saved['last_commit_step']} of the checkpoint; restore the "
                                 "checkpoint's masks before loading it")
        tracker = MaskTracker(len(self.buckets), stable_steps=stable_steps)
        tracker.load_state_dict(saved, snapshots)
        return tracker

    def arrays(self):
        """The bit arrays it keeps (snapshots, runs, the joined masks'), for memory reports."""
        for snapshot in self._snapshots.values():
            yield snapshot.bitmap
        for run in self._runs.values():
            yield run.bits
        if self._observed is not None and self._observed.joined is not None:
            yield self._observed.joined.bitmap


def agree_layout(collectives, unit, description, step, local_error=None):
    """Check that every rank maps the front end's ``unit`` (e.g. ``"DDP bucket 3"``) onto
    the same ``description`` (hashable items); see
    :meth:`pacmpi.engine.StepEngine.agree_layout`."""
    fields = dict(zip(_LAYOUT_FIELDS, digest_ints(list(description))),
                  magic=_MAGIC, step=step, input_error=int(local_error is not None))
    mismatched, maxima = agree(collectives, fields)
    if maxima["input_error"]:
        raise_together(collectives, local_error)
    if mismatched:
        details = gather_details(collectives, {"description": list(description)})
        bad = offending_ranks(details, ["description"])
        raise LayoutMismatchError("\n".join(
            [f"ranks disagree on {unit} at step {step}; offending ranks: {bad}"]
            + [f"rank {r} on {details[r]['host']}: {unit} is {details[r]['description']}"
               for r in sorted({0, *bad})]), details=details, offending_ranks=bad)
