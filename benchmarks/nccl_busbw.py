"""NCCL bus bandwidth: soapflow's SIMULATED all-reduce against published nccl-tests figures.

nccl-tests' ``all_reduce_perf`` reports, per message size B and time t over n GPUs, the algorithm
bandwidth algbw = B / t and the bus bandwidth busbw = algbw * 2(n-1)/n (what a ring all-reduce moves per
GPU, so that busbw is comparable across GPU counts and with a link's rate). This benchmark prices the
same all-reduce, over every GPU of a preset, with `simulator.comm.Comm` (the rings with one channel per
NIC rail, the double binary trees, and per size the faster of the two), and reports the same figures:
for each preset and size, the ring's, the tree's (all-reduces over several nodes only) and the chosen
algorithm's time and busbw. Nothing is tuned: the presets' link figures are those of `soap.devices`, and
`CommOverhead` is zero, as in `soapflow simulate` without a machine profile.

Published figures (nccl-tests ``all_reduce_perf``, float32 sum; GB/s = 1e9 bytes per second), each set
beside the simulated figure of the same preset, size and, where the source forced one, algorithm:

- a100-1x8, busbw 232.54 GB/s: one server of 8 A100 with NVLink (and 4 dual-port 200 Gb/s IB cards),
  ``all_reduce_perf -b 8 -e 4G -f 2 -g 8``, the result as reported, compared at 4 GiB.
  https://github.com/NVIDIA/nccl-tests/issues/175
- a100-1x8, busbw about 200 GB/s at 1 GiB: HPE Apollo 6500, 8x A100-SXM4-80GB over NVLink, NCCL 2.18.1,
  ``all_reduce_perf -b 8 -e 1G -f 4 -g 1 -t 8``. https://github.com/NVIDIA/nccl-tests/issues/149
- a100 multi-node, busbw 192 GB/s: NVIDIA's measurement on DGX A100 systems with 8x 200 Gb/s InfiniBand
  (node count not given; quoted as the ring's network reference), compared with a100-4x8's ring at 1 GiB
  (over three nodes or more NCCL runs rings for large sizes). https://github.com/NVIDIA/nccl/issues/812
- a100-2x8, 93.12 us for 8 bytes with ``NCCL_ALGO=Ring``: two DGX A100 (8x 100 Gb/s NICs each), NCCL
  2.16.5, 16 GPUs; a latency figure (the NICs' rate does not enter at 8 bytes), compared with the
  simulated ring at 8 bytes. https://github.com/NVIDIA/nccl/issues/812
- a100-1x2, 10.14 us for 32 bytes: 2x A100-SXM4-40GB in one server, ``nGpus 2`` (October 2021; NCCL
  version not given).
  https://github.com/NVIDIA/nccl/issues/583
- h100-1x8, busbw 479.41 GB/s at 8 GiB: 8x H100 80GB HBM3 in one node, default algorithm (NVLink SHARP,
  which the model does not have: it is compared with the model's ring).
  https://github.com/NVIDIA/nccl-tests/issues/347
- h100-1x8, busbw about 370 GB/s with ``NCCL_ALGO=RING``: NCCL's developer on H100's NVLink (450 GB/s line
  rate, about 20% protocol overhead), compared at 8 GiB. https://github.com/NVIDIA/nccl-tests/issues/212
- h100-2x8, busbw up to about 396 GB/s with the ring: NCCL's developer on multi-node HGX H100 with
  ConnectX-7 NDR 400 Gb/s NICs (about 48 GB/s each, aggregated over the node's 8), compared at 8 GiB.
  https://github.com/NVIDIA/nccl-tests/issues/319

Where the model misses (the results file gives the ratios): inside a node the NVSwitch link runs at its
datasheet line rate where NCCL reaches about 80% of it (so single-node busbw is 20-50% high), and
H100's NVLink SHARP is not modelled; per-step latencies are the presets' starting figures (5 us per
PCIe hop into a NIC, 12 us between nodes), several times what NCCL's low-latency protocol takes, so the
ring's small-message times are far too slow (the tree, which the model picks there, much less so); no
per-call launch cost unless calibration fits one (so the 2-GPU 32-byte call is too fast). Over two nodes
the model, like NCCL, picks the tree for large sizes too, whose busbw can exceed the network's (NCCL's
developers: up to about twice it, https://github.com/NVIDIA/nccl/issues/946); no published DGX figure of
it was found to compare with.

Writes a table to stdout and to benchmarks/results/<name>.md, the raw figures to <name>.json::

    python benchmarks/nccl_busbw.py
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.comm import ALLREDUCE, RING, Comm  # noqa: E402
from soap.topology import load_topology  # noqa: E402

KIB, GIB = 1 << 10, 1 << 30
PRESETS = ("a100-1x2", "a100-1x8", "a100-2x8", "a100-4x8", "h100-1x8", "h100-2x8")
SIZES = (8, 8 * KIB, GIB)
CHOSEN = "chosen"


@dataclass(frozen=True, slots=True)
class Published:
    """One published nccl-tests figure: a busbw (GB/s) or, for latency, a time (us)."""

    preset: str  # the preset it is compared with
    nbytes: int  # the message size it is compared at
    algorithm: str  # RING where the source forced the ring (or names it), else CHOSEN
    busbw_gbps: float | None
    time_us: float | None
    setup: str
    url: str


PUBLISHED = (
    Published("a100-1x8", 4 * GIB, CHOSEN, 232.54, None,
              "8x A100 with NVLink in one server, all_reduce_perf -b 8 -e 4G -f 2 -g 8, reported result",
              "https://github.com/NVIDIA/nccl-tests/issues/175"),
    Published("a100-1x8", GIB, CHOSEN, 200.0, None,
              "HPE Apollo 6500, 8x A100-SXM4-80GB, NVLink, NCCL 2.18.1, ~200 GB/s at 1 GiB",
              "https://github.com/NVIDIA/nccl-tests/issues/149"),
    Published("a100-4x8", GIB, RING, 192.0, None,
              "DGX A100, 8x 200 Gb/s IB per node, multi-node AllReduce busbw (NVIDIA; node count not given)",
              "https://github.com/NVIDIA/nccl/issues/812"),
    Published("a100-2x8", 8, RING, None, 93.12,
              "2x DGX A100 (8x 100 Gb/s NICs), NCCL 2.16.5, NCCL_ALGO=Ring, 8 bytes, out-of-place time",
              "https://github.com/NVIDIA/nccl/issues/812"),
    Published("a100-1x2", 32, CHOSEN, None, 10.14,
              "2x A100-SXM4-40GB in one server, nGpus 2, 32 bytes, out-of-place time",
              "https://github.com/NVIDIA/nccl/issues/583"),
    Published("h100-1x8", 8 * GIB, CHOSEN, 479.41, None,
              "8x H100 80GB HBM3 in one node, 8 GiB, default algorithm (NVLink SHARP: not modelled)",
              "https://github.com/NVIDIA/nccl-tests/issues/347"),
    Published("h100-1x8", 8 * GIB, RING, 370.0, None,
              "H100 NVLink with NCCL_ALGO=RING: ~370 GB/s effective (450 GB/s line rate, ~20% protocol overhead)",
              "https://github.com/NVIDIA/nccl-tests/issues/212"),
    Published("h100-2x8", 8 * GIB, RING, 396.0, None,
              "multi-node HGX H100, ConnectX-7 NDR 400 Gb/s (~48 GB/s per NIC, 8 per node), ring: up to ~396 GB/s",
              "https://github.com/NVIDIA/nccl-tests/issues/319"),
)


def busbw_gbps(nbytes: int, ns: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce of `nbytes` taking `ns` over `n` GPUs (1 byte/ns = 1 GB/s)."""
    return nbytes / ns * 2 * (n - 1) / n


def simulate(preset: str, nbytes: int) -> dict:
    """The all-reduce of `nbytes` over every GPU of `preset`: each algorithm's time and busbw, the pick."""
    topology = load_topology(preset)
    comm = Comm(topology)
    group = tuple(range(topology.num_devices))
    n = len(group)
    row = {"preset": preset, "gpus": n, "nodes": topology.num_nodes, "channels": comm.channels(group),
           "nbytes": nbytes}
    algorithms = comm.algorithms(group, ALLREDUCE)
    for algorithm in algorithms:
        ns = algorithm.wire_ns(nbytes)
        row[f"{algorithm.name}_us"] = ns / 1e3
        row[f"{algorithm.name}_busbw_gbps"] = busbw_gbps(nbytes, ns, n)
    row["chosen"] = min(algorithms, key=lambda algorithm: algorithm.wire_ns(nbytes)).name  # as `collective`
    ns = comm.collective(group, nbytes, ALLREDUCE)[1]
    row["chosen_us"] = ns / 1e3
    row["chosen_busbw_gbps"] = busbw_gbps(nbytes, ns, n)
    return row


def compare(pub: Published) -> dict:
    """`pub` beside the simulated figure of its preset, size and algorithm."""
    sim = simulate(pub.preset, pub.nbytes)
    key = RING if pub.algorithm == RING else CHOSEN
    out = {**asdict(pub), "simulated_algorithm": sim["chosen"] if key == CHOSEN else RING,
           "simulated_us": sim[f"{key}_us"], "simulated_busbw_gbps": sim[f"{key}_busbw_gbps"]}
    if pub.busbw_gbps is not None:
        out["ratio"] = out["simulated_busbw_gbps"] / pub.busbw_gbps  # > 1: the model is faster
    else:
        out["ratio"] = pub.time_us / out["simulated_us"]  # > 1: the model is faster
    return out


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render(rows: list[dict], comparisons: list[dict], meta: dict) -> str:
    lines = [
        "# NCCL all-reduce bus bandwidth: simulated vs published nccl-tests figures",
        "",
        "All-reduce over every GPU of the preset, priced by `simulator.comm.Comm` (rings with one channel per "
        "NIC rail, double binary trees over several nodes, the faster per size), presets' link figures, no "
        "runtime overhead; nothing tuned. busbw = (bytes / time) x 2(n-1)/n, GB/s. "
        f"Python {meta['python']}.",
        "",
        "## Simulated",
        "",
        "| preset | GPUs | channels | size | ring us | ring busbw | tree us | tree busbw | chosen | chosen busbw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['gpus']} | {r['channels']} | {_size(r['nbytes'])} | {r['ring_us']:.1f} | "
            f"{r['ring_busbw_gbps']:.2f} | {_num(r.get('tree_us'), '.1f')} | "
            f"{_num(r.get('tree_busbw_gbps'), '.2f')} | {r['chosen']} | {r['chosen_busbw_gbps']:.2f} |")
    lines += [
        "",
        "## Against published figures",
        "",
        "Ratio: simulated busbw / published busbw, or published time / simulated time: above 1 the model is "
        "faster than the hardware.",
        "",
        "| preset | size | published | simulated (algorithm) | ratio | setup | source |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for c in comparisons:
        if c["busbw_gbps"] is not None:
            published = f"{c['busbw_gbps']:.2f} GB/s busbw ({c['algorithm']})"
            simulated = f"{c['simulated_busbw_gbps']:.2f} GB/s ({c['simulated_algorithm']})"
        else:
            published = f"{c['time_us']:.2f} us ({c['algorithm']})"
            simulated = f"{c['simulated_us']:.2f} us ({c['simulated_algorithm']})"
        lines.append(f"| {c['preset']} | {_size(c['nbytes'])} | {published} | {simulated} | {c['ratio']:.2f} | "
                     f"{c['setup']} | {c['url']} |")
    lines += ["", "## Where the model misses", "", *meta["misses"], ""]
    return "\n".join(lines)


def misses(comparisons: list[dict], rows: list[dict]) -> list[str]:
    """Where the model misses the published figures, and by how much (from the comparisons' ratios)."""
    def pct(preset: str, url: str) -> str:
        ratio = next(c["ratio"] for c in comparisons if c["preset"] == preset and c["url"].endswith(url))
        return f"{abs(ratio - 1):.0%} {'above' if ratio > 1 else 'below'}"

    def sim(preset: str, nbytes: int) -> dict:
        return next(r for r in rows if r["preset"] == preset and r["nbytes"] == nbytes)

    two, four = sim("a100-2x8", GIB), sim("a100-4x8", GIB)
    ring8 = next(c for c in comparisons if c["preset"] == "a100-2x8" and c["nbytes"] == 8)
    two_gpu = next(c for c in comparisons if c["preset"] == "a100-1x2")
    return [
        "- Inside one node the ring runs at the NVSwitch link's datasheet rate (A100 300 GB/s, H100 450 GB/s per "
        "direction), where NCCL reaches about 80% of it (nccl-tests issue 212): a100-1x8 is "
        f"{pct('a100-1x8', '/175')} the first A100 figure and {pct('a100-1x8', '/149')} the second, h100-1x8 "
        f"{pct('h100-1x8', '/212')} the ring figure. H100's default all-reduce uses NVLink SHARP, which the model "
        f"does not have: the model's ring is {pct('h100-1x8', '/347')} that figure.",
        "- Between nodes the rail rings run at the NIC hop's rate (PCIe 4.0 into an HDR NIC: 24 GB/s; PCIe 5.0 into "
        "an NDR NIC: 48 GB/s) times the channels, less 2(n-1) step latencies of 12 us: a100-4x8's ring is "
        f"{pct('a100-4x8', '/812')} NVIDIA's 192 GB/s, h100-2x8's {pct('h100-2x8', '/319')} the ~396 GB/s figure.",
        "- Latency: the presets' per-hop latencies (5 us per PCIe hop into a NIC, 1 us per InfiniBand hop, 1.5 us "
        "per NVSwitch hop) are starting figures, several times what NCCL's low-latency protocol takes per step: "
        f"the simulated 8-byte ring over two a100 nodes takes {ring8['simulated_us']:.0f} us, "
        f"{ring8['simulated_us'] / ring8['time_us']:.1f}x the published {ring8['time_us']:.0f} us (the tree, which "
        f"the model picks at that size, takes {sim('a100-2x8', 8)['tree_us']:.0f} us). The 2-GPU 32-byte call "
        f"takes {two_gpu['simulated_us']:.0f} us, {1 - two_gpu['simulated_us'] / two_gpu['time_us']:.0%} less than "
        f"the published {two_gpu['time_us']:.2f} us: the model charges no launch cost (calibration fits one, "
        "`CommOverhead.sync_us`).",
        "- Algorithm choice: over two nodes the model picks the tree for large sizes too, as NCCL does (NCCL's "
        "developers say a 2-node tree can reach about twice the network's busbw: "
        f"https://github.com/NVIDIA/nccl/issues/946); a100-2x8 at 1 GiB reaches {two['tree_busbw_gbps']:.0f} GB/s "
        f"through it, NVSwitch-bound, with no published DGX figure to compare here. On a100-4x8 at 1 GiB the model "
        f"picks the tree ({four['tree_busbw_gbps']:.0f} against the ring's {four['ring_busbw_gbps']:.0f} GB/s) where "
        "NCCL runs the ring over three nodes or more: the ring's 62 steps of 12 us latency outweigh its smaller NIC "
        "load (2(n-1)/n against 2 times the bytes) at that size; at 16 GiB the ring wins.",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="nccl_busbw", help="results file stem (default: nccl_busbw)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    rows = [simulate(preset, nbytes) for preset in PRESETS for nbytes in SIZES]
    comparisons = [compare(pub) for pub in PUBLISHED]
    meta = {"python": platform.python_version(), "sizes": list(SIZES), "presets": list(PRESETS),
            "definition": "busbw = bytes / time * 2(n-1)/n (nccl-tests); GB/s = 1e9 bytes/s",
            "misses": misses(comparisons, rows)}
    text = render(rows, comparisons, meta)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    (args.out / f"{args.name}.json").write_text(
        json.dumps({"meta": meta, "simulated": rows, "published": comparisons}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
