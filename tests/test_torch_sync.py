"""PacTrainSync / TopKSync / checkpoints: local unit tests and 2- and 4-rank MPI scenarios."""
import numpy as np
import pytest
import torch

from pacmpi.adapters import convert
from pacmpi.adapters.convert import as_array, as_tensor, numpy_dtype
from pacmpi.adapters.torch_sync import PacTrainSync
from pacmpi.experiments.baselines import TopKSync
from pacmpi.experiments.models import DigitsCNN

from mpi_util import (  # tests/ is on sys.path (conftest.py)
    SHARED_TIMEOUT,
    run_scenarios,
    scenario_cases,
    scenario_names,
    shared_launches,
    shared_workdir,
)


def test_as_array_is_zero_copy_for_grads_and_masks():
    grad = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = as_array(grad)
    assert isinstance(view, np.ndarray) and view.dtype == np.float32 and view.shape == (3, 4)
    assert view.ctypes.data == grad.data_ptr()
    view[1, 2] = -7.0  # what the reducer writes back lands in the tensor
    assert grad[1, 2] == -7.0
    mask = torch.tensor([True, False, True])
    mview = as_array(mask)
    assert mview.dtype == np.bool_ and mview.ctypes.data == mask.data_ptr()
    mask[1] = True  # in-place mask updates are seen by the reducer's array
    assert mview[1]
    strided = torch.zeros(4, 6)[:, ::2]  # a non-contiguous grad is viewed, not copied
    as_array(strided)[0, 1] = 3.0
    assert strided[0, 1] == 3.0


def test_bfloat16_crosses_as_its_16_bit_storage():
    """CPU bfloat16 tensors <-> ml_dtypes.bfloat16 arrays, zero-copy both ways, strided too."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    grad = torch.tensor([[1.0, -2.5, 3.0e38], [2.0 ** -133, -0.0, 7.0]], dtype=torch.bfloat16)
    view = as_array(grad)
    assert view.dtype == ml_dtypes.bfloat16 and view.ctypes.data == grad.data_ptr()
    assert np.array_equal(view.view(np.int16), grad.view(torch.int16).numpy())  # same bits
    view[0, 1] = 0.5
    assert grad[0, 1] == 0.5
    as_array(grad[:, ::2])[1, 1] = 9.0  # strided: still a view
    assert grad[1, 2] == 9.0
    back = as_tensor(view)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == grad.data_ptr()
    assert torch.equal(back.view(torch.int16), grad.view(torch.int16))
    assert numpy_dtype(torch.bfloat16) == ml_dtypes.bfloat16
    assert numpy_dtype(torch.float16) == np.float16
    assert as_tensor(np.zeros(2)).dtype == torch.float64  # other dtypes as before


def test_bfloat16_without_ml_dtypes_names_it(monkeypatch):
    monkeypatch.setattr(convert, "bfloat16_dtype", lambda: None)
    for call in (lambda: as_array(torch.zeros(2, dtype=torch.bfloat16)),
                 lambda: numpy_dtype(torch.bfloat16)):
        with pytest.raises(TypeError, match="ml_dtypes"):
            call()


def test_as_array_rejects_other_devices():
    with pytest.raises(TypeError, match="meta"):
        as_array(torch.empty(2, device="meta"))


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "topk"}, "method 'topk' is not available here.*TopKSync"),
    ({"method": "int8"}, "unknown method 'int8'"),
    ({"masks": {"nope.weight": torch.ones(1, dtype=torch.bool)}}, "names no trainable"),
    ({"masks": {"classifier.3.weight": torch.ones(3, dtype=torch.bool)}}, "has shape"),
])
def test_sync_rejects_bad_arguments_before_communicating(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PacTrainSync(DigitsCNN(width=4, hidden=8), **kwargs)


def test_topk_rejects_bad_ratio():
    with pytest.raises(ValueError, match="ratio"):
        TopKSync(DigitsCNN(width=4, hidden=8), ratio=0.0)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, scenario",
                         scenario_cases("sync_scenarios.py", shared_launches("sync_scenarios.py")))
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
def test_sync_scenario(ranks, scenario):
    """Identical weights, pactrain == dense, zero pruned weights, unused params, gradual."""
    run_scenarios("sync_scenarios.py", ranks).check(scenario)


CHECKPOINTS = "sync_checkpoint_scenarios.py"
# First the shared 4-rank launch, which saves a checkpoint in the shared folder; then a 2-rank
# launch of its own resumes it (and runs the module's other scenarios).
CHECKPOINT_LAUNCHES = {**shared_launches(CHECKPOINTS),
                       (2,): tuple(t for t in scenario_names(CHECKPOINTS)
                                   if t != "test_save_at_4_ranks")}


@pytest.fixture(scope="module")
def checkpoint_runs():
    saved = run_scenarios(CHECKPOINTS, 4, only=CHECKPOINT_LAUNCHES[4,])
    return {4: saved, 2: run_scenarios(CHECKPOINTS, 2, only=CHECKPOINT_LAUNCHES[2,], timeout=150,
                                       env=(("PACMPI_TEST_WORKDIR", shared_workdir()),))}


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 210)  # the first waits for a shared launch and its own
@pytest.mark.parametrize("ranks, scenario", scenario_cases(CHECKPOINTS, CHECKPOINT_LAUNCHES))
def test_checkpoint_scenario(checkpoint_runs, ranks, scenario):
    """Resume is bit-exact (pactrain-ternary, topk); a checkpoint saved on 4 ranks resumes on
    2 with warnings and identical weights."""
    checkpoint_runs[ranks].check(scenario)
