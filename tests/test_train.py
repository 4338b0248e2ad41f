"""``pacmpi.experiments.train``: argument handling locally, the job end to end under mpirun."""
import sys

import pytest

from pacmpi.experiments import train

from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_names  # tests/ is on sys.path

E2E = "train_e2e_scenarios.py"
BASELINES = "train_baselines_scenarios.py"


def test_parse_gradual():
    assert train.parse_gradual("10:0.5,20:0.8") == [(10, 0.5), (20, 0.8)]
    with pytest.raises(ValueError, match="step:ratio"):
        train.parse_gradual("10")


@pytest.mark.parametrize("config, message", [
    ({"method": "int8"}, "unknown method 'int8'"),
    ({"dataset": "cifar10"}, "needs --data-dir"),
    ({"resume": True}, "needs --checkpoint"),
    ({"learning_rate": 1}, "unknown config keys"),
    ({"method": "dgc", "optimizer": "adam"}, "corrects SGD momentum"),
    ({"method": "dense", "error_feedback": False}, "no-error-feedback applies to"),
    ({"method": "dgc", "bias_probe": True}, "bias-probe needs"),
    ({"method": "pactrain", "backend": "ddp", "bias_probe": True}, "bias-probe needs"),
    ({"method": "terngrad", "backend": "horovod"}, "run --method topk|terngrad|dgc"),
    ({"method": "pactrain-ternary", "ternary_scale": "layer"},
     "ternary_scale must be one of .*got 'layer'"),
    ({"method": "pactrain-ternary", "ternary_scale": 0}, "positive int .*got 0"),
    ({"method": "fp16", "sharded": True}, "--sharded shards .*not fp16 with --backend mpi"),
    ({"method": "dense", "sharded": True}, "--sharded shards .*not dense with --backend mpi"),
    ({"method": "pactrain-ternary", "backend": "ddp", "sharded": True},
     "not pactrain-ternary with --backend ddp"),
    ({"method": "pactrain", "sharded": True, "checkpoint": "c.pt"},
     "--sharded does not support --checkpoint"),
])
def test_config_validation(config, message):
    with pytest.raises(ValueError, match=message):
        train.run(config)


def test_parser_covers_every_config_field():
    args = train.build_parser().parse_args(["--method", "topk", "--topk-ratio", "0.02",
                                            "--no-progress", "--gradual", "5:0.5"])
    assert args.method == "topk" and args.topk_ratio == 0.02 and args.progress is False
    assert train.check_config(args).gradual == "5:0.5"
    assert train.build_parser().parse_args(["--ternary-scale", "bucket"]).ternary_scale == "bucket"
    assert train.build_parser().parse_args(["--ternary-scale", "4096"]).ternary_scale == 4096


def test_horovod_backend_fails_clearly_without_horovod(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import raises ImportError
    cfg = train.check_config({"backend": "horovod"})
    with pytest.raises(RuntimeError, match="--backend horovod needs horovod.torch"):
        train._HorovodSync(cfg, None, None, {}, None)


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("scenario", scenario_names(E2E))
def test_train_end_to_end_on_two_ranks(scenario):
    """Every method for one epoch (accuracy, equal weights on every rank, bytes per step),
    ``--json``, and a checkpointed run resumed bit for bit: one mpirun launch."""
    run_scenarios(E2E, 2).check(scenario)


def test_watchdog_option_is_parsed_and_validated():
    from pacmpi.experiments.train import parse_watchdog

    assert parse_watchdog("60") == (60.0, None)
    assert parse_watchdog("60,600") == (60.0, 600.0)
    for bad in ("abc", "0", "1,2,3", "-5"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            parse_watchdog(bad)


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("scenario", scenario_names(BASELINES))
def test_baselines_error_feedback_and_bias_probe_on_two_ranks(scenario):
    run_scenarios(BASELINES, 2).check(scenario)


def test_a_gradient_criterion_leaves_embedding_tables_to_magnitude():
    """Taylor scored on a batch sees a zero gradient on every embedding row whose token the
    batch lacks, so it would remove those rows first; the job scores embedding tables by
    magnitude and the rest by the criterion, each part losing the same fraction. Control:
    Taylor over everything removes the absent tokens' rows."""
    import torch
    from torch import nn

    from pacmpi.adapters.pruning import prune

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.embed(x).mean(1))

    torch.manual_seed(0)
    batch = [(torch.randint(0, 10, (4, 5)), torch.randint(0, 3, (4,)))]  # tokens 0-9 only
    args = {"method": "taylor", "data": batch, "collectives": None}
    model = Tagger()
    weights = model.embed.weight.detach().clone()
    masks = train._prune(model, 0.5, args)
    assert list(masks) == ["embed.weight", "head.weight"]  # the model's order
    kept = masks["embed.weight"]
    assert int(kept.sum()) == weights.numel() // 2 and int(masks["head.weight"].sum()) == 12
    threshold = weights.abs().flatten().kthvalue(weights.numel() // 2).values
    assert bool((weights.abs()[kept] >= threshold).all())  # by magnitude
    assert int(kept[10:].sum()) > 100  # absent tokens' rows keep their large weights
    everything = prune(Tagger(), 0.5, **args)["embed.weight"]
    present = batch[0][0].unique()
    assert bool(everything[present].all())  # every weight it removed is an absent token's
