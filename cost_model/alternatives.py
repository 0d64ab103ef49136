"""Implementation alternatives of a Vector program, priced per device: what the compiler chooses between.

    cost_model.alternatives(program, device="ascend910")        -> [(name, Estimate), ...], cheapest first
    cost_model.epilogue_alternatives(a, b, program, device=...)  -> [(name, Estimate), ...]

* ``vector_program``: the generated kernel with its searched tiling. When the program reduces along its
  rows, also ``vector_program/one pass`` (whole rows in UB, if they fit) and ``vector_program/chunked``
  (column chunks, a pass per reduction level plus one): the norm's one-pass vs chunked choice.
* RoPE: when the program rotates a value by a half rotation (``cat(-x2, x1)``) or by pairs (``interleave``),
  ``rope on Cube``: each rotated input ``x`` multiplied by a rotation matrix ``R`` (``x @ R`` is exactly the
  rotated ``x``, one signed 1 per column) on the Cube, the rest of the program as a ``vector_program``
  reading the rotations as inputs; and, with one rotated input, ``rope on Cube, fused`` (the matmul by R
  with the program as its ``matmul_epilogue``).
* A matmul with an epilogue (``epilogue_alternatives``): ``matmul_epilogue`` vs ``matmul + vector_program``.

An alternative of several launches is priced as their sum (an :class:`Estimate` whose ``notes`` name the
launches and their tilings).
"""
from __future__ import annotations

from cost_model.estimate import UNITS, Estimate, estimate
from cost_model.program import Input, Instr, Output, Program, as_program


def _specs(prog):
    return [(tuple(i.shape), i.dtype) for i in prog.inputs]


def combine(name: str, parts) -> Estimate:
    """Launches one after the other: ``[(label, Estimate)]`` priced as their sum."""
    ests = [e for _, e in parts]
    busy = {u: sum(e.busy.get(u, 0) for e in ests) for u in UNITS}
    nbytes = {}
    for e in ests:
        for k, v in e.bytes.items():
            nbytes[k] = nbytes.get(k, 0) + v
    notes = tuple(f"{lbl}: {e.cycles:,} cycles, tiling {e.tiling}" for lbl, e in parts)
    return Estimate(kernel=name, device=ests[0].device, cycles=sum(e.cycles for e in ests),
                    hbm_bytes=sum(e.hbm_bytes for e in ests), bytes=nbytes, busy=busy,
                    bound=max(UNITS, key=lambda u: busy[u]), tiling=None,
                    roofline=sum(e.roofline for e in ests), flops=sum(e.flops for e in ests), notes=notes,
                    workspace_bytes=max(e.workspace_bytes for e in ests))


def _rotations(p: Program):
    """Values of ``p`` that are a rotation of a value ``x``: ``[(value, x, kind)]`` with kind ``half``
    (``cat(neg(x[h:]), x[:h])``) or ``pairs`` (``interleave(neg(x[1::2]), x[0::2])``)."""
    nin = len(p.inputs)

    def ins(v):
        return p.instrs[v - nin] if isinstance(v, int) and v >= nin else None

    def sl(v):
        i = ins(v)
        return (i.args[0], i.start, p.values[i.args[0]].width if i.stop is None else i.stop, i.step) \
            if i is not None and i.op == "slice" else None

    out = []
    for k, i in enumerate(p.instrs):
        if i.op not in ("cat", "interleave") or len(i.args) != 2:
            continue
        a, b = i.args
        na = ins(a)
        if na is None or na.op != "neg":
            continue
        s1, s2 = sl(na.args[0]), sl(b)
        if s1 is None or s2 is None or s1[0] != s2[0]:
            continue
        x, w = s1[0], p.values[s1[0]].width
        if i.op == "cat" and s1[1:] == (w // 2, w, 1) and s2[1:] == (0, w // 2, 1) and w % 2 == 0:
            out.append((nin + k, x, "half"))
        elif i.op == "interleave" and s1[1:] == (1, w, 2) and s2[1:] == (0, w, 2) and w % 2 == 0:
            out.append((nin + k, x, "pairs"))
    return out


def _replace(p: Program, repl: dict, first: list) -> Program:
    """``p`` with values ``repl[v]`` read from new inputs: inputs ``first`` (Input specs) are put first, then
    ``p``'s own; value ``v`` in ``repl`` becomes new input ``repl[v]``."""
    shift = len(first)
    nin = len(p.inputs)
    newnum = {}
    for v in range(nin):
        newnum[v] = v + shift
    instrs = []
    for k, ins in enumerate(p.instrs):
        v = nin + k
        if v in repl:                           # read it from the new input (in fp32: a free cast)
            instrs.append(Instr("cast", (repl[v],), dtype="float32"))
            newnum[v] = shift + nin + len(instrs) - 1
            continue
        args = tuple(newnum[a] if isinstance(a, int) and not isinstance(a, bool) else a for a in ins.args)
        instrs.append(Instr(ins.op, args, ins.dtype, ins.kind, ins.start, ins.stop, ins.step))
        newnum[v] = shift + nin + len(instrs) - 1
    outs = tuple(Output(newnum[o.value], o.dtype) for o in p.outputs)
    return Program(p.lead, tuple(first) + tuple(p.inputs), tuple(instrs), outs)


def alternatives(program, device="ascend910") -> list:
    """The ways to run ``program`` (see the module docstring), priced on ``device``, cheapest first."""
    p = as_program(program)
    specs = _specs(p)
    out = [("vector_program", estimate("vector_program", specs, device=device, program=p))]
    if any(i.op == "reduce" for i in p.instrs):
        from cost_model.vector_program import lowered, _max_rows, _fits
        from cost_model.devices import get_device
        dev = get_device(device)
        whole = lowered(p, False)
        if _fits(dev, whole, 1):
            r = max(1, min(_max_rows(dev, whole, 64), p.rows))
            out.append(("vector_program/one pass", estimate("vector_program", specs, device=device, program=p,
                                                            tiling={"rows": r})))
        try:
            ch = lowered(p, True)
            W = ch.width
            C = max(64, -(-(W // 2) // 64) * 64) if W > 64 else None
            if C is not None and C < W:
                r = max(1, min(_max_rows(dev, ch, 64, C), p.rows))
                out.append((f"vector_program/chunked ({C} columns)",
                            estimate("vector_program", specs, device=device, program=p,
                                     tiling={"rows": r, "chunk": C})))
        except ValueError:                     # column shuffles: whole rows only
            pass
    rots = _rotations(p)
    if rots:
        rot_inputs = []
        repl = {}
        for v, x, kind in rots:
            D = p.values[x].width
            dt = p.inputs[x].dtype if x < len(p.inputs) else "float32"
            shape = tuple(p.lead) + (D,)
            repl[v] = len(rot_inputs)
            rot_inputs.append(Input(dt if dt != "bool" else "float32", shape))
        rest = _replace(p, repl, rot_inputs)
        parts = []
        for (v, x, kind), ri in zip(rots, rot_inputs):
            D = ri.shape[-1]
            rows = p.rows
            parts.append((f"matmul x@R ({kind})", estimate("matmul", [((rows, D), ri.dtype), ((D, D), ri.dtype)],
                                                          device=device)))
        parts.append(("vector_program", estimate("vector_program", _specs(rest), device=device, program=rest)))
        out.append(("rope on Cube", combine("rope on Cube", parts)))
        if len(rots) == 1 and rots[0][1] < len(p.inputs):
            D = rot_inputs[0].shape[-1]
            dt = rot_inputs[0].dtype
            try:
                e = estimate("matmul_epilogue", [((p.rows, D), dt), ((D, D), dt)] + _specs(p), device=device,
                             program=rest)
                out.append(("rope on Cube, fused", e))
            except ValueError:                 # an input the epilogue cannot take (broadcast over some dims)
                pass
    return sorted(out, key=lambda ne: ne[1].cycles)


def epilogue_alternatives(a, b, program, device="ascend910", bias=None, trans_b=False) -> list:
    """``matmul_epilogue`` vs the matmul then the program as its own ``vector_program``, cheapest first."""
    p = as_program(program)
    extra = _specs(p)[1:]
    fused = estimate("matmul_epilogue", [a, b] + extra, device=device, program=p, bias=bias, trans_b=trans_b)
    mm = estimate("matmul", [a, b], device=device, bias=bias, trans_b=trans_b, out_dtype=p.inputs[0].dtype)
    vp = estimate("vector_program", _specs(p), device=device, program=p)
    out = [("matmul_epilogue", fused),
           ("matmul + vector_program", combine("matmul + vector_program", [("matmul", mm), ("vector_program", vp)]))]
    return sorted(out, key=lambda ne: ne[1].cycles)


__all__ = ["alternatives", "combine", "epilogue_alternatives"]
