"""Capture, stage 4: the operator calls of a traced graph emitted in order as `Operator`s.

Owns `_Builder`: input ops first (one per batch tensor, ``input0``, ... and the loss ``target`` last), then
one op per call of `_group` as its mapper drafts it, or opaque; a buffer an op reads becomes a
``constant`` op just before its first use. The builder names ops as `grouping` describes, folds
``getitem`` of a multi-output op into `TensorRef(op, index)`, gives parameters their state-dict names
(`ParamSpec.fqn`) and records on every op with tensor inputs their shapes in the attr ``input_shapes``.
`Operator.module` is the path of the module the op came from.

Opaque ops. An aten op no kind fits is an ``opaque`` op that runs whole on one device. Its attrs say
what to call: ``target`` is a dotted name resolvable from the top-level package by attribute access
(``torch.ops.aten.cumsum.default``, or ``_operator.getitem`` for a non-aten callable); ``args`` (a list) and
``kwargs`` (a dict) are the call's arguments, JSON-encoded: a tensor is ``{"input": i}`` (the op's i-th
input), a parameter ``{"param": name}`` (``op.params[name]``), a dtype ``{"dtype": "float32"}``, a device
``{"device": null}`` (use the rank's device), a layout or memory format ``{"torch": "strided"}`` (an
attribute of `torch`), and anything else that is not a number, string, bool, None or list
``{"repr": "..."}``. Tensor outputs are the op's outputs in order (non-tensor entries of a tuple
result are left out). Capture never writes ``target`` ``module``: a leaf-module call that fits no kind is
still one aten call (its parameters named relative to the module), which says exactly what ran.

FLOPs and bytes. The FLOPs of the kinds the registry marks `flops_counted` (conv2d, linear, matmul,
attention, opaque) come from `torch.utils.flop_counter.FlopCounterMode`: forward from running the aten op
on the fake tensors, backward from the same counter running autograd on those fake tensors (gradients for
parameters and for float inputs not produced by an ``input`` or ``constant`` op). Where a kind is not
counted, or the counter counts no forward FLOPs, the kind's own formula stands (`OpDef.flops` and
`OpDef.backward_flops` in soap/registry.py, which lists them). Bytes: forward is the element bytes of
inputs, outputs and parameters; backward is twice that; an ``input`` op moves its output once, a
``constant`` op is free.

Imports torch, soap.graph, soap.registry and the earlier capture stages; must not import the simulator,
the search, the runtime or soapflow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from soap.capture.grouping import _Call, _group
from soap.capture.mappers import _MAPPERS, _Draft
from soap.capture.nodes import _aten_name, _bind, _dtype_name, _is_getitem, _shape, _spec, _tensors_of
from soap.capture.tracing import _Traced
from soap.graph import Operator, ParamSpec, TensorRef, TensorSpec
from soap.registry import op_def


class _Builder:
    """Emits operators for a traced graph in order: inputs first, constants just before their first use."""

    def __init__(self, traced: _Traced, root: nn.Module) -> None:
        self.traced = traced
        self.root = root
        self.ops: list[Operator] = []
        self.by_name: dict[str, Operator] = {}
        self.counts: dict[str, int] = {}
        self.refs: dict[fx.Node, TensorRef] = {}
        self.no_grad: set[str] = set()
        self.num_dropouts = 0
        self.fused: dict[fx.Node, fx.Node] = {}
        self.fake_mode = next((n.meta["val"].fake_mode for n in traced.user_inputs
                               if hasattr(n.meta.get("val"), "fake_mode")), None)

    def build(self) -> list[Operator]:
        count = len(self.traced.user_inputs)
        for i, node in enumerate(self.traced.user_inputs):
            role = "target" if i == count - 1 else "input"
            name = "target" if role == "target" else f"input{i}"
            spec = _spec(node.meta["val"])
            self.add(Operator(name=self.unique(name), kind="input", outputs=(spec,),
                              attrs={"position": i, "role": role}, fwd_bytes=float(spec.nbytes)))
            self.refs[node] = TensorRef(op=self.ops[-1].name)
            self.no_grad.add(self.ops[-1].name)
        calls = _group(self.traced, self.root)
        skipped = self.fuse_losses(calls)
        for call in calls:
            if call.node not in skipped:
                self.emit(call)
        return self.ops

    # names and references

    def unique(self, base: str) -> str:
        n = self.counts.get(base, 0)
        name = base if n == 0 else f"{base}_{n}"
        while name in self.by_name:
            n += 1
            name = f"{base}_{n}"
        self.counts[base] = n + 1
        return name

    def add(self, op: Operator) -> None:
        self.ops.append(op)
        self.by_name[op.name] = op

    def ref(self, node: fx.Node) -> TensorRef:
        if node not in self.refs and node in self.traced.buffers:
            fqn = self.traced.buffers[node]
            self.add(Operator(name=self.unique(fqn), kind="constant", outputs=(_spec(node.meta["val"]),),
                              attrs={"fqn": fqn}, module=fqn.rpartition(".")[0]))
            self.refs[node] = TensorRef(op=self.ops[-1].name)
            self.no_grad.add(self.ops[-1].name)
        assert node in self.refs, f"{node.name} is used before it is produced"
        return self.refs[node]

    def is_param(self, value: Any) -> bool:
        return isinstance(value, fx.Node) and value in self.traced.params

    def is_act(self, value: Any) -> bool:
        """A tensor computed in the graph, a batch tensor or a buffer: anything but a parameter."""
        return (isinstance(value, fx.Node) and value not in self.traced.params
                and isinstance(value.meta.get("val"), torch.Tensor))

    def local_name(self, node: fx.Node, module: str | None) -> str:
        """A parameter's name relative to the leaf module making the call, else its full name."""
        fqn = self.traced.params[node]
        return fqn[len(module) + 1:] if module and fqn.startswith(f"{module}.") else fqn

    # emitting

    def fuse_losses(self, calls: list[_Call]) -> set[fx.Node]:
        """log_softmax whose only use is an nll_loss over classes: one cross-entropy loss op."""
        skipped = set()
        for call in calls:
            node, a = call.node, _bind(call.node)
            if a is None or _aten_name(node) not in ("nll_loss", "nll_loss_nd"):
                continue
            logp = a["self"]
            la = _bind(logp) if isinstance(logp, fx.Node) else None
            if (la is not None and _aten_name(logp) in ("log_softmax", "_log_softmax")
                    and len(logp.users) == 1 and _shape(logp) is not None and len(_shape(logp)) == 2
                    and la["dim"] in (1, -1) and la.get("dtype") is None
                    and a["weight"] is None and a["reduction"] == 1 and a["ignore_index"] == -100):
                self.fused[node] = logp.args[0]
                skipped.add(logp)
        return skipped

    def emit(self, call: _Call) -> None:
        node = call.node
        bound = _bind(node)
        if bound is not None and _aten_name(node) == "broadcast_tensors" and all(
                self.is_act(x) and _shape(x) == tuple(t.shape)
                for x, t in zip(bound["tensors"], node.meta["val"], strict=True)):
            for user in node.users:
                if _is_getitem(user):
                    self.refs[user] = self.ref(bound["tensors"][user.args[1]])
            return
        draft = None
        if bound is not None and isinstance(node.meta.get("val"), torch.Tensor | tuple | list):
            mapper = _MAPPERS.get(_aten_name(node))
            if mapper is not None:
                draft = mapper(self, call, bound)
                # the kind must name the aten op it was made from (OpDef.captured_from)
                assert draft is None or _aten_name(node) in op_def(draft.kind).captured_from, (
                    _aten_name(node), draft.kind)
        if draft is None:
            for factory in call.factories:
                self.emit(_Call(node=factory, scope=call.scope, in_loss=call.in_loss))
            draft = self.opaque(call)
        if draft is None:
            return
        if draft.kind == "loss" and call.in_loss:
            base = "loss"
        elif call.module is not None and call.module:
            base = call.module
        else:
            base = f"{call.scope}.{_aten_name(node)}" if call.scope else _aten_name(node)
        inputs = tuple(self.ref(n) for n in draft.inputs)
        params = {k: ParamSpec(shape=tuple(p.meta["val"].shape), fqn=self.traced.params[p],
                               dtype=_dtype_name(p.meta["val"].dtype)) for k, p in draft.params.items()}
        if draft.outputs is None:
            pairs = _tensors_of(node.meta["val"])
            draft.outputs = [t for _, t in pairs]
            draft.out_index = {i: j for j, (i, _) in enumerate(pairs)}
        outputs = tuple(_spec(t) for t in draft.outputs)
        if inputs:
            draft.attrs["input_shapes"] = [list(self.tensor(r).shape) for r in inputs]
        op = Operator(name=self.unique(base), kind=draft.kind, inputs=inputs, outputs=outputs,
                      params=params, attrs=draft.attrs,
                      module=(call.module if call.module is not None else
                              ("" if call.in_loss else call.scope)))
        fwd_flops, bwd_flops = self.flops(call, op)
        in_bytes = sum(self.tensor(r).nbytes for r in inputs)
        fwd_bytes = float(in_bytes + sum(t.nbytes for t in outputs) + op.param_bytes)
        op = dataclasses.replace(op, fwd_flops=float(fwd_flops), bwd_flops=float(bwd_flops),
                                 fwd_bytes=fwd_bytes, bwd_bytes=2.0 * fwd_bytes)
        self.add(op)
        if isinstance(node.meta["val"], torch.Tensor):
            self.refs[node] = TensorRef(op=op.name)
        else:
            index = draft.out_index if draft.out_index is not None else {i: i for i in range(len(outputs))}
            for user in node.users:
                if _is_getitem(user) and user.args[1] in index:
                    self.refs[user] = TensorRef(op=op.name, index=index[user.args[1]])

    def opaque(self, call: _Call) -> _Draft | None:
        node = call.node
        if not _tensors_of(node.meta.get("val")):
            return None
        draft = _Draft(kind="opaque", inputs=[])

        def encode(value: Any) -> Any:
            if isinstance(value, fx.Node):
                if self.is_param(value):
                    local = self.local_name(value, call.module)
                    draft.params[local] = value
                    return {"param": local}
                if isinstance(value.meta.get("val"), torch.Tensor):
                    if value not in draft.inputs:
                        draft.inputs.append(value)
                    return {"input": draft.inputs.index(value)}
                return encode(value.meta.get("val"))
            if value is None or isinstance(value, bool | int | float | str):
                return value
            if isinstance(value, tuple | list):
                return [encode(v) for v in value]
            if isinstance(value, torch.dtype):
                return {"dtype": str(value).removeprefix("torch.")}
            if isinstance(value, torch.device):
                return {"device": None}
            if isinstance(value, torch.layout | torch.memory_format):
                return {"torch": str(value).removeprefix("torch.")}
            return {"repr": repr(value)}

        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            qualname = f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
        else:
            module = getattr(target, "__module__", None) or "builtins"
            qualname = f"{module}.{getattr(target, '__qualname__', target)}"
        draft.attrs = {"target": qualname, "args": [encode(a) for a in node.args],
                       "kwargs": {k: encode(v) for k, v in node.kwargs.items()}}
        return draft

    # FLOPs

    def flops(self, call: _Call, op: Operator) -> tuple[float, float]:
        """(forward, backward) FLOPs of `op`: torch's count where its kind is counted and the counter counts
        forward FLOPs, else the kind's formula; a counted kind without a formula keeps the count (or 0)."""
        entry = op_def(op.kind)
        counted = None
        if entry.flops_counted:
            counted = self.count(call)
            if counted is not None and counted[0] > 0:
                return counted
        fwd = entry.flops(op)
        if fwd is None:
            return counted or (0.0, 0.0)
        return fwd, entry.backward_flops(op, fwd)

    def tensor(self, ref: TensorRef) -> TensorSpec:
        return self.by_name[ref.op].outputs[ref.index]

    def count(self, call: _Call) -> tuple[float, float] | None:
        """(forward, backward) FLOPs of the call's aten op by FlopCounterMode on fake tensors."""
        from torch.utils.flop_counter import FlopCounterMode

        node = call.node
        leaves: list[torch.Tensor] = []
        factories = set(call.factories)

        def fake(value: Any) -> Any:
            if isinstance(value, fx.Node):
                val = value.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    return val
                producer = self.refs.get(value)
                needs_grad = (value in self.traced.params or
                              (val.is_floating_point() and value not in factories
                               and value not in self.traced.buffers
                               and (producer is None or producer.op not in self.no_grad)))
                val = val.detach()
                if needs_grad:
                    val = val.requires_grad_(True)
                    leaves.append(val)
                return val
            if isinstance(value, tuple | list):
                return type(value)(fake(v) for v in value)
            return value

        if self.fake_mode is None:
            return None
        try:
            with self.fake_mode, FlopCounterMode(display=False) as counter:
                result = node.target(*fake(node.args), **{k: fake(v) for k, v in node.kwargs.items()})
                fwd = counter.get_total_flops()
                outs = [t for t in pytree.tree_leaves(result)
                        if isinstance(t, torch.Tensor) and t.requires_grad]
                if leaves and outs:
                    torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs], allow_unused=True)
                bwd = counter.get_total_flops() - fwd
        except Exception:
            return None
        return float(fwd), float(bwd)

