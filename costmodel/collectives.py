"""Alpha-beta cost of collectives over a group of GPUs, read off the cluster graph.

For a group of ranks, ``group_link`` walks the cluster graph between consecutive members of
the ring (once per kind of pair, on the cluster's smallest copy that has every kind:
``ClusterSpec.path_graph``) and keeps the slowest link on each kind of hop: inside a node
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
all-reduces take the tree (and, inside an NVSwitch node that reduces, NCCL's NVLS may beat
both: ``algorithms``); all-gather and reduce-scatter move half the ring all-reduce's bytes
and only run as a ring, so their latency grows with the ring (NCCL and gloo both run them as
rings), which is what makes sharded data parallelism over hundreds of ranks latency-bound.

Latency is hierarchical, as NCCL's own tuning model charges it (NVIDIA/nccl
``src/graph/tuning.cc``, ``ncclTopoTuneModel``): of a ring's ``n - 1`` steps (all-gather,
reduce-scatter) over ``N`` nodes, ``N - 1`` cross nodes and pay the cross-node hop latency, the
other ``n - N`` the in-node one (all-reduce: twice each); the tree all-reduce pays
``2 ((n/N - 1) alpha_intra + log2(N) alpha_inter)``. A group inside one tier (one node, or one
rank per node) has one hop latency, and the rule is the plain alpha-beta model the profile fit
inverts. NCCL's per-call base latency (``baseLat``, 6.6-8.4 us) and the ring's per-hop values
(``hwLat``: 3.4 us on NVLink, 14 us on the network for the Simple protocol) are of the order of
the catalog's path latencies; the per-call cost of the framework's host side is
``Calibration.collective_call_s``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan.costmodel.hardware import ClusterSpec

if TYPE_CHECKING:  # _pair_path (the networkx reference the tests check against) imports it
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
    intra_latency_s: float | None = None
    """Largest in-node hop latency between ring neighbours of a group that spans nodes (its
    in-node steps pay this, its cross-node steps ``latency_s``); None: every step pays
    ``latency_s`` (a group inside one tier)."""
    nvls_efficiency: float = 0.0
    """The GPU's ``GpuSpec.nvls_efficiency`` for a group of two or more ranks inside one
    node, where NCCL can all-reduce through the NVSwitch (NVLS); 0 otherwise."""

    def step_latencies(self) -> tuple[float, float]:
        """(in-node, cross-node) one-hop latency of the group's steps."""
        if self.nodes == 1:
            return self.latency_s, self.latency_s
        intra = self.latency_s if self.intra_latency_s is None else self.intra_latency_s
        return intra, self.latency_s

    @property
    def ring_bytes_per_s(self) -> float:
        """Bandwidth one rank gets in a ring over the group."""
        return min(self.intra_bytes_per_s, self.per_node * self.inter_bytes_per_s)


def _pair_path(graph: nx.Graph, u: int, v: int) -> tuple[float, float]:
    """(bottleneck bytes_per_s, total latency_s) of the shortest path between GPUs u and v
    of a cluster's networkx graph (``ClusterSpec.graph``): the reference ``_small_pair_path``
    is tested against."""
    import networkx as nx

    path = nx.bidirectional_shortest_path(graph, ("gpu", u), ("gpu", v))
    edges = [graph.edges[a, b] for a, b in zip(path, path[1:])]
    # fsum: the correctly rounded sum, the same whichever way the hops are met
    return (min((e["bytes_per_s"] for e in edges), default=math.inf),
            math.fsum(e["latency_s"] for e in edges))


def group_link(cluster: ClusterSpec, ranks: tuple[int, ...]) -> GroupLink:
    """Network view of the group ``ranks`` (GPU indices) in ``cluster``; cached."""
    return _group_link_cached(cluster, tuple(ranks))


@functools.lru_cache(maxsize=65536)
def _group_link_cached(cluster: ClusterSpec, ranks: tuple[int, ...]) -> GroupLink:
    """Ring neighbours are grouped by what their path depends on (same node, local GPU
    indices, same leaf switch); one shortest path per kind (``_kind_path``)."""
    n = len(ranks)
    if n == 1:
        return GroupLink(size=1, nodes=1, intra_bytes_per_s=math.inf,
                         inter_bytes_per_s=math.inf, per_node=1, latency_s=0.0)
    nodes, kinds = _ring_kinds(ranks, cluster.gpus_per_node, cluster.nodes_per_leaf)
    return _link_of_kinds(cluster, n, nodes, kinds)


def lattice_link(cluster: ClusterSpec, base: int, axes: tuple[tuple[int, int], ...]
                 ) -> GroupLink:
    """``group_link`` of the ranks ``base + sum_k i_k * stride_k`` (``axes``: (stride, size)
    pairs, ``0 <= i_k < size``) of a mesh layout: the group of one or two mesh axes, whose
    strides nest (each axis's stride is at least the one below times its size, as mixed-radix
    strides are), read without listing its ranks (``_lattice_kinds``); cached."""
    axes = tuple(sorted((a for a in axes if a[1] > 1), reverse=True))
    if not axes:
        return group_link(cluster, (base,))
    if len(axes) > 2:
        raise ValueError(f"lattice_link takes one or two axes, got {axes}")
    leaf = cluster.gpus_per_node * cluster.nodes_per_leaf
    return _lattice_link_cached(cluster, base % leaf, axes)


@functools.lru_cache(maxsize=65536)
def _lattice_link_cached(cluster: ClusterSpec, base: int,
                         axes: tuple[tuple[int, int], ...]) -> GroupLink:
    (outer, n_outer), (inner, n_inner) = axes if len(axes) == 2 else (axes[0], (1, 1))
    nodes, kinds = _lattice_kinds(base, outer, n_outer, inner, n_inner,
                                  cluster.gpus_per_node, cluster.nodes_per_leaf)
    return _link_of_kinds(cluster, n_outer * n_inner, nodes, kinds)


def _lattice_kinds(base: int, outer: int, n_outer: int, inner: int, n_inner: int, gpn: int,
                   npl: int) -> tuple[int, set[tuple]]:
    """``_ring_kinds`` of the sorted ranks ``base + i * outer + j * inner`` (``i < n_outer``,
    ``j < n_inner``, ``outer >= inner * n_inner``), from residues instead of ranks.

    A forward ring pair (r, r + d) has the kind (same node, r mod g, (r + d) mod g, same leaf)
    with same node iff ``r mod g + d < g`` and same leaf iff ``r mod l + d < l`` (g GPUs per
    node, l per leaf): it depends on r only through r mod l, and ``i * stride mod l`` repeats
    with period ``l / gcd(stride, l)``, so a period of each index gives every kind. The pairs
    are the inner steps (d = inner), the steps between runs of the inner axis (d = outer -
    (n_inner - 1) inner) and the ring's closing pair (last, first). The ranks ascend, so the
    nodes they span are one more than the forward pairs that change node, counted per residue
    class of i and j modulo g with each class's multiplicity."""
    leaf = gpn * npl
    kinds: set[tuple] = set()
    crossings = 0

    def kind(r: int, d: int) -> tuple:
        local = r % gpn
        return (local + d < gpn, local, (r + d) % gpn, r % leaf + d < leaf)

    def residues(stride: int, count: int, modulus: int) -> list[int]:
        return [(i * stride) % modulus for i in range(min(count, modulus // math.gcd(
            stride, modulus)))]

    def classes(stride: int, count: int) -> list[tuple[int, int]]:
        """(i * stride mod g, how many i < count have it), per class of i modulo the period."""
        period = gpn // math.gcd(stride, gpn)
        return [((k * stride) % gpn, count // period + (k < count % period))
                for k in range(min(count, period))]

    if n_inner > 1:  # steps inside a run of the inner axis
        offsets = residues(outer, n_outer, leaf)
        kinds.update(kind(base + a + b, inner) for a in offsets
                     for b in residues(inner, n_inner - 1, leaf))
        crossings += sum(ca * cb for a, ca in classes(outer, n_outer)
                         for b, cb in classes(inner, n_inner - 1)
                         if (base + a + b) % gpn + inner >= gpn)
    if n_outer > 1:  # steps from the end of one run to the start of the next
        step = outer - (n_inner - 1) * inner
        end = base + (n_inner - 1) * inner
        kinds.update(kind(end + a, step) for a in residues(outer, n_outer - 1, leaf))
        crossings += sum(ca for a, ca in classes(outer, n_outer - 1)
                         if (end + a) % gpn + step >= gpn)
    last = base + (n_outer - 1) * outer + (n_inner - 1) * inner  # the ring closes
    kinds.add((last // gpn == base // gpn, last % gpn, base % gpn, last // leaf == base // leaf))
    return 1 + crossings, kinds


def _link_of_kinds(cluster: ClusterSpec, n: int, nodes: int, kinds: set[tuple]) -> GroupLink:
    """The ``GroupLink`` of an ``n``-rank group over ``nodes`` nodes whose ring-neighbour pairs
    have ``kinds`` (``_ring_kinds``)."""
    per_node = max(1, n // nodes)
    intra, inter, latency, intra_latency = math.inf, math.inf, 0.0, 0.0
    for kind in kinds:
        bandwidth, hop_latency = _kind_path(cluster, *kind)
        if kind[0]:  # same node
            intra = min(intra, bandwidth)
            intra_latency = max(intra_latency, hop_latency)
        else:
            inter = min(inter, bandwidth)
        latency = max(latency, hop_latency)
    spans = nodes > 1
    return GroupLink(size=n, nodes=nodes, intra_bytes_per_s=intra,
                     inter_bytes_per_s=inter, per_node=per_node, latency_s=latency,
                     intra_latency_s=(intra_latency if spans and intra_latency > 0 else None),
                     nvls_efficiency=0.0 if spans else cluster.gpu.nvls_efficiency)


NUMPY_RING = 256
"""Groups of at least this many ranks are classified with numpy (``_ring_kinds``); smaller
ones in plain Python, which is faster there (a pair: ~2 us against ~200 us)."""


def _ring_kinds(ranks: tuple[int, ...], gpn: int, npl: int) -> tuple[int, set[tuple]]:
    """(nodes the group spans, the kinds of its ring-neighbour pairs): each pair's (same
    node, local index of each, same leaf), what its path depends on."""
    n = len(ranks)
    if n < NUMPY_RING:
        node_of = [r // gpn for r in ranks]
        kinds = set()
        for i, (a, node_a) in enumerate(zip(ranks, node_of)):
            j = i + 1 if i + 1 < n else 0
            node_b = node_of[j]
            kinds.add((node_a == node_b, a % gpn, ranks[j] % gpn,
                       node_a // npl == node_b // npl))
        return len(set(node_of)), kinds
    import numpy as np

    u = np.asarray(ranks, dtype=np.int64)
    v = np.roll(u, -1)
    nu, nv = u // gpn, v // gpn
    codes = (((nu == nv) * gpn + u % gpn) * gpn + v % gpn) * 2 + (nu // npl == nv // npl)
    _, first = np.unique(codes, return_index=True)
    kinds = {(bool(nu[i] == nv[i]), int(u[i] % gpn), int(v[i] % gpn),
              bool(nu[i] // npl == nv[i] // npl)) for i in first.tolist()}
    return len(np.unique(nu)), kinds


@functools.lru_cache(maxsize=64)
def _kind_paths(cluster: ClusterSpec) -> dict[tuple, tuple[float, float]]:
    return {}


def _kind_path(cluster: ClusterSpec, same_node: bool, local_u: int, local_v: int,
               same_leaf: bool) -> tuple[float, float]:
    """``_pair_path`` of every GPU pair of this kind in ``cluster``, read once off the
    cluster's smallest copy that has the kind (``ClusterSpec.path_graph``)."""
    paths = _kind_paths(cluster)
    key = (same_node, local_u, local_v, same_leaf)
    if key not in paths:
        paths[key] = _small_pair_path(cluster.path_graph[0], *cluster.pair_kind_gpus(
            same_node, local_u, local_v, same_leaf))
    return paths[key]


def _small_pair_path(adjacency: dict[tuple, list[tuple]], u: int,
                     v: int) -> tuple[float, float]:
    """``_pair_path`` on a ``ClusterSpec.path_graph`` adjacency: a breadth-first search for
    a path of fewest hops (every such path between two GPUs crosses the same tiers, so
    which one is found does not change the bottleneck or the latency)."""
    source, target = ("gpu", u), ("gpu", v)
    parent: dict[tuple, tuple | None] = {source: None}
    frontier = [source]
    while target not in parent and frontier:
        following = []
        for vertex in frontier:
            for neighbour, bytes_per_s, latency_s in adjacency[vertex]:
                if neighbour not in parent:
                    parent[neighbour] = (vertex, bytes_per_s, latency_s)
                    following.append(neighbour)
        frontier = following
    if target not in parent:
        raise ValueError(f"GPUs {u} and {v} are not connected")
    bandwidths, latencies = [], []
    vertex = target
    while parent[vertex] is not None:
        vertex, bytes_per_s, latency_s = parent[vertex]
        bandwidths.append(bytes_per_s)
        latencies.append(latency_s)
    return min(bandwidths, default=math.inf), math.fsum(latencies)


def with_latency(link: GroupLink, latency_s: Mapping[str, float]) -> GroupLink:
    """``link`` with its latency replaced by a measured one-hop latency, if one is given.

    ``latency_s`` maps ``intra`` / ``inter`` to seconds (``Calibration.link_latency_s``); a
    group inside one node takes ``intra``, a group spanning nodes ``inter``. Without the key
    (or for a group of one) the link is returned unchanged, with the cluster's latency.
    """
    kind = "intra" if link.nodes == 1 else "inter"
    if link.size <= 1 or kind not in latency_s:
        return link
    intra = link.intra_latency_s
    if intra is not None and "intra" in latency_s:
        intra = float(latency_s["intra"])
    return dataclasses.replace(link, latency_s=float(latency_s[kind]), intra_latency_s=intra)


def with_library_latency(link: GroupLink, hops: Mapping[str, float]) -> GroupLink:
    """``link`` with the collective library's own per-step latencies (``hops``: ``intra``,
    ``inter`` and ``intra_multi_node`` seconds, ``Calibration.library_hop_latency_s``) in
    place of the cluster's path latencies: a group inside one node pays ``intra`` per step, a
    group spanning nodes ``inter`` per cross-node step and ``intra_multi_node`` per in-node
    step (NCCL: a multi-node ring's in-node steps also wait for the network post, three per
    step with the Simple protocol). A key that is absent keeps the cluster's value."""
    if link.size <= 1:
        return link
    if link.nodes == 1:
        if "intra" not in hops:
            return link
        return dataclasses.replace(link, latency_s=float(hops["intra"]))
    intra = link.intra_latency_s
    if intra is not None and "intra_multi_node" in hops:
        intra = float(hops["intra_multi_node"])
    return dataclasses.replace(link, latency_s=float(hops.get("inter", link.latency_s)),
                               intra_latency_s=intra)


@dataclass(frozen=True)
class Algorithm:
    """One way to run a collective: ``bytes_factor * S / B + latency_steps * alpha`` seconds
    for ``S`` bytes over links of bandwidth ``B`` and one-hop latency ``alpha``."""

    name: str
    bytes_factor: float
    """Bytes each rank moves over its link, per byte of ``S`` (the beta term)."""
    latency_steps: float
    """One-hop latencies on the critical path (the alpha term)."""
    inter_steps: float = 0.0
    """How many of ``latency_steps`` cross nodes (the rest are in-node steps), for a group
    over several nodes with several ranks each (``algorithms``' ``nodes``)."""
    fixed_latency_s: float = 0.0
    """Latency charged once, whatever the hops' (NVLS: ``NVLS_LATENCY_S``)."""


NVLS_LATENCY_S = 25e-6
"""One NVLS all-reduce's latency: NCCL's tuning model charges NVLS no base latency and one
in-node step of 25 us (``hwLatencies[NVLINK][NVLS][SIMPLE]``, src/graph/tuning.cc)."""


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@functools.lru_cache(maxsize=4096)
def algorithms(op: str, n: int, nodes: int = 1, nvls: float = 0.0) -> tuple[Algorithm, ...]:
    """The candidate algorithms of ``op`` over ``n`` >= 2 ranks on ``nodes`` nodes, as the
    estimator charges them (``nvls``: the group's ``GroupLink.nvls_efficiency``).

    * all-reduce: ring, ``2 (n-1)/n`` bytes in ``2 (n-1)`` steps (Thakur et al. 2005 Sec. 4.4,
      reduce-scatter then all-gather), ``2 (N-1)`` of them across nodes; double binary tree,
      ``2`` bytes in ``2 ((n/N - 1) + log2 N)`` steps, ``2 log2 N`` across nodes (Sanders,
      Speck and Traeff 2009; NCCL's tree: a chain inside each node, a tree over the nodes).
      On one node (or one rank per node) the tree takes ``2 log2 n`` steps. Inside one node
      whose NVSwitch reduces (``nvls`` > 0: NVLink SHARP, H100/H200/B200), NCCL's NVLS too:
      its tuning model gives NVLS ``2 * nvls`` times the ring's bus bandwidth (the switch
      reduces, and two operations pipeline) and one ``NVLS_LATENCY_S``, so it moves
      ``2 (n-1)/n / (2 nvls)`` bytes per byte of ``S`` (the model's ``(nChannels - 1) /
      nChannels`` factor, 15/16 or more, is left out). Not modelled: NVLS across nodes
      (NVLS tree) and NVLS for all-gather and reduce-scatter (NCCL 2.19 on).
    * all-gather, reduce-scatter (``S`` the full buffer): the ring only, ``(n-1)/n`` bytes in
      ``n - 1`` steps, ``N - 1`` across nodes. NCCL runs them as rings (its NVLS and PAT
      variants need NVLink SHARP or one rank per node), gloo too: the latency grows with n.
    * all-to-all: each rank sends ``(n-1)/n`` of ``S`` to ``n - 1`` peers, one step each
      (``all_to_all_s`` splits the bytes between NVLink and NIC).
    * send/recv (``n`` = 2): ``S`` in one step.

    Step counts follow NCCL's tuning model (``src/graph/tuning.cc``: ``nsteps`` and
    ``nInterSteps`` of the ring, ``2 ((nRanks/nNodes - 1) intraLat + log2(nNodes) interLat)``
    of the tree).
    """
    if n < 2:
        raise ValueError(f"a collective needs at least 2 ranks, got n={n!r}")
    nodes = max(1, min(nodes, n))
    spans = 1 < nodes < n  # several ranks on each of several nodes: two kinds of step
    if op == "all_reduce":
        if spans:
            tree_inter = 2 * math.log2(nodes)
            tree = Algorithm("double_binary_tree", 2.0, 2 * (n / nodes - 1) + tree_inter,
                             inter_steps=tree_inter)
        else:
            tree = Algorithm("double_binary_tree", 2.0, 2 * math.log2(n))
        ring = Algorithm("ring", 2 * (n - 1) / n, 2.0 * (n - 1),
                         inter_steps=2.0 * (nodes - 1) if spans else 0.0)
        if nvls > 0 and nodes == 1:
            return ring, tree, Algorithm("nvls", 2 * (n - 1) / n / (2 * nvls), 0.0,
                                         fixed_latency_s=NVLS_LATENCY_S)
        return ring, tree
    if op in ("all_gather", "reduce_scatter"):
        return (Algorithm("ring", (n - 1) / n, n - 1.0,
                          inter_steps=nodes - 1.0 if spans else 0.0),)
    if op == "all_to_all":
        return (Algorithm("pairwise", (n - 1) / n, n - 1.0),)
    if op == "send_recv":
        return (Algorithm("direct", 1.0, 1.0),)
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVE_OPS)}")


def algorithm_s(algorithm: Algorithm, size_bytes: float, *, bytes_per_s: float,
                latency_s: float, intra_latency_s: float | None = None) -> float:
    """Seconds ``algorithm`` takes on ``size_bytes`` (alpha-beta model, module docstring):
    its cross-node steps pay ``latency_s``, the others ``intra_latency_s`` (default: the
    same)."""
    intra = latency_s if intra_latency_s is None else intra_latency_s
    return (algorithm.bytes_factor * size_bytes / bytes_per_s
            + algorithm.inter_steps * latency_s
            + (algorithm.latency_steps - algorithm.inter_steps) * intra
            + algorithm.fixed_latency_s)


def fastest(op: str, n: int, size_bytes: float, *, bytes_per_s: float,
            latency_s: float, nodes: int = 1,
            intra_latency_s: float | None = None, nvls: float = 0.0) -> Algorithm:
    """The algorithm of ``op`` over ``n`` ranks on ``nodes`` nodes that takes least time on
    ``size_bytes`` at ``bytes_per_s`` and one-hop ``latency_s`` (cross-node steps) and
    ``intra_latency_s`` (in-node steps; default the same), the first listed on a tie."""
    return min(algorithms(op, n, nodes, nvls), key=lambda a: algorithm_s(
        a, size_bytes, bytes_per_s=bytes_per_s, latency_s=latency_s,
        intra_latency_s=intra_latency_s))


def collective_s(op: str, n: int, size_bytes: float, *, bytes_per_s: float,
                 latency_s: float, nodes: int = 1,
                 intra_latency_s: float | None = None, nvls: float = 0.0) -> float:
    """Seconds of ``op`` on ``size_bytes`` over ``n`` ranks: its ``fastest`` algorithm's time;
    0 for one rank or no bytes."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    # the least time over the algorithms: ``fastest``'s time, without a second evaluation
    return min(algorithm_s(a, size_bytes, bytes_per_s=bytes_per_s, latency_s=latency_s,
                           intra_latency_s=intra_latency_s)
               for a in algorithms(op, n, nodes, nvls))


def link_collective_s(op: str, link: GroupLink, size_bytes: float, *, intra_eff: float,
                      inter_eff: float) -> float:
    """Seconds of ``op`` on ``size_bytes`` over the group ``link`` (hierarchical latency)."""
    intra, inter = link.step_latencies()
    return collective_s(op, link.size, size_bytes, nodes=link.nodes, latency_s=inter,
                        intra_latency_s=intra, nvls=link.nvls_efficiency,
                        bytes_per_s=effective_bytes_per_s(link, intra_eff=intra_eff,
                                                          inter_eff=inter_eff))


def call_latency_s(op: str, link: GroupLink) -> float:
    """The latency part of one call of ``op`` over ``link`` (what a message of no bytes
    would cost): the fewest-latency algorithm's steps times their hop latencies."""
    if link.size <= 1:
        return 0.0
    intra, inter = link.step_latencies()
    return min(algorithm_s(a, 0.0, bytes_per_s=1.0, latency_s=inter, intra_latency_s=intra)
               for a in algorithms(op, link.size, link.nodes, link.nvls_efficiency))


def effective_bytes_per_s(link: GroupLink, *, intra_eff: float, inter_eff: float) -> float:
    """Bandwidth a ring over ``link`` achieves: the slower of the in-node link and the
    node's parallel NIC channels, each times its calibrated efficiency."""
    return min(link.intra_bytes_per_s * intra_eff,
               link.per_node * link.inter_bytes_per_s * inter_eff)


def all_reduce_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                 inter_eff: float) -> float:
    """All-reduce of ``size_bytes`` per rank: the faster of ring and double binary tree."""
    return link_collective_s("all_reduce", link, size_bytes, intra_eff=intra_eff,
                             inter_eff=inter_eff)


def all_gather_s(link: GroupLink, size_bytes: float, *, intra_eff: float,
                 inter_eff: float) -> float:
    """All-gather producing ``size_bytes`` (the full, gathered buffer) on each rank.

    Reduce-scatter of a ``size_bytes`` input costs the same.
    """
    return link_collective_s("all_gather", link, size_bytes, intra_eff=intra_eff,
                             inter_eff=inter_eff)


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
