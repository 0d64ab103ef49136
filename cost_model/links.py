"""Links between NPUs: each device profile's ports and server topology, and the collective algorithms.

A rank reaches a peer through one *port* (a lane of the simulator's link unit):

* inside one **mesh domain** (NPUs wired to each other directly), one port per peer when the domain is a
  full mesh (HCCS), or one shared port when every peer sits behind the same bus (PCIe);
* outside it (another 4-NPU group of a first-generation server, or another server), the NPU's own RoCE port.

A transfer of ``b`` bytes occupies its port for ``b / bandwidth`` and its data lands ``latency`` later
(the flight and the completion flag: the port carries the next transfer meanwhile). Figures are per
direction; ports are full duplex, and every algorithm here receives as many bytes per port and step as it
sends, so the sending side is the one that limits.

Sources (tags as in ``cost_model/devices.py``: [D] derived, [A] assumption):

* Ascend 910B2 server (Atlas 800T A2): 8 NPUs, a full mesh over HCCS, 56 GB/s per link, 7 links = 392 GB/s
  per chip (Huawei's published figures for the 910B2/Atlas 800T A2, as collected in the project's hardware
  notes). Each NPU has its own network port in the server: the deployment guide configures "the 8 NPU
  ports of each training node" in one subnet
  (https://www.hiascend.com/document/detail/zh/mindcluster/730/deployer/deployerug/deployer_0025.html).
  Its speed: no published figure was found in our sources; we take 200 Gb/s = 25 GB/s [A] (the 200GE ports
  these servers are usually quoted with). The measured MoE anchor of the sgl-kernel-npu README (dispatch
  bottleneck 87 GB/s across nodes at EP 16) counts HCCS and RoCE traffic together and cannot pin it.
* Ascend 910 (first generation), Atlas 800 training server (model 9000): "3x 240Gbps HCCS ports" and
  "RoCE v2 (2x100Gbps)" per chip (Hot Chips 31 slides, as summarised at
  https://vengineer.hatenablog.com/entry/2019/09/06/070000 from AnandTech's coverage). Three HCCS ports
  make a full mesh of 4 NPUs: 30 GB/s per link [D: 240 Gb/s / 8]. The 8-NPU server is two such 4-NPU
  groups: the deployment guide pairs NPU0/NPU4, NPU1/NPU5, ... in "4 IP segments" for the model 9000
  (deployer_0025 above). Traffic between the groups and between servers goes over the NPU's 100 GbE RoCE
  port: 12.5 GB/s [D: one 100 Gb/s port; the Atlas 300T card doc names "the 100G ETH ports provided by each
  training card" for inter-server traffic,
  https://support.huawei.com/enterprise/en/doc/EDOC1100164821/e0f5fa7c/atlas-300t-training-card-model-9000].
  That the cross-group path within a server is RoCE rather than PCIe through the host is our choice [A].
* Ascend 310P (Atlas 300I Duo): no chip-to-chip link; the card attaches by "PCI Express x16 4.0"
  (https://www.elektronikpraxis.de/huawei-zeigt-mit-der-atlas-300i-duo-dass-der-weg-zur-unabhaengigkeit-von-nvidia-begonnen-hat-a-deb1ef4fcfe19c3dc4d27c214cd519d1
  and https://3dnews.ru/1131049/uskoritel-huawei-atlas-300i-duo-osnashchaetsya-paroy-iichipov-ascend-310):
  31.5 GB/s per direction [D: 16 GT/s x 16 lanes x 128/130 / 8], shared by every peer (one port). 8 chips
  per server (four Duo cards) [A]; across servers the host's 100 GbE NIC, 12.5 GB/s [A].
* Per-transfer latency: no published figure for HCCL; we assume 2 µs for an HCCS or PCIe transfer and
  5 µs for RoCE [A] (the order of the per-hop latencies NCCL's own tuning model uses for NVLink/PCIe and
  network hops).

Collective algorithms (per rank, ``n`` bytes of payload per rank, ``p`` ranks; npu-facts for ring):

==================  =====================  ==================================  ======================================
algorithm           collective             steps                               bytes each rank sends
==================  =====================  ==================================  ======================================
ring                all_reduce             2(p-1)                              2(p-1)/p · n
ring                reduce_scatter         p-1                                 (p-1)/p · n   (n = the whole input)
ring                all_gather             p-1                                 (p-1)/p · n   (n = the whole output)
mesh (one-shot)     reduce_scatter         1 (p-1 ports at once)               (p-1)/p · n, n/p per port
mesh                all_gather             1                                   (p-1)/p · n, n/p per port
mesh                all_reduce             2 (reduce-scatter + all-gather)     2(p-1)/p · n
oneshot             all_reduce             1 (every port at once; each rank    (p-1) · n, n per port
                                           adds the p-1 buffers it receives)
pairwise            all_to_all             p-1 (one peer per step), or 1 on    (p-1)/p · n
                                           a full mesh (every port at once)
hierarchical        all_reduce             mesh RS in the node, ring AR        2(L-1)/L · n in the node, then
(L per node,                               across the N nodes on n/L,          2(N-1)/N · n/L across nodes
 N nodes)                                  mesh AG in the node
==================  =====================  ==================================  ======================================

Each reducing step adds what it received into the rank's partial on the Vector unit (the simulator runs
that; the closed forms below count only the links).

Small all-reduces inside a full mesh go one-shot: HCCL's all-reduce selector for the 910B mesh
(``AllReduceOperator::SelectAlgfor910B`` in CANN's open-source HCCL, ``all_reduce_operator.cc``) switches to
its small-count executor at 256 KB and below, whose non-deterministic template (``AllReduceReduceBcast``)
has every rank reduce the whole buffer from every peer in one step. We switch where the one-shot's single
latency beats the two-shot's two on this profile's links: one-shot sends ``n`` per port against ``2n/p``, so
it is faster while ``n·(p-2)/p / bandwidth < latency`` (below 149 KB per rank on the 910B2's HCCS at 8
ranks [D: 2 µs [A] × 56 GB/s × 8/6]; always at 2 ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

GB = 1e9


@dataclass(frozen=True)
class Port:
    """One kind of port: bandwidth per direction (bytes/s) and the latency until a transfer's data lands."""

    kind: str                  # "hccs", "roce", "pcie"
    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class LinkProfile:
    """How the NPUs of one device type are wired (see the module docstring for the sources).

    ``mesh`` NPUs form one domain reached through ``intra`` ports: one port per peer when ``full_mesh``,
    else one shared port. Domains and servers (``node`` NPUs each) reach each other through one ``inter``
    port per NPU. Lanes of the simulator's link unit: the intra ports first, the inter port last.
    """

    device: str
    node: int                  # NPUs per server
    mesh: int                  # NPUs per directly wired domain (<= node)
    full_mesh: bool
    intra: Port
    inter: Port
    notes: tuple = field(default=())

    @property
    def intra_lanes(self) -> int:
        return self.mesh - 1 if self.full_mesh else 1

    @property
    def lanes(self) -> int:
        return self.intra_lanes + 1

    def domain(self, rank: int) -> int:
        return rank // self.mesh

    def lane(self, rank: int, peer: int) -> int:
        """The lane ``rank`` sends to ``peer`` on (ranks are numbered server by server, domain by domain)."""
        if rank == peer:
            raise ValueError(f"rank {rank} sends to itself: no link carries that")
        if self.domain(rank) != self.domain(peer):
            return self.intra_lanes
        if not self.full_mesh:
            return 0
        q = peer % self.mesh
        return q if q < rank % self.mesh else q - 1

    def port(self, rank: int, peer: int) -> Port:
        return self.inter if self.lane(rank, peer) == self.intra_lanes else self.intra

    def lane_ports(self) -> tuple:
        return (self.intra,) * self.intra_lanes + (self.inter,)


HCCS_910B = Port("hccs", 56 * GB, 2e-6)        # 56 GB/s per link (published); latency [A]
ROCE_200G = Port("roce", 25 * GB, 5e-6)        # 200 Gb/s [A: no published figure found]; latency [A]
HCCS_910 = Port("hccs", 30 * GB, 2e-6)         # 240 Gb/s per HCCS port (Hot Chips 31) [D]; latency [A]
ROCE_100G = Port("roce", 12.5 * GB, 5e-6)      # 100 GbE on the 910 die [D]; latency [A]
PCIE4_X16 = Port("pcie", 31.5 * GB, 2e-6)      # PCIe 4.0 x16 per direction [D]; latency [A]
HOST_NIC_100G = Port("roce", 12.5 * GB, 5e-6)  # [A]

LINKS = MappingProxyType({
    "ascend910b": LinkProfile("ascend910b", node=8, mesh=8, full_mesh=True, intra=HCCS_910B, inter=ROCE_200G,
                              notes=("RoCE port speed [A]",)),
    "ascend910": LinkProfile("ascend910", node=8, mesh=4, full_mesh=True, intra=HCCS_910, inter=ROCE_100G,
                             notes=("two 4-NPU HCCS meshes per server; between them RoCE [A]",)),
    "ascend310p": LinkProfile("ascend310p", node=8, mesh=8, full_mesh=False, intra=PCIE4_X16, inter=HOST_NIC_100G,
                              notes=("PCIe shared by all peers; 8 chips per server and the host NIC [A]",)),
})


def get_links(device) -> LinkProfile:
    """The link profile of a device (a name or a ``Device``)."""
    name = getattr(device, "name", device)
    from cost_model.devices import get_device
    name = get_device(name).name
    return LINKS[name]


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ALGORITHMS = ("ring", "mesh", "oneshot", "pairwise", "hierarchical")


def oneshot_limit(links: LinkProfile, world: int) -> float:
    """Bytes per rank below which a one-shot all-reduce beats the two-shot mesh on these links (see the module
    docstring); 0 where one-shot does not apply (a shared bus, or ranks beyond one mesh domain)."""
    if not links.full_mesh or world > links.mesh or world < 2:
        return 0.0
    if world == 2:
        return float("inf")
    return links.intra.latency_s * links.intra.bytes_per_s * world / (world - 2)


def default_algorithm(links: LinkProfile, op: str, world: int, nbytes: float | None = None) -> str:
    """What HCCL-style libraries pick: inside a full-mesh domain a one-shot all-reduce for small buffers
    (``nbytes`` per rank below :func:`oneshot_limit`), else the mesh; ring on a shared bus, hierarchical
    all-reduce across domains, ring for the other collectives across domains; all_to_all is always pairwise."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(COLLECTIVES)}")
    if op == "all_to_all":
        return "pairwise"
    if op == "all_reduce" and nbytes is not None and nbytes < oneshot_limit(links, world):
        return "oneshot"
    if world <= links.mesh:
        return "mesh" if links.full_mesh else "ring"
    if op == "all_reduce" and world % links.mesh == 0:
        return "hierarchical"
    return "ring"


def check(op: str, algorithm: str, world: int, links: LinkProfile) -> None:
    """Refuse combinations the simulator does not implement, naming what to use instead."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    if op == "all_to_all" and algorithm != "pairwise":
        raise ValueError(f"all_to_all runs pairwise, not {algorithm!r}")
    if op != "all_to_all" and algorithm == "pairwise":
        raise ValueError(f"{op} runs ring, mesh or hierarchical, not pairwise")
    if algorithm == "hierarchical" and (op != "all_reduce" or world % links.mesh or world <= links.mesh):
        raise ValueError(f"hierarchical {op} needs all_reduce over whole {links.mesh}-NPU domains, more than one "
                         f"(world {world}); use ring")
    if algorithm == "oneshot" and (op != "all_reduce" or not links.full_mesh or world > links.mesh):
        raise ValueError(f"oneshot {op} needs an all_reduce inside one full-mesh {links.mesh}-NPU domain (world "
                         f"{world}); use mesh or ring")
    if algorithm == "mesh" and world > links.mesh:
        raise ValueError(f"mesh {op} needs every rank in one {links.mesh}-NPU domain (world {world}); use ring "
                         f"or hierarchical")


def ring_neighbours(rank: int, world: int) -> tuple[int, int]:
    return (rank + 1) % world, (rank - 1) % world


def steps(op: str, algorithm: str, world: int, links: LinkProfile | None = None) -> int:
    """Steps each rank goes through (a step waits for the previous one's data)."""
    p = world
    if p == 1:
        return 0
    if algorithm == "ring":
        return 2 * (p - 1) if op == "all_reduce" else p - 1
    if algorithm == "mesh":
        return 2 if op == "all_reduce" else 1
    if algorithm == "oneshot":
        return 1
    if algorithm == "pairwise":
        return 1 if links is not None and p <= links.mesh and links.full_mesh else p - 1
    L = links.mesh
    N = p // L
    return 2 + 2 * (N - 1)


def bytes_per_rank(op: str, algorithm: str, world: int, nbytes: float, links: LinkProfile | None = None) -> float:
    """Bytes each rank sends, for ``nbytes`` of payload (the all_reduce buffer, the reduce_scatter input, the
    all_gather output, the all_to_all input)."""
    p = world
    if p == 1:
        return 0.0
    if algorithm == "hierarchical":
        L = links.mesh
        N = p // L
        return 2 * (L - 1) / L * nbytes + 2 * (N - 1) / N * nbytes / L
    if algorithm == "oneshot":
        return (p - 1) * nbytes
    factor = 2 if op == "all_reduce" else 1
    return factor * (p - 1) / p * nbytes


def ring_time(op: str, world: int, nbytes: float, port: Port) -> float:
    """Seconds of the ring algorithm over links of one kind: bytes per rank over the bandwidth, plus one
    latency per step (the textbook bound the simulator is checked against)."""
    return bytes_per_rank(op, "ring", world, nbytes) / port.bytes_per_s + steps(op, "ring", world) * port.latency_s


def ring_bottleneck(links: LinkProfile, world: int) -> Port:
    """The slowest port a ring over ranks 0..world-1 uses."""
    ports = [links.port(r, (r + 1) % world) for r in range(world)] if world > 1 else [links.intra]
    return min(ports, key=lambda p: p.bytes_per_s)


__all__ = ["ALGORITHMS", "COLLECTIVES", "LINKS", "LinkProfile", "Port", "bytes_per_rank", "check",
           "default_algorithm", "get_links", "oneshot_limit", "ring_bottleneck", "ring_neighbours", "ring_time", "steps"]
