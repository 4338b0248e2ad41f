"""Tests for pacmpi.experiments.data and pacmpi.experiments.models."""
import importlib.util
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from pacmpi.adapters.pruning import named_prunable_parameters, prune
from pacmpi.experiments.data import (
    CIFAR10_BATCHES,
    iterate_minibatches,
    load_cifar10,
    load_digits32_split,
    load_digits_split,
    shard,
)
from pacmpi.experiments.models import (
    MLP,
    MODELS,
    CifarCNN,
    DigitsCNN,
    ResNet18,
    build_model,
    count_parameters,
)

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- digits
@pytest.fixture(scope="module")
def digits():
    return load_digits_split()


def test_digits_split_sizes_types_and_range(digits):
    assert len(digits.x_train) + len(digits.x_test) == 1797
    assert len(digits.x_test) == 450  # ceil(0.25 * 1797), scikit-learn's rounding
    assert digits.x_train.shape[1:] == (1, 8, 8) and digits.x_test.shape[1:] == (1, 8, 8)
    assert digits.x_train.dtype == torch.float32 and digits.y_train.dtype == torch.int64
    assert digits.x_train.min() == 0.0 and digits.x_train.max() == 1.0
    assert set(digits.y_train.tolist()) == set(range(10))


def test_digits_split_is_stratified_and_deterministic(digits):
    again = load_digits_split()
    assert all(torch.equal(a, b) for a, b in zip(digits, again))
    assert not torch.equal(load_digits_split(seed=1).y_test, digits.y_test)
    counts_train = torch.bincount(digits.y_train, minlength=10).float()
    counts_test = torch.bincount(digits.y_test, minlength=10).float()
    share = counts_test / (counts_train + counts_test)
    assert torch.all((share - 0.25).abs() < 0.02)
    small = load_digits_split(test_fraction=0.1)
    assert len(small.x_test) == 180


def test_digits_split_read_from_the_cache_is_the_split(tmp_path, monkeypatch):
    """The cached split is scikit-learn's, bit for bit, per seed; a damaged file is split anew."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    made = load_digits_split(seed=3)
    files = list((tmp_path / "pacmpi").glob("digits-0.25-3-*"))
    assert len(files) == 1
    read = load_digits_split(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(made, read))
    other = load_digits_split(seed=4)  # negative control: another seed, another file and split
    assert len(list((tmp_path / "pacmpi").glob("digits-*"))) == 2
    assert not torch.equal(other.y_test, read.y_test)
    for damaged in (b"not a split", None):
        if damaged is None:
            torch.save({"x_train": made.x_train}, files[0])  # a file torch wrote, not a split
        else:
            files[0].write_bytes(damaged)
        assert all(torch.equal(a, b) for a, b in zip(made, load_digits_split(seed=3)))


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_digits_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match=repr(fraction)):
        load_digits_split(test_fraction=fraction)


def test_digits32_is_the_same_split_upscaled(digits):
    up = load_digits32_split()
    assert up.x_train.shape == (len(digits.x_train), 1, 32, 32)
    assert up.x_test.shape == (len(digits.x_test), 1, 32, 32)
    assert up.x_train.dtype == torch.float32 and up.x_train.is_contiguous()
    assert torch.equal(up.y_train, digits.y_train) and torch.equal(up.y_test, digits.y_test)
    assert set(up.y_train.tolist()) == set(range(10))
    # bilinear: convex combinations of the 8x8 pixels, so the range stays [0, 1] ...
    assert up.x_train.min() >= 0.0 and up.x_train.max() <= 1.0
    # ... and equal to bilinear interpolation written out: up = W x W^T, where output row i
    # samples source coordinate (i + 0.5) / 4 - 0.5 (half-pixel centres, clamped at the edges).
    weights = np.zeros((32, 8))
    for i in range(32):
        src = max((i + 0.5) / 4 - 0.5, 0.0)
        lo = int(np.floor(src))
        hi, frac = min(lo + 1, 7), src - lo
        weights[i, lo] += 1 - frac
        weights[i, hi] += frac
    for k in (0, 7, len(digits.x_test) - 1):
        expected = weights @ digits.x_test[k, 0].double().numpy() @ weights.T
        assert np.allclose(up.x_test[k, 0].numpy(), expected, atol=1e-6)
    # deterministic, and the seed picks the same split as the 8x8 loader's
    assert all(torch.equal(a, b) for a, b in zip(up, load_digits32_split()))
    assert torch.equal(load_digits32_split(seed=1).y_test, load_digits_split(seed=1).y_test)
    with pytest.raises(ValueError, match="1.5"):
        load_digits32_split(test_fraction=1.5)


# ---------------------------------------------------------------- shard
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_shard_is_disjoint_equal_and_drops_remainder(size):
    n = 101
    x, y = torch.arange(n), torch.arange(n) * 10
    shards = [shard((x, y), rank, size) for rank in range(size)]
    assert all(len(xs) == len(ys) == n // size for xs, ys in shards)
    assert all(torch.equal(ys, xs * 10) for xs, ys in shards)  # rows stay aligned
    seen = torch.cat([xs for xs, _ in shards])
    assert len(set(seen.tolist())) == len(seen) == (n // size) * size


def test_shard_tensor_and_dataset():
    x = torch.arange(10)
    assert shard(x, 1, 3).tolist() == [1, 4, 7]
    dataset = TensorDataset(torch.arange(10).float())
    parts = [shard(dataset, rank, 4) for rank in range(4)]
    assert all(isinstance(p, Subset) and len(p) == 2 for p in parts)
    assert len({i for p in parts for i in p.indices}) == 8


def test_shard_validation_names_value():
    with pytest.raises(ValueError, match="rank .* got 3"):
        shard(torch.arange(10), 3, 3)
    with pytest.raises(ValueError, match="size .* got 0"):
        shard(torch.arange(10), 0, 0)
    with pytest.raises(ValueError, match="2 items"):
        shard(torch.arange(2), 0, 3)
    with pytest.raises(ValueError, match="same length"):
        shard((torch.arange(3), torch.arange(4)), 0, 1)


# ---------------------------------------------------------------- minibatches
def _order(x, **kw):
    return torch.cat([xb for xb, _ in iterate_minibatches(x, x, 7, **kw)]).tolist()


def test_minibatches_deterministic_per_seed_and_epoch():
    x = torch.arange(50)
    assert _order(x, seed=3, epoch=1) == _order(x, seed=3, epoch=1)
    assert _order(x, seed=3, epoch=1) != _order(x, seed=3, epoch=2)
    assert _order(x, seed=3, epoch=1) != _order(x, seed=4, epoch=1)
    assert sorted(_order(x, seed=3, epoch=1)) == list(range(50))
    assert _order(x, seed=3, epoch=1, shuffle=False) == list(range(50))
    batches = list(iterate_minibatches(x, x, 7, seed=0, epoch=0, drop_last=True))
    assert len(batches) == 7 and all(len(xb) == 7 for xb, _ in batches)
    assert all(torch.equal(xb, yb) for xb, yb in batches)


def test_minibatches_validation():
    with pytest.raises(ValueError, match="batch_size .* got 0"):
        list(iterate_minibatches(torch.arange(4), torch.arange(4), 0, seed=0, epoch=0))
    with pytest.raises(ValueError, match="4 != 3"):
        list(iterate_minibatches(torch.arange(4), torch.arange(3), 2, seed=0, epoch=0))


# ---------------------------------------------------------------- CIFAR-10
def _write_fake_cifar(folder, per_batch=4):
    """Tiny files in the CIFAR-10 python format: pickled dicts with bytes keys."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for index, name in enumerate((*CIFAR10_BATCHES, "test_batch")):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [(index + i) % 10 for i in range(per_batch)]
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
                 b"filenames": [f"{name}_{i}.png".encode() for i in range(per_batch)]}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
        written[name] = (data, labels)
    return written


def test_cifar_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py") as info:
        load_cifar10(tmp_path / "nowhere")
    assert "nowhere" in str(info.value)


@pytest.mark.parametrize("point_at_folder", [False, True])
def test_cifar_reads_python_pickle_batches(tmp_path, point_at_folder):
    written = _write_fake_cifar(tmp_path / "cifar-10-batches-py")
    data_dir = tmp_path / "cifar-10-batches-py" if point_at_folder else tmp_path
    split = load_cifar10(data_dir, backend="pickle")
    assert split.x_train.shape == (20, 3, 32, 32) and split.x_test.shape == (4, 3, 32, 32)
    assert split.x_train.dtype == torch.float32 and split.y_train.dtype == torch.int64
    first, labels = written["data_batch_1"]
    expected = torch.from_numpy(first.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
    assert torch.equal(split.x_train[:4], expected)
    assert split.y_train[:4].tolist() == labels
    assert split.y_test.tolist() == written["test_batch"][1]
    assert 0.0 <= split.x_train.min() and split.x_train.max() <= 1.0


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None,
    reason="torchvision installed: 'auto' would use it, and it MD5-checks the fake files",
)
def test_cifar_auto_backend_without_torchvision(tmp_path):
    _write_fake_cifar(tmp_path / "cifar-10-batches-py")
    assert load_cifar10(tmp_path).x_train.shape == (20, 3, 32, 32)


def test_cifar_rejects_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="'tf'"):
        load_cifar10(tmp_path, backend="tf")


# ---------------------------------------------------------------- models
@pytest.mark.parametrize(
    "name, kwargs, shape",
    [
        ("digits_cnn", {"width": 4}, (5, 1, 8, 8)),
        ("mlp", {"in_features": 64, "hidden": (16, 8)}, (5, 1, 8, 8)),
        ("mlp", {"in_features": 64, "hidden": ()}, (5, 64)),
        ("cifar_cnn", {"width": 4}, (5, 3, 32, 32)),
        ("resnet18", {"width": 4}, (5, 3, 32, 32)),
        ("resnet18", {"width": 4, "in_channels": 1, "num_classes": 7}, (5, 1, 32, 32)),
    ],
)
def test_build_model_forward_shapes(name, kwargs, shape):
    model = build_model(name, **kwargs)
    assert isinstance(model, MODELS[name])
    assert model(torch.randn(shape)).shape == (5, kwargs.get("num_classes", 10))


def test_build_model_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="'resnet9'.*digits_cnn"):
        build_model("resnet9")


def test_count_parameters_and_deterministic_init():
    mlp = MLP(64, hidden=(16,), classes=10)
    assert count_parameters(mlp) == 64 * 16 + 16 + 16 * 10 + 10
    mlp.net[1].bias.requires_grad_(False)
    assert count_parameters(mlp, trainable_only=True) == count_parameters(mlp) - 16
    for cls in (DigitsCNN, CifarCNN):
        torch.manual_seed(7)
        a = cls()
        torch.manual_seed(7)
        b = cls()
        assert all(torch.equal(p, q)
                   for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_resnet18_parameter_count_structure_and_pruning():
    # The usual CIFAR ResNet-18 (3x3 stem, BasicBlocks [2, 2, 2, 2], widths 64..512): 11.17 M.
    assert count_parameters(ResNet18()) == 11_173_962
    # Convolutions scale with width**2: width 32 on 1-channel digits is the benchmark's size.
    model = ResNet18(width=32, in_channels=1)
    assert count_parameters(model) == 2_797_034
    blocks = [m for m in model.modules() if type(m).__name__ == "BasicBlock"]
    assert len(blocks) == 8
    assert [m.out_channels for m in model.modules() if isinstance(m, torch.nn.Conv2d)
            and m.kernel_size == (1, 1)] == [64, 128, 256]  # one projection per new stage
    bn = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bn) == 1 + 8 * 2 + 3
    # Pruning leaves BatchNorm affines (and the fc bias) dense: only conv and fc weights.
    prunable = named_prunable_parameters(model)
    assert all(name.endswith("weight") and p.dim() > 1 for name, p in prunable.items())
    assert not any(p is m.weight for m in bn for p in prunable.values())
    masks = prune(model, 0.8)
    kept = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    assert kept == total - round(0.8 * total)
    assert all(torch.all(m.weight != 0) for m in bn if m.weight is not None)
    with pytest.raises(ValueError, match="width must be a positive int, got 0"):
        ResNet18(width=0)


def test_training_job_runs_resnet18_on_digits32(tmp_path):
    """``pacmpi train --dataset digits32`` defaults to the ResNet-18 with one input channel and
    takes real PacTrain steps with it (one process: an MPI singleton)."""
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "pacmpi.experiments.train",
                           "--dataset", "digits32", "--width", "4", "--pretrain-epochs", "0",
                           "--epochs", "1",
                           "--max-steps", "2", "--ratio", "0.5", "--no-progress", "--json",
                           str(out)], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "resnet18"
    assert result["parameters"] == count_parameters(ResNet18(width=4, in_channels=1))
    assert len(result["steps"]) == 2 and result["summary"]["packed_reductions"] > 0
    assert result["density"] < 0.6  # pruned: conv and fc weights at half, BN and biases dense


def test_digits_cnn_learns_real_digits(digits):
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(3):
        for x, y in iterate_minibatches(digits.x_train, digits.y_train, 64, seed=0, epoch=epoch):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(digits.x_test).argmax(1) == digits.y_test).float().mean().item()
    assert accuracy > 0.9
