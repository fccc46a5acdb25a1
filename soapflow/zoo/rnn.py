"""The zoo's recurrent models from the FlexFlow evaluation (Jia, Zaharia, Aiken, SysML 2019, Table 3).

- RNNTC, text classification: embedding → 4 LSTM layers → linear classifier on the last step's output
  (the paper trains it on Movie Reviews, a two-class sentiment set, hence 2 classes).
- RNNLM, language model: embedding → 2 LSTM layers → linear over the vocabulary at every step
  (Penn Treebank in the paper); ``cell="gru"``, ``"rnn_tanh"`` or ``"rnn_relu"`` stacks GRU or plain RNN
  layers instead.
- NMT, translation: 4-layer LSTM encoder, 4-layer LSTM decoder, Luong-style dot attention of every
  decoder step over all encoder outputs, linear over the target vocabulary at every step (WMT English-German
  in the paper).

Sizes. The paper fixes the layer counts and unrolls every recurrent layer 40 steps; it does not pin the
widths, so we take hidden size 1024, embedding size 1024 and vocabulary 32768 (a 32K word-piece vocabulary)
for every model, with `steps=40` as the sequence length. All are keyword options of the builders.

Structure. Every LSTM layer is its own `nn.LSTM(num_layers=1, batch_first=True)` so that a strategy can
place layers on different devices (FlexFlow's per-layer model parallelism). The NMT decoder starts from
zero state; encoder information reaches it only through attention, which keeps each layer a one-input op.
Dropout (input of every LSTM layer and of the output projection, Zaremba et al. 2014) defaults to p=0 so
that distributed and single-process training draw no random masks. Tensors are batch-first throughout:
token ids `[N, T]` long, activations `[N, T, H]`, logits `[N, T, V]`.
"""

from __future__ import annotations

import torch
from torch import nn

from soapflow.zoo.losses import lm_cross_entropy


def _lstm_stack(num_layers: int, input_size: int, hidden: int) -> nn.ModuleList:
    return nn.ModuleList(
        nn.LSTM(input_size if i == 0 else hidden, hidden, num_layers=1, batch_first=True)
        for i in range(num_layers))


# the recurrent layers `RNNLM` can stack, by `cell`, and the name of the module list holding them
_STACK_NAMES = {"lstm": "lstms", "gru": "grus", "rnn_tanh": "rnns", "rnn_relu": "rnns"}


def _recurrent_stack(cell: str, num_layers: int, input_size: int, hidden: int) -> nn.ModuleList:
    if cell == "lstm":
        return _lstm_stack(num_layers, input_size, hidden)
    if cell == "gru":
        return nn.ModuleList(nn.GRU(input_size if i == 0 else hidden, hidden, batch_first=True)
                             for i in range(num_layers))
    nonlinearity = cell.removeprefix("rnn_")
    return nn.ModuleList(nn.RNN(input_size if i == 0 else hidden, hidden, nonlinearity=nonlinearity, batch_first=True)
                         for i in range(num_layers))


def _dropouts(count: int, p: float) -> nn.ModuleList:
    return nn.ModuleList(nn.Dropout(p=p) for _ in range(count))


class RNNTC(nn.Module):
    """Text classifier: `tokens[N, T]` → logits `[N, num_classes]` from the last step's hidden state."""

    def __init__(self, *, vocab: int, embed: int, hidden: int, num_layers: int, num_classes: int,
                 dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.drops = _dropouts(num_layers + 1, dropout)
        self.lstms = _lstm_stack(num_layers, embed, hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for drop, lstm in zip(self.drops, self.lstms, strict=False):
            x, _ = lstm(drop(x))
        last = x[:, -1, :]
        return self.classifier(self.drops[-1](last))


class RNNLM(nn.Module):
    """Language model: `tokens[N, T]` → next-token logits `[N, T, vocab]`.

    `cell` picks the recurrent layers: ``lstm`` (FlexFlow's model; the layers are ``lstms.{i}``), ``gru``
    (``grus.{i}``), ``rnn_tanh`` or ``rnn_relu`` (``nn.RNN`` with that nonlinearity, ``rnns.{i}``).
    """

    def __init__(self, *, vocab: int, embed: int, hidden: int, num_layers: int, dropout: float,
                 cell: str = "lstm") -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.drops = _dropouts(num_layers + 1, dropout)
        if cell not in _STACK_NAMES:
            raise ValueError(f"unknown recurrent cell {cell!r}; known: {', '.join(_STACK_NAMES)}")
        self.stack_name = _STACK_NAMES[cell]
        self.add_module(self.stack_name, _recurrent_stack(cell, num_layers, embed, hidden))
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for drop, layer in zip(self.drops, getattr(self, self.stack_name), strict=False):
            x, _ = layer(drop(x))
        return self.decoder(self.drops[-1](x))


class Attention(nn.Module):
    """Luong global dot attention: `h~ = tanh(W [context; h])`, context = softmax(h Eᵀ) E.

    `dec[N, T, H]` attends over `enc[N, S, H]`; scores `[N, T, S]`, output `[N, T, H]`.
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)
        self.combine = nn.Linear(2 * hidden, hidden)
        self.tanh = nn.Tanh()

    def forward(self, dec: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        scores = torch.bmm(dec, enc.transpose(1, 2))
        weights = self.softmax(scores)
        context = torch.bmm(weights, enc)
        return self.tanh(self.combine(torch.cat([context, dec], dim=-1)))


class NMT(nn.Module):
    """Encoder-decoder translator: `(src[N, S], tgt_in[N, T])` → target logits `[N, T, vocab]`."""

    def __init__(self, *, vocab: int, embed: int, hidden: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        self.src_embedding = nn.Embedding(vocab, embed)
        self.tgt_embedding = nn.Embedding(vocab, embed)
        self.enc_drops = _dropouts(num_layers, dropout)
        self.encoder = _lstm_stack(num_layers, embed, hidden)
        self.dec_drops = _dropouts(num_layers, dropout)
        self.decoder = _lstm_stack(num_layers, embed, hidden)
        self.attention = Attention(hidden)
        self.out_drop = nn.Dropout(p=dropout)
        self.generator = nn.Linear(hidden, vocab)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        enc = self.src_embedding(src)
        for drop, lstm in zip(self.enc_drops, self.encoder, strict=True):
            enc, _ = lstm(drop(enc))
        dec = self.tgt_embedding(tgt_in)
        for drop, lstm in zip(self.dec_drops, self.decoder, strict=True):
            dec, _ = lstm(drop(dec))
        return self.generator(self.out_drop(self.attention(dec, enc)))


def _tokens(batch_size: int, steps: int) -> torch.Tensor:
    return torch.empty(batch_size, steps, dtype=torch.long, device="meta")


def rnntc(batch_size: int = 64, *, hidden: int = 1024, embed: int = 1024, vocab: int = 32768,
          steps: int = 40, layers: int = 4, num_classes: int = 2, dropout: float = 0.0) -> tuple:
    """RNNTC on `tokens[N, steps]` with class labels `[N]` (default cross-entropy loss)."""
    module = RNNTC(vocab=vocab, embed=embed, hidden=hidden, num_layers=layers, num_classes=num_classes,
                   dropout=dropout)
    labels = torch.empty(batch_size, dtype=torch.long, device="meta")
    return module, (_tokens(batch_size, steps), labels)


def rnnlm(batch_size: int = 64, *, hidden: int = 1024, embed: int = 1024, vocab: int = 32768,
          steps: int = 40, layers: int = 2, dropout: float = 0.0, cell: str = "lstm") -> tuple:
    """RNNLM on `tokens[N, steps]` with next tokens `[N, steps]` as target (`lm_cross_entropy`); `cell`
    ``gru``, ``rnn_tanh`` or ``rnn_relu`` stacks those layers in place of the LSTMs (`RNNLM`)."""
    module = RNNLM(vocab=vocab, embed=embed, hidden=hidden, num_layers=layers, dropout=dropout, cell=cell)
    return module, (_tokens(batch_size, steps), _tokens(batch_size, steps)), lm_cross_entropy


def nmt(batch_size: int = 64, *, hidden: int = 1024, embed: int = 1024, vocab: int = 32768,
        steps: int = 40, layers: int = 4, dropout: float = 0.0) -> tuple:
    """NMT on `(src[N, steps], tgt_in[N, steps])` with target tokens `[N, steps]` (`lm_cross_entropy`)."""
    module = NMT(vocab=vocab, embed=embed, hidden=hidden, num_layers=layers, dropout=dropout)
    inputs = (_tokens(batch_size, steps), _tokens(batch_size, steps))
    return module, (inputs, _tokens(batch_size, steps)), lm_cross_entropy
