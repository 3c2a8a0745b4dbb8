"""HuggingFace Llama, Qwen2 and Qwen3 checkpoints in and out of the runtime, checked against
``transformers`` itself.

Small random models (6 layers, GQA, ~0.3 M parameters; Qwen3's with heads of 32, so its
query width, 128, is not the hidden size, and with its query and key norms' weights drawn
away from 1) are built with ``transformers`` and
saved with ``save_pretrained`` (safetensors) into temporary folders; nothing is fetched. Each
layout's first-step loss must equal ``transformers``' loss on the same batch (fp32, 1e-5); three
steps must equal a single-process run (losses and gradient norms, 1e-4: the third step is the
first made from two steps of AdamW state); a checkpoint written with ``--save-hf`` must load in
``transformers`` with the same logits (0 steps) or the same next-batch loss (after 3 steps).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from meshplan.costmodel import load_model  # noqa: E402
from meshplan.planner.plan import read_plan  # noqa: E402
from meshplan.runtime import data as data_mod  # noqa: E402
from meshplan.runtime import hf  # noqa: E402
from meshplan.runtime.materialize import materialize  # noqa: E402
from meshplan.runtime.train import RunOptions, plan_data  # noqa: E402

STEPS = 3
SAVE_EVERY = 1
"""The single-process run also writes ``--save-hf-every 1``: saved/step-1, saved/step-2 (the
last step's weights go to saved/ itself)."""
FIRST_STEP_TOL = 1e-5
STEPS_TOL = 1e-4
LOGITS_TOL = 1e-6
COMMON = dict(global_batch_size=8, seq_len=32, micro_batch_size=2)
LAYOUTS_2 = {"tp2": dict(tp=2), "pp2_uneven": dict(pp=2, layers_per_stage=(2, 4)),
             "pp2_interleaved_uneven": dict(pp=2, vpp=2, layers_per_stage=(2, 4)),
             "dp2_zero3": dict(dp=2, zero_stage=3)}
LAYOUTS_3D = {"llama": {"pp2_dp2_tp2_zero1": dict(pp=2, dp=2, tp=2, zero_stage=1)},
              "qwen2": {"pp2_dp2_tp2_zero3": dict(pp=2, dp=2, tp=2, zero_stage=3)},
              "qwen3": {"pp2_dp2_tp2_sp_zero3": dict(pp=2, dp=2, tp=2, sp=True,
                                                     zero_stage=3)}}
"""One 8-process 3D layout per architecture; Qwen2's and Qwen3's under ZeRO-3, whose FSDP
shards of tensor-parallel shards each rank reads from the checkpoint by region
(materialize.py); Qwen3's with sequence parallelism, its query and key norms on each rank's
heads beside norms on sequence shards."""
ARCHITECTURES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def _hf_model(kind: str, folder: Path) -> Path:
    extra = dict(head_dim=32) if kind == "qwen3" else {}
    config = getattr(transformers, ARCHITECTURES[kind])(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rope_theta=50000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, **extra)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if kind == "qwen3":  # norms at 1 would hide a missing or misplaced query / key norm
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.normal_(1.0, 0.2)
    model.save_pretrained(folder)
    return folder


def _job(root: Path, name: str, model_dir: Path, layouts: dict, *, steps: int,
         save_hf: Path | None, plan_file, torchrun_env,
         save_hf_every: int = 0) -> dict[str, dict]:
    """Run ``layouts`` (one world size) from ``model_dir``'s weights in one torchrun launch;
    their reports by name."""
    from meshplan.costmodel import ParallelConfig
    from meshplan.runtime.launch import Launch, torchrun_command
    from meshplan.runtime.worker import Job

    spec = load_model(str(model_dir))
    plans = [plan_file(spec, ParallelConfig(dtype="fp32", **COMMON, **fields),
                       root / f"{name}-{key}.json") for key, fields in layouts.items()]
    reports = [root / f"{name}-{key}-report.json" for key in layouts]
    world = read_plan(plans[0]).config.world_size
    job = Job(plans=tuple(map(str, plans)), reports=tuple(map(str, reports)),
              options=RunOptions(steps=steps, timeout_s=60.0, init_from=str(model_dir),
                                 save_hf=str(save_hf) if save_hf else None,
                                 save_hf_every=save_hf_every))
    done = subprocess.run(torchrun_command(job, Launch(), nproc_per_node=world),
                          capture_output=True, text=True, timeout=200, env=torchrun_env)
    assert done.returncode == 0, done.stderr[-5000:]
    return {key: json.loads(path.read_text()) for key, path in zip(layouts, reports)}


def _hf_loss(model_dir: Path, plan_path: Path, step: int) -> float:
    """``transformers``' mean next-token loss on the run's batch of ``step`` (0-based)."""
    plan = read_plan(plan_path)
    batch = data_mod.global_batch(plan_data(plan, RunOptions(steps=1)), step)
    inputs, targets = data_mod.split_inputs_targets(batch)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(inputs).logits
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def runs(request, tmp_path_factory, plan_file, meshplan_env):
    """Per architecture: its HF folder, the single-process run (which saves ``--save-hf``
    after ``STEPS`` steps) and the layouts' runs of one step more."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = _hf_model(kind, root / "hf")
    saved = root / "saved"
    single = _job(root, "w1", model_dir, {"single": {}}, steps=STEPS, save_hf=saved,
                  save_hf_every=SAVE_EVERY, plan_file=plan_file,
                  torchrun_env=meshplan_env)["single"]
    layouts = dict(LAYOUTS_2)
    reports = _job(root, "w2", model_dir, layouts, steps=STEPS + 1, save_hf=None,
                   plan_file=plan_file, torchrun_env=meshplan_env)
    reports |= _job(root, "w8", model_dir, LAYOUTS_3D[kind], steps=STEPS + 1, save_hf=None,
                    plan_file=plan_file, torchrun_env=meshplan_env)
    return kind, root, model_dir, saved, single, reports


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_first_step_loss_of_every_layout_equals_transformers(runs):
    kind, root, model_dir, _, single, reports = runs
    expected = _hf_loss(model_dir, root / "w1-single.json", 0)
    assert abs(single["losses"][0] - expected) <= FIRST_STEP_TOL, (kind, single["losses"][0])
    for name, report in reports.items():
        assert abs(report["losses"][0] - expected) <= FIRST_STEP_TOL, (kind, name,
                                                                       report["losses"][0],
                                                                       expected)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_steps_of_every_layout_equal_one_process(runs):
    kind, _, _, _, single, reports = runs
    for name, report in reports.items():
        for key in ("losses", "grad_norms"):
            got, want = report[key][:STEPS], single[key]
            assert max(abs(a - b) for a, b in zip(got, want)) <= STEPS_TOL, (kind, name, key,
                                                                            got, want)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_saved_checkpoint_loads_in_transformers_with_the_next_batch_loss(runs):
    """After ``STEPS`` (3) steps: ``transformers`` on the saved folder, batch 4, vs the
    layouts' 4th step (its loss is computed with the weights after 3 updates)."""
    kind, root, model_dir, saved, _, reports = runs
    assert {"config.json", hf.INDEX} <= set(os.listdir(saved))
    loss = _hf_loss(saved, root / "w1-single.json", STEPS)
    for name, report in reports.items():
        assert abs(report["losses"][STEPS] - loss) <= STEPS_TOL, (kind, name)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoints_saved_every_n_steps_load_with_the_next_batch_loss(runs):
    """``--save-hf-every 1`` of a 3-step run: step-1 and step-2, each loaded by
    ``transformers``, give the loss meshplan computed on the next batch."""
    kind, root, _, saved, single, _ = runs
    assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == ["step-1", "step-2"]
    for step in (1, 2):
        loss = _hf_loss(saved / f"step-{step}", root / "w1-single.json", step)
        assert abs(single["losses"][step] - loss) <= STEPS_TOL, (kind, step)


LOAD_OVERHEAD_BYTES = 16 * 2 ** 20
"""What loading adds to a rank's resident memory beyond its parameter shards and one
tensor's region in flight (safetensors' copy before it lands in the shard): allocator and
library state. Measured 9.4-9.5 MiB on this machine (dp4 and tp2 x dp2, ZeRO-3) for
checkpoints of 48 and 192 MiB, whose shards and regions in flight were 14 and 56 MiB, with
workers of their own interpreters. A worker forked from the preloaded server (the CPU default,
``runtime/prefork.py``) also counts the shared-library code it first runs while loading (Linux
does not copy the page tables of file mappings at a fork): 6-7 MiB more here, so the test
starts its workers as interpreters of their own."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_rank_reads_only_its_own_shard(tmp_path, plan_file):
    """tp2 x dp2 ZeRO-3 (each rank keeps a quarter) loading a 48 MiB checkpoint: the growth
    of each rank's resident memory while it builds and loads is its quarter, one tensor's
    region and the fixed overhead; reading the whole checkpoint would exceed that."""
    from meshplan.costmodel import ParallelConfig
    from meshplan.runtime.agent import START_ENV
    from tests.runtime.conftest import run_meshplan

    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=8192, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "hf")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    plan = plan_file(load_model(str(tmp_path / "hf")),
                     ParallelConfig(dtype="fp32", tp=2, dp=2, zero_stage=3, **COMMON),
                     tmp_path / "plan.json")
    done = run_meshplan("run", str(plan), "--steps", "1", "--init-from", str(tmp_path / "hf"),
                        "--json", "--oversubscribe", env={START_ENV: "spawn"})
    assert done.returncode == 0, done.stderr[-3000:]
    share = total / 4
    bound = share + largest / 4 + LOAD_OVERHEAD_BYTES
    assert total > bound  # a rank that read the whole checkpoint would fail the test
    growth = [rank["build_rss_bytes"] for rank in json.loads(done.stdout)["per_rank"]]
    assert len(growth) == 4 and all(g is not None for g in growth)
    assert max(growth) <= bound, (growth, share)
    assert min(growth) >= share * 0.9  # it did load its shard


@pytest.mark.timeout(120)
def test_zero_step_round_trip_keeps_the_logits(tmp_path):
    """Load an HF folder into the decoder, write it back with ``hf.save`` (a one-process
    group), and compare ``transformers``' logits of both folders."""
    import torch.distributed as dist
    from meshplan.runtime.model import build_decoder

    source = _hf_model("qwen2", tmp_path / "hf")
    (source / "tokenizer.json").write_text("{}")  # copied along
    spec = load_model(str(source))
    module = build_decoder(spec, device="meta")
    materialize(module, torch.device("cpu"), hf.SliceReader(str(source)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        hf.save([module], str(tmp_path / "out"), spec=spec, stage_indices=[0], num_stages=1,
                writer=True, source=str(source))
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (source, tmp_path / "out"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                                  dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert (logits[0] - logits[1]).abs().max().item() <= LOGITS_TOL


def test_hf_config_reads_rope_and_norm_settings_of_both_transformers_versions():
    from meshplan.costmodel.models import from_hf_config

    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=96, vocab_size=128, max_position_embeddings=64,
                rms_norm_eps=1e-6)
    v4 = from_hf_config({**base, "rope_theta": 500000}, name="v4")
    v5 = from_hf_config({**base, "rope_parameters": {"rope_theta": 500000.0,
                                                     "rope_type": "default"}}, name="v5")
    assert v4.rope_theta == v5.rope_theta == 500000.0 and v4.norm_eps == 1e-6
    scaled = from_hf_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                            name="s")
    assert scaled.rope_scaling == "llama3" and v5.rope_scaling == ""


def test_init_from_refuses_another_model_in_one_line(tmp_path):
    source = _hf_model("llama", tmp_path / "hf")
    other = load_model(str(source))
    import dataclasses
    with pytest.raises(ValueError, match="another model than the plan's: ffn_hidden_size"):
        hf.check_directory(str(source), dataclasses.replace(other, ffn_hidden_size=128))
    (source / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors file"):
        hf.check_directory(str(source), other)
    (source / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        hf.check_directory(str(source), other)
    (source / hf.INDEX).write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="no 'weight_map' of tensor names"):
        hf.check_directory(str(source), other)
    (source / hf.INDEX).write_text('{"weight_map": {"model.norm.weight": "a.safetensors"}}')
    with pytest.raises(ValueError, match="a.safetensors: no such file"):
        hf.check_directory(str(source), other)
    (source / "config.json").write_text("{bad")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        hf.check_directory(str(source), other)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_the_built_in_decoder_saves_a_checkpoint_transformers_loads(tmp_path, qk_norm):
    """``--save-hf`` for a catalog model: ``config.json`` made from its spec (Llama; Qwen3 for
    the same model with query and key norms and heads of 32, their weights drawn away from
    1), the logits of ``transformers`` equal the decoder's."""
    import dataclasses

    import torch.distributed as dist
    from meshplan.runtime.model import build_decoder

    spec = load_model("tiny")
    if qk_norm:
        spec = dataclasses.replace(spec, name="tiny-qk-norm", qk_norm=True, head_dim=32)
    module = build_decoder(spec, seed=3)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(2))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        hf.save([module], str(tmp_path / "out"), spec=spec, stage_indices=[0], num_stages=1,
                writer=True, source=None)
    finally:
        dist.destroy_process_group()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == ("qwen3" if qk_norm else "llama")
    assert config["num_key_value_heads"] == spec.kv_heads
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                              dtype=torch.float32)
    with torch.no_grad():
        diff = (model(tokens).logits - module(tokens)).abs().max().item()
    assert diff <= LOGITS_TOL


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_zero_steps_under_a_pipeline_convert_the_checkpoint_unchanged(tmp_path, plan_file,
                                                                      meshplan):
    """``meshplan run PLAN --steps 0 --init-from D --save-hf E`` on pp2: one shard per stage,
    and ``transformers`` gives E the logits of D."""
    from meshplan.costmodel import ParallelConfig

    source = _hf_model("llama", tmp_path / "hf")
    plan = plan_file(load_model(str(source)), ParallelConfig(dtype="fp32", pp=2, **COMMON),
                     tmp_path / "pp2.json")
    out = tmp_path / "out"
    done = meshplan("run", str(plan), "--steps", "0", "--init-from", str(source), "--save-hf",
                    str(out), "--oversubscribe", timeout_s=180)
    assert done.returncode == 0, done.stderr[-3000:]
    index = json.loads((out / hf.INDEX).read_text())["weight_map"]
    assert sorted(set(index.values())) == ["model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors"]
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    logits = []
    for folder in (source, out):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                                  dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert (logits[0] - logits[1]).abs().max().item() <= LOGITS_TOL


def _saved_random(config, folder: Path, *, seed: int):
    """A random ``transformers`` model of ``config`` saved to ``folder``; its ModelSpec."""
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return load_model(str(folder))


def _decoder_from(spec, folder: Path):
    """The runtime's decoder of ``spec`` built on meta and loaded from ``folder``."""
    from meshplan.runtime.model import build_decoder

    module = build_decoder(spec, device="meta")
    materialize(module, torch.device("cpu"), hf.SliceReader(str(folder)))
    return module


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 4.0}])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    """Llama 3.1's and linear RoPE scaling: the decoder's logits equal ``transformers``'
    (an original context of 16 tokens puts the 16 frequencies of a 32-wide head in all three
    llama3 bands)."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=128, max_position_embeddings=64, rope_theta=50000.0,
        rope_scaling=scaling)
    spec = _saved_random(config, tmp_path / "hf", seed=4)
    assert spec.rope_scaling == scaling["rope_type"] and spec.rope_factor == scaling["factor"]
    module = _decoder_from(spec, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                              dtype=torch.float32)
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (model(tokens).logits - module(tokens)).abs().max().item()
    assert diff <= LOGITS_TOL


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """A Mistral with an 8-token window on 32-token sequences: the decoder's logits equal
    ``transformers``', and differ from full causal attention's (the window matters)."""
    import dataclasses

    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, sliding_window=8,
        tie_word_embeddings=False)
    spec = _saved_random(config, tmp_path / "hf", seed=5)
    assert spec.sliding_window == 8 and hf.check_mappable(spec, what="test") == "mistral"
    hf.check_directory(str(tmp_path / "hf"), spec)
    outputs = []
    for window in (8, None):
        module = _decoder_from(dataclasses.replace(spec, sliding_window=window), tmp_path / "hf")
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            outputs.append(module(tokens))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                              dtype=torch.float32)
    with torch.no_grad():
        expected = model(tokens).logits
    assert (expected - outputs[0]).abs().max().item() <= LOGITS_TOL
    assert (expected - outputs[1]).abs().max().item() > 1e-3
    assert hf.hf_config_of(spec)["sliding_window"] == 8


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_traced_hf_model_starts_from_its_checkpoint(tmp_path, plan_file, meshplan_env):
    """Gemma 2 (no analytic reader: traced as ``hf-config:PATH`` and run whole) from a
    ``save_pretrained`` folder: one process and dp 2 under ZeRO-3 take its weights
    (``--init-from``), so the first step's loss is ``transformers``' own on the same batch;
    the dp 2 run's ``--save-hf`` checkpoint after one step loads in ``transformers`` with the
    loss the run took its second step at. A folder missing a tensor is refused in one line
    before anything starts."""
    from meshplan.costmodel import ParallelConfig
    from meshplan.runtime.launch import Launch, torchrun_command
    from meshplan.runtime.worker import Job

    config = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(1)
    folder = tmp_path / "gemma2"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    spec = load_model(str(folder), seq_len=32, dtype="fp32")
    assert spec.is_traced and hf.traced_from_hf_config(spec)
    hf.check_directory(str(folder), spec)
    expected, saved = None, tmp_path / "saved"
    for name, fields in {"single": {}, "dp2_zero3": dict(dp=2, zero_stage=3)}.items():
        plan = plan_file(spec, ParallelConfig(dtype="fp32", **COMMON, **fields),
                         tmp_path / f"{name}.json")
        report = tmp_path / f"{name}-report.json"
        writes = dict(steps=2, save_hf=str(saved), save_hf_every=1) if name != "single" \
            else dict(steps=1)
        job = Job(plans=(str(plan),), reports=(str(report),),
                  options=RunOptions(timeout_s=60.0, init_from=str(folder), **writes))
        world = read_plan(plan).config.world_size
        done = subprocess.run(torchrun_command(job, Launch(), nproc_per_node=world),
                              capture_output=True, text=True, timeout=300, env=meshplan_env)
        assert done.returncode == 0, done.stderr[-5000:]
        expected = expected if expected is not None else _hf_loss(folder, plan, 0)
        loss = json.loads(report.read_text())["losses"][0]
        assert abs(loss - expected) <= FIRST_STEP_TOL, (name, loss, expected)
    second = json.loads(report.read_text())["losses"][1]
    assert (saved / "step-1" / "config.json").read_text() == \
        (folder / "config.json").read_text()
    assert abs(_hf_loss(saved / "step-1", plan, 1) - second) <= STEPS_TOL, second
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="tensors of gemma2's module are missing, e.g. "
                                         "model.norm.weight"):
        hf.check_directory(str(broken), spec)
