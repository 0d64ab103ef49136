"""The training step as a graph: the forward and its backward, traced together, so the simulator can run both.

A captured graph (:mod:`autofuse.capture`) or a fused plan's graph computes the forward only; its backward is
what autograd runs when ``loss.backward()`` is called: the aten derivative formulas of every unfused op, and
for a fused call the backward that ``torch.ops.autofuse.<op>`` registers (a fused backward kernel such as
``flash_attention_grad``, a generated Vector program derived from the forward's, or matmuls). To simulate
that work it has to be a graph too.

:func:`joint_graph` makes it one. The trainable parameters (``get_attr`` nodes of parameters that require
grad; a tensor read under two names, tied weights, is one input) become placeholders, and so do the other
tensors it reads (buffers, constants: fake tracing cannot mix them with fake tensors); the function

    outputs = graph(*inputs); grads = torch.autograd.grad(outputs, params + inputs needing grad, grad_outputs)

is traced with ``make_fx`` on fake tensors (no data is touched, no kernel runs): the result is an aten graph
of the forward followed by the backward exactly as autograd dispatches it (what eager runs, or what a
fused op's backward calls), its values' shapes in ``node.meta["val"]``. Every node carries
``node.meta["autofuse_phase"]``: ``"forward"`` for what the forward call traced, ``"backward"`` for what
``autograd.grad`` traced (recomputations a backward does are backward work). The gradients of the outputs
are inputs of the joint graph (the loss's gradient, which a real step computes from the loss), so no node
computes them.

``simulate_graph(gm, inputs, backward=True)`` (:mod:`autofuse.simulate`; also ``autofuse.simulate``,
``FusedModule.simulate`` and ``autofuse simulate --backward``) simulates the joint graph like a forward graph:
each node's kernels, fused calls on their kernels; ``SimulationResult.phases`` gives each phase's cycles.
The forward phase lowers to the forward pass's kernels: the ops autograd dispatches instead of the captured
ones (``native_layer_norm`` for ``layer_norm``, ``addmm`` for ``linear``, ``bmm`` on copied operands for a
batched ``matmul``) lower to the same launches (:mod:`autofuse.lower`), so the forward phase costs what
the forward pass alone costs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autofuse.graph import get_attr_value, graph_module

FORWARD, BACKWARD = "forward", "backward"


@dataclass
class JointGraph:
    """The forward+backward graph of one training step (module docstring). ``graph_module`` takes
    ``params + state + inputs + grad_outputs`` (:meth:`arguments` builds them) and returns the forward's outputs
    followed by one gradient per parameter, then per input that requires grad (``None`` where unused)."""

    graph_module: fx.GraphModule
    params: list              # (dotted name, tensor) of each trainable parameter, in placeholder order
    state: list               # the other tensors the graph reads (buffers, constants), after the parameters
    n_inputs: int
    grad_shapes: list         # (shape, dtype) of each output gradient the step takes

    def arguments(self, inputs, seed: int = 0) -> list:
        """The joint graph's arguments: the parameters, ``inputs`` (the forward graph's), and output gradients
        drawn from a private generator (``seed``; the user's global generator is not touched)."""
        g = torch.Generator().manual_seed(seed)
        grads = [(torch.randn(s, generator=g) / max(1.0, float(torch.tensor(s).prod()) ** 0.5)).to(dt)
                 for s, dt in self.grad_shapes]
        return [t for _, t in self.params] + list(self.state) + list(inputs) + grads


def _state(gm: fx.GraphModule):
    """``{get_attr node: tensor}`` for every tensor the graph reads as an attribute (parameters, buffers, lifted
    constants), and the distinct tensors in order as ``(name, tensor, trainable)``: a parameter that requires
    grad is trainable; a tensor read under two names (tied weights) is one entry."""
    by_node, order = {}, []
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        t = get_attr_value(gm, n.target)
        if not isinstance(t, torch.Tensor):
            continue
        by_node[n] = t
        if not any(t is u for _, u, _ in order):
            trainable = isinstance(t, torch.nn.Parameter) and t.requires_grad and t.is_floating_point()
            order.append((n.meta.get("autofuse_state", n.target), t, trainable))
    return by_node, order


def _lifted(gm: fx.GraphModule, by_node: dict, order: list) -> fx.GraphModule:
    """``gm`` with every attribute tensor read through a placeholder (before the graph's own): trainable
    parameters first, then the other state (buffers, constants), in ``order``."""
    g = fx.Graph()
    env, ph = {}, {}
    for i, (name, t, _) in enumerate(order):
        p = g.placeholder(f"state_{i}")
        p.meta["autofuse_state"] = name
        ph[id(t)] = p
    for n in gm.graph.nodes:
        env[n] = ph[id(by_node[n])] if n in by_node else g.node_copy(n, lambda a: env[a])
    return graph_module(gm, g)


def joint_graph(gm: fx.GraphModule, inputs) -> JointGraph:
    """Trace the training step of ``gm`` (a captured or fused graph) on ``inputs`` (its placeholders' values,
    only their shapes and dtypes are read): see the module docstring. Raises ``ValueError`` naming what is
    missing when nothing requires grad."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

    by_node, state = _state(gm)
    state = [s for s in state if s[2]] + [s for s in state if not s[2]]
    order = [(name, t) for name, t, trainable in state if trainable]
    frozen = [t for _, t, trainable in state if not trainable]
    lifted = _lifted(gm, by_node, state)
    inputs = list(inputs)
    wants = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
    if not order and not any(wants):
        raise ValueError("training step: no parameter requires grad and no input does; there is no backward to "
                         "simulate (set requires_grad on the parameters to train)")
    outputs = _output_specs(gm)
    grad_shapes = [(tuple(v.shape), v.dtype) for v in outputs if v is not None]
    n_params, n_frozen = len(order), len(frozen)
    boundary = {}

    def step(*args):
        params, rest = args[:n_params], args[n_params:]
        consts, xs, gouts = rest[:n_frozen], rest[n_frozen:n_frozen + len(inputs)], rest[n_frozen + len(inputs):]
        outs = _Sourced(lifted, get_proxy_mode().tracer.graph).run(*params, *consts, *xs)
        flat = pytree.tree_leaves(outs)
        boundary["nodes"] = len(get_proxy_mode().tracer.graph.nodes)
        pairs = [(o, g) for o, g in zip([o for o, v in zip(flat, _floating(flat)) if v], gouts)
                 if o.requires_grad]
        wrt = list(params) + [x for x, w in zip(xs, wants) if w]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
            if pairs else [None] * len(wrt)
        return (*flat, *got)

    params = [t.detach().requires_grad_(True) for _, t in order]
    xs = [x.detach().requires_grad_(True) if w else x for x, w in zip(inputs, wants)]
    gouts = [torch.zeros(s, dtype=dt) for s, dt in grad_shapes]      # stand-ins: make_fx reads shapes only
    with torch.enable_grad():
        traced = make_fx(step, tracing_mode="fake")(*params, *frozen, *xs, *gouts)
    for i, n in enumerate(traced.graph.nodes):
        n.meta["autofuse_phase"] = FORWARD if i < boundary["nodes"] else BACKWARD
    return JointGraph(traced, order, frozen, len(inputs), grad_shapes)


class _Sourced(fx.Interpreter):
    """Runs the forward graph node by node while it is traced, and marks each traced node with
    ``meta["autofuse_source"]``: the forward graph's node it was traced from (a ``clone`` is priced as the
    captured clone it came from, :func:`autofuse.lower._clone_is_free`)."""

    def __init__(self, gm, traced):
        super().__init__(gm)
        self.traced = traced

    def run_node(self, n):
        before = len(self.traced.nodes)
        out = super().run_node(n)
        for t in itertools.islice(reversed(self.traced.nodes), len(self.traced.nodes) - before):
            t.meta["autofuse_source"] = n
        return out


def _floating(flat) -> list:
    return [isinstance(o, torch.Tensor) and o.is_floating_point() for o in flat]


def _output_specs(gm: fx.GraphModule) -> list:
    """The meta value of each floating output leaf of ``gm`` (None for the others), in output order."""
    out = gm.graph.output_node().args[0]
    leaves = pytree.tree_leaves(out)
    vals = []
    for a in leaves:
        v = a.meta.get("val") if isinstance(a, fx.Node) else a
        vals.append(v if isinstance(v, torch.Tensor) and v.is_floating_point() else None)
    return vals

