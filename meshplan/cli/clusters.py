"""``meshplan clusters``: the cluster templates of the catalog."""

from __future__ import annotations

import argparse
import dataclasses

from meshplan.cli.args import add_json_argument
from meshplan.cli.errors import EXIT_OK
from meshplan.cli.output import print_json
from meshplan.costmodel.hardware import cluster_names, load_cluster
from meshplan.planner import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    clusters = [load_cluster(name) for name in cluster_names()]
    if args.json:
        print_json([{**dataclasses.asdict(c), "num_gpus": c.num_gpus} for c in clusters])
    else:
        print(report.clusters_table(clusters))
    return EXIT_OK
