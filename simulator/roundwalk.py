"""The round order's edges (`simulator.taskgraph`'s task list), walked item by item and remembered, so that
a change of a few ops walks again only from their items until the walk is back on its old track.

Owns `RoundWalk` (one walk: per item of the step's order, the edges it made; every `CHECKPOINT` items,
the walk's state) and `walk_rounds` (a walk from scratch, or from an earlier one). The simulator
(`simulator.engine`) hands it the tasks as they are; this module only reads them. Must import only
`soap` and the stdlib.

The walk, as the runtime walks the order (`soap.lowering.step_order`): on every device, the tasks of an
op's rounds but the first it runs in each pass wait for the task before them in the device's share of the
order. At each forward item come the exchanges of its input edges for that round (in slot order) and the
transfers of the states its chunks receive from other devices (`OpPlan.carry_xfers`, in part order), then
its part; at each backward item, its part, then those exchanges' gradients and the states' gradients. An
exchange waits for the task before it on every device that sends or receives in it (a rank issues it when
its walk gets there), but only a receiver's next task waits for the exchange: a rank that only sends goes
on (`runtime.collectives.Outbox`), unless the exchange occupies the sending device itself (a cost model
that charges the copies to the devices, as on CPUs). The first item of each op and pass waits for nothing
(the plain ready order): it only moves its devices' last tasks on.

Again from an earlier walk. The walk's state before an item is, per device, its last task so far; an
item's edges depend only on that state for its devices, and on the item itself (its op's parts and
their tasks, its input edges' exchanges, its carries). A change of some ops, with the order unchanged,
changes only the items of those ops and of the ops their output edges feed. So the walk starts again from
the last remembered state at or before each such item, and goes on until a remembered state equals the
earlier walk's there (task ids are never reused, so equal states mean the same tasks): from there every
item up to the next such one makes the edges it made before, and the walk skips to it. Where the order itself changed,
the walk is made from scratch. Either way the result is exactly the walk from scratch, and only the edges
that differ are handed back (`walk_rounds`' cut and added edges).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from soap.lowering import BACKWARD, EdgeStep, GradFlow, Item, OpStep

Link = tuple[int, int]
CHECKPOINT = 8  # items between two remembered states of a walk


class RoundWalk:
    """One walk of an order: per item, its edges and how many of them may unsort the simulation (the
    simulator's count, `walk_rounds`' `unsorting`); before every `CHECKPOINT`-th item, the walk's state
    (device -> its last task so far). Never changed once made: a later walk shares what it keeps."""

    __slots__ = ("order", "firsts", "positions", "links", "unsorting", "states", "num_unsorting")

    def __init__(self, order: tuple[Item, ...], firsts: list[bool], positions: dict[int, list[int]],
                 links: list[list[Link]], unsorting: list[int], states: list[dict[int, int]]):
        self.order, self.firsts, self.positions = order, firsts, positions
        self.links, self.unsorting, self.states = links, unsorting, states
        self.num_unsorting = sum(unsorting)

    def all_links(self) -> list[Link]:
        """Every edge of the walk, item by item."""
        return [link for item in self.links for link in item]


def walk_rounds(order: tuple[Item, ...], steps: Sequence[OpStep], edges: Sequence[EdgeStep], units: Sequence[Any],
                edge_units: Sequence[Any], flow: GradFlow, res: Sequence[tuple[int, ...]],
                unsorting: Callable[[list[Link]], int], old: RoundWalk | None = None,
                changed: Iterable[int] = ()) -> tuple[RoundWalk, list[Link], list[Link]]:
    """The walk of `order` (module docstring) over op steps `steps` and edge steps `edges` with the tasks of
    `units` and `edge_units` (`fwd` and `bwd`: per part, per exchange; an op unit's `carry`) and the
    resources `res`, the edges of `old` (an earlier walk, or None) it does not make and those it makes
    that `old` did not. Where `old` is a walk of the same
    order before ops `changed` changed (the simulator's positions: the changed ops and those their output
    edges feed), it walks again only from their items (module docstring). `unsorting(links)`: how many of
    an item's edges may unsort the simulation, kept per item."""
    prior = old
    if old is not None and old.order is not order and old.order != order:
        old = None  # another order: walked from scratch
    if old is None:
        firsts, positions = _places(order)
        n = len(order)
        links: list[list[Link]] = [[] for _ in range(n)]
        counts = [0] * n
        states: list[dict[int, int]] = [{} for _ in range(-(-n // CHECKPOINT))]
        at: list[int] = []
    else:
        firsts, positions = old.firsts, old.positions
        at = sorted({k for i in changed for k in positions.get(i, ())})
        if not at:
            return old, [], []
        links, counts, states = list(old.links), list(old.unsorting), list(old.states)
    parts: dict[int, list[list[int]]] = {}  # op -> its parts per round (ops of several rounds)
    xfers: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}  # edge -> round -> (exchange, ranks)
    spans: list[tuple[int, int]] = []  # the ranges of items walked again
    prev: dict[int, int] = {}  # device -> its last task so far
    k, n, nxt = 0, len(order), 0  # at[nxt]: the next changed item
    while k < n:
        if not k % CHECKPOINT:
            c = k // CHECKPOINT
            if old is not None and prev == states[c]:
                # on the old walk's track: every item up to the next changed one makes the edges it made
                if nxt == len(at):
                    break
                jump = at[nxt] // CHECKPOINT * CHECKPOINT
                if jump > k or not spans:
                    k = jump
                    prev = dict(states[jump // CHECKPOINT])
                    spans.append((k, k))
            else:
                states[c] = dict(prev)
        out = _walk_item(order[k], not firsts[k], steps, edges, units, edge_units, flow, res, prev, parts, xfers)
        links[k] = out
        counts[k] = unsorting(out) if out else 0
        if nxt < len(at) and at[nxt] == k:
            nxt += 1
        k += 1
        if spans:
            spans[-1] = (spans[-1][0], k)
    walk = RoundWalk(order, firsts, positions, links, counts, states)
    if old is None:
        return (walk, *_differ([] if prior is None else prior.all_links(), walk.all_links()))
    return (walk, *_differ([link for lo, hi in spans for item in old.links[lo:hi] for link in item],
                           [link for lo, hi in spans for item in links[lo:hi] for link in item]))


def _differ(before: list[Link], after: list[Link]) -> tuple[list[Link], list[Link]]:
    """The edges of `before` not in `after` and those of `after` not in `before`, each in its order."""
    was, now = set(before), set(after)
    return [link for link in before if link not in now], [link for link in after if link not in was]


def _places(order: tuple[Item, ...]) -> tuple[list[bool], dict[int, list[int]]]:
    """Per item of `order`, whether it is the first of its op and pass; per op, its items' positions."""
    seen: set[tuple[int, int]] = set()
    firsts = []
    positions: dict[int, list[int]] = {}
    for k, (phase, i, _) in enumerate(order):
        firsts.append((phase, i) not in seen)
        seen.add((phase, i))
        positions.setdefault(i, []).append(k)
    return firsts, positions


def _walk_item(item: Item, waits: bool, steps: Sequence[OpStep], edges: Sequence[EdgeStep], units: Sequence[Any],
               edge_units: Sequence[Any], flow: GradFlow, res: Sequence[tuple[int, ...]], prev: dict[int, int],
               parts: dict[int, list[list[int]]], xfers: dict[int, dict[int, tuple[int, tuple[int, ...]]]]
               ) -> list[Link]:
    """The edges of one item of the walk (module docstring), `prev` moved on past it; `waits`: it is not the
    first item of its op and pass."""
    phase, i, r = item
    backward = phase == BACKWARD
    step = steps[i]
    tasks = units[i].bwd if backward else units[i].fwd
    if step.num_rounds == 1:
        cs, devs, mine = range(step.num_parts), step.devices, tasks
    else:
        rounds = parts.get(i)
        if rounds is None:
            rounds = parts[i] = [[] for _ in range(step.num_rounds)]
            for c, k in enumerate(step.rounds):
                rounds[k].append(c)
        cs = rounds[r]  # the round's parts
        devs = [step.devices[c] for c in cs]
        mine = [tasks[c] for c in cs]
    exchanges = []
    for e in flow.in_edges[i]:
        if not edges[e].exchanges or (backward and not flow.edges[e].grad):
            continue
        by_round = xfers.get(e)
        if by_round is None:
            by_round = xfers[e] = {x[0]: (k, x[1]) for k, x in enumerate(edges[e].exchanges)}
        if r in by_round:
            k, ranks = by_round[r]
            exchanges.append(((edge_units[e].bwd if backward else edge_units[e].fwd)[k], ranks,
                              edges[e].receivers[k][backward]))
    carry = units[i].carry
    if carry:  # the carries into the round's chunks from other devices, after the edges' exchanges
        for c in cs:
            if c in carry and carry[c][backward] is not None:
                src, dst = step.devices[step.carry_from[c]], step.devices[c]
                exchanges.append((carry[c][backward], (min(src, dst), max(src, dst)), {src if backward else dst}))
    out: list[Link] = []
    if not backward:
        _walk_exchanges(exchanges, waits, prev, out, res)
    if waits:
        for d, t in zip(devs, mine, strict=True):
            a = prev.get(d)
            if a is not None:
                out.append((a, t))
            prev[d] = t
    else:
        prev.update(zip(devs, mine, strict=True))
    if backward:
        _walk_exchanges(exchanges, waits, prev, out, res)
    return out


def _walk_exchanges(exchanges: list[tuple[int, tuple[int, ...], Any]], waits: bool, prev: dict[int, int],
                    out: list[Link], res: Sequence[tuple[int, ...]]) -> None:
    """One item's exchanges in the walk: each (task, ranks, receivers) waits, when the item `waits`, for the
    last task of every rank so far, and becomes the last task of the ranks that receive in it or that it
    occupies."""
    for t, devices, receivers in exchanges:
        if waits:
            out += [(a, t) for a in dict.fromkeys(prev[d] for d in devices if d in prev)]
        for d in devices:
            if d in receivers or d in res[t]:
                prev[d] = t


__all__ = ["CHECKPOINT", "RoundWalk", "walk_rounds"]
