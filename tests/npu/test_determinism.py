"""The simulator's speed-ups change nothing it reports: the same launches with the plain code paths (one
thread, values computed as instructions issue, a per-core copy loop for every GM transfer, copying moves)
and with the fast ones (values behind the timeline on three streams, work split over host threads even for
small batches, one-call gathers and scatters, moves that hand over arrays) give bit-identical stats, trace
events and outputs."""
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
    monkeypatch.setattr(machine.Group, "_gather", staticmethod(lambda *a: None))
    monkeypatch.setattr(machine.Group, "_scatter", staticmethod(lambda *a: None))
    monkeypatch.setattr(machine.Launch, "defer", lambda self: None)
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


def test_deferred_values_failure_is_raised_at_sync():
    launch = Launch(get_device("ascend910"), "t")
    g = launch.group("core", 4)
    t = g.alloc("UB", (8, 8), "float32", "t")
    launch.defer()

    def bad(cs):
        raise ValueError("boom")

    g.vector("bad", [t], [], 1, compute=bad, per_core=True)
    g.vector("fill", [t], [t], 1, compute=lambda cs: t.data[cs].fill(2.0), per_core=True)
    with pytest.raises(ValueError, match="boom"):
        launch.finish()


def test_deferred_moves_hand_over_arrays_per_stream():
    """Stream maps: after a deferred run with consuming moves, tiles hold what a plain run gives them."""
    results = []
    for deferred in (False, True):
        launch = Launch(get_device("ascend910"), "t")
        g = launch.group("core", 6)
        x = launch.tensor(np.arange(6 * 16 * 16, dtype=np.float32).reshape(6, 16, 16), "float32", "x")
        a, b = g.alloc("L1", (16, 16), "float32", "a"), g.alloc("L0A", (16, 16), "float32", "b")
        regions = tuple((c, slice(0, 16), slice(0, 16)) for c in range(6))
        if deferred:
            launch.defer()
        for i in range(3):
            g.load(a, x, regions)
            g.vector("scale", [a], [a], 1, compute=lambda cs, i=i: np.multiply(a.data[cs], i + 2, out=a.data[cs]),
                     per_core=True)
            g.move(b, a, consume=True)
        launch.finish()
        results.append(b.data.copy())
    assert np.array_equal(results[0], results[1])
    assert np.array_equal(results[0], np.arange(6 * 16 * 16, dtype=np.float32).reshape(6, 16, 16) * 4)


def _port_group(n=1):
    return Launch(get_device("ascend910b"), "port").group("aiv", n)


def _book(g, start, cycles):
    end, (free, gap) = g._reserve_port(np.full(g.n, float(start)), np.full(g.n, float(cycles)))
    g.port_free, g.port_gap = free, gap
    return float(end[0])


def test_port_fills_idle_intervals_in_pieces():
    g = _port_group()
    assert _book(g, 100, 100) == 200          # [100, 200); [0, 100) stays idle
    assert _book(g, 50, 80) == 230            # [50, 100) then [200, 230): no idle port while it waits
    assert _book(g, 0, 30) == 30              # the idle [0, 50) still takes a short transfer
    assert _book(g, 0, 40) == 250             # [30, 50), then the other 20 after the last booking: [230, 250)
    assert _book(g, 10, 0) == 10              # an empty transfer books nothing


def test_port_carries_one_transfer_at_a_time():
    """Random bookings: the busy time adds up and no transfer ends before it could (start + cycles)."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        g = _port_group(3)
        total = 0.0
        for _ in range(30):
            start = rng.integers(0, 2000, size=3).astype(float)
            cyc = rng.integers(0, 200, size=3).astype(float)
            end, (free, gap) = g._reserve_port(start, cyc)
            assert np.all(end >= start + cyc)
            # a transfer never needs longer than waiting for every booking so far
            assert np.all(end <= np.maximum(start, g.port_free) + cyc)
            g.port_free, g.port_gap = free, gap
            total += cyc
            gs, ge = gap
            assert np.all(ge[1:] >= ge[:-1]) and np.all(ge <= free)      # intervals in time order, in the past
        # idle time remembered + busy time never exceeds the port's span
        assert np.all((gap[1] - gap[0]).sum(axis=0) + total <= g.port_free + 1e-9)


def test_port_fast_path_books_as_the_general_one():
    """The no-idle-interval shortcut of _reserve_port gives the same end times and intervals."""
    rng = np.random.default_rng(3)
    for _ in range(10):
        a, b = _port_group(4), _port_group(4)
        for _ in range(60):
            start = rng.integers(0, 3000, size=4).astype(float)
            cyc = rng.integers(0, 150, size=4).astype(float)
            e1, (f1, g1) = a._reserve_port(start, cyc)
            e2, (f2, g2) = b._reserve_port_pieces(start, cyc + 0 * start, start.copy())
            assert np.array_equal(e1, e2) and np.array_equal(f1, f2) and np.array_equal(g1, g2)
            a.port_free, a.port_gap = f1, g1
            b.port_free, b.port_gap = f2, g2
