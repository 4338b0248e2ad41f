"""Small models for CPU-sized PacTrain experiments and tests.

All models use PyTorch's default initialisation, so ``torch.manual_seed(s)`` before
construction gives identical weights (what data-parallel ranks rely on before the
initial broadcast). Each contains BatchNorm layers (except :class:`MLP`) so that the
pruning defaults (norm layers and biases are never pruned) are exercised; ``MODELS["resnet18"]``
is a CIFAR-style ResNet-18 (:class:`ResNet18`), the larger workload of ``pacmpi bench train``;
``MODELS["minilm"]`` is the pretrained all-MiniLM-L6-v2 as a dual encoder
(:mod:`pacmpi.experiments.codesearch`), the text workload.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["BasicBlock", "CifarCNN", "DigitsCNN", "MLP", "MODELS", "PRETRAINED_MODELS",
           "ResNet18", "build_model", "count_parameters"]


class DigitsCNN(nn.Module):
    """CNN for ``(N, 1, 8, 8)`` digits: two 3x3 convs (+BatchNorm, ReLU), 2x2 max-pool,
    then a two-layer classifier.

    Args:
        width: channels of the first conv (the second has ``2 * width``).
        hidden: units of the hidden fully connected layer.
        classes: number of output logits.
    """

    def __init__(self, width: int = 16, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Fully connected ReLU network on flattened inputs.

    Args:
        in_features: input size after flattening (64 for 8x8 digits).
        hidden: sizes of the hidden layers (may be empty: a linear classifier).
        classes: number of output logits.
    """

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (128,), classes: int = 10):
        super().__init__()
        layers: list = [nn.Flatten()]
        sizes = [in_features, *hidden]
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _conv_block(fan_in: int, fan_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(fan_in, fan_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(fan_out),
        nn.ReLU(),
        nn.Conv2d(fan_out, fan_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(fan_out),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class CifarCNN(nn.Module):
    """VGG-style CNN for ``(N, 3, 32, 32)``: three blocks of two 3x3 convs (+BatchNorm,
    ReLU) and a 2x2 max-pool, global average pooling, one linear layer.

    Args:
        width: channels of the first block (then ``2 * width``, ``4 * width``).
        classes: number of output logits.
    """

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            _conv_block(3, width), _conv_block(width, 2 * width), _conv_block(2 * width, 4 * width)
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs (+BatchNorm), ReLU, identity shortcut, or a strided
    1x1 conv (+BatchNorm) when the block changes resolution or width."""

    def __init__(self, fan_in: int, fan_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(fan_in, fan_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(fan_out)
        self.conv2 = nn.Conv2d(fan_out, fan_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(fan_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or fan_in != fan_out:
            self.shortcut = nn.Sequential(nn.Conv2d(fan_in, fan_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18 for ``(N, in_channels, 32, 32)``: a 3x3 stem conv (stride 1, no
    max-pool, as for CIFAR rather than ImageNet's 7x7 stem), four stages of two
    :class:`BasicBlock` each with ``width, 2*width, 4*width, 8*width`` channels (stages 2-4
    halve the resolution), global average pooling, one linear layer. ``width=64`` is the
    usual CIFAR ResNet-18 (11.17 M parameters with 3 input channels and 10 classes); the
    parameter count scales with ``width ** 2``.

    Args:
        width: channels of the stem and of the first stage.
        in_channels: input image channels (1 for digits, 3 for CIFAR-10).
        num_classes: number of output logits.
    """

    def __init__(self, width: int = 64, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        for name, value in (("width", width), ("in_channels", in_channels),
                            ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        stages, fan_in = [], width
        for i in range(4):
            fan_out = width << i
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(fan_in, fan_out, stride),
                                        BasicBlock(fan_out, fan_out)))
            fan_in = fan_out
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(fan_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def _minilm(**kwargs) -> nn.Module:
    # transformers loads in seconds: only when asked for
    from pacmpi.experiments.codesearch import DualEncoder

    return DualEncoder(**kwargs)


MODELS = {"digits_cnn": DigitsCNN, "mlp": MLP, "cifar_cnn": CifarCNN, "resnet18": ResNet18,
          "minilm": _minilm}
#: Models that arrive pretrained (their weights come from a package or the hub, not from
#: ``pacmpi train``'s dense pretraining): all-MiniLM-L6-v2 as a query/code dual encoder.
PRETRAINED_MODELS = ("minilm",)


def build_model(name: str, **kwargs) -> nn.Module:
    """Construct ``MODELS[name](**kwargs)``, e.g. ``build_model("digits_cnn", width=8)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    return MODELS[name](**kwargs)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
