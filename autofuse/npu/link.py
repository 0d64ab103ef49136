"""The link unit of one simulated NPU, and the other ranks it talks to.

Each rank of a distributed run simulates its own chip. A kernel that communicates opens :class:`Links` on
its launch: a group of kind ``"link"`` whose lanes are the chip's ports (``cost_model.links``: one HCCS
port per peer of a full mesh, one shared PCIe port, one RoCE port to other domains and servers). A send
occupies the lane to that peer for ``bytes / bandwidth`` once its data is ready and the lane is free; the
data lands ``latency`` later. Compute (Cube, Vector, MTEs) runs on the cores' own timelines, so a kernel
overlaps communication with compute exactly where its program lets it.

What the peers send comes from a :class:`Comm`:

* :class:`GlooComm` — the real ranks of a ``torch.distributed`` process group (gloo, one process per rank):
  the payload and the time it lands (on the sender's timeline) travel through gloo point-to-point
  messages, so every value is the real exchange's and a slow rank delays the ranks waiting for it.
* :class:`ThreadWorld` — ``world`` ranks in threads of one process (for tests without torch.distributed).
* :class:`SymmetricComm` — one process standing for a rank-symmetric world (every rank runs the same
  program on data of the same shapes), for timing without values: a peer's transfer is timed on a mirror of
  the peer's lane to this rank (its data ready when this rank's own data of the same step is) and its
  payload is a stand-in (what this rank sent in the same exchange, else zeros). Times are exact for
  symmetric worlds on symmetric wiring; on a ring whose ports differ (two 4-NPU groups joined by RoCE) it
  simulates the rank behind the slowest incoming port. Values are not the collective's.

Ranks of a communicator are numbered as the chips are wired (server by server, domain by domain):
rank ``r`` of the group sits at position ``r`` of the link profile. Link transfers read and write HBM
directly (counted as HBM bytes, paths ``HBM->link`` and ``link->HBM``; not as L2 traffic) [A].
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from autofuse.groups import resolve_group
from cost_model.devices import get_links


@dataclass
class Transfer:
    """One send as booked on this rank's link unit (cycles on this rank's timeline)."""

    what: str
    peer: int
    nbytes: int
    start: float
    end: float                 # the lane is free again
    arrival: float             # the data has landed at the peer


class Links:
    """The link unit of one rank in one launch: lanes, sends, and the exchange with the peers."""

    def __init__(self, launch, comm: "Comm"):
        self.launch, self.comm = launch, comm
        self.profile = get_links(launch.device)
        if comm.world > 1 and comm.world > self.profile.node * 4096:
            raise ValueError(f"world size {comm.world} is beyond what the link model describes")
        self.group = launch.group("link", self.profile.lanes)
        clock = launch.device.clock_hz
        ports = self.profile.lane_ports()
        self.rate = np.array([p.bytes_per_s / clock for p in ports])        # bytes per cycle
        self.latency = np.array([p.latency_s * clock for p in ports])       # cycles
        self.transfers: list[Transfer] = []
        self.mirror_free: dict = {}          # SymmetricComm: when each peer's lane to us is free
        self._masks = [np.arange(self.profile.lanes) == i for i in range(self.profile.lanes)]

    @property
    def rank(self) -> int:
        return self.comm.rank

    def lane_cost(self, src: int, dst: int, nbytes: float) -> tuple[float, float]:
        """(occupancy, latency) in cycles of ``nbytes`` from rank ``src`` to rank ``dst``."""
        lane = self.profile.lane(src, dst)
        return nbytes / self.rate[lane], float(self.latency[lane])

    def send(self, peer: int, payload: np.ndarray, nbytes: int, ready: float, what: str):
        """Book a send of ``nbytes`` to ``peer`` once ``ready``; returns the message for :meth:`exchange`."""
        lane = self.profile.lane(self.rank, peer)
        cycles = np.zeros(self.profile.lanes)
        cycles[lane] = nbytes / self.rate[lane]
        end = self.group._exec("link", cycles, deps=(float(ready),), active=self._masks[lane],
                               name=f"{what} -> rank {peer}")
        end = float(end[lane])
        arrival = end + float(self.latency[lane])
        self.transfers.append(Transfer(what, peer, int(nbytes), end - float(cycles[lane]), end, arrival))
        launch = self.launch
        launch.bytes["HBM->link"] += int(nbytes)
        launch.hbm_read += int(nbytes)
        return Message(peer, payload, float(ready), arrival)

    def exchange(self, sends: list, recvs: list) -> list:
        """Hand this step's messages to the peers and take theirs: ``recvs`` is ``[(peer, shape, nbytes)]``;
        returns ``[(payload, arrival)]`` in that order. The payloads land in HBM (counted here)."""
        got = self.comm.exchange(self, sends, recvs)
        for _, _, nbytes in recvs:
            self.launch.bytes["link->HBM"] += int(nbytes)
            self.launch.hbm_write += int(nbytes)
        return got

    def summary(self) -> dict:
        """Bytes sent, link-busy cycles of the busiest lane and the span from first send to last arrival."""
        if not self.transfers:
            return {"bytes": 0, "busy": 0.0, "first": 0.0, "last": 0.0}
        return {"bytes": sum(t.nbytes for t in self.transfers),
                "busy": float(self.group.busy["link"].max()),
                "first": min(t.start for t in self.transfers),
                "last": max(t.arrival for t in self.transfers)}


@dataclass
class Message:
    peer: int
    payload: np.ndarray
    ready: float
    arrival: float


class Comm:
    """The other ranks, as a kernel sees them: ``rank``, ``world`` and :meth:`exchange`."""

    rank: int = 0
    world: int = 1

    def exchange(self, links: Links, sends: list, recvs: list) -> list:  # pragma: no cover - interface
        raise NotImplementedError


class SymmetricComm(Comm):
    """A rank-symmetric world simulated on one process (timing only; see the module docstring)."""

    def __init__(self, world: int, rank: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        self.world, self.rank = world, rank

    def exchange(self, links, sends, recvs):
        ready = max((m.ready for m in sends), default=0.0)
        out = []
        for peer, shape, nbytes in recvs:
            occ, lat = links.lane_cost(peer, self.rank, nbytes)
            start = max(ready, links.mirror_free.get(peer, 0.0))
            links.mirror_free[peer] = start + occ
            like = next((m.payload for m in sends if m.payload.shape == tuple(shape)), None)
            payload = like.copy() if like is not None else np.zeros(shape, dtype=np.float32)
            out.append((payload, start + occ + lat))
        return out


class ThreadWorld:
    """``world`` ranks running in threads of one process; ``comm(r)`` is rank r's :class:`Comm`."""

    def __init__(self, world: int, timeout: float = 120.0):
        self.world, self.timeout = world, timeout
        self.cv = threading.Condition()
        self.box: dict = {}
        self.sent: dict = {}
        self.taken: dict = {}

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)


class ThreadComm(Comm):
    def __init__(self, world: ThreadWorld, rank: int):
        self.w, self.rank, self.world = world, rank, world.world

    def exchange(self, links, sends, recvs):
        w = self.w
        with w.cv:
            for m in sends:
                k = w.sent.get((self.rank, m.peer), 0)
                w.sent[(self.rank, m.peer)] = k + 1
                w.box[(self.rank, m.peer, k)] = (np.array(m.payload, dtype=np.float32, copy=True), m.arrival)
            w.cv.notify_all()
            out = []
            for peer, shape, _ in recvs:
                k = w.taken.get((peer, self.rank), 0)
                w.taken[(peer, self.rank)] = k + 1
                key = (peer, self.rank, k)
                if not w.cv.wait_for(lambda: key in w.box, timeout=w.timeout):
                    raise TimeoutError(f"rank {self.rank} waited {w.timeout:.0f} s for message {k} from rank {peer}")
                payload, arrival = w.box.pop(key)
                out.append((payload.reshape(shape), arrival))
        return out


class GlooComm(Comm):
    """The ranks of a torch.distributed process group (default: the world), exchanged with gloo P2P."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def _global(self, r: int) -> int:
        return r if self.group is None else self.dist.get_global_rank(self.group, r)

    def exchange(self, links, sends, recvs):
        import torch
        dist = self.dist
        ops, bufs, k_send, k_recv = [], [], {}, {}
        for m in sends:
            k = k_send.get(m.peer, 0)
            k_send[m.peer] = k + 1
            data = torch.from_numpy(np.ascontiguousarray(m.payload, dtype=np.float32))
            t = torch.tensor([m.arrival], dtype=torch.float64)
            g = self._global(m.peer)
            ops += [dist.P2POp(dist.isend, data, g, self.group, tag=2 * k),
                    dist.P2POp(dist.isend, t, g, self.group, tag=2 * k + 1)]
        for peer, shape, _ in recvs:
            k = k_recv.get(peer, 0)
            k_recv[peer] = k + 1
            data = torch.empty(tuple(shape), dtype=torch.float32)
            t = torch.empty(1, dtype=torch.float64)
            g = self._global(peer)
            ops += [dist.P2POp(dist.irecv, data, g, self.group, tag=2 * k),
                    dist.P2POp(dist.irecv, t, g, self.group, tag=2 * k + 1)]
            bufs.append((data, t))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return [(d.numpy(), float(t.item())) for d, t in bufs]


def make_comm(comm=None, world: int | None = None, rank: int = 0) -> Comm:
    """A Comm from what a caller has: a Comm as is; ``"gloo"`` (the default group), a process group or a
    group's name for the real ranks; otherwise a :class:`SymmetricComm` of ``world`` ranks (default 1)."""
    if isinstance(comm, Comm):
        return comm
    if comm == "gloo":
        return GlooComm()
    if isinstance(comm, str):
        group = resolve_group(comm)
        if group is None:
            raise ValueError(f"process group {comm!r} cannot be resolved in this process: initialise "
                             f"torch.distributed on every rank, or pass world= for a rank-symmetric stand-in")
        return GlooComm(group)
    if comm is not None:
        return GlooComm(comm)
    return SymmetricComm(world or 1, rank)


__all__ = ["Comm", "GlooComm", "Links", "SymmetricComm", "ThreadComm", "ThreadWorld", "Transfer", "make_comm"]
