"""Small, offline data sets and data-parallel helpers.

* :func:`load_digits_split` -- scikit-learn's 8x8 handwritten digits (ships with
  scikit-learn, no download): real data that trains in seconds on a CPU.
* :func:`load_digits32_split` -- the same digits, upscaled to 32x32 (bilinear), for models
  built for CIFAR-sized inputs (the CIFAR-style ResNet-18).
* :func:`load_cifar10` -- CIFAR-10 from a local copy (never downloads).
* :func:`shard` -- disjoint, equal-size per-rank shards (remainder dropped, so every rank
  takes the same number of steps and collective calls stay matched).
* :func:`iterate_minibatches` -- shuffled minibatches, deterministic per ``(seed, epoch)``.
* :func:`cache_dir` -- where the lab caches what it makes once.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

__all__ = ["DataSplit", "cache_dir", "iterate_minibatches", "load_cifar10",
           "load_digits32_split", "load_digits_split", "shard"]

CIFAR10_BATCHES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5")
_CIFAR10_TEST = "test_batch"
_CIFAR10_DIR = "cifar-10-batches-py"


class DataSplit(NamedTuple):
    """Train/test tensors: images float32 ``(N, C, H, W)`` in [0, 1], labels int64 ``(N,)``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def cache_dir() -> Path:
    """Where the lab keeps what it makes once and reuses (pretrained models, mined data):
    ``$XDG_CACHE_HOME/pacmpi``, else ``~/.cache/pacmpi``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pacmpi"


def load_digits_split(test_fraction: float = 0.25, seed: int = 0) -> DataSplit:
    """scikit-learn ``load_digits`` (1797 images, 10 classes) as a stratified split.

    Args:
        test_fraction: fraction in (0, 1) of the samples held out for testing.
        seed: ``random_state`` of the split; the same seed gives the same split.

    Pixels (integers 0..16) are divided by 16, images are shaped ``(N, 1, 8, 8)``. The split
    is kept in :func:`cache_dir` (one file per split and scikit-learn version) and read from
    there next time: importing scikit-learn costs every rank of every job a second or two,
    more than a short run's training.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    from importlib.metadata import version

    path = cache_dir() / f"digits-{test_fraction!r}-{seed}-sklearn-{version('scikit-learn')}.pt"
    try:
        saved = torch.load(path, weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError):
        saved = None  # not cached yet, or not a file torch wrote: split again
    if isinstance(saved, list) and len(saved) == 4 and all(map(torch.is_tensor, saved)):
        return DataSplit(*saved)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                              stratify=y)
    split = DataSplit(*(torch.from_numpy(np.ascontiguousarray(a))
                        for a in (x_tr, y_tr, x_te, y_te)))
    from pacmpi.adapters.checkpoint import atomic_save

    try:  # ranks that write it at once each rename a whole file; a read-only home: not kept
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(list(split), path)
    except OSError:
        pass
    return split


def load_digits32_split(test_fraction: float = 0.25, seed: int = 0) -> DataSplit:
    """:func:`load_digits_split` (the same split for the same seed) with every image upscaled
    from 8x8 to 32x32: images ``(N, 1, 32, 32)`` float32 in [0, 1].

    Upscaling is bilinear (``torch.nn.functional.interpolate``, ``align_corners=False``, no
    antialiasing), which is deterministic on the CPU; each output pixel is a convex
    combination of input pixels, so values stay in [0, 1].
    """
    split = load_digits_split(test_fraction=test_fraction, seed=seed)
    up = [torch.nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
          for x in (split.x_train, split.x_test)]
    return DataSplit(up[0].contiguous(), split.y_train, up[1].contiguous(), split.y_test)


Shardable = Union[torch.Tensor, Sequence[torch.Tensor], Dataset]


def shard(dataset_or_tensors: Shardable, rank: int, size: int):
    """This rank's shard for data parallelism.

    Rank ``r`` of ``size`` gets items ``r, r + size, r + 2*size, ...`` (strided, like
    ``DistributedSampler``, so a class-sorted input still gives every rank a mix),
    truncated to ``len // size`` items: shards are disjoint and of equal size, and the
    remainder is dropped. Accepts a tensor, a tuple/list of tensors of equal length
    (returned as a tuple) or a map-style ``Dataset`` (returned as a ``Subset``).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")
    n = _length(dataset_or_tensors)
    per_rank = n // size
    if per_rank == 0:
        raise ValueError(f"{n} items cannot give each of {size} ranks at least one")
    indices = torch.arange(rank, per_rank * size, size)
    if torch.is_tensor(dataset_or_tensors):
        return dataset_or_tensors[indices.to(dataset_or_tensors.device)]
    if isinstance(dataset_or_tensors, (tuple, list)):
        return tuple(t[indices.to(t.device)] for t in dataset_or_tensors)
    return Subset(dataset_or_tensors, indices.tolist())


def _length(data: Shardable) -> int:
    if isinstance(data, (tuple, list)):
        lengths = {len(t) for t in data}
        if len(lengths) != 1:
            raise ValueError(f"tensors to shard must have the same length, got {sorted(lengths)}")
        return lengths.pop()
    return len(data)


def iterate_minibatches(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Iterator[tuple]:
    """Yield ``(x_batch, y_batch)``; the order depends only on ``(seed, epoch)``.

    Args:
        batch_size: items per batch (the last one may be smaller unless ``drop_last``).
        seed, epoch: seed the permutation (NumPy ``SeedSequence([seed, epoch])``), so a
            run is reproducible and each epoch gets a different order.
        shuffle: ``False`` keeps the input order.
        drop_last: drop a final incomplete batch.
    """
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} != {len(y)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = len(x)
    if shuffle:
        order = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(n))
    else:
        order = torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start : start + batch_size]
        yield x[idx.to(x.device)], y[idx.to(y.device)]


def _cifar_root(data_dir: Union[str, Path]) -> Path:
    """``data_dir/cifar-10-batches-py``, or ``data_dir`` itself if it holds the batches."""
    data_dir = Path(data_dir)
    for candidate in (data_dir / _CIFAR10_DIR, data_dir):
        if all((candidate / name).is_file() for name in (*CIFAR10_BATCHES, _CIFAR10_TEST)):
            return candidate
    raise FileNotFoundError(
        f"CIFAR-10 not found under {str(data_dir)!r}: expected {_CIFAR10_DIR}/ with "
        f"{', '.join(CIFAR10_BATCHES)} and {_CIFAR10_TEST} (the python version from "
        "https://www.cs.toronto.edu/~kriz/cifar.html); nothing is downloaded"
    )


def _read_cifar_batches(root: Path, names: Sequence[str]) -> tuple:
    images, labels = [], []
    for name in names:
        with open(root / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


def _read_with_torchvision(data_dir: Path, train: bool) -> tuple:
    import torchvision

    ds = torchvision.datasets.CIFAR10(root=str(data_dir), train=train, download=False)
    return (np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)),
            np.asarray(ds.targets, dtype=np.int64))


def load_cifar10(data_dir: Union[str, Path], backend: str = "auto") -> DataSplit:
    """CIFAR-10 from a local copy: 50000/10000 images ``(N, 3, 32, 32)`` float32 in [0, 1].

    Args:
        data_dir: directory holding ``cifar-10-batches-py/`` (torchvision's ``root``),
            or that folder itself.
        backend: ``"torchvision"`` uses ``torchvision.datasets.CIFAR10(download=False)``
            (which also verifies the files' MD5 sums); ``"pickle"`` reads the python
            batches with NumPy; ``"auto"`` uses torchvision when installed, else pickle.

    Raises ``FileNotFoundError`` naming the directory when the batches are missing.
    """
    if backend not in ("auto", "torchvision", "pickle"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torchvision' or 'pickle'")
    root = _cifar_root(data_dir)
    if backend == "auto":
        # torchvision insists on the ``<root>/cifar-10-batches-py`` layout.
        backend = "torchvision" if _has_torchvision() and root.name == _CIFAR10_DIR else "pickle"
    if backend == "torchvision":
        if root.name != _CIFAR10_DIR:
            raise ValueError(f"backend='torchvision' needs the batches in a {_CIFAR10_DIR}/ "
                             f"folder, got {str(root)!r}")
        (x_tr, y_tr), (x_te, y_te) = (_read_with_torchvision(root.parent, train)
                                      for train in (True, False))
    else:
        (x_tr, y_tr), (x_te, y_te) = (_read_cifar_batches(root, CIFAR10_BATCHES),
                                      _read_cifar_batches(root, [_CIFAR10_TEST]))
    return DataSplit(_to_unit_float(x_tr), torch.from_numpy(y_tr), _to_unit_float(x_te),
                     torch.from_numpy(y_te))


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401  (only probing whether it is installed)
    except ImportError:
        return False
    return True


def _to_unit_float(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).float().div_(255.0)
