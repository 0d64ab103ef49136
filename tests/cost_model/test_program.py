"""The Vector program IR: validation, inference, JSON, geometry and the lowering's decisions."""
import pytest

import cost_model
from cost_model.lowering import geometry, lower
from cost_model.program import Builder, Input, Instr, Output, Program, ProgramError, as_program, random_program


def rms(lead=(64,), H=256, dt="float16"):
    b = Builder(lead)
    x, w = b.input(dt, tuple(lead) + (H,)), b.input(dt, (H,))
    xf = b.cast(x, dtype="float32")
    r = b.rsqrt(b.add(b.reduce(b.mul(xf, xf), kind="mean"), 1e-6))
    b.output(b.mul(b.cast(b.mul(xf, r), dtype=dt), w), dt)
    b.output(r, "float32")
    return b.build()


def test_inference_and_shapes():
    p = rms()
    assert p.values[0].width == 256 and p.values[1].rowvar == (False,)
    red = next(i for i, ins in enumerate(p.instrs) if ins.op == "reduce") + len(p.inputs)
    assert p.values[red].width == 1 and p.values[red].level == 1 and p.values[red].dtype == "float32"
    assert p.output_shapes() == [(64, 256), (64, 1)]
    assert p.levels == 1


def test_json_roundtrip_and_hash():
    p = random_program(3, (2, 5), 40, "bfloat16", n_ops=10, reductions=2, shuffles=True)
    q = Program.from_json(p.to_json())
    assert q == p and hash(q) == hash(p)
    assert as_program(p.to_json()) == p and as_program(p.to_dict()) == p
    assert "ops" in repr(p)


@pytest.mark.parametrize("build, msg", [
    (lambda b, x: b.add(b.neg(x), b.input("float16", (4, 8))), "declare every input"),
    (lambda b, x: b.add(x, b.slice(x, start=0, stop=5)), "do not broadcast"),
    (lambda b, x: b.add(b.gt(x, 0.0), x), "a bool operand"),
    (lambda b, x: b.reduce(x, kind="prod"), "kind"),
    (lambda b, x: b.slice(x, start=4, stop=2), "slice"),
    (lambda b, x: b.cast(x, dtype="int8"), "dtype"),
    (lambda b, x: b.where(x, x, 0.0), "condition"),
    (lambda b, x: b.op("frobnicate", x), "unknown op"),
])
def test_malformed_programs_are_refused(build, msg):
    b = Builder((4,))
    x = b.input("float32", (4, 8))
    with pytest.raises(ProgramError, match=msg):
        v = build(b, x)
        b.output(v, "float32")
        b.build()


def test_bad_references_and_shapes():
    with pytest.raises(ProgramError, match="earlier value"):
        Program((4,), (Input("float32", (4, 8)),), (Instr("neg", (3,)),), (Output(1, "float32"),))
    with pytest.raises(ProgramError, match="does not broadcast"):
        Program((4, 3), (Input("float32", (5, 3, 8)),), (), (Output(0, "float32"),))
    with pytest.raises(ProgramError, match="immediate"):
        Program.from_dict({"lead": [4], "inputs": [["float32", [4, 8]]],
                           "instrs": [{"op": "add", "args": [0, True]}], "outputs": [[1, "float32"]]})


def test_geometry_coalesces_and_walks_block_major_for_outer_broadcasts():
    b = Builder((2, 8, 300))
    q, c = b.input("float16", (2, 8, 300, 64)), b.input("float32", (2, 1, 300, 64))
    b.output(b.mul(q, c), "float16")
    g = geometry(b.build())
    assert g.groups == (2, 8, 300) and g.block_major
    assert g.var[1] == (True, False, True)
    g2 = geometry(rms((2, 3, 5)))             # every input varies alike: one group of rows
    assert g2.groups == (30,) and not g2.block_major


def test_lowering_loads_slices_of_inputs_as_views():
    b = Builder((16,))
    gu = b.input("float16", (16, 192))
    b.output(b.mul(b.silu(b.slice(gu, start=0, stop=96)), b.slice(gu, start=96, stop=192)), "float16")
    low = lower(b.build())
    assert [(v.offset, v.width) for v in low.views] == [(0, 96), (96, 96)]
    assert low.width == 96
    assert not any(op.kind == "gather" for op in low.passes[0].ops)


def test_lowering_hoists_weight_casts_and_chunks_in_passes():
    p = rms()
    whole = lower(p)
    cast_w = [op for op in whole.passes[0].ops if op.kind == "cast_in" and op.slow]
    assert len(cast_w) == 1                      # the weight's cast runs only when the weight is reloaded
    ch = lower(p, chunked=True)
    assert len(ch.passes) == 2                   # one reduction level: accumulate, then normalise
    assert any(op.kind == "merge" for op in ch.passes[0].ops)
    assert [op.kind for op in ch.passes[0].end][:1] == ["mean"]
    assert ch.passes[0].end_stores and ch.passes[1].stores


def test_chunked_lowering_refuses_shuffles():
    p = random_program(1, (8,), 64, "float16", n_ops=3, reductions=0, shuffles=True)
    lower(p)
    with pytest.raises(ProgramError, match="whole rows"):
        lower(p, chunked=True)


def test_outputs_written_in_place():
    """An op producing an output's dtype writes straight into the output tile (no copy pass)."""
    b = Builder((8,))
    x = b.input("float32", (8, 64))
    b.output(b.tanh(b.exp(x)), "float32")
    ops = lower(b.build()).passes[0].ops
    assert [op.kind for op in ops] == ["ew", "ew"] and ops[-1].dst == ("out", 0)


def test_estimate_takes_the_program_as_json():
    p = rms()
    specs = [(i.shape, i.dtype) for i in p.inputs]
    a = cost_model.estimate("vector_program", specs, program=p)
    b = cost_model.estimate("vector_program", specs, program=p.to_json())
    assert a.cycles == b.cycles and a.tiling == b.tiling
    with pytest.raises(ProgramError, match="declares"):
        cost_model.estimate("vector_program", [((64, 255), "float16"), specs[1]], program=p)


def test_the_cost_models_elementwise_passes_restate_the_simulators():
    # every op of the simulator's table (the roundings' casts and selects, sign's compare-selects, ...) is priced as
    # the passes it runs, in the same dtype rules and work tiles
    from autofuse.npu.kernels.vector import OPS as SIM
    from cost_model.vector import OPS as MODEL
    for name, op in SIM.items():
        assert name in MODEL, name
        assert MODEL[name][:4] == (op.kind, op.native16, op.temps, op.scalar), name
        for has, s in ((False, None), (True, 2.0), (True, 0.3)):
            if (op.scalar == "none" and has) or (op.scalar == "required" and not has):
                continue
            assert MODEL[name][4](has, s) == len(op.passes(s, has)), (name, has, s)
