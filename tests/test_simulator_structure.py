"""Structural counts: which exchanges, reductions and all-reduces a strategy creates, and on which links.

All on p100-4x4 devices 0-3 (node 0: NVLink all-to-all, so a piece p -> c crosses exactly the one link
``route(p, c)``), fixed costs. The pieces of one edge that travel in one pass form one exchange task
(the runtime's packed all-to-all): its bytes are the pieces' sum, its links the union of their routes.
"""

from __future__ import annotations

from collections import Counter

from test_simulator_support import Net

from simulator import FixedCostModel, simulate
from simulator.comm import Comm
from soap.config import ParallelConfig
from soap.strategy import Strategy
from soap.topology import load_topology

TOPO = load_topology("p100-4x4")
COSTS = FixedCostModel(fwd_each_ms=1.0, update_each_ms=0.1, reduce_each_ms=0.1)
F32 = 4


def on(*devices: int, **degrees: int) -> ParallelConfig:
    return ParallelConfig(degrees=degrees, devices=devices)


def records(tl, category: str, prefix: str = "") -> list:
    return [r for r in tl.tasks() if r.category == category and r.name.startswith(prefix)]


def _two_linears(batch: int = 8, width: int = 16):
    net = Net("two_linears", batch)
    h = net.linear("fc1", net.input("x", (batch, width)), width)
    h = net.linear("fc2", h, width)
    net.mse("loss", h, net.input("y", (batch, width), role="target"))
    return net.graph()


def test_sample_split_feeding_a_parameter_split_is_an_all_gather_in_one_exchange():
    """fc1 split 4 ways on the sample dim, fc2 4 ways on out_features: every fc2 part needs the whole
    input, so each of the 4 x 3 ordered device pairs carries one row block (2 rows x 16 floats), all in
    one exchange; the gradients come back the same way, and each fc1 part adds the 4 it receives."""
    graph = _two_linears()
    dev = (0, 1, 2, 3)
    strategy = Strategy({"x": on(*dev, sample=4), "fc1": on(*dev, sample=4), "fc2": on(*dev, out_features=4),
                         "y": on(*dev, sample=4), "loss": on(*dev, sample=4)})
    tl = simulate(graph, strategy, TOPO, COSTS)
    (fwd,) = records(tl, "transfer", "fc1 -> fc2")
    block = 2 * 16 * F32
    assert fwd.nbytes == 12 * block
    pairs = Counter((TOPO.links[link].src, TOPO.links[link].dst) for link in fwd.links)
    assert pairs == Counter({(f"gpu{p}", f"gpu{c}"): 1 for p in dev for c in dev if p != c})
    assert set(fwd.links) == {link for p in dev for c in dev if p != c for link in TOPO.route(p, c)}
    # every link carries one block at once: the exchange takes one block's transfer, not twelve
    comm = Comm(TOPO)
    one_block = max(comm.transfer(p, c, block)[1] for p in dev for c in dev if p != c)
    assert round((fwd.end_ms - fwd.start_ms) * 1e6) == one_block
    (bwd,) = records(tl, "transfer", "grad fc2 -> fc1")
    assert bwd.nbytes == 12 * block and set(bwd.links) == set(fwd.links)
    sums = records(tl, "reduce", "fc1 sum grads")
    assert sorted(r.devices for r in sums) == [(0,), (1,), (2,), (3,)]
    # fc1 is replicated (sample split): one all-reduce over 0..3; fc2 is sharded: none
    syncs = records(tl, "allreduce")
    assert len(syncs) == 1 and syncs[0].name.endswith("devices 0..3")
    # fc2 -> loss: out_features parts to sample parts: again 12 pieces of 2 x 4 floats, one exchange
    (to_loss,) = records(tl, "transfer", "fc2 -> loss")
    assert to_loss.nbytes == 12 * 2 * 4 * F32
    assert tl.bytes_moved == sum(r.nbytes for r in tl.tasks())


def test_matching_splits_on_the_same_devices_move_nothing():
    graph = _two_linears()
    dp4 = on(0, 1, 2, 3, sample=4)
    tl = simulate(graph, Strategy({name: dp4 for name in ("x", "fc1", "fc2", "y", "loss")}), TOPO, COSTS)
    assert records(tl, "transfer") == []
    assert records(tl, "reduce") == []
    assert [r.name for r in records(tl, "allreduce")] == ["allreduce bucket 0 devices 0..3"]
    # the same split on other devices: each part moves to its twin, one exchange (and one gradient back)
    moved = Strategy({"x": dp4, "fc1": dp4, "fc2": on(4, 5, 6, 7, sample=4), "y": on(4, 5, 6, 7, sample=4),
                      "loss": on(4, 5, 6, 7, sample=4)})
    tl = simulate(graph, moved, TOPO, COSTS)
    (fwd,) = records(tl, "transfer", "fc1 -> fc2")
    (bwd,) = records(tl, "transfer", "grad fc2 -> fc1")
    assert fwd.nbytes == bwd.nbytes == 8 * 16 * F32
    assert set(fwd.links) == {link for p in range(4) for link in TOPO.route(p, p + 4)}


def test_height_split_convolution_exchanges_one_row_halo_each_way():
    """conv0 -> conv1 (3x3, padding 1), both split 2 ways on height over devices 0, 1: conv1's top half
    needs the first row of conv0's bottom half and vice versa: one row (N x C x 1 x W) each way."""
    n, c, h, w = 2, 4, 8, 8
    net = Net("halo", n)
    x = net.input("x", (n, 3, h, w))
    a = net.conv("conv0", x, c)
    b = net.conv("conv1", a, c)
    net.mse("loss", b, net.input("y", (n, c, h, w), role="target"))
    graph = net.graph()
    split = on(0, 1, height=2)
    strategy = Strategy({"x": on(0, 1, d2=2), "conv0": split, "conv1": split, "y": on(0),
                         "loss": on(0)})
    tl = simulate(graph, strategy, TOPO, COSTS)
    (halo,) = records(tl, "transfer", "conv0 -> conv1")
    row = n * c * 1 * w * F32
    assert halo.nbytes == 2 * row
    assert set(halo.links) == set(TOPO.route(0, 1) + TOPO.route(1, 0))
    # the two directions use different links: the exchange takes as long as one row's transfer
    assert round((halo.end_ms - halo.start_ms) * 1e6) == Comm(TOPO).transfer(0, 1, row)[1]
    # x is split on height too, but each device's loader reads the halo rows its conv0 part needs: the
    # batch never travels, and what a device reads (its half plus one row) counts in its memory
    assert records(tl, "transfer", "x -> conv0") == []
    split_x = simulate(graph, strategy.with_config("x", on(0)), TOPO, COSTS)
    assert split_x.iteration_time_ms == tl.iteration_time_ms
    assert split_x.peak_memory_bytes == tl.peak_memory_bytes
    # backward: the halo gradients come back, and each conv0 part adds the overlapping contributions
    assert [r.nbytes for r in records(tl, "transfer", "grad conv1 -> conv0")] == [2 * row]
    assert sorted(r.devices for r in records(tl, "reduce", "conv0 sum grads")) == [(0,), (1,)]
    # both convolutions are replicated over the height parts: their weight gradients are all-reduced
    assert {r.name for r in records(tl, "allreduce")} == {"allreduce bucket 0 devices 0..1"}


def test_reduction_split_makes_partial_sums_that_are_gathered_and_added():
    """fc split 2 ways on in_features over devices 0, 1: each part holds a partial sum of the whole
    output; the loss on device 0 receives part 1's partial (device 1 -> 0) and adds the two."""
    batch, width = 8, 16
    graph = _two_linears(batch, width)
    strategy = Strategy({"x": on(0), "fc1": on(0), "fc2": on(0, 1, in_features=2), "y": on(0),
                         "loss": on(0)})
    tl = simulate(graph, strategy, TOPO, COSTS)
    partials = records(tl, "transfer", "fc2 -> loss")
    assert [(r.name, r.nbytes, r.links) for r in partials] == [
        ("fc2 -> loss", batch * width * F32, TOPO.route(1, 0))]
    (add,) = records(tl, "reduce", "loss sum input 0")
    assert add.devices == (0,)
    start = {r.name: r.start_ms for r in tl.tasks()}
    end = {r.name: r.end_ms for r in tl.tasks()}
    assert start["loss sum input 0 [0]"] >= max(end["fc2 -> loss"], end["fc2 fwd[0]"])
    assert start["loss fwd[0]"] >= end["loss sum input 0 [0]"]
    # fc2's input: part 1 reads the second half of fc1's columns, which live on device 0
    (cols,) = records(tl, "transfer", "fc1 -> fc2")
    assert cols.name == "fc1 -> fc2" and cols.links == TOPO.route(0, 1) and cols.nbytes == batch * (width // 2) * F32
    # the weight is sharded by columns, not replicated: no all-reduce at all
    assert records(tl, "allreduce") == []
    # backward: the loss's gradient goes to both parts whole (the sum's adjoint is a copy)
    assert [r.name for r in records(tl, "transfer", "grad loss -> fc2")] == ["grad loss -> fc2"]


def test_gradient_sync_only_among_devices_that_replicate_a_parameter():
    """fc2 split 2 x 2 (sample, out_features) over 0..3: parts (s0, o0), (s0, o1), (s1, o0), (s1, o1) on
    devices 0, 1, 2, 3, so weight rows o0 live on 0 and 2, rows o1 on 1 and 3: two all-reduces of half
    the weight each, over exactly those pairs, on exactly the links of their rings."""
    graph = _two_linears()
    dp4 = on(0, 1, 2, 3, sample=4)
    strategy = Strategy({"x": dp4, "fc1": on(0), "fc2": on(0, 1, 2, 3, sample=2, out_features=2),
                         "y": dp4, "loss": dp4})
    tl = simulate(graph, strategy, TOPO, COSTS)
    syncs = {r.name: r for r in records(tl, "allreduce")}
    assert set(syncs) == {"allreduce bucket 0 devices 0..2", "allreduce bucket 0 devices 1..3"}
    half = (8 * 16 + 8) * F32  # 8 weight rows of 16 and 8 bias entries
    for name, (a, b) in (("allreduce bucket 0 devices 0..2", (0, 2)), ("allreduce bucket 0 devices 1..3", (1, 3))):
        r = syncs[name]
        assert r.nbytes == 2 * (2 - 1) * half
        assert set(r.links) == set(TOPO.route(a, b)) | set(TOPO.route(b, a))
        assert r.devices == ()
    # fc1 whole on device 0: nothing to synchronize; a pure parameter split: nothing either
    tp = Strategy({"x": on(0), "fc1": on(0, 1, 2, 3, out_features=4), "fc2": on(0, 1, 2, 3, out_features=4),
                   "y": on(0), "loss": on(0)})
    assert records(simulate(graph, tp, TOPO, COSTS), "allreduce") == []
    # the updates of replicated parts wait for their all-reduce
    start = {r.name: r.start_ms for r in tl.tasks()}
    assert start["fc2 update[device 0]"] >= syncs["allreduce bucket 0 devices 0..2"].end_ms
    assert start["fc2 update[device 3]"] >= syncs["allreduce bucket 0 devices 1..3"].end_ms


def test_task_counts_per_category():
    """Per part: one forward, one backward (where a gradient arrives), one update (where it holds
    parameters); input ops have no tasks; one step end per device of the topology (16)."""
    graph = _two_linears()
    dp4 = on(0, 1, 2, 3, sample=4)
    tl = simulate(graph, Strategy({name: dp4 for name in ("x", "fc1", "fc2", "y", "loss")}), TOPO, COSTS)
    counts = Counter(r.category for r in tl.tasks())
    assert counts == {"forward": 12, "backward": 12, "update": 8, "allreduce": 1, "step end": 16}
    assert tl.num_tasks == 49
