"""Outer steps in the lab (issue 43): ``pacmpi train --outer-period H`` and its checks, the
``bench train`` rows (``-dilocoH``, ``ddp-postlocal-H``) and their timing composition, and the
job end to end on 2 ranks (tests/mpi_scripts/outer_train_scenarios.py, one launch)."""
import pytest

from pacmpi.experiments import train
from pacmpi.experiments.bench_train import (
    DILOCO_METHODS,
    FULL,
    MethodSpec,
    _sweep,
    _train_argv,
    compose_timing,
    expand_methods,
    main,
    outer_step_seconds,
    parse_method,
    warmup_steps,
)

from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_names  # tests/ is on sys.path

SCENARIOS = "outer_train_scenarios.py"


@pytest.mark.parametrize("config, message", [
    ({"outer_period": -1}, "--outer-period is a step count >= 0, got -1"),
    ({"outer_period": 1.5}, "--outer-period is a step count >= 0, got 1.5"),
    ({"outer_period": 4, "method": "fp16"}, "--outer-period 4 sends .* not fp16"),
    ({"outer_period": 4, "method": "topk"}, "--outer-period 4 sends .* not topk"),
    ({"outer_period": 4, "backend": "horovod"}, "--outer-period 4 runs with .* not horovod"),
    ({"outer_period": 4, "sharded": True}, "does not support --sharded"),
    ({"outer_period": 4, "outer_optimizer": "postlocal", "backend": "ddp", "method": "dense",
      "checkpoint": "c.pt"}, "does not support --checkpoint"),
    ({"outer_period": 4, "bias_probe": True}, "does not support --bias-probe"),
    ({"outer_period": 4, "outer_lr": 0}, "--outer-lr must be > 0 .* got 0 and 0.9"),
    ({"outer_period": 4, "outer_momentum": -0.5}, "--outer-momentum >= 0, got 0.7 and -0.5"),
    ({"outer_lr": 1.0}, "--outer-lr 1.0 applies to outer steps: give --outer-period H"),
    ({"outer_optimizer": "postlocal", "backend": "ddp", "method": "dense"},
     "--outer-optimizer postlocal applies to outer steps"),
    ({"outer_period": 4, "outer_optimizer": "postlocal"},
     "--backend ddp --method dense, not --method pactrain with --backend mpi"),
    ({"outer_period": 4, "outer_optimizer": "postlocal", "backend": "ddp", "method": "dense",
      "outer_lr": 1.0}, "averages the weights: --outer-lr 1.0 does not apply"),
    ({"outer_period": 4, "method": "dense", "prune_steps": 20},
     "--outer-period 4 --method dense .* holds no masks"),
    ({"outer_period": 4, "method": "dense", "gradual": "8:0.5"}, "holds no masks"),
])
def test_outer_knobs_are_refused_with_the_value(config, message):
    with pytest.raises(ValueError, match=message):
        train.check_config(config)


def test_outer_knobs_that_fit_pass_and_resolve_stable_steps():
    """The controls of the refusals above; --stable-steps counts outer steps and packs a
    mask at once there (OuterSync's default), synchronous steps keep 1."""
    assert train.check_config({"outer_period": 4, "method": "pactrain-ternary",
                               "ratio": 0.0}).stable_steps == 0
    assert train.check_config({"outer_period": 4, "prune_steps": 20}).outer_period == 4
    assert train.check_config({"outer_period": 4, "checkpoint": "c.pt"}).checkpoint == "c.pt"
    assert train.check_config({"outer_period": 4, "outer_optimizer": "postlocal",
                               "backend": "ddp", "method": "dense", "gradual": "8:0.5"})
    assert train.check_config({}).stable_steps == 1
    assert train.check_config({"outer_period": 4, "stable_steps": 2}).stable_steps == 2
    args = train.build_parser().parse_args(["--outer-period", "16", "--outer-lr", "1",
                                            "--outer-momentum", "0", "--method", "dense"])
    cfg = train.check_config(args)
    assert (cfg.outer_period, cfg.outer_lr, cfg.outer_momentum) == (16, 1.0, 0.0)
    with pytest.raises(SystemExit):
        train.build_parser().parse_args(["--outer-period", "4.5"])


def test_outer_labels_and_negative_controls():
    assert parse_method("dense-diloco16") == MethodSpec("dense-diloco16", "dense", 0.0,
                                                        outer_period=16)
    assert parse_method("pactrain-0.8-diloco4") == MethodSpec("pactrain-0.8-diloco4",
                                                              "pactrain", 0.8, outer_period=4)
    spec = parse_method("pactrain-ternary-0-noef-diloco16")
    assert (spec.method, spec.ratio, spec.error_feedback, spec.outer_period) == (
        "pactrain-ternary", 0.0, False, 16)
    assert parse_method("ddp-pactrain-0.8-diloco4").backend == "ddp"
    assert parse_method("ddp-postlocal-16", 0.5) == MethodSpec(
        "ddp-postlocal-16", "dense", 0.5, backend="ddp", outer_period=16,
        outer_optimizer="postlocal")
    assert parse_method("pactrain-0.8").outer_period == 0
    argv = _train_argv(dict(FULL), parse_method("ddp-postlocal-4"), None, "x.json", 0)
    assert argv[argv.index("--outer-period"):] == ["--outer-period", "4", "--outer-optimizer",
                                                   "postlocal", "--backend", "ddp"]
    argv = _train_argv(dict(FULL), parse_method("pactrain-0.8-diloco16"), None, "x.json", 0)
    assert argv[argv.index("--outer-period") + 1] == "16" and "--outer-optimizer" not in argv
    assert "--outer-period" not in _train_argv(dict(FULL), parse_method("pactrain-0.8"), None,
                                               "x.json", 0)
    assert expand_methods(["diloco"]) == DILOCO_METHODS and len(DILOCO_METHODS) == 10
    for bad in ("fp16-diloco4", "topk-1%-diloco4", "dense-diloco0", "dense-diloco",
                "pactrain-0.8-diloco-4", "pactrain-0.8-sharded-diloco4",
                "pactrain-0.8-gradual-diloco4", "pactrain-0.8-diloco4-gradual",
                "pactrain-0.8-diloco4-sharded", "dense-diloco4-diloco4", "ddp-powersgd-1-diloco4",
                "ddp-postlocal-0", "ddp-postlocal", "postlocal-4", "ddp-postlocal-4-diloco4"):
        with pytest.raises(ValueError, match="unknown method label"):
            parse_method(bad)


def test_timing_places_outer_and_inner_steps_apart():
    """A shaped outer-step row: the unshaped run's outer steps (those that sent bytes) at the
    timed outer step's mean, the others at the inner step's; not the mean of all timed
    steps, which weighs them by how many outer steps the timed steps hold. The first period
    is warm-up: its outer step pays the reducer's one-time set-up."""
    spec = parse_method("dense-diloco4")
    assert warmup_steps(spec) == 4 and warmup_steps(parse_method("dense")) == 2
    period = [(1.0, 0), (1.0, 0), (1.0, 0)]
    steps = [{"seconds": s, "bytes_sent": b} for s, b in
             [(9.0, 0), *period[1:], (50.0, 100), *period, (5.0, 100), *period, (7.0, 100)]]
    split = outer_step_seconds(steps, warmup_steps(spec))
    assert split == {"outer": 6.0, "inner": 1.0, "outer_steps": 2}
    assert outer_step_seconds(steps[:7], 4) is None  # no outer step after the first period
    point = {"epoch": 0, "step": 8, "wall_seconds": 1.0, "train_seconds": 1.0,
             "test_accuracy": 0.9, "train_loss": 1.0}
    full = {"curve": [point], "final_accuracy": 0.9, "best_accuracy": 0.9,
            "pretrained_accuracy": 0.8, "outer_period": 4,
            "bytes_curve": [0, 0, 0, 100, 0, 0, 0, 100]}
    unshaped = {"runs": {"dense-diloco4": full, "pactrain-0.8-diloco4": full}}

    def timed(split):
        return {"curve": [], "throughput": {"step_seconds_mean": 2.5},
                "outer_step_seconds": split}

    shaped = {"runs": {"dense-diloco4": timed(split), "pactrain-0.8-diloco4": timed(None)},
              "failed": {}}
    compose_timing(shaped, unshaped, 8)
    assert shaped["runs"]["dense-diloco4"]["curve"][0]["wall_seconds"] == 6 * 1.0 + 2 * 6.0
    assert list(shaped["failed"]) == ["pactrain-0.8-diloco4"]
    with pytest.raises(ValueError, match="--timing-steps 6 times no outer step of "
                                         "pactrain-0.8-diloco4 after its first: give at least 8"):
        main(["--rates", "none,100mbit", "--timing-steps", "6", "--methods",
              "pactrain-0.8-diloco4", "--no-sweep", "--no-plots"])


def test_the_ratio_sweep_takes_synchronous_runs_only():
    """An outer-step row trains another way than the sweep's PacTrain at its ratio: the sweep
    passes over it (listed first here, it would be taken otherwise)."""
    def row(label, method, ratio, outer_period=0):
        return {"label": label, "method": method, "ratio": ratio, "backend": "mpi",
                "outer_period": outer_period, "final_accuracy": 0.5, "best_accuracy": 0.5,
                "density": 1 - ratio, "curve": [], "pretrained_accuracy": 0.4}

    runs = {"pactrain-0.8-diloco4": row("pactrain-0.8-diloco4", "pactrain", 0.8, 4),
            "dense-diloco4": row("dense-diloco4", "dense", 0.0, 4),
            "pactrain-0.8": row("pactrain-0.8", "pactrain", 0.8),
            "dense": row("dense", "dense", 0.0)}
    sweep = _sweep({}, (0.0, 0.8), "none", {"none": {"runs": runs}}, None, None, 0, 0.15, 10,
                   False)
    assert [p["label"] for p in sweep["points"]] == ["dense", "pactrain-0.8"]


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("scenario", scenario_names(SCENARIOS))
def test_outer_train_on_two_ranks(scenario):
    """Bytes on every H-th step only, PacTrain's fewer than dense's, torch's post-local SGD
    equal to a dense outer step of rate 1, a closing shorter period, evaluations of the
    global weights, the same weights on every rank: one (shared) mpirun launch."""
    run_scenarios(SCENARIOS, 2).check(scenario)
