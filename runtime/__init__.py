"""meshplan's runtime (``meshplan.runtime``): executes a plan with torch.distributed.

``launch`` starts torchrun (``python -m meshplan.runtime.worker``, with ``PYTHONSAFEPATH=1``
so nothing in the user's working directory can stand in for meshplan's modules); ``worker``
runs a job in each process; ``train`` builds the rank's model (``model`` or ``chain`` for a
traced module), applies the layout in DESIGN.md's order (``mesh``: the DeviceMesh from
``costmodel.layout``; ``parallelize``: TP/SP, activation checkpointing, FSDP2/DDP; ``pipeline``;
``optim``: ZeRO-1, offload) and trains; ``checkpoint`` saves and resumes with
torch.distributed.checkpoint; ``report`` is the typed run report. ``measure`` and ``topology``
measure the machine for ``meshplan profile``; ``memory`` tracks per-rank peaks; ``fault``
injects failures for tests. Imports ``meshplan.costmodel`` and ``meshplan.planner``.
"""
