"""Alpha-beta cost of collectives over a group of GPUs, read off the cluster graph.

For a group of ranks, ``group_link`` walks the cluster graph between consecutive members of
the ring (cached per pair class) and keeps the slowest link on each kind of hop: inside a node
(NVLink) and across nodes (NIC, leaf, spine). A ring that crosses nodes with ``k`` members per
node runs ``k`` channels in parallel, one per member's NIC (as NCCL does on rail-optimised
DGX clusters), so its inter-node bandwidth is ``k`` times one NIC's share.

Times follow the alpha-beta model (Thakur et al. 2005, "Optimization of Collective
Communication Operations in MPICH"; Chan et al. 2007): an algorithm that moves
``bytes_factor * S`` bytes per rank in ``latency_steps`` one-hop steps takes
``bytes_factor * S / B + latency_steps * alpha``. The one rule, used by the estimator's
functions below and by the profile fit (``fitting.fit_alpha_beta``): ``algorithms`` lists each
operation's candidates and ``fastest`` picks the one that takes least time for the message
size, bandwidth and latency at hand. Ring all-reduce moves ``2 (n-1)/n * S`` in ``2 (n-1)``
steps, a double binary tree ``2 S`` in ``2 log2 n`` (Sanders et al. 2009), so small
all-reduces take the tree; all-gather and reduce-scatter move half the ring all-reduce's bytes.
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


@dataclass(frozen=True)
class Algorithm:
    """One way to run a collective: ``bytes_factor * S / B + latency_steps * alpha`` seconds
    for ``S`` bytes over links of bandwidth ``B`` and one-hop latency ``alpha``."""

    name: str
    bytes_factor: float
    """Bytes each rank moves over its link, per byte of ``S`` (the beta term)."""
    latency_steps: float
    """One-hop latencies on the critical path (the alpha term)."""


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@functools.lru_cache(maxsize=1024)
def algorithms(op: str, n: int) -> tuple[Algorithm, ...]:
    """The candidate algorithms of ``op`` over ``n`` >= 2 ranks, as the estimator charges them.

    * all-reduce: ring, ``2 (n-1)/n`` bytes in ``2 (n-1)`` steps (Thakur et al. 2005 Sec. 4.4,
      reduce-scatter then all-gather); double binary tree, ``2`` bytes in ``2 log2 n`` steps
      (Sanders, Speck and Traeff 2009; NCCL's tree).
    * all-gather, reduce-scatter (``S`` the full buffer): the ring's ``(n-1)/n`` bytes in
      ``n - 1`` steps, or the same bytes in a double binary tree's ``2 log2 n`` steps. The
      second is the cost model's charge where it is fewer steps, not one published algorithm
      (recursive doubling, Thakur et al. Sec. 4.1, takes ``log2 n``); the bytes are equal, so
      the choice never depends on the size.
    * all-to-all: each rank sends ``(n-1)/n`` of ``S`` to ``n - 1`` peers, one step each
      (``all_to_all_s`` splits the bytes between NVLink and NIC).
    * send/recv (``n`` = 2): ``S`` in one step.
    """
    if n < 2:
        raise ValueError(f"a collective needs at least 2 ranks, got n={n!r}")
    if op == "all_reduce":
        return (Algorithm("ring", 2 * (n - 1) / n, 2.0 * (n - 1)),
                Algorithm("double_binary_tree", 2.0, 2 * math.log2(n)))
    if op in ("all_gather", "reduce_scatter"):
        return (Algorithm("ring", (n - 1) / n, n - 1.0),
                Algorithm("log_latency", (n - 1) / n, 2 * math.log2(n)))
    if op == "all_to_all":
        return (Algorithm("pairwise", (n - 1) / n, n - 1.0),)
    if op == "send_recv":
        return (Algorithm("direct", 1.0, 1.0),)
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVE_OPS)}")


def algorithm_s(algorithm: Algorithm, size_bytes: float, *, bytes_per_s: float,
                latency_s: float) -> float:
    """Seconds ``algorithm`` takes on ``size_bytes`` (alpha-beta model, module docstring)."""
    return algorithm.bytes_factor * size_bytes / bytes_per_s + algorithm.latency_steps * latency_s


def fastest(op: str, n: int, size_bytes: float, *, bytes_per_s: float,
            latency_s: float) -> Algorithm:
    """The algorithm of ``op`` over ``n`` ranks that takes least time on ``size_bytes`` at
    ``bytes_per_s`` and one-hop ``latency_s`` (the first listed on a tie)."""
    return min(algorithms(op, n), key=lambda a: algorithm_s(
        a, size_bytes, bytes_per_s=bytes_per_s, latency_s=latency_s))


def collective_s(op: str, n: int, size_bytes: float, *, bytes_per_s: float,
                 latency_s: float) -> float:
    """Seconds of ``op`` on ``size_bytes`` over ``n`` ranks: its ``fastest`` algorithm's time;
    0 for one rank or no bytes."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    algorithm = fastest(op, n, size_bytes, bytes_per_s=bytes_per_s, latency_s=latency_s)
    return algorithm_s(algorithm, size_bytes, bytes_per_s=bytes_per_s, latency_s=latency_s)


def effective_bytes_per_s(link: GroupLink, *, intra_eff: float, inter_eff: float) -> float:
    """Bandwidth a ring over ``link`` achieves: the slower of the in-node link and the
    node's parallel NIC channels, each times its calibrated efficiency."""
    return min(link.intra_bytes_per_s * intra_eff,
               link.per_node * link.inter_bytes_per_s * inter_eff)


def all_reduce_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                 inter_eff: float) -> float:
    """All-reduce of ``size_bytes`` per rank: the faster of ring and double binary tree."""
    return collective_s("all_reduce", link.size, size_bytes, latency_s=link.latency_s,
                        bytes_per_s=effective_bytes_per_s(link, intra_eff=intra_eff,
                                                          inter_eff=inter_eff))


def all_gather_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                 inter_eff: float) -> float:
    """All-gather producing ``size_bytes`` (the full, gathered buffer) on each rank.

    Reduce-scatter of a ``size_bytes`` input costs the same.
    """
    return collective_s("all_gather", link.size, size_bytes, latency_s=link.latency_s,
                        bytes_per_s=effective_bytes_per_s(link, intra_eff=intra_eff,
                                                          inter_eff=inter_eff))


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
    (pairwise,) = algorithms("all_to_all", n)  # its bytes, (n-1)/n, split as above
    return local + remote + pairwise.latency_steps * link.latency_s


def send_recv_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                inter_eff: float) -> float:
    """Point-to-point transfer of ``size_bytes`` between the two members of ``link``."""
    if link.size <= 1 or size_bytes <= 0:
        return 0.0
    bandwidth = (link.intra_bytes_per_s * intra_eff if link.nodes == 1
                 else link.inter_bytes_per_s * inter_eff)
    return collective_s("send_recv", link.size, size_bytes, bytes_per_s=bandwidth,
                        latency_s=link.latency_s)
