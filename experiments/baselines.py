"""The compression baselines a reviewer asks PacTrain to be compared with, run as their authors
ran them, for raw PyTorch loops over mpi4py (the same hooks as
:class:`TopKSync`):

- :class:`TernGradSync` (Wen et al., NeurIPS 2017): every rank clips each layer's gradient at
  ``clip`` standard deviations, stochastically ternarizes it with its *own* per-layer scale
  ``s = max |g|`` (``P(q = sign g) = |g| / s``, so ``E[s q] = g``), and the 2-bit codes plus the
  scales are **all-gathered**; every rank decodes every rank's codes and averages. Each rank
  sends 2 bits per value (4 codes per byte) and one float per layer, whatever the world size;
  no error feedback (the estimator is unbiased).
- :class:`DGCSync` (Lin et al., ICLR 2018, Deep Gradient Compression): momentum correction
  (each rank keeps its velocity ``u = m u + g`` and accumulates ``v += u``), per-layer TopK of
  ``|v|`` (``ratio`` of each layer, at least one value), the sent coordinates cleared from
  ``v`` (local gradient accumulation: ``v`` is the residual) and, with ``momentum_masking``,
  from ``u``; (index, value) pairs are all-gathered and summed. The momentum lives here, so
  the optimizer must be plain SGD without momentum. Not implemented: DGC's warm-up of the
  sparsity over the first epochs and its sampled threshold (the exact TopK is used).

Both need every parameter in one dtype and move their (small) payloads through host memory.
"""
import time

import numpy as np
import torch

from pacmpi import MPICollectives
from pacmpi.adapters.torch_sync import HookedSync, PacTrainSync
from pacmpi.costmodel import topk_count
from pacmpi.faults import ensure_abort_on_error
from pacmpi.methods import lookup_method
from pacmpi.ternary import pack_codes, unpack_codes

__all__ = ["DGCSync", "TernGradSync", "TopKSync", "make_baseline", "make_sync"]


def sparsify(accumulated, sizes, ks):
    """DGC's selection on one rank: per segment ``j`` of the flat ``accumulated`` (segments of
    ``sizes[j]`` values), the ``ks[j]`` largest magnitudes. Returns ``(indices, values)`` (int64
    flat indices, the selected values) and clears them in ``accumulated`` in place, which then
    holds the residual: ``residual + scatter(values) == accumulated`` exactly."""
    chosen, offset = [], 0
    for size, k in zip(sizes, ks):
        segment = accumulated[offset:offset + size]
        chosen.append(torch.topk(segment.abs(), k, sorted=False).indices + offset)
        offset += size
    indices = torch.cat(chosen)
    values = accumulated[indices].clone()
    accumulated[indices] = 0
    return indices, values


class _GatherSync(HookedSync):
    """What the all-gather baselines share: one flat gradient of the model per step, an
    ``Allgather`` of a fixed-size payload per rank, the decoded average written back into
    ``p.grad``, and the counters :class:`TopKSync` keeps."""

    def __init__(self, model, method, *, comm, masks, average, abort_on_error):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD.Dup()
        super().__init__(model, masks, MPICollectives(comm=comm), method)
        ensure_abort_on_error(abort_on_error, size=self.collectives.size)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TypeError(f"{type(self).__name__} needs parameters of one dtype, got "
                            f"{sorted(map(str, dtypes))}")
        self.comm, self.average = comm, bool(average)
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self.stats = {"steps": 0, "bytes_sent": 0, "dense_elements_equivalent": 0,
                      "packed_reductions": 0, "dense_reductions": 0, "dense_fallbacks": 0,
                      "resyncs": 0, "verify_seconds": 0.0, "pack_seconds": 0.0,
                      "comm_seconds": 0.0, "unpack_seconds": 0.0}

    def _gather(self, *arrays):
        """Each of ``arrays`` (1-d NumPy, equal size on every rank) from every rank, as
        ``(size, n)`` arrays; counts the bytes this rank sent."""
        started = time.perf_counter()
        out = []
        for array in arrays:
            recv = np.empty((self.collectives.size, array.size), dtype=array.dtype)
            self.comm.Allgather(array, recv)
            out.append(recv)
            self.stats["bytes_sent"] += array.nbytes
        self.stats["comm_seconds"] += time.perf_counter() - started
        return out

    def _write_back(self, total):
        """``total`` (the sum over ranks, flat) averaged into every ``p.grad``."""
        if self.average and self.collectives.size > 1:
            total /= self.collectives.size
        offset = 0
        for p, size in zip(self.params, self.sizes):
            p.grad.copy_(total[offset:offset + size].view_as(p.grad))
            offset += size
        self.stats["dense_elements_equivalent"] += self.numel
        self.stats["packed_reductions"] += 1
        self.stats["steps"] += 1


class TernGradSync(_GatherSync):
    """TernGrad (see the module doc). ``seed``: each rank draws from its own generator keyed by
    (``seed``, rank); ``clip``: clip each layer at ``clip`` standard deviations of its gradient
    before ternarizing (2.5 in the paper; ``None``: no clipping). ``model``, ``comm``, ``masks``,
    ``average``, ``abort_on_error`` as for :class:`TopKSync`."""

    def __init__(self, model, *, comm=None, masks=None, seed=0, clip=2.5, average=True,
                 abort_on_error=None):
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be positive or None, got {clip!r}")
        super().__init__(model, "terngrad", comm=comm, masks=masks, average=average,
                         abort_on_error=abort_on_error)
        self.clip, self.seed = clip, int(seed)
        self._generator = torch.Generator().manual_seed(self.seed * 1_000_003
                                                        + self.collectives.rank)
        self._segments = torch.tensor(self.sizes)

    def reduce_grads(self, arrays):
        started = time.perf_counter()
        with torch.no_grad():
            grads = [p.grad.detach().reshape(-1).cpu() for p in self.params]
            if self.clip is not None:
                grads = [self._clipped(g) for g in grads]
            scales = torch.stack([g.abs().max() for g in grads])
            flat = torch.cat(grads)
            per_value = torch.repeat_interleave(scales, self._segments)
            probability = flat.abs() / torch.where(per_value > 0, per_value, 1)
            keep = torch.rand(self.numel, generator=self._generator) < probability
            q = (torch.sign(flat) * keep).to(torch.int8).numpy()
            packed = pack_codes(q)
        self.stats["pack_seconds"] += time.perf_counter() - started
        all_packed, all_scales = self._gather(packed, scales.numpy())
        started = time.perf_counter()
        with torch.no_grad():
            codes = torch.from_numpy(unpack_codes(all_packed, self.numel))
            per_rank = torch.repeat_interleave(torch.from_numpy(all_scales), self._segments, dim=1)
            # int8 codes times the scale: exact, so the sum only rounds where the scales do.
            total = (codes.to(per_rank.dtype) * per_rank).sum(0)
            self._write_back(total.to(self.params[0].device))
        self.stats["unpack_seconds"] += time.perf_counter() - started

    def _clipped(self, g):
        bound = self.clip * g.std(unbiased=False)
        # A constant layer has no spread: clipping it at 0 would erase it.
        return g.clamp(-bound, bound) if bound > 0 else g

    def engine_state(self):
        return {"generator": self._generator.get_state(), "stats": dict(self.stats)}

    def load_engine_state(self, state, same_world):
        if same_world:  # another world size re-keys every rank's stream from the seed
            self._generator.set_state(state["generator"])
        self.stats = dict(state["stats"])


class DGCSync(_GatherSync):
    """Deep Gradient Compression (see the module doc). ``ratio``: kept fraction of each layer
    (0.001 = 0.1%, at least one value per layer); ``momentum``: the momentum DGC corrects for
    (the optimizer then runs without momentum); ``momentum_masking``: clear the sent
    coordinates from the velocity too, as the paper does. ``model``, ``comm``, ``masks``,
    ``average``, ``abort_on_error`` as for :class:`TopKSync`.

    State (per rank): ``velocity`` (``u``) and ``residual`` (``v``, the accumulated values not
    sent yet), flat over the model's parameters."""

    def __init__(self, model, *, comm=None, masks=None, ratio=0.001, momentum=0.9,
                 momentum_masking=True, average=True, abort_on_error=None):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        super().__init__(model, "dgc", comm=comm, masks=masks, average=average,
                         abort_on_error=abort_on_error)
        self.ratio, self.momentum = float(ratio), float(momentum)
        self.momentum_masking = bool(momentum_masking)
        self.ks = [topk_count(self.ratio, size) for size in self.sizes]
        self.velocity = self.residual = None

    def reduce_grads(self, arrays):
        started = time.perf_counter()
        with torch.no_grad():
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            if self.velocity is None:
                self.velocity, self.residual = torch.zeros_like(flat), torch.zeros_like(flat)
            self.velocity.mul_(self.momentum).add_(flat)
            self.residual.add_(self.velocity)
            indices, values = sparsify(self.residual, self.sizes, self.ks)
            if self.momentum_masking:
                self.velocity[indices] = 0
            send_i, send_v = indices.cpu().numpy(), values.cpu().numpy()
        self.stats["pack_seconds"] += time.perf_counter() - started
        recv_i, recv_v = self._gather(send_i, send_v)
        started = time.perf_counter()
        with torch.no_grad():
            total = torch.zeros_like(flat)
            total.index_add_(0, torch.from_numpy(recv_i.reshape(-1)).to(flat.device),
                             torch.from_numpy(recv_v.reshape(-1)).to(flat.device))
            self._write_back(total)
        self.stats["unpack_seconds"] += time.perf_counter() - started

    def engine_state(self):
        residuals = {} if self.residual is None else {
            "velocity": self.velocity.detach().cpu().clone(),
            "residual": self.residual.detach().cpu().clone()}
        return {"residuals": residuals, "stats": dict(self.stats), "ks": self.ks}

    def load_engine_state(self, state, same_world):
        if state["ks"] != self.ks:
            raise ValueError(f"checkpoint keeps {state['ks']} values per layer, this sync "
                             f"keeps {self.ks}")
        saved = state["residuals"] if same_world else {}
        device = self.params[0].device
        self.velocity = saved["velocity"].to(device).clone() if saved else None
        self.residual = saved["residual"].to(device).clone() if saved else None
        self.stats = dict(state["stats"])


def make_baseline(model, method, *, comm=None, masks=None, ratio=0.001, momentum=0.9, seed=0,
                  **kwargs):
    """A :class:`TernGradSync` (``"terngrad"``: ``seed``) or :class:`DGCSync` (``"dgc"``:
    ``ratio``, ``momentum``); ``kwargs`` go to the class."""
    if lookup_method(method, ("terngrad", "dgc")).name == "terngrad":
        return TernGradSync(model, comm=comm, masks=masks, seed=seed, **kwargs)
    return DGCSync(model, comm=comm, masks=masks, ratio=ratio, momentum=momentum, **kwargs)


# ---------------------------------------------------------------------------------- TopK
class TopKSync(HookedSync):
    """TopK sparsification with error feedback: the compression baseline PacTrain is compared
    with. Each rank adds its residual to its (masked) gradient, keeps the ``ratio`` largest
    magnitudes of the whole model (at least one), remembers the rest as its new residual, and
    all ranks all-gather (indices, values) and scatter-add them. Indices and values travel
    through host memory (they are small); nothing overlaps with backward, since a global TopK
    needs the whole gradient.

    Parameters: ``model``, ``comm``, ``masks``, ``average`` as for :class:`PacTrainSync`;
    ``ratio`` the kept fraction (0.01 = 1%); ``error_feedback`` keeps the residual;
    ``abort_on_error`` as for :class:`PacTrainSync`.
    """

    def __init__(self, model, *, comm=None, masks=None, ratio=0.01, average=True,
                 error_feedback=True, abort_on_error=None):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD.Dup()
        super().__init__(model, masks, MPICollectives(comm=comm), "topk")
        ensure_abort_on_error(abort_on_error, size=self.collectives.size)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TypeError(
                f"TopKSync needs parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.comm, self.ratio = comm, float(ratio)
        self.average, self.error_feedback = bool(average), bool(error_feedback)
        self.numel = sum(p.numel() for p in self.params)
        self.k = topk_count(self.ratio, self.numel)
        self._residual = None
        self.stats = {"steps": 0, "bytes_sent": 0, "dense_elements_equivalent": 0,
                      "packed_reductions": 0, "dense_reductions": 0, "dense_fallbacks": 0,
                      "resyncs": 0, "verify_seconds": 0.0, "pack_seconds": 0.0,
                      "comm_seconds": 0.0, "unpack_seconds": 0.0}

    def reduce_grads(self, arrays):
        started = time.perf_counter()
        grads = [p.grad for p in self.params]
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.error_feedback and self._residual is not None:
                flat += self._residual
            indices = torch.topk(flat.abs(), self.k, sorted=False).indices
            values = flat[indices]
            if self.error_feedback:
                flat[indices] = 0
                self._residual = flat
            send_i = indices.to(torch.int64).cpu().numpy()
            send_v = values.cpu().numpy()
            recv_i = np.empty(self.k * self.collectives.size, dtype=send_i.dtype)
            recv_v = np.empty(self.k * self.collectives.size, dtype=send_v.dtype)
            self.stats["pack_seconds"] += time.perf_counter() - started
            started = time.perf_counter()
            self.comm.Allgather(send_i, recv_i)
            self.comm.Allgather(send_v, recv_v)
            self.stats["comm_seconds"] += time.perf_counter() - started
            started = time.perf_counter()
            device = grads[0].device
            total = torch.zeros(self.numel, dtype=grads[0].dtype, device=device)
            total.index_add_(0, torch.from_numpy(recv_i).to(device),
                             torch.from_numpy(recv_v).to(device))
            if self.average and self.collectives.size > 1:
                total /= self.collectives.size
            offset = 0
            for g in grads:
                g.copy_(total[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            self.stats["unpack_seconds"] += time.perf_counter() - started
        self.stats["bytes_sent"] += send_i.nbytes + send_v.nbytes
        self.stats["dense_elements_equivalent"] += self.numel
        self.stats["packed_reductions"] += 1
        self.stats["steps"] += 1

    def engine_state(self):
        residuals = {} if self._residual is None else {0: self._residual.detach().cpu().clone()}
        return {"residuals": residuals, "stats": dict(self.stats), "k": self.k}

    def load_engine_state(self, state, same_world):
        if state["k"] != self.k:
            raise ValueError(f"checkpoint has k={state['k']}, this sync keeps k={self.k}")
        residual = state["residuals"].get(0) if same_world else None
        self._residual = None if residual is None else residual.to(self.params[0].device).clone()
        self.stats = dict(state["stats"])


def make_sync(model, method, *, comm=None, masks=None, topk_ratio=0.01, **kwargs):
    """A :class:`TopKSync` for ``method="topk"``, else a :class:`PacTrainSync`; ``kwargs`` go to
    :class:`PacTrainSync` (ignored knobs of the other class are an error, not silently dropped)."""
    if method == "topk":
        return TopKSync(model, comm=comm, masks=masks, ratio=topk_ratio, **kwargs)
    return PacTrainSync(model, comm=comm, masks=masks, method=method, **kwargs)
