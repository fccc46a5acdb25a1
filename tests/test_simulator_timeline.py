"""Hand-computed timelines on 2-3-op graphs under the fixed cost model: exact start and end of every task.

Every op part costs 1 ms forward and 2 ms backward, an optimizer step 0.5 ms. On `cpu-N` each process
reaches the loopback hub over its own link pair (5 GB/s = 5 bytes/ns, 20 us per link), so a transfer of
B bytes between two processes crosses two links: ``40,000 ns + B / 5`` (alpha-beta along the route),
rounded to whole ns. The activations here are float32 [4, 8]: 128 bytes, so one transfer takes 40,026 ns.
"""

from __future__ import annotations

import pytest
from test_simulator_support import Net

from simulator import FixedCostModel, Simulator, simulate
from simulator.comm import Comm, CommOverhead
from soap.config import ParallelConfig
from soap.setup import TrainSetup
from soap.strategy import Strategy
from soap.topology import load_topology

MS = 1_000_000  # ns
COSTS = FixedCostModel(fwd_each_ms=1.0, bwd_each_ms=2.0, update_each_ms=0.5)
T_128 = round(40_000 + 128 / 5)  # one 128-byte transfer between two cpu-N processes, ns


def on(*devices: int, **degrees: int) -> ParallelConfig:
    return ParallelConfig(degrees=degrees, devices=devices)


def linear_loss(batch: int = 4):
    """x[4, 8] -> fc (linear 8 -> 8) -> mse against y."""
    net = Net("linear_loss", batch)
    x = net.input("x", (batch, 8))
    h = net.linear("fc", x, 8)
    y = net.input("y", (batch, 8), role="target")
    net.mse("loss", h, y)
    return net.graph()


def times(timeline) -> dict[str, tuple[int, int]]:
    """Task name -> (start ns, end ns)."""
    out = {}
    for rec in timeline.tasks():
        assert rec.name not in out, rec.name
        out[rec.name] = (round(rec.start_ms * MS), round(rec.end_ms * MS))
    return out


def test_one_device_chain():
    graph = linear_loss()
    strategy = Strategy({name: on(0) for name in ("x", "fc", "y", "loss")})
    tl = simulate(graph, strategy, load_topology("cpu-2"), COSTS)
    assert times(tl) == {
        "fc fwd[0]": (0, 1 * MS),
        "loss fwd[0]": (1 * MS, 2 * MS),
        "loss bwd[0]": (2 * MS, 4 * MS),
        "fc bwd[0]": (4 * MS, 6 * MS),
        "fc update[device 0]": (6 * MS, 6_500_000),
        "step end[device 0]": (6 * MS, 6 * MS),  # the update waits for it; it takes no time
        "step end[device 1]": (0, 0),  # a process with nothing to do
    }
    assert tl.iteration_time_ns == 6_500_000
    assert tl.iteration_time_ms == 6.5
    assert (tl.compute_ms, tl.comm_ms, tl.sync_ms) == (6.5, 0.0, 0.0)
    assert tl.bytes_moved == 0
    # memory: fc holds weight [8, 8] + bias [8] = 288 bytes as parameter, gradient and one optimizer copy,
    # plus the activations of the parts on the device (x, fc's output; y and the scalar loss), plus the
    # largest backward transient, the loss's: its scalar's gradient and its input's (fc's output)
    assert tl.peak_memory_bytes == (3 * 288 + 128 + 128 + 128 + 4 + (4 + 128), 0)
    assert tl.device_busy_ms == (6.5, 0.0)


def test_transfer_and_its_gradient_cross_both_links_of_the_route():
    graph = linear_loss()
    strategy = Strategy({"x": on(0), "fc": on(0), "y": on(1), "loss": on(1)})
    topo = load_topology("cpu-2")
    tl = simulate(graph, strategy, topo, COSTS)
    t1 = 1 * MS + T_128
    t2 = t1 + 3 * MS + T_128  # loss forward and backward on device 1, then the gradient back
    assert times(tl) == {
        "fc fwd[0]": (0, 1 * MS),
        "fc -> loss": (1 * MS, t1),
        "loss fwd[0]": (t1, t1 + 1 * MS),
        "loss bwd[0]": (t1 + 1 * MS, t1 + 3 * MS),
        "grad loss -> fc": (t1 + 3 * MS, t2),
        "fc bwd[0]": (t2, t2 + 2 * MS),
        "fc update[device 0]": (t2 + 2 * MS, t2 + 2_500_000),
        "step end[device 0]": (t2 + 2 * MS, t2 + 2 * MS),
        "step end[device 1]": (t2, t2),  # once the gradient it sends has left
    }
    assert tl.iteration_time_ns == 6_500_000 + 2 * T_128
    records = {r.name: r for r in tl.tasks()}
    forward, backward = records["fc -> loss"], records["grad loss -> fc"]
    # loopback is half duplex: a link and its reverse are one resource, named by the lower link id
    assert forward.links == tuple(topo.capacity(i) for i in topo.route(0, 1)) and len(forward.links) == 2
    assert set(backward.links) == set(forward.links)
    # CPU processes move data with the cores that compute: a transfer occupies both ends too
    assert forward.devices == (0, 1) and backward.devices == (1, 0)
    assert forward.category == backward.category == "transfer" and forward.nbytes == backward.nbytes == 128
    assert tl.bytes_moved == 256
    assert tl.comm_ms == pytest.approx(2 * T_128 / MS, abs=1e-12)
    assert tl.compute_ms == pytest.approx(6.5, abs=1e-12)
    # device 1 keeps the 128 bytes it receives for the backward pass; the backward transients: fc's output
    # gradient (128; the batch gets none) on device 0, the loss's scalar and input gradients on device 1
    assert tl.peak_memory_bytes == (3 * 288 + 128 + 128 + 128, 128 + 4 + 128 + (4 + 128))


def test_a_transfer_keeps_cpu_processes_from_computing_but_overlaps_on_gpus():
    """fc_a and fc_b both run on device 0 and feed an add on device 1. fc_a's output is ready at 1 ms,
    while device 0 computes fc_b (1-2 ms): a GPU sends it at once (its copy engine overlaps), a CPU process
    only once fc_b is done (gloo copies with the core that computes)."""
    net = Net("two_branches", 4)
    x = net.input("x", (4, 8))
    a, b = net.linear("fc_a", x, 8), net.linear("fc_b", x, 8)
    net.mse("loss", net.add2("add", a, b), net.input("y", (4, 8), role="target"))
    graph = net.graph()
    strategy = Strategy({"x": on(0), "fc_a": on(0), "fc_b": on(0), "add": on(1), "y": on(1), "loss": on(1)})
    for topology, start, devices in (("cpu-2", 2 * MS, (0, 1)), ("p100-1x2", 1 * MS, ())):
        tl = simulate(graph, strategy, load_topology(topology), COSTS)
        assert times(tl)["fc_b fwd[0]"] == (1 * MS, 2 * MS)
        (send,) = [r for r in tl.tasks() if r.name == "fc_a -> add"]
        assert round(send.start_ms * MS) == start and send.devices == devices, topology


def test_transfers_sharing_a_link_run_one_at_a_time():
    """Two producers on processes 0 and 2 feed an add on process 1: both transfers need the hub -> 1 link,
    so the second waits for the first (lower input slot first); in backward both gradients leave over
    1 -> hub, the one of the later op first (its backward position comes first)."""
    net = Net("fan_in", 4)
    a = net.linear("fa", net.input("xa", (4, 8)), 8)
    b = net.linear("fb", net.input("xb", (4, 8)), 8)
    s = net.add2("add", a, b)
    net.mse("loss", s, net.input("y", (4, 8), role="target"))
    graph = net.graph()
    strategy = Strategy({"xa": on(0), "fa": on(0), "xb": on(2), "fb": on(2), "add": on(1), "y": on(1),
                         "loss": on(1)})
    tl = simulate(graph, strategy, load_topology("cpu-3"), COSTS)
    T = T_128
    f = 1 * MS + 2 * T  # add starts when the second transfer lands
    b0 = f + 2 * MS + 4 * MS  # add and loss forward (1 ms each), then loss and add backward (2 ms each)
    assert times(tl) == {
        "fa fwd[0]": (0, 1 * MS),
        "fb fwd[0]": (0, 1 * MS),
        "fa -> add": (1 * MS, 1 * MS + T),
        "fb -> add": (1 * MS + T, f),
        "add fwd[0]": (f, f + 1 * MS),
        "loss fwd[0]": (f + 1 * MS, f + 2 * MS),
        "loss bwd[0]": (f + 2 * MS, f + 4 * MS),
        "add bwd[0]": (f + 4 * MS, b0),
        "grad add -> fb": (b0, b0 + T),
        "grad add -> fa": (b0 + T, b0 + 2 * T),
        "fb bwd[0]": (b0 + T, b0 + T + 2 * MS),
        "fa bwd[0]": (b0 + 2 * T, b0 + 2 * T + 2 * MS),
        "fb update[device 2]": (b0 + T + 2 * MS, b0 + T + 2_500_000),
        "fa update[device 0]": (b0 + 2 * T + 2 * MS, b0 + 2 * T + 2_500_000),
        "step end[device 0]": (b0 + 2 * T + 2 * MS,) * 2,
        "step end[device 1]": (b0 + 2 * T,) * 2,  # both gradients sent
        "step end[device 2]": (b0 + T + 2 * MS,) * 2,
    }
    assert tl.iteration_time_ns == b0 + 2 * T + 2_500_000


def test_data_parallel_gradient_sync_is_a_ring_all_reduce_before_the_updates():
    """fc and loss split 2 ways on the sample dim: each process runs half the batch, then fc's 288 bytes of
    gradient are all-reduced over processes 0 and 1 (ring: 2 hops 0 -> 1, 1 -> 0, each over 2 links;
    2(n-1) = 2 steps of a 144-byte chunk; loopback is half duplex, so in every step each process's link
    pair carries both hops' chunks), then each process updates its replica."""
    graph = linear_loss()
    dp2 = on(0, 1, sample=2)
    strategy = Strategy({"x": dp2, "fc": dp2, "y": dp2, "loss": dp2})
    topo = load_topology("cpu-2")
    tl = simulate(graph, strategy, topo, COSTS, symmetry=False)  # every device's tasks, not one replica's
    sync_ns = round(2 * (40_000 + 2 * 144 / 5))
    assert sync_ns == 80_115
    got = times(tl)
    for p in (0, 1):
        assert got[f"fc fwd[{p}]"] == (0, 1 * MS)
        assert got[f"loss fwd[{p}]"] == (1 * MS, 2 * MS)
        assert got[f"loss bwd[{p}]"] == (2 * MS, 4 * MS)
        assert got[f"fc bwd[{p}]"] == (4 * MS, 6 * MS)
        assert got[f"fc update[device {p}]"] == (6 * MS + sync_ns, 6_500_000 + sync_ns)
        assert got[f"step end[device {p}]"] == (6 * MS + sync_ns,) * 2
    (sync,) = [r for r in tl.tasks() if r.category == "allreduce"]
    assert (round(sync.start_ms * MS), round(sync.end_ms * MS)) == (6 * MS, 6 * MS + sync_ns)
    # every link of the ring, a link and its reverse being one resource
    assert set(sync.links) == {topo.capacity(i) for i in topo.route(0, 1) + topo.route(1, 0)}
    assert sync.devices == (0, 1)  # and both processes, which reduce with their own cores
    assert sync.nbytes == 2 * (2 - 1) * 288  # each process sends 2(n-1)/n of the 288-byte buffer
    assert len(got) == 13  # 5 tasks and a step end per process, and the all-reduce
    assert tl.iteration_time_ns == 6_500_000 + sync_ns
    assert tl.sync_ms == pytest.approx(sync_ns / MS, abs=1e-12)
    assert tl.compute_ms == pytest.approx(6.5, abs=1e-12)
    assert tl.bytes_moved == 576


def test_ring_all_reduce_formula_on_three_processes():
    """Ring 0 -> 1 -> 2 -> 0 on cpu-3: each hop crosses 2 links; every process's half-duplex link pair
    carries the chunk it sends and the chunk it receives in each step; 4 steps."""
    comm = Comm(load_topology("cpu-3"))
    res, ns = comm.collective((0, 1, 2), 3000)
    assert ns == round(4 * (40_000 + 2 * 1000 / 5))
    # the three processes (busy while they communicate) and the hub's three link pairs
    assert res[:3] == (0, 1, 2) and len(res) == 6 and min(res[3:]) >= 3
    # all-gather and reduce-scatter take n - 1 = 2 steps
    assert comm.collective((0, 1, 2), 3000, "allgather")[1] == round(2 * (40_000 + 2 * 1000 / 5))
    # across nodes on k80-16x4: a step lasts as long as the slowest hop (latency of its route plus the
    # chunk over its narrowest link, divided by the number of hops sharing that link)
    topo = load_topology("k80-16x4")
    comm = Comm(topo)
    ring, tree = comm.algorithms((0, 1, 4))
    chunk = 1_000_000
    hops = [topo.route(0, 1), topo.route(1, 4), topo.route(4, 0)]
    load: dict[int, int] = {}
    for hop in hops:
        for link in hop:
            load[link] = load.get(link, 0) + 1
    step = max(sum(topo.links[i].latency_us * 1e3 for i in hop)
               + chunk * max(load[i] / topo.links[i].bandwidth_gbps for i in hop) for hop in hops)
    assert round(ring.wire_ns(3_000_000)) == round(4 * step)
    assert set(ring.resources) == {topo.num_devices + i for i in load}
    # over two nodes NCCL's double binary tree sends less through the network than the ring (B each way
    # against 4 steps of B/3): the collective takes it (tests/test_comm_nccl.py checks the tree's figures)
    assert tree.wire_ns(3_000_000) < ring.wire_ns(3_000_000)
    assert comm.collective((0, 1, 4), 3_000_000)[1] == round(tree.wire_ns(3_000_000))


def test_full_and_propose_agree_on_a_hand_checked_case():
    """The delta path on a hand-checked case: moving the loss to process 1 adds the two transfers."""
    graph = linear_loss()
    topo = load_topology("cpu-2")
    sim = Simulator(graph, topo, COSTS)
    sim.full(Strategy({name: on(0) for name in ("x", "fc", "y", "loss")}))
    assert sim.iteration_time_ms == 6.5
    sim.full(Strategy({"x": on(0), "fc": on(0), "y": on(1), "loss": on(0)}))
    # fc's output travels to the loss on process 1 and its gradient back; the target y is read there
    assert sim.propose("loss", on(1)) == (6_500_000 + 2 * T_128) / MS
    assert sim.timeline().bytes_moved == 256
    sim.reject()
    # the batch is loaded where it is read: y's placement moves nothing
    assert sim.iteration_time_ms == 6.5
    assert sim.timeline().bytes_moved == 0


def test_an_exchange_both_ways_between_two_processes_shares_the_loopback():
    """fc split 2 ways on the sample dim over processes 0, 1 feeds the loss on the other process each:
    part 0's rows go 0 -> 1 and part 1's go 1 -> 0 in one exchange (the runtime's all-to-all). Loopback
    is half duplex (both directions are copies by the same cores), so the exchange lasts one transfer of
    both pieces' bytes (128), and it is one task."""
    graph = linear_loss()
    topo = load_topology("cpu-2")
    strategy = Strategy({"x": on(0, 1, sample=2), "fc": on(0, 1, sample=2), "y": on(1, 0, sample=2),
                         "loss": on(1, 0, sample=2)})
    tl = simulate(graph, strategy, topo, COSTS)
    got = times(tl)
    assert got["fc -> loss"] == (1 * MS, 1 * MS + T_128)
    (fwd,) = [r for r in tl.tasks() if r.name == "fc -> loss"]
    assert fwd.nbytes == 128 and fwd.devices == (0, 1)
    assert set(fwd.links) == {topo.capacity(i) for i in topo.route(0, 1) + topo.route(1, 0)}
    assert got["loss fwd[0]"][0] == got["loss fwd[1]"][0] == 1 * MS + T_128


def test_exchange_pieces_that_share_a_link_queue_on_it():
    comm = Comm(load_topology("cpu-2"))
    one_way, t_one = comm.exchange([(0, 1, 1000)])
    assert (one_way, t_one) == comm.transfer(0, 1, 1000)
    # loopback is half duplex: both ways take as long as one way twice, as one direction twice does
    assert comm.exchange([(0, 1, 1000), (1, 0, 1000)])[1] == comm.transfer(0, 1, 2000)[1]
    assert comm.exchange([(0, 1, 1000), (0, 1, 1000)])[1] == comm.transfer(0, 1, 2000)[1]
    # on cpu-3, 0 -> 1 and 2 -> 1 share the hub's link into 1: 2000 bytes cross it
    three = Comm(load_topology("cpu-3"))
    assert three.exchange([(0, 1, 1000), (2, 1, 1000)])[1] == round(40_000 + 2000 / 5)
    with pytest.raises(ValueError, match="at least one piece"):
        three.exchange([])


def test_full_duplex_links_carry_both_directions_at_once():
    """NVLink is full duplex: each direction is its own link, so an exchange both ways costs one way,
    and a ring all-reduce's hops in opposite directions do not queue on each other."""
    topo = load_topology("v100-1x8")
    assert all(topo.capacity(i) == i for i in range(len(topo.links)))
    comm = Comm(topo)
    _, t_one = comm.transfer(0, 1, 10**6)
    assert comm.exchange([(0, 1, 10**6), (1, 0, 10**6)])[1] == t_one
    # on loopback the two directions of one process's attachment are one resource
    cpu = load_topology("cpu-2")
    assert sorted({cpu.capacity(i) for i in range(len(cpu.links))}) == [0, 2]


def test_exchange_copies_are_charged_per_byte_a_process_handles():
    """`exchange_ms_per_gb` prices the runtime's packing and unpacking: per byte the busiest process
    sends plus receives (here process 1: 1000 in from 0, 3000 out to 0 and 2)."""
    topo = load_topology("cpu-3")
    plain = Comm(topo)
    copies = Comm(topo, CommOverhead(exchange_ms_per_gb=2000.0))  # 2 ns per byte
    pieces = [(0, 1, 1000), (1, 0, 2000), (1, 2, 1000)]
    assert copies.exchange(pieces)[1] - plain.exchange(pieces)[1] == 2 * 4000
    assert copies.exchange([(0, 1, 500)])[1] - plain.exchange([(0, 1, 500)])[1] == 2 * 500
    # collectives are not exchanges: unchanged
    assert copies.collective((0, 1, 2), 3000) == plain.collective((0, 1, 2), 3000)


def test_the_runtimes_communication_overhead_adds_to_exchanges_and_all_reduces():
    """A cost model's `comm_overhead` (a machine profile's fit) lengthens each exchange by its fixed cost
    (plus the synchronizing cost where both processes send) and each all-reduce by the synchronizing
    cost plus its buffer's bytes x cost per GB; nothing else."""
    graph = linear_loss()
    topo = load_topology("cpu-2")
    overhead = CommOverhead(exchange_us=100.0, sync_us=40.0, allreduce_ms_per_gb=5000.0)
    charged = FixedCostModel(fwd_each_ms=1.0, bwd_each_ms=2.0, update_each_ms=0.5, comm_overhead=overhead)
    # the exchange both ways of the two-way test; one way: fc on 0, the loss on 1
    split = Strategy({"x": on(0, 1, sample=2), "fc": on(0, 1, sample=2), "y": on(1, 0, sample=2),
                      "loss": on(1, 0, sample=2)})
    one_way = Strategy({"x": on(0), "fc": on(0), "y": on(1), "loss": on(1)})
    for strategy, extra_ns in ((split, 140_000), (one_way, 100_000)):
        plain, charged_times = (times(simulate(graph, strategy, topo, m)) for m in (COSTS, charged))
        for name in ("fc -> loss", "grad loss -> fc"):
            start, end = charged_times[name]
            assert end - start == (plain[name][1] - plain[name][0]) + extra_ns
    # dp: the 288-byte gradient all-reduce, no exchange
    dp2 = on(0, 1, sample=2)
    dp = Strategy({"x": dp2, "fc": dp2, "y": dp2, "loss": dp2})
    base, slow = (simulate(graph, dp, topo, m) for m in (COSTS, charged))
    assert slow.iteration_time_ns - base.iteration_time_ns == 40_000 + round(288 * 5.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        CommOverhead(exchange_us=-1.0)


def _two_linears(batch: int = 4):
    """x[4, 8] -> fc1 -> fc2 (linear 8 -> 8 each) -> mse against y."""
    net = Net("two_linears", batch)
    h = net.linear("fc2", net.linear("fc1", net.input("x", (batch, 8)), 8), 8)
    net.mse("loss", h, net.input("y", (batch, 8), role="target"))
    return net.graph()


def test_updates_wait_for_every_all_reduce_of_the_step():
    """Data parallel over two GPUs with one bucket per linear: fc2's gradients are all-reduced while fc1's
    backward runs, fc1's after it. A rank steps its optimizer once its walk is over and every all-reduce has
    finished (the runtime's `sync.finish()` before `optimizer.step()`), so fc2's update does not start in
    the shadow of fc1's all-reduce: both updates follow the last all-reduce, one after the other."""
    dp2 = on(0, 1, sample=2)
    graph = _two_linears()
    setup = TrainSetup(bucket_mb=1e-6)  # every parameter unit its own bucket
    tl = simulate(graph, Strategy({name: dp2 for name in ("x", "fc1", "fc2", "y", "loss")}),
                  load_topology("p100-1x2"), COSTS, setup=setup, symmetry=False)
    got = times(tl)
    syncs = [r for r in tl.tasks() if r.category == "allreduce"]
    assert len(syncs) == 2
    last = max(round(r.end_ms * MS) for r in syncs)
    assert last > got["fc1 bwd[0]"][1]  # fc1's own all-reduce runs after its backward
    for p in (0, 1):
        assert got[f"step end[device {p}]"] == (last, last)
        starts = sorted(got[f"{op} update[device {p}]"][0] for op in ("fc1", "fc2"))
        assert starts == [last, last + MS // 2]  # one update after the other, 0.5 ms each
    assert tl.iteration_time_ns == last + MS


def test_loss_scaling_makes_every_rank_wait_for_the_overflow_check():
    """fc1 on GPU 0, fc2 and the loss on GPU 1: GPU 1 is done once fc2's input gradient has left, GPU 0
    two backward milliseconds later. In fp32 GPU 1 updates fc2 at once; in fp16 every rank first learns
    whether any rank's gradients overflowed (the loss scaler's all-reduce of a flag over every rank), so
    fc2's update waits for GPU 0's end and that all-reduce's latency."""
    topo = load_topology("p100-1x2")
    strategy = Strategy({"x": on(0), "fc1": on(0), "fc2": on(1), "y": on(1), "loss": on(1)})
    graph = _two_linears()
    fp32 = times(simulate(graph, strategy, topo, COSTS))
    assert "overflow check" not in fp32
    assert fp32["fc2 update[device 1]"][0] == fp32["step end[device 1]"][1] < fp32["step end[device 0]"][1]
    assert fp32["fc1 update[device 0]"][0] == fp32["step end[device 0]"][1]
    fp16 = times(simulate(graph, strategy, topo, COSTS, setup=TrainSetup(precision="fp16")))
    end0, end1 = fp16["step end[device 0]"][1], fp16["step end[device 1]"][1]
    assert end1 < end0
    latency = Comm(topo).collective((0, 1), 4)[1]
    assert latency > 0
    assert fp16["overflow check"] == (end0, end0 + latency)
    assert fp16["fc1 update[device 0]"][0] == fp16["fc2 update[device 1]"][0] == end0 + latency
