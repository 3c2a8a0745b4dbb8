"""``python -m meshplan.runtime <torchrun args>``: the agent ``meshplan run`` starts
(``agent.main``: torchrun that ends quietly on an error a worker recorded).

The agent runs under this name, not as ``-m meshplan.runtime.agent``, because of how the CPU's
workers start: they are forks of multiprocessing's fork server (``agent.START_ENV``), and a
fork re-runs its parent's ``__main__`` module by name unless that name ends in ``.__main__``.
Re-run as ``meshplan.runtime.agent``, a module the server had already imported with the
worker, it made Python warn "found in sys.modules ... unpredictable behaviour" once per
worker; this module is never re-run and never imported by anything else.
"""

import sys

from meshplan.runtime.agent import main

sys.exit(main(sys.argv[1:]))
