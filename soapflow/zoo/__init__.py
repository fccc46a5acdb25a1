"""The model zoo: the FlexFlow paper's benchmark models plus an MLP, ResNets and a GPT-2 Transformer.

Owns the `ZooModel` record, the `ZOO` table the CLI resolves MODEL names against, and `get`. Each family
lives in its own module (`mlp`, `cnn`, `inception`, `rnn`, `transformer`) whose builder functions are
importable on their own and take keyword size options for small test versions. A builder takes the global
batch size and returns `(module, (inputs, target))` or `(module, (inputs, target), loss_fn)`: the module
is real (CPU, float32, default init), the example batch is on the meta device (shapes and dtypes only), and
integer inputs and labels are `torch.long`. Dropout everywhere defaults to p=0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from soapflow.zoo.cnn import alexnet, resnet18, resnet50, resnet101
from soapflow.zoo.inception import inception_v3
from soapflow.zoo.mlp import mlp
from soapflow.zoo.rnn import nmt, rnnlm, rnntc
from soapflow.zoo.transformer import transformer


@dataclass(frozen=True, slots=True, kw_only=True)
class ZooModel:
    """One zoo entry: `build(batch_size)` makes the model and its example batch at that global batch."""

    name: str
    build: Callable[[int], tuple]
    default_batch: int
    description: str

    def __post_init__(self) -> None:
        if self.default_batch < 1:
            raise ValueError(f"zoo model {self.name!r}: default_batch must be positive, "
                             f"got {self.default_batch}")


ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel(name="mlp", build=mlp, default_batch=64,
             description="MLP 1024-4096-1024 with ReLU, regression (mse)"),
    ZooModel(name="alexnet", build=alexnet, default_batch=256,
             description="AlexNet (Krizhevsky et al. 2012, torchvision variant), 224x224, 1000 classes"),
    ZooModel(name="resnet18", build=resnet18, default_batch=64,
             description="ResNet-18 (He et al. 2016), 224x224, 1000 classes"),
    ZooModel(name="resnet50", build=resnet50, default_batch=64,
             description="ResNet-50 (He et al. 2016), 224x224, 1000 classes"),
    ZooModel(name="resnet101", build=resnet101, default_batch=64,
             description="ResNet-101 (He et al. 2016), 224x224, 1000 classes"),
    ZooModel(name="inception_v3", build=inception_v3, default_batch=64,
             description="Inception-v3 (Szegedy et al. 2016) without aux head, 299x299, 1000 classes"),
    ZooModel(name="rnntc", build=rnntc, default_batch=64,
             description="RNN text classifier: embedding, 4 LSTM layers (1024), 2 classes, 40 steps"),
    ZooModel(name="rnnlm", build=rnnlm, default_batch=64,
             description="RNN language model: embedding, 2 LSTM layers (1024), 32K vocab, 40 steps"),
    ZooModel(name="nmt", build=nmt, default_batch=64,
             description="NMT: 4+4 LSTM encoder-decoder (1024) with attention, 32K vocab, 40 steps"),
    ZooModel(name="transformer", build=transformer, default_batch=8,
             description="GPT-2 small decoder (Radford et al. 2019), 12x768, SDPA attention, 256-token "
                         "sequences of 1024 positions, 50257 vocab"),
)}


def get(name: str) -> ZooModel:
    """The zoo entry called `name`; `ValueError` naming the known models otherwise."""
    try:
        return ZOO[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(ZOO)}") from None


__all__ = ["ZOO", "ZooModel", "get"]
