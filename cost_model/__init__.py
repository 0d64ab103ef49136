"""Analytic cost model of a Cube/Vector NPU (numpy only).

    import cost_model
    e = cost_model.estimate("matmul", [((2048, 2048), "float16")] * 2, device="ascend910")
    e.cycles, e.hbm_bytes, e.bytes, e.busy, e.bound, e.tiling
    cost_model.roofline("matmul", [((2048, 2048), "float16")] * 2, device="ascend910")   # cycles

One model per simulator kernel (closed-form schedule of the kernel's tiled pipeline, see each module),
a tiling search per kernel, a roofline bound, and a generic price for ops without a kernel.
"""
from cost_model.devices import DEVICES, Device, devices, get_device
from cost_model.estimate import MODELS, Estimate, estimate, roofline
from cost_model import matmul as _matmul  # noqa: F401,E402  (each import registers a model)
from cost_model import conv as _conv  # noqa: F401,E402
from cost_model import softmax as _softmax  # noqa: F401,E402
from cost_model import norm as _norm  # noqa: F401,E402
from cost_model import vector as _vector  # noqa: F401,E402
from cost_model import flash_attention as _flash_attention  # noqa: F401,E402
from cost_model import score_bound as _score_bound  # noqa: F401,E402
from cost_model import dropout as _dropout  # noqa: F401,E402
from cost_model import movement as _movement  # noqa: F401,E402
from cost_model import moe as _moe  # noqa: F401,E402
from cost_model import moe_grad as _moe_grad  # noqa: F401,E402
from cost_model import grouped_matmul as _grouped_matmul  # noqa: F401,E402
from cost_model import grouped_matmul_grad as _grouped_matmul_grad  # noqa: F401,E402
from cost_model import collectives as _collectives  # noqa: F401,E402
from cost_model import mc2 as _mc2  # noqa: F401,E402
from cost_model import vector_program as _vector_program  # noqa: F401,E402
from cost_model import matmul_epilogue as _matmul_epilogue  # noqa: F401,E402
from cost_model import moe_ep as _moe_ep  # noqa: F401,E402
from cost_model import flash_attention_grad as _flash_attention_grad  # noqa: F401,E402
from cost_model.generic import generic_op  # noqa: E402
from cost_model.alternatives import alternatives, epilogue_alternatives  # noqa: E402

__all__ = ["DEVICES", "Device", "Estimate", "MODELS", "alternatives", "devices", "epilogue_alternatives", "estimate",
           "generic_op", "get_device", "roofline"]
