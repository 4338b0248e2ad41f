"""``pacmpi train``: prune a model and fine-tune it data-parallel with PacTrain or a baseline over
MPI, Horovod or DDP; rank 0 prints each epoch's test accuracy and the per-step time split, and
``--json`` writes the whole result.

The product's main job. The model is a small CNN or MLP pretrained densely first (``--dataset
digits|digits32|cifar10``) or the pretrained MiniLM text encoder, fine-tuned for code search
(``--dataset codesearch``: ``--model minilm`` and ``--pretrain-epochs 0`` by default).
Steps: (1) pretrain densely on rank 0 (the other ranks wait without spinning) or load the
``--pretrained`` cache (0 epochs for a model that comes pretrained); (2) broadcast the weights;
(3) prune to ``--ratio`` (rank 0 decides and broadcasts the masks) or follow a ``--gradual``
schedule; (4) fine-tune with gradient sparsity enforcement
(:class:`~pacmpi.adapters.pruning.MaskEnforcer`) and the chosen gradient synchronization
(``--method``); (5) after every epoch broadcast rank 0's BatchNorm statistics and report test
accuracy, the step-time split (compute / pack / communication / unpack), bytes sent
and dense fallbacks. Run it under ``mpirun -n 4 pacmpi train ...``, with ``--backend horovod``
under ``horovodrun -np 4`` (Gloo or MPI controller) or ``mpirun -n 4``, or with ``--backend ddp``
(DistributedDataParallel; PacTrain as its communication hook) under torchrun::

    torchrun --standalone --nproc-per-node 4 -m pacmpi.cli train --backend ddp --method pactrain
    # multi-node: the same command on every node (gloo on CPU)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m pacmpi.cli train --backend ddp --method pactrain-ternary

(``torchrun ... --no-python pacmpi train ...`` works too.) DDP's own baselines: ``--method dense``
(DDP's default all-reduce), ``fp16`` (``fp16_compress_hook``), ``powersgd`` (``powerSGD_hook``,
``--powersgd-rank 1`` or ``4``). ``--sharded`` shards the optimizer state over the ranks:
``--method pactrain`` trains through :class:`pacmpi.adapters.sharded.ShardedOptimizer` (its
reduce-scatter of the survivors, stepped by ``optimizer.step()``; under ``--backend ddp`` by
:func:`~pacmpi.adapters.sharded.sharded_hook` inside backward), ``--method dense --backend ddp``
through torch's ``ZeroRedundancyOptimizer``; the result's ``optimizer_state_elements`` is the
largest rank's optimizer state.

Outer steps (``--outer-period H``, DiLoCo): the ranks train on their own and synchronize
every H steps, by :class:`pacmpi.adapters.outer.OuterSync` (``--method dense``: the
pseudo-gradient by a dense fp32 all-reduce, DiLoCo's reference; ``pactrain``,
``pactrain-ternary``: packed) or, with ``--backend ddp --outer-optimizer postlocal``, torch's
``PostLocalSGDOptimizer``. A step's ``bytes_sent`` is its outer step's (0 between them);
evaluations score the global weights, those of the last outer step; masks move at outer steps.
``--checkpoint`` keeps OuterSync's state (global weights, outer momentum, each rank's own
weights and inner optimizer, the position in the period): a run resumed mid-period continues
bit for bit.

Every collective of the job (weight and mask broadcasts, evaluation sums, barriers, the gradient
synchronization) runs on one :class:`pacmpi.Collectives` (:func:`collectives_for`): MPI's
``COMM_WORLD`` for ``--backend mpi``, Horovod's process set for ``--backend horovod``, the
``torch.distributed`` world for ``--backend ddp``, so the job needs no MPI world there.

All methods fine-tune the *same pruned model*: ``--method dense`` is the plain all-reduce
baseline, so its accuracy is what PacTrain (lossless) must match.
"""
import argparse
import atexit
import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import sys
import time
import warnings
from collections import OrderedDict
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pacmpi import MPICollectives
from pacmpi.adapters.checkpoint import atomic_save, load_checkpoint, save_checkpoint
from pacmpi.adapters.outer import OuterSync
from pacmpi.adapters.pruning import (
    PRUNING_CRITERIA,
    GradualPruningSchedule,
    MaskEnforcer,
    named_prunable_parameters,
    prune,
)
from pacmpi.adapters.recipe import cubic_milestones, linear_weights
from pacmpi.adapters.torch_sync import (
    barrier,
    broadcast_buffers,
    broadcast_object,
    broadcast_parameters,
)
from pacmpi.cli_options import command_parser
from pacmpi.collectives import allreduce_algorithm
from pacmpi.engine import check_options
from pacmpi.experiments.baselines import make_baseline, make_sync
from pacmpi.experiments.codesearch import (
    contrastive_loss,
    load_codesearch_split,
    retrieval_accuracy,
)
from pacmpi.experiments.data import (
    iterate_minibatches,
    load_cifar10,
    load_digits32_split,
    load_digits_split,
    shard,
)
from pacmpi.experiments.models import MODELS, PRETRAINED_MODELS, build_model, count_parameters
from pacmpi.methods import ALLREDUCE_METHODS, METHODS, lookup_method
from pacmpi.units import parse_size

__all__ = ["BiasProbe", "TrainConfig", "add_config_options", "build_parser", "check_config",
           "collectives_for", "exit_after_gloo",
           "fine_tune", "main", "pretrained_state", "run"]

OPTIMIZERS = ("sgd", "adam", "adamw")
# Methods whose synchronized p.grad estimates the average gradient (DGC's carries its momentum).
PROBED_METHODS = ALLREDUCE_METHODS + ("topk", "terngrad")
# The all-gather baselines run over mpi4py (--backend mpi).
GATHER_METHODS = tuple(name for name, m in METHODS.items() if m.collective == "allgather")
# What each backend runs: the all-reduces (pacmpi's engine, or the framework's own for dense
# and fp16) everywhere, the all-gathers over mpi4py, PowerSGD as DDP's powerSGD_hook.
BACKEND_METHODS = {
    "mpi": ALLREDUCE_METHODS + GATHER_METHODS,
    "horovod": ALLREDUCE_METHODS,
    "ddp": tuple(name for name, m in METHODS.items() if m.collective in ("allreduce", "powersgd")),
}
BACKENDS = tuple(BACKEND_METHODS)
# digits32: the digits upscaled to 32x32; codesearch: docstring <-> signature retrieval
# (pacmpi.experiments.codesearch), fine-tuning the pretrained MiniLM.
DATASETS = ("digits", "digits32", "cifar10", "codesearch")
# --prune-layers: prune()'s own default selection, or the transformer recipe's.
PRUNE_LAYERS = ("all", "linear")
# --outer-period: what an outer step sends (the pseudo-gradient dense or packed, lossless or
# ternary), and which optimizer runs it.
OUTER_METHODS = ("dense", "pactrain", "pactrain-ternary")
OUTER_OPTIMIZERS = ("diloco", "postlocal")
DEFAULT_MODELS = {"digits": "digits_cnn", "cifar10": "cifar_cnn", "digits32": "resnet18",
                  "codesearch": "minilm"}


def _ternary_scale(text):
    """``--ternary-scale``: a name, or digits for blocks of that many elements (checked by
    :func:`pacmpi.engine.check_options` with the rest of the config)."""
    return int(text) if text.isdigit() else text


def knob(default, help, **argparse_options):
    """A :class:`TrainConfig` field: its ``default``, its ``--help`` text and any other argparse
    options of its flag (``choices``, ``type``)."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_options})


@dataclasses.dataclass
class TrainConfig:
    """Every knob of the job; the command-line flags carry the same names (``--batch-size``)."""

    # One definition per knob: `name: type = knob(default, "help")`. build_parser makes the flag
    # from it; the help says what the knob does and its unit or format (the formatter appends
    # the default; a None default's text says what unset means). Add a field the same way.
    dataset: str = knob(
        "digits", "what to train on: digits (scikit-learn's 8x8 digits, offline), digits32 (the "
        "same upscaled to 32x32), cifar10 (needs --data-dir) or codesearch (docstring -> "
        "signature retrieval: fine-tunes the pretrained MiniLM, so --model minilm and "
        "--pretrain-epochs 0 by default; the other defaults are the image sets')",
        choices=DATASETS)
    data_dir: Optional[str] = knob(
        None, "folder holding CIFAR-10's python batches (never downloaded); --dataset cifar10 "
              "needs it", metavar="DIR")
    model: Optional[str] = knob(
        None, "the model (default by dataset: "
              + ", ".join(f"{m} for {d}" for d, m in DEFAULT_MODELS.items())
              + "; mlp on the image sets takes --hidden)", choices=tuple(MODELS))
    width: int = knob(32, "channels of the CNNs' first convolution (later layers scale with "
                          "it); not used by mlp and minilm")
    hidden: str = knob("256", "hidden units: one integer for digits_cnn's dense layer, or the "
                              "MLP's layers comma-separated (e.g. 2048,1024)", metavar="N[,N]")
    pretrained: Optional[str] = knob(
        None, "cache of the densely pretrained model: loaded if it holds this run's "
              "pretraining (dataset, model, epochs, seed), else written after it (default: "
              "pretrain every run)", metavar="FILE")
    pretrain_epochs: Optional[int] = knob(
        None, "dense pretraining epochs on rank 0 before pruning (default: 10, or 0 for "
              "minilm, which comes pretrained)", type=int)
    pretrain_lr: float = knob(3e-3, "Adam learning rate of the dense pretraining")
    method: str = knob(
        "pactrain", "gradient synchronization: dense (the plain all-reduce), fp16, pactrain "
                    "(lossless: the survivors only), pactrain-ternary, or the baselines topk, "
                    "terngrad, dgc and powersgd (which --backend runs which: see --backend)",
        choices=tuple(METHODS))
    ratio: float = knob(0.5, "pruning ratio: the fraction of prunable weights removed before "
                             "fine-tuning, or by the end of --prune-steps (ignored with "
                             "--gradual)")
    prune_method: str = knob(
        "magnitude", "pruning criterion: magnitude (|W|), taylor (first-order saliency |W*g|, "
                     "for pretrained models) or grasp (at initialization)",
        choices=PRUNING_CRITERIA)
    gradual: Optional[str] = knob(
        None, "gradual pruning schedule STEP:RATIO,STEP:RATIO (e.g. 100:0.5,200:0.8): prune to "
              "RATIO at fine-tuning step STEP, replacing --ratio (default: prune once, to "
              "--ratio, before fine-tuning)", metavar="STEP:RATIO,...")
    prune_layers: str = knob(
        "all", "which weights --ratio counts: all (every weight matrix and embedding table; "
               "norms and biases stay dense) or linear (the recipe for transformers: the linear "
               "layers' weight matrices only, embeddings and classification/pooling heads "
               "dense; pacmpi.adapters.recipe.linear_weights)", choices=PRUNE_LAYERS)
    prune_steps: int = knob(
        0, "prune gradually over the first N fine-tuning steps, on the cubic schedule from "
           "--initial-ratio to --ratio (pacmpi.adapters.recipe), moving the mask every "
           "--prune-every steps (0: one shot, before fine-tuning)", metavar="N")
    prune_every: int = knob(10, "with --prune-steps: steps between two moves of the mask")
    initial_ratio: float = knob(0.0, "with --prune-steps: the pruning ratio the cubic schedule "
                                     "starts from (at step 0)")
    rewarm_steps: int = knob(
        0, "after each move of the mask (--prune-steps, --gradual), ramp the learning rate "
           "linearly back up to --lr over N steps (0: no re-warm)", metavar="N")
    distill: float = knob(
        0.0, "knowledge distillation: this share of the loss is the KL divergence from the "
             "dense model's output distribution (the model as loaded, before pruning: one more "
             "forward per step), the rest the task's loss (0: off)", metavar="SHARE")
    freeze_embeddings: bool = knob(
        False, "freeze every embedding table (no gradient, nothing sent for it), whatever the "
               "method")
    epochs: int = knob(3, "fine-tuning epochs")
    eval_every: int = knob(0, "also evaluate every this many fine-tuning steps (0: after each "
                              "epoch only); evaluation time is not counted as training time")
    batch_size: int = knob(32, "samples per rank per step (codesearch: query-code pairs, the "
                               "in-batch negatives)")
    lr: float = knob(0.01, "fine-tuning learning rate")
    optimizer: str = knob("sgd", "fine-tuning optimizer: sgd (with --momentum), adam or adamw",
                          choices=OPTIMIZERS)
    momentum: float = knob(0.9, "SGD momentum (--optimizer sgd; dgc applies it before "
                                "compressing)")
    weight_decay: float = knob(0.0, "weight decay of the fine-tuning optimizer")
    topk_ratio: float = knob(0.01, "fraction of the gradient's coordinates --method topk and dgc "
                                   "send (0.01: 1 in 100)")
    error_feedback: bool = knob(
        True, "add the part of the gradient a step did not send to the next step's (the "
              "residual; pactrain-ternary and topk): --no-error-feedback drops it")
    ternary_scale: Union[str, int] = knob(
        "tensor", "pactrain-ternary's scales: tensor (one per parameter tensor), bucket (one per "
                  "fusion bucket) or an integer N (one per N elements of a tensor)",
        type=_ternary_scale, metavar="tensor|bucket|N")
    bias_probe: bool = knob(
        False, "also all-reduce the exact average gradient (doubling the traffic) and report "
               "the method's error against it (--backend mpi; what pacmpi bench bias reads)")
    powersgd_rank: int = knob(1, "approximation rank of --method powersgd (--backend ddp)")
    sharded: bool = knob(
        False, "shard the optimizer state over the ranks: pactrain through pacmpi's "
               "ShardedOptimizer (its DDP hook under --backend ddp), dense under --backend ddp "
               "through torch's ZeroRedundancyOptimizer")
    outer_period: int = knob(
        0, "outer steps (DiLoCo): every rank trains on its own data and the ranks synchronize "
           "every H steps by an outer step, which sends the pseudo-gradient (global minus local "
           "weights) by --method: dense (fp32 all-reduce), pactrain (the survivors), "
           "pactrain-ternary (their ternary codes); --backend mpi or ddp; evaluations score "
           "the global weights, --verify-every and --stable-steps count outer steps (0: "
           "synchronize every step)", metavar="H")
    outer_optimizer: str = knob(
        "diloco", "with --outer-period: diloco (pacmpi.adapters.outer.OuterSync: outer SGD "
                  "with Nesterov momentum, --outer-lr, --outer-momentum) or postlocal (torch's "
                  "PostLocalSGDOptimizer averaging the weights, a dense fp32 all-reduce: the "
                  "peer torch users have; --backend ddp --method dense)",
        choices=OUTER_OPTIMIZERS)
    outer_lr: float = knob(0.7, "with --outer-period: the outer SGD's learning rate (DiLoCo's "
                                "0.7; 1 with --outer-momentum 0 is model averaging)")
    outer_momentum: float = knob(0.9, "with --outer-period: the outer SGD's Nesterov momentum "
                                      "(0: plain SGD)")
    bucket_bytes: int = knob(25 * 1024 * 1024,
                             "fusion bucket size: bytes, or K/M/G (binary: 25M = 26214400)",
                             type=parse_size, metavar="SIZE")
    verify_every: int = knob(1, "check that all ranks hold the same masks every this many "
                                "steps (1: every step); a mask changed in between is sent "
                                "from the next check on")
    stable_steps: Optional[int] = knob(
        None, "steps a changed mask must stay unchanged before its bucket is sent packed again "
              "(until then: dense, masked; 0: at once; default 1, or 0 with --outer-period, "
              "whose outer steps count and each verify the masks)", type=int)
    seed: int = knob(0, "random seed: the digits' train/test split, the initialization, the "
                        "batch order and the stochastic methods")
    threads: int = knob(0, "torch threads per rank (0: the host's cores / the ranks)")
    checkpoint: Optional[str] = knob(
        None, "where to save the fine-tuning state and --resume from (--backend mpi; "
              "default: no checkpoints)", metavar="FILE")
    checkpoint_every: int = knob(0, "save --checkpoint every this many steps (0: at the end of "
                                    "every epoch)")
    resume: bool = knob(False, "continue from --checkpoint if the file exists")
    max_steps: int = knob(0, "stop after this many fine-tuning steps (0: no limit)")
    backend: str = knob(
        "mpi", "how the ranks communicate: mpi (mpirun), horovod (horovodrun or mpirun) or ddp "
               "(torchrun; DistributedDataParallel with the method as its communication hook); "
               "their methods: " + "; ".join(f"{b}: {','.join(ms)}"
                                             for b, ms in BACKEND_METHODS.items()),
        choices=BACKENDS)
    watchdog: Optional[str] = knob(
        None, "WARN[,ABORT] in seconds: name the ranks a collective waits for after WARN "
              "seconds, end the job after ABORT (--backend mpi; default: off)",
        metavar="WARN[,ABORT]")
    json: Optional[str] = knob(
        None, "write the whole result here, on rank 0: config, per-epoch records, step-time "
              "split (default: not written)", metavar="FILE")
    progress: bool = knob(True, "show a progress bar and a line per evaluation on stderr "
                                "(rank 0)")


def parse_gradual(text):
    """``"100:0.5,200:0.8"`` -> ``[(100, 0.5), (200, 0.8)]``."""
    milestones = []
    for item in text.split(","):
        step, sep, ratio = item.partition(":")
        if not sep:
            raise ValueError(f"--gradual entries are step:ratio, got {item!r}")
        milestones.append((int(step), float(ratio)))
    return milestones


def check_config(config):
    """The :class:`TrainConfig` of ``config`` (a TrainConfig, dict or argparse namespace) with
    its defaults resolved; ``ValueError`` naming the first knob that is wrong or does not fit
    the others."""
    if isinstance(config, TrainConfig):
        config = dataclasses.asdict(config)
    elif isinstance(config, argparse.Namespace):
        config = vars(config)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown config keys: {unknown}")
    cfg = TrainConfig(**config)
    cfg.method = lookup_method(cfg.method).name
    checks = [(cfg.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}"),
              (cfg.backend in BACKENDS, f"backend must be one of {BACKENDS}"),
              (cfg.dataset in DATASETS, f"dataset must be one of {DATASETS}, got {cfg.dataset!r}"),
              (cfg.dataset != "cifar10" or cfg.data_dir, "--dataset cifar10 needs --data-dir"),
              (cfg.prune_layers in PRUNE_LAYERS,
               f"prune_layers must be one of {PRUNE_LAYERS}, got {cfg.prune_layers!r}"),
              (not cfg.resume or cfg.checkpoint, "--resume needs --checkpoint"),
              (cfg.backend != "horovod" or cfg.method in BACKEND_METHODS["horovod"],
               f"--backend horovod supports --method {'|'.join(BACKEND_METHODS['horovod'])}; "
               f"run --method {'|'.join(GATHER_METHODS)} with --backend mpi"),
              (cfg.backend != "ddp" or cfg.method in BACKEND_METHODS["ddp"],
               f"--backend ddp supports --method {'|'.join(BACKEND_METHODS['ddp'])}"),
              (cfg.method != "powersgd" or cfg.backend == "ddp",
               "--method powersgd is DDP's powerSGD_hook: use --backend ddp"),
              (cfg.powersgd_rank >= 1, "--powersgd-rank must be at least 1"),
              (cfg.error_feedback or cfg.method in ("pactrain-ternary", "topk"),
               f"--no-error-feedback applies to pactrain-ternary and topk, not {cfg.method}"),
              (cfg.method != "dgc" or cfg.optimizer == "sgd",
               "--method dgc corrects SGD momentum: use --optimizer sgd"),
              (not cfg.bias_probe or (cfg.backend == "mpi" and cfg.method in PROBED_METHODS),
               f"--bias-probe needs --backend mpi and --method {'|'.join(PROBED_METHODS)}"),
              (not cfg.sharded or cfg.method == "pactrain"
               or (cfg.method == "dense" and cfg.backend == "ddp"),
               f"--sharded shards --method pactrain (any backend) or dense (--backend ddp: "
               f"ZeroRedundancyOptimizer), not {cfg.method} with --backend {cfg.backend}"),
              (not (cfg.sharded and (cfg.checkpoint or cfg.bias_probe)),
               "--sharded does not support --checkpoint or --bias-probe"),
              (cfg.backend == "mpi" or not cfg.checkpoint,
               f"--backend {cfg.backend} does not support --checkpoint/--resume; "
               "use --backend mpi"),
              (cfg.backend == "mpi" or not cfg.watchdog,
               "--watchdog watches MPI collectives; use it with --backend mpi")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    check_options(ternary_scale=cfg.ternary_scale)
    if cfg.watchdog:
        parse_watchdog(cfg.watchdog)
    if cfg.model is None:
        cfg.model = DEFAULT_MODELS[cfg.dataset]
    if cfg.pretrain_epochs is None:
        cfg.pretrain_epochs = 0 if cfg.model in PRETRAINED_MODELS else 10
    if (cfg.dataset == "codesearch") != (cfg.model in PRETRAINED_MODELS):
        raise ValueError(f"--model {cfg.model} does not fit --dataset {cfg.dataset}: "
                         f"codesearch trains {'|'.join(PRETRAINED_MODELS)}, the image sets the "
                         "CNNs and MLP")
    if cfg.eval_every < 0:
        raise ValueError(f"--eval-every must be >= 0 steps, got {cfg.eval_every}")
    if cfg.prune_steps and cfg.gradual:
        raise ValueError("--prune-steps (the cubic schedule) and --gradual (milestones) are two "
                         "schedules: give one")
    if cfg.prune_steps < 0 or cfg.rewarm_steps < 0:
        raise ValueError(f"--prune-steps and --rewarm-steps are step counts >= 0, got "
                         f"{cfg.prune_steps} and {cfg.rewarm_steps}")
    if cfg.rewarm_steps and cfg.sharded:
        raise ValueError("--rewarm-steps sets the optimizer's learning rate, which --sharded "
                         "keeps inside its shards: use one of them")
    if not 0.0 <= cfg.distill < 1.0:
        raise ValueError(f"--distill is a share of the loss in [0, 1), got {cfg.distill}")
    if cfg.prune_steps:
        _milestones(cfg)  # names a bad --ratio, --initial-ratio or --prune-every now
    _check_outer(cfg)
    if cfg.stable_steps is None:
        # An outer step verifies the masks anyway, and outer steps are rare: a mask is packed
        # at the first one that verifies it (OuterSync's own default).
        cfg.stable_steps = 0 if cfg.outer_period else 1
    return cfg


def _check_outer(cfg):
    """``ValueError`` naming the value unless the outer-step knobs fit each other and the rest
    of ``cfg``."""
    if isinstance(cfg.outer_period, bool) or not isinstance(cfg.outer_period, int) \
            or cfg.outer_period < 0:
        raise ValueError(f"--outer-period is a step count >= 0, got {cfg.outer_period!r}")
    if not (cfg.outer_lr > 0 and cfg.outer_momentum >= 0):
        raise ValueError(f"--outer-lr must be > 0 and --outer-momentum >= 0, got "
                         f"{cfg.outer_lr} and {cfg.outer_momentum}")
    if cfg.outer_optimizer not in OUTER_OPTIMIZERS:
        raise ValueError(f"outer_optimizer must be one of {OUTER_OPTIMIZERS}, got "
                         f"{cfg.outer_optimizer!r}")
    defaults = TrainConfig()
    tuned = [f"--{name.replace('_', '-')} {getattr(cfg, name)}"
             for name in ("outer_optimizer", "outer_lr", "outer_momentum")
             if getattr(cfg, name) != getattr(defaults, name)]
    if not cfg.outer_period:
        if tuned:
            raise ValueError(f"{', '.join(tuned)} applies to outer steps: give --outer-period H")
        return
    where = f"--outer-period {cfg.outer_period}"
    postlocal = cfg.outer_optimizer == "postlocal"
    unsupported = [flag for flag, given in (("--sharded", cfg.sharded),
                                            ("--bias-probe", cfg.bias_probe),
                                            ("--checkpoint", cfg.checkpoint and postlocal))
                   if given]
    checks = [(cfg.method in OUTER_METHODS,
               f"{where} sends the pseudo-gradient by --method {'|'.join(OUTER_METHODS)}, not "
               f"{cfg.method}"),
              (cfg.backend in ("mpi", "ddp"),
               f"{where} runs with --backend mpi or ddp, not {cfg.backend}"),
              (not unsupported, f"{where} does not support {', '.join(unsupported)}"),
              (not postlocal or (cfg.backend, cfg.method) == ("ddp", "dense"),
               f"--outer-optimizer postlocal is torch's PostLocalSGDOptimizer: --backend ddp "
               f"--method dense, not --method {cfg.method} with --backend {cfg.backend}"),
              (not postlocal or len(tuned) == 1,
               f"--outer-optimizer postlocal averages the weights: {', '.join(tuned[1:])} "
               "does not apply"),
              # OuterSync holds no masks for dense: a mask that moved would not reach its
              # global weights and outer momentum.
              (postlocal or cfg.method != "dense" or not (cfg.prune_steps or cfg.gradual),
               f"{where} --method dense sends every weight and holds no masks, so a moving "
               "mask (--prune-steps, --gradual) would not reach the global weights: prune once "
               "(--ratio) or use --method pactrain")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _milestones(cfg):
    """The pruning schedule's ``[(step, ratio)]``, or None to prune once before fine-tuning."""
    if cfg.prune_steps:
        return cubic_milestones(cfg.ratio, cfg.prune_steps, cfg.prune_every,
                                initial=cfg.initial_ratio)
    return parse_gradual(cfg.gradual) if cfg.gradual else None


def parse_watchdog(text):
    """``"60"`` or ``"60,600"`` -> (warn_after, abort_after or None) in seconds."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or min(values) <= 0:
        raise ValueError(f"--watchdog must be WARN or WARN,ABORT in seconds, got {text!r}")
    return values[0], (values[1] if len(values) == 2 else None)


# ---------------------------------------------------------------------------------- pieces
def _load_data(cfg):
    if cfg.dataset == "codesearch":
        return load_codesearch_split()
    if cfg.dataset == "cifar10":
        return load_cifar10(cfg.data_dir)
    if cfg.dataset == "digits32":
        return load_digits32_split(seed=cfg.seed)
    return load_digits_split(seed=cfg.seed)


def _model_kwargs(cfg, data):
    if cfg.model in PRETRAINED_MODELS:
        return {}
    hidden = [int(h) for h in cfg.hidden.split(",")]
    if cfg.model == "mlp":
        return {"in_features": int(data.x_train[0].numel()), "hidden": hidden}
    if cfg.model == "digits_cnn":
        return {"width": cfg.width, "hidden": hidden[0]}
    if cfg.model == "resnet18":
        return {"width": cfg.width, "in_channels": int(data.x_train.shape[1])}
    return {"width": cfg.width}


def _optimizer_kind(cfg, lr):
    """``(optimizer class, its arguments but the parameters)``, as the sharded optimizers
    take them."""
    if cfg.optimizer == "sgd":
        # DGC applies the momentum before compressing (momentum correction), not after.
        momentum = 0.0 if cfg.method == "dgc" else cfg.momentum
        return torch.optim.SGD, dict(lr=lr, momentum=momentum, weight_decay=cfg.weight_decay)
    kind = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return kind, dict(lr=lr, weight_decay=cfg.weight_decay)


def _optimizer(cfg, params, lr):
    kind, options = _optimizer_kind(cfg, lr)
    return kind(params, **options)


def _state_elements(optimizer):
    """Elements of the per-coordinate state (momenta) ``optimizer`` keeps on this rank."""
    inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", optimizer)
    return sum(v.numel() for state in inner.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _loss_fn(cfg):
    return contrastive_loss if cfg.dataset == "codesearch" else F.cross_entropy


def _evaluate(cfg, model, data, collectives=None):
    """``{"test_accuracy": ...}`` over the whole test set (codesearch: top-1 retrieval accuracy,
    and ``test_top5``), each rank of ``collectives`` scoring its share (``None``: this process
    scores all of it)."""
    if cfg.dataset == "codesearch":
        top1, top5 = retrieval_accuracy(model, data.x_test, collectives)
        return {"test_accuracy": top1, "test_top5": top5}
    return {"test_accuracy": _classification_accuracy(model, data, collectives)}


@torch.no_grad()
def _classification_accuracy(model, data, collectives):
    rank, size = (0, 1) if collectives is None else (collectives.rank, collectives.size)
    model.eval()
    x, y = data.x_test[rank::size], data.y_test[rank::size]
    correct = sum(int((model(xb).argmax(1) == yb).sum())
                  for xb, yb in iterate_minibatches(x, y, 512, seed=0, epoch=0, shuffle=False))
    model.train()
    counts = np.array([correct, len(y)], dtype=np.int64)
    if collectives is not None:
        collectives.allreduce(counts, "sum")
    return int(counts[0]) / int(counts[1])


def _wait_quietly(collectives):
    """Block until every rank arrives without taking the cores from rank 0 while it pretrains:
    over MPI, poll a nonblocking barrier and sleep in between (MPI's blocking wait spins);
    Horovod's background thread already sleeps between its cycles."""
    if not isinstance(collectives, MPICollectives):
        barrier(collectives)
        return
    request = collectives.comm.Ibarrier()
    while not request.Test():
        time.sleep(0.02)


def _pretrain(cfg, data, kwargs):
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, **kwargs)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.pretrain_lr)
    for epoch in range(cfg.pretrain_epochs):
        for xb, yb in iterate_minibatches(data.x_train, data.y_train, 64, seed=cfg.seed + 1,
                                          epoch=epoch, drop_last=True):
            optimizer.zero_grad()
            _loss_fn(cfg)(model(xb), yb).backward()
            optimizer.step()
    return model


def pretrained_state(cfg, data, kwargs, collectives):
    """Rank 0 loads the cache (if its model matches) or pretrains and writes it; returns
    ``(state_dict or None on other ranks, dense test accuracy)``."""
    state, accuracy, error = None, None, None
    if collectives.rank == 0:
        try:
            key = {"dataset": cfg.dataset, "model": cfg.model, "kwargs": kwargs,
                   "pretrain_epochs": cfg.pretrain_epochs, "seed": cfg.seed}
            cached = (torch.load(cfg.pretrained, map_location="cpu", weights_only=False)
                      if cfg.pretrained and os.path.exists(cfg.pretrained) else None)
            if cached is not None and cached["key"] != key:
                raise ValueError(f"--pretrained {cfg.pretrained} holds {cached['key']}, this run "
                                 f"needs {key}; delete it or pass another path")
            if cached is None:
                model = _pretrain(cfg, data, kwargs)
                accuracy = _evaluate(cfg, model, data)["test_accuracy"]
                cached = {"key": key, "state": model.state_dict(), "accuracy": accuracy}
                if cfg.pretrained:
                    atomic_save(cached, cfg.pretrained)
            state, accuracy = cached["state"], cached["accuracy"]
        except (OSError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if collectives.size > 1:
        _wait_quietly(collectives)
        error, accuracy = broadcast_object(collectives, (error, accuracy))
    if error is not None:
        raise RuntimeError(f"pretraining on rank 0 failed: {error}")
    return state, accuracy


def _state_digest(model):
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _horovod():
    """``(horovod.torch, pacmpi.adapters.horovod)``, or a clear error if Horovod is missing."""
    try:
        import horovod.torch as hvd

        from pacmpi.adapters import horovod as adapter
    except ImportError as exc:
        raise RuntimeError(f"--backend horovod needs horovod.torch (pip install "
                           f"pacmpi[horovod]) and pacmpi.adapters.horovod: {exc}") from exc
    return hvd, adapter


def _close_process_group():
    """At a normal exit, the gloo group this module opened: left to the interpreter's exit,
    or torn down while a peer still talks to it, it may abort a finished rank ("terminate
    called without an active exception"). So every rank arrives first, then it is destroyed.
    After an unhandled exception it is left alone: the peers may never arrive."""
    import torch.distributed as dist

    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.barrier()
        dist.destroy_process_group()


def collectives_for(backend, watchdog=None):
    """The transport every collective of the job runs on: for ``"mpi"`` an
    :class:`pacmpi.MPICollectives` on a duplicate of ``COMM_WORLD`` (watched by a
    :class:`pacmpi.watchdog.StallWatchdog` when ``watchdog`` is ``"WARN[,ABORT]"``); for
    ``"horovod"`` ``hvd.init()`` and a :class:`pacmpi.adapters.horovod.HorovodCollectives`
    (works under ``horovodrun --gloo``, where there is no MPI world, and under ``mpirun``); for
    ``"ddp"`` ``torch.distributed`` (initialized from torchrun's environment if it is not yet,
    gloo; without torchrun, a world of one) and a
    :class:`pacmpi.adapters.ddp.TorchDistCollectives`.
    Collective."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "ddp":
        import torch.distributed as dist

        from pacmpi.adapters.ddp import TorchDistCollectives

        if not dist.is_initialized():
            if "RANK" not in os.environ:  # not under torchrun: a world of one
                os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
            dist.init_process_group("gloo")
            atexit.register(_close_process_group)
        return TorchDistCollectives()
    if backend == "mpi":
        if not watchdog:
            return MPICollectives()
        from pacmpi.watchdog import StallWatchdog

        return MPICollectives(watchdog=StallWatchdog(*parse_watchdog(watchdog)))
    hvd, adapter = _horovod()
    hvd.init()
    return adapter.HorovodCollectives()


class _FrameworkSync:
    """What the Horovod and DDP backends share: the masks (the engine re-reads these tensors:
    update them in place), dense-equivalent bytes, counters and the per-step record."""

    def __init__(self, cfg, model, masks):
        self.masks = masks
        self.dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._wire_bytes = self.dense_bytes // 2 if cfg.method == "fp16" else self.dense_bytes
        self.stats = {"steps": 0, "bytes_sent": 0, "dense_fallbacks": 0,
                      "packed_reductions": 0, "dense_reductions": 0}
        self.last_step = {}

    def set_masks(self, masks):
        with torch.no_grad():
            for name, mask in masks.items():
                self.masks[name].copy_(mask)

    def _record(self, counters, sent, **fields):
        """Account one step: ``counters`` (cumulative bytes_sent, dense_fallbacks, packed and
        dense reductions of pacmpi's engine) or, for a framework's own method, ``sent`` bytes
        of one dense reduction; ``fields`` go into ``last_step`` as they are."""
        before = dict(self.stats)
        if counters is None:
            self.stats["bytes_sent"] += sent
            self.stats["dense_reductions"] += 1
        else:
            self.stats.update(counters)
        self.stats["steps"] += 1
        self.last_step = {key: self.stats[key] - before[key] for key in self.stats}
        self.last_step.update(fields, dense_bytes=self.dense_bytes)


class _HorovodSync(_FrameworkSync):
    """``--backend horovod``: ``hvd.DistributedOptimizer`` with
    :class:`pacmpi.adapters.horovod.PacTrainCompressor` (pactrain, pactrain-ternary) or Horovod's
    own compression (dense, fp16), behind the few members :func:`run` uses of a sync.

    Horovod packs and reduces inside ``optimizer.step()``, so the step split is coarser than
    with MPI: ``comm_seconds`` is the whole synchronization (pack + all-reduce + unpack).
    Checkpoints and TopK are MPI-backend only (:func:`check_config` refuses them). Needs
    ``hvd.init()`` first (:func:`collectives_for`).
    """

    def __init__(self, cfg, model, optimizer, masks, enforcer):
        hvd, adapter = _horovod()
        super().__init__(cfg, model, masks)
        op = hvd.Average
        method = METHODS[cfg.method]
        if method.packed:
            ternary = method.quantize == "ternary"
            self.compressor = adapter.PacTrainCompressor(
                model, masks, quantize=method.quantize, average=ternary,
                stable_steps=cfg.stable_steps, verify_every=cfg.verify_every, seed=cfg.seed,
                error_feedback=cfg.error_feedback, ternary_scale=cfg.ternary_scale)
            compression, op = self.compressor, (hvd.Sum if ternary else hvd.Average)
        else:
            self.compressor = None
            compression = hvd.Compression.fp16 if cfg.method == "fp16" else hvd.Compression.none
        enforcer.register_grad_hooks()  # GSE before Horovod's hooks see the gradients
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression, op=op)

    def record(self, compute_seconds, step_seconds):
        """Account one step: ``step_seconds`` is the time ``optimizer.step()`` took."""
        c = None if self.compressor is None else self.compressor.stats
        self._record(None if c is None else dict(
            bytes_sent=c["bytes_sent"], dense_fallbacks=c["dense_fallbacks"],
            packed_reductions=c["packed_reductions"], dense_reductions=c["dense_reductions"]),
            self._wire_bytes, compute_seconds=compute_seconds, comm_seconds=step_seconds,
            wait_seconds=step_seconds)


class _DDPSync(_FrameworkSync):
    """``--backend ddp``: the model wrapped in ``DistributedDataParallel`` with
    :func:`pacmpi.adapters.ddp.pactrain_hook` (pactrain, pactrain-ternary), DDP's default
    all-reduce (dense), ``fp16_compress_hook`` or ``powerSGD_hook``; the few members :func:`run`
    uses of a sync. Communication overlaps backward, so ``compute_seconds`` includes what of it
    is exposed; ``comm_seconds`` is the hook's (PacTrain only). Needs ``torch.distributed``
    (:func:`collectives_for`)."""

    def __init__(self, cfg, model, masks):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook

        super().__init__(cfg, model, masks)
        self.state, self.powersgd = None, None
        bucket_cap_mb = None
        if cfg.method == "powersgd" and torch.distributed.get_backend() == "gloo":
            # powerSGD_hook waits on futures inside callbacks that run on gloo's worker
            # threads: with two buckets in flight it deadlocks, so one bucket holds the model.
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            bucket_cap_mb = max(25, -(-model_bytes // (1 << 20)) + 1)
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        if METHODS[cfg.method].packed:
            self.state = PacTrainHookState(
                self.ddp, masks, quantize=METHODS[cfg.method].quantize,
                stable_steps=cfg.stable_steps, verify_every=cfg.verify_every, seed=cfg.seed,
                error_feedback=cfg.error_feedback, ternary_scale=cfg.ternary_scale)
            self.ddp.register_comm_hook(self.state, pactrain_hook)
        elif cfg.method == "fp16":
            self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif cfg.method == "powersgd":
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                start_powerSGD_iter=2, random_seed=cfg.seed)
            self.ddp.register_comm_hook(self.powersgd, powerSGD_hook.powerSGD_hook)
        self._powersgd_numel, self._seconds = 0, {}

    def record(self, compute_seconds, step_seconds):
        """Account one step (``step_seconds``: ``optimizer.step()``, local under DDP)."""
        counters, sent, extra = None, self._wire_bytes, {"comm_seconds": 0.0}
        if self.state is not None:
            s = self.state.stats
            counters = {key: s[key] for key in ("bytes_sent", "dense_fallbacks",
                                                "packed_reductions", "dense_reductions")}
            for key in ("pack_seconds", "comm_seconds", "unpack_seconds", "verify_seconds"):
                extra[key] = s[key] - self._seconds.get(key, 0.0)
                self._seconds[key] = s[key]
        elif self.powersgd is not None:  # cumulative elements sent once compression starts
            numel = self.powersgd.total_numel_after_compression
            sent = (numel - self._powersgd_numel) * 4 if numel > self._powersgd_numel \
                else self.dense_bytes
            self._powersgd_numel = numel
        self._record(counters, sent, compute_seconds=compute_seconds, wait_seconds=0.0, **extra)


class _ShardedSync(_FrameworkSync):
    """``--sharded``: the optimizer state sharded over the ranks. PacTrain: a
    :class:`pacmpi.adapters.sharded.ShardedOptimizer` over this rank's shard of the survivors,
    stepped by ``optimizer.step()`` (``--backend mpi``) or inside backward by
    :func:`~pacmpi.adapters.sharded.sharded_hook` (``--backend ddp``); dense (``--backend
    ddp``): DDP's all-reduce and torch's ``ZeroRedundancyOptimizer``, the ZeRO-1 users have.
    ``weight_bytes`` per step: what the collective that brings the updated weights back
    carries (the all-gather; ZeRO's broadcasts), beside the gradient's ``bytes_sent``."""

    def __init__(self, cfg, model, masks, collectives):
        from pacmpi.adapters.sharded import ShardedOptimizer, sharded_hook

        super().__init__(cfg, model, masks)
        kind, options = _optimizer_kind(cfg, cfg.lr)
        self.forward, self.sharded = model, None
        if cfg.backend == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.forward = DistributedDataParallel(model)
        if cfg.method == "dense":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kind,
                                                     **options)
            self._weight_bytes = self.dense_bytes
            return
        self.sharded = self.optimizer = ShardedOptimizer(
            model, kind, masks=masks, collectives=collectives, verify_every=cfg.verify_every,
            **options)
        self._in_backward = cfg.backend == "ddp"  # sharded_hook steps inside backward
        if self._in_backward:
            self.forward.register_comm_hook(self.sharded, sharded_hook)
        self._weight_bytes, self._comm = self._survivor_bytes(), 0.0

    def _survivor_bytes(self):
        return sum(g.reducer.layout.total * g.shard.element_size() for g in self.sharded.groups)

    def set_masks(self, masks):
        super().set_masks(masks)
        if self.sharded is not None:
            self.sharded.set_masks(self.masks)
            self._weight_bytes = self._survivor_bytes()

    def record(self, compute_seconds, step_seconds):
        """Account one step (``step_seconds``: ``optimizer.step()``; under DDP the sharded
        step ran in backward, so ``compute_seconds`` holds what of it is exposed)."""
        extra = {"weight_bytes": self._weight_bytes}
        if self.sharded is None:
            self._record(None, self.dense_bytes, compute_seconds=compute_seconds,
                         wait_seconds=0.0, comm_seconds=0.0, **extra)
            return
        counters = {key: sum(g.reducer.stats[key] for g in self.sharded.groups)
                    for key in ("bytes_sent", "dense_fallbacks", "packed_reductions",
                                "dense_reductions")}
        comm = sum(g.reducer.stats["comm_seconds"] for g in self.sharded.groups)
        extra["comm_seconds"], self._comm = comm - self._comm, comm
        self._record(counters, 0, compute_seconds=compute_seconds,
                     wait_seconds=0.0 if self._in_backward else step_seconds, **extra)


# The counters of an outer step's reducer that a step record carries.
_REDUCER_COUNTERS = ("bytes_sent", "dense_fallbacks", "packed_reductions", "dense_reductions")


class _OuterRun(_FrameworkSync):
    """``--outer-period H``: every rank steps on its own data and the ranks synchronize every
    H steps, on the step that runs the outer step (its bytes on that step's record, 0 on the
    others). No DDP wrapper: inner steps communicate nothing. A run whose steps are not a
    multiple of H ends with one more, shorter period, so that every rank ends with the same
    model. Subclasses run the outer step (:class:`_DiLoCoRun`, :class:`_PostLocalRun`) and
    keep ``params`` and their ``globals``, the weights the last outer step left."""

    def __init__(self, cfg, model, masks, total_steps):
        super().__init__(cfg, model, masks)
        self.model, self.period, self.total_steps = model, cfg.outer_period, total_steps
        self.steps, self.outer_steps, self.synced = 0, 0, True
        self._buffers = [b.detach().clone() for b in model.buffers()]

    def record(self, compute_seconds, step_seconds):
        """Account one step (``step_seconds``: ``optimizer.step()``, with the outer step when
        it ran one); on the run's last step, close a shorter last period first."""
        self.steps += 1
        in_step = self._outer_seconds() if self.steps % self.period == 0 else 0.0
        began = time.perf_counter()
        closing = self.steps == self.total_steps and self.steps % self.period != 0
        if closing:
            self.outer_step()
        self.synced = closing or self.steps % self.period == 0
        self.outer_steps += self.synced
        counters, extra = self._counters()
        if self.synced:
            self._keep_global()
        added = time.perf_counter() - began
        self._record(counters, 0, compute_seconds=compute_seconds,
                     seconds=compute_seconds + step_seconds + added,
                     wait_seconds=in_step + added, optimizer_seconds=step_seconds - in_step,
                     **extra)

    @torch.no_grad()
    def _keep_global(self):
        # BatchNorm statistics as of the outer step, which evaluations score with its weights
        # (rank 0's, as the job gives every method before each evaluation).
        for kept, buffer in zip(self._buffers, self.model.buffers()):
            kept.copy_(buffer)

    @contextlib.contextmanager
    def global_weights(self):
        """The model holds the last outer step's weights and buffers while the body runs
        (between outer steps each rank's own differ from them), its own again after."""
        if self.synced:
            yield
            return
        pairs = (list(zip(self.params, self.globals))
                 + list(zip(self.model.buffers(), self._buffers)))
        with torch.no_grad():
            local = [mine.detach().clone() for mine, _ in pairs]
            for mine, kept in pairs:
                mine.copy_(kept)
        try:
            yield
        finally:
            with torch.no_grad():
                for (mine, _), saved in zip(pairs, local):
                    mine.copy_(saved)


class _DiLoCoRun(_OuterRun):
    """``--outer-optimizer diloco``: :class:`pacmpi.adapters.outer.OuterSync` on the inner
    optimizer's step hook, sending the pseudo-gradient dense without masks (``--method dense``:
    DiLoCo's reference), as packed survivors (``pactrain``) or as their ternary codes."""

    def __init__(self, cfg, model, optimizer, masks, collectives, total_steps):
        super().__init__(cfg, model, masks, total_steps)
        method = METHODS[cfg.method]
        self.outer = OuterSync(
            model, optimizer, period=cfg.outer_period, masks=masks if method.packed else None,
            quantize=method.quantize, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
            # BatchNorm statistics stay each rank's, as under every per-step method (the job
            # gives every rank rank 0's before each evaluation).
            buffers="local", collectives=collectives, bucket_bytes=cfg.bucket_bytes,
            verify_every=cfg.verify_every, stable_steps=cfg.stable_steps, seed=cfg.seed,
            error_feedback=cfg.error_feedback, ternary_scale=cfg.ternary_scale)
        self.optimizer, self.params, self.globals = optimizer, self.outer.params, self.outer.globals
        self._seconds = {}

    def set_masks(self, masks):
        super().set_masks(masks)
        self.outer.set_masks(masks)  # at the next outer step

    def outer_step(self):
        self.outer.outer_step()

    def memory_report(self):
        """OuterSync's bytes on this rank, by component (global copy, outer momentum, ...)."""
        return self.outer.memory_report()

    @property
    def collectives(self):
        return self.outer.collectives

    def state_dict(self):
        """OuterSync's state (laid out as ``save_checkpoint`` expects) and, under ``"job"``,
        where the run stands: its steps and outer steps, the buffers the last outer step left
        (what evaluations score) and the counters."""
        return dict(self.outer.state_dict(), job={
            "steps": self.steps, "outer_steps": self.outer_steps, "synced": self.synced,
            "buffers": [b.detach().clone() for b in self._buffers],
            "seconds": dict(self._seconds), "stats": dict(self.stats)})

    def load_state_dict(self, state):
        state = dict(state)
        job = state.pop("job")
        self.outer.load_state_dict(state)
        if state["masks"]:
            super().set_masks(state["masks"])  # the job's own mask tensors too
        self.steps, self.outer_steps, self.synced = job["steps"], job["outer_steps"], job["synced"]
        with torch.no_grad():
            for kept, saved in zip(self._buffers, job["buffers"]):
                kept.copy_(saved)
        self._seconds, self.stats = dict(job["seconds"]), dict(job["stats"])

    def _outer_seconds(self):
        return self.outer.last_outer["seconds"]

    def _counters(self):
        stats, extra = self.outer.stats, {}
        for key in ("pack_seconds", "comm_seconds", "unpack_seconds", "verify_seconds"):
            extra[key] = stats[key] - self._seconds.get(key, 0.0)
            self._seconds[key] = stats[key]
        return {key: stats[key] for key in _REDUCER_COUNTERS}, extra


class _PostLocalRun(_OuterRun):
    """``--outer-optimizer postlocal``: torch's ``PostLocalSGDOptimizer`` around the inner
    optimizer, its ``PeriodicModelAverager`` averaging the weights (one flat fp32 all-reduce)
    every H steps: the peer torch users have, DiLoCo with an outer learning rate of 1 and no
    momentum. ``globals``: a copy of the weights as last averaged, for the evaluations."""

    def __init__(self, cfg, model, optimizer, masks, total_steps):
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        super().__init__(cfg, model, masks, total_steps)
        # The averager averages at its calls warmup_steps + kH (0-based): with warm-up H - 1,
        # after every H-th step, as OuterSync does (with 0, after the first step too).
        self.averager = PeriodicModelAverager(period=cfg.outer_period,
                                              warmup_steps=cfg.outer_period - 1)
        self.optimizer = PostLocalSGDOptimizer(optimizer, self.averager)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.globals = [p.detach().clone() for p in self.params]
        self._sent = {key: 0 for key in _REDUCER_COUNTERS}
        self._inner_done = 0.0
        # PostLocalSGDOptimizer.step() averages right after the inner step: from its end on.
        optimizer.register_step_post_hook(self._mark_inner_done)

    def _mark_inner_done(self, optimizer, args, kwargs):
        self._inner_done = time.perf_counter()

    def outer_step(self):
        from torch.distributed.algorithms.model_averaging import utils

        utils.average_parameters_or_parameter_groups(self.optimizer.param_groups,
                                                     self.averager.process_group)

    def _outer_seconds(self):
        return time.perf_counter() - self._inner_done

    def _counters(self):
        if self.synced:
            from torch.distributed.algorithms.model_averaging import utils

            averaged = utils.get_params_to_average(self.optimizer.param_groups)
            self._sent["bytes_sent"] += sum(p.numel() * p.element_size() for p in averaged)
            self._sent["dense_reductions"] += 1
        return dict(self._sent), {}

    @torch.no_grad()
    def _keep_global(self):
        super()._keep_global()
        for g, p in zip(self.globals, self.params):  # the averaging gave them new storage
            g.copy_(p)


def _outer_run(cfg, model, optimizer, masks, collectives, total_steps):
    """The :class:`_OuterRun` of ``--outer-optimizer``."""
    if cfg.outer_optimizer == "postlocal":
        return _PostLocalRun(cfg, model, optimizer, masks, total_steps)
    return _DiLoCoRun(cfg, model, optimizer, masks, collectives, total_steps)


class BiasProbe:
    """How far the synchronized gradient is from the exact average (``--bias-probe``, for
    ``pacmpi bench bias``). A gradient hook registered before the sync's copies each rank's
    local gradient (masked as GSE masks it) before any of it is sent; :meth:`measure`, after
    ``optimizer.step()``, sums those copies with one extra float64 all-reduce (benchmarks
    only: it doubles the traffic) and compares the method's ``p.grad`` with that exact average
    on the kept coordinates. Per step: mean, 99th percentile and max of the per-coordinate
    ``|error|`` and mean ``|exact|``; over the run, per coordinate, the mean error over steps
    (the bias: an unbiased estimator's shrinks as 1/sqrt(steps), error feedback's telescopes to
    the last residual over steps), its mean ``|.|`` and 99th percentile. Collective."""

    def __init__(self, model, masks, collectives):
        self.collectives = collectives
        names = {}
        for name, param in model.named_parameters():
            names.setdefault(param, name)
        self.params = [p for p in names if p.requires_grad]
        self._keep = torch.cat([masks[names[p]].reshape(-1) if names[p] in masks else
                                torch.ones(p.numel(), dtype=torch.bool) for p in self.params])
        self._local = [None] * len(self.params)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(self.params)]
        self.steps = []
        self._error_sum = None

    def _hook(self, i):
        def hook(param):
            self._local[i] = param.grad.detach().reshape(-1).to(torch.float64, copy=True)

        return hook

    def measure(self):
        """Compare this step's synchronized ``p.grad`` with the exact average. Collective."""
        local = torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if g is None else g
                           for p, g in zip(self.params, self._local)])
        exact = np.ascontiguousarray(local[self._keep].numpy())
        self.collectives.allreduce(exact, "sum")
        exact /= self.collectives.size
        got = torch.cat([p.grad.detach().reshape(-1) for p in self.params])[self._keep]
        error = got.to(torch.float64).numpy() - exact
        magnitude = np.abs(error)
        self.steps.append({"mean_abs_error": float(magnitude.mean()),
                           "p99_abs_error": float(np.percentile(magnitude, 99)),
                           "max_abs_error": float(magnitude.max()),
                           "mean_abs_exact": float(np.abs(exact).mean())})
        self._error_sum = error if self._error_sum is None else self._error_sum + error
        self._local = [None] * len(self.params)

    def summary(self):
        """Per-step records, their medians, and the bias over the run (see the class doc)."""
        if not self.steps:
            return {"steps": 0}
        bias = np.abs(self._error_sum / len(self.steps))
        medians = {f"median_{key}": float(np.median([s[key] for s in self.steps]))
                   for key in self.steps[0]}
        return {"steps": len(self.steps), "kept_coordinates": int(self._keep.sum()),
                **medians,
                "median_relative_error": medians["median_mean_abs_error"]
                / max(medians["median_mean_abs_exact"], 1e-300),
                "bias_mean_abs": float(bias.mean()),
                "bias_p99_abs": float(np.percentile(bias, 99)),
                "per_step": self.steps}


class _StepLog:
    """Per-step timings and bytes, summed per epoch and over the run."""

    KEYS = ("seconds", "compute_seconds", "pack_seconds", "comm_seconds", "unpack_seconds",
            "verify_seconds", "wait_seconds", "optimizer_seconds", "bytes_sent", "dense_bytes",
            "weight_bytes", "dense_fallbacks", "packed_reductions", "dense_reductions")

    def __init__(self):
        self.steps = []

    def add(self, record):
        self.steps.append(record)

    def summary(self, first=0):
        steps = self.steps[first:]
        n = max(1, len(steps))
        sums = {key: sum(s.get(key, 0) for s in steps) for key in self.KEYS}
        return {
            "steps": len(steps),
            "samples_per_second": sum(s["samples"] for s in steps) / max(sums["seconds"], 1e-12),
            "step_seconds": {key.replace("_seconds", ""): sums[key] / n
                             for key in self.KEYS if key.endswith("seconds")},
            "bytes_per_step": sums["bytes_sent"] / n,
            "dense_bytes_per_step": sums["dense_bytes"] / n,
            "weight_bytes_per_step": sums["weight_bytes"] / n,
            "dense_fallbacks": sums["dense_fallbacks"],
            "packed_reductions": sums["packed_reductions"],
            "dense_reductions": sums["dense_reductions"],
        }


# ---------------------------------------------------------------------------------- run
def _prune(model, ratio: float, prune_args: dict):
    """Prune ``model`` by ``prune_args``' criterion; a gradient criterion leaves embedding tables
    to magnitude. A table's gradient is zero on every row whose token the scoring batch lacks,
    so Taylor and GraSP, scored on a batch, would remove those rows first (on MiniLM, 96% of
    the word embeddings, half the model: top-1 0.553 -> 0.020 at 0.5). Each part loses the same
    fraction, so the whole model does too."""
    tables = {id(m.weight) for m in model.modules()
              if isinstance(m, nn.Embedding) and m.weight.requires_grad}
    if prune_args["method"] == "magnitude" or not tables:
        return prune(model, ratio, **prune_args)

    def is_table(name, param):
        return id(param) in tables

    masks = prune(model, ratio, exclude=is_table, **prune_args)
    masks.update(prune(model, ratio, include=is_table, **{**prune_args, "method": "magnitude"}))
    order = named_prunable_parameters(model)
    return OrderedDict((name, masks[name]) for name in order)


def _selection(cfg, model):
    """``prune``'s ``include``/``exclude`` for ``--prune-layers``; frozen parameters (after
    ``--freeze-embeddings``) are never pruned: they neither change nor travel, and a mask on
    one would name a parameter no synchronization holds."""
    selection = {"include": linear_weights(model)} if cfg.prune_layers == "linear" else {}
    if any(not p.requires_grad for p in model.parameters()):
        selection["exclude"] = _frozen
    return selection


def _frozen(name, param):
    return not param.requires_grad


def _teacher(model):
    """A frozen copy of the dense model, in eval mode (no dropout: a fixed target)."""
    teacher = copy.deepcopy(model).eval()
    teacher.requires_grad_(False)
    return teacher


def _distillation(teacher, x, logits):
    """KL divergence of the student's output distribution from the teacher's, per sample (for
    the dual encoder: each query's distribution over the batch's codes)."""
    with torch.no_grad():
        target = F.log_softmax(teacher(x).float(), dim=-1)
    return F.kl_div(F.log_softmax(logits.float(), dim=-1), target, reduction="batchmean",
                    log_target=True)


def _rewarm(optimizer, cfg, milestones, step):
    """The learning rate ``step - m + 1`` steps after the latest move of the mask at step ``m``:
    a linear ramp back up to ``--lr`` over ``--rewarm-steps``. A function of the step alone, so
    a resumed run ramps as the uninterrupted one did."""
    moved = [s for s, _ in milestones if s <= step]
    factor = min(1.0, (step - moved[-1] + 1) / cfg.rewarm_steps) if moved else 1.0
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * factor


def run(config, collectives=None) -> dict:
    """Fine-tune as configured (a :class:`TrainConfig`, dict or argparse namespace) on every rank
    of ``collectives`` (default :func:`collectives_for` the configured backend: ``COMM_WORLD``
    or Horovod's ranks); returns the same result dict on every rank:

    ``epochs`` (per evaluation: at the end of every epoch and every ``eval_every`` steps:
    ``epoch``, ``step``, ``wall_seconds`` spent fine-tuning so far (evaluations excluded),
    ``test_accuracy`` (codesearch: top-1 retrieval, and ``test_top5``), ``train_loss`` and the
    step summary since the previous evaluation), ``final_accuracy``, ``pretrained_accuracy``,
    ``parameters``, ``density``, ``steps`` (per step: ``seconds``, ``samples_per_second``,
    the compute / pack / comm / unpack split, ``bytes_sent``), ``summary`` (averages over the
    run), ``state_sha256`` (digest of the final model, equal on every rank), ``outer_steps``
    (with ``outer_period``; else None).
    """
    return fine_tune(config, collectives)[1]


def fine_tune(config, collectives=None):
    """:func:`run`, returning ``(model, result)``: the fine-tuned model as well (identical on
    every rank; pruned weights exactly zero)."""
    cfg = check_config(config)
    if collectives is None:
        collectives = collectives_for(cfg.backend, cfg.watchdog)
    rank, size = collectives.rank, collectives.size
    data = _load_data(cfg)
    kwargs = _model_kwargs(cfg, data)
    # A model that arrives pretrained, with no dense epochs on top, is loaded by every rank
    # and scored by all of them together; the others are pretrained (or cached) on rank 0.
    arrives_pretrained = cfg.model in PRETRAINED_MODELS and not cfg.pretrain_epochs
    if not arrives_pretrained:
        state, pretrained_accuracy = pretrained_state(cfg, data, kwargs, collectives)
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // size))

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, **kwargs)
    if rank == 0 and not arrives_pretrained:
        model.load_state_dict(state)
    broadcast_parameters(model, collectives=collectives)
    model.train()
    if arrives_pretrained:
        pretrained_accuracy = _evaluate(cfg, model, data, collectives)["test_accuracy"]
    if cfg.freeze_embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                module.weight.requires_grad_(False)
    teacher = _teacher(model) if cfg.distill else None

    x_train, y_train = shard((data.x_train, data.y_train), rank, size)
    # One local batch for GraSP's gradient statistics (rank 0's decides; magnitude ignores it).
    grasp_data = [next(iterate_minibatches(x_train, y_train, cfg.batch_size, seed=cfg.seed + 1,
                                           epoch=0))]
    loss_fn = _loss_fn(cfg)
    prune_args = {"method": cfg.prune_method, "data": grasp_data, "collectives": collectives,
                  "loss_fn": loss_fn}
    prune_args.update(_selection(cfg, model))
    milestones = _milestones(cfg)
    masks = _prune(model, 0.0 if milestones else cfg.ratio, prune_args)
    enforcer = MaskEnforcer(model, masks)

    # Over what trains: frozen embeddings would be skipped anyway (no gradient), and
    # OuterSync refuses an optimizer over parameters it does not hold.
    optimizer = _optimizer(cfg, [p for p in model.parameters() if p.requires_grad], cfg.lr)
    forward = model
    # Before the sync's hooks, so it sees each local gradient before any of it is sent.
    probe = BiasProbe(model, enforcer.masks, collectives) if cfg.bias_probe else None
    if cfg.outer_period:
        # Before the outer step's hook: the local pruned weights are 0 when it reads them.
        enforcer.attach(optimizer)
        steps = cfg.epochs * (len(x_train) // cfg.batch_size)  # drop_last batches, every epoch
        sync = _outer_run(cfg, model, optimizer,
                          {name: mask.clone() for name, mask in enforcer.masks.items()},
                          collectives, min(steps, cfg.max_steps or steps))
        optimizer = sync.optimizer
    elif cfg.sharded:
        sync = _ShardedSync(cfg, model, {name: mask.clone() for name, mask in
                                         enforcer.masks.items()}, collectives)
        forward, optimizer = sync.forward, sync.optimizer
    elif cfg.backend == "ddp":
        sync = _DDPSync(cfg, model, {name: mask.clone() for name, mask in enforcer.masks.items()})
        forward = sync.ddp
    elif cfg.backend == "horovod":
        sync = _HorovodSync(cfg, model, optimizer, enforcer.masks, enforcer)
        optimizer = sync.optimizer
    elif cfg.method in ("terngrad", "dgc"):  # make_baseline's: all-gathers through mpi4py
        sync = make_baseline(model, cfg.method, comm=collectives.comm, masks=masks,
                             ratio=cfg.topk_ratio, momentum=cfg.momentum, seed=cfg.seed)
        sync.attach(optimizer)
    else:
        # TopK all-gathers through mpi4py itself (--backend mpi only, see check_config).
        sync_kwargs = ({"comm": collectives.comm} if cfg.method == "topk" else
                       {"collectives": collectives, "bucket_bytes": cfg.bucket_bytes,
                        "verify_every": cfg.verify_every, "stable_steps": cfg.stable_steps,
                        "seed": cfg.seed, "ternary_scale": cfg.ternary_scale})
        sync = make_sync(model, cfg.method, masks=masks, topk_ratio=cfg.topk_ratio,
                         error_feedback=cfg.error_feedback, **sync_kwargs)
        sync.attach(optimizer)
    # The shards hold survivors only; the outer run's inner optimizer is attached above.
    if not (cfg.sharded and cfg.method == "pactrain") and not cfg.outer_period:
        enforcer.attach(optimizer)

    step, start_epoch, skip, elapsed, records = 0, 0, 0, 0.0, []
    log = _StepLog()
    if cfg.resume and os.path.exists(cfg.checkpoint):
        where = load_checkpoint(cfg.checkpoint, model=model, optimizer=optimizer, sync=sync)
        enforcer.update(sync.masks)
        step, start_epoch = where["step"], where["epoch"]
        skip, elapsed = where["extra"]["batch_in_epoch"], where["extra"]["elapsed"]
        records = where["extra"]["records"]
        log.steps = where["extra"]["steps"]
    schedule = None
    if milestones and any(s >= step for s, _ in milestones):
        schedule = GradualPruningSchedule([m for m in milestones if m[0] >= step],
                                          method=cfg.prune_method,
                                          include=prune_args.get("include"),
                                          exclude=prune_args.get("exclude"))
        schedule.masks = dict(sync.masks)

    def trained_seconds():
        """Wall-clock time spent fine-tuning so far, evaluations excluded (every method runs the
        same evaluations, so they would only blur the differences)."""
        return elapsed + time.perf_counter() - started - evaluating

    def checkpoint(epoch, batch_in_epoch):
        save_checkpoint(cfg.checkpoint, model=model, optimizer=optimizer, sync=sync, step=step,
                        epoch=epoch, extra={"batch_in_epoch": batch_in_epoch,
                                            "elapsed": trained_seconds(),
                                            "records": records, "steps": log.steps})

    def evaluate(epoch):
        nonlocal evaluating, since, losses
        began = time.perf_counter()
        with sync.global_weights() if cfg.outer_period else contextlib.nullcontext():
            # rank 0's BatchNorm statistics for everyone (eval mode uses them; training not)
            broadcast_buffers(model, collectives=collectives)
            scores = _evaluate(cfg, model, data, collectives)
        evaluating += time.perf_counter() - began
        records.append({"epoch": epoch, "step": step, "wall_seconds": trained_seconds(),
                        **scores, "train_loss": sum(losses) / max(1, len(losses)),
                        **log.summary(since)})
        since, losses = len(log.steps), []
        if rank == 0 and cfg.progress:
            print(f"epoch {epoch} step {step}: test accuracy {scores['test_accuracy']:.4f}",
                  file=sys.stderr, flush=True)

    progress = _progress(cfg, rank)
    started, evaluating = time.perf_counter(), 0.0
    since, losses = len(log.steps), []   # steps and losses since the last evaluation
    stopped = False
    for epoch in range(start_epoch, cfg.epochs):
        batches = list(iterate_minibatches(x_train, y_train, cfg.batch_size, seed=cfg.seed,
                                           epoch=epoch, drop_last=True))
        bar = progress(total=len(batches), initial=skip, desc=f"epoch {epoch}")
        for b in range(skip, len(batches)):
            xb, yb = batches[b]
            pruning = time.perf_counter()
            # With outer steps a mask moves right after one, on the weights every rank then
            # holds; OuterSync applies it to the global weights at the next.
            if schedule is not None and step % (cfg.outer_period or 1) == 0:
                new = schedule.step(model, step, data=grasp_data, collectives=collectives,
                                    loss_fn=loss_fn)
                if new is not None:
                    enforcer.update(new)
                    sync.set_masks(new)
            if cfg.rewarm_steps and milestones:
                _rewarm(optimizer, cfg, milestones, step)
            t0 = time.perf_counter()
            optimizer.zero_grad()
            logits = forward(xb)
            loss = loss_fn(logits, yb)
            if teacher is not None:
                loss = (1.0 - cfg.distill) * loss + cfg.distill * _distillation(teacher, xb,
                                                                                  logits)
            loss.backward()
            if cfg.backend == "ddp" and not (cfg.sharded and cfg.method == "pactrain"):
                enforcer.apply_to_grads()  # GSE for DDP's own methods (PacTrain's hook did it)
            t1 = time.perf_counter()
            optimizer.step()
            t2 = time.perf_counter()
            step += 1
            if probe is not None:
                probe.measure()
            if cfg.backend != "mpi" or cfg.sharded or cfg.outer_period:
                sync.record(t1 - t0, t2 - t1)
            losses.append(float(loss.detach()))
            record = {"step": step, "seconds": t2 - t0, "samples": len(xb) * size,
                      "prune_seconds": t0 - pruning,
                      "loss": losses[-1],
                      "optimizer_seconds": t2 - t1 - sync.last_step["wait_seconds"]}
            record.update({k: sync.last_step[k] for k in _StepLog.KEYS if k in sync.last_step})
            record["samples_per_second"] = record["samples"] / record["seconds"]
            log.add(record)
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if cfg.eval_every and step % cfg.eval_every == 0:
                evaluate(epoch)
            if cfg.checkpoint and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                checkpoint(epoch, b + 1)
            if cfg.max_steps and step >= cfg.max_steps:
                stopped = b + 1 < len(batches)
                break
        bar.close()
        skip = 0
        if stopped:
            # rank 0's BatchNorm statistics for everyone, also when --max-steps stops mid-epoch
            broadcast_buffers(model, collectives=collectives)
            break
        if since < len(log.steps) or not records:
            evaluate(epoch)
        if cfg.checkpoint and not cfg.checkpoint_every:
            checkpoint(epoch + 1, 0)
        if cfg.max_steps and step >= cfg.max_steps:
            break

    density = enforcer.density()
    return model, {
        "config": dataclasses.asdict(cfg),
        "world_size": size,
        "parameters": count_parameters(model),
        "prunable_parameters": density.total,
        "density": density.overall,
        "pretrained_accuracy": pretrained_accuracy,
        "epochs": records,
        "final_accuracy": records[-1]["test_accuracy"] if records else None,
        "steps": log.steps,
        "summary": log.summary(),
        "fallbacks": sync.stats["dense_fallbacks"],
        "stats": dict(sync.stats),
        "state_sha256": _state_digest(model),
        "bias": probe.summary() if probe is not None else None,
        # the optimizer's per-coordinate state (Adam's moments), the largest over the ranks
        "optimizer_state_elements": max(collectives.allgather_object(_state_elements(optimizer))),
        "mpi_algorithms": _mpi_algorithms(cfg.backend),
        "outer_steps": sync.outer_steps if cfg.outer_period else None,
        # what outer steps keep beside the model (PostLocalSGD keeps nothing: it averages in
        # place), the largest over the ranks
        "outer_memory": _largest(collectives.allgather_object(sync.memory_report()))
        if cfg.outer_period and cfg.outer_optimizer == "diloco" else None,
    }


def _largest(reports):
    """Component by component, the largest of the ranks' memory reports."""
    return {key: max(report[key] for report in reports) for key in reports[0]}


def _mpi_algorithms(backend):
    """The all-reduce algorithms the MPI library was told to run, read back from it (MPI_T):
    the non-blocking one the reducer's buckets take and the blocking one; ``None`` off MPI.
    Recorded because the two are chosen apart (Open MPI: coll/libnbc and coll/tuned), and a
    job once ran a binomial tree while its blocking algorithm read "ring"."""
    if backend != "mpi":
        return None
    from mpi4py import MPI

    return {"allreduce": allreduce_algorithm(MPI),
            "iallreduce": allreduce_algorithm(MPI, nonblocking=True)}


def _progress(cfg, rank):
    if rank == 0 and cfg.progress:
        try:
            from tqdm import tqdm

            return lambda **kw: tqdm(leave=False, file=sys.stderr, **kw)
        except ImportError:
            pass
    return lambda **kw: _NoBar()


class _NoBar:
    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


# ---------------------------------------------------------------------------------- CLI
def build_parser():
    """``pacmpi train``'s parser: a flag per :class:`TrainConfig` field."""
    return add_config_options(command_parser("pacmpi train", __doc__))


def add_config_options(parser, names=None):
    """Add to ``parser`` a flag per :class:`TrainConfig` field (those in ``names``, default
    all), with its help, choices and type from the field's :func:`knob`; returns ``parser``.
    The benchmark drivers pass the same knobs on to the job this way."""
    for field in dataclasses.fields(TrainConfig):
        if names is not None and field.name not in names:
            continue
        flag = "--" + field.name.replace("_", "-")
        options = dict(field.metadata)
        if field.type is bool or isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=field.default, **options)
            continue
        options.setdefault("type", type(field.default) if field.default is not None else str)
        if "choices" not in options:
            options.setdefault("metavar", "N" if options["type"] is int else field.name.upper())
        parser.add_argument(flag, default=field.default, **options)
    return parser


def _print_summary(result):
    s = result["summary"]
    t = s["step_seconds"]
    cfg = result["config"]
    outer = (f", {result['outer_steps']} outer steps ({cfg['outer_optimizer']}, every "
             f"{cfg['outer_period']} steps)" if cfg["outer_period"] else "")
    print(f"pacmpi train: {cfg['model']} ({result['parameters']:,} parameters, density "
          f"{result['density']:.3f}) on {result['world_size']} ranks, method {cfg['method']}"
          + outer)
    print(f"  pretrained (dense) test accuracy: {result['pretrained_accuracy']:.4f}")
    for r in result["epochs"]:
        print(f"  epoch {r['epoch']}: {r['wall_seconds']:8.2f} s  test accuracy "
              f"{r['test_accuracy']:.4f}  loss {r['train_loss']:.4f}")
    print(f"  per step: {t['seconds']:.4f} s = compute {t['compute']:.4f} + pack {t['pack']:.4f} + "
          f"comm {t['comm']:.4f} + unpack {t['unpack']:.4f} + verify {t['verify']:.4f} "
          f"(+ optimizer {t['optimizer']:.4f}); exposed wait {t['wait']:.4f}")
    print(f"  {s['samples_per_second']:.0f} samples/s; {s['bytes_per_step']:,.0f} bytes sent per "
          f"step (dense: {s['dense_bytes_per_step']:,.0f}); dense fallbacks {result['fallbacks']}")


def main(argv=None):
    """Entry point of ``pacmpi train``; prints a summary on rank 0 and writes ``--json``."""
    args = build_parser().parse_args(argv)
    cfg = check_config(args)
    collectives = collectives_for(cfg.backend, cfg.watchdog)
    result = run(cfg, collectives)
    if collectives.rank == 0:
        _print_summary(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if cfg.backend == "ddp":
        atexit.register(exit_after_gloo, 0)
    return 0


def exit_after_gloo(status):
    """At the exit of a process whose ``--backend ddp`` job finished, end it with ``status``
    without interpreter finalization: torch 2.13's gloo can abort a finished rank while the
    interpreter is torn down ("terminate called without an active exception": 1 run in 8 on a
    loaded 2-core host, with or without destroy_process_group()), which torchrun reports as a
    failed job. Every rank arrives and the group is destroyed first, and the results are
    already written, so nothing is lost by leaving through ``os._exit``."""
    _close_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    warnings.simplefilter("default")
    sys.exit(main())
