"""``Calibration``: the fitted efficiencies and overheads of the time and memory model.

Values are data (``data/calibration.json`` by default, or a user file from ``meshplan profile``
/ ``validate --refit``); every value says what it was fitted on.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from meshplan.costmodel.config import FRAMEWORKS
from meshplan.costmodel.jsonio import (EFFICIENCY, FRACTION, NON_NEGATIVE, POSITIVE, Rule,
                                       check_object, load_json_document, read_package_json,
                                       schema_of)


LINK_KINDS = frozenset({"intra", "inter"})
"""Keys of ``Calibration.link_latency_s``: in-node and cross-node links."""
HOST_BUFFER_KINDS = ("pageable", "pinned")
"""Keys of ``Calibration.host_copy_bytes_per_s``."""
LIBRARY_HOP_KINDS = ("inter", "intra", "intra_multi_node")
"""Keys of each entry of ``Calibration.library_hop_latency_s``."""
PAGEABLE_FRACTION = 0.5
"""Pageable host-device copies against pinned ones when only one is known: CUDA copies a
pageable buffer through a pinned staging buffer, one more pass over host memory, so they
reach about half the pinned rate (NVIDIA, "How to Optimize Data Transfers in CUDA C/C++",
Harris 2012: 5.7 against 3.2 GB/s on PCIe 2; CUDA C++ Best Practices Guide, "Pinned
Memory"), and no more than the staging copy itself (``PAGEABLE_STAGING_BYTES_PER_S``)."""
PAGEABLE_STAGING_BYTES_PER_S = 1.35e10
"""Ceiling of a pageable copy when only the pinned rate is known: the driver's copy through
its staging buffer runs on the host, whatever the link. Measured on the lent H200 machine
(PCIe 5, pinned 55.3 GB/s each way): 256 MiB device-to-host 13.5 GB/s, host-to-device 8.1
(``benchmarks/gpu_kernels.py``, results/gpu-kernels-h200-2026-12-04.md). The device-to-host
rate, the direction of the only pageable copies modelled (FSDP2's gradient copies while
gradients accumulate, ``timing._param_offload_per_microbatch_s``); half of a PCIe 4 link's
25 GB/s stays below it."""


@dataclass(frozen=True, kw_only=True)
class DeviceCalibration:
    """Compute efficiencies of one accelerator kind."""

    matmul_efficiency: float
    """Fraction of dense peak a large GEMM reaches (asymptote for big matrices)."""
    matmul_overhead_s: float
    """Fixed cost per GEMM call (launch, tail effects); makes small GEMMs less efficient."""
    attention_efficiency: float
    """Fraction of dense peak reached by eager attention score / value batched matmuls."""
    flash_attention_efficiency: float
    """Fraction of dense peak reached by fused (flash) attention kernels."""
    memory_efficiency: float
    """Fraction of HBM bandwidth reached by element-wise kernels."""
    op_overhead_s: float = 0.0
    """Host seconds per eager PyTorch operator that the device cannot hide: dispatch,
    autograd bookkeeping and the Python around each op. A CPU runs every op on the host
    thread, so a small model's step is mostly this; a GPU queues kernels ahead of itself,
    so 0 there. Charged per op of each layer's forward (``timing.EAGER_OPS_PER_LAYER``),
    twice that in the backward."""
    host_op_s: float = 0.0
    """Host seconds per plain eager ATen op on the thread that drives this GPU (Python,
    dispatcher, autograd, the kernel launch). The device runs queued kernels while the host
    issues the next, so an eager framework's layer (``frameworks.eager_kernels``) takes the
    larger of its kernels' time and its host work, ``timing.HOST_OP_EQUIVALENTS`` of its
    recompute mode times this: small layers, and the selective-checkpoint dispatch modes'
    Python per op, leave the GPU waiting on the host. 0: not modelled (the CPU device, whose
    host work is serial, is priced by ``op_overhead_s``)."""
    collective_call_s: float = 0.0
    """Host seconds per latency step of every collective call on this device
    (``Calibration.collective_call_s`` adds to it): gloo on a CPU waits on Python, c10d,
    DTensor / FSDP2 hooks and the peer process for each call; 0 on NCCL GPUs."""
    eager_matmul_efficiency: float | None = None
    """Fraction of dense peak a large GEMM reaches when an eager PyTorch framework launches it
    (``frameworks.eager_kernels``: cuBLAS through ``torch.matmul``, unfused epilogues, FSDP's
    copies and waits on the stream), where it differs from ``matmul_efficiency`` (fitted on
    Megatron-LM and Llama 3's stack); None: the same."""

    eager_flash_attention_efficiency: float | None = None
    """Fraction of dense peak fused attention reaches when an eager PyTorch framework calls it
    (the flash-attn package or SDPA's flash kernels, against the cuDNN / Transformer Engine
    kernels of Megatron-LM and Llama 3's stack); None: ``flash_attention_efficiency``."""
    triton_attention_efficiency: float | None = None
    """Fraction of dense peak the Triton flash-attention kernel reaches
    (``ParallelConfig.attention_kernel`` ``triton``: llm-foundry's ``attn_impl: triton``),
    forward and backward, in the cost model's FLOP count; None:
    ``eager_flash_attention_efficiency``."""
    eager_flash_attention_half_seq: float | None = None
    """Sequence length at which the eager fused attention reaches half of
    ``eager_flash_attention_efficiency``: over s keys it runs at that efficiency times
    ``s / (s + eager_flash_attention_half_seq)`` (each query block's fixed prologue and
    epilogue amortised over more keys), as SDPA's flash kernel measured on a device across
    sequence lengths shows. None: one efficiency at every length (values fitted on training
    runs of one typical length)."""
    prefetch_overlap: float | None = None
    """Fraction of a micro-batch's compute that FSDP-style per-block collectives (all-gather
    of the next block, reduce-scatter of the last, prefetched on their own stream) hide
    behind, bytes and latency alike (``timing.prefetches_blocks``); None: the
    calibration's ``dp_overlap``, and the calls' latency stays exposed."""

    optimizer_params_per_s: float | None = None
    """Parameters per second of one rank's AdamW step on this device when it is not offloaded
    (the runtime's default ``foreach`` kernel), where the HBM-traffic formula
    (``timing.OPTIMIZER_BYTES_PER_PARAM``) does not hold; None: that formula."""
    prefetch_contention: float = 0.0
    """Fraction of its calls' latency an overlapped prefetched collective costs the compute it
    runs beside (``timing.prefetches_blocks``): NCCL's kernels hold their SMs while they wait
    on ring steps, which move no bytes. Without ``prefetch_contention_bytes`` the fraction of
    its whole time. 0: overlap is free."""
    prefetch_contention_bytes: float | None = None
    """HBM bytes an overlapped prefetched collective moves for every byte it carries on its
    ring's links (reading its send buffer, writing what arrives, reading the local chunk a
    reduce-scatter adds): the compute beside it loses that traffic's HBM time, so while it
    moves bytes the collective costs ``min(1, prefetch_contention_bytes * bus / hbm)`` of that
    time (``timing.prefetch_contention``): about half inside an NVLink node, a few percent for
    a ring of one rank per node at one NIC's rate. None: ``prefetch_contention`` over all of
    its time."""
    gemm_half_rows: float | None = None
    """Rows (tokens of the micro-batch) at which a GEMM reaches half of its large-matrix
    efficiency: a product with M rows runs at ``efficiency * M / (M + gemm_half_rows)``
    (``row_efficiency``). A CPU's BLAS packs each weight panel for every call and amortises
    it over the rows, so a few dozen tokens leave it far from its peak. None: not modelled
    (GPUs: every fitted efficiency was measured at training shapes of thousands of rows)."""
    fresh_page_bytes_per_s: float | None = None
    """Bytes per second of writing memory the process has just mapped (the kernel's page
    faults and zeroing): a CPU runtime whose allocator returns large blocks to the system
    (meshplan's CPU workers fix glibc's mmap threshold) writes every weight gradient, the
    embedding's dense gradient and every ZeRO-3 gather buffer into fresh pages each
    micro-batch (``timing.fresh_pages_s``). None: not modelled (GPU caching allocators reuse
    device memory)."""

    def row_efficiency(self, rows: float) -> float:
        """The fraction of its large-matrix efficiency a GEMM with ``rows`` rows reaches:
        ``rows / (rows + gemm_half_rows)``, 1 without ``gemm_half_rows``."""
        if self.gemm_half_rows is None:
            return 1.0
        return rows / (rows + self.gemm_half_rows)

    def gemm_efficiency(self, eager: bool) -> float:
        """``eager_matmul_efficiency`` for an eager framework when set, else
        ``matmul_efficiency``."""
        if eager and self.eager_matmul_efficiency is not None:
            return self.eager_matmul_efficiency
        return self.matmul_efficiency

    def fused_attention_efficiency(self, eager: bool, seq_len: float | None = None,
                                   kernel: str = "auto") -> float:
        """``triton_attention_efficiency`` for the Triton kernel (``kernel`` ``triton``) where
        set; otherwise ``eager_flash_attention_efficiency`` for an eager framework when set (over
        ``seq_len`` keys, times ``s / (s + eager_flash_attention_half_seq)`` where that is
        set), else ``flash_attention_efficiency``."""
        if kernel == "triton" and self.triton_attention_efficiency is not None:
            return self.triton_attention_efficiency
        if eager and self.eager_flash_attention_efficiency is not None:
            if self.eager_flash_attention_half_seq is None or seq_len is None:
                return self.eager_flash_attention_efficiency
            return (self.eager_flash_attention_efficiency * seq_len
                    / (seq_len + self.eager_flash_attention_half_seq))
        return self.flash_attention_efficiency

    def __post_init__(self) -> None:
        for name in ("eager_matmul_efficiency", "eager_flash_attention_efficiency",
                     "triton_attention_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if self.prefetch_overlap is not None and not 0 <= self.prefetch_overlap <= 1:
            raise ValueError(f"prefetch_overlap must be in [0, 1], got {self.prefetch_overlap!r}")
        for name in ("gemm_half_rows", "fresh_page_bytes_per_s",
                     "eager_flash_attention_half_seq"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if self.prefetch_contention_bytes is not None and self.prefetch_contention_bytes < 0:
            raise ValueError(f"prefetch_contention_bytes must be >= 0, got "
                             f"{self.prefetch_contention_bytes!r}")
        if self.optimizer_params_per_s is not None and self.optimizer_params_per_s <= 0:
            raise ValueError(f"optimizer_params_per_s must be positive, got "
                             f"{self.optimizer_params_per_s!r}")
        if not 0 <= self.prefetch_contention <= 1:
            raise ValueError(f"prefetch_contention must be in [0, 1], got "
                             f"{self.prefetch_contention!r}")
        for name in ("matmul_efficiency", "attention_efficiency", "flash_attention_efficiency",
                     "memory_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        for name in ("matmul_overhead_s", "op_overhead_s", "host_op_s", "collective_call_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """All fitted constants of the cost model."""

    devices: dict[str, DeviceCalibration] = field(hash=False)
    """Per GPU catalog key; ``default`` is used for GPUs without their own entry."""
    elementwise_traffic_factor: float
    """HBM bytes moved by element-wise kernels per byte of stored activations (fwd)."""
    attention_core_traffic_factor: float
    """HBM bytes moved by the eager softmax/dropout kernels per byte of stored score tensors."""
    framework_compute_factor: dict[str, float] = field(hash=False)
    """Compute-time multiplier per framework (kernel fusion, scheduler overheads); 1 if absent."""
    nvlink_efficiency: float
    """Achieved fraction of NVLink bandwidth in collectives (NCCL bus bandwidth / link)."""
    network_efficiency: float
    """Achieved fraction of NIC bandwidth in collectives across nodes."""
    tp_overlap: float
    """Fraction of TP/SP collective time hidden behind compute."""
    dp_overlap: float
    """Fraction of the last backward pass that once-per-step data-parallel gradient traffic
    can hide behind where the framework does not overlap it bucket by bucket (Megatron-LM
    without ``ParallelConfig.overlap_comm``, DeepSpeed, DDP; fitted on 2021-2022 runs)."""
    pp_overlap: float
    """Fraction of pipeline point-to-point time hidden behind compute."""
    offload_overlap: float
    """Fraction of offload PCIe traffic hidden behind compute."""
    host_adam_flop_per_param: float
    """Host FLOPs per parameter of one CPU Adam step (includes memory stalls)."""
    allocator_fragmentation: float
    """Reserved / allocated - 1 of the caching allocator."""
    communicator_bytes: float
    """Per-rank memory of communicator buffers (NCCL channels), added to reserved."""
    link_latency_s: dict[str, float] = field(default_factory=dict, hash=False)
    """Measured one-hop latency of collectives, seconds, by link kind: ``intra`` (inside a
    node) and/or ``inter`` (across nodes). When a kind is present it replaces the cluster's
    ``nvlink_latency_s`` / ``nic_latency_s`` path latency of every group of that kind
    (``collectives.with_latency``); absent (the default) the cluster's values are used.
    Written by ``meshplan profile`` (alpha of an alpha-beta fit over gloo/NCCL collectives)."""
    collective_call_s: float = 0.0
    """Fixed seconds per latency step of every collective call the runtime issues, on top of
    the alpha-beta time of the traffic the model charges: Python and c10d bookkeeping, DTensor
    redistribution, and the wait for the peer process to reach the call (gloo ranks sharing
    CPU cores). A call pays it once per one-hop step (``calls.latency_steps``: 2 for an
    all-reduce of two ranks, 1 for a send or an all-gather), for every call
    ``calls.collective_calls_per_microbatch`` counts. 0 (the default, right for NCCL, whose
    launches run ahead of the GPU); fitted by ``meshplan validate --refit`` over several plans
    (``fitting.refit_plans``)."""
    library_hop_latency_s: dict[str, dict[str, float]] = field(default_factory=dict,
                                                                hash=False)
    """Per GPU catalog key (``default`` for others without an entry of their own): the
    collective library's latency per ring step, ``intra`` (a group inside one node),
    ``inter`` (a step that crosses nodes) and ``intra_multi_node`` (an in-node step of a ring
    that spans nodes), replacing the cluster graph's path latencies for collectives on those
    GPUs (``collectives.with_library_latency``; pipeline sends keep the path latency); a
    measured ``link_latency_s`` replaces them in turn. Absent for a device (the CPU, gloo):
    the cluster's path latencies."""
    host_adam_bytes_per_param: float = 28.0
    """Host memory traffic of one fp32 AdamW step per parameter: read parameter, gradient,
    momentum and variance (16 bytes), write parameter, momentum and variance (12). CPU Adam
    is bound by this traffic, not by its ~20 FLOPs (``host_adam_flop_per_param``)."""
    host_memory_bytes_per_s: dict[str, float] = field(default_factory=dict, hash=False)
    """Achieved host memory bandwidth of one node, by GPU catalog key (the node design);
    ``default`` for others. Bounds the host optimizer step of offloaded plans."""
    host_copy_bytes_per_s: dict[str, float] = field(default_factory=dict, hash=False)
    """Host-device copy bandwidth per GPU by host buffer kind: ``pinned`` (page-locked:
    DeepSpeed's offload buffers, FSDP2's ``CPUOffloadPolicy(pin_memory=True)``) and
    ``pageable`` (staged through a driver bounce buffer: the gradient copies FSDP2 makes while
    gradients accumulate). Absent: the cluster's ``pcie_bytes_per_s`` for pinned and
    ``PAGEABLE_FRACTION`` of it, at most ``PAGEABLE_STAGING_BYTES_PER_S``, for pageable.
    ``meshplan profile`` on a GPU writes ``pinned`` (the slower of its measured host-to-device
    and device-to-host rates) and ``pageable`` (a blocking device-to-host copy into a fresh
    pageable tensor, as FSDP2 makes them)."""
    zero3_path_bytes_per_s: dict[str, float] = field(default_factory=dict, hash=False)
    """Per framework: bytes per second one GPU's ZeRO-3 parameter gather (and gradient
    reduce-scatter) path moves, whatever its links carry. A framework's own gather code can be
    slower than the collective library under it: zeroing the gathered buffer, synchronising
    before each call, copying the result out (``timing.deepspeed_zero3_traffic``). Each fetch
    batch takes the slower of this path and the library's ring. Absent: the library alone."""
    zero3_path_rank_s: dict[str, float] = field(default_factory=dict, hash=False)
    """Per framework: seconds the ZeRO-3 path adds per call and per rank of the group (a
    list-output all-gather, or list-input reduce-scatter, copies each rank's chunk out of (or
    into) one flat buffer: one device copy per rank and call). Absent: 0."""
    source: dict[str, str] = field(default_factory=dict, hash=False)
    """What each value was fitted on."""

    def library_hops(self, gpu_key: str) -> dict[str, float]:
        """``library_hop_latency_s`` of ``gpu_key`` (or ``default``); empty if none."""
        return (self.library_hop_latency_s.get(gpu_key)
                or self.library_hop_latency_s.get("default") or {})

    def host_memory_s(self, gpu_key: str, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through one node's host memory (0 without a value)."""
        rate = self.host_memory_bytes_per_s.get(gpu_key) or self.host_memory_bytes_per_s.get(
            "default")
        return nbytes / rate if rate else 0.0

    def host_copy_rate(self, cluster_pcie_bytes_per_s: float, *, pinned: bool) -> float:
        """Host-device bytes per second per GPU for a pinned or pageable host buffer."""
        if pinned:
            return self.host_copy_bytes_per_s.get("pinned", cluster_pcie_bytes_per_s)
        if "pageable" in self.host_copy_bytes_per_s:
            return self.host_copy_bytes_per_s["pageable"]
        pinned_rate = self.host_copy_bytes_per_s.get("pinned", cluster_pcie_bytes_per_s)
        return min(PAGEABLE_FRACTION * pinned_rate, PAGEABLE_STAGING_BYTES_PER_S)

    def device(self, gpu_key: str) -> DeviceCalibration:
        return self.devices.get(gpu_key) or self.devices["default"]

    def compute_factor(self, framework: str) -> float:
        return self.framework_compute_factor.get(framework, 1.0)

    def call_s(self, gpu_key: str) -> float:
        """Seconds per latency step of a collective call on ``gpu_key``: the device's own
        ``collective_call_s`` plus the calibration-wide one (what a refit fits)."""
        return self.device(gpu_key).collective_call_s + self.collective_call_s

    def __post_init__(self) -> None:
        if "default" not in self.devices:
            raise ValueError("calibration needs a 'default' device entry")
        for name in ("nvlink_efficiency", "network_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        bad_links = {k: v for k, v in self.link_latency_s.items()
                     if k not in LINK_KINDS or not isinstance(v, (int, float)) or v < 0}
        if bad_links:
            raise ValueError(f"link_latency_s must map {sorted(LINK_KINDS)} to seconds >= 0, "
                             f"got {bad_links!r}")
        if not isinstance(self.collective_call_s, (int, float)) or self.collective_call_s < 0:
            raise ValueError(f"collective_call_s must be seconds >= 0, got "
                             f"{self.collective_call_s!r}")
        for name in ("tp_overlap", "dp_overlap", "pp_overlap", "offload_overlap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEVICE_SCHEMA = schema_of(DeviceCalibration, limits={
    "matmul_efficiency": EFFICIENCY, "matmul_overhead_s": NON_NEGATIVE,
    "eager_matmul_efficiency": EFFICIENCY, "eager_flash_attention_efficiency": EFFICIENCY,
    "triton_attention_efficiency": EFFICIENCY,
    "prefetch_overlap": FRACTION, "prefetch_contention": FRACTION,
    "prefetch_contention_bytes": NON_NEGATIVE,
    "optimizer_params_per_s": POSITIVE, "gemm_half_rows": POSITIVE,
    "eager_flash_attention_half_seq": POSITIVE,
    "fresh_page_bytes_per_s": POSITIVE,
    "op_overhead_s": NON_NEGATIVE, "host_op_s": NON_NEGATIVE,
    "collective_call_s": NON_NEGATIVE,
    "attention_efficiency": EFFICIENCY, "flash_attention_efficiency": EFFICIENCY,
    "memory_efficiency": EFFICIENCY})
"""One entry of ``devices``: every DeviceCalibration field."""
CALIBRATION_SCHEMA = schema_of(
    Calibration,
    limits={"elementwise_traffic_factor": NON_NEGATIVE,
            "attention_core_traffic_factor": NON_NEGATIVE,
            "framework_compute_factor": POSITIVE, "nvlink_efficiency": EFFICIENCY,
            "network_efficiency": EFFICIENCY, "tp_overlap": FRACTION, "dp_overlap": FRACTION,
            "pp_overlap": FRACTION, "offload_overlap": FRACTION,
            "host_adam_flop_per_param": POSITIVE, "allocator_fragmentation": NON_NEGATIVE,
            "communicator_bytes": NON_NEGATIVE, "link_latency_s": NON_NEGATIVE,
            "collective_call_s": NON_NEGATIVE, "host_adam_bytes_per_param": POSITIVE,
            "library_hop_latency_s": NON_NEGATIVE,
            "host_memory_bytes_per_s": POSITIVE, "host_copy_bytes_per_s": POSITIVE,
            "zero3_path_bytes_per_s": POSITIVE, "zero3_path_rank_s": NON_NEGATIVE},
    rules={"devices": Rule(kind="object", items=Rule(kind="object", schema=DEVICE_SCHEMA)),
           "framework_compute_factor": Rule(kind="object", keys=FRAMEWORKS,
                                            items=Rule(kind="float")),
           "link_latency_s": Rule(kind="object", keys=tuple(sorted(LINK_KINDS)),
                                  items=Rule(kind="float")),
           "host_memory_bytes_per_s": Rule(kind="object", items=Rule(kind="float")),
           "library_hop_latency_s": Rule(kind="object", items=Rule(
               kind="object", keys=LIBRARY_HOP_KINDS, items=Rule(kind="float"))),
           "host_copy_bytes_per_s": Rule(kind="object", keys=HOST_BUFFER_KINDS,
                                         items=Rule(kind="float")),
           "zero3_path_bytes_per_s": Rule(kind="object", keys=FRAMEWORKS,
                                          items=Rule(kind="float")),
           "zero3_path_rank_s": Rule(kind="object", keys=FRAMEWORKS, items=Rule(kind="float")),
           "about": Rule(kind="str")})
"""A complete calibration (the built-in one, or a user file merged over it): the Calibration
fields and an optional ``about`` note."""
CALIBRATION_FILE_SCHEMA = CALIBRATION_SCHEMA.replace(required=frozenset())
"""A user calibration file: any subset of the keys, each as in ``CALIBRATION_SCHEMA`` (a
``devices`` entry is complete); ``load_calibration`` merges it over the built-in one."""


def calibration_from_dict(data: dict[str, Any], *, origin: str) -> Calibration:
    """A Calibration from a complete calibration object; ValueError naming ``origin``."""
    check_object(data, CALIBRATION_SCHEMA, origin=origin)
    values = {k: v for k, v in data.items() if k != "about"}
    try:
        values["devices"] = {key: DeviceCalibration(**entry)
                             for key, entry in values["devices"].items()}
        return Calibration(**values)
    except ValueError as err:
        raise ValueError(f"{origin}: {err}") from None


@functools.cache
def default_calibration() -> Calibration:
    return calibration_from_dict(read_package_json("calibration.json"),
                                 origin="costmodel/data/calibration.json")


def load_calibration(path: str | None) -> Calibration:
    """The built-in calibration, or the one in the JSON file ``path`` merged over it."""
    if path is None:
        return default_calibration()
    data = load_json_document(path, what="calibration", schema=CALIBRATION_FILE_SCHEMA)
    merged = default_calibration().to_dict()
    merged.update({k: v for k, v in data.items() if k != "devices"})
    merged["devices"] = {**merged["devices"], **data.get("devices", {})}
    return calibration_from_dict(merged, origin=str(path))
