"""Cost model of one training step's gradient all-reduce: fit it to benchmarks, predict clusters.

A step all-reduces a model's gradients in fusion buckets; on a ring of ``P`` participants over
links of ``B`` bytes/s it takes::

    t = a * steps + wire_bytes * ring_factor / (eta * B) + codec + verify (+ compute)

- ``steps = 2 (P - 1)`` per bucket, plus one verification all-reduce on PacTrain steps;
- ``ring_factor``: ``star`` (every node has its own uplink; ranks mapped by node, so each node
  link carries one ring edge): ``2 (N - 1) / N`` for N ranks, ``2 (K - 1) / K`` across K node
  leaders when hierarchical (a single node: at memory speed); ``shared`` (every rank's traffic
  crosses one link, the one-host test bed): ``2 (N - 1)``, ``2 (K - 1)`` hierarchical;
- hierarchical: the ranks of a node first sum dense at memory speed (``intra_Bps``, an
  all-reduce of the dense bytes among the node's ranks) and ternary digits use base ``2K + 1``
  for K nodes instead of ``2N + 1`` (:class:`pacmpi.ternary.TernaryCodec` gives the bits);
- wire bytes: dense (fp32) ``4 n``, fp16 ``2 n``, PacTrain ``4 kept``, ternary ``8`` per word of
  ``kept`` codes (uint64 words, as MPI sums them);
- codec: ``4 n / u + 4 kept / v`` seconds per method (gathers and rounding work on the kept
  values, the scatter clears every value; fp16's two casts touch every value), verify
  ``4 n / w`` (one comparison pass over the mask; ternary steps also compute scales there),
  each multiplied by ``ranks on a host / its cores`` when ranks share cores (the test bed);
- ``a`` and ``eta`` per topology (see :data:`DEFAULT_FIT`); the model is the ring's, which
  ``pacmpi-run --link/--nodes`` pins for every job (``pacmpi bench allreduce`` records it).

The peers (:func:`peer_step_seconds`), from the same ``a``, ``eta`` and ``B``, network only
(their codecs are not fitted): TopK and DGC all-gather ``k`` (int64 index, float32 value)
pairs per rank, ``k = ceil(ratio n)`` (DGC: per tensor, at least one each); TernGrad
all-gathers 2-bit codes (``n / 4`` bytes) and one float32 scale per tensor; each of the two
all-gathers takes ``P - 1`` ring steps and puts ``(P - 1) m`` bytes of an ``m``-byte payload
on every node link of a star (``P (P - 1) m`` through a shared link): it grows with ``P``
where the ring all-reduce's ``2 (P - 1) / P`` saturates. PowerSGD of rank ``r`` (torch's
``powerSGD_hook``) ring-all-reduces, per fusion bucket, the uncompressed tensors, then the
``P`` factors (``n r`` values per ``n x m`` matrix), then the ``Q`` factors (``m r``): float32
``(n + m) r`` values per compressed matrix, a tensor being compressed when
``2 (n + m) r < n m`` (its ``min_compression_rate``). fp16 is the all-reduce method above.

:func:`calibrate` fits the codec and verify throughputs to their measured columns and ``a``,
``eta`` to the rest of the step times of ``pacmpi bench allreduce --link RATE --json`` files;
:func:`predict` evaluates the model. ``compute_s`` adds a step's
compute, not overlapped with communication (a conservative choice for the speedup). The
commands that run them, ``pacmpi model calibrate`` and ``pacmpi model predict``, are
:mod:`pacmpi.model_cli`'s.
"""
import itertools
import json
import math
import os

import numpy as np

from .buckets import DEFAULT_BUCKET_BYTES, BucketLayout
from .methods import ALLREDUCE_METHODS, METHODS, lookup_method
from .ternary import TernaryCodec
from .units import parse_rate

__all__ = ["ring_factor", "ring_seconds", "workload", "predict", "compare", "latency",
           "calibrate", "validate"]

TOPOLOGIES = ("star", "shared")

DEFAULT_FIT = {
    "latency_s": {t: 0.0 for t in TOPOLOGIES}, "link_efficiency": {t: 1.0 for t in TOPOLOGIES},
    "codec_s_per_byte": {m: [0.0, 0.0] for m in ALLREDUCE_METHODS},
    "verify_s_per_byte": {m: 0.0 for m in ALLREDUCE_METHODS},
    "intra_Bps": 20e9, "host_cores": None,
}
"""An uncalibrated model: no latency, nominal rates, free codec; ``intra_Bps`` 20 GB/s (a PCIe
4.0 x16 link between a node's GPUs, an assumption). ``latency_s`` (a) and ``link_efficiency``
(eta) are per topology, since the two test beds differ: the star bed moves MTU-1500 packets
through veths, a bridge and two tbf queues per link, each link carrying one TCP flow per
direction; the shared bed moves 64 KiB packets through one queue on ``lo`` that every flow
shares. A single number applies to both."""

#: Where `pacmpi model calibrate` writes the fit and `pacmpi model predict` reads it.
FIT_FILE = "results/costmodel_fit.json"


def ring_factor(participants, topology="star"):
    """Bytes the busiest link carries per byte a ring all-reduce over ``participants`` sums:
    each sends ``2 (P - 1) / P`` of the buffer, all its own link carries on a ``star`` (a
    full-duplex link each); a ``shared`` link carries every participant's, ``2 (P - 1)``."""
    return 2 * (participants - 1) / (participants if topology == "star" else 1)


def ring_seconds(nbytes, participants, rate_Bps, topology="star"):
    """Seconds a ring all-reduce of ``nbytes`` over ``participants`` spends on links of
    ``rate_Bps`` bytes per second: ``ring_factor * S / B``, no latency."""
    return nbytes * ring_factor(participants, topology) / rate_Bps


def check_int(name, value, low=1):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def workload(*, model=None, nbytes=None, density=1.0, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """``(values, kept, buckets)`` of one step: a model's tensors (its magnitude mask keeps
    ``round(density * prunable)`` values plus every bias and norm value, as the benchmark's) or
    ``nbytes`` of float32 gradients, every value prunable, in ``ceil(nbytes / bucket_bytes)``
    buckets."""
    if not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    shapes, prunable = tensors(model=model, nbytes=nbytes, bucket_bytes=bucket_bytes)
    values = sum(math.prod(shape) for shape in shapes)
    kept = int(round(density * prunable)) + values - prunable
    buckets = len(BucketLayout(shapes, [np.float32] * len(shapes), bucket_bytes).buckets)
    return values, kept, buckets


def tensors(*, model=None, nbytes=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """``(shapes, prunable)``: a step's gradient tensors in gradient-ready (reverse) order and
    how many of their values a mask may prune; ``nbytes`` of float32 come as 1-d pieces of
    ``bucket_bytes``, every value prunable."""
    if (model is None) == (nbytes is None):
        raise ValueError("give exactly one of model (a name) and nbytes")
    if model is not None:
        from .bench.models import model_params
        params = model_params(model)[::-1]
        return [p.shape for p in params], sum(p.size for p in params if p.prunable)
    values = check_int("nbytes", nbytes, 4) // 4
    # Many tensors, as a model has, rather than one array that would get a bucket alone.
    piece = bucket_bytes // 4
    return [(piece,)] * (values // piece) + ([(values % piece,)] if values % piece else []), values


def _wire_bytes(method, values, kept, buckets, participants):
    """Bytes one rank puts into the all-reduces of a step of ``method`` (a :class:`Method`)."""
    if method.quantize == "ternary":
        codec = TernaryCodec(max(participants, 1), "uint64")
        # Left out: the buckets' partial last words (at most one each) and their scales, which
        # ride in the verification all-reduce on verified steps.
        return 8 * codec.words_for(kept)
    return (kept if method.packed else values) * (2 if method.quantize == "fp16" else 4)


def _per_method(fit, key, method):
    """``fit[key]``'s entry for ``method``; fits written before one vocabulary name dense and
    fp16 ``dense-fp32`` and ``dense-fp16``."""
    return {lookup_method(name).name: value for name, value in fit[key].items()}[method]


def _per_topology(fit, key, topology):
    value = fit[key]
    if not isinstance(value, dict):
        return float(value)
    if topology not in value:
        raise ValueError(f"the fit has no {key} for topology {topology!r} (it has "
                         f"{', '.join(sorted(value)) or 'none'}): calibrate with a {topology} run")
    return float(value[topology])


def link_efficiency(fit, topology):
    """The fitted share of the nominal rate that ``topology``'s links carry (eta)."""
    return _per_topology(fit, "link_efficiency", topology)


def latency(fit, topology):
    """The fitted seconds per ring step on ``topology`` (a)."""
    return _per_topology(fit, "latency_s", topology)


def _rate(fit, link_bps, nodes, topology):
    """Bytes per second of the link a ring edge crosses."""
    # One node on a star: the ring never leaves it, so it runs at memory speed.
    if topology == "star" and nodes == 1:
        return fit["intra_Bps"]
    return link_efficiency(fit, topology) * link_bps / 8


def step_seconds(fit, *, ranks, link_bps, values, kept, buckets, method, nodes=None,
                 topology="star", hierarchical=False, host_cores=None, compute_s=0.0,
                 codec=True):
    """Predicted seconds of one step, and its parts (a dict; see the module docstring);
    ``link_bps``: the nominal link rate in bits per second."""
    ranks = check_int("ranks", ranks)
    nodes = ranks if nodes is None else check_int("nodes", nodes)
    method = lookup_method(method, ALLREDUCE_METHODS)
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose from {', '.join(TOPOLOGIES)}")
    if ranks % nodes:
        raise ValueError(f"{ranks} ranks do not fill {nodes} nodes evenly")
    per_node = ranks // nodes
    ring = nodes if hierarchical else ranks
    wire = _wire_bytes(method, values, kept, buckets, ring)
    network_s = ring_seconds(wire, ring, _rate(fit, link_bps, nodes, topology), topology)
    collectives = buckets + method.packed
    latency_s = latency(fit, topology) * collectives * 2 * (ring - 1)
    intra_s = 0.0
    if hierarchical and per_node > 1:
        intra_s = ring_seconds(4 * values, per_node, fit["intra_Bps"])
    share = max(1.0, ranks / host_cores) if host_cores else 1.0
    u, v = _per_method(fit, "codec_s_per_byte", method.name)
    codec_s = (4 * values * u + 4 * kept * v) * share if codec else 0.0
    verify_s = (4 * values * _per_method(fit, "verify_s_per_byte", method.name) * share
                if codec else 0.0)
    total = compute_s + latency_s + network_s + intra_s + codec_s + verify_s
    return {"seconds": total, "compute_s": compute_s, "latency_s": latency_s,
            "network_s": network_s, "intra_s": intra_s, "codec_s": codec_s,
            "verify_s": verify_s, "wire_bytes": int(wire),
            "bits_per_value": 8 * wire / kept if method.quantize == "ternary" and kept else None}


PEERS = tuple(name for name in METHODS if name not in ALLREDUCE_METHODS)
"""The methods pacmpi compares itself with (TopK, TernGrad, DGC, PowerSGD), modelled by
:func:`peer_step_seconds`."""

PEER_DEFAULTS = {"topk_ratio": 0.01, "dgc_ratio": 0.001, "powersgd_rank": 4}
"""The peers' knobs when not given: the baselines' own defaults (``TopKSync`` 1%, DGC 0.1%
as in its paper, ``powerSGD_hook`` rank 4 as in ``pacmpi bench train``'s labels)."""


def topk_count(ratio, values):
    """Values a top-k of ``ratio`` keeps of ``values`` (``TopKSync``'s k): at least one."""
    return max(1, math.ceil(ratio * values))


def powersgd_values(shapes, rank):
    """Values one rank all-reduces per step under ``powerSGD_hook`` of ``rank``: each tensor as
    an ``n x m`` matrix (``n`` its first dimension), sent as ``(n + m) r`` factor values when
    ``2 (n + m) r < n m`` (torch's ``min_compression_rate`` 2; ``r = min(n, m, rank)``), else
    whole (vectors always)."""
    total = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        total += (n + m) * r if 2 * (n + m) * r < n * m else n * m
    return total


def _peer_traffic(method, shapes, buckets, *, topk_ratio, dgc_ratio, powersgd_rank):
    """``(collective, calls, payload bytes per rank)`` of one step of peer ``method``."""
    values = sum(math.prod(shape) for shape in shapes)
    if method == "topk":  # TopKSync: one global top-k, int64 indices and float32 values
        return "allgather", 2, 12 * topk_count(topk_ratio, values)
    if method == "dgc":  # DGCSync: the top ratio of each tensor, at least one value each
        return "allgather", 2, 12 * sum(topk_count(dgc_ratio, math.prod(shape))
                                        for shape in shapes)
    if method == "terngrad":  # 2-bit codes, four per byte, and a float32 scale per tensor
        return "allgather", 2, math.ceil(values / 4) + 4 * len(shapes)
    # powersgd: per fusion bucket the uncompressed tensors, then the Ps, then the Qs.
    return "allreduce", 3 * buckets, 4 * powersgd_values(shapes, powersgd_rank)


def peer_step_seconds(fit, *, method, ranks, link_bps, shapes, buckets, nodes=None,
                      topology="star", compute_s=0.0, topk_ratio=PEER_DEFAULTS["topk_ratio"],
                      dgc_ratio=PEER_DEFAULTS["dgc_ratio"],
                      powersgd_rank=PEER_DEFAULTS["powersgd_rank"]):
    """Predicted seconds of one step of a peer (see the module docstring) and its parts, in
    :func:`step_seconds`' keys; ``codec_s`` and ``verify_s`` are ``None``: not modelled."""
    ranks = check_int("ranks", ranks)
    nodes = ranks if nodes is None else check_int("nodes", nodes)
    method = lookup_method(method, PEERS).name
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose from {', '.join(TOPOLOGIES)}")
    if ranks % nodes:
        raise ValueError(f"{ranks} ranks do not fill {nodes} nodes evenly")
    for name, value in (("topk_ratio", topk_ratio), ("dgc_ratio", dgc_ratio)):
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    check_int("powersgd_rank", powersgd_rank)
    collective, calls, payload = _peer_traffic(method, shapes, buckets, topk_ratio=topk_ratio,
                                               dgc_ratio=dgc_ratio, powersgd_rank=powersgd_rank)
    rate = _rate(fit, link_bps, nodes, topology)
    if collective == "allgather":  # every rank receives every other rank's payload
        factor = ranks - 1 if topology == "star" else ranks * (ranks - 1)
        network_s = payload * factor / rate
        steps = ranks - 1
    else:
        network_s = ring_seconds(payload, ranks, rate, topology)
        steps = 2 * (ranks - 1)
    latency_s = latency(fit, topology) * calls * steps
    return {"seconds": compute_s + latency_s + network_s, "compute_s": compute_s,
            "latency_s": latency_s, "network_s": network_s, "intra_s": 0.0, "codec_s": None,
            "verify_s": None, "wire_bytes": int(payload), "bits_per_value": None,
            "collective": collective}


def predict(fit, *, ranks, link, method, density=1.0, model=None, nbytes=None, nodes=None,
            topology="star", hierarchical=False, compute_s=0.0, host_cores=None, codec=True,
            **peer):
    """Seconds per step of ``method`` and its speedup over flat dense (fp32) and fp16 (the same
    topology, compute and codec setting); returns a JSON-able dict. ``method``: one of
    :data:`~pacmpi.methods.METHODS`; a peer's knobs (``topk_ratio``, ``dgc_ratio``,
    ``powersgd_rank``) come as keywords (defaults :data:`PEER_DEFAULTS`). ``density`` is
    PacTrain's mask; the peers compress the full gradient, flat."""
    if not isinstance(compute_s, (int, float)) or compute_s < 0:
        raise ValueError(f"compute_s must be >= 0, got {compute_s!r}")
    unknown = set(peer) - set(PEER_DEFAULTS)
    if unknown:
        raise TypeError(f"predict() got unexpected keywords {sorted(unknown)}")
    values, kept, buckets = workload(model=model, nbytes=nbytes, density=density)
    common = dict(ranks=ranks, link_bps=parse_rate(link), nodes=nodes, topology=topology,
                  compute_s=compute_s)
    allreduce = dict(common, values=values, kept=kept, buckets=buckets, host_cores=host_cores,
                     codec=codec)
    method = lookup_method(method).name
    if method in ALLREDUCE_METHODS:
        mine = dict(step_seconds(fit, method=method, hierarchical=hierarchical, **allreduce),
                    collective="allreduce")
    else:
        if hierarchical:
            raise ValueError(f"hierarchical reduction is pacmpi's; {method} is modelled flat")
        if method == "powersgd" and model is None:
            raise ValueError("powersgd compresses matrices: give a model, not a byte count")
        mine = peer_step_seconds(fit, method=method, shapes=tensors(model=model, nbytes=nbytes)[0],
                                 buckets=buckets, **common, **{**PEER_DEFAULTS, **peer})
    baselines = {m: step_seconds(fit, method=m, **allreduce)["seconds"] for m in ("dense", "fp16")}
    knobs = {**PEER_DEFAULTS, **peer}
    setting = {"pactrain": f"density {density}", "pactrain-ternary": f"density {density}",
               "topk": f"ratio {knobs['topk_ratio']}", "dgc": f"ratio {knobs['dgc_ratio']}",
               "powersgd": f"rank {knobs['powersgd_rank']}"}.get(method, "")
    return dict(mine, setting=setting, ranks=ranks, nodes=nodes or ranks, link=link,
                topology=topology, method=method, hierarchical=hierarchical, model=model,
                density=density, values=values, kept=kept, buckets=buckets,
                dense_s=baselines["dense"], fp16_s=baselines["fp16"],
                speedup_vs_dense=baselines["dense"] / mine["seconds"],
                speedup_vs_fp16=baselines["fp16"] / mine["seconds"])


def compare(fit, *, model=None, nbytes=None, hierarchical=False, **options):
    """:func:`predict` of every method (PacTrain's hierarchical when asked, the peers flat;
    PowerSGD only for a model), fastest first."""
    rows = [predict(fit, method=method, model=model, nbytes=nbytes,
                    hierarchical=hierarchical and method in ALLREDUCE_METHODS, **options)
            for method in METHODS if not (method == "powersgd" and model is None)]
    return sorted(rows, key=lambda row: row["seconds"])


def _nnls(columns, target, weights):
    """Non-negative weighted least squares over few unknowns: the best of every subset of
    free unknowns whose unconstrained solution is non-negative."""
    a = np.asarray(columns, dtype=float).T * weights[:, None]
    b = np.asarray(target, dtype=float) * weights
    # Unit-norm columns: step counts and byte counts differ by 1e7, which costs precision.
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    best, best_cost = np.zeros(a.shape[1]), float(b @ b)
    for k in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), k):
            solution, *_ = np.linalg.lstsq(a[:, subset], b, rcond=None)
            if np.all(solution >= 0):
                full = np.zeros(a.shape[1])
                full[list(subset)] = solution
                cost = float(np.sum((a @ full - b) ** 2))
                if cost < best_cost:
                    best, best_cost = full, cost
    return best / norms


def _points(documents):
    """One dict per benchmark row: the run's set-up and the row's measurements."""
    points = []
    for doc in documents:
        source = doc.get("source", "?")
        for key in ("link", "ranks"):
            if doc.get(key) is None:
                raise ValueError(f"{source}: no {key!r}; run `pacmpi bench allreduce --model NAME "
                                 f"(or --sizes) --link RATE --json FILE` under `pacmpi-run --link "
                                 f"RATE`")
        algorithm = doc.get("allreduce_algorithm")
        if doc.get("topology") == "star" and algorithm != "ring":
            # On the star bed Open MPI's default choice took 1.73x the ring's time for the
            # same bytes; the model is the ring's, so such a run would only measure the choice.
            raise ValueError(f"{source}: star run with all-reduce algorithm {algorithm!r}, not "
                             f"the ring the model describes; rerun it under `pacmpi-run --link "
                             f"RATE` (which pins the ring)")
        for row in doc["rows"]:
            if doc.get("model") is not None:
                values, kept, buckets = workload(model=doc["model"], density=row["density"])
            else:  # `--sizes`: the row says what it reduced (its own random mask and buckets)
                values, kept, buckets = row["count"], row["kept"], row["buckets"]
            points.append({
                "source": source, "model": doc.get("model"), "ranks": doc["ranks"],
                "shapes": (None if doc.get("model") is not None  # a model's: looked up
                           else [(values,)]),
                "nodes": doc.get("nodes") or doc["ranks"], "link": doc["link"],
                "topology": doc.get("topology", "shared"),
                "method": lookup_method(row["method"], ALLREDUCE_METHODS + PEERS).name,
                "density": row["density"], "values": values, "kept": kept, "buckets": buckets,
                # a TopK or DGC row's density is its ratio; PowerSGD's rank is the run's
                "powersgd_rank": doc.get("powersgd_rank", PEER_DEFAULTS["powersgd_rank"]),
                "measured_s": row["time_avg_us"] / 1e6,
                "codec_s": row["pack_unpack_us"] / 1e6, "verify_s": row["verify_us"] / 1e6,
                "wire_bytes": row["wire_bytes_per_rank"]})
    return points


def _share(point, host_cores):
    return max(1.0, point["ranks"] / host_cores) if host_cores else 1.0


def calibrate(documents, *, host_cores=None, intra_Bps=DEFAULT_FIT["intra_Bps"]):
    """Fit the model to benchmark documents (``pacmpi bench allreduce --json`` output with
    ``link``); returns the fitted parameters with the points they came from.

    Each term comes from the column that measures it: the codec throughputs per method from the
    codec column (``4 n`` and ``4 kept`` bytes, non-negative least squares), the verification's
    from the verify column; then ``a`` and ``eta`` from what each step took beyond its own
    measured codec and verification (the network's part, latency and bytes). Fitting the codec
    indirectly to the step times, as a first version did, let the network's misfit leak into
    the codec coefficients. Points are weighed by ``1 / measured``, so small and large steps
    count alike (relative error).
    """
    # The peers' rows (TopK's all-gather) are predicted from the fit, not fitted.
    points = [p for p in _points(documents) if p["method"] in ALLREDUCE_METHODS]
    if not points:
        raise ValueError("no benchmark rows to fit")
    fit = json.loads(json.dumps(DEFAULT_FIT))
    fit.update(host_cores=host_cores, intra_Bps=intra_Bps)
    share = np.array([_share(p, host_cores) for p in points])
    values = np.array([4.0 * p["values"] for p in points]) * share
    kept = np.array([4.0 * p["kept"] for p in points]) * share
    methods = np.array([p["method"] for p in points])
    codec = np.array([p["codec_s"] for p in points])
    verify = np.array([p["verify_s"] for p in points])
    # The codec's cost per byte depends on the bucket layout: a `--sizes` run's one contiguous
    # bucket packs in place at a fraction of a model's multi-tensor buckets' cost, so where
    # model runs are given the codec and verification terms come from them alone (the sized
    # runs still fit the network terms, from their own measured codec and verification).
    modelled = np.array([p["model"] is not None for p in points])
    codec_points = modelled if modelled.any() else np.ones(len(points), bool)
    for method in ALLREDUCE_METHODS[1:]:  # dense has no codec
        mine = (methods == method) & codec_points
        if not mine.any():
            continue
        # fp16's two casts touch every value; PacTrain's gathers touch the kept ones.
        packed = METHODS[method].packed
        columns = [values[mine]] + ([kept[mine]] if packed else [])
        weights = 1 / np.maximum(codec[mine], 1e-9)
        fit["codec_s_per_byte"][method][:len(columns)] = [
            float(c) for c in _nnls(columns, codec[mine], weights)]
        if packed:
            fit["verify_s_per_byte"][method] = float(
                _nnls([values[mine]], verify[mine], 1 / np.maximum(verify[mine], 1e-9))[0])
    # With latency and link efficiency 1, step_seconds's latency is the step count and its
    # network time the bytes' time at the nominal rate.
    unit = dict(fit, latency_s=1.0, link_efficiency=1.0)
    parts = [step_seconds(unit, ranks=p["ranks"], link_bps=parse_rate(p["link"]),
                          values=p["values"], kept=p["kept"], buckets=p["buckets"],
                          method=p["method"], nodes=p["nodes"], topology=p["topology"],
                          host_cores=host_cores) for p in points]
    # One a and one eta per topology the documents cover: a column pair for each.
    topologies = sorted({p["topology"] for p in points})
    columns = []
    for t in topologies:
        on = np.array([p["topology"] == t for p in points])
        columns += [np.where(on, [q[k] for q in parts], 0.0) for k in ("latency_s", "network_s")]
    measured = np.array([p["measured_s"] for p in points])
    solution = _nnls(columns, measured - codec - verify, 1 / np.maximum(measured, 1e-9))
    fit["latency_s"] = {t: float(solution[2 * i]) for i, t in enumerate(topologies)}
    fit["link_efficiency"] = {t: float(1 / solution[2 * i + 1]) if solution[2 * i + 1] > 0
                              else 1.0 for i, t in enumerate(topologies)}

    fit["points"] = [dict(p, predicted_s=_predict_point(fit, p, host_cores)) for p in points]
    for p in fit["points"]:
        p["error"] = p["predicted_s"] / p["measured_s"] - 1
    return fit


def _predict_point(fit, point, host_cores):
    if point["method"] in PEERS:  # its network and latency: the peers' codec is not modelled
        shapes = point["shapes"] or tensors(model=point["model"])[0]
        knobs = {"powersgd_rank": point["powersgd_rank"]}
        if point["method"] in ("topk", "dgc"):
            knobs[f"{point['method']}_ratio"] = point["density"]
        return peer_step_seconds(fit, method=point["method"], ranks=point["ranks"],
                                 link_bps=parse_rate(point["link"]), shapes=shapes,
                                 buckets=point["buckets"], nodes=point["nodes"],
                                 topology=point["topology"], **knobs)["seconds"]
    return step_seconds(fit, ranks=point["ranks"], link_bps=parse_rate(point["link"]),
                        values=point["values"], kept=point["kept"], buckets=point["buckets"],
                        method=point["method"], nodes=point["nodes"],
                        topology=point["topology"], host_cores=host_cores)["seconds"]


def validate(fit, documents):
    """Predicted vs measured seconds of every row of held-out benchmark documents. A peer's
    prediction leaves its codec out (not modelled): it is compared with the measured time less
    the measured codec (``compared`` says which)."""
    rows = []
    for p in _points(documents):
        predicted = _predict_point(fit, p, fit.get("host_cores"))
        peer = p["method"] in PEERS
        measured = p["measured_s"] - (p["codec_s"] if peer else 0.0)
        rows.append(dict(p, predicted_s=predicted, error=predicted / measured - 1,
                         compared="network" if peer else "step", compared_s=measured))
    return rows


def load_documents(paths):
    """The benchmark JSON files at ``paths``, each with its file name as ``source``."""
    documents = []
    for path in paths:
        with open(path) as fh:
            documents.append(dict(json.load(fh), source=os.path.basename(path)))
    return documents
