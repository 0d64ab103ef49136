"""The grouped GEMM kernels' tile geometry: shared data, no cost formula.

What buffers a tiling of ``grouped_matmul`` and of ``grouped_matmul_weight_grad`` takes on a device, whether
it fits, and which tiling each kernel picks by default. The simulator's kernels
(``autofuse/npu/kernels/grouped_matmul.py``, ``grouped_matmul_grad.py``) and their cost models
(``cost_model/grouped_matmul.py``, ``grouped_matmul_grad.py``) both read it, so they agree by construction on
the tile a launch runs with and on the epilogue's UB staging. Nothing here counts or prices cycles or bytes.
"""
from __future__ import annotations

from cost_model.common import ceil_div, itemsize, round_up
from cost_model.vecutil import pad

#: gated activations: the product has gate and up columns, the output half as many
GLU = ("swiglu", "clamped_swiglu")


# ------------------------------------------------------------------------------------- grouped_matmul
def ub_bytes(device, m0, n0, out_dtype, activation, product=False, sets=1) -> int:
    """UB the epilogue needs: ``sets`` sets of fp32 product tile(s) and a temporary, output tiles
    double-buffered (split cores: per AIV, half the rows); with ``product`` (and a narrower output dtype) the
    cast product tiles, double-buffered."""
    split = device.arch == "split"
    if activation is None:
        return 0 if split else 2 * m0 * n0 * itemsize(out_dtype)
    rows = ceil_div(m0, 2) if split else m0
    nb = 2 if activation in GLU else 1
    f32 = rows * pad(n0, "float32") * 4
    cast = 2 * rows * pad(n0, out_dtype) * itemsize(out_dtype)
    return (sets * nb + 1) * f32 + cast + (nb * cast if product and out_dtype != "float32" else 0) + 3 * 32


def product_sets(device, m0, n0, out_dtype, activation, product=False) -> int:
    """Sets of fp32 product tiles the epilogue double-buffers: 2 where UB holds them (the next tile's product
    comes in while the Vector unit runs this one's epilogue), else 1."""
    return 2 if ub_bytes(device, m0, n0, out_dtype, activation, product, sets=2) <= device.buffers["UB"] else 1


def tiling_fits(device, dtype, out_dtype, t, activation=None, bias=False, product=False) -> bool:
    """Whether tiling ``t`` fits every buffer the grouped kernel allocates on ``device``."""
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    if min(m0, n0, k0, k1) < 1 or k1 % k0 or m0 % 16 or n0 % 16 or k0 % 16:
        return False
    isz = itemsize(dtype)
    nb = 2 if activation in GLU else 1
    buf = device.buffers
    l0c = nb * m0 * n0 * 4
    nc = 2 if 2 * l0c <= buf["L0C"] else 1
    ok = (2 * (m0 * k1 + nb * k1 * n0) * isz + nb * n0 * 4 * bool(bias) <= buf["L1"] - 64
          and 2 * m0 * k0 * isz <= buf["L0A"] and nb * 2 * k0 * n0 * isz <= buf["L0B"]
          and nc * l0c <= buf["L0C"])
    if not ok:
        return False
    return ub_bytes(device, m0, n0, out_dtype, activation, product) <= buf["UB"]


def default_tiling(device, dtype, out_dtype, K, N_out, activation=None, bias=False, product=False) -> dict:
    """The kernel's own tiling: the largest base tile that fits, m0 = 128 (MoE groups are short), n0 as
    wide as fits, K slices as deep as fit L0A/L0B double-buffered, L1 chunks two slices deep."""
    for m0 in (128, 64, 32, 16):
        for n0 in (256, 128, 64, 32, 16):
            n0e = min(n0, round_up(N_out, 16))
            for k0 in (128, 64, 32, 16):
                k0e = min(k0, round_up(K, 16))
                t = {"m0": m0, "n0": n0e, "k0": k0e, "k1": min(2 * k0e, round_up(K, k0e))}
                if tiling_fits(device, dtype, out_dtype, t, activation, bias, product):
                    return t
    raise ValueError(f"grouped_matmul: no tiling fits {device.name} for {dtype} ({activation})")


# --------------------------------------------------------------------------- grouped_matmul_weight_grad
def weight_grad_tiling_fits(device, dtype, out_dtype, t, zeros=False) -> bool:
    """Whether tiling ``t`` fits every buffer the weight-gradient kernel allocates on ``device`` (``zeros``: some
    group is empty, so a zero tile is allocated in UB too)."""
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    if min(m0, n0, k0, k1) < 1 or k1 % k0 or m0 % 16 or n0 % 16 or k0 % 16:
        return False
    isz = itemsize(dtype)
    buf = device.buffers
    nc = 2 if 2 * m0 * n0 * 4 <= buf["L0C"] else 1
    # coupled: two output tiles (and the zero tile) in UB; split: the zero tile in an AIV's UB
    ub = ((0 if device.arch == "split" else 2) + bool(zeros)) * m0 * n0 * itemsize(out_dtype)
    return (2 * (m0 * k1 + k1 * n0) * isz <= buf["L1"] - 64 and 2 * m0 * k0 * isz <= buf["L0A"]
            and 2 * k0 * n0 * isz <= buf["L0B"] and nc * m0 * n0 * 4 <= buf["L0C"] and ub <= buf["UB"])


def weight_grad_default_tiling(device, dtype, out_dtype, P, Q, rows, zeros=False) -> dict:
    """The weight-gradient kernel's own tiling: the largest output tile that fits (m0 up to 256, n0 up to 256),
    row slices as deep as fit L0A/L0B double-buffered (no deeper than the groups' mean rows), L1 chunks two
    slices deep."""
    for m0 in (256, 128, 64, 32, 16):
        for n0 in (256, 128, 64, 32, 16):
            m0e, n0e = min(m0, round_up(P, 16)), min(n0, round_up(Q, 16))
            for k0 in (128, 64, 32, 16):
                k0e = min(k0, round_up(max(rows, 1), 16))
                t = {"m0": m0e, "n0": n0e, "k0": k0e, "k1": 2 * k0e}
                if weight_grad_tiling_fits(device, dtype, out_dtype, t, zeros):
                    return t
    raise ValueError(f"grouped_matmul_weight_grad: no tiling fits {device.name} for {dtype}")
