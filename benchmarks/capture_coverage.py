"""What capture leaves opaque in real models at their usual sizes, and the data-parallel step it predicts.

An opaque op runs whole on one device: every strategy gathers its inputs there and scatters its outputs,
so the share of a model's work that is opaque bounds what any strategy can split. For each model (torch.nn
models written here as their papers and PyTorch's examples write them, and Hugging Face models from their
configs when `transformers` is installed: nothing is downloaded) this captures one training step and
reports its ops, the opaque ones (by aten op), their share of the forward FLOPs and of the parameters, and
the simulated step of data parallelism on `a100-1x8` (analytical cost model).

Prints a table and writes benchmarks/results/capture_coverage.md and .json::

    python benchmarks/capture_coverage.py [--models srresnet unet ...] [--topology a100-1x8]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search.baselines import parse_baseline  # noqa: E402
from simulator.engine import Simulator  # noqa: E402
from soap.capture import capture  # noqa: E402
from soap.topology import load_topology  # noqa: E402
from soapflow.tables import frame, markdown_table  # noqa: E402

RESULTS = Path(__file__).parent / "results"


class SRResNet(nn.Module):
    """Super-resolution ResNet (Ledig et al. 2017): PReLU, 8 residual blocks, two PixelShuffle x2 stages."""

    def __init__(self, blocks: int = 8):
        super().__init__()
        self.head = nn.Sequential(nn.Conv2d(3, 64, 9, padding=4), nn.PReLU())
        self.body = nn.ModuleList(nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.PReLU(64),
                                                nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64))
                                  for _ in range(blocks))
        self.up = nn.Sequential(nn.Conv2d(64, 256, 3, padding=1), nn.PixelShuffle(2), nn.PReLU(),
                                nn.Conv2d(64, 256, 3, padding=1), nn.PixelShuffle(2), nn.PReLU())
        self.tail = nn.Conv2d(64, 3, 9, padding=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(x)
        for block in self.body:
            h = h + block(h)
        return self.tail(self.up(h))


class UNet(nn.Module):
    """A three-level U-Net with batch norms, channel dropout at the bottom and bilinear upsampling with
    aligned corners (as the common PyTorch U-Net writes it), two classes per pixel."""

    def __init__(self, c: int = 64):
        super().__init__()

        def block(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

        self.down1, self.down2, self.down3 = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.pool, self.drop = nn.MaxPool2d(2), nn.Dropout2d(0.1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.up2, self.up1, self.out = block(6 * c, 2 * c), block(3 * c, c), nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(self.pool(a))
        c = self.drop(self.down3(self.pool(b)))
        b = self.up2(torch.cat([self.up(c), b], 1))
        return self.out(self.up1(torch.cat([self.up(b), a], 1)))


class Tagger(nn.Module):
    """A BiLSTM sequence tagger: embeddings, a bidirectional two-layer LSTM with dropout between its
    layers, a tag classifier; trained with padding ignored and smoothed labels."""

    def __init__(self, vocab: int = 30000, tags: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, 256)
        self.lstm = nn.LSTM(256, 512, num_layers=2, batch_first=True, bidirectional=True, dropout=0.3)
        self.head = nn.Linear(1024, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


class WordLM(nn.Module):
    """PyTorch's word-language-model example at its medium size: sequence first, 2-layer LSTM, dropout 0.5."""

    def __init__(self, vocab: int = 33278, width: int = 650):
        super().__init__()
        self.drop, self.encoder = nn.Dropout(0.5), nn.Embedding(vocab, width)
        self.rnn, self.decoder = nn.LSTM(width, width, 2, dropout=0.5), nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.encoder(ids.t())))
        return self.decoder(self.drop(out)).transpose(0, 1)


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.empty(batch, seq, dtype=torch.long, device="meta")


def _images(batch: int, size: int) -> torch.Tensor:
    return torch.empty(batch, 3, size, size, device="meta")


def _sequence_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0, label_smoothing=0.1)


class _Logits(nn.Module):
    """A Hugging Face model called with one keyword input, returning its logits (a seq2seq one also reads
    the ids shifted right as its decoder's)."""

    def __init__(self, model: nn.Module, key: str, seq2seq: bool = False):
        super().__init__()
        self.model, self.key, self.seq2seq = model, key, seq2seq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = {"decoder_input_ids": self.model._shift_right(x)} if self.seq2seq else {}
        return self.model(**{self.key: x}, **extra).logits


def _hf(name: str) -> tuple:
    import transformers as hf

    labels = torch.empty(64, dtype=torch.long, device="meta")
    if name == "swin_t":
        config = hf.SwinConfig(embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24], num_labels=1000)
        return _Logits(hf.SwinForImageClassification(config), "pixel_values"), _images(64, 224), labels, None
    if name == "mobilenet_v2":
        config = hf.MobileNetV2Config(num_labels=1000)
        return (_Logits(hf.MobileNetV2ForImageClassification(config), "pixel_values"), _images(64, 224), labels,
                None)
    if name == "vit_b16":
        config = hf.ViTConfig(num_labels=1000, attn_implementation="sdpa")
        return _Logits(hf.ViTForImageClassification(config), "pixel_values"), _images(64, 224), labels, None
    if name == "t5_small":
        config = hf.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, decoder_start_token_id=0,
                             pad_token_id=0)
        model = _Logits(hf.T5ForConditionalGeneration(config), "input_ids", seq2seq=True)
        return model, _ids(32, 128), _ids(32, 128), _sequence_loss
    raise KeyError(name)


# name -> () -> (module, input, target, loss or None)
MODELS: dict[str, Callable[[], tuple]] = {
    "srresnet": lambda: (SRResNet(), _images(32, 48), torch.empty(32, 3, 192, 192, device="meta"), None),
    "unet": lambda: (UNet(), _images(16, 128), torch.empty(16, 128, 128, dtype=torch.long, device="meta"),
                     F.cross_entropy),
    "bilstm_tagger": lambda: (Tagger(), _ids(256, 128), _ids(256, 128), _sequence_loss),
    "word_lm": lambda: (WordLM(), _ids(160, 35), _ids(160, 35), _sequence_loss),
    "swin_t": lambda: _hf("swin_t"),
    "mobilenet_v2": lambda: _hf("mobilenet_v2"),
    "vit_b16": lambda: _hf("vit_b16"),
    "t5_small": lambda: _hf("t5_small"),
}


def measure(name: str, topology_name: str) -> dict:
    torch.manual_seed(0)
    module, inputs, target, loss = MODELS[name]()
    graph = capture(module, inputs, target, loss, name=name)
    opaque = [op for op in graph if op.kind == "opaque"]
    flops = sum(op.fwd_flops for op in graph) or 1.0
    params = graph.num_params or 1
    topology = load_topology(topology_name)
    sim = Simulator(graph, topology)
    sim.full(parse_baseline("dp")(graph, topology))
    return {
        "model": name, "batch": int(inputs.shape[0]), "ops": len(graph), "opaque_ops": len(opaque),
        "opaque_calls": dict(Counter(str(op.attrs.get("target", "")).split(".")[-2] for op in opaque)),
        "opaque_flops_share": sum(op.fwd_flops for op in opaque) / flops,
        "opaque_params_share": sum(p.numel for op in opaque for p in op.params.values()) / params,
        "dp_ms": sim.iteration_time_ms, "dp_fits": sim.feasible,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--topology", default="a100-1x8")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = []
    for name in args.models:
        try:
            rows.append(measure(name, args.topology))
        except ImportError as exc:  # a Hugging Face model without transformers
            print(f"{name}: skipped ({exc})", file=sys.stderr)
    table = frame(rows)
    shown = table.assign(opaque_calls=[", ".join(f"{k} x{v}" for k, v in r["opaque_calls"].items()) or "-"
                                       for r in rows],
                         opaque_flops_share=[f"{r['opaque_flops_share']:.1%}" for r in rows],
                         opaque_params_share=[f"{r['opaque_params_share']:.1%}" for r in rows],
                         dp_ms=[f"{r['dp_ms']:.1f}" for r in rows])
    headers = ["model", "batch", "ops", "opaque ops", "opaque calls", "opaque FLOPs", "opaque params", "dp ms",
               "dp fits"]
    right = {"batch", "ops", "opaque_ops", "opaque_flops_share", "opaque_params_share", "dp_ms"}
    text = (f"# What capture leaves opaque in real models\n\nOne training step captured per model; `dp ms`: data "
            f"parallelism simulated on {args.topology} (analytical cost model). Opaque FLOPs and params: shares "
            f"of the forward FLOPs and of the parameters that run whole on one device.\n\n"
            + markdown_table(shown, headers=headers, right=right) + "\n")
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "capture_coverage.md").write_text(text)
    (RESULTS / "capture_coverage.json").write_text(json.dumps(
        {"meta": {"topology": args.topology, "torch": torch.__version__}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
