"""The generated Vector kernel: random programs vs the torch interpreter, eager chains vs float64, broadcast
kinds, reductions (whole rows and chunked), shuffles, capacity and utilisation."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings, strategies as st

from autofuse import npu
from autofuse.npu.machine import CapacityError
from autofuse.vector_program import _eval, program_from_function, run_program_torch, torch_dtype
from cost_model.program import Builder, ProgramError, random_program

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vector_chains as vc  # noqa: E402

DEVICES = ("ascend910", "ascend910b", "ascend310p")
EPS32 = 2.0 ** -23
# one unit in the last place of an output dtype, relative: two fp32 values a hair apart may round to
# neighbouring values of the output dtype
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "bool": 0.0}


def arrays(p, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in p.inputs:
        shape = i.shape or (1,)
        if i.dtype == "bool":
            out.append((torch.rand(shape, generator=g) < 0.5).reshape(i.shape))
        else:
            out.append(torch.randn(shape, generator=g).reshape(i.shape).to(torch_dtype(i.dtype)))
    return out


def magnitude(p, xs):
    """The largest |value| any step of the program takes (its fp32 rounding errors scale with it)."""
    nl = len(p.lead)
    vals = [t.reshape((1,) * (nl + 1 - len(s.shape or (1,))) + tuple(s.shape or (1,))) for s, t in zip(p.inputs, xs)]
    for ins in p.instrs:
        vals.append(_eval(ins, [vals[a] if isinstance(a, int) else a for a in ins.args]))
    return max(float(v.float().abs().max()) for v in vals if v.numel() and v.dtype != torch.bool)


def check_against_interpreter(p, xs, device="ascend910", tiling=None):
    r = npu.run("vector_program", *xs, program=p, device=device, tiling=tiling)
    ref = run_program_torch(p, xs)
    # fp32 steps: numpy and torch differ by a few ulps per transcendental op and in reduction order; 64 ulps
    # of the largest intermediate per op bounds that on any CPU, and is far below a wrong op's error.
    # An intermediate cast to fp16/bf16 may round two such values to neighbouring narrow values: one narrow
    # ulp of the intermediate, carried on by the later ops (which scale by at most the values' magnitude)
    M = magnitude(p, xs)
    narrow = sum(ULP[i.dtype] for i in p.instrs if i.op == "cast" and i.dtype in ("float16", "bfloat16"))
    slack = 64 * max(len(p.instrs), 1) * EPS32 * M + narrow * M * max(1.0, M)
    for got, want, o in zip(r.outputs, ref, p.outputs):
        got = torch.from_numpy(np.asarray(got))
        assert tuple(got.shape) == tuple(want.shape)
        if o.dtype == "bool":
            assert (got == want).float().mean() > 0.99           # a compare at a hair's distance may flip
            continue
        err = (got.double() - want.double()).abs()
        bound = ULP[o.dtype] * want.double().abs() + slack
        assert (err <= bound).all(), f"max error {err.max():.3g} (program {p})"
    return r


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_match_the_interpreter(seed):
    lead = [(7,), (3, 20), (1,), (2, 4, 9)][seed % 4]
    width = [64, 33, 130, 256][seed % 4 - 1]
    dt = ["float16", "bfloat16", "float32"][seed % 3]
    p = random_program(seed, lead, width, dt, n_ops=4 + seed % 9, reductions=seed % 3, shuffles=seed % 4 == 1)
    check_against_interpreter(p, arrays(p, seed), DEVICES[seed % 3])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), rows=st.integers(1, 40), width=st.integers(1, 200),
       dt=st.sampled_from(["float16", "bfloat16", "float32"]), red=st.integers(0, 2),
       dev=st.sampled_from(DEVICES))
@example(seed=1212, rows=6, width=121, dt="bfloat16", red=1, dev="ascend910")     # a bf16 round trip mid-chain
def test_property_random_programs(seed, rows, width, dt, red, dev):
    p = random_program(seed, (rows,), width, dt, n_ops=1 + seed % 10, reductions=red,
                       shuffles=width % 2 == 0 and seed % 3 == 0)
    check_against_interpreter(p, arrays(p, seed), dev)


def test_chunked_rows_match_whole_rows():
    """A row walked in column chunks (two or three passes) gives what whole rows give."""
    for seed, red in ((5, 1), (8, 2)):
        p = random_program(seed, (9,), 1000, "float16", n_ops=7, reductions=red, extras=("weight", "row", "scalar"))
        xs = arrays(p, seed)
        whole = check_against_interpreter(p, xs, "ascend910b")
        chunked = check_against_interpreter(p, xs, "ascend910b", {"rows": 4, "chunk": 320})
        assert chunked.stats.cycles != whole.stats.cycles     # a different schedule ran
        for a, b in zip(whole.outputs, chunked.outputs):
            # the chunks' partial reductions add in another order: fp32 rounding of the sums, then the output's
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                       rtol=2 ** -9, atol=1e-5)


# ------------------------------------------------------------------------------------------ eager chains
def rope_interleaved(q, cos, sin):
    rot = torch.stack((-q[..., 1::2], q[..., 0::2]), -1).flatten(-2)
    return q * cos + rot * sin


def softmax(x):
    return torch.softmax(x, -1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def bias_gelu_scale(x, b, s):
    return F.gelu(x + b, approximate="tanh") * s


def masked(x, m):
    return torch.where(m, x, torch.zeros_like(x)).amax(-1, keepdim=True) + x.amin(-1, keepdim=True)


def norm_and_rope_of_a_split(x, w, cos, sin):
    """DeepSeek's latent projection: RMSNorm of the first columns, interleaved RoPE of the rest, two outputs
    of different widths read through two slices of one input."""
    a, r = x[..., :w.shape[0]], x[..., w.shape[0]:]
    n = w * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6))
    e, o = r[..., 0::2], r[..., 1::2]
    return n, torch.cat((e * cos - o * sin, o * cos + e * sin), -1)


CHAINS = [
    (vc.rms_norm, [(6, 40, 256), (256,)]),
    (vc.add_rms_norm, [(50, 96), (50, 96), (96,)]),
    (vc.rope, [(1, 4, 33, 64), (1, 4, 33, 64), (1, 33, 64), (1, 33, 64)]),
    (vc.swiglu, [(40, 130), (40, 130)]),
    (rope_interleaved, [(2, 3, 17, 32), (17, 32), (17, 32)]),
    (softmax, [(3, 11, 100)]),
    (layer_norm, [(70, 77), (77,), (77,)]),
    (bias_gelu_scale, [(30, 200), (200,), (30, 1)]),
    (norm_and_rope_of_a_split, [(2, 1, 9, 48), (32,), (1, 1, 9, 8), (1, 1, 9, 8)]),
]

# DeepSeek's latent split as the discovery pass builds it (captured from a DeepSeek-V3 config): slices of one
# input and outputs narrower than the program's widest value, the narrow one first
SPLIT = ('{"lead":[2,1,8],"inputs":[["float32",[2,1,8,24]],["float32",[16]],["float32",[1,1,8,4]],'
         '["float32",[1,1,8,4]]],"instrs":[{"op":"slice","args":[0],"stop":16},{"op":"slice","args":[0],"stop":24,'
         '"start":16},{"op":"pow","args":[4,2.0]},{"op":"reduce","args":[6],"kind":"mean"},{"op":"add","args":'
         '[7,1e-06]},{"op":"rsqrt","args":[8]},{"op":"mul","args":[4,9]},{"op":"mul","args":[1,10]},{"op":"slice",'
         '"args":[5],"stop":8,"step":2},{"op":"slice","args":[5],"stop":8,"start":1,"step":2},{"op":"mul","args":'
         '[12,2]},{"op":"mul","args":[13,3]},{"op":"sub","args":[14,15]},{"op":"mul","args":[13,2]},{"op":"mul",'
         '"args":[12,3]},{"op":"add","args":[17,18]},{"op":"cat","args":[16,19]}],"outputs":[[11,"float32"],'
         '[20,"float32"]]}')
ROPE_AFTER_PASS = ('{"lead":[2,4,8],"inputs":[["float32",[2,4,8,16]],["float32",[1,1,8,4]],["float32",[1,1,8,4]]],'
                   '"instrs":[{"op":"slice","args":[0],"stop":8},{"op":"slice","args":[0],"stop":16,"start":8},'
                   '{"op":"slice","args":[4],"stop":8,"step":2},{"op":"slice","args":[4],"stop":8,"start":1,"step":2},'
                   '{"op":"mul","args":[5,1]},{"op":"mul","args":[6,2]},{"op":"sub","args":[7,8]},{"op":"mul","args":'
                   '[6,1]},{"op":"mul","args":[5,2]},{"op":"add","args":[10,11]},{"op":"cat","args":[9,12]},'
                   '{"op":"cat","args":[3,13]}],"outputs":[[14,"float32"]]}')


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("prog", ["split", "rope_after_pass"])
def test_views_and_outputs_narrower_than_the_widest_value(prog, rows):
    """Each slice of an input loads its own columns and each output stores its own, whatever the widest value."""
    g = torch.Generator().manual_seed(0)
    if prog == "split":
        x, w, c, s = (torch.randn(sh, generator=g) for sh in [(2, 1, 8, 24), (16,), (1, 1, 8, 4), (1, 1, 8, 4)])
        want = norm_and_rope_of_a_split(x, w, c, s)
        r = npu.run("vector_program", x.numpy(), w.numpy(), c.numpy(), s.numpy(), program=SPLIT,
                    device="ascend910", tiling={"rows": rows})
    else:
        x, c, s = (torch.randn(sh, generator=g) for sh in [(2, 4, 8, 16), (1, 1, 8, 4), (1, 1, 8, 4)])
        e, o = x[..., 8::2], x[..., 9::2]
        want = (torch.cat((x[..., :8], e * c - o * s, o * c + e * s), -1),)
        r = npu.run("vector_program", x.numpy(), c.numpy(), s.numpy(), program=ROPE_AFTER_PASS,
                    device="ascend910", tiling={"rows": rows})
    for got, ref in zip(r.outputs, want):
        # fp32 on both sides: the norm's mean is summed in another order (a few ulp of its rsqrt)
        torch.testing.assert_close(torch.from_numpy(np.asarray(got)), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn, shapes", CHAINS, ids=[f.__name__ for f, _ in CHAINS])
def test_eager_chains(fn, shapes, dtype):
    """The generated kernel computes the chain at least as accurately as eager does (both against float64),
    up to one rounding of the output: eager rounds every intermediate to fp16/bf16, the program keeps fp32."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    built, gm = program_from_function(fn, args)
    ins = vc.input_values(built, gm, args)
    r = npu.run("vector_program", *ins, program=built.program, device=DEVICES[len(shapes) % 3])
    eager = fn(*args)
    ref64 = fn(*[a.double() for a in args])
    eager = eager if isinstance(eager, tuple) else (eager,)
    ref64 = ref64 if isinstance(ref64, tuple) else (ref64,)
    for got, e, ref, shape in zip(r.outputs, eager, ref64, built.output_shapes):
        got = torch.from_numpy(np.asarray(got)).double().reshape(shape)
        ulp = ULP[str(e.dtype)[6:]] * ref.abs()
        if dtype == torch.float32:
            # same arithmetic as eager up to the exp/erf/rsqrt implementations and summation order
            torch.testing.assert_close(got, e.double(), rtol=1e-5, atol=1e-5)
        else:
            err_k = (got - ref).abs()
            err_e = (e.double() - ref).abs()
            assert (err_k <= err_e + ulp + 1e-6).all(), f"kernel {err_k.max():.3g} vs eager {err_e.max():.3g}"


def test_masks_and_bool_outputs():
    b = Builder((5, 30))
    x, m = b.input("float32", (5, 30, 64)), b.input("bool", (5, 30, 64))
    y = b.where(b.logical_and(m, b.gt(x, 0.0)), x, b.neg(x))
    b.output(y, "float16")
    b.output(b.lt(y, 0.5), "bool")
    p = b.build()
    check_against_interpreter(p, arrays(p, 3), "ascend910b")


def test_broadcast_kinds_and_outer_broadcast():
    """Full, per-row, per-col, scalar, and an input broadcast over an outer dim only (RoPE's cos)."""
    b = Builder((2, 3, 40))
    x = b.input("bfloat16", (2, 3, 40, 48))
    row, col, sc = b.input("float32", (2, 3, 40, 1)), b.input("float16", (48,)), b.input("float32", ())
    outer = b.input("float16", (2, 1, 40, 48))
    b.output(b.add(b.mul(b.add(b.mul(x, row), col), sc), outer), "bfloat16")
    p = b.build()
    r = check_against_interpreter(p, arrays(p, 1), "ascend910")
    assert r.stats.hbm_bytes < sum(t.numel() * t.element_size() for t in arrays(p, 1)) * 1.1 + 2 * 40 * 48 * 6


def test_utilisation_of_a_long_chain():
    """Twelve ops on [2048, 2048] fp16: the Vector unit stays busy (double-buffered loads and stores hidden)."""
    p = vc.long_chain(12, 2048, 2048)
    xs = arrays(p)
    st = npu.run("vector_program", *xs, program=p, device="ascend910").stats
    assert st.bound == "vector" and st.util["vector"] >= 0.8, st


@pytest.mark.slow
def test_utilisation_at_4096_squared():
    for n in (8, 16):
        p = vc.long_chain(n, 4096, 4096)
        st = npu.run("vector_program", *arrays(p), program=p, device="ascend910").stats
        assert st.util["vector"] >= 0.8, st


# ------------------------------------------------------------------------------------------ errors
def test_capacity_errors_name_the_buffer():
    p = random_program(2, (400,), 512, "float32", n_ops=4, reductions=1)
    with pytest.raises(CapacityError, match="UB overflow"):
        npu.run("vector_program", *arrays(p), program=p, tiling={"rows": 400})
    b = Builder((2,))
    x = b.input("float32", (2, 100000))
    b.output(b.cat(b.neg(b.slice(x, start=50000, stop=100000)), b.slice(x, start=0, stop=50000)), "float32")
    p = b.build()
    with pytest.raises(ProgramError, match="whole rows"):         # no whole row fits, and shuffles cannot chunk
        npu.run("vector_program", *arrays(p), program=p)


def test_inputs_must_match_the_program():
    p = random_program(0, (4,), 64, "float16", n_ops=3, reductions=0, extras=())
    x = torch.randn(4, 64).half()
    with pytest.raises(ProgramError, match="declares"):
        npu.run("vector_program", x.float(), program=p)
    with pytest.raises(ProgramError, match="tensors for a program"):
        npu.run("vector_program", x, x, program=p)


def test_empty_rows():
    b = Builder((0,))
    x = b.input("float32", (0, 8))
    b.output(b.exp(x), "float32")
    r = npu.run("vector_program", torch.zeros(0, 8), program=b.build())
    assert r.outputs[0].shape == (0, 8)


def test_eager_rounding_mode_reproduces_eager_fp16():
    def chain(x, y):
        return torch.tanh(x * y + x) * 0.5 - y

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(16, 96, generator=g).half() for _ in range(2))
    built, _ = program_from_function(chain, (x, y), rounding="eager")
    out = npu.run("vector_program", x, y, program=built.program).outputs[0]
    # every step rounded to fp16 as eager does; only tanh's fp32 implementations differ (a few ulps of fp32,
    # which may move a value across an fp16 rounding boundary: at most one fp16 ulp)
    e = chain(x, y).double()
    assert (torch.from_numpy(out).double() - e).abs().max() <= 2 ** -10 * e.abs().max() + 1e-6
    assert math.isclose(sum(i.op == "cast" for i in built.program.instrs), 5)


# ------------------------------------------------------------------------- one column, per-row values in chunks

@pytest.mark.parametrize("name,fn", [
    ("an input's column 3", lambda x: x[..., 3:4] * 2),
    ("two columns of an input", lambda x: x[..., 0:1] * x[..., 3:4]),
    ("a computed value's column 8", lambda x: x.exp()[..., 8:9] * x),      # an aligned slice: no gather
    ("a computed value's column 9", lambda x: x.exp()[..., 9:10] * 2),
])
def test_a_one_column_slice_reads_its_own_column(name, fn):
    """A slice one column wide read column 0 of its source (an input's at any offset, a computed value's at an
    offset that is a multiple of 8): 2.9 to 4.3 off on these."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    bp, _ = program_from_function(fn, (x,))
    check_against_interpreter(bp.program, [x])


@pytest.mark.parametrize("fn", [lambda x: F.gelu(x.sum(-1, keepdim=True)) * x,      # an op with work registers
                                lambda x: torch.sin(x.sum(-1, keepdim=True)) * x,
                                lambda x: x.sum(-1, keepdim=True).mean(-1, keepdim=True) + x,   # a per-row reduced
                                lambda x: x.amax(-1, keepdim=True).sum(-1, keepdim=True) * x])
def test_per_row_values_in_column_chunks(fn):
    """Walked in column chunks: an op on a per-row value that needs work registers (gelu, sin) raised a TypeError
    (its registers were never allocated); a reduction of a per-row value was counted once a chunk (4x here)."""
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    bp, _ = program_from_function(fn, (x,))
    check_against_interpreter(bp.program, [x], "ascend910", {"rows": 1, "chunk": 64})
