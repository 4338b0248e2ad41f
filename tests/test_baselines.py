"""TernGrad and DGC baselines (``pacmpi.experiments.baselines``): code packing and DGC's selection
locally, their invariants on 2 and 4 MPI ranks (``mpi_scripts/baselines_scenarios.py``)."""
import numpy as np
import pytest
import torch

from pacmpi.experiments.baselines import (
    DGCSync,
    TernGradSync,
    make_baseline,
    pack_codes,
    sparsify,
    unpack_codes,
)
from pacmpi.experiments.models import DigitsCNN

from mpi_util import (  # tests/ is put on sys.path by conftest.py
    SHARED_TIMEOUT,
    run_scenarios,
    scenario_cases,
    shared_launches,
)

MODULE = "baselines_scenarios.py"


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 17])
def test_codes_round_trip_four_per_byte(n):
    q = np.random.default_rng(n).integers(-1, 2, n).astype(np.int8)
    packed = pack_codes(q)
    assert packed.dtype == np.uint8 and packed.size == -(-n // 4)
    assert np.array_equal(unpack_codes(packed, n), q)
    # rows of several ranks decode independently
    both = unpack_codes(np.stack([packed, pack_codes(-q)]), n)
    assert np.array_equal(both, np.stack([q, -q]))


def test_code_layout_first_value_in_lowest_bits():
    assert pack_codes(np.array([1, 0, -1, 1], dtype=np.int8)).tolist() == [2 | 1 << 2 | 0 | 2 << 6]


def test_sparsify_conserves_and_keeps_each_segments_largest():
    accumulated = torch.tensor([1.0, -5.0, 3.0, 0.5, 2.0, -7.0, 4.0])
    before = accumulated.clone()
    indices, values = sparsify(accumulated, sizes=[3, 4], ks=[1, 2])
    assert sorted(indices.tolist()) == [1, 5, 6]
    assert torch.equal(values, before[indices])
    rebuilt = accumulated.clone()
    rebuilt[indices] += values
    assert torch.equal(rebuilt, before)  # sent + residual == accumulated
    assert accumulated[indices].eq(0).all()


@pytest.mark.parametrize("factory, message", [
    (lambda m: DGCSync(m, ratio=0.0), "ratio must be in"),
    (lambda m: DGCSync(m, ratio=1.5), "ratio must be in"),
    (lambda m: DGCSync(m, momentum=1.0), "momentum must be in"),
    (lambda m: TernGradSync(m, clip=0), "clip must be positive"),
    (lambda m: make_baseline(m, "qsgd"), "unknown method 'qsgd'; choose from terngrad, dgc"),
])
def test_bad_arguments_are_refused_before_communicating(factory, message):
    with pytest.raises(ValueError, match=message):
        factory(DigitsCNN(width=4, hidden=8))


def test_dgc_keeps_at_least_one_value_per_layer():
    sync = DGCSync(DigitsCNN(width=4, hidden=8), ratio=1e-6)
    assert sync.ks == [1] * len(sync.params)
    sync.remove()


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, shared_launches(MODULE)))
def test_baseline_invariants_under_mpi(ranks, scenario):
    run_scenarios(MODULE, ranks).check(scenario)
