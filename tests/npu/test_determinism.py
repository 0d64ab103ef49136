"""The simulator's speed-ups change nothing it reports: the same launches with the plain code paths (one
thread, a per-core copy loop for every GM transfer, copying moves) and with the fast ones (work split over
host threads even for small batches, one-call gathers and scatters, moves that hand over arrays) give
bit-identical stats, trace events and outputs."""
import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu import machine
from autofuse.npu.machine import Launch, SimulatorError
from cost_model.devices import get_device


def _inputs(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def _launches():
    out = []
    for dev in npu.devices():
        a, b = _inputs([(70, 130), (130, 40)], torch.float16, 1)
        out.append(("matmul", (a, b), {"device": dev}))
        x, = _inputs([(33, 300)], torch.bfloat16, 2)
        out.append(("softmax", (x,), {"dim": -1, "device": dev}))
        x, w, bb = _inputs([(5, 33, 200), (200,), (200,)], torch.float16, 4)
        out.append(("layer_norm", (x, w, bb), {"device": dev}))
        for dt in (torch.float16, torch.float32):
            q, k, v = _inputs([(2, 4, 96, 64), (2, 2, 160, 64), (2, 2, 160, 64)], dt, 6)
            mask = torch.rand(2, 1, 96, 160, generator=torch.Generator().manual_seed(7)) > 0.3
            for kw in ({}, {"causal": True, "mask": mask}, {"return_probs": True}):
                out.append(("flash_attention", (q, k, v), {"device": dev, **kw}))
    return out


def _record():
    rec = []
    for name, args, kw in _launches():
        r = npu.run(name, *args, **kw)
        st = r.stats
        events = [(g.kind, unit, nm, np.asarray(s).tobytes(), np.asarray(e).tobytes(),
                   None if a is None else np.asarray(a).tobytes()) for g, unit, nm, s, e, a in r.trace._events]
        rec.append((name, kw.get("device"), st.cycles, st.bytes, st.hbm_bytes, st.busy, st.busy_total, st.util,
                    st.instructions, events, [(o.dtype, o.shape, o.tobytes()) for o in r.outputs]))
    return rec


def test_fast_paths_change_no_figure_and_no_value(monkeypatch):
    fast = None
    prev = machine.set_host_threads(3)
    try:
        monkeypatch.setattr(machine, "SPLIT_MIN", 1)          # split every batch, however small
        fast = _record()
    finally:
        machine.set_host_threads(prev)
    monkeypatch.setattr(machine, "SPLIT_MIN", 1 << 62)
    monkeypatch.setattr(machine.Group, "_load_all", staticmethod(lambda *a: False))
    monkeypatch.setattr(machine.Group, "_store_all", staticmethod(lambda *a: False))
    move = machine.Group.move
    monkeypatch.setattr(machine.Group, "move", lambda self, *a, consume=False, **k: move(self, *a, **k))
    prev = machine.set_host_threads(1)
    try:
        plain = _record()
    finally:
        machine.set_host_threads(prev)
    assert len(fast) == len(plain)
    for f, p in zip(fast, plain):
        assert f == p, f[:2]


def test_consumed_tile_cannot_be_read():
    launch = Launch(get_device("ascend910"), "t")
    g = launch.group("core", 2)
    x = launch.tensor(np.ones((2, 16, 16), np.float32), "float16", "x")
    l1 = g.alloc("L1", (16, 16), "float16", "l1")
    l0 = g.alloc("L0A", (16, 16), "float16", "l0")
    regions = [(c, slice(0, 16), slice(0, 16)) for c in range(2)]
    g.load(l1, x, regions)
    g.move(l0, l1, consume=True)
    assert np.all(l0.data == 1)
    with pytest.raises(SimulatorError, match="l1"):
        g.move(l0, l1)
    g.load(l1, x, regions)                                    # rewritten whole: readable again
    g.move(l0, l1)


def test_blas_threads_restored():
    blas = machine._find_openblas()
    if not blas:
        pytest.skip("numpy's BLAS is not a settable OpenBLAS")
    before = blas[1]()
    with machine.host_blas():
        assert blas[1]() == 1
        with machine.host_blas():
            assert blas[1]() == 1
        assert blas[1]() == 1
    assert blas[1]() == before
