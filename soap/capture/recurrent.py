"""Capture, stage 1 (with `tracing`): stacked recurrences with dropout between their layers, layer by layer.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` with ``num_layers`` > 1 and ``dropout`` > 0 apply dropout to each
layer's output but the last's, in training, inside one fused call that draws its masks from torch's
generator: no part of a split op could reproduce them, so capture would leave the module opaque (whole on
one device), as in PyTorch's word-language-model example. While capture traces (`layered_recurrences`),
such a module computes the same function layer by layer instead: each layer one call of the module's
recurrence with that layer's weights (both directions where it is bidirectional) from zero states, and
``F.dropout`` of its output before the next layer; the final states are the layers', concatenated in
torch's order. Capture then sees one recurrence per layer (`tracing._recurrences_apart` keeps each a call
of the module of its own) and ``dropout`` ops between them, which the runtime draws by hash; the verifying
reference (runtime.train) runs under the same forward, so its ``F.dropout`` calls draw the same masks.

Left to PyTorch's own forward: evaluation mode, no dropout or one layer, given initial states, packed
sequences and an LSTM's projections.

Imports torch only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import _VF, nn

RECURRENT_MODULES: tuple[type[nn.Module], ...] = (nn.LSTM, nn.GRU, nn.RNN)


def _layerwise(module: nn.RNNBase, x: Any, hx: Any) -> bool:
    return (module.training and bool(module.dropout) and module.num_layers > 1 and hx is None
            and isinstance(x, torch.Tensor) and x.dim() == 3 and not getattr(module, "proj_size", 0))


def _layer(module: nn.RNNBase, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Layer `layer` of `module` on x (in the module's layout): its output and final states."""
    directions = 2 if module.bidirectional else 1
    per = len(module._flat_weights_names) // module.num_layers
    # by name, not from the module's cached list: tracing swaps the parameters themselves
    weights = [getattr(module, name) for name in module._flat_weights_names[layer * per:(layer + 1) * per]]
    batch = x.shape[0] if module.batch_first else x.shape[1]
    def zeros() -> torch.Tensor:
        return torch.zeros(directions, batch, module.hidden_size, dtype=x.dtype, device=x.device)

    args = (module.bias, 1, 0.0, module.training, module.bidirectional, module.batch_first)
    if isinstance(module, nn.LSTM):
        out, h, c = _VF.lstm(x, (zeros(), zeros()), weights, *args)
        return out, (h, c)
    run = _VF.gru if isinstance(module, nn.GRU) else _VF.rnn_tanh if module.nonlinearity == "tanh" else _VF.rnn_relu
    out, h = run(x, zeros(), weights, *args)
    return out, (h,)


@contextmanager
def layered_recurrences() -> Iterator[None]:
    """Within the block, recurrent modules with dropout between layers in training compute layer by layer
    (module docstring)."""
    originals = {cls: cls.forward for cls in RECURRENT_MODULES}

    def forward(self: nn.RNNBase, input: Any, hx: Any = None) -> Any:
        if not _layerwise(self, input, hx):
            original = next(f for cls, f in originals.items() if isinstance(self, cls))
            return original(self, input, hx)
        finals: list[tuple[torch.Tensor, ...]] = []
        out = input
        for layer in range(self.num_layers):
            if layer:
                out = F.dropout(out, self.dropout, self.training)
            out, states = _layer(self, out, layer)
            finals.append(states)
        stacked = tuple(torch.cat(list(parts), 0) for parts in zip(*finals, strict=True))
        return out, stacked if isinstance(self, nn.LSTM) else stacked[0]

    for cls in RECURRENT_MODULES:
        cls.forward = forward
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.forward = original
