"""Tests for pacmpi.adapters.pruning: magnitude/GraSP pruning, GSE, torch.nn.utils.prune
interop, gradual schedules and rank-consistent masks under mpirun."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune as torch_prune

from pacmpi.adapters.pruning import (
    GradualPruningSchedule,
    MaskEnforcer,
    masks_digest,
    masks_from_torch_prune,
    named_prunable_parameters,
    prune,
)
from pacmpi.experiments.data import iterate_minibatches, load_digits_split
from pacmpi.experiments.models import DigitsCNN

from mpi_util import (  # tests/ is put on sys.path by conftest.py
    SHARED_TIMEOUT,
    mpirun_argv,
    run_scenarios,
    scenario_cases,
    shared_launches,
)

pytestmark = pytest.mark.timeout(120)
SCENARIOS = "pruning_scenarios.py"


@pytest.fixture(scope="module")
def digits():
    return load_digits_split()


@pytest.fixture(scope="module")
def batches(digits):
    return list(iterate_minibatches(digits.x_train, digits.y_train, 64, seed=0, epoch=0))


def make_model(seed=0):
    torch.manual_seed(seed)
    return DigitsCNN(width=8)


def pruned_count(masks):
    return sum(int((~m).sum()) for m in masks.values())


def assert_pruned_zero(params, masks):
    for name, mask in masks.items():
        assert torch.count_nonzero(params[name].detach()[~mask]) == 0, name


def non_prunable_state(model):
    prunable = set(named_prunable_parameters(model))
    return {k: v.clone() for k, v in model.state_dict().items() if k not in prunable}


# ---------------------------------------------------------------- magnitude pruning
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.9])
def test_magnitude_global_exact_ratio_zeroes_and_leaves_others(ratio):
    model = make_model()
    before = non_prunable_state(model)
    masks = prune(model, ratio)
    params = named_prunable_parameters(model)
    assert list(masks) == list(params) == [
        "features.0.weight", "features.3.weight", "classifier.1.weight", "classifier.3.weight"
    ]
    total = sum(m.numel() for m in masks.values())
    assert pruned_count(masks) == round(ratio * total)
    assert all(m.dtype == torch.bool and m.shape == params[n].shape for n, m in masks.items())
    assert_pruned_zero(params, masks)
    after = non_prunable_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # biases, BatchNorm untouched


def test_magnitude_global_removes_smallest_across_layers():
    model = make_model()
    original = {n: p.detach().clone() for n, p in named_prunable_parameters(model).items()}
    masks = prune(model, 0.6)
    pruned = torch.cat([original[n][~m].abs() for n, m in masks.items()])
    kept = torch.cat([original[n][m].abs() for n, m in masks.items()])
    assert pruned.max() <= kept.min()


def test_magnitude_layer_scope_exact_per_layer():
    model = make_model()
    masks = prune(model, 0.75, scope="layer")
    for mask in masks.values():
        assert int((~mask).sum()) == round(0.75 * mask.numel())


def test_deterministic_and_ties_prune_lowest_flat_index_first():
    assert masks_digest(prune(make_model(), 0.5)) == masks_digest(prune(make_model(), 0.5))
    a, b = nn.Linear(4, 3, bias=False), nn.Linear(2, 2, bias=False)
    model = nn.Sequential(a, b)
    with torch.no_grad():
        a.weight.fill_(0.5)
        b.weight.fill_(0.5)
    masks = prune(model, 0.5)  # 8 of 16 equal weights: the first 8 in parameter order
    assert (~masks["0.weight"]).flatten().tolist() == [True] * 8 + [False] * 4
    assert masks["1.weight"].all()


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    ratio=st.floats(0.0, 0.99),
    seed=st.integers(0, 1000),
    scope=st.sampled_from(["global", "layer"]),
)
def test_magnitude_exact_count_with_many_ties(rows, cols, ratio, seed, scope):
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(cols, rows), nn.Linear(rows, cols))
    with torch.no_grad():  # small integers: lots of ties in |W|
        for layer in model:
            layer.weight.copy_(
                torch.randint(-2, 3, layer.weight.shape, generator=generator).float())
    original = {n: p.detach().clone() for n, p in named_prunable_parameters(model).items()}
    masks = prune(model, ratio, scope=scope)
    groups = [masks] if scope == "global" else [{n: m} for n, m in masks.items()]
    for group in groups:
        assert pruned_count(group) == round(ratio * sum(m.numel() for m in group.values()))
        pruned = [original[n][~m].abs() for n, m in group.items()]
        kept = [original[n][m].abs() for n, m in group.items()]
        if torch.cat(pruned).numel() and torch.cat(kept).numel():
            assert torch.cat(pruned).max() <= torch.cat(kept).min()


def test_include_exclude_globs_and_callables():
    model = make_model()
    # include replaces the default rule, so BatchNorm biases (features.1/4) match too
    assert list(named_prunable_parameters(model, include="*.bias")) == [
        "features.1.bias", "features.4.bias", "classifier.1.bias", "classifier.3.bias"
    ]
    assert list(named_prunable_parameters(model, exclude="classifier.*")) == [
        "features.0.weight", "features.3.weight"]
    only_fc = named_prunable_parameters(model, include=lambda name, p: p.dim() == 2)
    assert list(only_fc) == ["classifier.1.weight", "classifier.3.weight"]
    masks = prune(model, 0.5, include=["features.*.weight"],
                  exclude=["features.1.*", "features.4.*"])  # BatchNorms
    assert list(masks) == ["features.0.weight", "features.3.weight"]


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5, float("nan"), True, "0.5"])
def test_bad_ratio_is_named(ratio):
    with pytest.raises(ValueError, match="ratio") as info:
        prune(make_model(), ratio)
    assert repr(ratio) in str(info.value)


def test_bad_method_scope_and_missing_data_are_named():
    with pytest.raises(ValueError, match="'snip'"):
        prune(make_model(), 0.5, method="snip")
    with pytest.raises(ValueError, match="'block'"):
        prune(make_model(), 0.5, scope="block")
    with pytest.raises(ValueError, match="needs data"):
        prune(make_model(), 0.5, method="grasp")
    with pytest.raises(ValueError, match="method='taylor' needs data"):
        prune(make_model(), 0.5, method="taylor")
    with pytest.raises(ValueError, match="no prunable"):
        prune(make_model(), 0.5, include="nothing.*")


# ---------------------------------------------------------------- GraSP
def test_grasp_sign_convention_hand_computed():
    """y = w·x, loss = ½(y - t)²: g = r x, H = x xᵀ, Hg = r (x·x) x with r = w·x - t.

    w = (3, 1), x = (1, 1), t = 10: r = -6, Hg = (-12, -12), score = -w ⊙ Hg = (36, 12).
    GraSP removes the HIGHEST score: w₀ = 3, although it is the larger weight (magnitude
    pruning would remove w₁). Check: without w₀, |g|² = 2·9² = 162; without w₁, 2·7² = 98:
    removing w₀ preserves (here raises) gradient flow most.
    """
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 1.0]]))
    data = [(torch.tensor([[1.0, 1.0]]), torch.tensor([10.0]))]

    def half_squared_error(out, target):
        return 0.5 * ((out.squeeze(-1) - target) ** 2).sum()

    masks = prune(model, 0.5, "grasp", data=data, loss_fn=half_squared_error,
                  grasp_temperature=1.0, include="*")
    assert masks["weight"].tolist() == [[False, True]]
    assert model.weight.tolist() == [[0.0, 1.0]]


def test_taylor_saliency_hand_computed():
    """y = w·x, loss = ½(y - t)²: g = r x with r = w·x - t. w = (3, 1), x = (1, 4), t = 10:
    r = -3, g = (-3, -12), |w ⊙ g| = (9, 12): Taylor removes w₀ = 3, the LARGER weight (the
    loss leans on w₁ through its large input), where magnitude would remove w₁."""
    def model():
        linear = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.tensor([[3.0, 1.0]]))
        return linear

    data = [(torch.tensor([[1.0, 4.0]]), torch.tensor([10.0]))]

    def half_squared_error(out, target):
        return 0.5 * ((out.squeeze(-1) - target) ** 2).sum()

    taylor = model()
    masks = prune(taylor, 0.5, "taylor", data=data, loss_fn=half_squared_error, include="*")
    assert masks["weight"].tolist() == [[False, True]] and taylor.weight.tolist() == [[0.0, 1.0]]
    assert prune(model(), 0.5, include="*")["weight"].tolist() == [[True, False]]  # magnitude
    assert all(p.grad is None for p in taylor.parameters())


def test_grasp_exact_ratio_differs_from_magnitude_and_is_side_effect_free(batches):
    model = make_model()
    bn_before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    model.train()
    grasp = prune(model, 0.8, "grasp", data=batches, grasp_batches=2)
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in bn_before.items())
    assert pruned_count(grasp) == round(0.8 * sum(m.numel() for m in grasp.values()))
    assert_pruned_zero(named_prunable_parameters(model), grasp)
    magnitude = prune(make_model(), 0.8)
    assert masks_digest(grasp) != masks_digest(magnitude)
    layer = prune(make_model(), 0.5, "grasp", "layer", data=batches)
    assert all(int((~m).sum()) == round(0.5 * m.numel()) for m in layer.values())


def test_grasp_pruned_model_still_trains(digits, batches):
    model = make_model()
    masks = prune(model, 0.8, "grasp", data=batches, grasp_batches=2)
    enforcer = MaskEnforcer(model, masks)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    enforcer.attach(optimizer)
    losses = []
    for epoch in range(3):
        for x, y in iterate_minibatches(digits.x_train, digits.y_train, 64, seed=1, epoch=epoch):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            enforcer.apply_to_grads()
            optimizer.step()
            losses.append(loss.item())
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert_pruned_zero(enforcer.parameters, masks)


def test_attaching_an_optimizer_twice_hooks_it_once():
    """The second attach returns the first handle; removing it leaves no hook behind, so an
    unmasked gradient then moves pruned weights (the control: before, the hook zeroed them)."""
    layer = nn.Linear(6, 4)
    masks = {"weight": torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) < 0.5}
    enforcer = MaskEnforcer(layer, masks)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    handle = enforcer.attach(optimizer)
    assert enforcer.attach(optimizer) is handle
    for hooked in (True, False):
        optimizer.zero_grad()
        layer(torch.ones(3, 6)).sum().backward()  # no apply_to_grads: pruned coordinates move
        optimizer.step()
        pruned = layer.weight.detach()[~masks["weight"]]
        assert bool(torch.all(pruned == 0)) == hooked
        handle.remove()


# ---------------------------------------------------------------- gradient sparsity enforcement
OPTIMIZERS = {
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def train_after_pruning(digits, make_optimizer, attach: bool, steps: int = 20):
    """Warm the optimizer on the dense model (momentum/Adam state exists, as for a
    pretrained model or a schedule milestone), prune, then train with masked gradients.
    Returns whether the pruned weights were exactly zero after every step."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    data = list(iterate_minibatches(digits.x_train, digits.y_train, 32, seed=0, epoch=0))

    def step(x, y, enforcer=None):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if enforcer is not None:
            enforcer.apply_to_grads()
            for name, param in enforcer.parameters.items():
                assert torch.count_nonzero(param.grad[~enforcer.masks[name]]) == 0
        optimizer.step()

    for x, y in data[:5]:
        step(x, y)
    masks = prune(model, 0.7)
    enforcer = MaskEnforcer(model, masks)
    if attach:
        enforcer.attach(optimizer)
    zero_after_every_step = True
    for x, y in data[5 : 5 + steps]:
        step(x, y, enforcer)
        params = enforcer.parameters
        zero_after_every_step &= all(bool((params[n][~m] == 0).all()) for n, m in masks.items())
        if attach:
            for name, param in params.items():
                for value in optimizer.state[param].values():
                    if value.shape == param.shape:
                        assert torch.count_nonzero(value[~masks[name]]) == 0, name
    return zero_after_every_step


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_enforcer_keeps_pruned_weights_zero(digits, name):
    assert train_after_pruning(digits, OPTIMIZERS[name], attach=True)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_negative_control_masked_grads_alone_resurrect_weights(digits, name):
    # Momentum / Adam moments built before pruning move pruned weights even though their
    # gradients are zero: shows the check above can fail.
    assert not train_after_pruning(digits, OPTIMIZERS[name], attach=False)


def test_grad_hooks_mask_on_accumulation_and_follow_update(digits):
    model = make_model()
    enforcer = MaskEnforcer(model, prune(model, 0.5))
    enforcer.register_grad_hooks()
    x, y = digits.x_train[:32], digits.y_train[:32]
    F.cross_entropy(model(x), y).backward()
    for name, param in enforcer.parameters.items():
        assert torch.count_nonzero(param.grad[~enforcer.masks[name]]) == 0
        assert torch.count_nonzero(param.grad[enforcer.masks[name]]) > 0
    sparser = prune(model, 0.9, current_masks=enforcer.masks)
    enforcer.update(sparser)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for name, param in enforcer.parameters.items():
        assert torch.count_nonzero(param.grad[~sparser[name]]) == 0
    enforcer.remove_grad_hooks()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert any(torch.count_nonzero(p.grad[~sparser[n]]) > 0 for n, p in enforcer.parameters.items())


def test_enforcer_masks_order_density_and_validation():
    model = make_model()
    masks = prune(model, 0.25)
    reordered = dict(reversed(list(masks.items())))
    enforcer = MaskEnforcer(model, reordered)
    assert list(enforcer.masks) == list(named_prunable_parameters(model))
    report = enforcer.density()
    assert report.total == sum(m.numel() for m in masks.values())
    assert report.kept == report.total - round(0.25 * report.total)
    assert report.overall == pytest.approx(0.75, abs=1e-3)
    assert set(report.per_parameter) == set(masks)
    with pytest.raises(ValueError, match="nope.weight"):
        MaskEnforcer(model, {"nope.weight": torch.ones(3, dtype=torch.bool)})
    with pytest.raises(ValueError, match="shape"):
        MaskEnforcer(model, {"features.0.weight": torch.ones(3, dtype=torch.bool)})


def test_update_zeroes_weights_and_attached_optimizer_state(digits):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    enforcer = MaskEnforcer(model, prune(model, 0.2))
    enforcer.attach(optimizer)
    F.cross_entropy(model(digits.x_train[:32]), digits.y_train[:32]).backward()
    optimizer.step()
    new = prune(copy.deepcopy(model), 0.6, current_masks=enforcer.masks)
    enforcer.update(new)
    for name, param in enforcer.parameters.items():
        assert torch.count_nonzero(param.detach()[~new[name]]) == 0
        assert torch.count_nonzero(optimizer.state[param]["momentum_buffer"][~new[name]]) == 0


# ---------------------------------------------------------------- torch.nn.utils.prune interop
class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.hidden(x.flatten(1))))


def test_masks_from_torch_prune_point_at_weight_orig(digits):
    torch.manual_seed(0)
    model = TwoLayer()
    torch_prune.l1_unstructured(model.fc, "weight", amount=0.3)
    masks = masks_from_torch_prune(model)
    assert list(masks) == ["fc.weight"]
    assert torch.equal(masks["fc.weight"], model.fc.weight_mask.bool())
    # why not weight_orig
    assert torch.count_nonzero(model.fc.weight_orig.detach()[~masks["fc.weight"]]) > 0
    assert named_prunable_parameters(model)["fc.weight"] is model.fc.weight_orig
    enforcer = MaskEnforcer(model, masks)
    assert enforcer.parameters["fc.weight"] is model.fc.weight_orig

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    enforcer.attach(optimizer)
    for x, y in list(iterate_minibatches(digits.x_train, digits.y_train, 32, seed=0, epoch=0))[:15]:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        enforcer.apply_to_grads()
        optimizer.step()
        model(x)  # the forward pre-hook recomputes the effective weight
        assert torch.count_nonzero(model.fc.weight.detach()[~masks["fc.weight"]]) == 0
        assert torch.count_nonzero(model.fc.weight_orig.detach()[~masks["fc.weight"]]) == 0


def test_prune_on_torch_reparametrized_model_extends_its_mask():
    torch.manual_seed(0)
    model = TwoLayer()
    torch_prune.l1_unstructured(model.fc, "weight", amount=0.3)
    old = model.fc.weight_mask.bool().clone()
    masks = prune(model, 0.6)
    assert list(masks) == ["hidden.weight", "fc.weight"]
    assert not (masks["fc.weight"] & ~old).any()  # old pruned coordinates stay pruned
    assert pruned_count(masks) == round(0.6 * (64 * 32 + 32 * 10))
    assert torch.equal(model.fc.weight_mask.bool(), masks["fc.weight"])
    model(torch.randn(2, 64))
    assert torch.count_nonzero(model.fc.weight.detach()[~masks["fc.weight"]]) == 0


# ---------------------------------------------------------------- gradual schedule
def test_schedule_masks_only_get_sparser(digits):
    model = make_model()
    schedule = GradualPruningSchedule([(0, 0.2), (4, 0.5), (8, 0.8)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = list(iterate_minibatches(digits.x_train, digits.y_train, 32, seed=0, epoch=0))
    history = []
    for step_index, (x, y) in enumerate(data[:12]):
        masks = schedule.step(model, step_index)
        assert (masks is None) == (step_index not in (0, 4, 8))
        if masks is not None:
            history.append(masks)
        # Train WITHOUT enforcement so pruned weights regrow: the schedule must still keep
        # them pruned instead of re-deciding from scratch.
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert len(history) == 3
    total = sum(m.numel() for m in history[0].values())
    for ratio, masks in zip((0.2, 0.5, 0.8), history):
        assert pruned_count(masks) == round(ratio * total)
    for older, newer in zip(history, history[1:]):
        assert all(not (newer[n] & ~older[n]).any() for n in older)
    assert schedule.masks is history[-1]


def test_schedule_applies_latest_due_milestone_once():
    schedule = GradualPruningSchedule([(2, 0.3), (5, 0.6)], scope="layer")
    model = make_model()
    masks = schedule.step(model, 10)
    assert all(int((~m).sum()) == round(0.6 * m.numel()) for m in masks.values())
    assert schedule.step(model, 11) is None


@pytest.mark.parametrize(
    "milestones, named",
    [
        ([(0, 0.5), (0, 0.6)], "0 after 0"),
        ([(5, 0.5), (3, 0.6)], "3 after 5"),
        ([(0, 0.5), (3, 0.4)], "0.4 after 0.5"),
        ([(0, 1.0)], "1.0"),
        ([(-1, 0.1)], "-1"),
        ([(1.5, 0.1)], "1.5"),
        ([], "empty"),
    ],
)
def test_schedule_validation_names_bad_value(milestones, named):
    with pytest.raises(ValueError, match=named):
        GradualPruningSchedule(milestones)


def test_schedule_validates_method_and_scope():
    with pytest.raises(ValueError, match="'random'"):
        GradualPruningSchedule([(0, 0.5)], method="random")
    with pytest.raises(ValueError, match="'row'"):
        GradualPruningSchedule([(0, 0.5)], scope="row")


# ---------------------------------------------------------------- multi-rank consistency
@pytest.mark.mpi
@pytest.mark.skipif(mpirun_argv(1)[0] is None, reason="mpirun not installed")
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario", scenario_cases(SCENARIOS, shared_launches(SCENARIOS)))
def test_grasp_masks_identical_across_ranks_with_different_data(ranks, scenario):
    """GraSP on different per-rank batches, with ``comm``: identical masks (a local control
    differs), rank 0's decision, exact ratio, zeros; a failure on rank 0 raises on every rank."""
    run_scenarios(SCENARIOS, ranks).check(scenario)
