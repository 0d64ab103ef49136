"""Elementwise and reduce kernels vs torch: ops, dtypes, broadcasting, scalars, capacity, timing."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autofuse import npu
from autofuse.npu.kernels.vector import OPS
from autofuse.npu.machine import CapacityError
from cost_model.devices import get_device

# fp32: both sides evaluate the op in fp32 (different exp/erf/tanh implementations: a few ulps).
# fp16/bf16: torch computes these ops in fp32 and rounds once, as the kernel does; allow that rounding
# (one ulp of the output: 2^-10 / 2^-7 relative) where the fp32 values differ on a rounding boundary.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = list(TOL)


def _np(x):
    return np.asarray(x)


def _close(got, ref, dtype=None, exact=False):
    got = torch.from_numpy(np.ascontiguousarray(got))
    if ref.dtype == torch.bool or exact:
        assert got.shape == ref.shape
        assert torch.equal(got.to(ref.dtype), ref)
        return
    torch.testing.assert_close(got.float(), ref.float(), equal_nan=True, **TOL[dtype or ref.dtype])


def ew(*xs, **kw):
    return npu.run("elementwise", *xs, **kw)


UNARY = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "square": torch.square, "exp": torch.exp,
    "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "erf": torch.erf, "softplus": F.softplus,
    "log1p": torch.log1p, "expm1": torch.expm1,
}
POSITIVE = {"log", "sqrt", "rsqrt", "reciprocal"}
ABOVE_MINUS_1 = {"log1p"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(UNARY))
def test_unary(op, dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 129) * 3
    if op in POSITIVE:
        x = x.abs() + 0.1
    if op in ABOVE_MINUS_1:
        x = x.abs() - 0.99
    x = x.to(dtype)
    r = ew(x, op=op)
    assert r.dtypes == (str(dtype)[6:],)
    if dtype != torch.float32:
        _close(r.outputs[0], UNARY[op](x.float()).to(dtype), dtype)
        return
    # fp32: measured against float64 truth, not against torch's fp32 op, whose accuracy depends on the CPU
    # build (one CI machine's torch.exp was 1e-4 off in relative terms while numpy's was within 1e-7). The
    # kernel's error may be TOL's few ulps, plus twice eager's own error where eager is less accurate.
    truth = UNARY[op](x.double())
    got = torch.from_numpy(np.ascontiguousarray(r.outputs[0])).double()
    eager_err = (UNARY[op](x).double() - truth).abs()
    bound = TOL[dtype]["atol"] + TOL[dtype]["rtol"] * truth.abs() + 2 * eager_err
    err = (got - truth).abs()
    assert bool((err <= bound).all()), f"{op}: worst error {(err - bound).max().item():.3g} over the bound"


BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
          "minimum": torch.minimum}
SHAPES = [((37, 129), (37, 129)), ((37, 129), (129,)), ((37, 129), (37, 1)), ((4, 1, 33), (1, 5, 33)),
          ((2, 3, 4, 5), (3, 1, 5)), ((64, 256), ()), ((1000,), (1000,)), ((3, 1), (1, 300))]


@pytest.mark.parametrize("op", list(BINARY))
@pytest.mark.parametrize("sa,sb", SHAPES)
def test_binary_broadcasting(op, sa, sb):
    torch.manual_seed(1)
    a, b = torch.randn(sa), torch.randn(sb) + (3.0 if op == "div" else 0.0)
    _close(ew(a, b, op=op).outputs[0], BINARY[op](a, b), exact=op != "div")


@pytest.mark.parametrize("dtype", DTYPES)
def test_binary_low_precision_and_promotion(dtype):
    torch.manual_seed(2)
    a, b = torch.randn(33, 70).to(dtype), torch.randn(70).to(dtype)
    _close(ew(a, b, op="mul").outputs[0], a * b, dtype)
    c = torch.randn(33, 70)                            # fp32 operand: the result is fp32
    r = ew(a, c, op="add")
    assert r.dtypes == ("float32",)
    _close(r.outputs[0], a + c, torch.float32)
    r = ew(a, b, op="add", out_dtype="float32")       # a cast epilogue
    assert r.dtypes == ("float32",)
    _close(r.outputs[0], (a + b).float(), dtype)


@pytest.mark.parametrize("op,s,ref", [("add", 2.5, lambda x: x + 2.5), ("sub", 1.5, lambda x: x - 1.5),
                                      ("mul", -0.5, lambda x: x * -0.5), ("div", 3.0, lambda x: x / 3.0),
                                      ("maximum", 0.2, lambda x: x.clamp(min=0.2)),
                                      ("rsub", 1.0, lambda x: 1.0 - x), ("rdiv", 2.0, lambda x: 2.0 / x),
                                      ("pow", 2, lambda x: x ** 2), ("pow", 3, lambda x: x ** 3),
                                      ("pow", -2, lambda x: x ** -2), ("pow", 0.5, lambda x: x ** 0.5),
                                      ("pow", 1.7, lambda x: x ** 1.7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tensor_scalar(op, s, ref, dtype):
    torch.manual_seed(3)
    x = (torch.rand(17, 45) + 0.5).to(dtype)
    _close(ew(x, op=op, scalar=s).outputs[0], ref(x.float()).to(dtype), dtype)


def test_pow_tensor_tensor():
    torch.manual_seed(4)
    a, b = torch.rand(20, 30) + 0.5, torch.randn(30)
    _close(ew(a, b, op="pow").outputs[0], a ** b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_where_masked_fill_compare(dtype):
    torch.manual_seed(5)
    x, y = torch.randn(2, 4, 17, 17).to(dtype), torch.randn(17).to(dtype)
    m = torch.rand(2, 1, 17, 17) > 0.5
    _close(ew(x, m, op="masked_fill", scalar=float("-inf")).outputs[0], x.masked_fill(m, float("-inf")), exact=True)
    _close(ew(m, x, y, op="where").outputs[0], torch.where(m, x, y), exact=True)
    _close(ew(m, x, op="where", scalar=0.0).outputs[0], torch.where(m, x, 0.0), exact=True)
    for op, f in (("lt", torch.lt), ("eq", torch.eq), ("ge", torch.ge)):
        r = ew(x, y, op=op)
        assert r.dtypes == ("bool",)
        _close(r.outputs[0], f(x, y))
    _close(ew(m, op="logical_not").outputs[0], ~m)
    _close(ew(m, m.transpose(-1, -2).contiguous(), op="logical_and").outputs[0], m & m.transpose(-1, -2))


@pytest.mark.parametrize("src,dst", [(torch.float32, "float16"), (torch.float32, "bfloat16"),
                                     (torch.float16, "float32"), (torch.bfloat16, "float32"),
                                     (torch.float32, "int32"), (torch.int32, "float32"), (torch.bool, "float16")])
def test_cast(src, dst):
    torch.manual_seed(6)
    x = (torch.randn(33, 65) * 100).to(src) if src != torch.bool else torch.rand(33, 65) > 0.5
    r = ew(x, op="cast", out_dtype=dst)
    _close(r.outputs[0], x.to(getattr(torch, dst)), exact=True)


def test_int32_arithmetic():
    a = torch.randint(-1000, 1000, (40, 33), dtype=torch.int32)
    b = torch.randint(-1000, 1000, (33,), dtype=torch.int32)
    r = ew(a, b, op="add")
    assert r.dtypes == ("int32",) and r.outputs[0].dtype == np.int32
    _close(r.outputs[0], a + b, exact=True)


def test_broadcast_operand_is_not_materialised():
    """A bias row shared by every output row comes from HBM once; its re-reads hit L2."""
    torch.manual_seed(7)
    x, b = torch.randn(512, 1000), torch.randn(1000)
    r = ew(x, b, op="add")
    assert r.stats.hbm_bytes == (2 * x.numel() + b.numel()) * 4


def test_errors():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="unknown op 'frobnicate'"):
        ew(x, op="frobnicate")
    with pytest.raises(ValueError, match="do not broadcast"):
        ew(x, np.ones((3,), np.float32), op="add")
    with pytest.raises(TypeError, match="needs out_dtype"):
        ew(x, op="cast")
    with pytest.raises(TypeError, match="mask is float32"):
        ew(x, x, op="masked_fill", scalar=0.0)
    with pytest.raises(CapacityError, match="UB overflow"):
        ew(np.ones((256, 4096), np.float32), np.ones(4096, np.float32), op="add", tiling={"rows": 64, "cols": 4096})
    with pytest.raises(CapacityError, match="UB overflow"):
        ew(np.ones(1 << 20, np.float32), op="gelu", tiling={"cols": 1 << 20})


EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 3e-5, -3e-5, 0.4999, -0.4999, 0.5, -0.5, 0.75, -0.75, 1.0, -1.0,
         -0.999999, -1.5, 3.9, -3.9, 10.0, -10.0, 17.0, -17.0, 20.0, -20.0, 30.0, -30.0, 88.0, -88.0, 89.0, -89.0,
         -104.0, 1e30, -1e30, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("op", ["erf", "softplus", "log1p", "expm1"])
def test_edge_values(op):
    """Tiny, large and infinite arguments, NaN, and log1p below -1 (NaN, as eager): the same NaNs and infinities as
    eager; fp32 within a few ulps of eager's values, zeros in eager's places; fp16/bf16 the float64 truth rounded
    once (eager's 16-bit erf is a coarser fp32 approximation: 0 for erf(1.2e-7), 0.5 % low at 3e-5)."""
    small = torch.tensor(EDGES, dtype=torch.float32)
    ramp = torch.linspace(-12, 12, 4801)                       # steps of 0.005 through the branches' switches
    x = torch.cat([small, ramp, ramp * 1e-3]).reshape(1, -1)
    for dtype in DTYPES:
        xd = x.to(dtype)
        got = torch.from_numpy(np.ascontiguousarray(ew(xd, op=op).outputs[0])).to(dtype)   # bf16 comes as fp32
        want = UNARY[op](xd)
        assert torch.equal(got.isnan(), want.isnan()), op
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()]), op
        fin = want.isfinite()
        if dtype == torch.float32:
            assert torch.equal(got[fin] == 0, want[fin] == 0)
            # four fp32 ulps: erf's polynomial, log1p's and expm1's corrections (within 3 ulps of torch's over
            # 1.2 M points), exp's and ln's own ulp
            err = (got[fin].double() - want[fin].double()).abs() / want[fin].double().abs().clamp_min(1e-38)
            assert err.max() <= 4 * 2 ** -23, (op, err.max() / 2 ** -23, x[fin][err.argmax()])
            continue
        truth = UNARY[op](xd.double())[fin]
        fi = torch.finfo(dtype)
        # one rounding to the 16-bit dtype of a value a few fp32 ulps from the truth: within one of its ulps
        ulp = fi.eps * truth.abs().clamp_min(fi.tiny)
        assert bool(((got[fin].double() - truth).abs() <= ulp).all()), (op, dtype)


ROUNDINGS = {"floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round, "sign": torch.sign}


@pytest.mark.parametrize("op", list(ROUNDINGS))
def test_roundings_and_sign_are_torchs_at_ties_zeros_and_limits(op):
    """torch's values exactly: round half to even, a zero result with x's sign (ceil(-0.5) is -0.0), x itself from
    2^23 up and at ±inf and NaN (sign: 0 at NaN, +0 at ±0), in every dtype (the 16-bit results exact in them)."""
    ties = torch.arange(-40, 41) / 4                       # quarters: the ties and the values between them
    x = torch.cat([torch.tensor(EDGES), ties, torch.tensor([8388607.5, 8388608.5, -8388609.0, 2.0 ** 30 + 64])])
    for dtype in DTYPES:
        xd = x.reshape(1, -1).to(dtype)
        got = torch.from_numpy(np.ascontiguousarray(ew(xd, op=op).outputs[0])).to(dtype)
        want = ROUNDINGS[op](xd)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), (op, dtype)
        assert torch.equal(got[~nan], want[~nan]) and torch.equal(got[~nan].signbit(), want[~nan].signbit()), \
            (op, dtype)


def test_every_op_has_named_passes():
    for name, op in OPS.items():
        passes = op.passes(2.0, name in ("rsub", "rdiv", "masked_fill") or False)
        assert passes and all(isinstance(p, str) for p in passes)


def test_timing_add_is_memory_bound_gelu_vector_bound():
    x = torch.randn(1024, 2048)
    dev = get_device("ascend910")
    s = ew(x, x, op="add").stats
    assert s.bound in ("mte2", "mte3")
    assert s.cycles < 1.1 * s.hbm_bytes / dev.hbm_bytes_per_cycle + s.launch_cycles
    s = ew(x.half(), op="gelu").stats                    # ~27 fp32 passes per element
    assert s.bound == "vector"


def test_timing_scales_with_rows():
    a = ew(torch.randn(512, 2048), op="silu").stats
    b = ew(torch.randn(1024, 2048), op="silu").stats
    assert 1.8 < (b.cycles - b.launch_cycles) / (a.cycles - a.launch_cycles) < 2.2


# ------------------------------------------------------------------------------------------ reduce
RED = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin}


def _sum_bound(x, dims, keepdim, n):
    """fp32 summation error bound (depth ≲ log2 n + 8 roundings) on the sum of |x|."""
    s = x.double().abs().sum(dim=dims, keepdim=keepdim)
    return (math.log2(max(n, 2)) + 8) * 2.0 ** -24 * s


@pytest.mark.parametrize("op", list(RED))
@pytest.mark.parametrize("dims", [(-1,), (1,), (0,), (1, 2), (0, 2), (0, 3), None])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reduce_fp32(op, dims, keepdim):
    torch.manual_seed(8)
    x = torch.randn(5, 37, 129, 3)
    kw = {} if dims is None else {"dim": dims}
    r = npu.run("reduce", x, op=op, keepdim=keepdim, **kw)
    d = dims if dims is not None else tuple(range(4))
    ref = RED[op](x.double(), dim=d, keepdim=keepdim)
    got = torch.from_numpy(r.outputs[0]).double()
    assert got.shape == ref.shape
    n = math.prod(x.shape[i] for i in d)
    if op in ("amax", "amin"):
        assert torch.equal(got, ref)
    else:
        bound = _sum_bound(x, d, keepdim, n) / (n if op == "mean" else 1)
        assert ((got - ref).abs() <= bound + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiling", [None, {"block": 4, "chunk": 512}])
def test_reduce_low_precision(dtype, tiling):
    torch.manual_seed(9)
    x = torch.randn(64, 3000).to(dtype)
    for op in ("sum", "mean", "amax"):
        r = npu.run("reduce", x, op=op, dim=-1, tiling=tiling)
        _close(r.outputs[0], RED[op](x.float(), dim=-1).to(dtype), dtype)
    r = npu.run("reduce", x, op="sum", dim=0, out_dtype="float32")
    _close(r.outputs[0], x.float().sum(0), torch.float16)


def test_reduce_timing_is_memory_bound():
    s = npu.run("reduce", torch.randn(2048, 1024), op="sum", dim=-1).stats
    assert s.bound == "mte2"
    assert s.cycles < 1.1 * s.hbm_bytes / get_device("ascend910").hbm_bytes_per_cycle + s.launch_cycles


def test_round_fp16_matches_numpy_float16():
    """The fast fp16 rounding (tiles.round_fp16) equals numpy's conversion, subnormals and overflow included."""
    from autofuse.npu.kernels.tiles import round_fp16
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-10, 6, 200_000)).astype(np.float32)
    special = [0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, -65520, 2 ** -25, -2 ** -25, 2 ** -24 * 1.5,
               2 ** -24 * 2.5, 2 ** -14 - 2 ** -26, 1e-45, 3e38]
    x = np.concatenate([x, np.array(special, np.float32)])
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    got = round_fp16(x)
    assert np.array_equal(got, ref) and np.array_equal(np.signbit(got), np.signbit(ref))
    assert np.isnan(round_fp16(np.array([np.nan], np.float32))).all()
    assert round_fp16(np.float32(1.0)).shape == ()


def test_zero_dim_tensors():
    a, b = torch.tensor(1.5).bfloat16(), torch.tensor(2.25).bfloat16()
    r = ew(a, b, op="add")
    assert r.outputs[0].shape == () and float(r.outputs[0]) == 3.75
    y = torch.randn(4, 5)
    _close(ew(torch.tensor(2.0), y, op="mul").outputs[0], 2.0 * y, exact=True)
