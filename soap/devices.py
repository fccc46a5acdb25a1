"""Device and link specifications from vendor datasheets: the one table the topology presets draw on.

Every row names its source. Units (the same as in the topology file):

- peak compute in TFLOP/s per dtype, dense (the datasheets' "with sparsity" figures are halved);
  ``float32`` is the plain FP32 rate and ``tf32`` the tensor-core rate for float32 matmuls where the
  hardware has one; a dtype missing from a row is not supported by that hardware;
- memory bandwidth in GB/s and memory capacity in GB, both with GB = 1e9 bytes. Vendors quote HBM/GDDR
  capacity in binary units (a "16 GB" P100 holds 16 GiB), so the capacity here is about 7% below the
  physical one; that is deliberate: the CUDA context and the allocator's reserve take about as much;
- `num_sms`, `boost_clock_mhz`, `sustained_clock_mhz` (GPUs only; 0 elsewhere): the streaming
  multiprocessors and the clocks the peak figures are quoted at (boost) and that a full training load
  holds (sustained). The analytical cost model prices a kernel by waves of tiles over the SMs at the
  sustained clock (`simulator.kernel_efficiency`);
- link bandwidth in GB/s per direction for one link as the topology uses it (datasheets quote NVLink and
  PCIe as the sum of both directions; those totals are halved), latency in microseconds per hop (a route's
  latency is the sum over its hops).

Compute and memory figures are datasheet peaks; link latencies and the effective bandwidths of PCIe and
loopback are starting figures, not measurements: calibration replaces all of them with measured values
(a machine profile is a topology file with per-device overrides and its own link figures).

Must not import torch, the simulator, the search or the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One device kind as its datasheet describes it (one CUDA device, or one CPU process).

    `busy_while_communicating`: the device's own compute moves its data, so a transfer or collective it
    takes part in keeps it from computing. True for a CPU process (gloo copies, packs and reduces with the
    cores that compute; the runtime's exchanges block both ends); GPUs have copy engines and overlap.
    """

    kind: str
    model: str  # the product, form factor and memory size the figures are for
    peak_tflops: Mapping[str, float]  # dtype name -> TFLOP/s, dense
    memory_bandwidth_gbps: float  # GB/s
    memory_gb: float  # GB (1e9 bytes)
    nvlink_links: int  # NVLink bricks per GPU (0: none)
    source: str
    busy_while_communicating: bool = False
    num_sms: int = 0  # streaming multiprocessors (0: not a GPU, or not known)
    boost_clock_mhz: float = 0.0  # the clock `peak_tflops` is quoted at (0: not known)
    sustained_clock_mhz: float = 0.0  # the clock held under a full load (0: not known)

    @property
    def sustained_fraction(self) -> float:
        """Sustained over boost clock: the fraction of `peak_tflops` a full load can reach (1 when the
        clocks are not known)."""
        if self.boost_clock_mhz > 0 and self.sustained_clock_mhz > 0:
            return self.sustained_clock_mhz / self.boost_clock_mhz
        return 1.0

    def __post_init__(self) -> None:
        peaks = {str(k): float(v) for k, v in dict(self.peak_tflops).items()}
        if not peaks or any(v <= 0 for v in peaks.values()):
            raise ValueError(f"device kind {self.kind!r}: peak_tflops must be non-empty and positive, "
                             f"got {peaks}")
        unknown = sorted(set(peaks) - set(DTYPES))
        if unknown:
            raise ValueError(f"device kind {self.kind!r}: unknown dtype(s) {unknown}; "
                             f"known: {', '.join(DTYPES)}")
        if self.memory_bandwidth_gbps <= 0 or self.memory_gb <= 0 or self.nvlink_links < 0:
            raise ValueError(f"device kind {self.kind!r}: memory_bandwidth_gbps="
                             f"{self.memory_bandwidth_gbps}, memory_gb={self.memory_gb} must be > 0 and "
                             f"nvlink_links={self.nvlink_links} >= 0")
        if (self.num_sms < 0 or self.boost_clock_mhz < 0 or self.sustained_clock_mhz < 0
                or self.sustained_clock_mhz > self.boost_clock_mhz > 0):
            raise ValueError(f"device kind {self.kind!r}: num_sms={self.num_sms}, boost_clock_mhz="
                             f"{self.boost_clock_mhz}, sustained_clock_mhz={self.sustained_clock_mhz} must be "
                             f">= 0, the sustained clock at most the boost clock")
        object.__setattr__(self, "peak_tflops", MappingProxyType(peaks))
        object.__setattr__(self, "memory_bandwidth_gbps", float(self.memory_bandwidth_gbps))
        object.__setattr__(self, "memory_gb", float(self.memory_gb))
        object.__setattr__(self, "boost_clock_mhz", float(self.boost_clock_mhz))
        object.__setattr__(self, "sustained_clock_mhz", float(self.sustained_clock_mhz))


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """One kind of physical link: bandwidth per direction of one link, latency per hop."""

    name: str
    bandwidth_gbps: float  # GB/s, one direction
    latency_us: float  # microseconds, one hop
    source: str

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0 or self.latency_us < 0:
            raise ValueError(f"link spec {self.name!r}: bandwidth_gbps={self.bandwidth_gbps} must be > 0 and "
                             f"latency_us={self.latency_us} >= 0")
        object.__setattr__(self, "bandwidth_gbps", float(self.bandwidth_gbps))
        object.__setattr__(self, "latency_us", float(self.latency_us))


_DEVICE_ROWS = (
    DeviceSpec(
        kind="p100", model="NVIDIA Tesla P100 SXM2 16 GB",
        peak_tflops={"float64": 5.3, "float32": 10.6, "float16": 21.2},
        memory_bandwidth_gbps=732, memory_gb=16, nvlink_links=4,
        num_sms=56, boost_clock_mhz=1480, sustained_clock_mhz=1480,
        source="NVIDIA Tesla P100 datasheet (2016), NVLink (SXM2) column; SMs and clocks: NVIDIA Tesla P100 "
               "whitepaper (2016), Table 1 (56 SMs, base 1328 MHz, GPU Boost 1480 MHz; the 300 W SXM2 board "
               "holds its boost clock under load)"),
    DeviceSpec(
        # One K80 board carries two GK210 GPUs, each its own CUDA device: the board figures are halved.
        kind="k80", model="NVIDIA Tesla K80, one of the board's two GK210 GPUs, 12 GB",
        peak_tflops={"float64": 2.91 / 2, "float32": 8.73 / 2},  # with GPU Boost; no fast fp16
        memory_bandwidth_gbps=480 / 2, memory_gb=24 / 2, nvlink_links=0,
        num_sms=13, boost_clock_mhz=875, sustained_clock_mhz=562,
        source="NVIDIA Tesla K80 datasheet (2014): per board 8.73 TFLOP/s fp32 and 2.91 fp64 with GPU Boost, "
               "480 GB/s, 24 GB GDDR5; Tesla K80 board specification (BD-07317-001): 2 x 13 SMX, base "
               "clock 560-562 MHz, boost up to 875 MHz only while the two GPUs stay under the 300 W board "
               "limit, so a full training load runs at the base clock"),
    DeviceSpec(
        kind="v100", model="NVIDIA Tesla V100 SXM2 32 GB",
        peak_tflops={"float64": 7.8, "float32": 15.7, "float16": 125},  # float16: tensor cores
        memory_bandwidth_gbps=900, memory_gb=32, nvlink_links=6,
        num_sms=80, boost_clock_mhz=1530, sustained_clock_mhz=1530,
        source="NVIDIA Tesla V100 datasheet (2018), SXM2 column; SMs and clock: NVIDIA Tesla V100 "
               "whitepaper (2017), Table 1 (80 SMs, GPU Boost 1530 MHz, held under load on the 300 W "
               "SXM2 board)"),
    DeviceSpec(
        # float64 is the FP64 tensor-core rate, which cuBLAS uses for double-precision matmuls.
        kind="a100", model="NVIDIA A100 SXM 80 GB",
        peak_tflops={"float64": 19.5, "float32": 19.5, "tf32": 156, "bfloat16": 312, "float16": 312},
        memory_bandwidth_gbps=2039, memory_gb=80, nvlink_links=12,
        num_sms=108, boost_clock_mhz=1410, sustained_clock_mhz=1410,
        source="NVIDIA A100 Tensor Core GPU datasheet (2021), A100 80GB SXM column; SMs and clock: NVIDIA "
               "A100 Tensor Core GPU Architecture whitepaper (2020), Table 1 (108 SMs, GPU Boost 1410 MHz)"),
    DeviceSpec(
        kind="h100", model="NVIDIA H100 SXM 80 GB",
        peak_tflops={"float64": 67, "float32": 67, "tf32": 989 / 2, "bfloat16": 1979 / 2,
                     "float16": 1979 / 2},
        memory_bandwidth_gbps=3350, memory_gb=80, nvlink_links=18,
        num_sms=132, boost_clock_mhz=1980, sustained_clock_mhz=1980,
        source="NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column; tensor figures quoted with "
               "sparsity, halved; SMs and clock: NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), "
               "132 SMs on the SXM5 board, GPU Boost 1980 MHz (held under load: an H100 SXM measured by this "
               "project ran its matrix products at its maximum clock)"),
    DeviceSpec(
        kind="h200", model="NVIDIA H200 SXM 141 GB",
        peak_tflops={"float64": 67, "float32": 67, "tf32": 989 / 2, "bfloat16": 1979 / 2,
                     "float16": 1979 / 2},
        memory_bandwidth_gbps=4800, memory_gb=141, nvlink_links=18,
        source="NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column; tensor figures quoted with "
               "sparsity, halved"),
    DeviceSpec(
        # Not a datasheet: one training process pinned to about one x86 core with AVX2 FMA (2 FMA units x
        # 8 float32 lanes x 2 FLOP at ~3 GHz is ~96 peak; ~50 is what a good GEMM sustains), its share of
        # DRAM bandwidth and memory. bfloat16/float16 run at the float32 rate (converted to float32 on CPUs
        # without native support). Calibration on the actual machine replaces every figure.
        kind="cpu", model="one local CPU process (about one x86 core with AVX2)",
        peak_tflops={"float64": 0.025, "float32": 0.05, "bfloat16": 0.05, "float16": 0.05},
        memory_bandwidth_gbps=20, memory_gb=8, nvlink_links=0,
        source="assumption (generic x86 core, AVX2); replaced by calibration", busy_while_communicating=True),
)

DEVICE_SPECS: Mapping[str, DeviceSpec] = MappingProxyType({row.kind: row for row in _DEVICE_ROWS})

_LINK_ROWS = (
    LinkSpec(name="nvlink1", bandwidth_gbps=20, latency_us=3,
             source="NVIDIA Tesla P100 datasheet (2016): 4 NVLink links, 160 GB/s bidirectional per GPU"),
    LinkSpec(name="nvlink2", bandwidth_gbps=25, latency_us=3,
             source="NVIDIA Tesla V100 datasheet (2018): 6 NVLink links, 300 GB/s bidirectional per GPU"),
    # NVSwitch: one link per GPU carrying all its NVLink bandwidth; a GPU -> switch -> GPU route has two
    # hops, so the per-hop latency is half a direct NVLink transfer's.
    LinkSpec(name="nvswitch-a100", bandwidth_gbps=600 / 2, latency_us=1.5,
             source="NVIDIA A100 datasheet (2021): NVLink 600 GB/s (both directions) per GPU via NVSwitch"),
    LinkSpec(name="nvswitch-h100", bandwidth_gbps=900 / 2, latency_us=1.5,
             source="NVIDIA H100/H200 datasheets (2023/2024): NVLink 900 GB/s (both directions) per GPU"),
    # PCIe: effective figures (what a pinned cudaMemcpy reaches), not the theoretical per-direction rate
    # (3.0: 8 GT/s x 16 lanes x 128/130 = 15.75 GB/s; 4.0: 31.5; 5.0: 63).
    LinkSpec(name="pcie3-x16", bandwidth_gbps=12, latency_us=5,
             source="PCI Express Base Specification 3.0 (2010): 15.75 GB/s theoretical per direction, "
                    "~12 GB/s effective"),
    LinkSpec(name="pcie4-x16", bandwidth_gbps=24, latency_us=5,
             source="PCI Express Base Specification 4.0 (2017): 31.5 GB/s theoretical per direction, "
                    "~24 GB/s effective"),
    LinkSpec(name="pcie5-x16", bandwidth_gbps=48, latency_us=5,
             source="PCI Express Base Specification 5.0 (2019): 63 GB/s theoretical per direction, "
                    "~48 GB/s effective"),
    # InfiniBand 4x ports, signalling rate / 8 (a NIC -> switch -> NIC route has two hops: ~1 us of switch
    # and wire plus the verbs software on each end).
    LinkSpec(name="ib-fdr", bandwidth_gbps=56 / 8, latency_us=1,
             source="InfiniBand Trade Association roadmap / Mellanox ConnectX-3: FDR 4x, 56 Gb/s (2011)"),
    LinkSpec(name="ib-edr", bandwidth_gbps=100 / 8, latency_us=1,
             source="InfiniBand Trade Association roadmap / Mellanox ConnectX-4: EDR 4x, 100 Gb/s (2014)"),
    LinkSpec(name="ib-hdr", bandwidth_gbps=200 / 8, latency_us=1,
             source="InfiniBand Trade Association roadmap / Mellanox ConnectX-6: HDR 4x, 200 Gb/s (2018)"),
    LinkSpec(name="ib-ndr", bandwidth_gbps=400 / 8, latency_us=1,
             source="InfiniBand Trade Association roadmap / NVIDIA ConnectX-7: NDR 4x, 400 Gb/s (2021)"),
    # Not a datasheet: gloo over TCP on the loopback interface, one stream; process -> hub -> process is two
    # hops, ~40 us end to end.
    LinkSpec(name="loopback", bandwidth_gbps=5, latency_us=20,
             source="assumption (gloo over TCP loopback: 30-50 us, a few GB/s); replaced by calibration"),
)

LINK_SPECS: Mapping[str, LinkSpec] = MappingProxyType({row.name: row for row in _LINK_ROWS})


def device_spec(kind: str) -> DeviceSpec:
    """The table row for a device kind; `ValueError` listing the known kinds when there is none."""
    try:
        return DEVICE_SPECS[kind]
    except KeyError:
        raise ValueError(f"unknown device kind {kind!r}; known kinds: {', '.join(DEVICE_SPECS)}") from None
