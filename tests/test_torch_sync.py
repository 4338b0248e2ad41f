"""PacTrainSync / TopKSync / checkpoints: local unit tests and 2- and 4-rank MPI scenarios."""
import numpy as np
import pytest
import torch

from mpi_util import run_mpi  # tests/ is put on sys.path by conftest.py
from pacmpi.adapters.models import DigitsCNN
from pacmpi.adapters.torch_sync import PacTrainSync, TopKSync, as_array


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


def test_as_array_rejects_other_devices():
    with pytest.raises(TypeError, match="meta"):
        as_array(torch.empty(2, device="meta"))


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "topk"}, "use TopKSync"),
    ({"method": "int8"}, "method must be one of"),
    ({"masks": {"nope.weight": torch.ones(1, dtype=torch.bool)}}, "names no trainable"),
    ({"masks": {"classifier.3.weight": torch.ones(3, dtype=torch.bool)}}, "has shape"),
])
def test_sync_rejects_bad_arguments_before_communicating(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PacTrainSync(DigitsCNN(width=4, hidden=8), **kwargs)


def test_topk_rejects_bad_ratio():
    with pytest.raises(ValueError, match="ratio"):
        TopKSync(DigitsCNN(width=4, hidden=8), ratio=0.0)


def _check(result, *expected):
    assert result.returncode == 0, result.stdout + result.stderr
    for line in expected:
        assert line in result.stdout, result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_sync_scenarios(ranks):
    """Identical weights, pactrain == dense, zero pruned weights, unused params, gradual."""
    _check(run_mpi("sync_scenarios.py", ranks, timeout=150),
           "OK methods", "OK unused", "OK gradual", "OK optimizer")


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["pactrain-ternary", "topk"])
def test_checkpoint_resume_is_bit_exact(tmp_path, method):
    _check(run_mpi("sync_checkpoint.py", 2, "same", tmp_path, method, timeout=120),
           f"OK same {method}")


@pytest.mark.mpi
def test_resume_at_another_world_size_warns_and_continues(tmp_path):
    _check(run_mpi("sync_checkpoint.py", 4, "save", tmp_path, "pactrain-ternary", timeout=120),
           "OK save")
    result = run_mpi("sync_checkpoint.py", 2, "resume", tmp_path, "pactrain-ternary",
                     timeout=120)
    _check(result, "OK resume pactrain-ternary from world size 4 at 2",
           "WARNED: resuming pactrain-ternary at world size 2", "residuals",
           "per-rank RNG states are reseeded")
    # Stale per-rank files of older checkpoints were removed; the current ones remain.
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[0] == "ckpt.pt" and len(files) == 5 and not any(f.endswith(".tmp") for f in files)
