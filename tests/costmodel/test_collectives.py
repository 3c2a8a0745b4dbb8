"""Collective costs on the cluster graph: placement matters, and the alpha-beta numbers are right.

Hand-computed values use the link numbers of the catalog JSON files themselves
(``costmodel/data/clusters.json`` and ``gpus.json``), read here with ``json``, and the formulas
of Thakur et al. 2005 (ring all-reduce ``2 (n-1)/n S/B + 2 (n-1) alpha``, all-gather
``(n-1)/n S/B + (n-1) alpha``) and of the double binary tree (``2 S/B + 2 log2(n) alpha``).
The profile fit (``fitting.fit_alpha_beta``) must give back the link behind samples made by
these very functions, for every group size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from importlib import resources

import pytest

from meshplan.costmodel import collectives as coll
from meshplan.costmodel import fitting
from meshplan.costmodel.calibration import default_calibration
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.layout import axis_group, dp_cp_ranks
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model

EXACT = 1e-12
CLUSTER = "dgx-a100-80gb"
RAW = 1.0
"""Link efficiency 1: the raw datasheet bandwidth, for hand-computed values."""


def _catalog_json(name: str) -> dict:
    return json.loads(resources.files("meshplan.costmodel.data").joinpath(name).read_text())


@pytest.fixture(scope="module")
def links() -> dict[str, float]:
    """The DGX A100 numbers as the catalog files state them."""
    template = _catalog_json("clusters.json")["clusters"][CLUSTER]
    gpu = _catalog_json("gpus.json")["gpus"][template["gpu"]]
    assert template["nics_per_node"] == template["gpus_per_node"]  # one NIC (rail) per GPU
    return {"nvlink_bytes_per_s": gpu["nvlink_bytes_per_s"],
            "nvlink_latency_s": template["nvlink_latency_s"],
            "nic_bytes_per_s": template["nic_bytes_per_s"],
            "nic_latency_s": template["nic_latency_s"],
            "nodes_per_leaf": template["nodes_per_leaf"],
            "gpus_per_node": template["gpus_per_node"]}


def _effs() -> dict[str, float]:
    cal = default_calibration()
    return dict(intra_eff=cal.nvlink_efficiency, inter_eff=cal.network_efficiency)


# ----- placement ---------------------------------------------------------------------------------
def test_tp_all_reduce_inside_a_node_is_far_cheaper_than_across_nodes(links):
    cluster = load_cluster(CLUSTER, nodes=8)
    gpn = links["gpus_per_node"]
    inside = coll.group_link(cluster, tuple(range(8)))
    spread = coll.group_link(cluster, tuple(node * gpn for node in range(8)))
    assert (inside.nodes, spread.nodes, spread.per_node) == (1, 8, 1)
    size_bytes = 2 * 2048 * 12288  # one GPT-3 hidden state of a 2048-token micro-batch, bf16
    t_inside = coll.all_reduce_s(inside, size_bytes, **_effs())
    t_spread = coll.all_reduce_s(spread, size_bytes, **_effs())
    assert t_spread > 5 * t_inside


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_dp_group_with_eight_members_per_node_gets_eight_nics(links, nodes):
    """NCCL runs one ring channel per member's NIC on a rail-optimised DGX."""
    cluster = load_cluster(CLUSTER, nodes=nodes)
    config = ParallelConfig(dp=nodes * 8, global_batch_size=nodes * 8)
    link = coll.group_link(cluster, axis_group(config, "dp"))
    assert (link.size, link.nodes, link.per_node) == (nodes * 8, nodes, 8)
    assert link.inter_bytes_per_s == links["nic_bytes_per_s"]
    assert link.ring_bytes_per_s == 8 * links["nic_bytes_per_s"]
    # With tp 8 inside the node, the dp group has one member per node: one NIC.
    tp_outer = ParallelConfig(tp=8, dp=nodes, global_batch_size=nodes)
    single = coll.group_link(cluster, axis_group(tp_outer, "dp"))
    assert (single.per_node, single.ring_bytes_per_s) == (1, links["nic_bytes_per_s"])


def test_tp_inside_node_beats_tp_across_nodes_in_estimate():
    """With many micro-batches per step the per-layer TP traffic outweighs the once-per-step
    data-parallel reduction that the other layout keeps inside a node."""
    model = load_model("megatron-7.5b")
    cluster = load_cluster(CLUSTER, nodes=2)
    inner = ParallelConfig(tp=8, dp=2, sp=True, micro_batch_size=1, global_batch_size=128,
                           seq_len=2048, mesh_order=("tp", "cp", "dp", "pp"))
    outer = inner.replace(mesh_order=("pp", "dp", "cp", "tp"))
    assert coll.group_link(cluster, axis_group(inner, "tp")).nodes == 1
    assert coll.group_link(cluster, axis_group(outer, "tp")).nodes == 2
    fast = estimate(model, cluster, inner)
    slow = estimate(model, cluster, outer)
    assert fast.time.tp_comm_s < slow.time.tp_comm_s
    assert fast.time.step_s < slow.time.step_s


# ----- alpha-beta values by hand -----------------------------------------------------------------
def ring_all_reduce_s(n: int, size_bytes: float, bandwidth: float, alpha: float) -> float:
    return 2 * (n - 1) / n * size_bytes / bandwidth + 2 * (n - 1) * alpha


def tree_all_reduce_s(n: int, size_bytes: float, bandwidth: float, alpha: float) -> float:
    return 2 * size_bytes / bandwidth + 2 * math.log2(n) * alpha


def test_ring_all_reduce_inside_a_node_by_hand(links):
    """Four GPUs on one NVSwitch: bandwidth NVLink, one hop GPU-switch-GPU = nvlink latency."""
    cluster = load_cluster(CLUSTER, nodes=1)
    link = coll.group_link(cluster, (0, 1, 2, 3))
    size_bytes = 1e9
    bandwidth, alpha = links["nvlink_bytes_per_s"], links["nvlink_latency_s"]
    assert (link.intra_bytes_per_s, link.latency_s) == (bandwidth, pytest.approx(alpha))
    expected = ring_all_reduce_s(4, size_bytes, bandwidth, alpha)
    assert expected < tree_all_reduce_s(4, size_bytes, bandwidth, alpha)  # ring is chosen
    ours = coll.all_reduce_s(link, size_bytes, intra_eff=RAW, inter_eff=RAW)
    assert ours == pytest.approx(expected, rel=EXACT)


def test_ring_all_reduce_across_nodes_by_hand(links):
    """One GPU on each of 4 nodes under one leaf: GPU-NIC-leaf-NIC-GPU, one NIC each."""
    cluster = load_cluster(CLUSTER, nodes=4)
    gpn = links["gpus_per_node"]
    link = coll.group_link(cluster, (0, gpn, 2 * gpn, 3 * gpn))
    size_bytes = 256e6
    eff = _effs()
    bandwidth = links["nic_bytes_per_s"] * eff["inter_eff"]
    alpha = links["nic_latency_s"]
    expected = ring_all_reduce_s(4, size_bytes, bandwidth, alpha)
    ours = coll.all_reduce_s(link, size_bytes, **eff)
    assert ours == pytest.approx(expected, rel=EXACT)


@pytest.mark.parametrize("order,alpha_hops", [
    ((0, 1, 9, 8), ("nic",)),  # every cross-node hop stays on its rail: 1 -> 9, 8 -> 0
    ((0, 1, 8, 9), ("nvlink", "nic")),  # 1 -> 8 changes rail: through the NVSwitch first
])
def test_ring_all_reduce_two_per_node_by_hand(links, order, alpha_hops):
    """GPUs 0, 1 of node 0 and 0, 1 of node 1 (global 8, 9): two channels across nodes, so the
    slower of NVLink and 2 NICs bounds the ring. Latency is hierarchical (NCCL's tuning
    model): of the ring's 2 (n - 1) = 6 steps, 2 (N - 1) = 2 cross nodes and pay the slowest
    cross-node hop, the other 4 the in-node (NVLink) hop."""
    cluster = load_cluster(CLUSTER, nodes=2)
    assert links["gpus_per_node"] == 8  # global ranks 8 and 9 are node 1's GPUs 0 and 1
    link = coll.group_link(cluster, order)
    assert (link.per_node, link.nodes) == (2, 2)
    size_bytes = 512e6
    eff = _effs()
    bandwidth = min(links["nvlink_bytes_per_s"] * eff["intra_eff"],
                    2 * links["nic_bytes_per_s"] * eff["inter_eff"])
    alpha = sum(links[f"{hop}_latency_s"] for hop in alpha_hops)
    assert link.latency_s == pytest.approx(alpha, rel=EXACT)
    assert link.intra_latency_s == pytest.approx(links["nvlink_latency_s"], rel=EXACT)
    expected = (2 * 3 / 4 * size_bytes / bandwidth + 2 * alpha
                + 4 * links["nvlink_latency_s"])
    ours = coll.all_reduce_s(link, size_bytes, **eff)
    assert ours == pytest.approx(expected, rel=EXACT)


def test_all_gather_latency_grows_with_the_ring_across_nodes(links):
    """A ring all-gather over 8 ranks on each of N nodes pays (8N - N) in-node and N - 1
    cross-node steps (no tree: NCCL runs all-gather as a ring), so a latency-bound call
    costs ~N times more on N nodes."""
    costs = {}
    for nodes in (2, 16, 96):
        cluster = load_cluster(CLUSTER, nodes=nodes)
        link = coll.group_link(cluster, tuple(range(8 * nodes)))
        intra, inter = link.step_latencies()
        assert intra == pytest.approx(links["nvlink_latency_s"])
        expected = (8 * nodes - nodes) * intra + (nodes - 1) * inter
        assert coll.call_latency_s("all_gather", link) == pytest.approx(expected, rel=EXACT)
        costs[nodes] = coll.all_gather_s(link, 1024.0, intra_eff=RAW, inter_eff=RAW)
    assert costs[96] > 40 * costs[2]


def test_small_all_reduce_takes_the_tree(links):
    """For a tiny message latency dominates: 2 log2(8) = 6 steps instead of the ring's 14."""
    cluster = load_cluster(CLUSTER, nodes=1)
    link = coll.group_link(cluster, tuple(range(8)))
    size_bytes = 1024.0
    bandwidth, alpha = links["nvlink_bytes_per_s"], links["nvlink_latency_s"]
    expected = tree_all_reduce_s(8, size_bytes, bandwidth, alpha)
    assert expected < ring_all_reduce_s(8, size_bytes, bandwidth, alpha)
    ours = coll.all_reduce_s(link, size_bytes, intra_eff=RAW, inter_eff=RAW)
    assert ours == pytest.approx(expected, rel=EXACT)


def test_all_gather_reduce_scatter_and_send_by_hand(links):
    cluster = load_cluster(CLUSTER, nodes=1)
    link = coll.group_link(cluster, (0, 1, 2, 3))
    size_bytes = 1e9
    bandwidth, alpha = links["nvlink_bytes_per_s"], links["nvlink_latency_s"]
    expected = 3 / 4 * size_bytes / bandwidth + 3 * alpha  # n - 1 = 3 < 2 log2 4 = 4 steps
    for op in (coll.all_gather_s, coll.reduce_scatter_s):
        assert op(link, size_bytes, intra_eff=RAW, inter_eff=RAW) == pytest.approx(expected,
                                                                                  rel=EXACT)
    pair = coll.group_link(cluster, (0, 1))
    assert coll.send_recv_s(pair, size_bytes, intra_eff=RAW, inter_eff=RAW) == pytest.approx(
        size_bytes / bandwidth + alpha, rel=EXACT)


def test_crossing_the_spine_costs_oversubscription_and_two_more_hops(links):
    """Nodes under different leaves: GPU-NIC-leaf-spine-leaf-NIC-GPU, six quarter-latency
    hops, and the leaf-spine link is the NIC divided by the oversubscription."""
    oversubscription = 4.0
    base = load_cluster(CLUSTER, nodes=2 * links["nodes_per_leaf"])
    cluster = dataclasses.replace(base, spine_oversubscription=oversubscription)
    far = links["nodes_per_leaf"] * links["gpus_per_node"]  # first GPU under the second leaf
    link = coll.group_link(cluster, (0, far))
    assert link.inter_bytes_per_s == pytest.approx(links["nic_bytes_per_s"] / oversubscription)
    assert link.latency_s == pytest.approx(6 / 4 * links["nic_latency_s"])
    size_bytes = 64e6
    ours = coll.send_recv_s(link, size_bytes, intra_eff=RAW, inter_eff=RAW)
    assert ours == pytest.approx(size_bytes / link.inter_bytes_per_s + link.latency_s,
                                 rel=EXACT)


@pytest.mark.parametrize("n", [4, 8, 16])
def test_all_reduce_switches_from_tree_to_ring_at_the_crossover(n):
    """tree < ring <=> (2/n) S/B < 2 (n - 1 - log2 n) alpha <=> S < n (n - 1 - log2 n) alpha B."""
    bandwidth, alpha = 100e9, 5e-6
    crossover = n * (n - 1 - math.log2(n)) * alpha * bandwidth
    pick = {size: coll.fastest("all_reduce", n, size, bytes_per_s=bandwidth, latency_s=alpha).name
            for size in (0.99 * crossover, 1.01 * crossover)}
    assert pick == {0.99 * crossover: "double_binary_tree", 1.01 * crossover: "ring"}


def test_coefficients_without_a_size_only_where_one_algorithm_always_wins():
    assert fitting.collective_coefficients("all_reduce", 2) == (1.0, 2.0)  # ring: fewer bytes
    assert fitting.collective_coefficients("all_gather", 8) == (7 / 8, 7.0)  # the ring only
    with pytest.raises(ValueError, match="depending on the message size"):
        fitting.collective_coefficients("all_reduce", 8)
    assert fitting.collective_coefficients("all_reduce", 8, 1024.0, bytes_per_s=1e11,
                                           latency_s=5e-6) == (2.0, 6.0)


# ----- the profile fit charges what the estimator charges -----------------------------------------
FIT_REL = 0.01
"""The fit must recover alpha and B, and reproduce its samples, within 1 %."""
FIT_BYTES_PER_S = 150e9
"""Bandwidth of the synthetic link (NVLink-like)."""
FIT_LATENCY_S = 8e-6
"""One-hop latency of the synthetic link."""
FIT_SIZES_BYTES = tuple(4.0 ** k for k in range(5, 15))
"""1 KiB to 256 MiB: below and above the ring/tree crossover of every group size."""
ESTIMATOR_OPS = {"all_reduce": coll.all_reduce_s, "all_gather": coll.all_gather_s,
                 "reduce_scatter": coll.reduce_scatter_s, "all_to_all": coll.all_to_all_s,
                 "send_recv": coll.send_recv_s}


def _node_link(n: int, *, bytes_per_s: float, latency_s: float) -> coll.GroupLink:
    """``n`` ranks of one node on links of ``bytes_per_s`` and ``latency_s``."""
    return coll.GroupLink(size=n, nodes=1, intra_bytes_per_s=bytes_per_s,
                          inter_bytes_per_s=math.inf, per_node=n, latency_s=latency_s)


def _estimator_samples(n: int, ops) -> list[tuple[str, int, float, float]]:
    """``(op, n, size_bytes, seconds)`` as the estimator's own functions charge them."""
    link = _node_link(n, bytes_per_s=FIT_BYTES_PER_S, latency_s=FIT_LATENCY_S)
    return [(op, n, size, ESTIMATOR_OPS[op](link, size, intra_eff=RAW, inter_eff=RAW))
            for op in ops for size in FIT_SIZES_BYTES]


@pytest.mark.parametrize("ops", [("all_reduce",),
                                 ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")],
                         ids=["all_reduce", "all_ops"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_alpha_beta_recovers_the_link_the_estimator_charges(n, ops):
    """Samples made by the estimator's collective functions (small all-reduces take the
    double binary tree: 2 log2 n latency steps, not the ring's 2 (n - 1)) give back the link's
    alpha and B, and the estimator with the fitted link reproduces every sample."""
    samples = _estimator_samples(n, ops)
    assert any(t < ring_all_reduce_s(n, size, FIT_BYTES_PER_S, FIT_LATENCY_S)
               for op, _, size, t in samples if op == "all_reduce") == (n > 2)  # tree used
    bytes_per_s, latency_s = fitting.fit_alpha_beta(samples)
    assert bytes_per_s == pytest.approx(FIT_BYTES_PER_S, rel=FIT_REL)
    assert latency_s == pytest.approx(FIT_LATENCY_S, rel=FIT_REL)
    fitted = _node_link(n, bytes_per_s=bytes_per_s, latency_s=latency_s)
    for op, _, size, seconds in samples:
        predicted = ESTIMATOR_OPS[op](fitted, size, intra_eff=RAW, inter_eff=RAW)
        assert predicted == pytest.approx(seconds, rel=FIT_REL), (op, size)


def test_fit_profile_of_a_node_recovers_its_link_from_groups_of_two_four_and_eight():
    """What ``meshplan profile`` measures on one 8-GPU node: every op on groups of 2, 4, 8."""
    samples = (_estimator_samples(2, ESTIMATOR_OPS) + _estimator_samples(4, ESTIMATOR_OPS)
               + _estimator_samples(8, ESTIMATOR_OPS))
    samples = [s for s in samples if s[0] != "send_recv" or s[1] == 2]
    fit = fitting.fit_profile(gemm=[(1e6, 1e-5), (1e9, 1e-2)], copy=(2e9, 0.05),
                              collectives=[("intra", *s) for s in samples])
    assert fit.links["intra"].bytes_per_s == pytest.approx(FIT_BYTES_PER_S, rel=FIT_REL)
    assert fit.links["intra"].latency_s == pytest.approx(FIT_LATENCY_S, rel=FIT_REL)


# ----- NVLS: NCCL's in-switch all-reduce on NVSwitch nodes that reduce ----------------------------
NCCL_NVLS_EFFICIENCY = {"h100-sxm": 0.85, "h100-hbm2e-96gb": 0.85, "h200": 0.85, "b200": 0.74}
"""NVIDIA/nccl src/graph/tuning.cc ``nvlsEfficiency``: Hopper 0.85, Blackwell 0.74 (Ampere 0)."""
NCCL_NVLS_LATENCY_S = 25e-6
"""tuning.cc: NVLS base latency 0, ``hwLatencies[NVLINK][NVLS][SIMPLE]`` 25 us."""


def test_catalog_gpus_carry_nccls_nvls_efficiency():
    gpus = _catalog_json("gpus.json")["gpus"]
    assert {key: gpu["nvls_efficiency"] for key, gpu in gpus.items()
            if "nvls_efficiency" in gpu} == NCCL_NVLS_EFFICIENCY


@pytest.mark.parametrize("cluster_name,gpu", [("dgx-h100", "h100-sxm"), ("dgx-b200", "b200")])
def test_all_reduce_inside_an_nvls_node_runs_nvls_at_nccls_bandwidth(cluster_name, gpu):
    """NCCL's tuning model: NVLS bus bandwidth = 2 x efficiency x the ring's (the switch
    reduces; two operations pipeline), algorithm bandwidth = bus x n / (2 (n - 1)), plus 25 us.
    A large all-reduce of the node's 8 GPUs takes that; a small one the tree or NVLS,
    whichever is less."""
    cluster = load_cluster(cluster_name, nodes=2)
    link = coll.group_link(cluster, tuple(range(8)))
    assert link.nodes == 1 and link.nvls_efficiency == NCCL_NVLS_EFFICIENCY[gpu]
    n, size = 8, 1e9
    bus = 2 * NCCL_NVLS_EFFICIENCY[gpu] * link.intra_bytes_per_s
    nvls = size / (bus * n / (2 * (n - 1))) + NCCL_NVLS_LATENCY_S
    ring = 2 * (n - 1) / n * size / link.intra_bytes_per_s + 2 * (n - 1) * link.latency_s
    assert nvls < ring
    assert coll.all_reduce_s(link, size, intra_eff=RAW, inter_eff=RAW) == pytest.approx(
        nvls, rel=EXACT)
    tree_latency = 2 * math.log2(n) * link.latency_s
    assert coll.call_latency_s("all_reduce", link) == pytest.approx(
        min(tree_latency, NCCL_NVLS_LATENCY_S), rel=EXACT)
    # the ring ops are unchanged: all-gather of the same node
    assert coll.all_gather_s(link, size, intra_eff=RAW, inter_eff=RAW) == pytest.approx(
        (n - 1) / n * size / link.intra_bytes_per_s + (n - 1) * link.latency_s, rel=EXACT)


def test_no_nvls_across_nodes_or_without_a_reducing_switch():
    """NVLS tree (across nodes) is not modelled, and an A100 node's NVSwitch does not
    reduce: both keep ring and tree."""
    spanning = coll.group_link(load_cluster("dgx-h100", nodes=2), tuple(range(16)))
    a100 = coll.group_link(load_cluster(CLUSTER, nodes=1), tuple(range(8)))
    for link in (spanning, a100):
        assert link.nvls_efficiency == 0.0
        assert "nvls" not in {a.name for a in coll.algorithms(
            "all_reduce", link.size, link.nodes, link.nvls_efficiency)}


def test_profile_fit_of_an_nvls_node_recovers_its_link():
    """On an NVLS node the estimator charges large in-node all-reduces as NVLS; the profile
    fit, told the GPU's efficiency, gives back the link behind such samples, where a fit that
    assumed ring and tree would not."""
    nvls = NCCL_NVLS_EFFICIENCY["h100-sxm"]
    samples = []
    for n in (2, 4, 8):
        link = dataclasses.replace(
            _node_link(n, bytes_per_s=FIT_BYTES_PER_S, latency_s=FIT_LATENCY_S),
            nvls_efficiency=nvls)
        samples += [(op, n, size, ESTIMATOR_OPS[op](link, size, intra_eff=RAW, inter_eff=RAW))
                    for op in ("all_reduce", "all_gather", "reduce_scatter")
                    for size in FIT_SIZES_BYTES]
    fit = fitting.fit_profile(gemm=[(1e6, 1e-5), (1e9, 1e-2)], copy=(2e9, 0.05),
                              collectives=[("intra", *s) for s in samples], nvls=nvls)
    assert fit.links["intra"].bytes_per_s == pytest.approx(FIT_BYTES_PER_S, rel=FIT_REL)
    assert fit.links["intra"].latency_s == pytest.approx(FIT_LATENCY_S, rel=FIT_REL)
    blind = fitting.fit_alpha_beta(samples)
    assert blind[0] > 1.1 * FIT_BYTES_PER_S


# ----- offload: host memory bandwidth and host-copy buffers ----------------------------------------
def test_host_adam_is_bound_by_host_memory_bandwidth():
    """7B parameters offloaded from one DGX A100 node: the host step moves 28 bytes per
    parameter at the node's host memory rate, ~10x slower than the FLOP bound."""
    model = load_model("llama2-7b")
    cluster = load_cluster(CLUSTER, nodes=1)
    cal = default_calibration()
    config = ParallelConfig(dp=8, zero_stage=2, offload="optimizer", micro_batch_size=1,
                            global_batch_size=8, seq_len=4096)
    est = estimate(model, cluster, config, framework="deepspeed", calibration=cal)
    params = model.num_params
    host_s = params * cal.host_adam_bytes_per_param / cal.host_memory_bytes_per_s["a100-80gb"]
    assert host_s > 5 * params * cal.host_adam_flop_per_param / cluster.host_flop_per_s
    assert est.time.offload_s >= host_s


def test_pageable_host_copies_are_slower_and_a_profile_overrides_pinned():
    cal = default_calibration()
    assert cal.host_copy_rate(25e9, pinned=True) == 25e9
    assert cal.host_copy_rate(25e9, pinned=False) < 25e9
    measured = dataclasses.replace(cal, host_copy_bytes_per_s={"pinned": 20e9})
    assert measured.host_copy_rate(25e9, pinned=True) == 20e9
    fit = fitting.fit_profile(gemm=[(1e6, 1e-5), (1e9, 1e-2)], copy=(2e9, 0.05),
                              host_copy=[("h2d", 2e9, 0.1), ("d2h", 2e9, 0.08)])
    rates = fitting.CatalogRates(peak_flop_per_s=1e14, hbm_bytes_per_s=1e12,
                                 link_bytes_per_s=1e11, nic_bytes_per_s=1e10)
    profiled = fitting.profiled_calibration(cal, fit, gpu_key="a100-80gb", catalog=rates,
                                            note="test")
    assert profiled.host_copy_bytes_per_s["pinned"] == pytest.approx(20e9)


def test_a_profile_writes_the_pageable_rate_apart_from_the_pinned_one():
    """``meshplan profile`` on a GPU times pinned copies each way and a blocking copy into a
    fresh pageable tensor: the slower pinned way becomes ``pinned``, the pageable copy
    ``pageable`` (slower still, it must not pull ``pinned`` down)."""
    cal = default_calibration()
    fit = fitting.fit_profile(gemm=[(1e6, 1e-5), (1e9, 1e-2)], copy=(2e9, 0.05),
                              host_copy=[("h2d", 2e9, 0.1), ("d2h", 2e9, 0.08),
                                         ("d2h_pageable", 2e9, 0.5)])
    rates = fitting.CatalogRates(peak_flop_per_s=1e14, hbm_bytes_per_s=1e12,
                                 link_bytes_per_s=1e11, nic_bytes_per_s=1e10)
    profiled = fitting.profiled_calibration(cal, fit, gpu_key="h200", catalog=rates,
                                            note="test")
    assert profiled.host_copy_rate(50e9, pinned=True) == pytest.approx(20e9)
    assert profiled.host_copy_rate(50e9, pinned=False) == pytest.approx(4e9)


def test_pageable_copies_are_half_the_link_up_to_the_hosts_staging_copy():
    """A pageable copy goes through the driver's staging buffer: half the pinned rate on a
    PCIe 4 link (25 GB/s), and on PCIe 5 no more than the 13.5 GB/s device-to-host the lent
    H200 machine's host measured with a 55 GB/s pinned link; a calibrated pageable rate
    stands as given."""
    cal = default_calibration()
    assert cal.host_copy_rate(25e9, pinned=False) == pytest.approx(12.5e9)
    assert cal.host_copy_rate(50e9, pinned=False) == pytest.approx(13.5e9)
    profiled = dataclasses.replace(cal, host_copy_bytes_per_s={"pinned": 55.3e9})
    assert profiled.host_copy_rate(50e9, pinned=False) == pytest.approx(13.5e9)
    measured = dataclasses.replace(cal, host_copy_bytes_per_s={"pinned": 55e9,
                                                               "pageable": 20e9})
    assert measured.host_copy_rate(50e9, pinned=False) == 20e9


def test_library_hop_latencies_replace_path_latencies_on_gpus_only():
    """On DGX A100 NCCL's Simple ring charges 3.4 us per NVLink step, 14 us per network step
    and, in a ring over several nodes, at least 3 network posts (2 us each on AMD hosts) per
    in-node step; the CPU cluster (gloo) keeps its path latencies."""
    cal = default_calibration()
    hops = cal.library_hops("a100-80gb")
    assert hops == {"intra": 3.4e-6, "inter": 14e-6, "intra_multi_node": 6e-6}
    assert cal.library_hops("cpu") == {}
    cluster = load_cluster(CLUSTER, nodes=96)
    link = coll.with_library_latency(coll.group_link(cluster, tuple(range(768))), hops)
    assert coll.call_latency_s("all_gather", link) == pytest.approx(
        672 * 6e-6 + 95 * 14e-6, rel=EXACT)
    node = coll.with_library_latency(coll.group_link(cluster, tuple(range(8))), hops)
    assert coll.call_latency_s("all_gather", node) == pytest.approx(7 * 3.4e-6, rel=EXACT)


def test_zero3_collapses_as_data_parallelism_grows_at_fixed_batch():
    """DeepSpeed ZeRO-3, GPT-3 175B, global batch 1536, full recompute: per-GPU throughput
    falls as the same batch is spread over more GPUs (each gather's ring grows, the compute
    per gather shrinks), and from 768 to 1536 GPUs the step barely gets shorter."""
    from meshplan.costmodel.flops import hardware_flop_per_step
    model = load_model("gpt3-175b")
    work = hardware_flop_per_step(model, recompute="full", global_batch_size=1536,
                                  seq_len=2048)
    rate, step = {}, {}
    for gpus, micro in ((384, 4), (768, 2), (1536, 1)):
        config = ParallelConfig(dp=gpus, micro_batch_size=micro, global_batch_size=1536,
                                seq_len=2048, recompute="full", flash_attention=False,
                                zero_stage=3)
        est = estimate(model, load_cluster(CLUSTER, nodes=gpus // 8), config,
                       framework="deepspeed")
        step[gpus] = est.time.step_s
        rate[gpus] = work / step[gpus] / gpus
    assert rate[384] > 1.3 * rate[768] > 1.3 * 1.3 * rate[1536]
    assert step[1536] > 0.9 * step[768]


def _reference_group_link(cluster, ranks):
    """A group's links from the shortest path of every ring-neighbour pair (no sharing)."""
    gpn = cluster.gpus_per_node
    intra, inter, latency, intra_latency = math.inf, math.inf, 0.0, 0.0
    for u, v in zip(ranks, ranks[1:] + ranks[:1]):
        bandwidth, hop = coll._pair_path(cluster.graph, u, v)
        if u // gpn == v // gpn:
            intra, intra_latency = min(intra, bandwidth), max(intra_latency, hop)
        else:
            inter = min(inter, bandwidth)
        latency = max(latency, hop)
    nodes = len({r // gpn for r in ranks})
    return (nodes, intra, inter, latency, intra_latency if nodes > 1 and intra_latency else None)


@pytest.mark.parametrize("cluster_name,nodes", [("dgx-a100-80gb", 10), ("dgx-h100", 9)])
def test_group_links_match_every_pair_and_stages_shift_by_whole_leaves(cluster_name, nodes):
    """Each group's links equal those read off every ring-neighbour pair's own path, and a
    stage's links (reused from the stage a whole number of leaves before it) equal the ones
    read off its own ranks, for every stage of layouts whose stages cross leaves."""
    from meshplan.costmodel import timing

    cluster = load_cluster(cluster_name, nodes=nodes)
    n = cluster.num_gpus
    checked = 0
    for tp, cp, pp, order in [(2, 1, n // 8, ("tp", "cp", "dp", "pp")),
                              (1, 2, n // 4, ("tp", "cp", "dp", "pp")),
                              (2, 2, n // 16 if n % 16 == 0 else n // 8,
                               ("tp", "cp", "pp", "dp")),
                              (8, 1, n // 8, ("tp", "pp", "cp", "dp"))]:
        dp = n // (tp * cp * pp)
        layout = ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, mesh_order=order,
                                global_batch_size=dp, seq_len=cp)
        for stage in range(pp):
            got = timing.stage_links(cluster, layout, stage)
            assert got == timing.direct_stage_links(cluster, layout, stage)
            for link, ranks in ((got.dp, dp_cp_ranks(layout, stage=stage)),
                                (got.tp, axis_group(layout, "tp", stage=stage))):
                if len(ranks) > 1:
                    assert (link.nodes, link.intra_bytes_per_s, link.inter_bytes_per_s,
                            link.latency_s, link.intra_latency_s) == \
                        _reference_group_link(cluster, list(ranks))
                    checked += 1
    assert checked > 50


@pytest.mark.parametrize("name,nodes,changes", [
    ("dgx-h100", 9, {}),
    ("dgx-a100-80gb", 3, {}),
    ("dgx-h100", 7, {"nodes_per_leaf": 3, "spine_oversubscription": 2.0}),
    ("dgx-h100", 5, {"nodes_per_leaf": 1}),
    ("dgx-h100", 6, {"nics_per_node": 4, "nodes_per_leaf": 2}),
    ("dgx-h100", 2, {"nodes_per_leaf": 8}),
])
def test_pair_paths_of_the_small_copy_are_the_clusters_own(name, nodes, changes):
    """Every GPU pair's shortest path (bottleneck bandwidth and latency) read off the full
    cluster graph equals the one of its kind on ``path_graph``, the cluster's small copy the
    group links are read from: pairs from two different nodes to GPUs of every node."""
    cluster = dataclasses.replace(load_cluster(name, nodes=nodes), **changes)
    small, _ = cluster.path_graph
    assert len(small) <= cluster.graph.number_of_nodes()
    gpn, npl = cluster.gpus_per_node, cluster.nodes_per_leaf
    checked = 0
    for a_node in sorted({0, nodes // 2}):
        for u in range(a_node * gpn, (a_node + 1) * gpn):
            for v in range(cluster.num_gpus):
                if u == v:
                    continue
                kind = (u // gpn == v // gpn, u % gpn, v % gpn, u // gpn // npl == v // gpn // npl)
                assert (coll._small_pair_path(small, *cluster.pair_kind_gpus(*kind))
                        == coll._pair_path(cluster.graph, u, v)), (u, v)
                checked += 1
    assert checked >= gpn * (cluster.num_gpus - 1)


def test_ring_kinds_agree_in_python_and_numpy(monkeypatch):
    """Both ways ``_ring_kinds`` classifies a group (plain Python below ``NUMPY_RING`` ranks,
    numpy from there) give the same nodes and pair kinds, on strided, shuffled and repeated-
    node groups of 2 to 600 ranks."""
    import random

    rng = random.Random(7)
    groups = [tuple(range(s, s + n * stride, stride))
              for n, stride, s in ((2, 256, 0), (8, 1, 8), (64, 8, 3), (300, 4, 1), (600, 1, 0))]
    groups += [tuple(rng.sample(range(4096), n)) for n in (2, 3, 17, 255, 256, 500)]
    for ranks in groups:
        for gpn, npl in ((8, 4), (4, 1), (72, 2)):
            monkeypatch.setattr(coll, "NUMPY_RING", 10**9)
            in_python = coll._ring_kinds(ranks, gpn, npl)
            monkeypatch.setattr(coll, "NUMPY_RING", 1)
            assert coll._ring_kinds(ranks, gpn, npl) == in_python, (len(ranks), gpn, npl)


@pytest.mark.parametrize("name,nodes,changes", [
    ("dgx-h100", 12, {}),
    ("dgx-a100-80gb", 7, {"nodes_per_leaf": 3}),
    ("dgx-h100", 10, {"gpus_per_node": 4, "nodes_per_leaf": 2}),
    ("dgx-h100", 6, {"nodes_per_leaf": 1}),
])
def test_lattice_links_equal_the_links_of_their_listed_ranks(name, nodes, changes):
    """``lattice_link`` (a mesh group read from its strides) gives the ``group_link`` of the
    same ranks listed and sorted, for random nested lattices of one and two axes at random
    offsets: strides that divide the node or the leaf, or neither, groups inside a node and
    across leaves, runs that end mid-node."""
    cluster = dataclasses.replace(load_cluster(name, nodes=nodes), **changes)
    n = cluster.num_gpus
    rng = random.Random(7)
    checked = 0
    while checked < 300:
        inner, n_inner = rng.randint(1, 12), rng.randint(1, 9)
        outer = inner * n_inner * rng.randint(1, 5) + rng.choice([0, 0, 1, 3])
        n_outer = rng.randint(1, 9)
        span = (n_outer - 1) * outer + (n_inner - 1) * inner
        if span >= n:
            continue
        base = rng.randint(0, n - 1 - span)
        ranks = tuple(sorted(base + i * outer + j * inner
                             for i in range(n_outer) for j in range(n_inner)))
        if len(set(ranks)) != len(ranks):
            continue
        axes = ((outer, n_outer), (inner, n_inner))
        assert coll.lattice_link(cluster, base, axes) == coll.group_link(cluster, ranks), \
            (base, axes)
        assert coll.lattice_link(cluster, base, ((inner, n_inner),)) == coll.group_link(
            cluster, tuple(base + j * inner for j in range(n_inner)))
        checked += 1
