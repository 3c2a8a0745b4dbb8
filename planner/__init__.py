"""meshplan's planner (``meshplan.planner``): the search for the best parallel layout.

Pipeline (DESIGN.md, "Planner"): ``space`` enumerates the global choices (degrees, ZeRO,
offload, micro-batch, interleaving, rank layout); ``tables`` turns one candidate into integer
cost tables from the cost model; ``solver`` (the only module that imports OR-Tools) builds and
solves the CP-SAT model of the layer split and per-stage recompute; ``search`` orders candidates
by a lower bound and keeps the best; ``planning`` applies the objective (time or cost) and the
Pareto front. ``plan`` is the plan file (``Plan``, strict reader and writer), ``explain`` says
why a plan, ``export`` writes it for DeepSpeed, Megatron-LM and torchtitan, ``report`` formats
tables for people. Imports ``meshplan.costmodel`` only; never the runtime.
"""
