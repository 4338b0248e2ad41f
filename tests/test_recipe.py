"""The gradual-pruning recipe: the cubic schedule, the default selection on transformers built
from a config, and its multi-rank invariants (tests/mpi_scripts/recipe_scenarios.py)."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pacmpi.adapters.pruning import named_prunable_parameters, prune
from pacmpi.adapters.recipe import cubic_milestones, gradual_schedule, linear_weights

from mpi_util import (  # tests/ is on sys.path
    SHARED_TIMEOUT,
    mpirun_argv,
    run_scenarios,
    scenario_cases,
    shared_launches,
)

SCENARIOS = "recipe_scenarios.py"

ratios = st.floats(0.0, 0.99)


@settings(max_examples=100, deadline=None)
@given(a=ratios, b=ratios, steps=st.integers(1, 400), every=st.integers(1, 60),
       start=st.integers(0, 50))
def test_cubic_schedule_is_monotone_and_ends_at_its_ratio_exactly(a, b, steps, every, start):
    initial, final = min(a, b), max(a, b)
    if final == 0.0:
        return
    milestones = cubic_milestones(final, steps, every, initial=initial, start=start)
    if initial == final:
        assert milestones == [(start, final)], "one shot at the start"
        return
    points, values = zip(*milestones)
    assert list(points) == sorted(set(points)), "steps strictly increase"
    assert all(x < y for x, y in zip(values, values[1:])), "every update prunes more"
    assert milestones[-1] == (start + steps, final), "the last update is at T, at s_f exactly"
    assert all((p - start) % every == 0 or p == start + steps for p in points)
    for p, value in milestones:
        t = (p - start) / steps
        assert value == pytest.approx(final + (initial - final) * (1 - t) ** 3, abs=1e-12)
    assert initial == 0.0 or milestones[0] == (start, initial), "s_i at once"


def test_cubic_schedule_drops_updates_that_prune_nothing_more():
    assert cubic_milestones(0.8, 4, 2) == [(2, 0.8 - 0.8 * 0.5 ** 3), (4, 0.8)]
    assert cubic_milestones(0.5, 10, 20, initial=0.5) == [(0, 0.5)]  # one shot at the start


@pytest.mark.parametrize("call, named", [
    (lambda: cubic_milestones(0.5, 10, 2, initial=0.7), "0.5 is below the initial ratio 0.7"),
    (lambda: cubic_milestones(1.0, 10, 2), "got 1.0"),
    (lambda: cubic_milestones(0.5, 10, 2, initial=-0.5), "initial ratio"),
    (lambda: cubic_milestones(0.5, 0, 2), "steps must be an int >= 1, got 0"),
    (lambda: cubic_milestones(0.5, 10, 0), "every must be an int >= 1, got 0"),
    (lambda: cubic_milestones(0.5, 10.0, 2), "got 10.0"),
    (lambda: cubic_milestones(0.5, 10, True), "got True"),
    (lambda: cubic_milestones(0.5, 10, 2, start=-1), "start must be an int >= 0, got -1"),
])
def test_bad_schedules_name_the_value(call, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        call()


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3)
    return BertForSequenceClassification(config)


def test_default_selection_on_a_bert_from_a_config_is_its_linear_weight_matrices():
    model = _tiny_bert()
    expected = [f"bert.encoder.layer.{i}.{part}.weight" for i in range(2)
                for part in ("attention.self.query", "attention.self.key",
                             "attention.self.value", "attention.output.dense",
                             "intermediate.dense", "output.dense")]
    assert linear_weights(model) == expected
    # Control: the default of prune() itself also takes the embeddings, pooler and classifier.
    everything = set(named_prunable_parameters(model))
    assert {"bert.embeddings.word_embeddings.weight", "bert.pooler.dense.weight",
            "classifier.weight"} <= everything - set(expected)
    untouched = {name: p.detach().clone() for name, p in model.named_parameters()
                 if name not in expected}
    schedule = gradual_schedule(model, final=0.8, steps=6, every=2)
    masks = None
    for step in range(7):
        masks = schedule.step(model, step) or masks
    assert list(masks) == expected
    total = sum(m.numel() for m in masks.values())
    assert total - sum(int(m.sum()) for m in masks.values()) == round(0.8 * total)
    weights = dict(model.named_parameters())
    assert all(bool((weights[name][~mask] == 0).all()) for name, mask in masks.items())
    assert all(torch.equal(weights[name], value) for name, value in untouched.items())


def test_default_selection_takes_gpt2_conv1d_and_leaves_the_tied_head():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    assert linear_weights(model) == [f"transformer.h.0.{part}.weight" for part in
                                     ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def test_selection_without_linear_layers_says_so():
    with pytest.raises(ValueError, match="no linear layer outside the heads"):
        linear_weights(torch.nn.Sequential(torch.nn.Embedding(4, 2)))
    with pytest.raises(ValueError, match="no linear layer"):
        linear_weights(torch.nn.ModuleDict({"classifier": torch.nn.Linear(2, 2)}))


def test_prune_with_the_selection_matches_the_schedule_at_one_shot():
    a, b = _tiny_bert(), _tiny_bert()
    one_shot = prune(a, 0.5, include=linear_weights(a))
    scheduled = gradual_schedule(b, final=0.5, steps=1, every=1, initial=0.5).step(b, 0)
    assert all(torch.equal(one_shot[n], scheduled[n]) for n in one_shot)


@pytest.mark.parametrize("config, named", [
    ({"prune_steps": 10, "gradual": "5:0.5"}, "two schedules"),
    ({"prune_steps": 10, "ratio": 0.2, "initial_ratio": 0.5}, "below the initial ratio 0.5"),
    ({"prune_steps": 10, "prune_every": 0}, "every must be an int >= 1, got 0"),
    ({"prune_steps": -1}, "got -1"),
    ({"rewarm_steps": 5, "sharded": True}, "--rewarm-steps"),
    ({"distill": 1.0}, "got 1.0"),
    ({"prune_layers": "some"}, "'some'"),
])
def test_the_training_job_names_a_bad_recipe(config, named):
    from pacmpi.experiments.train import check_config

    with pytest.raises(ValueError, match=re.escape(named)):
        check_config(config)


def test_frozen_embeddings_are_never_pruned_and_the_sync_takes_the_masks():
    from pacmpi.adapters.torch_sync import model_masks
    from pacmpi.experiments.train import TrainConfig, _selection

    model, table = _tiny_bert(), "bert.embeddings.word_embeddings.weight"
    everything = TrainConfig(prune_layers="all")
    # control: before freezing, --prune-layers all takes the table
    assert table in named_prunable_parameters(model, **_selection(everything, model))
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.weight.requires_grad_(False)
    for cfg in (everything, TrainConfig(prune_layers="linear")):
        masks = prune(model, 0.5, **_selection(cfg, model))
        assert masks and not any("embeddings" in name for name in masks), sorted(masks)
        model_masks(model, masks)  # a mask on a frozen table would raise here


def test_the_learning_rate_rewarms_after_each_move_of_the_mask():
    from pacmpi.experiments.train import TrainConfig, _milestones, _rewarm

    cfg = TrainConfig(lr=1.0, prune_steps=8, prune_every=4, rewarm_steps=2, ratio=0.5)
    assert [s for s, _ in _milestones(cfg)] == [4, 8]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    rates = []
    for step in range(11):
        _rewarm(optimizer, cfg, _milestones(cfg), step)
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == [1, 1, 1, 1, 0.5, 1, 1, 1, 0.5, 1, 1]


@pytest.mark.mpi
@pytest.mark.skipif(mpirun_argv(1)[0] is None, reason="mpirun not installed")
@pytest.mark.parametrize("ranks, scenario",
                         scenario_cases(SCENARIOS, shared_launches(SCENARIOS)))
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
def test_recipe_scenario(ranks, scenario):
    """Masks agree after every update, pruned weights and Adam state stay 0, dense steps only
    after updates; a schedule that skips the broadcast is caught; bad schedules raise."""
    run_scenarios(SCENARIOS, ranks).check(scenario)


# ---------------------------------------------------------------- the benchmark's -gradual rows
def test_gradual_labels_and_the_recipe_reach_each_job():
    from pacmpi.experiments.bench_train import TEXT, job_command, parse_method

    spec = parse_method("pactrain-ternary-0.8-noef-block256-gradual")
    assert (spec.gradual, spec.ratio, spec.ternary_scale, spec.error_feedback) == (
        True, 0.8, 256, False)
    for bad in ("pactrain-0-gradual", "dense-gradual", "pactrain-0.8-sharded-gradual",
                "topk-1%-gradual"):
        with pytest.raises(ValueError, match="-gradual follows a pactrain label"):
            parse_method(bad)
    recipe = {"prune_layers": "linear", "prune_steps": 48, "prune_every": 4,
              "freeze_embeddings": True, "distill": 0.5}
    cfg = {**TEXT, "recipe": recipe}

    def tail(label, **extra):
        argv, _, _ = job_command({**cfg, **extra}, parse_method(label), "none", None, "o.json")
        return argv[argv.index("--method"):]

    everyone = ["--prune-layers", "linear", "--freeze-embeddings"]
    assert tail("dense") == ["--method", "dense", "--ratio", "0.0", *everyone,
                             "--topk-ratio", "0.01"]
    assert tail("pactrain-0.8") == ["--method", "pactrain", "--ratio", "0.8", *everyone,
                                    "--distill", "0.5", "--topk-ratio", "0.01"]
    schedule = ["--prune-steps", "48", "--prune-every", "4"]
    assert tail("pactrain-0.8-gradual") == [
        "--method", "pactrain", "--ratio", "0.8", "--prune-layers", "linear", *schedule,
        "--freeze-embeddings", "--distill", "0.5", "--topk-ratio", "0.01"]
    # a timing run times the final mask's step: the schedule is left out there
    assert tail("pactrain-0.8-gradual", max_steps=6) == tail("pactrain-0.8")


def test_gradual_rows_need_a_schedule_and_bad_knobs_are_named():
    from pacmpi.experiments.bench_train import run_benchmark

    with pytest.raises(ValueError, match="pactrain-0.8-gradual prune by the cubic schedule"):
        run_benchmark(methods=("dense", "pactrain-0.8-gradual"), rates=("none",),
                      sweep_ratios=())
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        run_benchmark(methods=("dense", "pactrain-0.8-gradual"), rates=("none",),
                      sweep_ratios=(), recipe={"prune_steps": 10, "prune_every": 0})
    with pytest.raises(ValueError, match="0.5 is below the initial ratio 0.6"):
        run_benchmark(methods=("dense", "pactrain-0.8-gradual", "pactrain-0.5-gradual"),
                      rates=("none",), sweep_ratios=(),
                      recipe={"prune_steps": 10, "initial_ratio": 0.6})
    with pytest.raises(ValueError, match="unknown recipe knobs"):
        run_benchmark(methods=("dense",), rates=("none",), sweep_ratios=(),
                      recipe={"prune_ratio": 0.5})


def test_a_gradual_curve_is_placed_by_each_steps_bytes_and_the_schedule_time():
    from pacmpi.experiments.bench_train import compose_timing

    def point(step):
        return {"epoch": 0, "step": step, "wall_seconds": 0.0, "train_seconds": 0.0,
                "test_accuracy": 0.5, "train_loss": 1.0}

    def timed(seconds, sent):
        return {"curve": [], "throughput": {"step_seconds_mean": seconds}, "bytes_per_step": sent}

    # 4 steps: dense while nothing is pruned, a dense fallback after the move at step 2, then
    # the final mask's packed steps; moving the mask took 0.5 s.
    gradual = {"curve": [point(2), point(4)], "final_accuracy": 0.5, "best_accuracy": 0.5,
               "pretrained_accuracy": 0.4, "gradual": True,
               "bytes_curve": [100, 100, 100, 20], "prune_curve": [0.0, 0.0, 0.5, 0.0]}
    plain = {**gradual, "gradual": False}
    unshaped = {"runs": {"pactrain-0.8-gradual": gradual, "pactrain-0.8": plain,
                         "dense": {**plain, "bytes_curve": [100] * 4}}}
    shaped = {"runs": {"dense": timed(10.0, 100), "pactrain-0.8-gradual": timed(2.0, 20),
                       "pactrain-0.8": timed(2.0, 20)}, "failed": {}}
    compose_timing(shaped, unshaped, 6)
    # dense bytes at dense's 10 s, the final mask's at its own 2 s, the move's 0.5 s on top
    assert [p["wall_seconds"] for p in shaped["runs"]["pactrain-0.8-gradual"]["curve"]] == [
        20.0, 32.5]
    assert [p["wall_seconds"] for p in shaped["runs"]["pactrain-0.8"]["curve"]] == [4.0, 8.0]
    assert shaped["runs"]["pactrain-0.8-gradual"]["composed"]["gradual"] is True
    # control: without the dense reference a -gradual row is refused, not guessed
    alone = {"runs": {"pactrain-0.8-gradual": timed(2.0, 20)}, "failed": {}}
    compose_timing(alone, unshaped, 6)
    assert list(alone["failed"]) == ["pactrain-0.8-gradual"] and not alone["runs"]
