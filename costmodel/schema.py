"""Schema versions of every JSON document meshplan writes (DESIGN.md), in one place.

A reader accepts the version listed here; the documents' keys are DESIGN.md's contract.
"""

ESTIMATE = 1
"""``meshplan estimate --json`` (also the ``predicted`` object of a plan file)."""
PLAN_FILE = 1
"""A plan file (``meshplan plan -o``)."""
PLAN_SEARCH = 1
"""``meshplan plan --json``: the ranked plans, the solver outcome, the Pareto front."""
RUN_REPORT = 1
"""``meshplan run --report``."""
