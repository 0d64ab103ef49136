"""Bit inputs of Vector programs: a dropout keep-mask packed one bit per element (``pack_keep``'s format) read
by the generated kernel's Select as it was loaded. Outputs against a reference computed from the unpacked
mask (whole rows, column chunks, widths not a multiple of 8, masks broadcast over rows or an outer dim), the
bytes the mask costs, the one Select pass, a matmul epilogue with the mask as an extra input, the cost model
on these, and the errors."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu.kernels.dropout import pack_keep, unpack_keep
from cost_model.program import Builder, ProgramError, stored_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cost_model_accuracy import Case, dropout_program, epilogue, run, specs_of  # noqa: E402

DEVICES = ("ascend910", "ascend910b", "ascend310p")
P_DROP = 0.1
SCALE = np.float32(1.0 / (1.0 - P_DROP))       # the program's immediate, rounded to fp32


def tensors(p, seed=0, keep_prob=0.9):
    """Random tensors for program ``p``: floats as torch tensors of their dtype, a bit input as the packed
    bytes of a random keep-mask (returned beside them, per input: the bool mask or None)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    xs, keeps = [], []
    for i in p.inputs:
        if i.dtype == "bit":
            keep = rng.random(i.shape) < keep_prob
            xs.append(pack_keep(keep))
            keeps.append(keep)
        else:
            xs.append(torch.randn(i.shape, generator=g).to(getattr(torch, i.dtype)))
            keeps.append(None)
    return xs, keeps


def f32(t):
    return t.float() if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t, dtype=np.float32))


def dropped(x, keep, residual=None):
    """x * where(keep, s, 0) (+ residual), in fp32 as the program computes it."""
    y = f32(x) * torch.where(torch.from_numpy(np.array(keep, dtype=bool)), torch.tensor(SCALE), torch.tensor(0.0))
    return y if residual is None else y + f32(residual)


def out(r, j=0):
    o = np.asarray(r.outputs[j])
    return torch.from_numpy(o.astype(np.float32) if o.dtype != np.float32 else o)


def rounded(y, dtype):
    return y.to(getattr(torch, dtype)).float()


# ------------------------------------------------------------------------------------------ values
@pytest.mark.parametrize("W", [100, 1000, 64, 256, 13])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dropout_whole_rows_is_exact(W, dtype):
    p = dropout_program("dropout", (37,), W, dtype)
    xs, keeps = tensors(p, W)
    r = npu.run("vector_program", *xs, program=p, device=DEVICES[W % 3])
    assert torch.equal(out(r), rounded(dropped(xs[0], keeps[1]), dtype))


@pytest.mark.parametrize("W, tiling", [(1000, {"rows": 3, "chunk": 192}), (100, {"rows": 4, "chunk": 64}),
                                       (256, {"rows": 5, "chunk": 128}), (1000, {"rows": 2})])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropout_residual_chunked_is_exact(W, tiling, dtype):
    """Column chunks (multiples of 64 columns: each chunk's bits start on a byte), a ragged last chunk
    whose byte holds fewer than 8 columns (W = 100, 1000), and whole rows for comparison."""
    p = dropout_program("residual", (2, 9), W, dtype)
    xs, keeps = tensors(p, 1)
    r = npu.run("vector_program", *xs, program=p, tiling=tiling, device="ascend910b")
    assert torch.equal(out(r), rounded(dropped(xs[0], keeps[1], xs[2]), dtype))


@pytest.mark.parametrize("tiling", [None, {"rows": 3, "chunk": 128}])
def test_dropout_residual_layer_norm(tiling):
    """Two reductions after the dropout; whole rows and chunks (three passes over the chunks, the mask
    reloaded in each)."""
    W = 300
    p = dropout_program("layer_norm", (11,), W, "float32")
    xs, keeps = tensors(p, 2)
    r = npu.run("vector_program", *xs, program=p, tiling=tiling, device="ascend310p")
    h = dropped(xs[0], keeps[1], xs[2])
    assert torch.equal(out(r, 0), h)
    d = h.double() - h.double().mean(-1, keepdim=True)
    want = d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * xs[3].double() + xs[4].double()
    assert (out(r, 1).double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("tiling", [None, {"rows": 4, "chunk": 64}])
def test_mask_broadcast_over_rows_and_an_outer_dim(tiling):
    """A mask of shape [W] (one row for every row) and one of [S, W] over lead (B, S) (the walk goes
    block-major, the mask's tile kept across B)."""
    W = 100
    for lead, ks in (((12,), (W,)), ((3, 10), (10, W))):
        p = dropout_program("dropout", lead, W, "float16", keep_shape=ks)
        xs, keeps = tensors(p, 3)
        r = npu.run("vector_program", *xs, program=p, tiling=tiling)
        assert torch.equal(out(r), rounded(dropped(xs[0], np.broadcast_to(keeps[1], lead + (W,))), "float16"))


def test_select_reads_the_mask_beside_other_ops():
    """where(keep, a, b) with two computed branches, the mask's result reused by a reduction and a later op."""
    b = Builder((6,))
    x, keep = b.input("float32", (6, 70)), b.input("bit", (6, 70))
    y = b.where(keep, b.exp(b.tanh(x)), b.neg(x))
    b.output(b.sub(y, b.reduce(y, kind="max")), "float32")
    p = b.build()
    xs, keeps = tensors(p, 4, keep_prob=0.5)
    r = npu.run("vector_program", *xs, program=p)
    x0 = f32(xs[0])
    y = torch.where(torch.from_numpy(keeps[1]), torch.exp(torch.tanh(x0)), -x0)
    assert (out(r) - (y - y.amax(-1, keepdim=True))).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------ cost
@pytest.mark.parametrize("W, tiling", [(100, None), (1000, None), (1000, {"rows": 2, "chunk": 192}),
                                       (256, {"rows": 4, "chunk": 64})])
def test_mask_bytes_are_rows_times_bytes_of_a_row(W, tiling):
    """The mask costs ceil(W / 8) bytes per row, read once (chunks start on bytes, so a chunked row's
    chunks add up to the same bytes); x and the output cost their dtypes' bytes."""
    rows = 21
    p = dropout_program("dropout", (rows,), W, "float16")
    xs, _ = tensors(p)
    s = npu.run("vector_program", *xs, program=p, tiling=tiling, timing_only=True).stats
    dense = rows * W * 2 * 2                                 # x in, the output out (fp16)
    mask = rows * -(-W // 8)
    assert s.hbm_bytes == dense + mask
    assert s.bytes["GM->UB"] == rows * W * 2 + mask


def vector_names(r):
    return [name for g, unit, name, *_ in r.trace._events if unit == "vector"]


def test_select_on_bits_is_one_pass():
    """The bit mask's where is one Select per tile; a bool mask's where also compares it into bits first."""
    rows, W = 16, 256
    bits = dropout_program("dropout", (rows,), W, "float32")
    b = Builder((rows,))
    x, keep = b.input("float32", (rows, W)), b.input("bool", (rows, W))
    b.output(b.where(keep, b.mul(x, float(1 / 0.9)), 0.0), "float32")
    bools = b.build()
    t = {"rows": 4}
    xs, keeps = tensors(bits)
    rb = npu.run("vector_program", *xs, program=bits, tiling=t)
    ro = npu.run("vector_program", xs[0], torch.from_numpy(keeps[1]), program=bools, tiling=t)
    nb, no = vector_names(rb), vector_names(ro)
    assert nb.count("select") == no.count("select") > 0
    assert nb.count("compare cond->bitmask") == 0 and no.count("compare cond->bitmask") == no.count("select")
    assert len(nb) == len(no) - no.count("select")
    assert rb.stats.instructions < ro.stats.instructions
    assert torch.equal(out(rb), out(ro))
    # the mask's bytes: a bit per element against a byte per element
    assert ro.stats.hbm_bytes - rb.stats.hbm_bytes == rows * W - rows * W // 8


# ------------------------------------------------------------------------------------------ matmul epilogue
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M, K, N, tiling", [(70, 64, 100, None), (96, 32, 200, {"m0": 48, "n0": 64, "k0": 32,
                                                                                  "k1": 32, "sub": 16})])
def test_matmul_bias_dropout_residual(device, M, K, N, tiling):
    """matmul -> bias -> dropout over packed bits -> residual add; whole-row tiles and tiles of 64 columns
    (the mask's bytes from column n0 * j / 8)."""
    p, _ = epilogue("bias_dropout_residual", M, N, product="float32")
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(M, K, generator=g) / 8).half()
    w = (torch.randn(K, N, generator=g) / 8).half()
    ex, keeps = tensors(p, 6)
    ex, keeps = ex[1:], keeps[1:]
    r = npu.run("matmul_epilogue", a, w, *ex, program=p, device=device, tiling=tiling)
    prod = a.float() @ w.float()
    want = dropped(prod + ex[0].float(), keeps[1], ex[2])
    got = out(r)
    assert (got - rounded(want, "float16")).abs().max() <= 2 ** -9 * want.abs().max() + 1e-5
    # where the mask drops, the output is the residual exactly
    assert torch.equal(got[~torch.from_numpy(keeps[1])], ex[2].float()[~torch.from_numpy(keeps[1])])


def test_epilogue_tiles_must_start_the_mask_on_a_byte():
    p, _ = epilogue("bias_dropout_residual", 32, 100, product="float32")
    a, w = torch.zeros(32, 32).half(), torch.zeros(32, 100).half()
    ex, _ = tensors(p)
    with pytest.raises(ValueError, match="multiple of 8"):
        npu.run("matmul_epilogue", a, w, *ex[1:], program=p,
                tiling={"m0": 32, "n0": 36, "k0": 32, "k1": 32, "sub": 8})


# ------------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("device", DEVICES)
def test_model_agrees_with_the_simulator(device):
    """Dropout (whole rows), dropout + residual + LayerNorm in column chunks, an epilogue with the mask."""
    p1 = dropout_program("residual", (300,), 1000, "float16")
    p2 = dropout_program("layer_norm", (8,), 8192, "float32")
    p3, extra = epilogue("bias_dropout_residual", 200, 256, product="float32")
    cs = [Case("vector_program", specs_of(p1), device, {"program": p1}),
          Case("vector_program", specs_of(p2), device, {"program": p2, "tiling": {"rows": 1, "chunk": 2048}}),
          Case("matmul_epilogue", [((200, 128), "float16"), ((128, 256), "float16")] + extra, device, {"program": p3})]
    for rec in run(cs):
        assert rec.err_cycles <= 0.15 and rec.err_hbm <= 0.05, (rec.case.label(), rec.err_cycles, rec.err_hbm)


# ------------------------------------------------------------------------------------------ errors
def test_wrong_mask_tensors_are_refused():
    p = dropout_program("dropout", (4,), 100, "float32")
    x = torch.zeros(4, 100)
    assert stored_shape(p.inputs[1]) == (4, 13)
    for bad in (np.zeros((4, 100), np.uint8), np.zeros((4, 13), bool), torch.zeros(4, 12, dtype=torch.uint8)):
        with pytest.raises(ProgramError, match=r"input 1 is .* uint8 \[4, 13\]"):
            npu.run("vector_program", x, bad, program=p)
    import cost_model
    with pytest.raises(ProgramError, match="input 1 is"):
        cost_model.estimate("vector_program", [((4, 100), "float32"), ((4, 100), "uint8")], program=p)
    assert cost_model.estimate("vector_program", [((4, 100), "float32"), ((4, 13), "uint8")], program=p).cycles > 0
    q, extra = epilogue("bias_dropout_residual", 16, 40, product="float32")
    ex, _ = tensors(q)
    ex[2] = np.zeros((16, 40), np.uint8)
    with pytest.raises(ProgramError, match="extra input 1 is"):
        npu.run("matmul_epilogue", torch.zeros(16, 16).half(), torch.zeros(16, 40).half(), *ex[1:], program=q)


def test_chunks_must_start_the_mask_on_a_byte_and_width_one_masks_are_refused():
    p = dropout_program("dropout", (4,), 100, "float32")
    xs, _ = tensors(p)
    with pytest.raises(ProgramError, match="multiple of 8"):
        npu.run("vector_program", *xs, program=p, tiling={"rows": 1, "chunk": 36})
    b = Builder((4,))
    x, keep = b.input("float32", (4, 1)), b.input("bit", (4, 1))
    b.output(b.where(keep, x, 0.0), "float32")
    with pytest.raises(ProgramError, match="width 1"):
        npu.run("vector_program", torch.zeros(4, 1), np.zeros((4, 1), np.uint8), program=b.build())


def test_select_bits_is_not_an_elementwise_kernel_op():
    with pytest.raises(ValueError, match="select_bits"):
        npu.run("elementwise", np.zeros(8, np.uint8), np.zeros(64, np.float32), np.zeros(64, np.float32),
                op="select_bits")


def test_op_table_unpacks_like_pack_keep():
    from autofuse.npu.kernels.vector import OPS
    rng = np.random.default_rng(0)
    keep = rng.random((3, 29)) < 0.5
    a, b = rng.standard_normal((3, 29)), np.float32(-1.0)
    assert np.array_equal(OPS["select_bits"].fn(pack_keep(keep), a, b, 29), np.where(keep, a, b))
    assert np.array_equal(unpack_keep(pack_keep(keep), 29).astype(bool), keep)
    assert OPS["select_bits"].passes(None, False) == ("select",)
