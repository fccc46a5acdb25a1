"""The zoo's plain convolutional networks: AlexNet and ResNet-18/50/101, torchvision-equivalent.

Layer names and parameter shapes match torchvision (a torchvision state_dict loads), so parameter counts
are the published ones. Differences, all parameter-free: ReLUs are not in-place, and every ReLU call
site is its own module (`relu1`, `relu2`, ...) so that each captured operator has a distinct module path.
Dropout defaults to p=0 so that distributed and single-process training draw no random masks.
Not imported by anything outside `soapflow`.
"""

from __future__ import annotations

import torch
from torch import nn


class AlexNet(nn.Module):
    """torchvision's AlexNet (Krizhevsky 2014 one-GPU variant), 61,100,840 parameters at 1000 classes."""

    def __init__(self, *, num_classes: int = 1000, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a residual add (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, "ResNet v1.5"), 1x1 expand by 4, residual add (ResNet-50+)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.downsample = downsample
        self.relu3 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + identity)


class ResNet(nn.Module):
    """He et al. 2016 ImageNet ResNet: 7x7 stem, four stages of residual blocks, global pool, classifier."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: tuple[int, int, int, int], *,
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block: type[BasicBlock | Bottleneck], planes: int, num_blocks: int,
                    stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        blocks = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        blocks += [block(self.inplanes, planes) for _ in range(1, num_blocks)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def image_batch(batch_size: int, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`images[N, 3, S, S]` float32 and `labels[N]` long, on the meta device."""
    images = torch.empty(batch_size, 3, image_size, image_size, device="meta")
    labels = torch.empty(batch_size, dtype=torch.long, device="meta")
    return images, labels


def alexnet(batch_size: int = 256, *, num_classes: int = 1000, image_size: int = 224,
            dropout: float = 0.0) -> tuple:
    """AlexNet on 224x224 RGB images with integer class labels (cross-entropy loss)."""
    return AlexNet(num_classes=num_classes, dropout=dropout), image_batch(batch_size, image_size)


def resnet18(batch_size: int = 64, *, num_classes: int = 1000, image_size: int = 224) -> tuple:
    """ResNet-18, 11,689,512 parameters at 1000 classes."""
    module = ResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes)
    return module, image_batch(batch_size, image_size)


def resnet50(batch_size: int = 64, *, num_classes: int = 1000, image_size: int = 224) -> tuple:
    """ResNet-50, 25,557,032 parameters at 1000 classes."""
    module = ResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes)
    return module, image_batch(batch_size, image_size)


def resnet101(batch_size: int = 64, *, num_classes: int = 1000, image_size: int = 224) -> tuple:
    """ResNet-101, 44,549,160 parameters at 1000 classes."""
    module = ResNet(Bottleneck, (3, 4, 23, 3), num_classes=num_classes)
    return module, image_batch(batch_size, image_size)
