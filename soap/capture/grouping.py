"""Capture, stage 2: the aten nodes of a `_Traced` graph grouped into operator calls (`_Call`), one per op.

Grouping follows ``nn_module_stack``: every call of a standard torch.nn leaf module (`LEAF_MODULES`) whose
aten ops reduce to one op becomes one call of that module, which the builder names by the module path (a
second call of the same module gets ``_1``, ...); the zero initial states a recurrent module (LSTM, GRU,
RNN) makes (factory ops) fold into its call. Any other aten op becomes its own call, scoped by the path of
the module whose forward made it, which the builder names ``<scope>.<aten op name>`` (``layer1.0.add``,
``flatten``, ``layer1.0.relu_1``), numbered in graph order, so the same model always gives the same names.
The ops of the loss function are scoped ``loss``. ``getitem`` nodes make no call (the builder folds them
into references), and `nn.Identity` emits no aten op and so leaves no call.

Imports torch.fx, `tracing` and `nodes`; must not import `mappers` or `builder`, the simulator, the
search, the runtime or soapflow.
"""

from __future__ import annotations

import dataclasses

from torch import fx, nn

from soap.capture.nodes import _aten_name, _is_getitem
from soap.capture.tracing import _MODEL, _is_leaf, _model_fqn, _Traced

_LOSS_SCOPE = "loss"

# aten ops that make a tensor from nothing; inside a leaf-module call they fold into it (recurrent modules' states)
_FACTORIES = {"zeros", "ones", "empty", "full"}


@dataclasses.dataclass(slots=True)
class _Call:
    """One operator to emit: its main aten node, the module path scoping its name, and (for a whole
    leaf-module call) the module path and the factory nodes (a recurrent module's zero states) folded into it."""

    node: fx.Node
    scope: str
    in_loss: bool
    module: str | None = None
    factories: tuple[fx.Node, ...] = ()


def _group(traced: _Traced, root: nn.Module) -> list[_Call]:
    """The operator calls of `traced` in graph order; `root` is the traced wrapper (its submodules tell
    leaf modules apart)."""
    leaf_of_path: dict[str, bool] = {}

    def model_paths(node: fx.Node) -> list[tuple[str, str]]:
        """(stack key, module path in the model) for each module on the node's stack, outermost first."""
        paths = []
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if path == _MODEL or path.startswith(f"{_MODEL}."):
                paths.append((key, path))
        return paths

    def leaf_key(node: fx.Node) -> tuple[str, str] | None:
        for key, path in model_paths(node):
            if path not in leaf_of_path:
                leaf_of_path[path] = _is_leaf(root.get_submodule(path))
            if leaf_of_path[path]:
                return key, _model_fqn(path) if path != _MODEL else ""
        return None

    groups: list[tuple[tuple[str, str] | None, list[fx.Node]]] = []
    for node in traced.nodes:
        if _is_getitem(node):
            continue
        leaf = leaf_key(node)
        if leaf is not None and groups and groups[-1][0] == leaf:
            groups[-1][1].append(node)
        else:
            groups.append((leaf, [node]))

    calls = []
    for leaf, nodes in groups:
        live = [n for n in nodes if n.users]
        paths = model_paths(nodes[0])
        in_loss = not paths
        scope = _LOSS_SCOPE if in_loss else (_model_fqn(paths[-1][1]) if paths[-1][1] != _MODEL else "")
        if leaf is None:
            calls += [_Call(node=n, scope=scope, in_loss=in_loss) for n in live]
            continue
        members = set(nodes)
        factories = tuple(n for n in live if _aten_name(n) in _FACTORIES
                          and not any(isinstance(a, fx.Node) for a in n.args)
                          and all(u in members for u in n.users))
        mains = [n for n in live if n not in factories]
        if len(mains) == 1:
            calls.append(_Call(node=mains[0], scope=leaf[1], in_loss=False, module=leaf[1],
                               factories=factories))
        else:
            calls += [_Call(node=n, scope=leaf[1], in_loss=False) for n in live]
    return calls

