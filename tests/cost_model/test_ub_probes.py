"""The tile searches' UB probes (softmax._ub_fits, norm._ub_fits) against the kernels' tile lists (their _specs)
summed by vecutil.fits: the same answer for every probe."""
import itertools

from cost_model.devices import get_device
from cost_model.softmax import _specs, _ub_fits
from cost_model.vecutil import fits


def test_softmax_ub_probe_matches_the_tile_list():
    masks = [None, ("bool", True, True), ("float16", False, True), ("float32", True, False), ("bfloat16", True, True),
             ("float16", True, True, "float16"), ("bfloat16", False, True, "bfloat16")]
    for device in ("ascend910", "ascend910b", "ascend310p"):
        dev = get_device(device)
        for dtype, out, rowwise, mask, log in itertools.product(("float16", "bfloat16", "float32"),
                                                                (None, "float32", "float16"), (True, False), masks,
                                                                (False, True)):
            ok = _ub_fits(dev, dtype, rowwise, out, mask, log)
            for block, chunk, one in itertools.product((1, 3, 8, 17, 64, 200), (1, 7, 64, 100, 1000, 5000),
                                                       (True, False)):
                assert ok(block, chunk, one) == fits(dev, _specs(dtype, rowwise, block, chunk, out, mask, log, one))


def test_norm_ub_probe_matches_the_tile_list():
    from cost_model.norm import _layout, _ub_fits
    for device in ("ascend910", "ascend910b", "ascend310p"):
        dev = get_device(device)
        for kind, dtype, wdt, has_w, has_b, H in itertools.product(
                ("layer", "rms", "add_rms"), ("float16", "float32"), (("float32", "float32"), ("float16", "float16")),
                (True, False), (True, False), (64, 1000, 8192, 60000)):
            spec_fn, tight = _layout(dev, kind, dtype, wdt, has_w, has_b, H)
            ok = _ub_fits(dev, kind, dtype, wdt, has_w, has_b, H, tight)
            for R, cc in itertools.product((1, 2, 7, 64, 300), (64, 640, H, H + 64)):
                assert ok(R, cc) == fits(dev, spec_fn(R, cc))
