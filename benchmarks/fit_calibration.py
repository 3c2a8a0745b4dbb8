"""Fit the default calibration on the published runs marked ``fit``.

Minimises the squared log error of predicted vs published step time over the ``fit`` runs of
``costmodel/data/reference_runs.json`` (Megatron-LM, DeepSpeed, Llama 3 and MosaicML FSDP runs)
plus the per-layer forward/backward times of Korthikanti et al. 2022 Table 4, and writes the result to ``costmodel/data/calibration.json`` (``--write``)
or prints it. Runs marked ``holdout`` are never used here; ``benchmarks/accuracy.py`` reports
them separately.

    python benchmarks/fit_calibration.py            # print the fitted values and errors
    python benchmarks/fit_calibration.py --write    # update costmodel/data/calibration.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from meshplan.costmodel import ParallelConfig, default_calibration, load_cluster, load_model
from meshplan.costmodel.calibration import Calibration
from meshplan.costmodel.frameworks import eager_kernels
from meshplan.costmodel.reference import predict, reference_runs
from meshplan.costmodel.timing import BACKWARD_FACTOR, layer_forward_s, stage_links, tp_comm_parts_s

CALIBRATION_FILE = Path(__file__).resolve().parents[1] / "costmodel" / "data" / "calibration.json"
RESULTS = Path(__file__).resolve().parent / "results"

# Korthikanti et al. 2022 Table 4: one 22B layer (h 6144, 64 heads, s 2048, b 4) on tp 8,
# forward and backward milliseconds per configuration.
TABLE4_LAYER_MS = {
    ("none", False): (7.7, 11.9),
    ("none", True): (7.2, 11.8),
    ("full", False): (7.7, 19.5),
    ("selective", False): (7.7, 13.2),
    ("selective", True): (7.2, 13.1),
}

PARAMETERS = (  # name, initial value, lower, upper
    ("a100_matmul_efficiency", 0.75, 0.4, 0.95),
    ("a100_matmul_overhead_s", 2e-5, 1e-7, 2e-4),
    ("a100_attention_efficiency", 0.5, 0.1, 0.9),
    ("h100_matmul_efficiency", 0.65, 0.3, 0.95),
    ("elementwise_traffic_factor", 2.0, 0.5, 8.0),
    ("attention_core_traffic_factor", 1.5, 0.3, 8.0),
    ("nvlink_efficiency", 0.75, 0.4, 0.95),
    ("dp_overlap", 0.5, 0.0, 1.0),
    ("deepspeed_compute_factor", 1.1, 0.8, 2.0),
)
EAGER_PARAMETERS = (  # fitted on the eager (FSDP trainer) fit runs only, the rest held fixed
    ("a100_eager_matmul_efficiency", 0.75, 0.3, 0.95),
    ("h100_eager_matmul_efficiency", 0.55, 0.3, 0.95),
    ("a100_eager_flash_attention_efficiency", 0.35, 0.1, 0.9),
    ("h100_eager_flash_attention_efficiency", 0.25, 0.1, 0.9),
    ("a100_triton_attention_efficiency", 0.3, 0.05, 0.9),
    ("h100_triton_attention_efficiency", 0.17, 0.05, 0.9),
    ("gpu_prefetch_contention_bytes", 2.4, 0.0, 8.0),
    ("gpu_prefetch_contention", 0.1, 0.0, 0.6),
)
PREFETCH_OVERLAP = 1.0
"""Share of a micro-batch's compute that FSDP's prefetched per-block collectives can hide
behind, not fitted: FSDP2 gathers block k+1 while block k computes and reduce-scatters block
k+1's gradients while block k's backward runs, so every block's compute but the first's can
hide traffic. The eager fit rows bind it only from below (with the contention priced by the
rings' HBM traffic, every value from 0.4525 to 1 fits them equally, 2026-12-06), so it takes
its mechanism's bound."""
ZERO3_PARAMETERS = (  # fitted on the DeepSpeed ZeRO-3 fit runs only, the rest held fixed
    ("deepspeed_zero3_path_rank_s", 5e-6, 0.0, 5e-5),
)
DEEPSPEED_ZERO3_PATH_BYTES_PER_S = 25e9
"""DeepSpeed ZeRO-3's gather path per GPU, not fitted: DeepSpeed issue #1174 (0.3.16, one
p4d.24xlarge, 8 A100s on NVLink): a 5.1B-parameter BERT's forward took ~480 ms under ZeRO-3
against ~60 ms under ZeRO-2, ~0.42 s for its ~10.2 GB of fp16 parameters, ~25 GB/s, a
fraction of what NVLink carries; PR #1188 names the causes (a synchronize before every
gather, an explicit copy after it)."""
GPU_KEYS = ("a100-80gb", "a100-40gb", "h100-sxm", "h100-hbm2e-96gb", "h200", "b200", "default")
"""The GPUs of the two generations the fit covers (H200 and B200 take H100's values, but for
``MEASURED_DEVICE_FIELDS``)."""
MEASURED_DEVICE_FIELDS = {"h200": ("eager_matmul_efficiency", "eager_flash_attention_efficiency",
                                   "eager_flash_attention_half_seq")}
"""Values of a device measured on the device itself (``--stage h200``), which the other stages
keep instead of the generation's fitted ones."""
H200_KERNELS = RESULTS / "gpu-kernels-h200-2026-12-04.json"
"""SDPA's flash kernel on one H200 (torch 2.11, ``benchmarks/gpu_kernels.py``): forward and
backward seconds, causal, head dim 128, 2k-8k tokens."""
H200_RUNTIME = RESULTS / "gpu-h200-2026-12-04.json"
"""meshplan's runtime on one H200 (``benchmarks/gpu_runtime.py``): Llama-3.2-1B, bf16,
4 micro-batches of 2 x 2048 tokens per step, measured step per plan."""
H200_RUNTIME_FIT_PLAN = "none"
"""The runtime plan the H200's eager GEMM efficiency is solved on: no recomputation, bound by
the device (its host issues a layer's kernels in a third of their run time); the ``full``
plan is held out."""


def _keep_measured(base: Calibration, devices: dict) -> dict:
    """``devices`` with ``MEASURED_DEVICE_FIELDS`` taken back from ``base``."""
    for key, names in MEASURED_DEVICE_FIELDS.items():
        measured = {name: getattr(base.device(key), name) for name in names}
        devices[key] = dataclasses.replace(devices[key], **measured)
    return devices


def calibration_from_vector(base: Calibration, x: np.ndarray) -> Calibration:
    v = {name: float(value) for (name, *_), value in zip(PARAMETERS, x)}
    a100 = dataclasses.replace(base.device("a100-80gb"),
                               matmul_efficiency=v["a100_matmul_efficiency"],
                               matmul_overhead_s=v["a100_matmul_overhead_s"],
                               attention_efficiency=v["a100_attention_efficiency"])
    ratio = v["h100_matmul_efficiency"] / v["a100_matmul_efficiency"]
    h100 = dataclasses.replace(base.device("h100-sxm"),
                               matmul_efficiency=v["h100_matmul_efficiency"],
                               matmul_overhead_s=v["a100_matmul_overhead_s"],
                               attention_efficiency=min(1.0, a100.attention_efficiency * ratio))
    devices = dict(base.devices)
    devices.update({"a100-80gb": a100, "a100-40gb": a100, "h100-sxm": h100,
                    "h100-hbm2e-96gb": h100, "h200": h100, "b200": h100,
                    "default": a100})  # the GPUs of one generation share values
    devices = _keep_measured(base, devices)
    factors = dict(base.framework_compute_factor, deepspeed=v["deepspeed_compute_factor"])
    return dataclasses.replace(
        base, devices=devices, elementwise_traffic_factor=v["elementwise_traffic_factor"],
        attention_core_traffic_factor=v["attention_core_traffic_factor"],
        nvlink_efficiency=v["nvlink_efficiency"], dp_overlap=v["dp_overlap"],
        framework_compute_factor=factors)


def eager_calibration_from_vector(base: Calibration, x: np.ndarray) -> Calibration:
    """``base`` with the eager-framework values of ``EAGER_PARAMETERS`` set to ``x``: each
    generation's eager GEMM efficiency, its fused-attention efficiency (SDPA's flash kernel)
    and its Triton attention kernel's (the MosaicML rows' ``attn_impl: triton``; H200 and B200
    take H100's values), and the prefetched collectives' contention on every GPU (``prefetch_contention_bytes`` over the
    time they move bytes, ``prefetch_contention`` over their calls' latency), their overlap
    ``PREFETCH_OVERLAP``."""
    v = {name: float(value) for (name, *_), value in zip(EAGER_PARAMETERS, x)}
    devices = dict(base.devices)
    for key in GPU_KEYS:
        generation = "a100" if key.startswith("a100") or key == "default" else "h100"
        devices[key] = dataclasses.replace(
            base.device(key),
            eager_matmul_efficiency=v[f"{generation}_eager_matmul_efficiency"],
            eager_flash_attention_efficiency=v[f"{generation}_eager_flash_attention_efficiency"],
            triton_attention_efficiency=v[f"{generation}_triton_attention_efficiency"],
            prefetch_overlap=PREFETCH_OVERLAP,
            prefetch_contention_bytes=v["gpu_prefetch_contention_bytes"],
            prefetch_contention=v["gpu_prefetch_contention"])
    return dataclasses.replace(base, devices=_keep_measured(base, devices))


def zero3_calibration_from_vector(base: Calibration, x: np.ndarray) -> Calibration:
    """``base`` with DeepSpeed's ZeRO-3 path: its per-rank call cost ``x[0]`` (fitted) and its
    gather rate ``DEEPSPEED_ZERO3_PATH_BYTES_PER_S`` (cited)."""
    return dataclasses.replace(
        base, zero3_path_bytes_per_s=dict(base.zero3_path_bytes_per_s,
                                          deepspeed=DEEPSPEED_ZERO3_PATH_BYTES_PER_S),
        zero3_path_rank_s=dict(base.zero3_path_rank_s, deepspeed=float(x[0])))


def h200_measured(base: Calibration) -> Calibration:
    """``base`` with the H200's eager values measured on an H200 (``MEASURED_DEVICE_FIELDS``).

    * Fused attention: SDPA's flash kernel timed forward and backward (``H200_KERNELS``, its
      ``efficiency`` counts 3 forward passes of FLOPs); in the cost model's terms the pair costs
      ``1 + timing.FLASH_BACKWARD_FACTOR`` forwards, so each point's efficiency is the
      measured one times 3.5 / 3; ``a s / (s + h)`` is fitted to the points (least squares).
    * GEMMs: the eager efficiency at which meshplan's runtime's ``H200_RUNTIME_FIT_PLAN``
      plan is predicted at its measured step (bisection).
    """
    import scipy.optimize

    from meshplan.costmodel import estimate
    from meshplan.costmodel.timing import FLASH_BACKWARD_FACTOR
    rows = json.loads(H200_KERNELS.read_text())["rows"]
    points = [(int(row["case"].split("s=")[1].split()[0]),
               row["efficiency"] * (1 + FLASH_BACKWARD_FACTOR) / 3) for row in rows
              if row["group"] == "attention" and row["case"].startswith("flash ")
              and " d=128 " in row["case"]]
    seqs, effs = (np.array(values, dtype=float) for values in zip(*points))
    (top, half), _ = scipy.optimize.curve_fit(lambda s, a, h: a * s / (s + h), seqs, effs,
                                              p0=(effs.max(), 1000.0))
    measured = {row["plan"]: row["measured_step_s"]
                for row in json.loads(H200_RUNTIME.read_text())}
    model = load_model("llama3.2-1b")
    cluster = load_cluster("dgx-h200", nodes=1, gpus_per_node=1)
    config = ParallelConfig(global_batch_size=8, micro_batch_size=2, seq_len=2048, dtype="bf16",
                            recompute="none")

    def with_values(matmul: float) -> Calibration:
        device = dataclasses.replace(base.device("h200"), eager_matmul_efficiency=matmul,
                                     eager_flash_attention_efficiency=float(top),
                                     eager_flash_attention_half_seq=float(half))
        return dataclasses.replace(base, devices=dict(base.devices, h200=device))

    def gap(matmul: float) -> float:
        step = estimate(model, cluster, config, framework="meshplan",
                        calibration=with_values(matmul)).time.step_s
        return step / measured[H200_RUNTIME_FIT_PLAN] - 1

    return with_values(scipy.optimize.brentq(gap, 0.3, 0.95, xtol=1e-6))


def is_deepspeed_zero3(run) -> bool:
    """A DeepSpeed ZeRO-3 run: its own fit stage (``ZERO3_PARAMETERS``), left out of the
    others."""
    return run.framework == "deepspeed" and run.config.zero_stage == 3


def table4_predictions_ms(cal: Calibration) -> dict[tuple[str, bool], tuple[float, float]]:
    model = load_model("megatron-22b")
    cluster = load_cluster("dgx-a100-80gb", nodes=1)
    out = {}
    for (mode, sp) in TABLE4_LAYER_MS:
        config = ParallelConfig(tp=8, micro_batch_size=4, global_batch_size=4, seq_len=2048,
                                sp=sp, recompute=mode, flash_attention=False)
        fwd, core = layer_forward_s(model, cluster, config, cal, moe=False)
        link = stage_links(cluster, config, 0).tp
        tp_fwd, tp_bwd = tp_comm_parts_s(model, config, link, cal, framework="megatron")
        extra = fwd + tp_fwd if mode == "full" else (core if mode == "selective" else 0.0)
        out[(mode, sp)] = ((fwd + tp_fwd) * 1e3, (BACKWARD_FACTOR * fwd + tp_bwd + extra) * 1e3)
    return out


def residuals(cal: Calibration, *, eager: bool = False, zero3: bool = False
              ) -> tuple[list[float], list[tuple[str, float, float]]]:
    """Log errors of every fit target, and (name, predicted, published) rows: the fit runs of
    non-eager frameworks (DeepSpeed ZeRO-3 runs aside) plus Korthikanti's Table 4 layer times,
    or (``eager``) the fit runs of eager frameworks (``frameworks.eager_kernels``), or
    (``zero3``) the DeepSpeed ZeRO-3 fit runs."""
    errors, rows = [], []
    for run in reference_runs():
        if run.set != "fit" or is_deepspeed_zero3(run) != zero3 or (
                not zero3 and eager_kernels(run.framework) != eager):
            continue
        predicted = predict(run, cal).time.step_s
        errors.append(math.log(predicted / run.measured_step_s))
        rows.append((run.id, predicted, run.measured_step_s))
    if eager or zero3:
        return errors, rows
    for key, (fwd, bwd) in table4_predictions_ms(cal).items():
        pub_fwd, pub_bwd = TABLE4_LAYER_MS[key]
        name = f"table4-{key[0]}{'-sp' if key[1] else ''}"
        errors += [0.5 * math.log(fwd / pub_fwd), 0.5 * math.log(bwd / pub_bwd)]
        rows += [(name + "-fwd-ms", fwd, pub_fwd), (name + "-bwd-ms", bwd, pub_bwd)]
    return errors, rows


def _current(base: Calibration, name: str) -> float:
    """The base calibration's value of fit parameter ``name`` (the starting point)."""
    device = {"a100": base.device("a100-80gb"), "h100": base.device("h100-sxm"),
              "gpu": base.device("h100-sxm")}
    prefix, _, field = name.partition("_")
    if prefix in device:
        value = getattr(device[prefix], field)
        return value if value is not None else float("nan")
    if name == "deepspeed_compute_factor":
        return base.compute_factor("deepspeed")
    if name == "deepspeed_zero3_path_rank_s":
        return base.zero3_path_rank_s.get("deepspeed", float("nan"))
    return getattr(base, name)


def fit(base: Calibration, *, eager: bool = False, zero3: bool = False) -> Calibration:
    """Minimise mean squared log error plus half the squared largest one over the fit targets,
    by Nelder-Mead inside each parameter's bounds: ``PARAMETERS`` on the non-eager targets, or
    (``eager``) ``EAGER_PARAMETERS`` on the eager fit runs, or (``zero3``)
    ``ZERO3_PARAMETERS`` on the DeepSpeed ZeRO-3 fit runs, with everything else fixed."""
    parameters, build = ((ZERO3_PARAMETERS, zero3_calibration_from_vector) if zero3 else
                         (EAGER_PARAMETERS, eager_calibration_from_vector) if eager else
                         (PARAMETERS, calibration_from_vector))
    lower = np.array([p[2] for p in parameters])
    upper = np.array([p[3] for p in parameters])

    def objective(z: np.ndarray) -> float:
        x = lower + (upper - lower) / (1 + np.exp(-z))  # keep inside bounds
        errors, _ = residuals(build(base, x), eager=eager, zero3=zero3)
        return float(np.mean(np.square(errors)) + 0.5 * np.max(np.abs(errors)) ** 2)

    x0 = np.array([_current(base, p[0]) for p in parameters])
    x0 = np.where(np.isnan(x0), [p[1] for p in parameters], x0)
    x0 = np.clip(x0, lower + 1e-3 * (upper - lower), upper - 1e-3 * (upper - lower))
    z0 = -np.log((upper - lower) / (x0 - lower) - 1)
    result = minimize(objective, z0, method="Nelder-Mead",
                      options={"maxiter": 1500, "xatol": 1e-4, "fatol": 1e-7})
    x = lower + (upper - lower) / (1 + np.exp(-result.x))
    return build(base, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="update calibration.json")
    parser.add_argument("--stage", choices=("all", "main", "eager", "zero3", "h200"),
                        default="all",
                        help="fit the non-eager parameters, the eager ones, DeepSpeed's ZeRO-3 "
                             "path, or all three in turn; or set the H200's eager values "
                             "from its own measurements (h200)")
    args = parser.parse_args()
    fitted = default_calibration()
    stages = {"all": ("main", "eager", "zero3"), "main": ("main",), "eager": ("eager",),
              "zero3": ("zero3",), "h200": ("h200",)}[args.stage]
    for stage in stages:
        fitted = (h200_measured(fitted) if stage == "h200" else
                  fit(fitted, eager=stage == "eager", zero3=stage == "zero3"))
    rows = (residuals(fitted)[1] + residuals(fitted, eager=True)[1]
            + residuals(fitted, zero3=True)[1])
    for name, predicted, published in rows:
        print(f"{name:40s} predicted {predicted:9.3f} published {published:9.3f} "
              f"error {predicted / published - 1:+.1%}")
    data = fitted.to_dict()
    data["source"] = dict(data["source"], fit=FIT_SOURCE)
    print(json.dumps(data, indent=2))
    if args.write:
        data = {"about": json.loads(CALIBRATION_FILE.read_text()).get("about", ""), **data}
        CALIBRATION_FILE.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {CALIBRATION_FILE}")


FIT_SOURCE = (
    "benchmarks/fit_calibration.py: A100 matmul/attention efficiency, GEMM overhead, "
    "element-wise traffic factors, NVLink efficiency and DP overlap fitted on the non-eager "
    "'fit' runs of reference_runs.json (Narayanan et al. 2021 Table 1: 1.7B, 7.5B, 39.1B, "
    "145.6B; Korthikanti et al. 2022 Table 5: 22B and 175B, full and SP+selective) and "
    "Korthikanti Table 4 layer times; H100 matmul efficiency on Llama 3 Table 4 (8,192 GPUs, "
    "without activation recomputation, Sec. 3.3.2; with Megatron-LM's data-parallel overlap, "
    "ParallelConfig.overlap_comm, which the Narayanan and Korthikanti runs did not "
    "have); "
    "DeepSpeed compute factor on MT-NLG (280 nodes). Then, with those fixed, the eager "
    "(FSDP trainer) values on the eager 'fit' runs (14 MosaicML llm-foundry rows: MPT-7B/13B on "
    "8 H100s, 30B on 16, 70B on 64, MPT-7B on 8 A100-80GB, 13B on 64 A100-40GB, MPT-1B at 16k "
    "and 32k tokens on 8 GPUs of each kind, MPT-1B and 3B on 512 H100s; torchtitan's Llama 2 "
    "13B on 64 A100s and Llama 3.1 8B on 8 Grand Teton H100s): each generation's "
    "eager GEMM efficiency, its SDPA flash-attention efficiency (the torchtitan rows) and its "
    "Triton flash-attention efficiency (the MosaicML rows, which ran llm-foundry's "
    "attn_impl: triton), and the prefetched FSDP collectives' "
    "contention (HBM bytes per byte on the ring; their overlap is PREFETCH_OVERLAP, not "
    "fitted). Then DeepSpeed ZeRO-3's per-rank call cost on its two fit rows "
    "(Narayanan et al. 2021 Table 2: 174.6B on 768 A100s, 529.6B on 2,240), its gather "
    "path rate cited (DeepSpeed #1174: 25 GB/s per GPU).")


if __name__ == "__main__":
    main()
