"""The lowering of bit inputs (packed keep-masks): a uint8 register of the row's bytes padded to 32 B, no
widening, the where it conditions one ``select_bits`` op (one pass in both op tables), chunks of C / 8
bytes; the bytes helper; the model's mask bytes."""
import sys
from pathlib import Path

import pytest

import cost_model
from autofuse.npu.kernels.vector import OPS as SIM_OPS
from autofuse.npu.kernels.vector_program import passes, temps
from cost_model.lowering import bits_aligned, col_bytes, lower, pad
from cost_model.program import Builder
from cost_model.vector import OPS as MODEL_OPS
from cost_model.vector_program import n_passes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cost_model_accuracy import dropout_program, specs_of  # noqa: E402


def test_col_bytes_and_pad():
    assert [col_bytes(c, "bit") for c in (1, 8, 9, 100, 1000, 4096)] == [1, 1, 2, 13, 125, 512]
    assert col_bytes(100, "float16") == 200 and col_bytes(3, "float32") == 12 and col_bytes(5, "bool") == 5
    assert [pad(c, "bit") for c in (1, 256, 257, 1000)] == [32, 32, 64, 128]      # bytes, whole 32 B blocks
    assert pad(100, "float16") == 112 and pad(100, "float32") == 104


@pytest.mark.parametrize("W", [100, 1000, 64])
def test_the_mask_is_a_uint8_register_read_by_one_select(W):
    p = dropout_program("residual", (9,), W, "float16")
    low = lower(p, False, temps)
    bit = [w for w in low.views if w.dtype == "bit"]
    assert len(bit) == 1 and bit[0].width == W and bit[0].rows
    a, b = low.in_regs[[w.dtype for w in low.views].index("bit")]
    specs = low.ub_specs(5)
    assert specs[a] == ((5, pad(W, "bit")), "uint8") and specs[b] == specs[a]
    ops = low.passes[0].ops
    sel = [op for op in ops if op.op == "select_bits"]
    assert len(sel) == 1 and not [op for op in ops if op.op == "where"]
    assert sel[0].srcs[0].reg == ("in", 1) and sel[0].dense and sel[0].lanes == "float32"
    # the mask is never widened; x (fp16) is
    assert [op.srcs[0].reg for op in ops if op.kind == "cast_in"] == [("in", 0), ("in", 2)]
    assert passes(sel[0]) == ("select",) and n_passes(sel[0]) == 1
    assert SIM_OPS["where"].passes(None, False) == ("compare cond->bitmask", "select")
    assert MODEL_OPS["select_bits"][4](False, None) == len(SIM_OPS["select_bits"].passes(None, False)) == 1


def test_chunked_lowering_loads_the_chunks_bytes():
    p = dropout_program("layer_norm", (4,), 1000, "float32")
    low = lower(p, True, temps)
    k = [w.dtype for w in low.views].index("bit")
    assert all(k in ps.loads for ps in low.passes)          # reloaded by every pass over the chunks
    assert low.ub_specs(2, 192)[low.in_regs[k][0]] == ((2, 32), "uint8")          # 192 columns: 24 bytes
    assert low.ub_specs(2, 512)[low.in_regs[k][0]] == ((2, 64), "uint8")
    assert bits_aligned(low, 192) and not bits_aligned(low, 100) and bits_aligned(low, None)


def test_a_broadcast_mask_is_read_row_by_row():
    p = dropout_program("dropout", (6,), 100, "float32", keep_shape=(100,))
    low = lower(p, False, temps)
    sel = [op for op in low.passes[0].ops if op.op == "select_bits"][0]
    # the scaled mask x · where(keep, s, 0) multiplies by is itself one row: selected once, broadcast by the mul
    assert not sel.srcs[0].rows and not sel.rows
    assert low.ub_specs(4)[low.in_regs[1][0]] == ((1, 32), "uint8")


def test_programs_without_bits_lower_as_before():
    b = Builder((4,))
    x, m = b.input("float32", (4, 100)), b.input("bool", (4, 100))
    b.output(b.where(m, x, 0.0), "float32")
    low = lower(b.build(), False, temps)
    assert [op.op for op in low.passes[0].ops if op.kind == "ew"] == ["where"]
    assert low.ub_specs(2)[low.in_regs[1][0]] == ((2, 128), "bool")


def test_model_counts_the_mask_bytes():
    """HBM bytes of a dropout: x and the output in their dtype, the mask ceil(W / 8) bytes a row."""
    rows, W = 300, 1000
    p = dropout_program("dropout", (rows,), W, "bfloat16")
    e = cost_model.estimate("vector_program", specs_of(p), program=p, device="ascend910")
    assert e.hbm_bytes == rows * W * 2 * 2 + rows * 125
    assert specs_of(p)[1] == ((rows, 125), "uint8")
