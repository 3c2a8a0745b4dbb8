"""Step-time accuracy against published runs (the bounds of the accuracy benchmark).

Per source family (``ReferenceRun.family``), over its fit and held-out runs: mean absolute
error <= 6 %, maximum <= 15 %, bias (mean signed error) within 5 %, except where
``KNOWN_SHORTFALLS`` says how far the model still is; no run beyond 15 % but the named
``KNOWN_OUTLIERS``."""

from __future__ import annotations

import pytest

from meshplan.costmodel import default_calibration
from meshplan.costmodel.reference import predict, reference_runs

BOUNDS = (0.06, 0.15, 0.05)
"""(mean |error|, max |error|, |bias|) every family must meet."""
KNOWN_SHORTFALLS = {
    # MosaicML's whole llm-foundry table (125M-70B, 512-65,536 tokens): the mean and bias hold;
    # the rows in KNOWN_OUTLIERS run 15-29 % slower than predicted.
    "mosaicml-a100": (0.06, 0.30, 0.05),
    "mosaicml-h100": (0.06, 0.19, 0.05),
    # torchtitan's long-context table (8B, 32K-262K tokens, FSDP + CP, compiled, float8, full
    # AC): CP 4 and 8 within 2 %, CP 1 and 2 predicted 16 % and 31 % slow, not monotonic in
    # the CP degree (the CP 2 row is the fastest relative to the model); attention-bound steps.
    # The ring's fp32 merges (timing.ring_attention_merge_s) add about 1 % to the CP rows
    "torchtitan-cp": (0.13, 0.32, 0.13),
    # torchtitan's 405B 3D table (async TP, PP 8, full AC stopping early): both rows 7-8 %
    # faster predicted than measured (6-7 % before SDPA's efficiency was fitted apart from
    # the MosaicML rows' Triton kernel). Both schedules' steps (1F1B 15 t, interleaved 11.5 t)
    # give one per-micro-batch stage time; the same mesh with one 32K sequence per
    # micro-batch (the 4D table's CP 1 row) comes out 2 % long
    "torchtitan-3d": (0.08, 0.08, 0.08),
    # OLMo-core's throughput table (compiled FSDP2 on 8 H100, bf16 and float8): the 7B and 8B
    # rows 8-12 % slower predicted than measured, the 1B and 13B within 3 % but 13B float8
    # (10 % fast); the 1B rows of the table's next revision (e27ba7455: micro-batch 8 x 4096
    # and the loss compiled, 25 % faster measured) 13-16 % slow: the model gives that change
    # 11 %
    "olmo-core-h100": (0.09, 0.16, 0.07),
}
KNOWN_OUTLIERS = {
    # runs at the edge of device memory (predicted reserved peak 89-97 % of the GPU): the
    # caching allocator's retries near capacity are not modelled
    "mosaicml-a100-40-13b-s512-g8", "mosaicml-a100-40-13b-s1024-g8",
    # (its 2,048-token neighbour, at 93 % too, -14.8 % until the PURE rows reduced in bf16)
    "mosaicml-a100-40-13b-s2048-g8",
    "mosaicml-a100-40-70b-s2048-g64",
    "mosaicml-a100-80-30b-s8192-g8", "mosaicml-h100-30b-s8192-g8",
    # rows that break from their own table's neighbours (the same model at the next GPU
    # count or sequence length runs 20 % faster); the memory model puts these three above
    # capacity (117-119 %), so it over-predicts their activations too
    "mosaicml-a100-40-1b-s2048-g32", "mosaicml-a100-80-760m-s512-g8",
    "mosaicml-a100-80-760m-s1024-g8",
    # torchtitan's long-context rows without CP (32K) and with CP 2 (64K): see KNOWN_SHORTFALLS
    "torchtitan-llama3.1-8b-fsdp8-cp1-s32768-h100", "torchtitan-llama3.1-8b-fsdp4-cp2-s65536-h100",
    # OLMo-core's 1B at micro-batch 8 with the loss compiled: see KNOWN_SHORTFALLS
    "olmo-core-1b-bf16-g8-mb8",
}
"""Runs allowed beyond the 15 % bound (every other run must stay within it)."""


@pytest.fixture(scope="module")
def errors() -> dict[str, tuple[str, str, bool, float]]:
    calibration = default_calibration()
    return {run.id: ("golden" if run.golden else run.set, run.family, run.dp_heavy,
                     predict(run, calibration).time.step_s / run.measured_step_s - 1)
            for run in reference_runs()}


def test_golden_runs_within_bounds(errors):
    golden = [abs(err) for group, _, _, err in errors.values() if group == "golden"]
    assert len(golden) == 8
    assert sum(golden) / len(golden) <= 0.10
    assert max(golden) <= 0.20


def test_holdout_runs_within_bounds(errors):
    holdout = {rid: err for rid, (group, _, _, err) in errors.items() if group == "holdout"}
    assert len(holdout) >= 10
    assert sum(abs(e) for e in holdout.values()) / len(holdout) <= 0.06
    assert abs(sum(holdout.values()) / len(holdout)) <= 0.05


def test_only_the_known_outliers_exceed_15_percent(errors):
    beyond = {rid for rid, (_, _, _, err) in errors.items() if abs(err) > 0.15}
    assert beyond == KNOWN_OUTLIERS, sorted(beyond ^ KNOWN_OUTLIERS)


FAMILIES = ("narayanan-t1", "korthikanti", "mt-nlg", "llama3", "narayanan-t2-zero3",
            "narayanan-t2-ptdp", "mosaicml-h100", "mosaicml-a100", "torchtitan-fsdp2",
            "torchtitan-cp", "torchtitan-2d", "torchtitan-3d", "torchtitan-4d", "torchtitan-tp",
            "fms-fsdp", "fms-fsdp-compile", "mosaicml-h100-fp8", "nemo-h100-fp8",
            "megatron-core-h100", "olmo-core-h100")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_within_bounds(errors, family):
    errs = [err for _, fam, _, err in errors.values() if fam == family]
    assert errs, family
    mean_bound, max_bound, bias_bound = KNOWN_SHORTFALLS.get(family, BOUNDS)
    assert sum(abs(e) for e in errs) / len(errs) <= mean_bound, errs
    assert max(abs(e) for e in errs) <= max_bound, errs
    assert abs(sum(errs) / len(errs)) <= bias_bound, errs


def test_data_parallel_heavy_group_within_bounds(errors):
    """ZeRO-3 / FSDP runs without model parallelism, from 8 to 2,240 GPUs."""
    errs = [err for _, _, heavy, err in errors.values() if heavy]
    assert len(errs) >= 200
    assert sum(abs(e) for e in errs) / len(errs) <= 0.06
    assert abs(sum(errs) / len(errs)) <= 0.05


def test_every_run_has_a_family(errors):
    assert {fam for _, fam, _, _ in errors.values()} == set(FAMILIES)


def test_measured_step_from_published_tflops():
    """Narayanan Table 1 reports TFLOP/s; the implied step time matches the reference file's
    derived value (tests/data/published.json: implied_iter_time_s_derived)."""
    runs = {run.id: run for run in reference_runs()}
    assert runs["narayanan-145.6b"].measured_step_s == pytest.approx(24.817, rel=1e-3)
    assert runs["narayanan-1.7b"].measured_step_s == pytest.approx(3.528, rel=1e-3)


def test_measured_step_from_tokens_per_second():
    """MosaicML reports tokens/s per GPU: MPT-7B on 8 H100s, global batch 48 x 2048 tokens at
    10,643 tokens/s per GPU is a 1.1546 s step."""
    runs = {run.id: run for run in reference_runs()}
    assert runs["mosaicml-h100-7b-s2048-g8"].measured_step_s == pytest.approx(
        48 * 2048 / (10643 * 8), rel=1e-9)


def test_llama_3s_long_context_row_holds_no_more_than_its_8k_rows():
    """The 131K-token CP 16 row runs without recomputation, as the 8K-token rows do (Llama 3,
    Sec. 3.3.2): a context rank holds 8,192 tokens of the sequence, as a rank of those runs
    does on the same TP 8 x PP 16 layout. It rests on the memory model agreeing: at every
    interleaving the tuner tries, its reserve without recomputation is at most the 8K row's,
    which the paper reports running (the model over-predicts both: neither 'fits')."""
    from meshplan.costmodel.estimate import estimate
    from meshplan.costmodel.reference import tuned_configs
    runs = {run.id: run for run in reference_runs()}
    long_row, short_row = runs["llama3-405b-16k-gpus-cp16"], runs["llama3-405b-8k-gpus"]
    assert long_row.config.stage_recompute(0) == "none" and "recompute" not in long_row.tune

    def reserve(run):
        return {c.vpp: estimate(run.model, run.cluster, c, framework=run.framework,
                                calibration=default_calibration()).memory.peak_reserved_bytes
                for c in tuned_configs(run)}

    long_reserve, short_reserve = reserve(long_row), reserve(short_row)
    assert set(long_reserve) == set(short_reserve) and len(long_reserve) >= 4
    for vpp, held in long_reserve.items():
        assert held <= short_reserve[vpp], vpp
