"""meshplan: auto-parallelism planner, memory and step-time estimator and training runtime.

One import namespace (DESIGN.md, "Shape"). The repository's top-level folders install under it:

- ``meshplan.costmodel`` (folder ``costmodel/``): memory per GPU per stage, time per step;
- ``meshplan.planner`` (``planner/``): the search over parallel layouts, plan files, exports;
- ``meshplan.runtime`` (``runtime/``): executes a plan with torch.distributed under torchrun;
- ``meshplan.workflows`` (``meshplan/workflows/``): multi-step jobs (profile, validate) as
  library functions a notebook can call;
- ``meshplan.cli`` (``meshplan/cli/``): the ``meshplan`` command, one thin module per
  subcommand.

Dependencies point one way: costmodel <- planner <- runtime <- workflows <- cli
(``tests/test_architecture.py``). Importing this package imports nothing heavy.
"""

__version__ = "0.2.0"
