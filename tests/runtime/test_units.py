"""Single-process tests of the runtime's pieces: model, layout, data, optimizer, memory."""

from __future__ import annotations

import os
import dataclasses

import numpy as np
import pytest
import torch

from meshplan.costmodel import ParallelConfig, load_model
from meshplan.runtime import data, materialize, mesh, optim, pipeline
from meshplan.runtime.memory import LiveStorageTracker, PeakMemory
from meshplan.runtime.report import RunReport
from meshplan.runtime.model import build_decoder
from meshplan.runtime.recipe import Recipe

TINY = load_model("tiny")


# ----- model -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "gpt3-125m", "llama2-7b"])
def test_parameter_count_equals_the_cost_model(name):
    spec = dataclasses.replace(load_model(name), num_layers=1, reported_params=None)
    if spec.hidden_size > 1024:  # keep it small: same architecture, narrower
        spec = dataclasses.replace(spec, hidden_size=256, ffn_hidden_size=688,
                                   vocab_size=1000, padded_vocab_size=None, num_heads=8,
                                   num_kv_heads=None if spec.num_kv_heads is None else 8,
                                   head_dim=None)
    model = build_decoder(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_stages_reproduce_the_whole_model():
    """Weights are seeded by parameter name, so stage-wise construction equals the full model."""
    full = build_decoder(TINY, seed=3)
    first = build_decoder(TINY, layer_ids=[0], last=False, seed=3)
    middle = build_decoder(TINY, layer_ids=[1, 2], first=False, last=False, seed=3)
    last = build_decoder(TINY, layer_ids=[3], first=False, seed=3)
    params = dict(full.named_parameters())
    for part in (first, middle, last):
        for name, param in part.named_parameters():
            assert torch.equal(param, params[name]), name
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    torch.testing.assert_close(last(middle(first(tokens))), full(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_a_stage_built_on_meta_and_filled_equals_the_eager_one(tied):
    """``materialize`` gives each parameter its ``initial_value``: the meta-built stages of a
    pipeline equal the eagerly built ones, and a whole tied model keeps one shared tensor."""
    spec = dataclasses.replace(TINY, tied_embeddings=tied)
    for ids, first, last in (([0, 1, 2, 3], True, True), ([0, 1], True, False),
                             ([2, 3], False, True)):
        eager = build_decoder(spec, layer_ids=ids, first=first, last=last, seed=5)
        built = build_decoder(spec, layer_ids=ids, first=first, last=last, device="meta")
        assert all(p.is_meta for p in built.parameters())
        materialize.materialize(built, torch.device("cpu"), materialize.random_fill(
            num_layers=spec.num_layers, seed=5, tied_copy=built.tied_copy))
        expected = dict(eager.named_parameters())
        assert [name for name, _ in built.named_parameters()] == list(expected)
        for name, param in built.named_parameters():
            assert torch.equal(param, expected[name]), (ids, name)
        if first and last and tied:
            assert built.output.weight is built.tok_embeddings.weight


def test_seed_changes_the_weights():
    a, b = build_decoder(TINY, seed=0), build_decoder(TINY, seed=1)
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)


def test_attention_is_causal():
    model = build_decoder(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % TINY.vocab_size
    torch.testing.assert_close(model(tokens)[0, :10], model(changed)[0, :10])


def test_tied_embeddings_share_one_matrix():
    spec = dataclasses.replace(TINY, tied_embeddings=True, reported_params=None)
    model = build_decoder(spec)
    assert model.output.weight is model.tok_embeddings.weight


def test_moe_is_refused():
    spec = dataclasses.replace(TINY, num_experts=4, moe_top_k=2, reported_params=None)
    with pytest.raises(ValueError, match="MoE"):
        build_decoder(spec)


# ----- layout ------------------------------------------------------------------------------------

def test_interleaved_split_follows_the_worked_example():
    config = ParallelConfig(pp=2, vpp=2, layers_per_stage=(3, 5), global_batch_size=8, seq_len=64)
    assert pipeline.virtual_stage_layers(config, 8) == [[0, 1], [2, 3, 4], [5], [6, 7]]
    assert pipeline.rank_stage_indices(config, 0) == [0, 2]
    assert pipeline.rank_stage_indices(config, 1) == [1, 3]


def test_virtual_chunks_of_a_rank_give_the_remainder_to_the_first_chunks():
    # 4 layers per rank over 3 chunks: (2, 1, 1) each; virtual stages alternate ranks 0, 1
    config = ParallelConfig(pp=2, vpp=3, layers_per_stage=(4, 4), global_batch_size=8,
                            seq_len=64)
    assert pipeline.virtual_stage_layers(config, 8) == [[0, 1], [2, 3], [4], [5], [6], [7]]


def test_plain_split_uses_layers_per_stage():
    config = ParallelConfig(pp=2, layers_per_stage=(1, 3), global_batch_size=8, seq_len=64)
    assert pipeline.virtual_stage_layers(config, 4) == [[0], [1, 2, 3]]


def test_mesh_dims_reverse_the_plan_order():
    config = ParallelConfig(tp=2, pp=2, dp=2, global_batch_size=8, seq_len=64)
    assert mesh.mesh_dims(config) == (("pp", "dp", "tp"), (2, 2, 2))
    swapped = config.replace(mesh_order=("dp", "tp", "cp", "pp"))
    assert mesh.mesh_dims(swapped) == (("pp", "tp", "dp"), (2, 2, 2))


@pytest.mark.parametrize("changes, match", [
    ({"cp": 2, "dp": 1}, "context parallelism"),
    ({"offload": "optimizer", "offload_device": "nvme"}, "nvme"),
    ({"compile": "model"}, "the plan's compile 'model' is not run by meshplan's runtime"),
    ({"float8": True}, "the plan's float8 is not run by meshplan's runtime"),
    ({"compile": "model+loss", "float8": True},
     "the plan's compile 'model\\+loss' and float8 are not run .* export the plan to torchtitan"),
    ({"compile": "model", "async_tp": True, "tp": 2, "sp": True},
     "the plan's compile 'model' and async TP are not run by meshplan's runtime"),
    ({"dp": 2, "zero_stage": 3, "grad_reduce_dtype": "bf16"},
     "reduces gradients in bf16; meshplan's runtime reduces them in fp32"),
])
def test_unsupported_plans_are_refused(changes, match):
    config = ParallelConfig(global_batch_size=8, seq_len=64, **changes)
    with pytest.raises(mesh.UnsupportedPlan, match=match):
        mesh.check_supported(config, TINY)


def test_tied_embeddings_with_pipeline_and_parameter_offload_are_refused():
    spec = dataclasses.replace(TINY, tied_embeddings=True, reported_params=None)
    mesh.check_supported(ParallelConfig(pp=2, global_batch_size=8, seq_len=64), spec)  # runs
    config = ParallelConfig(pp=2, dp=2, zero_stage=3, offload="optimizer+params",
                            global_batch_size=8, seq_len=64)
    with pytest.raises(mesh.UnsupportedPlan, match="tied"):
        mesh.check_supported(config, spec)


def test_world_size_mismatch_names_both_sizes():
    config = ParallelConfig(tp=2, dp=2, global_batch_size=8, seq_len=64)
    with pytest.raises(ValueError, match="= 4 processes but the launch has 3"):
        mesh.check_world_size(config, 3)


# ----- data --------------------------------------------------------------------------------------

def test_global_batch_is_deterministic_and_sliced_by_replica():
    spec = data.DataSpec(global_batch_size=8, seq_len=16, vocab_size=256, seed=1)
    batch = data.global_batch(spec, 3)
    assert torch.equal(batch, data.global_batch(spec, 3))
    assert not torch.equal(batch, data.global_batch(spec, 4))
    assert batch.shape == (8, 17) and int(batch.max()) < 256
    halves = [data.replica_rows(batch, dp_rank=r, dp=2) for r in range(2)]
    assert torch.equal(torch.cat(halves), batch)
    inputs, targets = data.split_inputs_targets(batch)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_token_file_is_read_in_windows(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    spec = data.DataSpec(global_batch_size=2, seq_len=4, vocab_size=256, token_file=str(path))
    assert data.global_batch(spec, 0).tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert data.global_batch(spec, 1)[0].tolist() == [10, 11, 12, 13, 14]


def test_token_file_ids_must_fit_the_vocabulary(tmp_path):
    path = tmp_path / "tokens.bin"
    np.full(20, 300, dtype=np.uint16).tofile(path)
    spec = data.DataSpec(global_batch_size=2, seq_len=4, vocab_size=256, token_file=str(path))
    with pytest.raises(ValueError, match="token id 300"):
        data.global_batch(spec, 0)


# ----- optimizer ---------------------------------------------------------------------------------

def test_host_offload_adamw_matches_adamw():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), **Recipe().adamw_kwargs())
    opt_b = optim.HostOffloadAdamW(b.parameters(), **Recipe().adamw_kwargs())
    _step_alike(((a, opt_a), (b, opt_b)), steps=3)
    _assert_fused_close(a, b)


def _step_alike(pairs, *, steps: int) -> None:
    """``steps`` steps of each (model, optimizer) pair on the same random inputs."""
    for _ in range(steps):
        x = torch.randn(5, 8)
        for model, opt in pairs:
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()


def _assert_fused_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Parameters equal up to the rounding of torch's fused CPU AdamW: it rounds differently
    from the single-tensor loop on some CPUs (AMD EPYC family 26: 1 of 32 elements 2 ulp apart
    after three steps); a wrong update (bias correction, decay, eps) is off by orders of
    magnitude more."""
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-8)


def test_host_threads_adamw_steps_on_its_threads_and_matches_adamw(monkeypatch):
    """FSDP2's CPU-offload optimizer: torch's fused AdamW (whatever kernel the recipe asks
    for), stepped on ``threads`` threads (the workers run on one), the thread count restored
    after the step."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), **Recipe().adamw_kwargs())
    opt_b = optim.HostThreadsAdamW(b.parameters(), threads=3, **Recipe().adamw_kwargs(),
                                   foreach=True)
    assert opt_b.defaults["fused"] and not opt_b.defaults["foreach"]
    seen = []
    original = torch.optim.AdamW.step

    def recording(self, closure=None):
        seen.append(torch.get_num_threads())
        return original(self, closure)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    before = torch.get_num_threads()
    _step_alike(((a, opt_a), (b, opt_b)), steps=2)
    assert seen == [before, 3, before, 3] and torch.get_num_threads() == before
    _assert_fused_close(a, b)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert optim.HostThreadsAdamW(a.parameters()).threads == (os.cpu_count() or 1)


def test_gpu_ranks_offloading_parameters_use_the_hosts_cores(monkeypatch):
    from meshplan.runtime.train import host_work_threads

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert host_work_threads("optimizer+params", cuda) == max(1, (os.cpu_count() or 1) // 2)
    assert host_work_threads("optimizer+params", cpu) is None
    assert host_work_threads("optimizer", cuda) is None  # HostOffloadAdamW raises its own
    assert host_work_threads("none", cuda) is None


def test_partition_balances_and_is_deterministic():
    owners = optim.partition([10, 1, 7, 3, 3], 2)
    loads = [sum(s for s, o in zip([10, 1, 7, 3, 3], owners) if o == p) for p in range(2)]
    assert owners == optim.partition([10, 1, 7, 3, 3], 2)
    assert sorted(loads) == [11, 13]  # 10, 7 apart; 3 to 7 (10, 10); 3 to the first (13, 10); 1 (13, 11)


# ----- memory ------------------------------------------------------------------------------------

def test_tracker_counts_live_bytes_and_resizes():
    tracker = LiveStorageTracker()
    with tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.ones(250)  # 1000 bytes
        assert tracker.live_bytes == 5000
        del b
        assert tracker.live_bytes == 4000
        a.untyped_storage().resize_(0)
        assert tracker.live_bytes == 0
        a.untyped_storage().resize_(400)
        assert tracker.live_bytes == 400
    assert tracker.peak_bytes == 5000


def test_tracker_reentered_where_modes_are_off_sees_the_temporaries():
    """A tensor subclass's op handler runs with dispatch modes off (DTensor's loss-parallel
    handlers): entering the tracker again there counts what the handler allocates, and
    leaving both restores storage resizing as it was."""
    from torch.utils._python_dispatch import _disable_current_modes
    original_resize = torch.UntypedStorage.resize_
    tracker = LiveStorageTracker()
    with tracker:
        kept = torch.empty(1000)  # 4000 bytes
        with _disable_current_modes():
            hidden = torch.empty(500)  # made with the mode off: not counted
            with tracker:
                temporary = torch.empty(2000)  # 8000 bytes, counted
                del temporary
        assert tracker.live_bytes == 4000
        del hidden, kept
    assert tracker.peak_bytes == 12000
    assert torch.UntypedStorage.resize_ is original_resize


def test_stopping_the_cpu_tracker_keeps_its_peak_and_restores_dispatch():
    original_resize = torch.UntypedStorage.resize_
    with PeakMemory(torch.device("cpu")) as memory:
        kept = torch.empty(1000)  # 4000 bytes
        memory.reset()
        temporary = torch.empty(500)  # 2000 bytes: the peak, 6000
        del temporary
        assert memory.cpu_tracking and memory.allocated_bytes == 4000
        memory.stop_cpu_tracking()
        assert not memory.cpu_tracking and memory.allocated_bytes is None
        assert torch.UntypedStorage.resize_ is original_resize  # the tracker's hook is gone
        later = torch.empty(10_000)  # after the stop: not counted
        memory.stop_cpu_tracking()  # a second stop does nothing
        memory.reset()  # nor does a reset once stopped
        assert memory.peak_bytes == memory.peak_reserved_bytes == 6000
        del later, kept
    assert memory.source == "cpu-live-tensors" and memory.peak_bytes == 6000


def test_median_step_leaves_out_the_warm_up_and_the_tracked_steps():
    def report(step_s, tracked=()):
        return RunReport(plan={}, world_size=1, backend="gloo", losses=(1.0,) * len(step_s),
                         step_s=step_s, predicted_step_s=1.0, predicted_peak_bytes=1.0,
                         per_rank=(), tracked_steps=tracked)
    assert report((9.0, 2.0, 1.0, 1.2, 1.1), (0, 1)).step_s_median == 1.1
    assert report((9.0, 2.0, 1.0, 1.2, 1.1)).step_s_median == pytest.approx(1.15)
    # nothing timed bare: the rule without a tracker (all but the warm-up; one step: itself)
    assert report((9.0, 2.0), (0, 1)).step_s_median == 2.0
    assert report((9.0,), (0,)).step_s_median == 9.0


def test_a_run_on_shared_cores_is_compared_with_the_prediction_times_the_sharing():
    from meshplan.cli.run import run_summary
    from meshplan.runtime.report import report_from_dict

    shared = RunReport(plan={"global_batch_size": 8, "seq_len": 64}, world_size=4,
                       backend="gloo", losses=(5.0, 4.0, 3.0),
                       step_s=(0.5, 0.3, 0.3), predicted_step_s=0.1, predicted_peak_bytes=1.0,
                       per_rank=(), timeshare=2.0)
    doc = shared.to_dict()
    assert doc["timeshare"] == 2.0 and doc["predicted"]["timeshared_step_s"] == 0.2
    assert doc["ratio"]["timeshared_step_s"] == pytest.approx(1.5)
    assert doc["ratio"]["step_s"] == pytest.approx(3.0)
    assert report_from_dict(doc, origin="r.json").timeshare == 2.0
    assert run_summary(shared).splitlines()[2] == (
        "           2 processes per CPU core here: predicted x2 = 0.2000 s   ratio 1.50x")
    assert "per CPU core" not in run_summary(dataclasses.replace(shared, timeshare=1.0))
    with pytest.raises(ValueError, match="timeshare"):
        report_from_dict({**doc, "timeshare": 0.5}, origin="r.json")


def test_plans_that_do_not_fit_the_model_are_refused():
    config = ParallelConfig(tp=4, global_batch_size=8, seq_len=64)  # tiny has 2 kv heads
    with pytest.raises(ValueError, match="kv heads"):
        mesh.check_supported(config, TINY)
    odd_ffn = dataclasses.replace(TINY, ffn_hidden_size=177, reported_params=None)
    with pytest.raises(mesh.UnsupportedPlan, match="ffn_hidden_size"):
        mesh.check_supported(ParallelConfig(tp=2, global_batch_size=8, seq_len=64), odd_ffn)
