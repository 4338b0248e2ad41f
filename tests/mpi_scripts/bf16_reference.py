"""What the bf16 scenario modules share: a model that mixes dtypes as bf16 models do, and the
reference for reduced low-precision gradients, every order in which a transport may add the
ranks' values (one rounding per addition).

A transport's order depends on where a coordinate sits in the payload (gloo's ring: each
quarter of a 4-rank payload is summed in another rotation of the ranks), so packed and dense
payloads, or DDP buckets of other sizes, may add a coordinate's values in different orders. At
2 ranks every order gives the one rounding of ``a + b``.
"""
import functools
import itertools

import torch
from torch import nn


class MixedBF16(nn.Module):
    """bfloat16 Linear -> float32 LayerNorm -> bfloat16 Linear (DDP and pacmpi bucket each
    dtype apart)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(24, 32, dtype=torch.bfloat16)
        self.norm = nn.LayerNorm(32)
        self.b = nn.Linear(32, 8, dtype=torch.bfloat16)

    def forward(self, x):
        return self.b(self.norm(self.a(x).float()).to(torch.bfloat16))


def order_sums(values):
    """Every result of adding the same-shape tensors ``values`` (one per rank) pairwise in
    their dtype, in any order and grouping (at 4 ranks, 15)."""
    @functools.cache
    def sums(group):
        if len(group) == 1:
            return (values[group[0]],)
        first, rest = group[0], group[1:]
        found = []
        for k in range(len(rest)):  # the group that holds `first` takes k of the rest
            for taken in itertools.combinations(rest, k):
                other = tuple(i for i in rest if i not in taken)
                found += [a + b for a in sums((first, *taken)) for b in sums(other)]
        return tuple(found)

    return sums(tuple(range(len(values))))


def in_some_order(result, values, divisor=1):
    """Where ``result`` equals ``sum(values) / divisor`` added in some order (bool tensor);
    ``divisor`` a power of two, so dividing is exact."""
    hit = torch.zeros(result.shape, dtype=torch.bool, device=result.device)
    for total in order_sums(values):
        hit |= result == total / divisor
    return hit
