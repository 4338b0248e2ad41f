"""Parameter shape tables of published architectures, for benchmarks at paper scale.

Written from the published architectures (torchvision's ResNet-50/152 and VGG19, BERT-base
uncased, GPT-2 124M with its output layer tied to the token embedding), in the order of the
models' ``named_parameters()``; BatchNorm running statistics are buffers, not gradients, and are
left out. Nothing is downloaded and no framework is imported: a benchmark needs only the shapes,
a mask and gradients of the right sizes.

:func:`magnitude_mask` prunes like :func:`pacmpi.adapters.pruning.prune`'s defaults (global
magnitude over every parameter of more than one dimension outside norm layers; biases and norm
affines stay dense) over seeded random-normal weights scaled per layer.
"""
from dataclasses import dataclass

import numpy as np

__all__ = ["MODELS", "model_params", "magnitude_mask", "random_weights"]


@dataclass(frozen=True)
class Param:
    """One parameter tensor: its name, shape and whether magnitude pruning may mask it."""

    name: str
    shape: tuple
    prunable: bool

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))


def _conv(name, out, inp, k, bias=False):
    params = [Param(f"{name}.weight", (out, inp, k, k), True)]
    return params + ([Param(f"{name}.bias", (out,), False)] if bias else [])


def _linear(name, out, inp, bias=True):
    return [Param(f"{name}.weight", (out, inp), True)] + (
        [Param(f"{name}.bias", (out,), False)] if bias else [])


def _norm(name, width):
    return [Param(f"{name}.weight", (width,), False), Param(f"{name}.bias", (width,), False)]


def _resnet(blocks):
    """torchvision's ResNet with Bottleneck blocks (expansion 4, stride on the 3x3 conv)."""
    params = _conv("conv1", 64, 3, 7) + _norm("bn1", 64)
    inplanes = 64
    for stage, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512)), start=1):
        for block in range(count):
            prefix = f"layer{stage}.{block}"
            params += (_conv(f"{prefix}.conv1", width, inplanes, 1) + _norm(f"{prefix}.bn1", width)
                       + _conv(f"{prefix}.conv2", width, width, 3) + _norm(f"{prefix}.bn2", width)
                       + _conv(f"{prefix}.conv3", width * 4, width, 1)
                       + _norm(f"{prefix}.bn3", width * 4))
            if block == 0:
                params += (_conv(f"{prefix}.downsample.0", width * 4, inplanes, 1)
                           + _norm(f"{prefix}.downsample.1", width * 4))
            inplanes = width * 4
    return params + _linear("fc", 1000, 2048)


def _vgg19():
    """torchvision's vgg19 (configuration E, no batch norm, 224x224 input)."""
    params, inp, index = [], 3, 0
    for width in (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                  512, 512, 512, 512, "M", 512, 512, 512, 512, "M"):
        if width != "M":
            params += _conv(f"features.{index}", width, inp, 3, bias=True)
            inp = width
            index += 1  # the ReLU after each conv
        index += 1
    return (params + _linear("classifier.0", 4096, 512 * 7 * 7)
            + _linear("classifier.3", 4096, 4096) + _linear("classifier.6", 1000, 4096))


def _bert_base(vocab=30522, hidden=768, layers=12, intermediate=3072, positions=512):
    """BERT-base (uncased vocabulary) with its pooler, as Hugging Face's ``BertModel``."""
    params = [Param("embeddings.word_embeddings.weight", (vocab, hidden), True),
              Param("embeddings.position_embeddings.weight", (positions, hidden), True),
              Param("embeddings.token_type_embeddings.weight", (2, hidden), True)]
    params += _norm("embeddings.LayerNorm", hidden)
    for layer in range(layers):
        prefix = f"encoder.layer.{layer}"
        for part in ("query", "key", "value"):
            params += _linear(f"{prefix}.attention.self.{part}", hidden, hidden)
        params += (_linear(f"{prefix}.attention.output.dense", hidden, hidden)
                   + _norm(f"{prefix}.attention.output.LayerNorm", hidden)
                   + _linear(f"{prefix}.intermediate.dense", intermediate, hidden)
                   + _linear(f"{prefix}.output.dense", hidden, intermediate)
                   + _norm(f"{prefix}.output.LayerNorm", hidden))
    return params + _linear("pooler.dense", hidden, hidden)


def _gpt2_124m(vocab=50257, hidden=768, layers=12, positions=1024):
    """GPT-2 small as Hugging Face's ``GPT2LMHeadModel``: ``Conv1D`` weights are (in, out), and
    ``lm_head`` is the token embedding itself (tied), so it adds no gradient tensor."""
    params = [Param("transformer.wte.weight", (vocab, hidden), True),
              Param("transformer.wpe.weight", (positions, hidden), True)]
    for layer in range(layers):
        prefix = f"transformer.h.{layer}"
        params += (_norm(f"{prefix}.ln_1", hidden)
                   + [Param(f"{prefix}.attn.c_attn.weight", (hidden, 3 * hidden), True),
                      Param(f"{prefix}.attn.c_attn.bias", (3 * hidden,), False),
                      Param(f"{prefix}.attn.c_proj.weight", (hidden, hidden), True),
                      Param(f"{prefix}.attn.c_proj.bias", (hidden,), False)]
                   + _norm(f"{prefix}.ln_2", hidden)
                   + [Param(f"{prefix}.mlp.c_fc.weight", (hidden, 4 * hidden), True),
                      Param(f"{prefix}.mlp.c_fc.bias", (4 * hidden,), False),
                      Param(f"{prefix}.mlp.c_proj.weight", (4 * hidden, hidden), True),
                      Param(f"{prefix}.mlp.c_proj.bias", (hidden,), False)])
    return params + _norm("transformer.ln_f", hidden)


_BUILDERS = {
    "resnet50": lambda: _resnet((3, 4, 6, 3)),
    "resnet152": lambda: _resnet((3, 8, 36, 3)),
    "vgg19": _vgg19,
    "bert-base": _bert_base,
    "gpt2-124m": _gpt2_124m,
}
MODELS = tuple(_BUILDERS)

PUBLISHED_COUNTS = {"resnet50": 25_557_032, "resnet152": 60_192_808, "vgg19": 143_667_240,
                    "bert-base": 109_482_240, "gpt2-124m": 124_439_808}
"""Well-known parameter counts (torchvision's model cards; BERT-base with pooler; GPT-2 124M
with tied embeddings), which the shape tables must reproduce."""


def model_params(name):
    """The model's parameters (:class:`Param`), in ``named_parameters()`` order."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return _BUILDERS[name]()


def model_count(name):
    """Total number of parameter values (gradient elements) of the model."""
    return sum(p.size for p in model_params(name))


def random_weights(params, seed=0):
    """One flat float32 array of weights in ``params`` order: prunable tensors normal with
    standard deviation ``1/sqrt(fan_in)`` (fan_in: every dimension but the output one; GPT-2's
    (in, out) ``Conv1D`` weights are treated alike, since only the per-tensor scale matters),
    other tensors normal with standard deviation 0.01 around 0 (biases) or 1 (norm scales)."""
    rng = np.random.default_rng(seed)
    out = np.empty(sum(p.size for p in params), dtype=np.float32)
    offset = 0
    for p in params:
        view = out[offset:offset + p.size]
        rng.standard_normal(size=p.size, dtype=np.float32, out=view)
        if p.prunable:
            view *= np.float32(1.0 / np.sqrt(p.size // p.shape[0]))
        else:
            view *= np.float32(0.01)
            if p.name.endswith(".weight"):
                view += np.float32(1.0)
        offset += p.size
    return out


def magnitude_mask(params, weights, density):
    """Flat bool mask: exactly ``round(density * prunable values)`` of the prunable tensors'
    values with the largest ``|weight|`` over all of them (global magnitude; ties broken by
    position), and every value of the other tensors."""
    if not isinstance(density, (int, float, np.floating)) or not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    prunable = np.concatenate([np.full(p.size, p.prunable) for p in params])
    magnitudes = np.abs(weights[prunable])
    keep = int(round(density * magnitudes.size))
    kept = np.ones(magnitudes.size, dtype=bool)
    if keep < magnitudes.size:
        threshold = np.partition(magnitudes, magnitudes.size - keep)[magnitudes.size - keep]
        kept = magnitudes > threshold
        ties = np.flatnonzero(magnitudes == threshold)
        kept[ties[:keep - int(np.count_nonzero(kept))]] = True
    mask = ~prunable
    mask[prunable] = kept
    return mask
