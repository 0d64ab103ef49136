"""The simulated NPU: buffers, engines with timelines, a shared L2 in front of HBM, SPMD launches.

How a kernel runs
-----------------
1. A kernel opens a :class:`Launch` on a device and asks for one or more :class:`Group` s of cores
   (``"core"``: a coupled AI core with every unit; ``"aic"``: Cube side of a split core; ``"aiv"``:
   a vector core). All cores of a group run the same program in lockstep: every buffer holds a numpy
   array with a leading core axis, so one numpy call computes a tile on every core at once.
2. The program allocates tiles in the core's buffers (:meth:`Group.alloc`): capacity and alignment
   are enforced, an overflow raises :class:`CapacityError` naming the buffer and the bytes.
3. Each instruction occupies one unit (``mte1 mte2 mte3 fixpipe cube vector``) for a number of cycles
   given by the device's rates. It starts when its unit is free, when the Scalar unit has issued it,
   and when the tiles it reads are written (RAW) and the tiles it writes are no longer read (WAR).
   Units run in parallel, so double buffering shows up as overlap on the timelines.
4. Transfers from and to global memory (GM) also pass the core's port to the shared L2/HBM: a read
   that hits L2 costs L2 bandwidth, a miss costs HBM bandwidth, and the cores of one lockstep
   instruction share the chip's bandwidth (see :meth:`Group._gm_access`). A core's port carries one
   transfer at a time; while an engine waits for it, the engine counts as busy, as a hardware counter
   counts an outstanding request.
5. :meth:`Launch.finish` returns :class:`Stats`: kernel time = the slowest core (never less than the
   launch's HBM bytes over the chip's HBM bandwidth, nor its GM traffic over the chip's L2 bandwidth)
   + the launch overhead.

Everything here counts what the program executed; nothing calls a cost formula.

L2 policy: an LRU cache of the regions kernels touch (keyed by tensor and region). Reads allocate.
Writes to ordinary tensors are written through to HBM (a kernel's output must reach HBM for the next
kernel); writes to *scratch* tensors (workspace a kernel rewrites and re-reads) stay in L2 as dirty
lines, written back when evicted or, at the latest, at the end of the kernel.

Host speed (never the figures). Timing bookkeeping is separate from values: an instruction books its
unit, port and L2 at issue and hands its data work (copies, GEMMs, ``compute``) to :meth:`Launch._data`.
That work runs at once, split by cores over host threads when large (:func:`split_cores`; GEMMs only while
:func:`host_blas` holds OpenBLAS at one thread), or, after :meth:`Launch.defer`, behind the timeline on one
value stream per host thread, each for its share of the cores (:class:`_Streams`). Region lists passed
again as the same tuple reuse their bookkeeping (:func:`_regions`); uniform per-core regions are copied in
one gather/scatter. Each core's values come from the same numpy calls on the same data in every mode, so
stats, traces and outputs are bit for bit those of the plain path (tests/npu/test_determinism.py).
``AUTOFUSE_NPU_THREADS`` (or :func:`set_host_threads`) sets the host threads; 1 turns splitting off.
"""
from __future__ import annotations

import ctypes
import glob
import itertools
import math
import os
import threading
from collections import OrderedDict, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from autofuse.npu.dtypes import STORAGE, itemsize, to_dtype
from cost_model.devices import Device

UNITS = ("mte1", "mte2", "mte3", "fixpipe", "cube", "vector", "scalar")
# The chip's ports to other NPUs (autofuse/npu/link.py): one lane per port, reported only by launches that
# communicate, so that every other kernel's statistics keep the units above.
LINK_UNIT = "link"
ALL_UNITS = UNITS + (LINK_UNIT,)
PORT_GAPS = 4          # idle intervals of a core's GM port remembered for transfers that run out of issue order
_GROUP_UNITS = {
    "core": UNITS,
    "aic": ("mte1", "mte2", "fixpipe", "cube", "scalar"),
    "aiv": ("mte2", "mte3", "vector", "scalar"),
    "link": (LINK_UNIT, "scalar"),
}
_GROUP_BUFFERS = {"core": ("L1", "L0A", "L0B", "L0C", "UB"), "aic": ("L1", "L0A", "L0B", "L0C"), "aiv": ("UB",),
                  "link": ()}
# Which engine moves data along each path.
_PATH_UNIT = {
    "GM->L1": "mte2", "GM->L0A": "mte2", "GM->L0B": "mte2", "GM->UB": "mte2",
    "L1->L0A": "mte1", "L1->L0B": "mte1", "L1->UB": "mte1",
    "L0C->UB": "fixpipe", "L0C->GM": "fixpipe", "UB->GM": "mte3",
}


def _live(tiles, what: str) -> None:
    """Refuse to read (or partly write) a tile whose values a ``move(..., consume=True)`` handed on."""
    for t in tiles:
        if t.consumed:
            raise SimulatorError(f"{what} uses tile {t.name} ({t.buffer}) after a move(consume=True) took its "
                                 f"values; rewrite it whole (load, move, mmad) first")


class CapacityError(MemoryError):
    """A tile does not fit its buffer."""


class SimulatorError(RuntimeError):
    """A program asked the simulated hardware for something it cannot do."""


def _extent(region) -> tuple[int, ...]:
    """Shape of ``data[region]`` for a region of slices (with explicit bounds) and integer indices."""
    return tuple([s.stop - s.start for s in region if s.__class__ is slice])


def _key(region) -> tuple:
    return tuple([(s.start, s.stop) if s.__class__ is slice else s for s in region])


class _Regions:
    """The bookkeeping of one per-core region list, done once: L2 keys, elements, which cores take part and,
    when every core has a region of one extent, the row indices that copy all of them in one numpy call.

    A kernel that passes the same *tuple* of regions again (a cached schedule) gets this object back from
    :func:`_regions` instead of a per-core pass over the slices. Lists are rebuilt every time (they may change).
    """

    __slots__ = ("regions", "keys", "elems", "cores", "present", "idle", "extent", "_rows")

    def __init__(self, regions):
        keys, elems, cores = [], [], []
        extent = None
        uniform = True
        for c, region in enumerate(regions):
            if region is None:
                keys.append(None)
                elems.append(0)
                continue
            key, n, ext = [], 1, []
            for s in region:
                if s.__class__ is slice:
                    key.append((s.start, s.stop))
                    e = s.stop - s.start
                    n *= e
                    ext.append(e)
                else:
                    key.append(s)
            keys.append(tuple(key))
            elems.append(n)
            cores.append(c)
            if uniform:
                ext = tuple(ext)
                if extent is None:
                    extent = ext
                elif ext != extent:
                    uniform = False
        self.regions, self.keys, self.elems, self.cores = regions, keys, elems, cores
        self.idle = len(cores) < len(regions)
        self.present = None
        if self.idle:
            self.present = np.array([r is not None for r in regions])
            self.present.flags.writeable = False
        # one copy for all cores: only when every core takes part with a region of the same extent
        self.extent = extent if uniform and not self.idle and cores else None
        self._rows = {}

    def rows(self, data: np.ndarray):
        """``(W, rows)``: with ``data`` viewed as ``[-1, W]`` rows (W = the regions' last extent), core c's
        region is ``view[rows[c]]`` (shape ``[n, *extent]``); None when the regions do not allow it (a region
        not covering every dim, out of bounds, with a step, or not starting on a W boundary)."""
        key = data.shape
        got = self._rows.get(key, 0)
        if got == 0:
            got = self._rows[key] = self._build_rows(data.shape)
        return got

    def _build_rows(self, shape):
        ext = self.extent
        nd = len(shape)
        if ext is None or not ext or min(ext) <= 0:
            return None
        W = ext[-1]
        if shape[-1] % W:
            return None
        strides = [1] * nd
        for d in range(nd - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        offs, slice_dims = [], None
        for region in self.regions:
            if len(region) != nd or region[-1].__class__ is not slice:
                return None
            off, sd = 0, []
            for d, s in enumerate(region):
                if s.__class__ is slice:
                    if s.step is not None or not (0 <= s.start <= s.stop <= shape[d]):
                        return None
                    off += s.start * strides[d]
                    sd.append(d)
                else:
                    if not 0 <= s < shape[d]:
                        return None
                    off += int(s) * strides[d]
            if region[-1].start % W:
                return None
            if slice_dims is None:
                slice_dims = sd
            elif sd != slice_dims:
                return None
            offs.append(off)
        rel = np.zeros((), dtype=np.intp)
        for d, e in zip(slice_dims[:-1], ext[:-1]):
            rel = rel[..., None] + np.arange(e, dtype=np.intp) * strides[d]
        off = np.array(offs, dtype=np.intp).reshape((-1,) + (1,) * rel.ndim)
        rows = (off + rel) // W
        return W, rows, bool(np.unique(rows).size == rows.size)


_REGIONS: dict = {}             # id(tuple of regions) -> _Regions (holding the tuple, so the id stays its own)
_REGIONS_MAX = 1 << 15


def _regions(regions) -> _Regions:
    if regions.__class__ is tuple:
        info = _REGIONS.get(id(regions))
        if info is not None and info.regions is regions:
            return info
        info = _Regions(regions)
        if len(_REGIONS) >= _REGIONS_MAX:
            _REGIONS.clear()
        _REGIONS[id(regions)] = info
        return info
    return _Regions(regions)


def _contiguous(a: np.ndarray) -> bool:
    return a.flags.c_contiguous


# ------------------------------------------------------------------------------ host threads
# The simulator's own speed (never its figures): a lockstep instruction computes every core's tile in one
# numpy call, and the big ones (the Cube's batched GEMMs, kernels' Vector passes) are split by cores over
# the host's CPUs. Each core's values are computed by the same numpy/BLAS call on the same data whether or
# not the batch is split, so outputs are bit for bit the same with any number of threads.

_THREADS = None


def _host_threads() -> int:
    """Host threads for the simulator: ``AUTOFUSE_NPU_THREADS`` if set (read once), else the CPUs this
    process may use (at most 4: the batches are small). :func:`set_host_threads` changes it."""
    global _THREADS
    if _THREADS is None:
        env = os.environ.get("AUTOFUSE_NPU_THREADS", "").strip()
        if env:
            _THREADS = max(1, int(env))
        else:
            try:
                cpus = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cpus = os.cpu_count() or 1
            _THREADS = max(1, min(cpus, 4))
    return _THREADS


def set_host_threads(n: int | None) -> int:
    """Use ``n`` host threads (1: no splitting; None: as the environment says); returns the previous count."""
    global _THREADS
    prev = _host_threads()
    _THREADS = None if n is None else max(1, int(n))
    return prev


class _Job:
    """Parts of one split computation; whoever is free takes the next part (the caller too)."""

    def __init__(self, fn, parts):
        self.fn, self.parts = fn, parts
        self.next = 0
        self.left = len(parts)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error = None

    def work(self):
        parts, fn, lock = self.parts, self.fn, self.lock
        while True:
            with lock:
                i = self.next
                if i >= len(parts):
                    return
                self.next = i + 1
            try:
                fn(parts[i])
            except BaseException as e:         # re-raised in the caller
                if self.error is None:
                    self.error = e
            with lock:
                self.left -= 1
                if self.left == 0:
                    self.done.set()


class _Pool:
    """Sleeping helper threads that take parts of a split computation alongside the calling thread.

    The caller works through the parts too and only waits for parts a helper has already started, so a
    helper the OS has not scheduled yet (a loaded machine) delays nothing: the caller does its share.
    Helpers sleep on a condition variable between jobs (no spinning). One job at a time: a call made while
    another thread's job runs computes its parts itself.
    """

    def __init__(self):
        self.cv = threading.Condition()
        self.job = None
        self.gen = 0
        self.threads: list = []
        self.pid = os.getpid()
        self.busy = threading.Lock()

    def _loop(self):
        seen = 0
        while True:
            with self.cv:
                while self.gen == seen:
                    self.cv.wait()
                seen, job = self.gen, self.job
            if job is not None:
                job.work()

    def map(self, fn, parts) -> None:
        """``fn(part)`` for every part, the parts spread over this thread and the helpers."""
        helpers = _host_threads() - 1
        if helpers <= 0 or len(parts) < 2 or not self.busy.acquire(blocking=False):
            for part in parts:
                fn(part)
            return
        try:
            if os.getpid() != self.pid:          # a forked child has none of the parent's threads
                self.threads, self.pid = [], os.getpid()
            while len(self.threads) < helpers:
                t = threading.Thread(target=self._loop, name="npu-sim", daemon=True)
                t.start()
                self.threads.append(t)
            job = _Job(fn, parts)
            with self.cv:
                self.job = job
                self.gen += 1
                self.cv.notify_all()
            job.work()
            job.done.wait()
            with self.cv:
                self.job = None
        finally:
            self.busy.release()
        if job.error is not None:
            raise job.error


_POOL = _Pool()


SPLIT_MIN = 1 << 16               # elements (or GEMM MACs per core) below which a split does not pay


def core_parts(n: int, size: int, parts: int | None = None):
    """Slices of ``range(n)`` (the core axis) to split a computation of ``size`` elements over host threads
    (one slice per thread by default: fewer hand-offs beat finer balance here); a single slice when it is
    smaller than ``SPLIT_MIN`` (or one host thread is configured)."""
    threads = _host_threads()
    if n < 2 or size < SPLIT_MIN or threads < 2:
        return [slice(0, n)]
    k = min(n, parts or threads)
    return [slice(i * n // k, (i + 1) * n // k) for i in range(k)]


def split_cores(fn, n: int, size: int) -> None:
    """``fn(cores)`` over slices of the core axis, on the host threads (see :func:`core_parts`)."""
    _POOL.map(fn, core_parts(n, size))


def _slice_of(i: int, k: int, n: int, base: int) -> slice:
    """Stream ``i`` of ``k``'s share of a group of ``n`` cores, in a launch whose smallest group has ``base``
    cores: whole multiples of ``n / base`` when ``base`` divides ``n``, so that AIC c and the AIVs paired
    with it (2c, 2c+1) fall in one stream."""
    if base and n % base == 0:
        r = n // base
        return slice(i * base // k * r, (i + 1) * base // k * r)
    return slice(i * n // k, (i + 1) * n // k)


_LOCAL = threading.local()        # per thread: .arrays, a value stream's tile -> array map
_EVERY = object()                 # a stream item every stream runs (not a share of the cores)


class _Streams:
    """The values of a deferred launch (:meth:`Launch.defer`), computed behind its timeline by ``k`` threads.

    The calling thread runs the program: it books every instruction (units, GM port, L2: nothing there
    depends on values) and queues the instruction's data work. Stream ``i`` runs the whole queue in issue
    order for its share of the cores (:func:`_slice_of`), which is exact because in lockstep every value a
    core computes comes from its own tiles and from GM regions it (or a core of its share) wrote earlier.
    Work that is not per core (``whole``) runs on one stream between two barriers. A failure is raised by
    :meth:`sync`.
    """

    def __init__(self, k: int, base: int):
        self.k, self.base = k, base
        self.cv = threading.Condition()
        self.queue: list = []
        self.closed = False
        self.error = None
        self.barrier = threading.Barrier(k) if k > 1 else None
        # moves that hand arrays over (consume=True) do so on each stream's own map, tile -> array: a stream
        # that is ahead uses an array in its new role on its cores while another still uses it in the old
        # role on its own cores. Every stream makes the same exchanges, so the maps agree at the end.
        self.arrays: list[dict] = [{} for _ in range(k)]
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"npu-sim-values-{i}", daemon=True)
                        for i in range(k)]
        for t in self.threads:
            t.start()

    def submit(self, item) -> None:
        with self.cv:
            self.queue.append(item)
            self.cv.notify_all()

    def _run(self, i: int) -> None:
        try:
            self._stream(i)
        except BaseException as e:           # never end silently: sync() raises it
            self.error = e
            if self.barrier is not None:
                self.barrier.abort()         # the other streams must not wait for this one

    def _stream(self, i: int) -> None:
        k, cv, queue = self.k, self.cv, self.queue
        _LOCAL.arrays = self.arrays[i]
        pos = 0
        while True:
            with cv:
                while pos >= len(queue) and not self.closed:
                    cv.wait()
                if pos >= len(queue):
                    return
                end = len(queue)
            while pos < end:                  # the items issued meanwhile, without taking the lock again
                n, fn = queue[pos]
                pos += 1
                try:
                    if n is _EVERY:           # bookkeeping every stream does
                        fn(None)
                    elif n is not None:       # per core: this stream's share
                        if self.error is None:
                            cs = _slice_of(i, k, n, self.base)
                            if cs.start < cs.stop:
                                fn(cs)
                    else:                     # whole: one stream, the others wait
                        if self.barrier is not None:
                            self.barrier.wait()
                        if i == 0 and self.error is None:
                            fn()
                        if self.barrier is not None:
                            self.barrier.wait()
                except BaseException as e:    # raised by sync() in the calling thread
                    if self.error is None:
                        self.error = e

    def sync(self) -> None:
        """Wait for every queued item; the streams end (a launch syncs once, at the end)."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        for t in self.threads:
            t.join()
        for tile, array in self.arrays[0].items():
            tile._data = array
        if self.error is None and any(m != self.arrays[0] for m in self.arrays[1:]):
            self.error = SimulatorError("value streams disagree on the arrays their moves exchanged")
        if self.error is not None:
            e, self.error = self.error, None
            raise e


def _find_openblas():
    """numpy's OpenBLAS ``(set_num_threads, get_num_threads)``, or None (another BLAS, or not found)."""
    dirs = [os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs"),
            os.path.join(os.path.dirname(np.__file__), ".libs")]
    try:
        import scipy_openblas64
        dirs.append(os.path.join(os.path.dirname(scipy_openblas64.__file__), "lib"))
    except ImportError:
        pass
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*openblas*.so*"))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for prefix in ("scipy_openblas", "openblas"):
                for suffix in ("64_", ""):
                    set_, get = f"{prefix}_set_num_threads{suffix}", f"{prefix}_get_num_threads{suffix}"
                    if hasattr(lib, set_) and hasattr(lib, get):
                        fset, fget = getattr(lib, set_), getattr(lib, get)
                        fset.argtypes, fset.restype, fget.restype = [ctypes.c_int], None, ctypes.c_int
                        return fset, fget
    return None


_BLAS = None
_BLAS_LOCK = threading.Lock()
_BLAS_STATE = {"depth": 0, "saved": None}
_blas_split = False              # whether mmad may split its GEMMs over host threads (BLAS is single-threaded)


@contextmanager
def host_blas():
    """While a kernel runs: numpy's OpenBLAS on one thread, the Cube's batched GEMMs split by cores over the
    simulator's own host threads instead; the previous OpenBLAS thread count is restored afterwards.

    Why: one simulated instruction is one small GEMM per core (e.g. 32 of 128³). OpenBLAS threads hand each
    of them to workers that spin while waiting; on a loaded machine every hand-off waits for a time slice
    (a 4 ms batch measured at 700 ms). The simulator's helpers sleep between jobs and the calling thread
    does the parts no helper has started. This is process-wide (OpenBLAS has one setting): other threads'
    numpy GEMMs run single-threaded while a kernel is being simulated. Without a settable OpenBLAS (another
    BLAS), GEMMs are not split and BLAS keeps its own threading.
    """
    global _BLAS, _blas_split
    with _BLAS_LOCK:
        if _BLAS is None:
            _BLAS = _find_openblas() or False
        st = _BLAS_STATE
        if st["depth"] == 0 and _BLAS:
            st["saved"] = _BLAS[1]()
            if st["saved"] != 1:
                _BLAS[0](1)
            _blas_split = True
        st["depth"] += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            st["depth"] -= 1
            if st["depth"] == 0 and _BLAS:
                _blas_split = False
                if st["saved"] != 1:
                    _BLAS[0](st["saved"])


class Absent:
    """The values of a tensor or tile in a timing-only launch (:class:`Launch` with ``values=False``): its shape
    and storage type, no values and no memory.

    Indexing, ``reshape``, ``transpose`` and ``astype`` give the Absent of the result's shape, so host code that
    only looks at shapes runs unchanged. Anything that would read or write values (``np.asarray``, arithmetic,
    assignment) raises :class:`SimulatorError`: a kernel whose program depends on values must get them as real
    inputs (its ``steer`` inputs, see :func:`autofuse.npu.run.kernel`), so a timing-only launch can never
    silently branch on zeros.
    """

    __slots__ = ("shape", "dtype", "element")

    def __init__(self, shape, dtype=np.float32, element: str | None = None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.element = element          # the element type's name when it differs from the storage's (float16)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def _like(self):
        """A zero-stride array of this shape (no memory): numpy computes the shapes of views of it."""
        return np.lib.stride_tricks.as_strided(np.zeros(1, self.dtype), self.shape, (0,) * len(self.shape))

    def __getitem__(self, index) -> "Absent":
        if isinstance(index, Absent) or (isinstance(index, tuple) and any(isinstance(i, Absent) for i in index)):
            raise SimulatorError("a timing-only launch cannot index by absent values")
        return Absent(self._like()[index].shape, self.dtype, self.element)

    def reshape(self, *shape) -> "Absent":
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = [int(d) for d in shape]
        if -1 in shape:
            rest = math.prod(d for d in shape if d != -1)
            shape[shape.index(-1)] = self.size // rest if rest else 0
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape an absent array of shape {self.shape} into {tuple(shape)}")
        return Absent(shape, self.dtype, self.element)

    def transpose(self, *axes) -> "Absent":
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = axes or tuple(range(self.ndim))[::-1]
        return Absent([self.shape[a] for a in axes], self.dtype, self.element)

    @property
    def T(self) -> "Absent":
        return self.transpose()

    def astype(self, dtype, copy=True) -> "Absent":
        return Absent(self.shape, dtype)

    def _no_values(self, *args, **kwargs):
        raise SimulatorError(f"values of an absent array {list(self.shape)} were used in a timing-only launch: "
                             f"the kernel reads values outside its instructions' data work; declare the input "
                             f"it depends on as a steering input (run.kernel(steer=...)) or give the kernel "
                             f"values=True")

    __array__ = __setitem__ = __iter__ = __float__ = __int__ = __bool__ = fill = _no_values

    def __repr__(self) -> str:
        return f"Absent({list(self.shape)}, {self.dtype})"


class GMTensor:
    """A tensor in global memory (HBM), stored as float32 holding values of ``dtype``."""

    _ids = itertools.count()

    def __init__(self, data: np.ndarray, dtype: str, name: str, scratch: bool = False):
        self.id = next(GMTensor._ids)
        self.data = data
        self.dtype = dtype
        self.name = name
        self.scratch = scratch

    @property
    def shape(self):
        return self.data.shape


class Tile:
    """A buffer allocation on every core of a group: ``data[core, ...]`` plus per-core event times."""

    __slots__ = ("group", "buffer", "offset", "nbytes", "shape", "dtype", "_data", "ready", "busy_until", "name",
                 "consumed")

    def __init__(self, group, buffer, offset, nbytes, shape, dtype, name):
        n = group.n
        self.group, self.buffer, self.offset, self.nbytes = group, buffer, offset, nbytes
        self.shape, self.dtype, self.name = tuple(shape), dtype, name
        storage = np.bool_ if dtype == "bool" else (np.uint8 if dtype == "uint8" else np.float32)
        self._data = np.zeros((n, *shape), dtype=storage) if group.launch.values else Absent((n, *shape), storage)
        self.ready = np.zeros(n)          # when the last write to the tile completes
        self.busy_until = np.zeros(n)     # when the last read of the tile completes
        self.consumed = False             # values handed on by move(consume=True): unreadable until rewritten

    @property
    def data(self) -> np.ndarray:
        """The tile's values ``[core, *shape]`` (float32; bool and uint8 tiles hold their own type). On a value stream of a deferred launch,
        the array this stream's moves have handed to the tile (see :class:`_Streams`)."""
        arrays = getattr(_LOCAL, "arrays", None)
        if arrays is None:
            return self._data
        return arrays.get(self, self._data)

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value


class L2:
    """Shared LRU cache of GM regions. Returns (hit_bytes, miss_bytes, writeback_bytes) per access."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.lines: OrderedDict = OrderedDict()   # key -> [nbytes, dirty]

    def _make_room(self, nbytes: int) -> int:
        wb = 0
        while self.used + nbytes > self.capacity and self.lines:
            _, (size, dirty) = self.lines.popitem(last=False)
            self.used -= size
            wb += size if dirty else 0
        return wb

    def read(self, key, nbytes: int) -> tuple[int, int, int]:
        line = self.lines.get(key)
        if line is not None and line[0] >= nbytes:
            self.lines.move_to_end(key)
            return nbytes, 0, 0
        if line is not None:
            self.used -= line[0]
            del self.lines[key]
        wb = self._make_room(nbytes)
        if nbytes <= self.capacity:
            self.lines[key] = [nbytes, False]
            self.used += nbytes
        return 0, nbytes, wb

    def write(self, key, nbytes: int, dirty: bool) -> int:
        line = self.lines.pop(key, None)
        if line is not None:
            self.used -= line[0]
        wb = self._make_room(nbytes)
        if nbytes <= self.capacity:
            self.lines[key] = [nbytes, dirty]
            self.used += nbytes
        elif dirty:
            wb += nbytes
        return wb

    def invalidate(self, tensor_id: int) -> None:
        """Drop every line of a tensor that another agent (a peer's DMA over the link) has overwritten in HBM."""
        for key in [k for k in self.lines if k[0] == tensor_id]:
            size, _ = self.lines.pop(key)
            self.used -= size

    def dirty_bytes(self) -> int:
        return sum(size for size, dirty in self.lines.values() if dirty)


@dataclass
class Stats:
    """What a launch cost, as counted by the simulator.

    ``busy[unit]`` is the unit's busy cycles on the core where that unit is busiest; ``util[unit]`` is that
    over ``cycles``. ``busy_total[unit]`` sums all cores. ``bytes`` sums each data path over all cores.
    """

    cycles: int
    seconds: float
    bytes: dict
    hbm_bytes: int
    busy: dict
    util: dict
    busy_total: dict = field(default_factory=dict)
    cores: dict = field(default_factory=dict)
    launch_cycles: int = 0
    instructions: int = 0
    workspace_bytes: int = 0          # GM the kernel allocated besides its outputs (scratch, internal tensors)
    # the launch's phases, split at its SyncAlls (one phase without any): each one's end (cycles from the launch's
    # start, held to what HBM and L2 can move in it; no launch overhead) and the HBM bytes it moved (not counting
    # the lines still dirty at the end, which count toward ``hbm_bytes`` only)
    phases: tuple = ()

    @property
    def bound(self) -> str:
        """The busiest unit (ties broken by unit order)."""
        return max(ALL_UNITS, key=lambda u: self.util.get(u, 0.0))

    def __str__(self) -> str:
        top = ", ".join(f"{u} {self.util[u]:.0%}" for u in ALL_UNITS if self.util.get(u, 0) > 0.005)
        return (f"{self.cycles:,} cycles ({self.seconds * 1e6:,.1f} µs), HBM {self.hbm_bytes:,} B, "
                f"util: {top}")


class Group:
    """``n`` cores of one kind running one program in lockstep."""

    def __init__(self, launch: "Launch", kind: str, n: int):
        if kind not in _GROUP_UNITS:
            raise ValueError(f"unknown core kind {kind!r}")
        if n < 1:
            raise ValueError(f"a group needs at least one core, got {n}")
        self.launch, self.kind, self.n = launch, kind, n
        dev = launch.device
        self.units = _GROUP_UNITS[kind]
        self.capacity = {b: dev.buffers[b] for b in _GROUP_BUFFERS[kind]}
        self.used = {b: 0 for b in self.capacity}
        self.free = {u: np.zeros(n) for u in self.units}
        self.busy = {u: np.zeros(n) for u in self.units}
        self.port_free = np.zeros(n)            # end of the last reservation of the core's GM port
        # idle intervals before it that a later-issued but earlier-running transfer may use: [start|end, k, core]
        self.port_gap = np.zeros((2, PORT_GAPS, n))
        self.all = np.ones(n, dtype=bool)
        self._idx = np.arange(n)

    # ---------------------------------------------------------------- allocation
    def alloc(self, buffer: str, shape, dtype: str, name: str = "") -> Tile:
        """Allocate ``shape`` of ``dtype`` in ``buffer`` on every core (aligned; overflow is an error)."""
        if buffer not in self.capacity:
            raise SimulatorError(f"{self.kind} cores have no {buffer} (they have {', '.join(self.capacity)})")
        align = self.launch.device.align[buffer]
        nbytes = math.prod(shape) * itemsize(dtype)
        offset = -(-self.used[buffer] // align) * align
        if offset + nbytes > self.capacity[buffer]:
            free = max(0, self.capacity[buffer] - offset)
            raise CapacityError(
                f"{buffer} overflow on {self.launch.device.name} ({self.launch.name}): tile "
                f"{name or '?'} {list(shape)} {dtype} needs {nbytes:,} B, {buffer} has {free:,} B free "
                f"of {self.capacity[buffer]:,} B")
        self.used[buffer] = offset + nbytes
        return Tile(self, buffer, offset, nbytes, shape, dtype, name)

    # ---------------------------------------------------------------- timing core
    def _exec(self, unit, cycles, reads=(), writes=(), deps=(), active=None, name="", port=None):
        """Occupy ``unit`` for ``cycles`` (per core) after the instruction's inputs are ready."""
        if unit not in self.free:
            raise SimulatorError(f"{self.kind} cores have no {unit} unit")
        launch = self.launch
        launch.instructions += 1
        issue_cost = launch.device.scalar_issue_cycles
        sfree = self.free["scalar"]
        issue = sfree + issue_cost
        start = np.maximum(self.free[unit], issue)
        for t in reads:
            np.maximum(start, t.ready, out=start)
        for t in writes:
            np.maximum(start, t.busy_until, out=start)
            np.maximum(start, t.ready, out=start)
        for d in deps:
            np.maximum(start, d, out=start)
        end = start + cycles
        if port is not None:
            port_end, gap = self._reserve_port(start, port)
            np.maximum(end, port_end, out=end)
        if active is None or active.all():
            self.free["scalar"] = issue
            self.busy["scalar"] += issue_cost
            self.free[unit] = end
            self.busy[unit] += end - start
            if port is not None:
                self.port_free, self.port_gap = gap
            for t in reads:
                np.maximum(t.busy_until, end, out=t.busy_until)
            for t in writes:
                t.ready = end.copy()
            launch.events.append((self, unit, name, start, end, None))
        else:
            self.free["scalar"] = np.where(active, issue, sfree)
            self.busy["scalar"] += np.where(active, issue_cost, 0)
            self.free[unit] = np.where(active, end, self.free[unit])
            self.busy[unit] += np.where(active, end - start, 0.0)
            if port is not None:
                self.port_free = np.where(active, gap[0], self.port_free)
                self.port_gap = np.where(active, gap[1], self.port_gap)
            for t in reads:
                t.busy_until = np.where(active, np.maximum(t.busy_until, end), t.busy_until)
            for t in writes:
                t.ready = np.where(active, end, t.ready)
            launch.events.append((self, unit, name, start, end, active.copy()))
        return end

    def _reserve_port(self, start, cycles):
        """Book the core's GM port for ``cycles`` from ``start`` on, in time order, not issue order.

        Units run ahead of each other, so a transfer issued later may be ready earlier than ones already
        booked. It fills the remembered idle intervals of the port (the ``PORT_GAPS`` latest, kept in time
        order) from ``start`` on, in time order and in as many pieces as it takes, and queues what is left
        after the last booking: the port never idles while a transfer is waiting for it (a DMA engine
        interleaves its bursts with other transfers), and it carries one transfer at a time.
        """
        gs, ge = self.port_gap
        pf = self.port_free
        rem = np.asarray(cycles, dtype=float) + np.zeros_like(pf)
        end = np.array(start, dtype=float) + np.zeros_like(pf)
        if not (ge > np.maximum(start, gs)).any():
            # the common case, no idle interval after ``start``: queue after the last booking; a wait for
            # the data leaves [last end, start) as the newest interval (the oldest gives way)
            tail = rem > 0
            after = np.maximum(end, pf)
            end = np.where(tail, after + rem, end)
            new = tail & (after > pf)
            gap = self.port_gap
            if new.any():
                gap = gap.copy()
                gap[:, :-1, new] = gap[:, 1:, new]
                gap[0, -1, new] = pf[new]
                gap[1, -1, new] = after[new]
            return end, (np.where(tail, end, pf), gap)
        return self._reserve_port_pieces(start, rem, end)

    def _reserve_port_pieces(self, start, rem, end):
        """:meth:`_reserve_port` in general: fill the idle intervals in time order, then queue the rest."""
        gs, ge = self.port_gap
        K = gs.shape[0]
        pf = self.port_free
        rem = rem.copy()
        end = end.copy()
        # what is left of each interval: its part before the transfer and its part after
        cs = np.empty((2 * K + 1, self.n))
        ce = np.empty((2 * K + 1, self.n))
        for k in range(K):
            b = np.maximum(start, gs[k])
            take = np.minimum(np.maximum(ge[k] - b, 0.0), rem)
            used = take > 0
            rem = rem - take
            np.copyto(end, b + take, where=used)
            cs[2 * k] = gs[k]
            ce[2 * k] = np.where(used, b, ge[k])
            cs[2 * k + 1] = np.where(used, b + take, 0.0)
            ce[2 * k + 1] = np.where(used, ge[k], 0.0)
        tail = rem > 0
        after = np.maximum(start, pf)
        end = np.where(tail, after + rem, end)
        new_free = np.where(tail, end, pf)
        # a transfer queued after the last booking because it waited for its data leaves [last end, start)
        cs[2 * K] = pf
        ce[2 * K] = np.where(tail, np.maximum(start, pf), pf)
        # keep the K latest non-empty intervals, in time order (the candidates already are)
        gap = np.zeros((2, K, self.n))
        slot = np.full(self.n, K - 1)
        idx = self._idx
        for c in range(2 * K, -1, -1):
            keep = (ce[c] > cs[c]) & (slot >= 0)
            if keep.any():
                gap[0, slot[keep], idx[keep]] = cs[c][keep]
                gap[1, slot[keep], idx[keep]] = ce[c][keep]
                slot = slot - keep
        return end, (new_free, gap)

    # ---------------------------------------------------------------- GM transfers
    def load(self, dst: Tile, src: GMTensor, regions, active=None, deps=(), fn=None, name=None):
        """MTE2: copy ``src[regions[c]]`` into ``dst`` on each core ``c`` (``None``: core idle).

        The region lands in the top-left corner of the tile, the rest is zero-filled. ``fn`` transforms the
        region on the way (e.g. a transpose, as the hardware's ND→NZ load does at no extra cost).
        ``regions``: a list, or a tuple that the kernel passes again on later calls (its bookkeeping is then
        reused; it must not change).
        """
        if len(regions) != self.n:
            raise SimulatorError(f"load into {dst.name}: {len(regions)} regions for {self.n} cores")
        info = _regions(regions)
        if active is None and info.idle:
            active = info.present
        dst.consumed = False                  # written whole (zero-filled around the region)
        path = f"GM->{dst.buffer}"
        isz = itemsize(src.dtype)
        nbytes, port = self._gm_access(src, info, isz, write=False)
        if not self.launch.values:            # timing only: no data work
            pass
        elif (gather := self._gather(dst, src, info, fn)) is not None:
            self.launch._data(self.n, gather, math.prod(dst.shape) * self.n)
        else:
            def per_core(cs):
                for c in range(cs.start, cs.stop):
                    region = regions[c]
                    if region is None:
                        continue
                    block = src.data[region]
                    if fn is not None:
                        block = fn(block)
                    view = dst.data[c]
                    if block.shape != view.shape:
                        view.fill(0)
                        view[tuple(slice(0, e) for e in block.shape)] = block
                    else:
                        view[...] = block

            self.launch._data(self.n, per_core)
        self.launch.bytes[path] += sum(info.elems) * isz
        cycles = nbytes / self.launch.device.rates[path]
        return self._exec(_PATH_UNIT[path], cycles, writes=(dst,), deps=deps, active=active,
                          name=name or f"load {src.name}->{dst.name}", port=port)

    @staticmethod
    def _gather(dst: Tile, src: GMTensor, info: _Regions, fn):
        """``part(cores)`` copying those cores' regions in one gather (what the per-core loop does), or None
        when the regions do not allow it."""
        if info.extent is None or (fn is not None and fn is not np.transpose) or \
                src.data.dtype != (np.bool_ if dst.dtype == "bool" else np.float32) or not _contiguous(src.data):
            return None
        got = info.rows(src.data)
        if got is None:
            return None
        W, rows, _ = got
        ext = info.extent
        if fn is None:
            shape = ext
        elif len(ext) == 2:
            shape = ext[::-1]
        else:
            return None
        if len(shape) != len(dst.shape) or any(e > t for e, t in zip(shape, dst.shape)):
            return None
        flat = src.data.reshape(-1, W)
        whole = fn is None and shape == dst.shape
        corner = (slice(None), *(slice(0, e) for e in shape))

        def part(cs):
            dd = dst.data[cs]
            if whole:
                # rows are in bounds (checked), hence mode="clip": no bounds pass, no buffered copy
                np.take(flat, rows[cs], axis=0, out=dd, mode="clip")
                return
            block = np.take(flat, rows[cs], axis=0, mode="clip")
            if fn is not None:
                block = block.transpose(0, 2, 1)
            if shape == dst.shape:
                np.copyto(dd, block)
            else:
                dd.fill(0)
                dd[corner] = block

        return part

    def store(self, src: Tile, dst: GMTensor, regions, active=None, deps=(), fn=None, name=None):
        """MTE3 (UB→GM) or FixPipe (L0C→GM): write the tile's top-left corner to ``dst[regions[c]]``.

        Values are rounded to ``dst.dtype`` (FixPipe converts fp32 accumulators on the way out; the MTE3
        path moves bytes only, so a UB tile must already hold ``dst.dtype``). ``regions`` as for :meth:`load`.
        ``fn`` selects from each core's tile (e.g. a block of rows); the top-left corner of what it returns
        is written.
        """
        if len(regions) != self.n:
            raise SimulatorError(f"store from {src.name}: {len(regions)} regions for {self.n} cores")
        if src.buffer == "UB" and src.dtype != dst.dtype:
            raise SimulatorError(f"UB->GM moves bytes only: tile {src.name} is {src.dtype}, "
                                 f"{dst.name} is {dst.dtype}; cast on the Vector unit first")
        if src.consumed:
            _live((src,), f"store {src.name}")
        info = _regions(regions)
        if active is None and info.idle:
            active = info.present
        path = f"{src.buffer}->GM"
        if path not in _PATH_UNIT:
            raise SimulatorError(f"no data path {path}")
        isz = itemsize(dst.dtype)
        nbytes, port = self._gm_access(dst, info, isz, write=True)
        if not self.launch.values:            # timing only: no data work
            pass
        elif (scatter := self._scatter(src, dst, info, fn)) is not None:
            self.launch._data(self.n, scatter, math.prod(src.shape) * self.n)
        else:
            def in_order():                   # regions may overlap: the later core's write stays
                for c, region in enumerate(regions):
                    if region is None:
                        continue
                    block = src.data[c] if fn is None else fn(src.data[c])
                    block = block[tuple(slice(0, e) for e in _extent(region))]
                    dst.data[region] = to_dtype(block, dst.dtype) if dst.dtype != src.dtype else block

            self.launch._data(self.n, whole=in_order)
        self.launch.bytes[path] += sum(info.elems) * isz
        cycles = nbytes / self.launch.device.rates[path]
        return self._exec(_PATH_UNIT[path], cycles, reads=(src,), deps=deps, active=active,
                          name=name or f"store {src.name}->{dst.name}", port=port)

    @staticmethod
    def _scatter(src: Tile, dst: GMTensor, info: _Regions, fn):
        """``part(cores)`` writing those cores' regions in one scatter, or None (regions that overlap or do
        not allow it: the per-core loop)."""
        if info.extent is None or fn is not None or not _contiguous(dst.data):
            return None
        ext = info.extent
        if len(ext) != len(src.shape) or any(e > t for e, t in zip(ext, src.shape)):
            return None
        got = info.rows(dst.data)
        if got is None or not got[2]:
            return None
        W, rows, _ = got
        convert = dst.dtype != src.dtype
        out_type = to_dtype(np.zeros(1, np.bool_ if src.dtype == "bool" else np.float32), dst.dtype).dtype \
            if convert else (np.bool_ if src.dtype == "bool" else np.float32)
        if out_type != dst.data.dtype:
            return None
        flat = dst.data.reshape(-1, W)
        corner = (slice(None), *(slice(0, e) for e in ext))

        def part(cs):
            block = src.data[cs]
            if ext != src.shape:
                block = block[corner]
            if convert:
                block = to_dtype(block, dst.dtype)
            flat[rows[cs]] = block

        return part

    def _gm_access(self, t: GMTensor, info: _Regions, isz: int, write: bool):
        """Bytes per core, and per-core port cycles after the L2 lookup.

        The cores of a lockstep instruction draw on the chip's L2 and HBM bandwidth together: the unique
        bytes that miss (plus write-backs and write-throughs) take ``total / HBM bandwidth`` and every core
        that needs one of them waits that long; hits take ``total hits / L2 bandwidth``. With every core
        missing its own region this equals an even split of the bandwidth; when cores share a region, the
        first reader's miss fills the line for all of them, as an L2 does.
        """
        launch = self.launch
        n = self.n
        nbytes = [0] * n
        hits = [0] * n
        slow = [False] * n
        l2 = launch.l2
        lines = l2.lines
        keys, elems = info.keys, info.elems
        tid = t.id
        hbm_total = 0
        if write:
            scratch = t.scratch
            for c in info.cores:
                b = elems[c] * isz
                nbytes[c] = b
                wb = l2.write((tid, keys[c]), b, dirty=scratch)
                through = 0 if scratch else b
                launch.hbm_write += wb + through
                hbm_total += wb + through
                slow[c] = (wb + through) > 0
                hits[c] = b - through
        else:
            missed = set()
            for c in info.cores:
                b = elems[c] * isz
                nbytes[c] = b
                key = (tid, keys[c])
                line = lines.get(key)
                if line is not None and line[0] >= b:       # a hit (L2.read's first case)
                    lines.move_to_end(key)
                    hits[c] = b
                    slow[c] = key in missed
                    continue
                hit, miss, wb = l2.read(key, b)
                launch.hbm_read += miss
                launch.hbm_write += wb
                hbm_total += miss + wb
                if miss:
                    missed.add(key)
                slow[c] = miss > 0 or wb > 0 or key in missed
                hits[c] = hit
        hits = np.array(hits, dtype=float)
        t_hit = hits.sum() / launch.device.l2_bytes_per_cycle
        t_hbm = hbm_total / launch.device.hbm_bytes_per_cycle
        port = np.where(hits > 0, t_hit, 0.0) + np.where(slow, t_hbm, 0.0)
        return np.array(nbytes, dtype=float), port

    # ---------------------------------------------------------------- on-chip moves and compute
    def move(self, dst: Tile, src: Tile, fn=None, nbytes=None, active=None, deps=(), name=None, consume=False,
             fn_cores=False):
        """On-chip copy along ``src.buffer -> dst.buffer`` (MTE1, or FixPipe out of L0C).

        ``fn(src_data) -> dst_data`` (batched over cores, each core's slice on its own: it may be given a
        slice of the cores) selects/transposes the part moved; values are rounded
        to ``dst.dtype`` (L0C→UB may convert fp32 to fp16/bf16). ``fn_cores=True``: ``fn(src_data, cores)`` is
        also told which slice of the cores it is given (a move that picks different elements on each core, as
        load3d's img2col does). ``nbytes`` per core defaults to the data moved.

        ``consume=True``: the program will not read ``src`` again before rewriting it whole (the next load,
        move or mmad into it). The simulator may then hand ``src``'s array to ``dst`` instead of copying it
        (same shape and type, no ``fn``); timing and counts are those of the copy. Reading ``src`` before
        rewriting it raises :class:`SimulatorError`.
        """
        path = f"{src.buffer}->{dst.buffer}"
        if path not in _PATH_UNIT or path.startswith("GM") or path.endswith("GM"):
            raise SimulatorError(f"no on-chip data path {path} (tiles {src.name} -> {dst.name})")
        if src.consumed:
            _live((src,), f"move {path}")
        if consume and fn is None and src is not dst and dst.dtype == src.dtype and dst.shape == src.shape:
            # tiles keep arrays of their own shape and storage type: exchange them
            streams = self.launch.streams
            if streams is None:
                src.data, dst.data = dst.data, src.data
            else:
                def swap(cs):                 # on this stream's map (every stream does it, whatever its cores)
                    arrays = _LOCAL.arrays
                    a, b = arrays.get(src, src._data), arrays.get(dst, dst._data)
                    arrays[src], arrays[dst] = b, a

                streams.submit((_EVERY, swap))
        else:
            def copy(cs):
                data = src.data[cs]
                if fn is not None:
                    data = fn(data, cs) if fn_cores else fn(data)
                if dst.dtype != src.dtype:
                    data = to_dtype(data, dst.dtype)
                dd = dst.data[cs]
                if data.shape == dd.shape:
                    dd[...] = data
                else:
                    dd.fill(0)
                    dd[(slice(None), *(slice(0, e) for e in data.shape[1:]))] = data

            self.launch._data(self.n, copy, math.prod(dst.shape) * self.n)
        dst.consumed = False
        if nbytes is None:
            shape = src.data.shape if fn is None else \
                (fn(src.data, slice(0, self.n)) if fn_cores else fn(src.data)).shape     # shapes only: values may be pending
            nbytes = math.prod(shape[1:]) * itemsize(src.dtype)
        total = nbytes * (self.n if np.isscalar(nbytes) else 1)
        self.launch.bytes[path] += int(np.sum(total) if active is None else np.sum(np.where(active, nbytes, 0)))
        cycles = np.asarray(nbytes, dtype=float) / self.launch.device.rates[path]
        end = self._exec(_PATH_UNIT[path], cycles, reads=(src,), writes=(dst,), deps=deps, active=active,
                         name=name or f"{path} {dst.name}")
        if consume:
            src.consumed = True
        return end

    def mmad(self, c: Tile, a: Tile, b: Tile, m, k, n, accumulate: bool, init=None, active=None, deps=(),
             name="mmad"):
        """Cube: ``c[:, :m, :n] (+)= a[:, :m, :k] @ b[:, :k, :n]`` in fp32; fp16/bf16/fp32 operands.

        Cycles = ceil(m/16)·ceil(k/k0)·ceil(n/16): one 16×k0×16 fractal per cycle. ``m, k, n`` may be
        per-core arrays (edge tiles). Tiles are zero-padded, so the product over whole tiles is exact.
        ``init`` (broadcastable to ``c``) seeds the accumulator, as a bias table does.
        """
        if (a.buffer, b.buffer, c.buffer) != ("L0A", "L0B", "L0C"):
            raise SimulatorError(f"mmad reads L0A x L0B into L0C, got {a.buffer} x {b.buffer} -> {c.buffer}")
        if a.dtype != b.dtype:
            raise SimulatorError(f"mmad operands differ in dtype: {a.dtype} vs {b.dtype}")
        if a.consumed or b.consumed or (accumulate and c.consumed):
            _live((a, b, c) if accumulate else (a, b), name)
        c.consumed = False                    # written whole (tiles are zero-padded)
        dev = self.launch.device
        k0 = dev.cube_k0[a.dtype]
        if init is not None and not accumulate and self.launch.values:
            init = np.broadcast_to(init, c.data.shape)
        macs = math.prod(a.shape) * b.shape[-1] if len(a.shape) == 2 else 0      # per core

        def product(cs):
            ad, bd, cd = a.data[cs], b.data[cs], c.data[cs]
            with np.errstate(all="ignore"):             # fp32 overflow to inf, as the Cube's IEEE arithmetic
                if accumulate:
                    cd += np.matmul(ad, bd)
                elif init is not None:
                    np.add(np.matmul(ad, bd), init[cs], out=cd)
                else:
                    np.matmul(ad, bd, out=cd)

        # GEMMs split over host threads only while BLAS runs single-threaded (host_blas)
        self.launch._data(self.n, product, macs * self.n if _blas_split else 0)
        cycles = (-(-np.asarray(m) // 16)) * (-(-np.asarray(k) // k0)) * (-(-np.asarray(n) // 16))
        return self._exec("cube", cycles.astype(float), reads=(a, b, c) if accumulate else (a, b),
                          writes=(c,), deps=deps, active=active, name=name)

    def vector(self, name: str, writes, reads, repeats, compute=None, active=None, deps=(), per_core=False):
        """Vector: ``repeats`` passes of 256 B (per core, scalar or array); ``compute()`` does the numerics.

        ``per_core=True``: ``compute(cores)`` computes the slice ``cores`` of the core axis alone (the
        simulator may split the cores over host threads, and a deferred launch runs it per stream).
        """
        _live(reads, f"vector {name}")
        _live(writes, f"vector {name}")
        if compute is not None:
            if per_core:
                self.launch._data(self.n, compute, sum(math.prod(t.shape) for t in writes) * self.n)
            else:
                self.launch._data(self.n, whole=compute)
        cycles = np.asarray(repeats, dtype=float)
        return self._exec("vector", cycles, reads=reads, writes=writes, deps=deps, active=active, name=name)

    def repeats(self, elements, dtype: str):
        """Vector repeats to sweep ``elements`` contiguous values of ``dtype`` once."""
        per = self.launch.device.vector_bytes_per_cycle // itemsize(dtype)
        return -(-np.asarray(elements) // per)

    def row_repeats(self, rows, cols, dtype: str):
        """Vector repeats for a per-row operation on ``rows`` rows of ``cols`` values (a reduction)."""
        return np.asarray(rows) * self.repeats(cols, dtype)

    def end_time(self) -> np.ndarray:
        return np.max(np.stack([self.free[u] for u in self.units]), axis=0)


class Launch:
    """One kernel launch on one device: its L2, its groups of cores, its counters.

    ``values=False`` makes a *timing-only* launch: every instruction is issued, booked and counted exactly as
    in a full launch (units, GM port, L2 lookups, bytes per path, busy cycles, trace events), but its data work
    (:meth:`_data`: copies, GEMMs, Vector ``compute``) is not run, and tiles, outputs and inputs the caller
    makes with :meth:`placeholder` hold :class:`Absent` values (a shape, no memory). Inputs whose values steer
    the program (group sizes, token routing, gather indices) are made with :meth:`tensor` as usual.
    """

    def __init__(self, device: Device, name: str, values: bool = True):
        self.device = device
        self.name = name
        self.values = values
        self.groups: list[Group] = []
        self.l2 = L2(device.l2_bytes)
        self.bytes = defaultdict(int)
        self.hbm_read = 0
        self.hbm_write = 0
        self.instructions = 0
        self.allocated = []                # (GM tensor, bytes) of every launch.empty
        self.events: list = []
        self.overheads: list = []          # (start, end) cycles of the overheads of launches run inside this one
        self.streams: _Streams | None = None
        self._phase = (0.0, 0, 0)          # the last SyncAll: (its time, HBM bytes and GM bytes moved by then)
        self._phases: list[tuple[int, int]] = []      # the phases closed so far (Stats.phases)

    # ---------------------------------------------------------------- deferred values
    def defer(self) -> None:
        """Compute the values of the instructions issued from now on behind the timeline, on host threads
        (see :class:`_Streams`); :meth:`sync` (and :meth:`finish`) waits for them.

        For a program whose data flows stay within each core (and from AIC c to AIVs 2c, 2c+1 and back)
        except across :meth:`barrier`, whose host code reads tile and GM values only inside instruction
        callbacks, which look tile arrays up when they run (``tile.data``), and whose ``move`` ``fn`` and
        per-core ``compute`` act on each core's slice alone.
        """
        if self.streams is None and self.values:
            self.streams = _Streams(_host_threads(), min((g.n for g in self.groups), default=0))

    def barrier(self) -> None:
        """Values issued after this point may depend on values any core computed before it."""
        if self.streams is not None:
            self.streams.submit((None, lambda: None))

    def sync_all(self) -> float:
        """Every core of every group waits for every other (CANN's SyncAll); returns the time the barrier
        opens, after which values may depend on any core's (:meth:`barrier`).

        That time is the latest core's end, and no earlier than the chip can move the bytes issued since the
        last SyncAll through HBM and through L2. Within a phase the timelines share the GM port per lockstep
        instruction only (overlapping instructions of different units each get the whole bandwidth), so a
        phase could otherwise move its bytes faster than the chip allows; the barrier holds each phase to the
        chip's bandwidths as :meth:`finish` holds the last phase and the whole launch."""
        self.barrier()
        self._close_phase()
        return self._phase[0]

    def _close_phase(self) -> None:
        # the phase since the last SyncAll ends: record (its end, the HBM bytes it moved) and start the next
        hbm = self.hbm_read + self.hbm_write
        end = self._port_floor(self._core_end())
        self._phases.append((int(math.ceil(end)), int(hbm - self._phase[1])))
        self._phase = (end, hbm, self._gm_bytes())

    def elapsed(self) -> float:
        """Cycles from the launch's start to its end, without the launch overhead: its latest core, its last phase
        (since the last SyncAll) held to the chip's HBM and L2 bandwidths, and the whole launch held to them. What
        is still dirty in L2 (outputs, workspace) is written back at the end but may drain while any phase runs:
        it counts in the whole launch's HBM bytes, not the last phase's. Every GM transfer passes through L2: the
        chip cannot move more than its L2 bandwidth, whatever the overlap of the cores' instructions (each
        instruction shares it only among its own cores), nor more than its HBM bandwidth."""
        dev = self.device
        hbm = self.hbm_read + self.hbm_write + self.l2.dirty_bytes()
        return max(self._port_floor(self._core_end()), hbm / dev.hbm_bytes_per_cycle,
                   self._gm_bytes() / dev.l2_bytes_per_cycle)

    def _core_end(self) -> float:
        """The latest time any unit of any core is busy until."""
        return max((float(g.end_time().max()) for g in self.groups), default=0.0)

    def _gm_bytes(self) -> int:
        """Bytes moved on every path to or from GM so far: each passes through L2."""
        return sum(b for path, b in self.bytes.items() if "GM" in path)

    def _port_floor(self, t: float) -> float:
        """``t``, or the earliest time HBM and L2 can have moved the bytes issued since the last SyncAll."""
        dev = self.device
        t0, hbm0, gm0 = self._phase
        return max(t, t0 + (self.hbm_read + self.hbm_write - hbm0) / dev.hbm_bytes_per_cycle,
                   t0 + (self._gm_bytes() - gm0) / dev.l2_bytes_per_cycle)

    def _data(self, n: int, part=None, size: int = 0, whole=None) -> None:
        """The data work of an instruction: ``part(cores)`` for a slice of the ``n`` cores (split over host
        threads when ``size`` elements make it pay), or ``whole()``; now, or queued (deferred launch); never
        in a timing-only launch."""
        if not self.values:
            return
        streams = self.streams
        if streams is None:
            if whole is not None:
                whole()
            elif size >= SPLIT_MIN:
                split_cores(part, n, size)
            else:
                part(slice(0, n))
        elif whole is not None:
            streams.submit((None, whole))
        else:
            streams.submit((n, part))

    def sync(self) -> None:
        """Wait for every deferred value (no-op unless deferred); raises what failed there."""
        streams, self.streams = self.streams, None
        if streams is not None:
            streams.sync()

    close = sync

    def group(self, kind: str, n: int) -> Group:
        """``n`` cores of ``kind`` ("core" coupled, "aic"/"aiv" split; "aiv" also means vector-only cores;
        "link": lanes of the link unit, one per port, see :mod:`autofuse.npu.link`)."""
        if kind == "link":
            from cost_model.devices import get_links
            limit = get_links(self.device).lanes
        else:
            limit = {"core": self.device.cube_cores if self.device.arch == "coupled" else 0,
                     "aic": self.device.cube_cores if self.device.arch == "split" else 0,
                     "aiv": self.device.vector_cores}[kind]
        if n > limit:
            raise SimulatorError(f"{self.device.name} has {limit} cores of kind {kind!r}, asked for {n}")
        g = Group(self, kind, n)
        self.groups.append(g)
        return g

    def tensor(self, data: np.ndarray, dtype: str, name: str, scratch: bool = False) -> GMTensor:
        if dtype == "float16" and getattr(data, "dtype", None) == np.float16:
            # already fp16 values: exact in float32, no re-rounding (cast in pieces on the host threads)
            src = np.ascontiguousarray(data).reshape(-1)
            flat = np.empty(src.size, dtype=np.float32)
            _POOL.map(lambda p: np.copyto(flat[p], src[p]), core_parts(src.size, src.size, parts=8))
            data = flat.reshape(np.shape(data))
        elif dtype in ("float16", "bfloat16", "float32"):
            data = to_dtype(np.asarray(data, dtype=np.float32), dtype)
        else:                                  # integers and bools keep their exact values
            data = np.asarray(data, dtype=STORAGE[dtype])
        return GMTensor(data, dtype, name, scratch)

    def placeholder(self, shape, dtype: str, name: str) -> GMTensor:
        """An input of a timing-only launch whose values the program never reads: its shape and type only."""
        return GMTensor(Absent(shape, STORAGE[dtype]), dtype, name)

    def zeros(self, shape, storage=np.float32):
        """Zero-filled storage of ``shape`` for a GM tensor the kernel writes; :class:`Absent` in a timing-only
        launch."""
        return np.zeros(shape, dtype=storage) if self.values else Absent(shape, storage)

    def empty(self, shape, dtype: str, name: str, scratch: bool = False) -> GMTensor:
        """A float GM tensor the kernel writes (an output or a workspace), counted as allocated."""
        t = GMTensor(self.zeros(tuple(shape)), dtype, name, scratch)
        self.allocated.append((t, math.prod(t.shape) * itemsize(dtype)))
        return t

    def finish(self) -> Stats:
        self.sync()
        dev = self.device
        body = self.elapsed()
        self._close_phase()                                # the last phase (SyncAll to the end)
        self.hbm_write += self.l2.dirty_bytes()          # written back at the end
        hbm = self.hbm_read + self.hbm_write
        cycles = int(math.ceil(body)) + dev.launch_cycles
        busy, busy_total, cores = {}, {}, {}
        for g in self.groups:
            cores[g.kind] = g.n
            for u in g.units:
                busy[u] = max(busy.get(u, 0.0), float(g.busy[u].max()))
                busy_total[u] = busy_total.get(u, 0.0) + float(g.busy[u].sum())
        units = ALL_UNITS if LINK_UNIT in busy else UNITS
        busy = {u: int(round(busy.get(u, 0.0))) for u in units}
        busy_total = {u: int(round(busy_total.get(u, 0.0))) for u in units}
        util = {u: busy[u] / cycles for u in units}
        return Stats(cycles=cycles, seconds=cycles / dev.clock_hz, bytes=dict(self.bytes), hbm_bytes=int(hbm),
                     busy=busy, util=util, busy_total=busy_total, cores=cores, launch_cycles=dev.launch_cycles,
                     instructions=self.instructions, phases=tuple(self._phases))
