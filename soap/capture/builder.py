"""Capture, stage 4: the operator calls of a traced graph emitted in order as `Operator`s.

Owns `_Builder`: input ops first (one per batch tensor, ``input0``, ... and the loss ``target`` last), then
one op per call of `_group` as its mapper drafts it, or opaque; a buffer an op reads becomes a
``constant`` op just before its first use. The builder names ops as `grouping` describes, folds
``getitem`` of a multi-output op into `TensorRef(op, index)`, gives parameters their state-dict names
(`ParamSpec.fqn`) and records on every op with tensor inputs their shapes in the attr ``input_shapes``.
`Operator.module` is the path of the module the op came from.

Folded constants. A value the batch and the parameters do not reach (an ``arange``, a causal mask built
from shapes, position ids, a rotary table computed from a buffer, a lifted ``torch.tensor`` literal, casts,
views and copies of buffers) is the same in every step: its aten calls make no op. Where a real op reads
one, a ``constant`` op stands for it just before that use, with its ``recipe``: the calls that compute it,
in order, each ``{"target", "args", "kwargs"}`` encoded as an opaque op's call below, a tensor argument
being ``{"step": i}`` (the value of step i), ``{"buffer": fqn}`` (a buffer of the model) or
``{"literal": {"values", "dtype", "shape"}}`` (a lifted constant); the last step's value is the constant.
Not folded: random ops and uninitialized memory (``rand``, ``dropout``, ``empty``), values an in-place op
mutates, and the ``*_like``/``new_*`` factories read only for their shape (they fold as ``full``).

Buffer writes. The runtime installs a model's buffers once and never writes them back, so a forward that
writes a buffer (``self.ema.mul_(0.9).add_(...)``, ``self.ema[:2] = ...``, ``self.ema = ...``) would train
every step from the initial value: the builder refuses it (`ValueError` naming the buffer) unless the buffer
is a running statistic of a ``batchnorm`` op (``running_mean``, ``running_var``, which the kind carries
across steps) or its module's ``num_batches_tracked``. Tracing lists the writes (`_Traced.buffer_writes`).

Hand-written RMS norms. ``weight * (x * rsqrt(mean(x^2, -1, keepdim) + eps))``, with ``to`` casts that
keep the dtype around it (Hugging Face's ``LlamaRMSNorm``), becomes one ``rmsnorm`` op named after the
module whose forward computes it, as long as no intermediate value is used elsewhere; so does
``(x * rsqrt(...)) * (c + weight)`` (Gemma's, weight stored as an offset from c = 1), with the attr
``offset`` c.

Blocks of parameters. A parameter cut by ``split``, ``split_with_sizes``, ``chunk``, ``unsafe_split`` (one
piece of it, through ``getitem``), ``slice`` with step 1 or ``narrow``, perhaps repeatedly (and through
``alias``), is a block of that parameter (`ParamSpec.offset`, as `fused` makes them): the cut makes no
op, and the op reading the block holds it as a parameter, so ``F.linear(x, w[:d], b[:d])`` is a ``linear``
over rows 0 to d of w.
An opaque op names a block by its parameter's local name, ``@`` and the offset (``weight@0,64``). Blocks
of one parameter overlapping without being equal (``w[:8]`` and ``w[4:]``, or a block and the parameter
read whole) stay cuts, opaque ops: two ops holding overlapping boxes would each keep and update its own
copy of the overlap.

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

Imports torch, soap.graph, soap.opdef, soap.registry and the earlier capture stages; must not import the simulator,
the search, the runtime or soapflow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from soap.capture.grouping import _Call, _group
from soap.capture.mappers import _MAPPERS, _Draft, transposed_linear
from soap.capture.nodes import (
    _aten_name,
    _bind,
    _dtype_name,
    _encode,
    _is_getitem,
    _qualname,
    _shape,
    _spec,
    _tensors_of,
)
from soap.capture.tracing import _model_fqn, _Traced
from soap.graph import Operator, ParamSpec, TensorRef, TensorSpec
from soap.opdef import intersect
from soap.registry import op_def

# aten ops whose values are random or uninitialized: never folded into constants
_RANDOM = frozenset({"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
                     "normal", "uniform", "multinomial", "exponential", "poisson", "dropout", "native_dropout",
                     "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
# factories that read only the shape, dtype and device of their tensor argument: fill value (a number, or
# the name of the argument holding it); they fold as ``full``
_LIKE = {"new_zeros": 0, "new_ones": 1, "new_full": "fill_value", "zeros_like": 0, "ones_like": 1,
         "full_like": "fill_value"}
# aten ops that cut a block out of a parameter (module docstring)
_CUTS = frozenset({"split", "split_with_sizes", "chunk", "unsafe_split", "slice", "narrow", "alias"})
# lifted constants up to this many elements are written into a recipe as literals
_MAX_LITERAL = 65536


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
        # the model's buffers, and its frozen parameters (``requires_grad`` False), by their names in
        # `traced.buffers` and `traced.params`
        self.model_buffers = {_model_fqn(name) for name, _ in root.named_buffers(remove_duplicate=False)}
        self.frozen = {_model_fqn(name) for name, p in root.named_parameters(remove_duplicate=False)
                       if not p.requires_grad}
        self.num_dropouts = 0
        self.num_draws = 0
        self.fused: dict[fx.Node, fx.Node] = {}
        self.fused_norms: dict[fx.Node, _Draft] = {}
        self.calls: dict[fx.Node, _Call] = {}
        # blocks of parameters (module docstring): node -> (the parameter's placeholder, offset per axis)
        self.blocks: dict[fx.Node, tuple[fx.Node, tuple[int, ...]]] = {}
        self.folded = self.foldable()
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
        self.calls = {call.node: call for call in calls}
        skipped = self.find_blocks()
        skipped |= self.fuse_losses(calls) | self.fuse_rms_norms(calls) | self.fuse_transposed_weights(calls)
        for call in calls:
            if call.node not in skipped:
                self.emit(call)
        self.refuse_buffer_writes()
        return self.ops

    def refuse_buffer_writes(self) -> None:
        """Refuse a forward that writes a buffer of the model other than the running statistics of a
        ``batchnorm`` op (and its ``num_batches_tracked``): the runtime installs buffers once, so every step
        would read the initial value where PyTorch reads the last step's."""
        kept: set[str] = set()
        for op in self.ops:
            if op.kind == "batchnorm" and op.attrs.get("running_mean"):
                module = op.attrs["running_mean"].rpartition(".")[0]
                kept |= {op.attrs["running_mean"], op.attrs["running_var"],
                         f"{module}.num_batches_tracked" if module else "num_batches_tracked"}
        for fqn, how in self.traced.buffer_writes.items():
            if fqn in self.model_buffers and fqn not in kept:
                raise ValueError(
                    f"the forward of {type(self.root.model).__name__} writes its buffer {fqn!r} ({how}), but "
                    f"soapflow cannot carry buffer updates across steps (only BatchNorm running statistics), so "
                    f"every step would start from the initial value: update {fqn!r} outside forward instead "
                    f"(after each step, from the step's outputs)")

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
        if node not in self.refs and node in self.folded:
            producer = node.args[0] if _is_getitem(node) else node
            call = self.calls.get(producer) or _Call(node=producer, scope="", in_loss=False)
            self.add(Operator(name=self.unique(self.base(call)), kind="constant", outputs=(_spec(node.meta["val"]),),
                              attrs={"recipe": self.recipe(node)},
                              module=call.module if call.module is not None else call.scope))
            self.refs[node] = TensorRef(op=self.ops[-1].name)
            self.no_grad.add(self.ops[-1].name)
        if node not in self.refs and node in self.traced.buffers:
            fqn = self.traced.buffers[node]
            self.add(Operator(name=self.unique(fqn), kind="constant", outputs=(_spec(node.meta["val"]),),
                              attrs={"fqn": fqn}, module=fqn.rpartition(".")[0]))
            self.refs[node] = TensorRef(op=self.ops[-1].name)
            self.no_grad.add(self.ops[-1].name)
        assert node in self.refs, f"{node.name} is used before it is produced"
        return self.refs[node]

    def is_param(self, value: Any) -> bool:
        """A parameter or a block of one."""
        return isinstance(value, fx.Node) and (value in self.traced.params or value in self.blocks)

    def is_act(self, value: Any) -> bool:
        """A tensor computed in the graph, a batch tensor or a buffer: anything but a parameter."""
        return (isinstance(value, fx.Node) and not self.is_param(value)
                and isinstance(value.meta.get("val"), torch.Tensor))

    def local_name(self, node: fx.Node, module: str | None) -> str:
        """A parameter's name relative to the leaf module making the call, else its full name; a block's
        with ``@`` and its offset."""
        base, offset = self.blocks.get(node, (node, ()))
        fqn = self.traced.params[base]
        local = fqn[len(module) + 1:] if module and fqn.startswith(f"{module}.") else fqn
        return f"{local}@{','.join(map(str, offset))}" if offset else local

    def param_spec(self, node: fx.Node) -> ParamSpec:
        """The `ParamSpec` of parameter (or block) `node`."""
        base, offset = self.blocks.get(node, (node, ()))
        fqn, whole = self.traced.params[base], base.meta["val"]
        return ParamSpec(shape=tuple(node.meta["val"].shape), fqn=fqn, dtype=_dtype_name(whole.dtype),
                         offset=offset, whole_shape=tuple(whole.shape) if offset else (),
                         trainable=fqn not in self.frozen)

    def find_blocks(self) -> set[fx.Node]:
        """Record the blocks of parameters (module docstring) in `blocks`; returns the cutting nodes, which
        make no op. A parameter whose blocks (or the parameter read whole) overlap without being equal
        keeps its cuts as ops: two ops holding overlapping boxes would each keep and update its own copy
        of the overlap."""
        cuts: dict[fx.Node, fx.Node] = {}  # cutting node -> the parameter it cuts
        for node in self.traced.nodes:
            a = _bind(node)
            name = _aten_name(node)
            if a is None or name not in _CUTS or not self.is_param(node.args[0]):
                continue
            x = node.args[0]
            ndim = len(_shape(x))
            dim = int(a.get("dim") or 0) % max(ndim, 1)
            base, offset = self.blocks.get(x, (x, ()))
            offset = offset or (0,) * ndim
            cuts[node] = base
            if name == "alias":
                self.blocks[node] = self.blocks.get(x, (x, ()))
            elif name in ("slice", "narrow"):
                if name == "slice" and a["step"] != 1:
                    del cuts[node]
                    continue
                size = _shape(x)[dim]
                start = int(a["start"] or 0)
                start = max(start + size, 0) if start < 0 else min(start, size)
                self.blocks[node] = (base, _shifted(offset, dim, start))
            else:
                starts = [0]
                for piece in node.meta["val"][:-1]:
                    starts.append(starts[-1] + int(piece.shape[dim]))
                for user in node.users:
                    if _is_getitem(user):
                        self.blocks[user] = (base, _shifted(offset, dim, starts[user.args[1]]))
        boxes: dict[fx.Node, set[tuple[tuple[int, int], ...]]] = {}
        for node, (base, _) in self.blocks.items():
            if any(u not in cuts for u in _uses(node)):
                boxes.setdefault(base, set()).add(self.param_spec(node).box)
        for base in boxes:
            if any(u not in cuts for u in _uses(base)):
                boxes[base].add(self.param_spec(base).box)
        overlapping = {base for base, found in boxes.items()
                       if any(a != b and intersect(a, b) is not None for a in found for b in found)}
        self.blocks = {n: v for n, v in self.blocks.items() if v[0] not in overlapping}
        return {n for n, base in cuts.items() if base not in overlapping}

    # folding

    def foldable(self) -> set[fx.Node]:
        """The nodes whose values neither the batch nor the parameters reach (the module docstring's
        rules), computed in graph order."""
        traced = self.traced
        mutated: set[fx.Node] = set()
        for node in traced.nodes:
            if isinstance(node.target, torch._ops.OpOverload) and _aten_name(node) != "detach":
                bound = _bind(node) or {}
                mutated.update(bound[a.name] for a in node.target._schema.arguments
                               if a.alias_info is not None and a.alias_info.is_write
                               and isinstance(bound.get(a.name), fx.Node))
        roots = {n for n, fqn in traced.buffers.items() if n not in mutated and (
            fqn in self.model_buffers or (n in traced.constants and traced.constants[n].numel() <= _MAX_LITERAL))}
        folded: set[fx.Node] = set()
        for node in traced.nodes:
            if node in mutated:
                continue
            if _is_getitem(node):
                if node.args[0] in folded:
                    folded.add(node)
                continue
            name = _aten_name(node)
            if (not isinstance(node.target, torch._ops.OpOverload) or name in _RANDOM
                    or not _tensors_of(node.meta.get("val"))):
                continue
            if name in _LIKE or all(d in folded or d in roots for d in _deps(node)):
                folded.add(node)
        return folded

    def recipe(self, node: fx.Node) -> list[dict[str, Any]]:
        """The calls that compute folded `node`, in graph order (the module docstring's encoding)."""
        needed: set[fx.Node] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n in needed or n not in self.folded:
                continue
            needed.add(n)
            if _aten_name(n) not in _LIKE:
                stack += _deps(n)
        index: dict[fx.Node, int] = {}
        steps: list[dict[str, Any]] = []

        def tensor(value: fx.Node) -> Any:
            if value in index:
                return {"step": index[value]}
            if value in self.traced.constants:
                t = self.traced.constants[value]
                return {"literal": {"values": t.flatten().tolist(), "dtype": _dtype_name(t.dtype),
                                    "shape": list(t.shape)}}
            return {"buffer": self.traced.buffers[value]}

        for n in self.traced.nodes:
            if n not in needed:
                continue
            index[n] = len(steps)
            name = _aten_name(n)
            if _is_getitem(n):
                steps.append({"target": _qualname(n.target), "args": [{"step": index[n.args[0]]}, n.args[1]],
                              "kwargs": {}})
                continue
            if name in _LIKE:
                val, fill = n.meta["val"], _LIKE[name]
                fill = fill if isinstance(fill, int) else _bind(n)[fill]
                steps.append({"target": "torch.ops.aten.full.default", "args": [list(val.shape), fill],
                              "kwargs": {"dtype": _encode(val.dtype, tensor), "device": {"device": None}}})
                continue
            steps.append({"target": _qualname(n.target), "args": _encode(list(n.args), tensor),
                          "kwargs": {k: _encode(v, tensor) for k, v in n.kwargs.items()}})
        return steps

    # emitting

    def fuse_rms_norms(self, calls: list[_Call]) -> set[fx.Node]:
        """Hand-written RMS norms (the module docstring's pattern): their last ``mul`` maps to one
        ``rmsnorm`` op (`fused_norms`), the other nodes make no op."""
        skipped: set[fx.Node] = set()
        for call in calls:
            found = _rms_norm_pattern(self, call.node)
            if found is not None:
                x, weight, eps, offset, interior = found
                self.fused_norms[call.node] = _Draft(
                    kind="rmsnorm", inputs=[x], params={"weight": weight},
                    attrs={"normalized_shape": [int(_shape(x)[-1])], "eps": eps,
                           **({"offset": offset} if offset else {})})
                skipped |= interior
                if call.scope and call.module is None:
                    call.module = call.scope  # named after the norm's module, as a leaf module would be
        return skipped

    def fuse_transposed_weights(self, calls: list[_Call]) -> set[fx.Node]:
        """``x @ w.T`` of a 2-D parameter w (Falcon's linears): the transpose makes no op, its matmul maps
        to a ``linear`` holding w (`mappers.transposed_linear`)."""
        skipped: set[fx.Node] = set()
        for call in calls:
            if transposed_linear(self, call.node) is not None:
                skipped.add(call.node.args[1])
        return skipped

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
                    and a["reduction"] in (1, 2)):
                self.fused[node] = logp.args[0]
                skipped.add(logp)
        return skipped

    def base(self, call: _Call, kind: str = "") -> str:
        """The name an op made from `call` gets before numbering (the naming rules of `grouping`)."""
        if kind == "loss" and call.in_loss:
            return "loss"
        if call.module is not None and call.module:
            return call.module
        name = _aten_name(call.node)
        return f"{call.scope}.{name}" if call.scope else name

    def emit(self, call: _Call) -> None:
        node = call.node
        if node in self.folded:
            return
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
        base = self.base(call, draft.kind)
        inputs = tuple(self.ref(n) for n in draft.inputs)
        params = {k: self.param_spec(p) for k, p in draft.params.items()}
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

        def tensor(value: fx.Node) -> Any:
            if self.is_param(value):
                local = self.local_name(value, call.module)
                draft.params[local] = value
                return {"param": local}
            if value not in draft.inputs:
                draft.inputs.append(value)
            return {"input": draft.inputs.index(value)}

        draft.attrs = {"target": _qualname(node.target), "args": [_encode(a, tensor) for a in node.args],
                       "kwargs": {k: _encode(v, tensor) for k, v in node.kwargs.items()}}
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
                if self.is_param(value):
                    needs_grad = self.param_spec(value).trainable
                else:
                    needs_grad = (val.is_floating_point() and value not in factories
                                  and value not in self.traced.buffers
                                  and (producer is None or producer.op not in self.no_grad))
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


def _deps(node: fx.Node) -> list[fx.Node]:
    """The nodes `node` reads."""
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


def _shifted(offset: tuple[int, ...], dim: int, by: int) -> tuple[int, ...]:
    return tuple(o + by if i == dim else o for i, o in enumerate(offset))


def _uses(node: fx.Node) -> list[fx.Node]:
    """The users of `node`, but for the metadata checks export adds (``_assert_tensor_metadata``)."""
    return [u for u in node.users if not _aten_name(u).startswith("_assert")]


def _single_use(node: Any, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and _uses(node) == [user]


def _same_dtype_cast(node: Any) -> fx.Node | None:
    """The input of a ``to`` that keeps the dtype, else None."""
    if not isinstance(node, fx.Node) or _aten_name(node) not in ("to", "_to_copy"):
        return None
    x = node.args[0]
    return x if isinstance(x, fx.Node) and x.meta["val"].dtype == node.meta["val"].dtype else None


def _offset_weight(b: _Builder, node: Any) -> tuple[fx.Node, float, set[fx.Node]] | None:
    """(weight, c, interior nodes) where `node` is ``c + weight`` (either order; the weight perhaps under
    a cast that keeps its dtype and is used only here); None otherwise."""
    if not isinstance(node, fx.Node) or _aten_name(node) != "add" or len(node.args) != 2 or node.kwargs:
        return None
    w, c = node.args if isinstance(node.args[0], fx.Node) else node.args[::-1]
    if not isinstance(w, fx.Node) or isinstance(c, bool) or not isinstance(c, float | int):
        return None
    interior = {node}
    cast = _same_dtype_cast(w)
    if cast is not None:
        if not _single_use(w, node):
            return None
        interior.add(w)
        w = cast
    return (w, float(c), interior) if b.is_param(w) else None


def _rms_norm_pattern(b: _Builder, anchor: fx.Node) -> tuple[fx.Node, fx.Node, float, float, set[fx.Node]] | None:
    """(input, weight, eps, offset, interior nodes) where `anchor` is ``weight * rms_normalized(x)`` or
    ``(offset + weight) * rms_normalized(x)`` (the module docstring's patterns), else None."""
    if _aten_name(anchor) != "mul" or len(anchor.args) != 2:
        return None
    a0, a1 = anchor.args
    offset, interior = 0.0, set()
    if b.is_param(a0) or b.is_param(a1):
        weight, t = (a0, a1) if b.is_param(a0) else (a1, a0)
    else:
        for side, other in ((a0, a1), (a1, a0)):
            found = _offset_weight(b, side)
            if found is not None and _single_use(side, anchor):
                (weight, offset, interior), t = found, other
                break
        else:
            return None
    if not b.is_param(weight) or not _single_use(t, anchor):
        return None
    u = _same_dtype_cast(t)
    if u is not None:
        interior.add(t)
        if not _single_use(u, t):
            return None
    else:
        u = t
    if _aten_name(u) != "mul" or len(u.args) != 2:
        return None
    r, x1 = (u.args[0], u.args[1]) if _aten_name(u.args[0]) == "rsqrt" else (u.args[1], u.args[0])
    if not _single_use(r, u) or _aten_name(r) != "rsqrt" or not isinstance(x1, fx.Node):
        return None
    s = r.args[0]
    if not _single_use(s, r) or _aten_name(s) != "add" or len(s.args) != 2:
        return None
    mean, eps = s.args if isinstance(s.args[0], fx.Node) else s.args[::-1]
    if not _single_use(mean, s) or not isinstance(eps, float | int) or _aten_name(mean) != "mean":
        return None
    ma = _bind(mean)
    ndim = len(_shape(x1))
    if (ma is None or not ma.get("keepdim") or [d % ndim for d in ma.get("dim") or []] != [ndim - 1]
            or ma.get("dtype") is not None):
        return None
    p = ma["self"]
    if not _single_use(p, mean) or not (
            (_aten_name(p) == "pow" and p.args[0] is x1 and p.args[1] == 2)
            or (_aten_name(p) == "mul" and p.args[0] is x1 and p.args[1] is x1)):
        return None
    interior |= {u, r, s, mean, p}
    x = _same_dtype_cast(x1)
    if x is not None and set(_uses(x1)) == {p, u}:
        interior.add(x1)
    else:
        x = x1
    if (_shape(weight) != _shape(x)[-1:] or not b.is_act(x) or x.meta["val"].dtype != anchor.meta["val"].dtype
            or not x.meta["val"].is_floating_point()):
        return None
    return x, weight, float(eps), offset, interior
