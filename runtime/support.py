"""Which models meshplan's runtime trains, decided from the ``ModelSpec`` alone.

``mesh.check_supported`` refuses a plan of such a model before any process starts, and
``meshplan plan`` warns when it plans one for ``--framework meshplan`` (the default), so
that a user learns it before booking the machines. Imports neither torch nor the rest of
the runtime: the planner's command line loads this module only.
"""

from __future__ import annotations

from meshplan.costmodel.model import ModelSpec

RUNTIME_ROPE_SCALINGS = ("", "linear", "llama3")
"""RoPE scalings the runtime's decoder implements (``model.scaled_frequencies``)."""


def model_refusal(model: ModelSpec) -> str | None:
    """Why the runtime cannot train ``model`` under any plan (one line), or None."""
    if model.is_moe:
        return (f"MoE models are not implemented by the runtime yet (model {model.name}, "
                f"{model.num_experts} experts); plan with --framework torchtitan or megatron "
                f"and export the plan (meshplan export)")
    if model.qk_norm and model.norm != "rmsnorm":
        return (f"query and key norms (qk_norm) are RMSNorms in the runtime (as in Qwen3); "
                f"model {model.name} has {model.norm}")
    if model.rope_scaling not in RUNTIME_ROPE_SCALINGS:
        return (f"RoPE scaling {model.rope_scaling!r} (the config's rope_scaling) is not "
                f"implemented by the runtime (linear and llama3 are)")
    if model.position_embedding == "alibi":
        return "ALiBi positions are not implemented; use rope or learned"
    return None
