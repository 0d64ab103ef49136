"""Element types as the NPU stores them, and rounding where the hardware rounds.

numpy has no bfloat16 and no float16 BLAS, so data lives in a *storage* dtype (float16 for fp16,
float32 for bf16 and fp32) and arithmetic runs in float32; results are rounded back to the element
type exactly where the hardware writes that type.
"""
from __future__ import annotations

import numpy as np

from cost_model.devices import ITEMSIZE

STORAGE = {"float16": np.float32, "bfloat16": np.float32, "float32": np.float32, "float64": np.float64,
           "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
           "bool": np.bool_}
FLOATS = ("float16", "bfloat16", "float32")


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even); returns float32."""
    shape = np.shape(x)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(shape)     # (ascontiguousarray makes 0-d 1-d)
    bits = x.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    out = rounded.view(np.float32)
    return np.where(np.isnan(x), x, out)


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype``; floating types are held as float32 (exactly representable values)."""
    if dtype == "bfloat16":
        return round_bf16(x)
    if dtype == "float16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    return np.asarray(x).astype(STORAGE[dtype], copy=False)


def name_of(array) -> str:
    """The element-type name of a numpy array or torch tensor."""
    s = str(array.dtype).replace("torch.", "")
    if s == "bool":
        return "bool"
    if s not in ITEMSIZE:
        raise TypeError(f"unsupported dtype {s}: the NPU simulator handles {', '.join(ITEMSIZE)}")
    return s
