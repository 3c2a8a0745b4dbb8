"""``meshplan run``: execute a plan with torch.distributed under torchrun and report measured
against predicted. The runtime is imported only inside ``run`` (DESIGN.md)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from meshplan.cli.args import (node_range, nonnegative_float, nonnegative_int, positive_float,
                               positive_int, rdzv_conf)
from meshplan.cli.output import check_folder, print_json, refuse_overwrite

if TYPE_CHECKING:
    from meshplan.runtime.report import RunReport

METRICS_FILE = "metrics.jsonl"
"""Default per-step metrics file inside ``--checkpoint-dir``."""
EXIT_TOO_FEW_NODES = 4
"""An elastic job ended because fewer than MIN nodes met at the rendezvous (its checkpoints
are intact; start it again with --resume)."""
ELASTIC_MAX_RESTARTS = 3
"""Default ``--max-restarts`` of an elastic job. Each lost node costs one (its peers' step
fails and torchrun restarts them); a node that joins costs none."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--steps", type=nonnegative_int, default=10, metavar="N",
                        help="optimizer steps (default 10; the first is a warm-up); 0 with "
                             "--init-from and --save-hf converts the weights only")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    parser.add_argument("--data", metavar="PATH",
                        help="a token file (flat uint16/int32 array), or text: .jsonl, .txt, "
                             ".parquet or an HF datasets folder, tokenized with --tokenizer "
                             "and packed with EOS (default: synthetic tokens)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="tokenizer.json (or its folder) for text --data (default: the "
                             "--init-from folder)")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the field / column holding the text (default text)")
    parser.add_argument("--report", metavar="FILE",
                        help="write the run report JSON (schema_version 1) to FILE")
    parser.add_argument("--force", action="store_true",
                        help="let --report overwrite an existing FILE")
    parser.add_argument("--timeout", type=positive_float, default=60.0, metavar="S",
                        help="process-group timeout in seconds once the first step is done "
                             "(default 60)")
    parser.add_argument("--init-timeout", type=positive_float, default=600.0, metavar="S",
                        help="process-group timeout until then: construction, checkpoint "
                             "loading, the first step (default 600)")
    parser.add_argument("--metrics", metavar="FILE",
                        help="append per-step metrics (loss, grad norm, lr, tokens/s, MFU, "
                             "memory) as JSON lines to FILE (default: DIR/metrics.jsonl with "
                             "--checkpoint-dir DIR, else none)")
    weights = parser.add_argument_group("HuggingFace weights (Llama, Mistral, Qwen2)")
    weights.add_argument("--init-from", metavar="DIR",
                         help="start from the weights of an HF checkpoint directory "
                              "(config.json + safetensors) of the plan's model; each rank "
                              "reads its own stage's tensors")
    weights.add_argument("--save-hf", metavar="DIR",
                         help="at the end, write an HF checkpoint (config, safetensors, the "
                              "--init-from tokenizer) that transformers' from_pretrained loads; "
                              "DIR must not exist or be empty")
    weights.add_argument("--save-hf-every", metavar="N", type=int, default=0,
                         help="also write one every N steps, into DIR/step-<k> (needs "
                              "--save-hf)")
    recipe = parser.add_argument_group("training recipe (stored in checkpoints)")
    recipe.add_argument("--lr", type=positive_float, default=3e-3,
                        help="peak learning rate (default 3e-3)")
    recipe.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                        help="linear warm-up steps (default 0)")
    recipe.add_argument("--lr-schedule", choices=("constant", "linear", "cosine"),
                        default="constant", help="decay after warm-up, to --min-lr at the "
                                                 "last step (default constant)")
    recipe.add_argument("--min-lr", type=nonnegative_float, default=0.0,
                        help="learning rate at the end of the decay (default 0)")
    recipe.add_argument("--weight-decay", type=nonnegative_float, default=0.1,
                        help="AdamW weight decay (default 0.1)")
    recipe.add_argument("--max-grad-norm", type=nonnegative_float, default=1.0, metavar="X",
                        help="clip the global gradient norm to X; 0: no clipping (default 1)")
    recipe.add_argument("--optimizer-impl", choices=("foreach", "fused", "for-loop"),
                        default="foreach", help="AdamW kernel (default foreach)")
    saving = parser.add_argument_group("checkpoints (torch.distributed.checkpoint)")
    saving.add_argument("--checkpoint-dir", metavar="DIR",
                        help="checkpoint folder, shared by all nodes (layout: "
                             "runtime/checkpoint.py)")
    saving.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                        help="save after every N steps (default: never; DIR is then only read)")
    saving.add_argument("--keep-last", type=positive_int, metavar="K",
                        help="keep only the K newest checkpoints (default: all)")
    saving.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in DIR, under this "
                             "plan (it may differ from the one that saved it)")
    group = parser.add_argument_group("torchrun (ignored when already under torchrun)")
    group.add_argument("--nproc-per-node", type=positive_int, metavar="K",
                       help="processes per node (default: the plan's world size / nodes)")
    group.add_argument("--nnodes", type=node_range, default=(1, None), metavar="N|MIN:MAX",
                       help="nodes (default 1); MIN:MAX: an elastic job that replans and "
                            "reshards from the last checkpoint when nodes leave or join "
                            "(needs --checkpoint-dir and --checkpoint-every)")
    group.add_argument("--rdzv-conf", type=rdzv_conf, metavar="K=V,...",
                       help="torchrun's rendezvous settings, e.g. join_timeout=600,"
                            "last_call_timeout=30,keep_alive_interval=5 (seconds)")
    group.add_argument("--replan-time-limit", type=positive_float, default=30.0, metavar="S",
                       help="elastic jobs: wall-clock bound of one replan on rank 0 (default 30)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="c10d rendezvous (default on one node: 127.0.0.1, a free port)")
    group.add_argument("--rdzv-id", metavar="ID", help="rendezvous job id, the same on all nodes")
    group.add_argument("--max-restarts", type=int, default=None, metavar="K",
                       help="restart the workers up to K times after a failure; they resume "
                            "from the latest checkpoint in DIR (default 0; elastic jobs "
                            f"{ELASTIC_MAX_RESTARTS}: a lost node fails its peers' step, "
                            "which counts as one)")
    group.add_argument("--oversubscribe", action="store_true",
                       help="on a CPU-only machine, run more processes than CPU cores (tests, "
                            "debugging); the memory check stays")
    parser.add_argument("--json", action="store_true",
                        help="print the run report JSON on stdout (progress goes to stderr)")


def run(args: argparse.Namespace) -> int:
    """Exit code 0, or the workers' (1) when one failed; ValueError when refused."""
    from meshplan.runtime import corpus, launch
    from meshplan.runtime.recipe import Recipe
    from meshplan.runtime.train import RunOptions

    data, shuffle = args.data, False
    if data and corpus.is_text(data):
        data, shuffle = _tokenized(args), True
    elif data and not os.path.isfile(data):
        raise ValueError(f"--data {args.data!r}: no such file")
    refuse_overwrite("--report", args.report, force=args.force)
    check_folder("--report", args.report)
    if args.save_hf and os.path.exists(args.save_hf) and (
            not os.path.isdir(args.save_hf) or os.listdir(args.save_hf)):
        raise ValueError(f"--save-hf {args.save_hf}: exists and is not an empty folder "
                         "(nothing is overwritten); choose a new one")
    if args.init_from and not os.path.isdir(args.init_from):
        raise ValueError(f"--init-from {args.init_from!r}: no such folder")
    check_folder("--metrics", args.metrics)
    metrics = args.metrics or (os.path.join(args.checkpoint_dir, METRICS_FILE)
                               if args.checkpoint_dir else None)
    recipe = Recipe(lr=args.lr, warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule,
                    min_lr=args.min_lr, weight_decay=args.weight_decay,
                    max_grad_norm=args.max_grad_norm or None,
                    optimizer_impl=args.optimizer_impl)
    min_nodes, max_nodes = args.nnodes
    is_elastic = max_nodes is not None and max_nodes > min_nodes
    restarts = args.max_restarts if args.max_restarts is not None else (
        ELASTIC_MAX_RESTARTS if is_elastic else 0)
    run_id = args.rdzv_id or os.environ.get("TORCHELASTIC_RUN_ID")
    options = RunOptions(steps=args.steps, seed=args.seed, data=data, shuffle=shuffle,
                         timeout_s=args.timeout, init_timeout_s=args.init_timeout,
                         recipe=recipe, metrics=metrics, checkpoint_dir=args.checkpoint_dir,
                         checkpoint_every=args.checkpoint_every or 0, resume=args.resume,
                         keep_last=args.keep_last or 0, elastic=is_elastic, run_id=run_id,
                         replan_time_limit_s=args.replan_time_limit,
                         init_from=os.path.abspath(args.init_from) if args.init_from else None,
                         save_hf=os.path.abspath(args.save_hf) if args.save_hf else None,
                         save_hf_every=args.save_hf_every)
    where = launch.Launch(nproc_per_node=args.nproc_per_node, nnodes=min_nodes,
                          max_nnodes=max_nodes, rdzv_conf=args.rdzv_conf,
                          rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                          max_restarts=restarts, oversubscribe=args.oversubscribe)
    try:
        result = launch.run(args.plan_file, options=options, launch=where,
                            report=args.report, json_output=args.json)
    except launch.TooFewNodes as err:
        print(f"meshplan: error: {err}", file=sys.stderr)
        return EXIT_TOO_FEW_NODES
    except launch.WorkerRefused as refused:
        print(f"meshplan: error: {refused}", file=sys.stderr)
        return refused.code
    except launch.Stopped as stopped:
        print(f"meshplan: stopped by {stopped}: torchrun and its workers were ended",
              file=sys.stderr)
        return 128 + stopped.signum
    if result.report is not None:
        if args.json:
            print_json(result.report.to_dict())
        else:
            print(run_summary(result.report))
    return result.exit_code


def _tokenized(args: argparse.Namespace) -> str:
    """The token file of the text corpus ``--data`` (``runtime/corpus.py``)."""
    from meshplan.planner.plan import read_plan
    from meshplan.runtime import corpus

    tokenizer = args.tokenizer or args.init_from
    if tokenizer is None:
        raise ValueError(f"--data {args.data}: text needs --tokenizer DIR (or --init-from DIR "
                         "with a tokenizer.json)")
    vocab = read_plan(args.plan_file).model.vocab_size
    cache = os.path.join(args.checkpoint_dir, "data") if args.checkpoint_dir else None
    return corpus.prepare(args.data, tokenizer=tokenizer, field=args.text_field,
                          vocab_size=vocab, cache_dir=cache)


def run_summary(report: RunReport) -> str:
    """Measured against predicted, for people: step time and the largest per-rank peak."""
    def ratio(measured: float | None, predicted: float) -> str:
        return f"{measured / predicted:.2f}x" if measured is not None and predicted else "n/a"

    lines = [f"ran {len(report.losses)} steps on {report.world_size} processes "
             f"({report.backend}); final loss {report.losses[-1]:.4f}",
             f"step time  measured {report.step_s_median:.4f} s   predicted "
             f"{report.predicted_step_s:.4f} s   ratio "
             f"{ratio(report.step_s_median, report.predicted_step_s)}"]
    if report.timeshare > 1:
        lines.append(f"           {report.timeshare:.2g} processes per CPU core here: predicted "
                     f"x{report.timeshare:.2g} = {report.timeshared_step_s:.4f} s   ratio "
                     f"{ratio(report.step_s_median, report.timeshared_step_s)}")
    if report.resumed_from_step is not None:
        lines.append(f"resumed from checkpoint step-{report.resumed_from_step} "
                     f"({report.restarts} torchrun restarts)")
    for change in report.membership_changes:
        measured = change["measured_step_s"]
        lines.append(
            f"membership at step {change['step']}: {change['old_world_size']} -> "
            f"{change['world_size']} processes ({change['reason']}); replan "
            f"{change['replan_s']:.2f} s, reshard {change['reshard_s']:.2f} s, "
            f"{change['steps_redone']} steps redone; step time predicted "
            f"{change['predicted_step_s']:.4f} s, measured "
            + (f"{measured:.4f} s" if measured is not None else "n/a"))
    if report.peak_bytes is not None:
        lines.append(f"peak/rank  measured {report.peak_bytes / 1e6:.2f} MB   predicted "
                     f"{report.predicted_peak_bytes / 1e6:.2f} MB   ratio "
                     f"{ratio(report.peak_bytes, report.predicted_peak_bytes)}")
    return "\n".join(lines)
