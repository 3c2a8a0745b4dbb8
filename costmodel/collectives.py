"""Alpha-beta cost of collectives over a group of GPUs, read off the cluster graph.

For a group of ranks, ``group_link`` walks the cluster graph between consecutive members of
the ring (cached per pair class) and keeps the slowest link on each kind of hop: inside a node
(NVLink) and across nodes (NIC, leaf, spine). A ring that crosses nodes with ``k`` members per
node runs ``k`` channels in parallel, one per member's NIC (as NCCL does on rail-optimised
DGX clusters), so its inter-node bandwidth is ``k`` times one NIC's share.

Times follow the alpha-beta model (Thakur et al. 2005, "Optimization of Collective
Communication Operations in MPICH"; Chan et al. 2007): ring all-reduce moves
``2 (n-1)/n * S`` bytes per rank in ``2 (n-1)`` steps, all-gather and reduce-scatter half of
that, a double binary tree has ``2 log2 n`` latency steps. The cheaper of ring and tree is used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan.costmodel.hardware import ClusterSpec

if TYPE_CHECKING:  # imported in _pair_path: the plan-file type and light commands skip networkx
    import networkx as nx


@dataclass(frozen=True)
class GroupLink:
    """What a communication group sees of the network."""

    size: int
    """Ranks in the group (n)."""
    nodes: int
    """Distinct nodes the group spans."""
    intra_bytes_per_s: float
    """Slowest in-node link between ring neighbours (inf if no in-node hop)."""
    inter_bytes_per_s: float
    """Slowest cross-node link between ring neighbours, one channel (inf if none)."""
    per_node: int
    """Members per node (parallel channels across nodes)."""
    latency_s: float
    """Largest one-hop latency between ring neighbours."""

    @property
    def ring_bytes_per_s(self) -> float:
        """Bandwidth one rank gets in a ring over the group."""
        return min(self.intra_bytes_per_s, self.per_node * self.inter_bytes_per_s)


def _pair_path(graph: nx.Graph, u: int, v: int) -> tuple[float, float]:
    """(bottleneck bytes_per_s, total latency_s) of the shortest path between GPUs u and v."""
    import networkx as nx

    path = nx.bidirectional_shortest_path(graph, ("gpu", u), ("gpu", v))
    bandwidth, latency = math.inf, 0.0
    for a, b in zip(path, path[1:]):
        edge = graph.edges[a, b]
        bandwidth = min(bandwidth, edge["bytes_per_s"])
        latency += edge["latency_s"]
    return bandwidth, latency


def group_link(cluster: ClusterSpec, ranks: tuple[int, ...]) -> GroupLink:
    """Network view of the group ``ranks`` (GPU indices) in ``cluster``; cached."""
    return _group_link_cached(cluster, tuple(ranks))


@functools.lru_cache(maxsize=65536)
def _group_link_cached(cluster: ClusterSpec, ranks: tuple[int, ...]) -> GroupLink:
    n = len(ranks)
    nodes = {cluster.node_of(r) for r in ranks}
    per_node = max(1, n // len(nodes))
    if n == 1:
        return GroupLink(size=1, nodes=1, intra_bytes_per_s=math.inf,
                         inter_bytes_per_s=math.inf, per_node=1, latency_s=0.0)
    intra, inter, latency = math.inf, math.inf, 0.0
    seen: dict[tuple, tuple[float, float]] = {}
    gpn, npl = cluster.gpus_per_node, cluster.nodes_per_leaf
    for u, v in zip(ranks, ranks[1:] + ranks[:1]):
        nu, nv = u // gpn, v // gpn
        key = (nu == nv, u % gpn, v % gpn, nu // npl == nv // npl)
        if key not in seen:
            seen[key] = _pair_path(cluster.graph, u, v)
        bandwidth, hop_latency = seen[key]
        if nu == nv:
            intra = min(intra, bandwidth)
        else:
            inter = min(inter, bandwidth)
        latency = max(latency, hop_latency)
    return GroupLink(size=n, nodes=len(nodes), intra_bytes_per_s=intra,
                     inter_bytes_per_s=inter, per_node=per_node, latency_s=latency)


def with_latency(link: GroupLink, latency_s: Mapping[str, float]) -> GroupLink:
    """``link`` with its latency replaced by a measured one-hop latency, if one is given.

    ``latency_s`` maps ``intra`` / ``inter`` to seconds (``Calibration.link_latency_s``); a
    group inside one node takes ``intra``, a group spanning nodes ``inter``. Without the key
    (or for a group of one) the link is returned unchanged, with the cluster's latency.
    """
    kind = "intra" if link.nodes == 1 else "inter"
    if link.size <= 1 or kind not in latency_s:
        return link
    return dataclasses.replace(link, latency_s=float(latency_s[kind]))


def _effective(link: GroupLink, intra_eff: float, inter_eff: float) -> float:
    return min(link.intra_bytes_per_s * intra_eff,
               link.per_node * link.inter_bytes_per_s * inter_eff)


def all_reduce_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                 inter_eff: float) -> float:
    """All-reduce of ``size_bytes`` per rank: min(ring, double binary tree)."""
    n = link.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    bandwidth = _effective(link, intra_eff, inter_eff)
    ring = 2 * (n - 1) / n * size_bytes / bandwidth + 2 * (n - 1) * link.latency_s
    tree = 2 * size_bytes / bandwidth + 2 * math.log2(n) * link.latency_s
    return min(ring, tree)


def all_gather_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                 inter_eff: float) -> float:
    """All-gather producing ``size_bytes`` (the full, gathered buffer) on each rank.

    Reduce-scatter of a ``size_bytes`` input costs the same.
    """
    n = link.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    bandwidth = _effective(link, intra_eff, inter_eff)
    latency_steps = min(n - 1, 2 * math.log2(n))
    return (n - 1) / n * size_bytes / bandwidth + latency_steps * link.latency_s


reduce_scatter_s = all_gather_s


def all_to_all_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                 inter_eff: float) -> float:
    """All-to-all where each rank sends ``size_bytes`` in total, 1/n to every peer.

    Peers on the same node are reached over NVLink, the others over the rank's own NIC share.
    """
    n = link.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    k = link.per_node
    local = (k - 1) / n * size_bytes / (link.intra_bytes_per_s * intra_eff) if k > 1 else 0.0
    remote = (n - k) / n * size_bytes / (link.inter_bytes_per_s * inter_eff) if n > k else 0.0
    return local + remote + (n - 1) * link.latency_s


def send_recv_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                inter_eff: float) -> float:
    """Point-to-point transfer of ``size_bytes`` between the two members of ``link``."""
    if link.size <= 1 or size_bytes <= 0:
        return 0.0
    bandwidth = (link.intra_bytes_per_s * intra_eff if link.nodes == 1
                 else link.inter_bytes_per_s * inter_eff)
    return size_bytes / bandwidth + link.latency_s
