"""Golden memory tests: the cost model against published numbers in tests/data/published.json.

Expected values come from the published cases (or from the source's formula evaluated here, in
the test, never by the code under test):

* ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054) Table 1: model states of a 7.5B model;
* DeepSpeed 0.19.8 ``estimate_zero2/3_model_states_mem_needs`` return values;
* Korthikanti et al. 2022 (arXiv:2205.05198) Table 2 activation bytes per layer, Fig. 7 ratios;
* Megatron-LM ``theoretical_memory_usage.py`` on Korthikanti's Table 3 configurations;
* Korthikanti Fig. 1 first-stage memory as measured (Calculon's reading of the bars).
"""

from __future__ import annotations

import pytest

from meshplan.costmodel import activations as act
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.frameworks import (deepspeed_host_bytes_per_node, framework_buffer_bytes,
                                  model_state_bytes)
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model

EXACT = 1e-9
"""Relative tolerance where the source is a formula."""
PUBLISHED_ROUNDED = 0.01
"""Relative tolerance against a published number printed with few digits."""
MEASURED = 0.10
"""Relative tolerance against a measurement (a bar read off a figure)."""
GB = 1e9
GIB = 2**30
MIB = 2**20
CLUSTER = "dgx-a100-80gb"
"""Korthikanti et al. and Narayanan et al. ran on Selene: DGX A100 80GB nodes."""

# Published model labels -> catalog names (Korthikanti et al. Table 3).
MODEL_NAMES = {"22B": "megatron-22b", "175B": "gpt3-175b", "megatron-22B": "megatron-22b",
               "gpt3-175B": "gpt3-175b"}


def _state_total(states) -> float:
    return states.params + states.grads + states.optimizer


# ----- ZeRO Table 1 ------------------------------------------------------------------------------
ZERO_STAGES = {"baseline": 0, "P_os (ZeRO-1)": 1, "P_os+g (ZeRO-2)": 2, "P_os+g+p (ZeRO-3)": 3}


def zero_paper_bytes(*, stage: int, psi: float, nd: int, k: float = 12) -> float:
    """ZeRO Sec. 5 / Table 1: baseline (2+2+K)Psi; P_os 4Psi + K Psi/Nd; P_os+g 2Psi + (2+K)Psi/Nd;
    P_os+g+p (4+K)Psi/Nd."""
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / nd, 2: 2 * psi + (2 + k) * psi / nd,
            3: (4 + k) * psi / nd}[stage]


def _printed_half_unit(value: float) -> float:
    """Half a unit in the last digit a number was printed with (41.3 -> 0.05, 120 -> 0.5)."""
    text = repr(value)
    decimals = len(text.split(".")[1]) if "." in text else 0
    return 0.5 * 10.0**-decimals


@pytest.mark.published(kind="zero_memory")
def test_zero_table1_ideal_framework(published_case):
    inputs, expected = published_case["inputs"], published_case["expected"]
    assert inputs["K"] == 12  # the 'ideal' framework is mixed-precision Adam: K = 12
    stage = ZERO_STAGES[inputs["stage"]]
    psi = inputs["psi"]
    paper_gb = expected.get("per_device_model_state_GB_paper",
                            expected.get("per_device_model_state_GB"))
    for nd in ((1, 8, 64) if inputs["nd"] == "any" else (inputs["nd"],)):
        states = model_state_bytes("ideal", params=psi, shard=nd, zero_stage=stage,
                                   offload="none")
        ours = _state_total(states)
        # formula_GB is printed to 6 decimals (30.351562 for 30.3515625): compare to that.
        assert ours / GB == pytest.approx(expected["formula_GB"], rel=EXACT, abs=1e-6)
        assert ours == pytest.approx(zero_paper_bytes(stage=stage, psi=psi, nd=nd), rel=EXACT)
        # The paper prints 2-3 significant digits (41.25 -> 41.3, 0.1172 -> 0.12).
        tolerance = max(PUBLISHED_ROUNDED * paper_gb, _printed_half_unit(paper_gb) + 1e-9)
        assert abs(ours / GB - paper_gb) <= tolerance


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("nd", [1, 4, 16, 64, 256, 1024])
def test_zero_formulas_end_to_end_through_estimate(nd, zero_stage):
    """A catalog 7.5B model, data parallel only, ``--framework ideal``: the estimate's model
    states are the ZeRO formulas applied to the model's parameter count."""
    model = load_model("megatron-7.5b")
    cluster = load_cluster(CLUSTER, nodes=max(1, nd // 8), gpus_per_node=min(8, nd))
    config = ParallelConfig(dp=nd, zero_stage=zero_stage, global_batch_size=nd,
                            seq_len=model.seq_len)
    est = estimate(model, cluster, config, framework="ideal")
    expected = zero_paper_bytes(stage=zero_stage, psi=model.num_params, nd=nd)
    assert est.memory.model_states_bytes == pytest.approx(expected, rel=EXACT)


# ----- DeepSpeed estimators ---------------------------------------------------------------------
def _ds_inputs(inputs: dict) -> tuple[int, str]:
    stage = 2 if inputs["function"] == "estimate_zero2_model_states_mem_needs" else 3
    if not inputs["cpu_offload"]:
        offload = "none"
    elif inputs.get("cpu_offload_params", False):
        offload = "optimizer+params"
    else:
        offload = "optimizer"
    return stage, offload


@pytest.mark.published(kind="ds_estimator")
def test_deepspeed_estimator_gpu_bytes(published_case):
    """GPU bytes = DeepSpeed's model states plus, for ZeRO-3, the largest layer's fp16 param
    and grad. For ZeRO-2 DeepSpeed's estimator leaves out the reduce/all-gather buckets that
    ``framework_buffer_bytes`` adds, so only model states are compared."""
    inputs, expected = published_case["inputs"], published_case["expected"]
    assert inputs["additional_buffer_factor"] == 1.5  # DeepSpeed's default, which we assume
    stage, offload = _ds_inputs(inputs)
    params = inputs["total_params"]
    shard = inputs["num_gpus_per_node"] * inputs["num_nodes"]
    largest = inputs.get("largest_layer_params", 0)
    ours = _state_total(model_state_bytes("deepspeed", params=params, shard=shard,
                                          zero_stage=stage, offload=offload))
    if stage == 3:
        buffers = framework_buffer_bytes("deepspeed", zero_stage=3, stage_params=params,
                                         largest_layer_params=largest)
        assert buffers == pytest.approx(expected["largest_layer_memory_bytes"], rel=EXACT)
        ours += buffers
    assert ours == pytest.approx(expected["gpu_mem_bytes"], rel=EXACT)


@pytest.mark.published(kind="ds_estimator")
def test_deepspeed_estimator_cpu_bytes(published_case):
    inputs, expected = published_case["inputs"], published_case["expected"]
    stage, offload = _ds_inputs(inputs)
    ours = deepspeed_host_bytes_per_node(
        total_params=inputs["total_params"], zero_stage=stage, offload=offload,
        gpus_per_node=inputs["num_gpus_per_node"], nodes=inputs["num_nodes"],
        largest_layer_params=inputs.get("largest_layer_params", 0),
        zero_init=inputs.get("zero_init", True))
    assert ours == pytest.approx(expected["cpu_mem_bytes"], rel=EXACT)


def test_deepspeed_host_bytes_end_to_end_through_estimate():
    """``estimate`` wires DeepSpeed's ZeRO-3 offload estimator (with zero.Init) through:
    host bytes per node = P * 18 / nodes * 1.5 (stage3.py estimate_zero3_model_states_mem_needs).
    """
    model = load_model("megatron-7.5b")
    nodes = 4
    cluster = load_cluster(CLUSTER, nodes=nodes)
    config = ParallelConfig(dp=32, zero_stage=3, offload="optimizer+params", global_batch_size=32,
                            seq_len=model.seq_len)
    est = estimate(model, cluster, config, framework="deepspeed")
    assert est.memory.cpu_bytes_per_node == pytest.approx(
        model.num_params * 18 / nodes * 1.5, rel=EXACT)
    stage = est.memory.per_stage[0]
    assert stage.params_bytes == stage.grads_bytes == stage.optimizer_bytes == 0


# ----- Korthikanti Table 2: activation bytes per layer -----------------------------------------
TECHNIQUES = {
    # technique: (tensor parallel, sequence parallel, recompute); Korthikanti Table 2 rows
    "no_parallelism": (False, False, "none"),
    "tp_baseline": (True, False, "none"),
    "tp_sp": (True, True, "none"),
    "tp_selective": (True, False, "selective"),
    "tp_sp_selective": (True, True, "selective"),
    "full_recompute": (True, False, "full"),
}


def test_korthikanti_models_in_catalog_match_table3_and_keep_dropout(published):
    """Table 2 counts dropout masks; the catalog models must have dropout and Table 3 shapes."""
    for label in ("22B", "175B"):
        model = load_model(MODEL_NAMES[label])
        inputs = published[f"korthikanti_actmem_{label}_tp_baseline"]["inputs"]
        assert model.dropout
        assert (model.hidden_size, model.num_heads) == (inputs["h"], inputs["a"])
        assert model.ffn_hidden_size == 4 * model.hidden_size
        assert model.q_size == model.kv_size == model.hidden_size


@pytest.mark.published(kind="activation_memory", prefix="korthikanti_actmem_")
def test_korthikanti_table2_layer_activation_bytes(published_case):
    inputs = published_case["inputs"]
    use_tp, sp, recompute = TECHNIQUES[inputs["technique"]]
    model = load_model(MODEL_NAMES[inputs["model"]])
    config = ParallelConfig(tp=inputs["t"] if use_tp else 1, sp=sp,
                            micro_batch_size=inputs["b"], global_batch_size=inputs["b"],
                            seq_len=inputs["s"], flash_attention=False)
    ours = act.layer_activation_bytes(model, config, recompute=recompute)
    assert ours == pytest.approx(published_case["expected"]["bytes_per_layer"], rel=EXACT)


FIG7_TECHNIQUES = {"none": "tp_baseline", "seq": "tp_sp", "sel": "tp_selective",
                   "seqsel": "tp_sp_selective", "full": "full_recompute"}


@pytest.mark.parametrize("label", ["megatron-22B", "gpt3-175B"])
def test_korthikanti_fig7_activation_ratios_to_tp_baseline(published, label):
    """Korthikanti Fig. 7: activation memory of each technique as % of the TP-only baseline
    (measured bars, printed to 0.01%), at the Table 3 micro-batch and tp; per layer, within 1%."""
    case = published[f"calculon_validation_fig7_{label}"]
    short = label.split("-")[1]
    table3 = published[f"korthikanti_t3t5_{short}"]["inputs"]
    model = load_model(MODEL_NAMES[short])

    def layer_bytes(technique: str) -> float:
        use_tp, sp, recompute = TECHNIQUES[technique]
        config = ParallelConfig(tp=table3["tp"] if use_tp else 1, sp=sp,
                                micro_batch_size=table3["micro_batch"],
                                global_batch_size=table3["micro_batch"], seq_len=table3["seq"],
                                flash_attention=False)
        return act.layer_activation_bytes(model, config, recompute=recompute)

    baseline = layer_bytes("tp_baseline")
    for key, technique in FIG7_TECHNIQUES.items():
        measured = float(case["expected"][key]["measured_pct"].rstrip("%")) / 100
        assert layer_bytes(technique) / baseline == pytest.approx(measured,
                                                                  rel=PUBLISHED_ROUNDED)


# ----- Megatron-LM theoretical memory and Korthikanti Fig. 1 -----------------------------------
def _korthikanti_config(published: dict, label: str, *, sp: bool,
                        recompute: str) -> ParallelConfig:
    """Korthikanti Table 3 configuration of ``label`` (22B or 175B), eager attention."""
    inputs = published[f"korthikanti_t3t5_{label}"]["inputs"]
    return ParallelConfig(tp=inputs["tp"], pp=inputs["pp"], dp=inputs["dp"], sp=sp,
                          recompute=recompute, micro_batch_size=inputs["micro_batch"],
                          global_batch_size=inputs["global_batch"],
                          vpp=inputs["interleave_stages_m"] or 1, seq_len=inputs["seq"],
                          flash_attention=False)


def _first_stage(published: dict, label: str, *, sp: bool, recompute: str):
    model = load_model(MODEL_NAMES[label])
    config = _korthikanti_config(published, label, sp=sp, recompute=recompute)
    cluster = load_cluster(CLUSTER, nodes=config.world_size // 8)
    est = estimate(model, cluster, config, framework="megatron")
    return est.memory.per_stage[0]


@pytest.mark.parametrize("label", ["22B", "175B"])
def test_megatron_theoretical_memory_first_stage(published, label):
    """Megatron-LM theoretical_memory_usage.py (HEAD and the 2023 version) on the most loaded
    (first) stage: weights + optimizer (18 bytes/param, no distributed optimizer) and
    SP + selective activations, within 1%."""
    case = published[f"megatron_theoretical_memory_{label}"]
    inputs, expected = case["inputs"], case["expected"]
    config = _korthikanti_config(published, label, sp=True, recompute="selective")
    assert (config.tp, config.pp, config.micro_batch_size, config.grad_accum_steps) == (
        inputs["tp"], inputs["pp"], inputs["micro_batch"], inputs["num_microbatches"])
    assert config.vpp == (inputs["virtual_pp"] or 1)
    first = _first_stage(published, label, sp=True, recompute="selective")
    for key in ("head_weight_and_optimizer_MiB", "v2023_weight_and_optimizer_MiB"):
        assert first.model_states_bytes / MIB == pytest.approx(expected[key],
                                                               rel=PUBLISHED_ROUNDED)
    for key in ("head_activation_sp_selective_MiB", "v2023_activation_MiB"):
        assert first.activations_bytes / MIB == pytest.approx(expected[key],
                                                              rel=PUBLISHED_ROUNDED)


@pytest.mark.parametrize("label", ["megatron-22B", "gpt3-175B"])
def test_korthikanti_fig1_params_and_optimizer(published, label):
    case = published[f"calculon_validation_fig1_par_{label}"]
    short = label.split("-")[1]
    for key, (sp, recompute) in {"no_recompute": (False, "none"),
                                 "seq_par+selective": (True, "selective")}.items():
        first = _first_stage(published, short, sp=sp, recompute=recompute)
        assert first.model_states_bytes / GIB == pytest.approx(
            case["expected"][key]["measured_GiB"], rel=MEASURED)


@pytest.mark.parametrize("label", ["megatron-22B", "gpt3-175B"])
def test_korthikanti_fig1_activations(published, label):
    """No recompute is the TP baseline (no SP); the other bar is SP + selective."""
    case = published[f"calculon_validation_fig1_act_{label}"]
    short = label.split("-")[1]
    for key, (sp, recompute) in {"no_recompute": (False, "none"),
                                 "seq_par+selective": (True, "selective")}.items():
        first = _first_stage(published, short, sp=sp, recompute=recompute)
        assert first.activations_bytes / GIB == pytest.approx(
            case["expected"][key]["measured_GiB"], rel=MEASURED)
