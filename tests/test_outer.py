"""OuterSync (pacmpi.adapters.outer): its memory and argument checks on one rank, and the
multi-rank scenarios of tests/mpi_scripts/outer_scenarios.py at 2 and 4 ranks."""
import pytest
import torch
import torch.nn.functional as F

from pacmpi.adapters.outer import OuterSync
from pacmpi.adapters.pruning import prune
from pacmpi.errors import RankInputError
from pacmpi.experiments.models import DigitsCNN

from mpi_util import (  # tests/ is on sys.path (conftest.py)
    SHARED_TIMEOUT,
    run_scenarios,
    scenario_cases,
    shared_launches,
)

SCENARIOS = "outer_scenarios.py"


def trained(period=2, steps=2, **outer):
    torch.manual_seed(0)
    model = DigitsCNN(width=8, hidden=32)
    masks = prune(model, 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = OuterSync(model, optimizer, period=period, masks=masks, **outer)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.rand(8, 1, 8, 8)), torch.randint(0, 10, (8,))).backward()
        optimizer.step()
    return model, sync


def test_memory_is_a_global_copy_and_the_outer_momentum():
    model, sync = trained(bucket_bytes=4096)  # the large matrices in buckets of their own
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    report = sync.memory_report()
    # The pseudo-gradient lives in the local parameters' storage: no third copy.
    assert report["global"] == report["outer_optimizer"] == params and report["staging"] == 0
    assert sum(report.values()) < 2.15 * params, report  # + indices, snapshots, small fusion
    # One 25 MB bucket fuses every parameter: its buffer is a third copy.
    fused = trained()[1].memory_report()
    assert 3 * params < sum(fused.values()) < 3.1 * params, fused
    ternary = trained(quantize="ternary", error_feedback=True, bucket_bytes=4096)[1]
    residuals = ternary.reducer.memory_report()["residuals"]
    assert 0.4 * params < residuals < 0.6 * params, residuals  # one per survivor (half kept)
    assert trained(outer_momentum=0)[1].memory_report()["outer_optimizer"] == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"period": 1.5}, "period must be a positive int, got 1.5"),
    ({"period": -2}, "period must be a positive int, got -2"),
    ({"outer_lr": 0}, "outer_lr must be a positive float, got 0"),
    ({"outer_momentum": "0.9"}, "outer_momentum must be >= 0, got '0.9'"),
    ({"masks": {"nope.weight": torch.ones(1, dtype=torch.bool)}}, "names no trainable"),
])
def test_bad_arguments_name_the_value(kwargs, message):
    model = DigitsCNN(width=4, hidden=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RankInputError, match=message):
        OuterSync(model, optimizer, **{"period": 2, **kwargs})


def test_state_of_another_period_or_masks_is_refused():
    _, sync = trained(period=2)
    state = sync.state_dict()
    with pytest.raises(RankInputError, match="period=2, this OuterSync has period=3"):
        trained(period=3, steps=0)[1].load_state_dict(state)
    with pytest.raises(ValueError, match="exactly the masks given at construction"):
        sync.set_masks({})


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario",
                         scenario_cases(SCENARIOS, shared_launches(SCENARIOS)))
def test_outer_scenario(ranks, scenario):
    """period 1 == synchronous PacTrain, identical weights after outer steps, pruned state 0,
    bytes, ternary residuals, mask changes, buffers, bad input, checkpoints."""
    run_scenarios(SCENARIOS, ranks).check(scenario)
