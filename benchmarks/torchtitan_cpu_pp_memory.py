"""torchtitan's pipeline-parallel code path on this CPU: measured per-rank peak against the model.

Builds torchtitan 0.2.2's llama3 ``Transformer`` in meshplan's ``tiny`` shape (optionally more
layers), splits it into pipeline stages as torchtitan does (``generate_llm_fqn_per_model_part``
with its default weights, the embedding and the output head counted as one layer each; with
``--even`` as many blocks in every model part, as meshplan's export writes
``module_fqns_per_model_part``), then ``pipeline_module_split``: one stage per rank for
``1F1B``, two for ``Interleaved1F1B``, the two schedules a meshplan plan names. Every stage
gets ``apply_tp`` under ``--tp`` > 1 (sequence and loss parallelism, torchtitan's defaults),
``apply_ac`` and ``apply_fsdp(pp_enabled=True)`` (FSDP2 over ``--dp`` gloo ranks, fp32 on CPU,
parameters not resharded after forward); then torchtitan's pipelined train step runs
(``schedule.step`` with the loss inside the schedule, under ``loss_parallel()`` with TP,
``return_outputs=False``; fused AdamW over all of the rank's stages). Peaks are live tensor
bytes (``meshplan.runtime.memory.PeakMemory``, loss parallelism's local temporaries tracked)
over steps 2-3; the prediction is ``estimate(..., framework="torchtitan")``'s peak of the
rank's pipeline stage for the same plan on the ``cpu`` cluster.

    python benchmarks/torchtitan_cpu_pp_memory.py [--pp 2] [--dp 1] [--tp 1] [--schedule 1F1B]
        [--microbatches 4] [--micro-batch 2] [--layers 6] [--policy full] [--even]
    python benchmarks/torchtitan_cpu_pp_memory.py --recorded   # the plans of memory_runs.json

``--recorded`` runs the plans whose peaks ``costmodel/data/memory_runs.json`` holds (8 blocks
over pp 2, or 16 over pp 4; every stage as many, as meshplan's torchtitan export splits them)
and writes ``results/torchtitan-cpu-pp-memory-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_cpu_memory import (SEQ_LEN, TINY_HEADS, TINY_VOCAB,  # noqa: E402
                                   _free_port, _init_rank, _new_model, _parallelize, _spawn,
                                   _stub_moe_kernels, _track_loss_parallel)

STEPS = 3
TIMEOUT_S = 240
RESULTS = Path(__file__).resolve().parent / "results"
RECORDED = (  # schedule, dp, tp, micro-batches, policy
    ("1F1B", 1, 1, 4, "full"), ("1F1B", 2, 1, 8, "none"),
    ("Interleaved1F1B", 1, 1, 8, "full"), ("Interleaved1F1B", 1, 1, 4, "none"),
    ("Interleaved1F1B", 2, 1, 4, "op"),
    ("1F1B", 1, 2, 4, "op"), ("Interleaved1F1B", 1, 2, 8, "none"), ("1F1B", 2, 2, 4, "full"),
)
RECORDED_PP4 = (  # schedule, micro-batches, policy: pp 4, dp 1, tp 1, 16 blocks
    ("1F1B", 4, "full"), ("Interleaved1F1B", 4, "full"), ("Interleaved1F1B", 8, "full"),
)
"""pp 4 (2026-12-07): with as many micro-batches as ranks every rank runs all its forwards
before its first backward under ``Interleaved1F1B``; with 8, a steady phase."""
SCHEDULES = ("1F1B", "Interleaved1F1B")
"""The torch.distributed.pipelining schedules of meshplan's plans (vpp 1 and 2; two stages per
rank is torchtitan's default for a looped schedule)."""


def _even_split(stages: int, layers: int) -> list[list[str]]:
    """Module names per stage with the same number of blocks in every stage (``layers`` a
    multiple of ``stages``): the embedding joins the first, the norm and head the last."""
    per = layers // stages
    names = [[f"layers.{i}" for i in range(s * per, (s + 1) * per)] for s in range(stages)]
    names[0].insert(0, "tok_embeddings")
    names[-1] += ["norm", "output"]
    return names


def _worker(rank: int, pp: int, dp: int, tp: int, schedule_name: str, microbatches: int,
            micro_batch: int, layers: int, policy: str, even: bool, port: str,
            out_dir: str) -> None:
    _init_rank(rank, pp * dp * tp, port)
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
    _stub_moe_kernels()
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.pipeline_parallel import (generate_llm_fqn_per_model_part,
                                                          pipeline_module_split)
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    from meshplan.runtime.memory import PeakMemory

    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "fsdp", "tp"))
    args = TransformerModelArgs(dim=64, n_layers=layers, n_heads=TINY_HEADS[0],
                                n_kv_heads=TINY_HEADS[1], vocab_size=TINY_VOCAB,
                                multiple_of=16, max_seq_len=SEQ_LEN)
    schedule_class = get_schedule_class(schedule_name)
    looped = issubclass(schedule_class, PipelineScheduleMulti)
    stages_total = pp * (2 if looped else 1)
    torch.manual_seed(0)
    peak = PeakMemory(torch.device("cpu"))
    _track_loss_parallel(peak)
    with peak:
        whole = _new_model(args)
        names = (_even_split(stages_total, layers) if even
                 else generate_llm_fqn_per_model_part(stages_total, layers))
        stages, parts = pipeline_module_split(whole, mesh["pp"], schedule_name,
                                              torch.device("cpu"), names)
        del whole
        for stage, part in zip(stages, parts):
            _parallelize(part, mesh, tp=tp, policy=policy, pp_enabled=True)
            stage.submod = part
        schedule = schedule_class(stages if looped else stages[0], n_microbatches=microbatches,
                                  loss_fn=cross_entropy_loss, scale_grads=False)
        first = any(stage.is_first for stage in stages)
        last = any(stage.is_last for stage in stages)
        optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()],
                                      lr=1e-3, fused=True)
        # the ranks of one pipeline and TP group read the same batch; each data-parallel rank
        # its own
        tokens = torch.randint(0, TINY_VOCAB, (microbatches * micro_batch, SEQ_LEN + 1),
                               generator=torch.Generator().manual_seed(
                                   mesh["fsdp"].get_local_rank()))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        for step in range(STEPS):
            optimizer.zero_grad()
            if step == 1:
                peak.reset()
            targets, losses = (labels, []) if last else (None, None)
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                if first:
                    schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
                else:
                    schedule.step(target=targets, losses=losses, return_outputs=False)
            optimizer.step()
    stage_ids = [stage.stage_index for stage in stages]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"peak_bytes": peak.peak_bytes, "pp_rank": mesh["pp"].get_local_rank(),
         "stages": stage_ids}))
    dist.destroy_process_group()


def measure(*, pp: int = 2, dp: int = 1, tp: int = 1, schedule: str = "1F1B",
            microbatches: int = 4, micro_batch: int = 2, layers: int = 6, policy: str = "full",
            even: bool = False) -> list[dict]:
    """Per rank: its pipeline rank, its stage indices and its peak bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_worker, (pp, dp, tp, schedule, microbatches, micro_batch, layers, policy, even,
                         _free_port(), tmp), pp * dp * tp, TIMEOUT_S)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text())
                for r in range(pp * dp * tp)]


def predict(*, pp: int = 2, dp: int = 1, tp: int = 1, schedule: str = "1F1B",
            microbatches: int = 4, micro_batch: int = 2, layers: int = 6, policy: str = "full",
            even: bool = False) -> list[float]:
    """Predicted peak bytes per pipeline rank (``even`` does not change the model's split)."""
    del even
    import dataclasses

    from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
    recompute = policy if policy in ("full", "none") else "selective"
    selective_ac = "op" if policy in ("full", "none") else policy
    config = ParallelConfig(pp=pp, dp=dp, tp=tp, sp=tp > 1,
                            vpp=2 if schedule == "Interleaved1F1B" else 1,
                            zero_stage=3, recompute=recompute, selective_ac=selective_ac,
                            micro_batch_size=micro_batch,
                            global_batch_size=dp * micro_batch * microbatches,
                            seq_len=SEQ_LEN, dtype="fp32")
    model = dataclasses.replace(load_model("tiny"), num_layers=layers, vocab_size=TINY_VOCAB,
                                num_heads=TINY_HEADS[0], num_kv_heads=TINY_HEADS[1])
    est = estimate(model, load_cluster("cpu", nodes=1, gpus_per_node=pp * dp * tp), config,
                   framework="torchtitan")
    return [stage.peak_bytes for stage in est.memory.per_stage]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--dp", type=int, default=1, help="FSDP ranks per stage")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks (SP and loss parallelism on)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--policy", default="full", help="op, an integer N, full or none")
    parser.add_argument("--even", action="store_true",
                        help="as many blocks in every stage (torchtitan's module_fqns_per_model"
                        "_part) instead of its default split")
    parser.add_argument("--recorded", action="store_true",
                        help="run the plans memory_runs.json records and write the results")
    args = parser.parse_args()
    if args.recorded:
        record()
        return
    plan = dict(pp=args.pp, dp=args.dp, tp=args.tp, schedule=args.schedule,
                microbatches=args.microbatches,
                micro_batch=args.micro_batch, layers=args.layers, policy=args.policy,
                even=args.even)
    predicted = predict(**plan)
    for row in measure(**plan):
        stage = row["pp_rank"]
        print(f"{args.schedule} pp {args.pp} dp {args.dp} tp {args.tp} m {args.microbatches} "
              f"mb {args.micro_batch} layers {args.layers} {args.policy}: pp rank {stage} "
              f"(stages {row['stages']}) measured {row['peak_bytes']} B, predicted "
              f"{predicted[stage]:.0f} B, error {predicted[stage] / row['peak_bytes'] - 1:+.3f}")


def record() -> None:
    """Run ``RECORDED`` (pp 2, 8 blocks, micro-batch 2, even split; TP with SP and loss
    parallelism) and ``RECORDED_PP4`` (pp 4, 16 blocks) and write the per-rank measured and
    predicted peaks."""
    rows = []
    plans = [dict(pp=2, dp=dp, tp=tp, schedule=schedule, microbatches=microbatches,
                  micro_batch=2, layers=8, policy=policy, even=True)
             for schedule, dp, tp, microbatches, policy in RECORDED]
    plans += [dict(pp=4, dp=1, tp=1, schedule=schedule, microbatches=microbatches,
                   micro_batch=2, layers=16, policy=policy, even=True)
              for schedule, microbatches, policy in RECORDED_PP4]
    for plan in plans:
        schedule, dp, tp = plan["schedule"], plan["dp"], plan["tp"]
        microbatches, policy = plan["microbatches"], plan["policy"]
        predicted = predict(**plan)
        for row in measure(**plan):
            rows.append({**plan, **row, "predicted_bytes": predicted[row["pp_rank"]],
                         "error": predicted[row["pp_rank"]] / row["peak_bytes"] - 1})
            print(f"{schedule} pp {plan['pp']} dp {dp} tp {tp} m {microbatches} {policy}: "
                  f"pp rank {row['pp_rank']} "
                  f"measured {row['peak_bytes']} B, predicted {rows[-1]['predicted_bytes']:.0f} "
                  f"B, error {rows[-1]['error']:+.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"torchtitan-cpu-pp-memory-{dt.date.today().isoformat()}.json"
    out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
