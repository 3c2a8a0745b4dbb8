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

from meshplan.costmodel.jsonio import read_json_object, read_package_json

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
        for name in ("nodes", "gpus_per_node", "nics_per_node", "nodes_per_leaf"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"cluster {self.name!r}: {name} must be a positive integer, "
                                 f"got {value!r}")
        for name in ("nic_bytes_per_s", "pcie_bytes_per_s", "nvme_bytes_per_s",
                     "host_flop_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cluster {self.name!r}: {name} must be > 0, "
                                 f"got {getattr(self, name)!r}")
        if self.spine_oversubscription < 1.0:
            raise ValueError(f"cluster {self.name!r}: spine_oversubscription must be >= 1, "
                             f"got {self.spine_oversubscription!r}")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    @functools.cached_property
    def graph(self) -> nx.Graph:
        """The topology graph (built once per ClusterSpec)."""
        return build_topology(self)


def build_topology(cluster: ClusterSpec) -> nx.Graph:
    """Return the networkx graph of ``cluster``.

    Vertices: ``("gpu", g)``, ``("nvswitch", n)``, ``("nic", n, r)``, ``("leaf", r, j)``,
    ``("spine", r)``; every vertex has ``kind`` and, where it applies, ``node``. Rail r's NIC of
    every node hangs off that rail's leaf switches (rail-optimised, as in DGX SuperPODs); leaves
    of a rail meet at that rail's spine. Edge ``bytes_per_s`` is what one GPU's flow gets per
    direction: NVLink for GPU-NVSwitch, the NIC for GPU-NIC-leaf, and the NIC divided by
    ``spine_oversubscription`` for leaf-spine.
    """
    import networkx as nx

    g = nx.Graph()
    gpu = cluster.gpu
    rails = min(cluster.nics_per_node, cluster.gpus_per_node)  # NICs with a GPU on them
    nic_share = max(1, cluster.gpus_per_node // rails)
    per_gpu_nic = cluster.nic_bytes_per_s / nic_share
    leaves_per_rail = -(-cluster.nodes // cluster.nodes_per_leaf)
    for node in range(cluster.nodes):
        switch = ("nvswitch", node)
        g.add_node(switch, kind="nvswitch", node=node)
        for local in range(cluster.gpus_per_node):
            gid = node * cluster.gpus_per_node + local
            g.add_node(("gpu", gid), kind="gpu", node=node, local=local)
            g.add_edge(("gpu", gid), switch, bytes_per_s=gpu.nvlink_bytes_per_s,
                       latency_s=cluster.nvlink_latency_s / 2, tier="nvlink")
            if cluster.nodes > 1:
                rail = local % rails
                g.add_edge(("gpu", gid), ("nic", node, rail), bytes_per_s=per_gpu_nic,
                           latency_s=cluster.nic_latency_s / 4, tier="pcie-nic")
        if cluster.nodes == 1:
            continue
        for rail in range(rails):
            nic = ("nic", node, rail)
            g.nodes[nic].update(kind="nic", node=node, rail=rail)
            leaf = ("leaf", rail, node // cluster.nodes_per_leaf)
            g.add_node(leaf, kind="leaf", rail=rail)
            g.add_edge(nic, leaf, bytes_per_s=per_gpu_nic, latency_s=cluster.nic_latency_s / 4,
                       tier="nic-leaf")
    if cluster.nodes > 1 and leaves_per_rail > 1:
        for rail in range(rails):
            spine = ("spine", rail)
            g.add_node(spine, kind="spine", rail=rail)
            for j in range(leaves_per_rail):
                g.add_edge(("leaf", rail, j), spine,
                           bytes_per_s=per_gpu_nic / cluster.spine_oversubscription,
                           latency_s=cluster.nic_latency_s / 4, tier="leaf-spine")
    return g


# ----- catalogs and loading --------------------------------------------------------------------

@functools.cache
def gpu_catalog() -> dict[str, GpuSpec]:
    raw = read_package_json("gpus.json")["gpus"]
    return {key: _gpu_from_dict(key, value) for key, value in raw.items()}


def _gpu_from_dict(key: str, value: dict[str, Any]) -> GpuSpec:
    fields = {f.name: f for f in dataclasses.fields(GpuSpec)}
    allowed = set(fields) - {"key"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"GPU {key!r}: unknown keys {unknown}; accepted: {sorted(allowed)}")
    required = {n for n, f in fields.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING} - {"key"}
    missing = sorted(required - set(value))
    if missing:
        raise ValueError(f"GPU {key!r}: missing keys {missing}")
    return GpuSpec(key=key, **value)


@functools.cache
def _cluster_templates() -> dict[str, dict[str, Any]]:
    return read_package_json("clusters.json")["clusters"]


def cluster_names() -> list[str]:
    return sorted(_cluster_templates())


_CLUSTER_KEYS = {f.name for f in dataclasses.fields(ClusterSpec)}


def cluster_from_dict(data: dict[str, Any], *, name: str, nodes: int | None = None,
                      gpus_per_node: int | None = None) -> ClusterSpec:
    """Build a ClusterSpec from a JSON object (catalog template or user file).

    ``gpu`` is a catalog GPU key or an object with the GpuSpec fields. ``nodes`` defaults to 1.
    """
    unknown = sorted(set(data) - _CLUSTER_KEYS)
    if unknown:
        raise ValueError(f"cluster {name!r}: unknown keys {unknown}; accepted: "
                         f"{sorted(_CLUSTER_KEYS)}")
    values = dict(data)
    values["name"] = values.get("name", name)
    gpu = values.get("gpu")
    if isinstance(gpu, str):
        catalog = gpu_catalog()
        if gpu not in catalog:
            raise ValueError(f"cluster {name!r}: unknown gpu {gpu!r}; known: {sorted(catalog)}")
        values["gpu"] = catalog[gpu]
    elif isinstance(gpu, dict):
        values["gpu"] = _gpu_from_dict(str(gpu.get("key", "custom")),
                                       {k: v for k, v in gpu.items() if k != "key"})
    else:
        raise ValueError(f"cluster {name!r}: 'gpu' must be a catalog name or an object, "
                         f"got {gpu!r}")
    if nodes is not None:
        values["nodes"] = nodes
    values.setdefault("nodes", 1)
    if gpus_per_node is not None:
        values["gpus_per_node"] = gpus_per_node
    try:
        return ClusterSpec(**values)
    except TypeError as err:  # a required key is missing
        raise ValueError(f"cluster {name!r}: {err}") from None


def load_cluster(ref: str, *, nodes: int | None = None,
                 gpus_per_node: int | None = None) -> ClusterSpec:
    """A catalog cluster name (with ``nodes``) or a path to a cluster JSON file."""
    templates = _cluster_templates()
    if ref in templates:
        template = {k: v for k, v in templates[ref].items()}
        return cluster_from_dict(template, name=ref, nodes=nodes, gpus_per_node=gpus_per_node)
    path = Path(ref)
    if path.suffix == ".json" or path.exists():
        data = read_json_object(path, what="cluster")
        return cluster_from_dict(data, name=path.stem, nodes=nodes, gpus_per_node=gpus_per_node)
    near = difflib.get_close_matches(ref, list(templates), n=3, cutoff=0.3)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    raise ValueError(f"unknown cluster {ref!r}{hint} Known: {', '.join(sorted(templates))}, "
                     f"or a path to a cluster JSON file")
