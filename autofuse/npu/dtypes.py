"""Element types as the NPU stores them, and rounding where the hardware rounds.

numpy has no bfloat16 and no float16 BLAS, so data lives in a *storage* dtype (float16 for fp16,
float32 for bf16 and fp32) and arithmetic runs in float32; results are rounded back to the element
type exactly where the hardware writes that type.
"""
from __future__ import annotations

import numpy as np

from cost_model.devices import ITEMSIZE

STORAGE = {"float16": np.float16, "bfloat16": np.float32, "float32": np.float32, "int8": np.int8,
           "int32": np.int32, "bool": np.bool_}
FLOATS = ("float16", "bfloat16", "float32")


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even); returns float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    out = rounded.view(np.float32)
    return np.where(np.isnan(x), x, out)


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and held in its storage dtype."""
    if dtype == "bfloat16":
        return round_bf16(x)
    return np.asarray(x).astype(STORAGE[dtype], copy=False)


def name_of(array) -> str:
    """The element-type name of a numpy array or torch tensor."""
    s = str(array.dtype).replace("torch.", "")
    if s == "bool":
        return "bool"
    if s not in ITEMSIZE:
        raise TypeError(f"unsupported dtype {s}: the NPU simulator handles {', '.join(ITEMSIZE)}")
    return s
