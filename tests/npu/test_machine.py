"""The simulated machine: capacity, alignment, timelines, overlap, L2, stats, trace (numpy only)."""
import json

import numpy as np
import pytest

from autofuse import npu
from autofuse.npu.dtypes import round_bf16, to_dtype
from autofuse.npu.machine import CapacityError, Launch, SimulatorError
from cost_model.devices import get_device


def test_devices_contract():
    assert npu.devices() == ["ascend310p", "ascend910", "ascend910b"]


def test_capacity_error_names_buffer_and_bytes():
    launch = Launch(get_device("ascend910b"), "t")
    g = launch.group("aiv", 1)
    g.alloc("UB", (128, 256), "float32", "first")           # 131,072 B of 196,608
    with pytest.raises(CapacityError) as e:
        g.alloc("UB", (128, 128), "float32", "p")             # 65,536 B asked, 65,536 - 0 free? no: 65,536 free
        g.alloc("UB", (1, 8), "float32", "q")
    msg = str(e.value)
    assert "UB overflow" in msg and "q" in msg and "32 B" in msg and "196,608 B" in msg


def test_alignment_is_enforced():
    launch = Launch(get_device("ascend910"), "t")
    g = launch.group("core", 1)
    a = g.alloc("L0A", (1, 3), "float16", "a")                # 6 B
    b = g.alloc("L0A", (16, 16), "float16", "b")
    assert a.offset == 0 and b.offset == 512
    u1 = g.alloc("UB", (3,), "float32")
    u2 = g.alloc("UB", (3,), "float32")
    assert u2.offset - u1.offset == 32


def test_group_without_unit_or_buffer_is_rejected():
    launch = Launch(get_device("ascend910b"), "t")
    aiv = launch.group("aiv", 2)
    with pytest.raises(SimulatorError, match="no L1"):
        aiv.alloc("L1", (16, 16), "float16")
    with pytest.raises(SimulatorError, match="has 24 cores"):
        launch.group("aic", 25)


def _stream(nbuf: int):
    """Load 64 tiles and run four vector passes over each, with ``nbuf`` UB buffers."""
    launch = Launch(get_device("ascend910"), "stream")
    g = launch.group("aiv", 1)
    x = launch.tensor(np.ones((64 * 64, 256), np.float32), "float16", "x")
    bufs = [g.alloc("UB", (64, 256), "float16", f"b{i}") for i in range(nbuf)]
    for i in range(64):
        t = bufs[i % nbuf]
        g.load(t, x, [(slice(i * 64, (i + 1) * 64), slice(0, 256))])
        g.vector("work", writes=(t,), reads=(t,), repeats=int(g.repeats(64 * 256, "float16")) * 4)
    return launch.finish()


def test_double_buffering_overlaps_load_and_compute():
    single, double = _stream(1), _stream(2)
    assert double.cycles < 0.8 * single.cycles
    # with overlap the kernel runs near the speed of its busiest unit
    assert max(double.util.values()) > 0.8


def test_l2_rereads_do_not_cross_hbm():
    def reads(times):
        launch = Launch(get_device("ascend910"), "reread")
        g = launch.group("aiv", 1)
        x = launch.tensor(np.ones((64, 256), np.float32), "float16", "x")
        t = g.alloc("UB", (64, 256), "float16")
        for _ in range(times):
            g.load(t, x, [(slice(0, 64), slice(0, 256))])
        return launch.finish()
    once, thrice = reads(1), reads(3)
    assert once.hbm_bytes == thrice.hbm_bytes == 64 * 256 * 2
    assert thrice.bytes["GM->UB"] == 3 * once.bytes["GM->UB"]


def test_l2_capacity_evicts():
    dev = get_device("ascend310p")            # 16 MB L2
    launch = Launch(dev, "evict")
    g = launch.group("aiv", 1)
    rows = 12288                               # 24 MB of fp16 through a 16 MB LRU: the second sweep misses
    x = launch.tensor(np.zeros((rows, 1024), np.float32), "float16", "x")
    t = g.alloc("UB", (64, 1024), "float16")
    for sweep in range(2):
        for r in range(0, rows, 64):
            g.load(t, x, [(slice(r, r + 64), slice(0, 1024))])
    stats = launch.finish()
    assert stats.hbm_bytes > 1.5 * rows * 1024 * 2


def test_gm_traffic_is_capped_by_l2_bandwidth():
    """Two groups reading L2-resident data at once: each instruction shares L2 only among its own cores,
    but the launch cannot finish before all its GM traffic has passed the chip's L2."""
    dev = get_device("ascend910b")
    launch = Launch(dev, "l2cap")
    aic, aiv = launch.group("aic", dev.cube_cores), launch.group("aiv", dev.vector_cores)
    x = launch.tensor(np.zeros((64, 8192), np.float32), "float16", "x")
    a, v = aic.alloc("L1", (64, 1024), "float16"), aiv.alloc("UB", (64, 1024), "float16")
    reg = (slice(0, 64), slice(0, 1024))
    aiv.load(v, x, [reg] * dev.vector_cores)                 # bring the region into L2
    for _ in range(8):
        aic.load(a, x, [reg] * dev.cube_cores)
        aiv.load(v, x, [reg] * dev.vector_cores)
    stats = launch.finish()
    gm = sum(b for p, b in stats.bytes.items() if "GM" in p)
    core_end = max(float(g.end_time().max()) for g in launch.groups)
    assert gm / dev.l2_bytes_per_cycle > core_end             # the groups overlapped beyond L2's bandwidth
    assert stats.cycles - stats.launch_cycles == int(np.ceil(gm / dev.l2_bytes_per_cycle))


def test_syncall_opens_no_earlier_than_hbm_can_move_the_phase():
    """Two groups reading distinct HBM regions at once: each instruction shares the GM port only among its own
    cores, so together they finish sooner than HBM can deliver; SyncAll opens when it can, the phase after it
    starts there, and the launch's last phase is held to HBM the same way."""
    dev = get_device("ascend910b")
    launch = Launch(dev, "hbmcap")
    aic, aiv = launch.group("aic", dev.cube_cores), launch.group("aiv", dev.vector_cores)
    n = dev.cube_cores + dev.vector_cores
    x = launch.tensor(np.zeros((64 * 2 * n, 1024), np.float32), "float16", "x")
    a, v = aic.alloc("L1", (64, 1024), "float16"), aiv.alloc("UB", (64, 1024), "float16")

    def read(phase):                  # every core its own 128 KB region, never read before: all from HBM
        first = 64 * n * phase
        aic.load(a, x, [(slice(first + 64 * c, first + 64 * c + 64), slice(0, 1024)) for c in range(aic.n)],
                 deps=(t,))
        first += 64 * aic.n
        aiv.load(v, x, [(slice(first + 64 * c, first + 64 * c + 64), slice(0, 1024)) for c in range(aiv.n)],
                 deps=(t,))

    t = 0.0
    read(0)
    phase_bytes = 64 * 1024 * 2 * n
    assert launch.hbm_read == phase_bytes
    core_end = max(float(g.end_time().max()) for g in launch.groups)
    assert phase_bytes / dev.hbm_bytes_per_cycle > 1.2 * core_end       # the timelines overlap beyond HBM
    t = launch.sync_all()
    assert t == pytest.approx(phase_bytes / dev.hbm_bytes_per_cycle)
    read(1)
    assert max(float(g.end_time().max()) for g in launch.groups) < t + phase_bytes / dev.hbm_bytes_per_cycle
    stats = launch.finish()
    assert stats.hbm_bytes == 2 * phase_bytes
    assert stats.cycles - stats.launch_cycles == int(np.ceil(2 * phase_bytes / dev.hbm_bytes_per_cycle))
    # the two phases as Stats reports them: each one's end and the HBM bytes it moved
    assert stats.phases == ((int(np.ceil(t)), phase_bytes),
                            (int(np.ceil(2 * phase_bytes / dev.hbm_bytes_per_cycle)), phase_bytes))


def test_stats_contract_and_trace():
    r = npu.run("matmul", np.ones((40, 24), np.float16), np.ones((24, 56), np.float16), device="ascend910",
                tiling={"m0": 48, "n0": 64, "k0": 32, "k1": 32})
    s = r.stats
    assert isinstance(s.cycles, int) and s.cycles > get_device("ascend910").launch_cycles
    assert s.seconds == pytest.approx(s.cycles / 1e9)
    assert set(s.busy) == set(s.util) == {"mte1", "mte2", "mte3", "fixpipe", "cube", "vector", "scalar"}
    assert all(0 <= u <= 1 for u in s.util.values())
    assert s.util["cube"] == pytest.approx(s.busy["cube"] / s.cycles)
    assert s.bytes["GM->L1"] == 40 * 24 * 2 + 24 * 56 * 2
    assert s.hbm_bytes == 40 * 24 * 2 + 24 * 56 * 2 + 40 * 56 * 2
    doc = json.loads(r.trace.to_json())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"cube", "mte2", "mte1"} <= names
    assert any(e["ph"] == "X" and e["tid"] == 4 for e in doc["traceEvents"])   # a Cube event


@pytest.mark.parametrize("kernel,args,device", [
    ("matmul", (np.ones((512, 512), np.float16), np.ones((512, 512), np.float16)), "ascend910"),
    ("softmax", (np.ones((64, 256), np.float16),), "ascend910b"),
    # one matmul launch per group, in sequence: the overheads between them are traced too
    ("matmul_per_group", (np.ones((96, 64), np.float16), np.ones((3, 64, 32), np.float16), np.array([32, 64, 96])),
     "ascend910")])
def test_a_trace_spans_the_launchs_cycles_with_its_launch_overhead(kernel, args, device, tmp_path):
    """The trace ended one launch overhead short of ``Stats.cycles`` (3.296 us traced for a 512² matmul counted
    6.296 us): the overhead is an event of its own on a ``launch`` track, ending at the launch's last cycle."""
    r = npu.run(kernel, *args, device=device)
    dev = get_device(device)
    r.trace.save(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    span = max(e["ts"] + e["dur"] for e in xs) - min(0.0, min(e["ts"] for e in xs))
    assert span == pytest.approx(r.stats.cycles / dev.clock_hz * 1e6, abs=1e-9)
    launch = [e for e in xs if e["name"] == "launch"]
    tracks = {(e["pid"], e.get("tid")): e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {tracks[e["pid"], None] for e in launch} == {"launch"}
    assert {tracks[e["pid"], 0] for e in launch} == {"overhead"}
    assert all(e["dur"] == pytest.approx(dev.launch_cycles / dev.clock_hz * 1e6) for e in launch)
    assert len(launch) == (3 if kernel == "matmul_per_group" else 1)
    assert launch[-1]["ts"] + launch[-1]["dur"] == pytest.approx(span)
    work = [e for e in xs if e["name"] != "launch"]           # no launch overlaps the work of a core
    for e in launch:
        assert not any(w["ts"] < e["ts"] + e["dur"] - 1e-9 and w["ts"] + w["dur"] > e["ts"] + 1e-9 for w in work)
    assert doc["otherData"]["cycles"] == r.stats.cycles and doc["otherData"]["launch_cycles"] == dev.launch_cycles


def test_bf16_rounding_ties_to_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, np.inf], np.float32)
    assert list(round_bf16(x)) == [1.0, 1.0, 1.0 + 2 ** -6, -2.5, np.inf]
    assert to_dtype(np.float32(1 / 3), "float16") == np.float32(np.float16(1 / 3))


def test_unknown_kernel_and_parameter_errors():
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        npu.run("nope", np.ones(3))
    with pytest.raises(TypeError, match="takes no parameter 'bogus'"):
        npu.run("matmul", np.ones((2, 2), np.float16), np.ones((2, 2), np.float16), bogus=1)
    with pytest.raises(ValueError, match="unknown target device"):
        npu.run("matmul", np.ones((2, 2), np.float16), np.ones((2, 2), np.float16), device="gpu")
