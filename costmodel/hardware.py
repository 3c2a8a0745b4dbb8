"""Hardware as data: ``GpuSpec``, ``ClusterSpec`` and the cluster's networkx topology.

A cluster is ``nodes`` copies of one node design (GPUs on an NVSwitch, one NIC per rail) joined
by a leaf/spine fabric. ``build_topology`` turns that into a graph whose vertices are GPUs,
NVSwitches, NICs, leaf and spine switches, and whose edges carry ``bytes_per_s`` (what one
GPU's flow gets on that link, per direction) and ``latency_s``. Collective costs
(``collectives.py``) read bandwidth and latency off the slowest link a group's traffic crosses.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshplan.costmodel.jsonio import (NON_NEGATIVE, POSITIVE, Limit, Rule, check_object, count,
                                       load_json_document, read_package_json, schema_of)

# ----- upper bounds on the cluster's counts -------------------------------------------------
# Generous but finite: the topology graph has a vertex per GPU, the planner enumerates the
# divisors of the GPU count and the ways to lay degrees on nodes, so ``nodes: 10**30`` would
# never finish; each bound is far above any cluster built or announced.
MAX_GPUS_PER_NODE = 1024
"""GPUs in one node (one NVLink domain): above NVIDIA's 576-GPU NVL576 rack, the largest
announced; DGX nodes have 8, GB200 NVL72 racks 72."""
MAX_NODES = 65536
"""Nodes: 2.5x the ~25,000 eight-GPU nodes of the largest clusters built (~200,000 GPUs)."""
MAX_GPUS = 2**18
"""GPUs in all: 262,144, above the largest clusters built (~200,000 GPUs)."""
CLUSTER_COUNT_LIMITS = {"nodes": count(MAX_NODES, "MAX_NODES"),
                        "gpus_per_node": count(MAX_GPUS_PER_NODE, "MAX_GPUS_PER_NODE"),
                        "nics_per_node": count(MAX_GPUS_PER_NODE, "MAX_GPUS_PER_NODE"),
                        "nodes_per_leaf": count(MAX_NODES, "MAX_NODES")}
"""The values each count of ``ClusterSpec`` may take (``__post_init__`` and the JSON readers)."""

if TYPE_CHECKING:  # networkx is imported where a graph is built: loading a cluster stays light
    import networkx as nx


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator, from its datasheet."""

    key: str
    """Catalog key (``a100-80gb``)."""
    name: str
    """Marketing name."""
    peak_flop_per_s: dict[str, float] = field(hash=False)
    """Dense peak per dtype (``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32``)."""
    hbm_bytes: int
    """Device memory capacity as CUDA reports it."""
    hbm_bytes_per_s: float
    """Device memory bandwidth."""
    nvlink_bytes_per_s: float
    """GPU-to-GPU bandwidth inside a node, per direction."""
    nvls_efficiency: float = 0.0
    """NCCL's NVLS efficiency for this GPU generation (``nvlsEfficiency`` in NCCL's
    ``src/graph/tuning.cc``: 0.85 Hopper, 0.74 Blackwell) where its NVSwitch node reduces in
    the switch (NVLink SHARP: HGX/DGX H100, H200, B200); 0: no NVLS, all-reduces run as ring
    or tree (``collectives.algorithms``)."""
    source: str = ""

    def __post_init__(self) -> None:
        if self.hbm_bytes <= 0 or self.hbm_bytes_per_s <= 0 or self.nvlink_bytes_per_s <= 0:
            raise ValueError(f"GPU {self.key!r}: hbm_bytes, hbm_bytes_per_s and "
                             f"nvlink_bytes_per_s must be > 0")
        if not self.peak_flop_per_s or any(v <= 0 for v in self.peak_flop_per_s.values()):
            raise ValueError(f"GPU {self.key!r}: peak_flop_per_s needs positive values per dtype, "
                             f"got {self.peak_flop_per_s!r}")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; bf16 falls back to fp16 and vice versa."""
        for key in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype), "fp32"):
            if key in self.peak_flop_per_s:
                return self.peak_flop_per_s[key]
        raise ValueError(f"GPU {self.key!r} has no peak for dtype {dtype!r}; "
                         f"known: {sorted(self.peak_flop_per_s)}")


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A homogeneous cluster: ``nodes`` x ``gpus_per_node`` GPUs and how they are linked."""

    name: str
    gpu: GpuSpec
    nodes: int
    gpus_per_node: int
    nvlink_latency_s: float
    """Latency of one GPU-to-GPU hop inside a node."""
    nics_per_node: int
    """Compute NICs per node; GPU i uses NIC ``i % nics_per_node``."""
    nic_bytes_per_s: float
    """Bandwidth of one NIC, per direction."""
    nic_latency_s: float
    """Latency of one inter-node message (NIC + switch hops)."""
    nodes_per_leaf: int = 4
    """Nodes under one leaf switch (per rail); beyond that traffic crosses the spine."""
    spine_oversubscription: float = 1.0
    """Leaf-to-spine oversubscription (1.0 = full bisection; 7.0 = 1:7)."""
    pcie_bytes_per_s: float = 25e9
    """Host-device copy bandwidth per GPU (offload traffic)."""
    host_bytes: int = 1 << 40
    """Host (CPU) memory per node."""
    nvme_bytes: int = 0
    """Local NVMe capacity per node."""
    nvme_bytes_per_s: float = 5e9
    """NVMe read/write bandwidth per node."""
    host_flop_per_s: float = 1e12
    """What the node's CPUs achieve on an offloaded Adam step (FLOP/s)."""
    source: str = ""

    def __post_init__(self) -> None:
        for name, limit in CLUSTER_COUNT_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"cluster {self.name!r}: {name} must be a positive integer, "
                                 f"got {value!r}")
            if value > limit.maximum:
                raise ValueError(f"cluster {self.name!r}: {name} must be at most "
                                 f"{limit.maximum} ({limit.name}), got {value!r}")
        if self.nodes * self.gpus_per_node > MAX_GPUS:
            raise ValueError(f"cluster {self.name!r}: {self.nodes} nodes x {self.gpus_per_node} "
                             f"GPUs is more than {MAX_GPUS} GPUs (MAX_GPUS)")
        for name in ("nic_bytes_per_s", "pcie_bytes_per_s", "nvme_bytes_per_s",
                     "host_flop_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cluster {self.name!r}: {name} must be > 0, "
                                 f"got {getattr(self, name)!r}")
        if self.spine_oversubscription < 1.0:
            raise ValueError(f"cluster {self.name!r}: spine_oversubscription must be >= 1, "
                             f"got {self.spine_oversubscription!r}")

    def __hash__(self) -> int:
        """The fields' hash, computed once: clusters key the collective and link caches,
        which the planner reads hundreds of thousands of times per search."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        """The fields only: string hashes differ between processes, and the cached graphs
        are rebuilt on demand."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    @functools.cached_property
    def graph(self) -> nx.Graph:
        """The topology graph (built once per ClusterSpec)."""
        return build_topology(self)

    @functools.cached_property
    def path_graph(self) -> tuple[dict[tuple, list[tuple]], int]:
        """(adjacency, far node): the topology of the smallest cluster of this design in
        which every kind of GPU pair occurs (``pair_kind_gpus``), as each vertex's
        ``(neighbour, bytes_per_s, latency_s)`` list in ``topology``'s edge order, and the
        node under another leaf than node 0 (node 1 shares node 0's leaf whenever two nodes
        can).

        Every node is a copy of one design and every leaf of a rail meets the same spine, so
        the path between two GPUs depends only on their local indices and on whether they
        share a node or a leaf: node 0, node 1 and the first node of the second leaf stand
        for every pair, and a 16,384-GPU cluster's paths come from a graph of a few dozen
        GPUs, built without networkx."""
        npl = self.nodes_per_leaf
        nodes = 1 if self.nodes == 1 else 2 if self.nodes <= npl else npl + 1
        small = self if nodes == self.nodes else dataclasses.replace(self, nodes=nodes)
        adjacency: dict[tuple, list[tuple]] = {}
        for a, b, bytes_per_s, latency_s, _ in topology(small)[1]:
            adjacency.setdefault(a, []).append((b, bytes_per_s, latency_s))
            adjacency.setdefault(b, []).append((a, bytes_per_s, latency_s))
        return adjacency, min(npl, nodes - 1)

    def pair_kind_gpus(self, same_node: bool, local_u: int, local_v: int,
                       same_leaf: bool) -> tuple[int, int]:
        """Two GPUs of ``path_graph`` whose path is that of every pair of this kind: GPU
        ``local_u`` of node 0 and GPU ``local_v`` of node 0 (same node), of node 1 (same
        leaf) or of the graph's far node (another leaf)."""
        gpn = self.gpus_per_node
        if same_node:
            return local_u, local_v
        node = 1 if same_leaf else self.path_graph[1]
        return local_u, node * gpn + local_v


def build_topology(cluster: ClusterSpec) -> nx.Graph:
    """Return the networkx graph of ``cluster``.

    Vertices: ``("gpu", g)``, ``("nvswitch", n)``, ``("nic", n, r)``, ``("leaf", r, j)``,
    ``("spine", r)``; every vertex has ``kind`` and, where it applies, ``node``. Rail r's NIC of
    every node hangs off that rail's leaf switches (rail-optimised, as in DGX SuperPODs); leaves
    of a rail meet at that rail's spine. Edge ``bytes_per_s`` is what one GPU's flow gets per
    direction: NVLink for GPU-NVSwitch, the NIC for GPU-NIC-leaf, and the NIC divided by
    ``spine_oversubscription`` for leaf-spine (``topology``: the vertices and edges).
    """
    import networkx as nx

    vertices, edges = topology(cluster)
    g = nx.Graph()
    g.add_nodes_from(vertices.items())
    for a, b, bytes_per_s, latency_s, tier in edges:
        g.add_edge(a, b, bytes_per_s=bytes_per_s, latency_s=latency_s, tier=tier)
    return g


def topology(cluster: ClusterSpec) -> tuple[dict[tuple, dict[str, Any]], list[tuple]]:
    """The vertices of ``cluster``'s topology with their attributes, and its edges as
    ``(a, b, bytes_per_s, latency_s, tier)`` (``build_topology`` makes the graph of them)."""
    gpu = cluster.gpu
    rails = min(cluster.nics_per_node, cluster.gpus_per_node)  # NICs with a GPU on them
    nic_share = max(1, cluster.gpus_per_node // rails)
    per_gpu_nic = cluster.nic_bytes_per_s / nic_share
    leaves_per_rail = -(-cluster.nodes // cluster.nodes_per_leaf)
    vertices: dict[tuple, dict[str, Any]] = {}
    edges: list[tuple] = []
    for node in range(cluster.nodes):
        switch = ("nvswitch", node)
        vertices[switch] = {"kind": "nvswitch", "node": node}
        for local in range(cluster.gpus_per_node):
            gid = ("gpu", node * cluster.gpus_per_node + local)
            vertices[gid] = {"kind": "gpu", "node": node, "local": local}
            edges.append((gid, switch, gpu.nvlink_bytes_per_s, cluster.nvlink_latency_s / 2,
                          "nvlink"))
            if cluster.nodes > 1:
                nic = ("nic", node, local % rails)
                vertices.setdefault(nic, {})
                edges.append((gid, nic, per_gpu_nic, cluster.nic_latency_s / 4, "pcie-nic"))
        if cluster.nodes == 1:
            continue
        for rail in range(rails):
            nic = ("nic", node, rail)
            vertices.setdefault(nic, {}).update(kind="nic", node=node, rail=rail)
            leaf = ("leaf", rail, node // cluster.nodes_per_leaf)
            vertices[leaf] = {"kind": "leaf", "rail": rail}
            edges.append((nic, leaf, per_gpu_nic, cluster.nic_latency_s / 4, "nic-leaf"))
    if cluster.nodes > 1 and leaves_per_rail > 1:
        for rail in range(rails):
            spine = ("spine", rail)
            vertices[spine] = {"kind": "spine", "rail": rail}
            for j in range(leaves_per_rail):
                edges.append((("leaf", rail, j), spine,
                               per_gpu_nic / cluster.spine_oversubscription,
                               cluster.nic_latency_s / 4, "leaf-spine"))
    return vertices, edges


# ----- catalogs and loading --------------------------------------------------------------------

GPU_SCHEMA = schema_of(
    GpuSpec, limits={"peak_flop_per_s": POSITIVE, "hbm_bytes": POSITIVE,
                     "hbm_bytes_per_s": POSITIVE, "nvlink_bytes_per_s": POSITIVE,
                     "nvls_efficiency": Limit(minimum=0, maximum=1)},
    required=("name", "peak_flop_per_s", "hbm_bytes", "hbm_bytes_per_s", "nvlink_bytes_per_s"))
"""A GPU object (``gpus.json`` entry, a cluster's ``gpu`` object): ``key`` is optional (the
catalog's key, ``custom`` in a cluster file)."""
CLUSTER_SCHEMA = schema_of(
    ClusterSpec,
    limits={**CLUSTER_COUNT_LIMITS, "nvlink_latency_s": NON_NEGATIVE,
            "nic_bytes_per_s": POSITIVE, "nic_latency_s": NON_NEGATIVE,
            "spine_oversubscription": Limit(minimum=1), "pcie_bytes_per_s": POSITIVE,
            "host_bytes": POSITIVE, "nvme_bytes": NON_NEGATIVE, "nvme_bytes_per_s": POSITIVE,
            "host_flop_per_s": POSITIVE},
    rules={"gpu": Rule(kind="union", alternatives=(Rule(kind="str"),
                                                   Rule(kind="object", schema=GPU_SCHEMA)))},
    required=("gpu", "gpus_per_node", "nvlink_latency_s", "nics_per_node", "nic_bytes_per_s",
              "nic_latency_s"))
"""A cluster JSON object (catalog template, user file, a plan file's ``cluster``): the
ClusterSpec fields; ``gpu`` a catalog GPU key or a GPU object; ``name`` defaults to the file
stem, ``nodes`` to 1."""


@functools.cache
def gpu_catalog() -> dict[str, GpuSpec]:
    origin = "costmodel/data/gpus.json"
    raw = read_package_json("gpus.json")["gpus"]
    for key, value in raw.items():
        check_object(value, GPU_SCHEMA, origin=f"{origin} gpu {key!r}")
    return {key: _gpu_from_dict(key, value, origin=f"{origin} gpu {key!r}")
            for key, value in raw.items()}


def _gpu_from_dict(key: str, value: dict[str, Any], *, origin: str) -> GpuSpec:
    """A GpuSpec from a GPU object already checked against ``GPU_SCHEMA``."""
    fields = {k: v for k, v in value.items() if k != "key"}
    try:
        return GpuSpec(key=key, **fields)
    except ValueError as err:
        raise ValueError(f"{origin}: {err}") from None


@functools.cache
def _cluster_templates() -> dict[str, dict[str, Any]]:
    return read_package_json("clusters.json")["clusters"]


def cluster_names() -> list[str]:
    return sorted(_cluster_templates())


def cluster_from_dict(data: dict[str, Any], *, name: str, nodes: int | None = None,
                      gpus_per_node: int | None = None, origin: str | None = None) -> ClusterSpec:
    """Build a ClusterSpec from a JSON object (catalog template or user file).

    ``data`` is checked against ``CLUSTER_SCHEMA``; ``gpu`` is a catalog GPU key or an object
    with the GpuSpec fields. ``nodes`` (default: the object's, else 1) and ``gpus_per_node``
    override the object's. ``origin`` (a file; default ``cluster 'name'``) starts every
    message.
    """
    label = origin or f"cluster {name!r}"
    check_object(data, CLUSTER_SCHEMA, origin=label)
    values = dict(data)
    values["name"] = values.get("name", name)
    gpu = values["gpu"]
    if isinstance(gpu, str):
        catalog = gpu_catalog()
        if gpu not in catalog:
            raise ValueError(f"{label}: unknown gpu {gpu!r}; known: {sorted(catalog)}, or a "
                             f"GPU object")
        values["gpu"] = catalog[gpu]
    elif not isinstance(gpu, GpuSpec):
        values["gpu"] = _gpu_from_dict(str(gpu.get("key", "custom")), gpu, origin=label)
    if nodes is not None:
        values["nodes"] = nodes
    values.setdefault("nodes", 1)
    if gpus_per_node is not None:
        values["gpus_per_node"] = gpus_per_node
    try:
        return ClusterSpec(**values)
    except ValueError as err:  # its messages name the cluster; add the file, if any
        if origin is None:
            raise
        raise ValueError(f"{origin}: {err}") from None


def load_cluster(ref: str, *, nodes: int | None = None,
                 gpus_per_node: int | None = None) -> ClusterSpec:
    """A catalog cluster name (with ``nodes``) or a path to a cluster JSON file."""
    templates = _cluster_templates()
    if ref in templates:
        template = {k: v for k, v in templates[ref].items()}
        return cluster_from_dict(template, name=ref, nodes=nodes, gpus_per_node=gpus_per_node)
    path = Path(ref)
    if path.suffix == ".json" or path.exists():
        data = load_json_document(path, what="cluster")
        return cluster_from_dict(data, name=path.stem, nodes=nodes, gpus_per_node=gpus_per_node,
                                 origin=str(path))
    near = difflib.get_close_matches(ref, list(templates), n=3, cutoff=0.3)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    raise ValueError(f"unknown cluster {ref!r}{hint} Known: {', '.join(sorted(templates))}, "
                     f"or a path to a cluster JSON file")
