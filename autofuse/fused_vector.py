"""Fused calls of the discovered families: a Vector region as ``torch.ops.autofuse.vector_program`` and a matmul
with its epilogue as ``torch.ops.autofuse.matmul_epilogue`` (see :mod:`patterns.vector_chain`).

In a graph captured for training (:func:`training_graph`), a region keeps for its backward the values of fewest
bytes that its backward can be computed from (:func:`kept_values`: its inputs, or values it computes, which the
kernel then stores as outputs past its own, :func:`with_saved`; a matmul epilogue's product, the pre-activation
GELU's backward reads, among them); each such store is one more output the cost model and the simulator price as
part of the program; the forward graph ignores those outputs, the op's autograd saves them for the backward.

The price of a region is the cost model's price of its program on the target device, with the tiling its
search finds at O3; the *alternatives* (one pass or chunked rows, RoPE on the Cube, a matmul with or without
its epilogue) are priced on every device, and the report shows which one each device would run and what
the others cost. Only alternatives this kernel can run are chosen; one it cannot (RoPE as a Cube matmul) is
shown with its price.
"""
from __future__ import annotations

import dataclasses
import json
import math
import operator

import networkx as nx
import torch
import torch.fx as fx

import cost_model
from autofuse.ops_vector import product_output      # (and registers the ops)
from autofuse.fused import (REDUCED, Family, Price, _adapt, _physical_order, keep_mask_call, keep_mask_price,
                            per_device, register_family)
from autofuse.graph import PRODUCTS, call
from cost_model.program import BIT, FLOATS, Input, Output, ProgramError, _is_ref, as_program, stored_shape
from cost_model.program_grad import backward_reads

aten = torch.ops.aten


def _family(match) -> str:
    return match.params["family"]


def _dtype(n) -> str:
    return str(n.meta["val"].dtype).replace("torch.", "")


def _alternatives(kind: str, args: tuple, kwargs: dict) -> dict:
    """device -> [(implementation, cycles, runnable)], cheapest first, from cost_model's alternatives."""
    price = cost_model.alternatives if kind == "vector" else cost_model.epilogue_alternatives
    return per_device(lambda d: [(name, int(e.cycles), _runnable(name)) for name, e in price(*args, device=d, **kwargs)])


def _runnable(name: str) -> bool:
    return name.startswith("vector_program") or name == "matmul_epilogue"


def _price(kernel, specs, device, search, alts, **params) -> Price:
    if not search:      # O1, O2: the tiling the kernel picks by itself, which the emitted call (no tiling) runs
        params["tiling"] = _kernel_default(kernel, specs, device, params)
    e = cost_model.estimate(kernel, specs, device=device, **params)
    p = Price(int(e.cycles), int(e.hbm_bytes), [kernel], e.bound, dict(e.tiling or {}), e.workspace_bytes)
    p.alternatives = alts
    return p


def _kernel_default(kernel, specs, device, params):
    """The generated kernels' own default tiling for this launch (None for a plain matmul: the backward's product
    recompute is eager's tuned matmul)."""
    from cost_model.devices import get_device
    from cost_model.program import as_program
    if kernel not in ("vector_program", "matmul_epilogue"):
        return None
    dev, prog = get_device(device), as_program(params["program"])
    if kernel == "vector_program":
        from cost_model.vector_program import kernel_default
        return kernel_default(dev, prog)
    from cost_model.matmul_epilogue import _dims, kernel_default
    M, N, K, dtype = _dims(specs, prog, params.get("trans_b", False))
    return kernel_default(dev, prog, M, N, K, dtype)


def _specs(match, nodes, shapes) -> list:
    """The kernel's input specs: a node's shape and dtype, or a drawn keep-mask's packed bits (uint8)."""
    drawn = {d[0] for d in match.params.get("draws", ())}
    return [(stored_shape(Input(BIT, tuple(s))), "uint8") if i in drawn else (tuple(s), _dtype(nodes[match.inputs[f"in{i}"]]))
            for i, s in enumerate(shapes)]


def _with_draws(price: Price, match, shapes, device: str) -> Price:
    """``price`` with the keep-mask generators the fused call launches first (DropOutGenMask, as eager's
    dropouts launch it: the same launches on both sides)."""
    gens = [keep_mask_price(shapes[d[0]], d[1], device) for d in match.params.get("draws", ())]
    if not gens:
        return price
    return dataclasses.replace(price, cycles=price.cycles + sum(int(e.cycles) for e in gens),
                               hbm_bytes=price.hbm_bytes + sum(int(e.hbm_bytes) for e in gens),
                               kernels=["dropout_gen_mask"] * len(gens) + list(price.kernels))


def price_vector(match, nodes: dict, device: str, search_tiling: bool) -> Price:
    prog = match.params["program"]
    keep = ()
    if training_graph(_graph(match, nodes)):
        keep = kept_values(prog, _free_inputs(prog, match, nodes, 0), _held_outputs(prog, match, nodes))
        prog, saved = with_saved(prog, keep)
        keep = keep if saved else ()
    specs = _specs(match, nodes, match.params["input_shapes"])
    alts = _alternatives("vector", (prog,), {})
    price = _price("vector_program", specs, device, search_tiling, alts, program=prog)
    if keep:
        price.options = {"keep": json.dumps(keep)}     # emit_vector stores these values for the backward
    return _with_draws(price, match, match.params["input_shapes"], device)


def _graph(match, nodes: dict) -> fx.Graph:
    return nodes[next(iter(match.nodes))].graph


# ops whose backward keeps their tensor operands (a matmul's, a convolution's, attention's q, k and v)
_KEEP_OPERANDS = PRODUCTS | {aten.convolution.default, aten.scaled_dot_product_attention.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
          aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default}


def _held(n, region) -> bool:
    """Whether node ``n`` (an input or an output of the fused ``region``, node names) is alive for the backward
    whatever the fused kernel keeps: a parameter or buffer, an input of the model, or a value an op outside the
    region keeps for its own backward (a matmul or attention reading it, directly or through views)."""
    if n is None:
        return False
    if n.op in ("get_attr", "placeholder"):
        return True
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        for u in x.users:
            if u.name in region or u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if u.target in _KEEP_OPERANDS:
                return True
            if u.target in _VIEWS and u.args and u.args[0] is x:
                stack.append(u)
    return False


def _free_inputs(prog, match, nodes: dict, first: int) -> set:
    """The program's inputs from ``first`` on (an epilogue's input 0 is its product) held anyway (:func:`_held`)."""
    region = set(match.nodes)
    return {k for k in range(first, len(prog.inputs)) if _held(nodes.get(match.inputs.get(f"in{k - first}")), region)}


def _held_outputs(prog, match, nodes: dict) -> dict:
    """:func:`kept_values`' weights of the values the kernel stores exactly as outputs held anyway (:func:`_held`):
    none."""
    region, vals = set(match.nodes), prog.values
    return {o.value: 0 for j, o in enumerate(prog.outputs)
            if o.dtype == vals[o.value].dtype and _held(nodes.get(match.outputs.get(f"out{j}")), region)}


def kept_values(prog, free=frozenset(), weigh=None) -> tuple:
    """The values of ``prog`` (numbers, inputs among them) its backward keeps: the fewest bytes that every path from
    the program's inputs to what the backward reads (:func:`~cost_model.program_grad.backward_reads`, for every
    float input) passes through, a minimum vertex cut (networkx's max-flow) of the program's dataflow. An input
    weighs its bytes (nothing for those in ``free``, held alive anyway: a parameter, an input of the model), a
    value its bytes in its own dtype at every row; on a tie, what the kernel stores already wins over an input
    (the region's output is what the next ops read, and often keep for their own backward: a softmax keeps its
    probabilities, as eager's), and an input over one more store (any other over an epilogue's product);
    ``weigh``: {value: weight, or None for one that cannot be kept}, for the caller's own. () when the backward is
    no Vector program. LayerNorm over a sum of embeddings keeps the sum (one tensor) in place of its terms."""
    wrt = [k for k, i in enumerate(prog.inputs) if i.dtype in FLOATS]
    try:
        reads = backward_reads(prog, wrt) if wrt else ()
    except ProgramError:
        return ()
    if not reads:
        return ()
    nin, vals, weigh = len(prog.inputs), prog.values, weigh or {}
    stored = {o.value for o in prog.outputs if o.dtype == vals[o.value].dtype}
    g = nx.DiGraph()
    for v, val in enumerate(vals):
        if v in weigh:
            cost = weigh[v]
        elif v < nin:
            inp = prog.inputs[v]
            cost = 0 if v in free else 4 * math.prod(stored_shape(inp) or (1,)) * _bytes(inp.dtype) + 1
        elif val.dtype in FLOATS:
            cost = 4 * prog.rows * val.width * _bytes(val.dtype) + (0 if v in stored else 2)
        else:
            cost = None            # a mask, an index: recomputed from what it reads, never kept itself
        if v < nin:
            g.add_edge("source", ("in", v))
        g.add_edge(("in", v), ("out", v), **({} if cost is None else {"capacity": cost}))
        if v >= nin:
            for a in dict.fromkeys(a for a in prog.instrs[v - nin].args if _is_ref(a)):
                g.add_edge(("out", a), ("in", v))
    for v in reads:
        g.add_edge(("out", v), "sink")
    _, (near, _) = nx.minimum_cut(g, "source", "sink")
    return tuple(v for v in range(len(vals)) if ("in", v) in near and ("out", v) not in near)


def _bytes(dtype: str) -> int:
    return {"float32": 4, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2}.get(dtype, 1)    # bit: packed


def with_saved(prog, keep, product: bool = False) -> tuple:
    """``(program, saved)``: ``prog`` storing the values ``keep`` (numbers, :func:`kept_values`) each in its own
    dtype, as outputs past its own where none holds it already, and ``saved`` the outputs that hold those values
    (the ops' ``saved``: their backward reads them in place of recomputing them). Inputs in ``keep`` are kept as
    inputs, but with ``product`` an epilogue's input 0, the product, which the kernel stores where it can
    (:func:`_storable_product`; not among ``saved``: the epilogue's backward finds it by
    :func:`~autofuse.ops_vector.product_output`)."""
    vals = prog.values
    outputs, saved = list(prog.outputs), []
    if product and 0 in keep and _storable_product(prog):
        outputs.append(Output(0, prog.inputs[0].dtype))
    for v in keep:
        if v < len(prog.inputs):
            continue
        j = next((j for j, o in enumerate(outputs) if o.value == v and o.dtype == vals[v].dtype), None)
        if j is None:
            outputs.append(Output(v, vals[v].dtype))
            j = len(outputs) - 1
        saved.append(j)
    if len(outputs) == len(prog.outputs):
        return prog, tuple(saved)
    return dataclasses.replace(prog, outputs=tuple(outputs)), tuple(saved)


# ops whose ``training`` argument (position, keyword) says the graph was captured in training mode
_TRAIN_ARG = {aten.native_dropout.default: (2, "train"), aten.dropout.default: (2, "train"),
              aten.batch_norm.default: (5, "training"), aten._native_batch_norm_legit_functional.default: (5, "training"),
              aten._native_batch_norm_legit.default: (5, "training")}


def training_graph(graph: fx.Graph) -> bool:
    """Whether ``graph`` was captured for training: its module's ``meta["autofuse_training"]`` when capture
    records it, else whether an op of it runs in training mode (a dropout that drops, a batch norm on batch
    statistics). A model without such an op in ``train()`` reads as eval here: its epilogues then write no
    product, and their backward recomputes it (a matmul more, still correct)."""
    flag = getattr(graph.owning_module, "meta", {}).get("autofuse_training")
    if flag is not None:
        return bool(flag)
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _TRAIN_ARG:
            i, name = _TRAIN_ARG[n.target]
            if (n.args[i] if len(n.args) > i else n.kwargs.get(name)) is True:
                return True
    return False


def _storable_product(prog) -> bool:
    """Whether an epilogue can add its product (input 0) as an output: not one already, and as wide as every
    output (SwiGLU on a fused gate_up projection outputs half the product's width; the kernel walks the
    output's columns, each tile reading both halves, so it cannot store the product)."""
    return all(o.value != 0 and prog.values[o.value].width == prog.values[0].width for o in prog.outputs)


def price_epilogue(match, nodes: dict, device: str, search_tiling: bool) -> Price:
    p = match.params
    prog = p["program"]
    keep, recompute = (), False
    if training_graph(nodes[match.inputs["a"]].graph):
        # a training plan's backward: what it keeps of the epilogue (kept_values), the product among the values
        # (the kernel stores it, or where it cannot, a matmul recomputes it in the backward, keeping nothing)
        keep = kept_values(prog, _free_inputs(prog, match, nodes, 1),
                           {**_epilogue_weights(prog), **_held_outputs(prog, match, nodes)})
        trained, saved = with_saved(prog, keep, product=True)
        recompute = 0 in keep and product_output(trained) is None
        keep = keep if saved or len(trained.outputs) > len(prog.outputs) else ()
        prog = trained
    a, b = (nodes[match.inputs[r]] for r in ("a", "b"))
    specs = [(tuple(a.meta["val"].shape), _dtype(a)), (tuple(b.meta["val"].shape), _dtype(b))]
    extra = _specs(match, nodes, p["extra_shapes"])
    bias = nodes[match.inputs["bias"]] if "bias" in match.inputs else None
    bspec = None if bias is None else (tuple(bias.meta["val"].shape), _dtype(bias))
    try:
        alts = _alternatives("epilogue", (specs[0], specs[1], prog), {"bias": bspec, "trans_b": p["trans_b"]})
        price = _price("matmul_epilogue", specs + extra, device, search_tiling, alts, program=prog, bias=bspec,
                       trans_b=p["trans_b"])
    except ProgramError as e:
        raise _naming_inputs(e, match, nodes) from None
    if keep:
        price.options = {"keep": json.dumps(keep)}     # emit_epilogue stores these for the backward
    if recompute:
        # a training plan whose epilogue cannot store its product (outputs narrower than it): the backward
        # recomputes the product with a matmul, eager's backward reads it; the plan weighs that matmul too, so
        # the Vector chain alone (its product written by the matmul) wins where the epilogue saves less
        redo = _price("matmul", specs, device, search_tiling, {}, trans_b=p["trans_b"])
        price = dataclasses.replace(price, cycles=price.cycles + redo.cycles,
                                    hbm_bytes=price.hbm_bytes + redo.hbm_bytes,
                                    kernels=list(price.kernels) + ["matmul (the backward's product recompute)"])
    return _with_draws(price, match, p["extra_shapes"], device)


def _epilogue_weights(prog) -> dict:
    """:func:`kept_values`' weights of an epilogue's own: the product (input 0) weighs its bytes (on a tie it loses
    to a value computed from it, which the backward then need not recompute nor combine with other inputs that may
    not be held: MiniMax's residual sum before its norm), or where the kernel cannot store it, almost nothing (a
    matmul in the backward recomputes it from what it keeps anyway, the plan prices that matmul); a value as wide as
    the outputs weighs as by default, any other cannot be kept (the kernel stores tiles of its output's columns)."""
    vals = prog.values
    width = {vals[o.value].width for o in prog.outputs}
    weights = {v: None for v in range(len(prog.inputs), len(vals)) if {vals[v].width} != width}
    if any(o.value == 0 and o.dtype == prog.inputs[0].dtype for o in prog.outputs):
        return weights          # stored already: as any value
    inp = prog.inputs[0]
    weights[0] = 4 * prog.rows * vals[0].width * _bytes(inp.dtype) + 3 if _storable_product(prog) else 1
    return weights


def _naming_inputs(e: ProgramError, match, nodes: dict) -> ProgramError:
    """``e``, about some inputs of an epilogue's program (``e.inputs``, the product input 0), with what each is in
    the model: its node, what computes it (a cos or sin table, through views, is called one) and the region's ops
    that read it."""
    # imported here: patterns.vector_chain registers its matcher when imported, and imported with this module it
    # would come ahead of attention's (``autofuse patterns`` lists the families in registration order)
    from patterns.vector_chain import _KEEPS, _trace_table
    said = []
    for k in e.inputs:
        n = nodes.get(match.inputs.get(f"in{k - 1}")) if k > 0 else None
        if n is None:
            continue
        if n.op == "placeholder":
            what = "an input of the model"
        elif n.op == "get_attr":
            what = f"the parameter or buffer {n.target}"
        else:
            fn = _trace_table(n)[1]
            src = n
            while src.op == "call_function" and src.target in _KEEPS and isinstance(src.args[0], fx.Node):
                src = src.args[0]
            through = " through views" if src is not n else ""
            what = f"a {fn} table (computed by aten.{fn})" if fn else \
                f"computed by {getattr(src.target, '__name__', src.target)} at {src.name}{through}"
        readers = [u.name for u in n.users if u.name in match.nodes]
        said.append(f"{n.name} {list(n.meta['val'].shape)}, {what}" + (f", read by {', '.join(readers)}"
                                                                      if readers else ""))
    return ProgramError(f"{e}. The input{'s' if len(said) > 1 else ''} read so: {'; '.join(said)}", e.inputs) \
        if said else e


def _kwargs(device: str, price: Price, level: str) -> dict:
    tiling = price.tiling if level == "O3" else {}
    return {"device": device, "tiling": json.dumps(tiling, sort_keys=True) if tiling else "", **price.options}


def _view(g, x: fx.Node, shape_) -> fx.Node:
    return x if tuple(x.meta["val"].shape) == tuple(shape_) else call(g, aten.reshape.default, x, list(shape_))


def _outputs(g, results: fx.Node, m) -> dict:
    p = m.params
    outs = {}
    for i, like in enumerate(p["out_likes"]):
        o = call(g, operator.getitem, results, i)
        outs[f"out{i}"] = _adapt(g, o, like)
    return outs


def _inputs(g, ins: dict, m, shapes, device: str) -> list:
    """The call's input tensors: the region's, viewed as the program declares them, and for each dropout the
    keep-mask its fused call draws here, in graph order (``dropout_gen_mask`` on the dropout's shape and
    dtype, in its memory order: the same draws as eager's, when no other random op lies between; the planner
    checks that)."""
    drawn = {i: (p, dt, order) for i, p, dt, order in m.params.get("draws", ())}
    xs = []
    for i, s in enumerate(shapes):
        if i not in drawn:
            xs.append(_view(g, ins[f"in{i}"], s))
            continue
        p, dt, order = drawn[i]
        xs.append(keep_mask_call(g, s, p, getattr(torch, dt), device, m.params["out_likes"][0], order))
    return xs


def _layouts(prog, likes) -> str:
    """``vector_program``'s ``layouts``: the memory order of each captured value an output replaces, where it is a
    permutation of the dims other than row-major and the output has its shape (see ``ops_vector._laid_out``)."""
    orders = []
    for shape_, like in zip(prog.output_shapes(), likes):
        order = None
        if tuple(shape_) == tuple(like.shape) and like.dim() >= 2 and not like.is_contiguous():
            o = _physical_order(like)
            dense = torch.empty([like.shape[d] for d in o], device="meta").permute(*[o.index(d) for d in range(len(o))])
            order = o if dense.stride() == like.stride() else None
        orders.append(order)
    return json.dumps(orders) if any(orders) else ""


def emit_vector(g: fx.Graph, ins: dict, m, kwargs: dict) -> dict:
    """The fused call; its outputs past the match's (values a training plan keeps for the backward) are left for
    autograd."""
    p = m.params
    kwargs = dict(kwargs)
    prog, saved = with_saved(p["program"], json.loads(kwargs.pop("keep", "[]")))
    xs = _inputs(g, ins, m, p["input_shapes"], kwargs.get("device", "ascend910"))
    layouts = _layouts(p["program"], p["out_likes"])
    if layouts:
        kwargs["layouts"] = layouts
    if saved:
        kwargs["saved"] = json.dumps(saved)
    r = call(g, torch.ops.autofuse.vector_program.default, xs, prog.to_json(), **kwargs)
    r.meta["autofuse_match"] = m
    return _outputs(g, r, m)


def emit_epilogue(g: fx.Graph, ins: dict, m, kwargs: dict) -> dict:
    """The fused call; its outputs past the match's (what a training plan keeps: the product, values) are left for
    autograd."""
    p = m.params
    kwargs = dict(kwargs)
    prog, saved = with_saved(p["program"], json.loads(kwargs.pop("keep", "[]")), product=True)
    if saved:
        kwargs["saved"] = json.dumps(saved)
    extra = _inputs(g, ins, m, p["extra_shapes"], kwargs.get("device", "ascend910"))
    r = call(g, torch.ops.autofuse.matmul_epilogue.default, ins["a"], ins["b"], ins.get("bias"), extra,
             prog.to_json(), p["trans_b"], **kwargs)
    r.meta["autofuse_match"] = m
    return _outputs(g, r, m)


def shrink_rows(match) -> dict:
    """Leading (row) dims of the program above 256, reduced to ``REDUCED``: the columns, and the weights that
    span them, keep their size, so the program's column work is checked as it will run."""
    lead = match.params["program"].lead
    sizes = {d: REDUCED for d in set(lead) if d > 256}
    whole, reduced = math.prod(lead), math.prod(sizes.get(d, d) for d in lead)
    if sizes and whole not in sizes and whole not in lead:
        sizes[whole] = reduced      # the rows flattened into one dim (a matmul's [B*S, K] operand)
    return sizes


def resize(match, sizes: dict):
    """The same match for shapes reduced by ``sizes`` (the program's rows and its inputs' leading dims)."""
    p = match.params
    prog = p["program"]
    sub = lambda s: tuple(sizes.get(d, d) for d in s)  # noqa: E731
    new_prog = as_program(dataclasses.replace(prog, lead=sub(prog.lead),
                                              inputs=tuple(Input(i.dtype, sub(i.shape)) for i in prog.inputs)))
    params = dict(p, program=new_prog, input_shapes=tuple(sub(s) for s in p["input_shapes"]),
                  output_shapes=tuple(sub(s) for s in p["output_shapes"]),
                  out_likes=tuple(x.new_empty(sub(x.shape)) for x in p["out_likes"]))
    if "extra_shapes" in p:
        params["extra_shapes"] = tuple(sub(s) for s in p["extra_shapes"])
    return dataclasses.replace(match, params=params)


VECTOR_CHAIN = register_family(Family("vector_chain", torch.ops.autofuse.vector_program.default, "vector_program",
                                      emit_vector, price_vector, _kwargs, shrink_rows, resize))
MATMUL_EPILOGUE = register_family(Family("matmul_epilogue", torch.ops.autofuse.matmul_epilogue.default,
                                         "matmul_epilogue", emit_epilogue, price_epilogue, _kwargs, shrink_rows,
                                         resize))
