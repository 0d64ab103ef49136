"""The softmax tile search's UB probe (softmax._ub_fits) against the kernel's tile list (softmax._specs) summed by
vecutil.fits: the same answer for every probe."""
import itertools

from cost_model.devices import get_device
from cost_model.softmax import _specs, _ub_fits
from cost_model.vecutil import fits


def test_ub_probe_matches_the_tile_list():
    masks = [None, ("bool", True, True), ("float16", False, True), ("float32", True, False), ("bfloat16", True, True)]
    for device in ("ascend910", "ascend910b", "ascend310p"):
        dev = get_device(device)
        for dtype, out, rowwise, mask, log in itertools.product(("float16", "bfloat16", "float32"),
                                                                (None, "float32", "float16"), (True, False), masks,
                                                                (False, True)):
            ok = _ub_fits(dev, dtype, rowwise, out, mask, log)
            for block, chunk, one in itertools.product((1, 3, 8, 17, 64, 200), (1, 7, 64, 100, 1000, 5000),
                                                       (True, False)):
                assert ok(block, chunk, one) == fits(dev, _specs(dtype, rowwise, block, chunk, out, mask, log, one))
