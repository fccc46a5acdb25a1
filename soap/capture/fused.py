"""Capture, stage 5: a fused projection whose output is split becomes one linear per piece.

Models often compute q, k and v with one linear layer and split its output (``qkv(x).split(d, dim=-1)``:
GPT-2's ``c_attn``, soapflow's zoo transformer). The fused weight holds q, k and v in consecutive blocks of
its output axis, so no split of that one linear gives each device the same heads of q, k and v: a
head-parallel attention would then need its inputs exchanged. Megatron-LM stores its fused weight per
head for this reason. Here the graph says the same thing without touching the model: the linear becomes
one linear per piece of the split, each over its block of the fused parameters (`ParamSpec.offset`), and
the reshapes between the linear and the split are repeated per piece. A piece's ops are named after the
fused ones with a letter per piece (``attn.qkv.a``, ``.b``, ``.c``). What runs is the same arithmetic
(each output column of a linear depends only on its own weight column and bias entry) and the state dict
is unchanged: checkpoints and parameters keep their fused names and shapes.

The rule, `split_fused_linears`: a ``linear`` op whose parameters no other op reads, whose output reaches
exactly one ``split`` on its last axis through reshapes that keep that axis (each used once), is replaced
as above. So is one whose output reaches, through such reshapes, a reshape that factors the last axis
into (pieces, ...) read only by one squeezing select per piece (``qkv(x).reshape(n, t, 3, heads,
d).unbind(2)``, what tracing makes of timm's attention): piece i's reshape drops the pieces axis and
stands for select i. FLOPs are shared in proportion to the pieces' widths; bytes are counted per new op as the
builder counts them.

Imports soap.graph and soap.registry only.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

from soap.graph import Operator, ParamSpec, TensorRef, TensorSpec
from soap.registry import op_def


def split_fused_linears(ops: list[Operator]) -> list[Operator]:
    """`ops` (topological order) with every fused projection split per piece (module docstring)."""
    by_name = {op.name: op for op in ops}
    users: dict[str, list[tuple[str, int, int]]] = {}
    for op in ops:
        for slot, ref in enumerate(op.inputs):
            users.setdefault(ref.op, []).append((op.name, slot, ref.index))
    param_users = Counter(p.fqn for op in ops for p in op.params.values())
    taken = set(by_name)
    replaced: dict[str, list[Operator]] = {}  # op name -> the ops that stand for it
    dropped: set[str] = set()
    renamed: dict[tuple[str, int], TensorRef] = {}  # split output -> the new tensor
    for op in ops:
        chain = _fused_chain(op, by_name, users, param_users)
        if chain is None:
            continue
        reshapes, end = chain
        if isinstance(end, Operator):  # a split of the last axis
            sizes = [int(s) for s in end.attrs["sizes"]]
            outs = [(end.name, i) for i in range(len(sizes))]
            dropped.add(end.name)
        else:  # a reshape factoring the last axis into (pieces, ...), then a select per piece
            factor, selects = end
            sizes = [op.outputs[0].shape[-1] // len(selects)] * len(selects)
            outs = [(s.name, 0) for s in selects]
            dropped |= {factor.name, *(s.name for s in selects)}
        start = 0
        for i, size in enumerate(sizes):
            name = _fresh(f"{op.name}.{_letter(i)}", taken)
            piece = _linear_piece(op, name, start, size)
            replaced.setdefault(op.name, []).append(piece)
            last = piece
            for r in reshapes:
                last = _reshape_piece(r, _fresh(f"{r.name}.{_letter(i)}", taken), TensorRef(op=last.name),
                                      (*r.attrs["input_shapes"][0][:-1], size), (*r.outputs[0].shape[:-1], size))
                replaced.setdefault(r.name, []).append(last)
            if not isinstance(end, Operator):
                # the factoring reshape without its pieces axis (`p`: where the select cut)
                p = selects[i].attrs["axis"]
                shape = factor.outputs[0].shape
                last = _reshape_piece(factor, _fresh(f"{factor.name}.{_letter(i)}", taken), TensorRef(op=last.name),
                                      (*factor.attrs["input_shapes"][0][:-1], size), (*shape[:p], *shape[p + 1:]))
                replaced.setdefault(factor.name, []).append(last)
            renamed[outs[i]] = TensorRef(op=last.name)
            start += size
    if not replaced:
        return ops
    out: list[Operator] = []
    for op in ops:
        if op.name in replaced:
            out.extend(replaced[op.name])
            continue
        if op.name in dropped:
            continue
        inputs = tuple(renamed.get((r.op, r.index), r) for r in op.inputs)
        out.append(op if inputs == op.inputs else dataclasses.replace(op, inputs=inputs))
    return out


def _fused_chain(op: Operator, by_name: dict[str, Operator], users: dict[str, list[tuple[str, int, int]]],
                 param_users: Counter) -> tuple[list[Operator], Any] | None:
    """(the reshapes keeping the last axis, then the split; or then the factoring reshape and its selects
    in piece order) after linear `op` when the rule applies, else None."""
    if op.kind != "linear" or not op.params or any(param_users[p.fqn] > 1 or p.offset for p in op.params.values()):
        return None
    width = op.outputs[0].shape[-1]
    chain: list[Operator] = []
    current = op
    while True:
        uses = users.get(current.name, [])
        if len(uses) != 1:
            return None
        nxt = by_name[uses[0][0]]
        if nxt.kind == "reshape" and nxt.outputs[0].shape and nxt.outputs[0].shape[-1] == width:
            chain.append(nxt)
            current = nxt
            continue
        if nxt.kind == "split" and op_def("split").axis(nxt) == len(nxt.outputs[0].shape) - 1 \
                and len(nxt.attrs["sizes"]) > 1 and sum(int(s) for s in nxt.attrs["sizes"]) == width:
            return chain, nxt
        selects = _selects_of(nxt, current, by_name, users, width) if nxt.kind == "reshape" else None
        return (chain, (nxt, selects)) if selects is not None else None


def _selects_of(factor: Operator, source: Operator, by_name: dict[str, Operator],
                users: dict[str, list[tuple[str, int, int]]], width: int) -> list[Operator] | None:
    """The selects, in piece order, where reshape `factor` turns `source`'s last axis (of `width`) into
    (pieces, ...) and one squeezing select per piece reads it; else None."""
    lead = source.outputs[0].shape[:-1]
    shape = factor.outputs[0].shape
    if shape[:len(lead)] != lead or len(shape) < len(lead) + 2 or shape[len(lead)] < 2 \
            or math.prod(shape[len(lead):]) != width:
        return None
    count = shape[len(lead)]
    found: dict[int, Operator] = {}
    for name, _, _ in users.get(factor.name, []):
        s = by_name[name]
        a = s.attrs
        if s.kind != "slice" or a["axis"] != len(lead) or not a["squeeze"] or a["step"] != 1 \
                or a["stop"] != a["start"] + 1 or a["start"] in found:
            return None
        found[a["start"]] = s
    return [found[i] for i in range(count)] if sorted(found) == list(range(count)) else None


def _letter(i: int) -> str:
    """a, b, .., z, aa, ab, ..: pieces are named by letter, since numbers in names number the copies of
    repeated blocks (`search.structure`)."""
    out = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        out = chr(97 + r) + out
    return out


def _fresh(base: str, taken: set[str]) -> str:
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def _block(spec: ParamSpec, axis: int, start: int, size: int) -> ParamSpec:
    shape = list(spec.shape)
    shape[axis] = size
    offset = [0] * len(shape)
    offset[axis] = start
    return ParamSpec(shape=tuple(shape), fqn=spec.fqn, dtype=spec.dtype, offset=tuple(offset),
                     whole_shape=spec.shape, trainable=spec.trainable)


def _linear_piece(op: Operator, name: str, start: int, size: int) -> Operator:
    width = op.outputs[0].shape[-1]
    out_axis = 1 if op.attrs.get("transposed", False) else 0
    params = {k: _block(p, out_axis if k == "weight" else 0, start, size) for k, p in op.params.items()}
    output = TensorSpec(shape=(*op.outputs[0].shape[:-1], size), dtype=op.outputs[0].dtype)
    in_bytes = op.fwd_bytes - op.outputs[0].nbytes - op.param_bytes  # what the builder counted
    fwd_bytes = float(in_bytes + output.nbytes + sum(p.nbytes for p in params.values()))
    share = size / width
    return dataclasses.replace(op, name=name, outputs=(output,), params=params,
                               fwd_flops=op.fwd_flops * share, bwd_flops=op.bwd_flops * share,
                               fwd_bytes=fwd_bytes, bwd_bytes=2.0 * fwd_bytes)


def _reshape_piece(op: Operator, name: str, source: TensorRef, in_shape: tuple[int, ...],
                   out_shape: tuple[int, ...]) -> Operator:
    output = TensorSpec(shape=tuple(out_shape), dtype=op.outputs[0].dtype)
    attrs = {**op.attrs, "shape": tuple(output.shape), "input_shapes": (tuple(in_shape),)}
    fwd_bytes = 2.0 * output.nbytes
    return dataclasses.replace(op, name=name, inputs=(source,), outputs=(output,), attrs=attrs,
                               fwd_bytes=fwd_bytes, bwd_bytes=2.0 * fwd_bytes)
