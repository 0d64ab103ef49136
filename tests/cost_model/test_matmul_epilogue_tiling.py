"""The matmul epilogue's tiling search never picks a tile the cost model prices above the kernel's own default
(it took the plain matmul's searched tile, adapted, and stopped there: GPT-2's projection + LayerNorm at hidden 256
was priced 9,160 cycles against the default's 8,648, and ran at that), and the model's mirror of the kernel's
default is the kernel's."""
import pytest

import cost_model
from autofuse.npu.kernels.matmul_epilogue import default_tiling
from cost_model.devices import get_device
from cost_model.matmul_epilogue import kernel_default
from cost_model.program import Builder


def _layer_norm(M, N):
    b = Builder((M,))
    p = b.input("float32", (M, N))
    x = b.cast(p, dtype="float32")
    mean = b.reduce(x, kind="mean")
    d = b.sub(x, mean)
    var = b.reduce(b.mul(d, d), kind="mean")
    b.output(b.mul(d, b.rsqrt(b.add(var, 1e-5))), "float16")
    return b.build()


def _gelu(M, N):
    b = Builder((M,))
    p = b.input("float32", (M, N))
    b.output(b.gelu_tanh(p), "float16")
    return b.build()


@pytest.mark.parametrize("device", ["ascend910", "ascend910b", "ascend310p"])
@pytest.mark.parametrize("program,M,N,K", [(_layer_norm, 256, 256, 256), (_layer_norm, 512, 768, 768),
                                          (_gelu, 256, 1024, 256), (_gelu, 1024, 768, 3072)])
def test_the_searched_epilogue_tile_is_never_priced_above_the_kernels_default(program, M, N, K, device):
    prog = program(M, N)
    specs = [((M, K), "float16"), ((K, N), "float16")]
    dev = get_device(device)
    default = kernel_default(dev, prog, M, N, K, "float16")
    assert default == default_tiling(dev, prog, M, N, K, "float16")         # the mirror is the kernel's
    searched = cost_model.estimate("matmul_epilogue", specs, device=device, program=prog)
    at_default = cost_model.estimate("matmul_epilogue", specs, device=device, program=prog, tiling=default)
    assert searched.cycles <= at_default.cycles
