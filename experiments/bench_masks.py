"""``pacmpi bench masks``: check mask consistency of gradual pruning under non-IID data, and that
injected faults are caught in the step they appear; rank 0 prints a table per run (exit status 1
if a check failed) and ``--json`` writes the report.

Run it under MPI (``mpirun -n 4 pacmpi bench masks``). Every rank fine-tunes the same densely
pretrained digits CNN on a disjoint block of classes (4 ranks: 0-2 / 3-5 / 6-7 / 8-9) with
gradual magnitude pruning: every ``prune_every`` steps each rank recomputes its mask *locally*
from its own weights (no broadcast), the density falling linearly from 1.0 to ``1 - final_ratio``
over the run. Gradients are averaged by a :class:`pacmpi.PacTrainReducer` (lossless, packed,
verifying every step). Per step the benchmark records, from its own all-gather of SHA-256
digests, how many ranks' masks and weights differ from rank 0's, and from the reducer's
counters whether the step was reduced dense (a fallback after a mask change, or a resync), the
resyncs and the bytes sent.

Faults (``--inject``), each on one rank (``--inject-rank``, the last by default), each run once
with ``on_mismatch="raise"`` and once with ``"resync"``:

- ``ulp-tie``: at a re-prune step the two weights that straddle the new threshold are made an
  exact tie on every rank (the stable tie break keeps the masks identical), then the faulty
  rank's pruned one is moved one ULP up, so that rank prunes the other one.
- ``lr``: the faulty rank applies one optimizer step with ``lr_factor`` times the learning
  rate, in the step before a re-prune; weights differ from then on, masks at the re-prune.
- ``sum-order``: from the injection step on, the payload sums run through an all-gather and
  an explicit rank-order sum (:class:`OrderedSumCollectives`), which the faulty rank adds in
  reversed order: last-bit differences in its averaged gradient. With 2 ranks the order cannot
  matter (floating-point addition is commutative).

Checked in every run: a mask difference is detected in the very step the masks first differ
(the bench's digests), on every rank; in raise mode the step's gradients are left as they were
before the reduction (nothing summed, nothing applied); in resync mode the step's result equals
the dense average of the gradients under rank 0's masks, bit for bit. ``control=True`` runs a
fault at size zero (a tie without the ULP, ``lr_factor`` 1, the same order on every rank): the
negative control.
"""
import argparse
import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pacmpi import Collectives, MaskMismatchError, MPICollectives, PacTrainReducer
from pacmpi.adapters.convert import as_array, numpy_dtype
from pacmpi.adapters.pruning import (
    GradualPruningSchedule,
    MaskEnforcer,
    masks_digest,
    named_prunable_parameters,
)
from pacmpi.adapters.torch_sync import broadcast_parameters
from pacmpi.bench import harness
from pacmpi.cli_options import add_json_file, add_out_dir, command_parser
from pacmpi.experiments.data import iterate_minibatches, load_digits_split
from pacmpi.experiments.models import build_model
from pacmpi.experiments.train import TrainConfig, knob, pretrained_state

__all__ = ["BenchConfig", "build_parser", "format_table", "main", "run", "write_plots"]

FAULTS = ("ulp-tie", "lr", "sum-order")
POLICIES = ("raise", "resync")


@dataclass
class BenchConfig:
    """The workload; the command-line flags carry the same names (``--prune-every``)."""

    # One definition per knob, as in TrainConfig: `name: type = knob(default, "help")`.
    steps: int = knob(1000, "fine-tuning steps of the fault-free run")
    fault_steps: int = knob(0, "steps of each fault run (0: --steps)")
    prune_every: int = knob(10, "each rank recomputes its mask from its own weights every this "
                                "many steps")
    final_ratio: float = knob(0.8, "pruning ratio reached at the last re-prune (the density "
                                   "falls linearly from 1)")
    batch_size: int = knob(32, "samples per rank and step")
    lr: float = knob(0.05, "SGD learning rate of the fine-tuning")
    momentum: float = knob(0.9, "SGD momentum of the fine-tuning")
    width: int = knob(8, "DigitsCNN channels of the first convolution")
    hidden: int = knob(32, "DigitsCNN hidden units")
    pretrain_epochs: int = knob(5, "dense pretraining epochs on rank 0 before fine-tuning")
    seed: int = knob(0, "random seed: data split, initialization, batch order")
    inject_step: int = knob(0, "re-prune step the faults aim at (the lr fault: the step "
                               "before); a multiple of --prune-every, 0: the one nearest 1/3 "
                               "of the run")
    inject_rank: int = knob(-1, "the faulty rank (-1: the last)")
    lr_factor: float = knob(2.0, "learning-rate factor of the lr fault's one step")

    def __post_init__(self):
        checks = [(self.steps >= 2, f"steps must be >= 2, got {self.steps!r}"),
                  (self.fault_steps >= 0, f"fault_steps must be >= 0, got {self.fault_steps!r}"),
                  (1 <= self.prune_every < self.steps,
                   f"prune_every must be in [1, steps), got {self.prune_every!r}"),
                  (0.0 < self.final_ratio < 1.0,
                   f"final_ratio must be in (0, 1), got {self.final_ratio!r}"),
                  (self.lr_factor > 0, f"lr_factor must be > 0, got {self.lr_factor!r}"),
                  (self.inject_step == 0 or self.inject_step % self.prune_every == 0,
                   f"inject_step must be a multiple of prune_every ({self.prune_every}), "
                   f"got {self.inject_step!r}")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def class_groups(size, classes=10):
    """Disjoint, contiguous blocks of class labels, one per rank (4 ranks: 0-2/3-5/6-7/8-9)."""
    if not 1 <= size <= classes:
        raise ValueError(f"cannot give each of {size} ranks its own classes out of {classes}")
    return [tuple(int(c) for c in block) for block in np.array_split(np.arange(classes), size)]


def linear_milestones(steps, every, final_ratio):
    """Re-prune at every ``every``-th step after 0, the density falling linearly so that the
    last re-prune before ``steps`` reaches ``1 - final_ratio``: ``[(step, ratio), ...]``."""
    points = list(range(every, steps, every))
    return [(s, final_ratio * (i + 1) / len(points)) for i, s in enumerate(points)]


def injection_step(cfg, steps):
    """The re-prune step a fault aims at: ``cfg.inject_step``, or the one nearest a third."""
    step = cfg.inject_step or max(cfg.prune_every,
                                  cfg.prune_every * round(steps / 3 / cfg.prune_every))
    if not 0 < step < steps:
        raise ValueError(f"injection step {step} is outside the run's {steps} steps")
    return step


class OrderedSumCollectives(MPICollectives):
    """MPI transport whose floating-point SUMs add every rank's buffer in an explicit order
    (all-gather, then left to right), rank order by default, reversed where ``reverse`` is set:
    a rank-dependent summation order. Other reductions go to MPI."""

    def __init__(self, *, comm=None):
        super().__init__(comm=comm)
        self.reverse = False

    def allreduce(self, buf, op="sum", name=None):
        if op != "sum" or np.dtype(buf.dtype).kind != "f":
            return super().allreduce(buf, op, name)
        parts = np.empty((self.size, buf.size), dtype=buf.dtype)
        self.comm.Allgather(np.ascontiguousarray(buf).reshape(-1), parts)
        total = parts[-1].copy() if self.reverse else parts[0].copy()
        for part in (parts[-2::-1] if self.reverse else parts[1:]):
            total += part
        buf[...] = total.reshape(buf.shape)

    iallreduce = Collectives.iallreduce  # blocking underneath, like the sum itself


def _digest(tensors):
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _threshold_pair(prunable, masks, ratio):
    """Flat positions (over the prunable parameters, in order) of the last weight the next
    prune to ``ratio`` removes and the first it keeps, as ``prune`` ranks them."""
    magnitude = torch.cat([p.detach().abs().flatten() for p in prunable.values()])
    pruned = torch.cat([~masks[name].flatten() for name in prunable])
    n_remove = int(round(ratio * magnitude.numel()))
    if not int(pruned.sum()) < n_remove < magnitude.numel():
        raise ValueError(f"ratio {ratio} removes no new weight here: pick a re-prune step "
                         "whose ratio grows")
    order = torch.argsort((-magnitude).masked_fill(pruned, math.inf), descending=True,
                          stable=True)
    return int(order[n_remove - 1]), int(order[n_remove])


def _flat_slot(prunable, position):
    for param in prunable.values():
        if position < param.numel():
            return param.view(-1), position
        position -= param.numel()
    raise IndexError(position)


@torch.no_grad()
def _make_tie(prunable, masks, ratio, ulps):
    """Give the two weights at the coming threshold the same magnitude (on every rank), then
    move the lower-indexed one, which the stable tie break would prune, ``ulps`` ULPs up."""
    removed, kept = _threshold_pair(prunable, masks, ratio)
    (w_removed, i_removed), (w_kept, i_kept) = (_flat_slot(prunable, p) for p in (removed, kept))
    w_kept[i_kept] = torch.copysign(w_removed[i_removed].abs(), w_kept[i_kept])
    weight, index = (w_removed, i_removed) if removed < kept else (w_kept, i_kept)
    value = weight[index:index + 1]
    for _ in range(ulps):
        value.copy_(torch.copysign(torch.nextafter(value.abs(), torch.full_like(value, math.inf)),
                                   value))
    return {"positions": sorted((removed, kept)), "magnitude": float(w_removed[i_removed].abs())}


def _local_data(cfg, rank, size):
    """This rank's training images: only its block of classes."""
    data = load_digits_split(seed=cfg.seed)
    keep = torch.isin(data.y_train, torch.tensor(class_groups(size)[rank]))
    return data.x_train[keep], data.y_train[keep]


def _batches(x, y, cfg):
    """Endless minibatches of this rank's classes; ranks' epochs differ in length."""
    epoch = 0
    while True:
        yield from iterate_minibatches(x, y, cfg.batch_size, seed=cfg.seed, epoch=epoch,
                                       drop_last=True)
        epoch += 1


def run_one(cfg, pretrained, comm, *, steps, fault=None, on_mismatch="raise", control=False):
    """One fine-tuning run of ``steps`` steps (ended early by a detection in raise mode);
    every rank returns the same record: per-step rows, the injection and the detection."""
    rank, size = comm.rank, comm.size
    faulty = (size - 1 if cfg.inject_rank < 0 else cfg.inject_rank) if fault else None
    if faulty is not None and not 0 <= faulty < size:
        raise ValueError(f"inject_rank {cfg.inject_rank} is not a rank of {size}")
    base = injection_step(cfg, steps) if fault else None
    inject_at = base - 1 if fault == "lr" else base
    collectives = (OrderedSumCollectives if fault == "sum-order" else MPICollectives)(
        comm=comm.Dup())
    x, y = _local_data(cfg, rank, size)
    batches = _batches(x, y, cfg)
    model = build_model("digits_cnn", width=cfg.width, hidden=cfg.hidden)
    model.load_state_dict(pretrained)
    prunable = named_prunable_parameters(model)
    masks = OrderedDict((name, torch.ones_like(p, dtype=torch.bool))
                        for name, p in prunable.items())
    enforcer = MaskEnforcer(model, masks)
    params = list(model.parameters())
    names = {id(p): n for n, p in prunable.items()}
    reducer = PacTrainReducer(
        [as_array(masks[names[id(p)]]) if id(p) in names else None for p in params],
        collectives=collectives, on_mismatch=on_mismatch, shapes=[tuple(p.shape) for p in params],
        dtypes=[numpy_dtype(p.dtype) for p in params], abort_on_error=False)
    masked_elements = sum(b.size for b in reducer.layout.buckets
                          if any(id(params[m.index]) in names for m in b.members))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    enforcer.attach(optimizer)
    schedule = GradualPruningSchedule(linear_milestones(steps, cfg.prune_every, cfg.final_ratio))
    ratios = dict(schedule.milestones)
    rows, injection, detection, started = [], None, None, time.perf_counter()
    for step in range(steps):
        if fault == "ulp-tie" and step == inject_at:
            injection = _make_tie(prunable, masks, ratios[step],
                                  ulps=int(rank == faulty and not control))
        if fault == "sum-order" and step == inject_at:
            collectives.reverse = rank == faulty and not control
            injection = {"reversed_on": faulty}
        new = schedule.step(model, step)
        if new is not None:
            with torch.no_grad():
                for name, mask in new.items():
                    masks[name].copy_(mask)
            enforcer.update(masks)
        mask_digest, weight_digest = masks_digest(masks), _digest(params)
        optimizer.zero_grad()
        xb, yb = next(batches)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        enforcer.apply_to_grads()
        grads = [p.grad.numpy() for p in params]
        local = [g.copy() for g in grads]
        before = dict(reducer.stats)
        error, check = None, True
        try:
            reducer.reduce(grads)
        except MaskMismatchError as exc:
            error = exc
            # Nothing summed: the step's gradients are what this rank computed.
            check = all(np.array_equal(g, own) for g, own in zip(grads, local))
        delta = {k: reducer.stats[k] - before[k] for k in ("dense_fallbacks", "resyncs",
                                                           "resync_bytes", "bytes_sent")}
        if delta["resyncs"]:
            check = _equals_dense_average(reducer, collectives, grads, local, masks, names,
                                          params)
            enforcer.update(masks)
            schedule.masks = OrderedDict((n, m.clone()) for n, m in masks.items())
        seen = comm.allgather((mask_digest, weight_digest, error is not None, check,
                               float(loss.detach()), delta))
        rows.append({
            # Rounded: thousands of rows go into the JSON, and these are for reading.
            "step": step, "ratio": round(ratios[step], 6) if step in ratios else None,
            "density": round(enforcer.density().overall, 6),
            "mask_disagree": sum(s[0] != seen[0][0] for s in seen),
            "weight_disagree": sum(s[1] != seen[0][1] for s in seen),
            "raised": [r for r, s in enumerate(seen) if s[2]],
            "checked": all(s[3] for s in seen),
            "loss": float(f"{np.mean([s[4] for s in seen]):.6g}"),
            "dense": bool(seen[0][5]["dense_fallbacks"] or seen[0][5]["resyncs"]),
            "resyncs": seen[0][5]["resyncs"], "bytes": seen[0][5]["bytes_sent"],
            "resync_bytes": seen[0][5]["resync_bytes"],
        })
        if error is not None:
            detection = {"step": step, "offending_ranks": list(error.offending_ranks),
                         "message": str(error).splitlines()[0]}
            break
        if fault == "lr" and step == inject_at:
            factor = 1.0 if control else cfg.lr_factor
            injection = {"lr": cfg.lr * factor, "on": faulty}
            if rank == faulty:
                optimizer.param_groups[0]["lr"] = cfg.lr * factor
        optimizer.step()
        optimizer.param_groups[0]["lr"] = cfg.lr
    collectives.comm.Free()
    return {"fault": fault, "on_mismatch": on_mismatch, "control": control, "ranks": size,
            "faulty_rank": faulty, "steps": steps, "masked_elements": masked_elements,
            "inject_step": inject_at, "injection": injection, "detection": detection,
            "seconds": time.perf_counter() - started, "rows": rows,
            "summary": summarize(rows, size, on_mismatch)}


def _equals_dense_average(reducer, collectives, grads, local, masks, names, params):
    """The resynced step's result against the dense average of every rank's gradient under
    the adopted (rank 0's) masks, summed by the same transport."""
    masked = [np.where(masks[names[id(p)]].numpy(), grad, 0) if id(p) in names else grad
              for grad, p in zip(local, params)]
    for bucket in reducer.layout.buckets:
        flat = bucket.flatten(masked, np.empty(bucket.size, dtype=bucket.dtype))
        collectives.allreduce(flat, "sum")
        flat /= collectives.size
        if not np.array_equal(flat, bucket.flatten(grads, np.empty_like(flat))):
            return False
    return True


def _first(rows, key, after=-1):
    return next((r["step"] for r in rows if r[key] and r["step"] > after), None)


def caught_in_step(rows, ranks, on_mismatch):
    """Whether every step whose masks differed raised on all ``ranks`` (or resynced) in that
    very step, and no other step did."""
    for row in rows:
        acted = (len(row["raised"]) == ranks if on_mismatch == "raise" else row["resyncs"] > 0)
        if bool(row["mask_disagree"]) != acted or (row["raised"] and not acted):
            return False
    return True


def summarize(rows, ranks, on_mismatch):
    """Counts over a run's rows: steps with differing masks/weights, dense steps, resyncs,
    bytes, the first step masks and weights differed, whether every mask difference was caught
    in its step and whether every step's own check held."""
    n = len(rows)
    return {
        "caught_in_step": caught_in_step(rows, ranks, on_mismatch),
        "steps_run": n,
        "mask_disagreement_steps": sum(r["mask_disagree"] > 0 for r in rows),
        "mask_disagreeing_rank_steps": sum(r["mask_disagree"] for r in rows),
        "weight_disagreement_steps": sum(r["weight_disagree"] > 0 for r in rows),
        "first_mask_disagreement": _first(rows, "mask_disagree"),
        "first_weight_disagreement": _first(rows, "weight_disagree"),
        "dense_steps": sum(r["dense"] for r in rows),
        "fallback_fraction": sum(r["dense"] for r in rows) / n if n else 0.0,
        "resyncs": sum(r["resyncs"] for r in rows),
        "resync_bytes": sum(r["resync_bytes"] for r in rows),
        "bytes_per_step": sum(r["bytes"] for r in rows) / n if n else 0.0,
        "final_density": rows[-1]["density"] if rows else None,
        "final_loss": rows[-1]["loss"] if rows else None,
        "checks_held": all(r["checked"] for r in rows),
        "detected_steps": [r["step"] for r in rows if r["raised"]],
    }


def _fault_row(result, baseline):
    """One line of the fault table: injection, detection, and what a resync run cost beyond
    the fault-free run's dense steps and bytes over the same steps."""
    s = result["summary"]
    same = baseline["rows"][:s["steps_run"]]
    detection = result["detection"] or {}
    return {
        "fault": result["fault"], "control": result["control"],
        "on_mismatch": result["on_mismatch"], "inject_step": result["inject_step"],
        "first_weight_disagreement": s["first_weight_disagreement"],
        "first_mask_disagreement": s["first_mask_disagreement"],
        "detection_step": (detection.get("step") if result["on_mismatch"] == "raise" else
                           next((r["step"] for r in result["rows"] if r["resyncs"]), None)),
        "ranks_raised": (result["rows"][-1]["raised"] if result["detection"] else []),
        "offending_ranks": detection.get("offending_ranks", []),
        "resyncs": s["resyncs"],
        "resync_steps": [r["step"] for r in result["rows"] if r["resyncs"]],
        # Only a run that goes on after the fault has a cost to compare; a raise ends it.
        "extra_dense_steps": (s["dense_steps"] - sum(r["dense"] for r in same)
                              if result["on_mismatch"] == "resync" else None),
        "extra_payload_bytes": (sum(r["bytes"] for r in result["rows"])
                                - sum(r["bytes"] for r in same)
                                if result["on_mismatch"] == "resync" else None),
        # Rank 0's masks, one byte per masked bucket element (the reducer's resync_bytes);
        # bytes_sent counts payloads only.
        "resync_broadcast_bytes": s["resync_bytes"],
        "checks_held": s["checks_held"],
    }


def run(cfg, *, faults=FAULTS, policies=POLICIES, controls=False, comm=None):
    """The fault-free run and every (fault, policy) run; collective. Returns the report."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup() if comm is None else comm
    torch.set_num_threads(1)
    collectives = MPICollectives(comm=comm)
    model = build_model("digits_cnn", width=cfg.width, hidden=cfg.hidden)
    data = load_digits_split(seed=cfg.seed)
    state, accuracy = pretrained_state(
        TrainConfig(model="digits_cnn", width=cfg.width, hidden=str(cfg.hidden),
                    pretrain_epochs=cfg.pretrain_epochs, seed=cfg.seed, progress=False),
        data, {"width": cfg.width, "hidden": cfg.hidden}, collectives)
    if state is not None:
        model.load_state_dict(state)
    broadcast_parameters(model, collectives=collectives)
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}
    baseline = run_one(cfg, pretrained, comm, steps=cfg.steps)
    fault_steps = cfg.fault_steps or cfg.steps
    # The fault runs' costs are counted against a fault-free run of their own length (its
    # pruning schedule depends on the length).
    reference = (baseline if fault_steps == cfg.steps
                 else run_one(cfg, pretrained, comm, steps=fault_steps))
    results = []
    for fault in faults:
        for policy in policies:
            results.append(run_one(cfg, pretrained, comm, steps=fault_steps, fault=fault,
                                   on_mismatch=policy))
        if controls:
            results.append(run_one(cfg, pretrained, comm, steps=fault_steps, fault=fault,
                                   control=True))
    return {"config": asdict(cfg), "rank": comm.rank, "ranks": comm.size,
            "classes": class_groups(comm.size), "pretrained_accuracy": accuracy,
            "baseline": baseline, "reference": reference,
            "faults": results, "fault_table": [_fault_row(r, reference) for r in results]}


_FAULT_COLUMNS = (
    ("fault", "fault"), ("control", "control"), ("policy", "on_mismatch"),
    ("inject", "inject_step"), ("weights differ", "first_weight_disagreement"),
    ("masks differ", "first_mask_disagreement"), ("detected", "detection_step"),
    ("ranks raised", "ranks_raised"), ("offending", "offending_ranks"), ("resyncs", "resyncs"),
    ("extra dense", "extra_dense_steps"), ("extra payload bytes", "extra_payload_bytes"),
    ("checks", "checks_held"))


def format_table(report):
    """Two plain tables: the fault-free run, and the fault table."""
    s = report["baseline"]["summary"]
    lines = [f"fault-free: {report['ranks']} ranks, classes {report['classes']}, "
             f"{s['steps_run']} steps, prune every {report['config']['prune_every']} steps to "
             f"density {s['final_density']:.3f}",
             f"  steps with differing masks: {s['mask_disagreement_steps']} "
             f"(rank-steps {s['mask_disagreeing_rank_steps']}), differing weights: "
             f"{s['weight_disagreement_steps']}, dense steps: {s['dense_steps']} "
             f"({s['fallback_fraction']:.3f}), resyncs: {s['resyncs']}, bytes/step: "
             f"{s['bytes_per_step']:.0f}, final loss {s['final_loss']:.3f}", ""]
    lines.append(harness.format_table(report["fault_table"], _FAULT_COLUMNS, sep="  "))
    return "\n".join(lines)


def write_plots(report, out_dir, prefix="bench_masks", window=50):
    """Fallback fraction (dense steps over the last ``window`` steps), cumulative resyncs, and
    ranks whose weights (lines) and masks (dots) differ from rank 0's, over steps, for the
    fault-free and the resync runs, as ``out_dir/<prefix>_timeline.png``; returns
    ``{name: path}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("fault-free", report["baseline"])] + [
        (f"{r['fault']} (resync)", r) for r in report["faults"]
        if r["on_mismatch"] == "resync" and not r["control"]]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for i, (label, result) in enumerate(runs):
        rows, color = result["rows"], plt.get_cmap("tab10")(i)
        steps = np.array([r["step"] for r in rows])
        dense = np.cumsum([0] + [r["dense"] for r in rows])
        trailing = (dense[1:] - dense[np.maximum(steps + 1 - window, 0)]) / np.minimum(
            steps + 1, window)
        axes[0].plot(steps, trailing, label=label, color=color)
        axes[1].step(steps, np.cumsum([r["resyncs"] for r in rows]), where="post", color=color)
        axes[2].step(steps, [r["weight_disagree"] for r in rows], where="post", color=color)
        hits = [(r["step"], r["mask_disagree"]) for r in rows if r["mask_disagree"]]
        if hits:
            axes[2].plot(*zip(*hits), "o", ms=4, color=color)
        if result["inject_step"] is not None:
            for ax in axes:
                ax.axvline(result["inject_step"], color=color, lw=0.8, ls=":")
    axes[0].set(ylabel=f"fallback fraction\n(last {window} steps)")
    axes[1].set(ylabel="resyncs (cumulative)")
    axes[2].set(ylabel="ranks differing from rank 0\nline: weights, dot: masks", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report['ranks']} ranks, non-IID classes {report['classes']}; "
                 "dotted: injection step")
    fig.tight_layout()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"timeline": str(path)}


def _for_json(report):
    """The report with each run's per-step rows as columns (``{"step": [...], ...}``), which
    keeps thousands of steps small; ``reference`` only when it is not the fault-free run."""
    def columns(result):
        rows = result["rows"]
        return dict(result, rows={key: [r[key] for r in rows] for key in (rows[0] if rows else {})})

    out = {k: v for k, v in report.items() if k not in ("rank", "reference")}
    out["baseline"] = columns(report["baseline"])
    if report["reference"] is not report["baseline"]:
        out["reference"] = columns(report["reference"])
    out["faults"] = [columns(r) for r in report["faults"]]
    return out


def _names(text, allowed, what):
    names = [] if text in ("", "none") else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad}; expected some of {allowed}")
    return tuple(names)


def build_parser(parser=None):
    parser = parser or command_parser("pacmpi bench masks", __doc__)
    for field in fields(BenchConfig):
        kind = type(field.default)
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=field.default,
                            metavar="N" if kind is int else "X", **field.metadata)
    parser.add_argument("--inject", type=lambda t: _names(t, FAULTS, "faults"), default=FAULTS,
                        metavar="FAULT,FAULT",
                        help=f"comma-separated faults from {','.join(FAULTS)}, or 'none' "
                             f"(default {','.join(FAULTS)})")
    parser.add_argument("--on-mismatch", type=lambda t: _names(t, POLICIES, "policies"),
                        default=POLICIES, metavar="POLICY,POLICY",
                        help=f"policies each fault runs under, comma-separated from "
                             f"{','.join(POLICIES)} (default both)")
    parser.add_argument("--controls", action="store_true",
                        help="also run every fault at size zero (the negative control)")
    add_json_file(parser, "the report")
    add_out_dir(parser, None, "write the timeline plot here, named after --json "
                              "(<stem>_timeline.png; default: no plot)")
    return parser


def main(argv=None):
    """Entry point of ``pacmpi bench masks``; prints the tables on rank 0. Exit status 1 when a
    check failed: masks differed without a raise (or resync) in that very step on every rank,
    a step raised or resynced with identical masks, a raise left gradients summed, or a
    resync's result was not the dense average."""
    args = build_parser().parse_args(argv)
    cfg = BenchConfig(**{k: getattr(args, k) for k in asdict(BenchConfig())})
    report = run(cfg, faults=args.inject, policies=args.on_mismatch, controls=args.controls)
    results = [report["baseline"], report["reference"], *report["faults"]]
    report["all_checks_held"] = all(r["summary"]["caught_in_step"]
                                    and r["summary"]["checks_held"] for r in results)
    if report["rank"] == 0:
        if args.out_dir:
            report["plots"] = write_plots(report, args.out_dir, prefix=(
                Path(args.json).stem if args.json else "bench_masks"))
        print(format_table(report))
        if args.json:
            harness.write_report(args.json, _for_json(report), "pacmpi bench masks",
                                 compact=True)
        if not report["all_checks_held"]:
            print("CHECK FAILED: see caught_in_step / checks_held in the JSON")
    return 0 if report["all_checks_held"] else 1
