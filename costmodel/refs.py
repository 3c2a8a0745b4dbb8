"""What a ``--model`` reference names: a user's ``nn.Module`` factory, or something to load.

Its own module so that the loader (``models.py``) and the tracer (``factory.py``) both read
the rule without importing each other.
"""

from __future__ import annotations

import re
from pathlib import Path

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
"""``package.module:callable`` (the callable may be an attribute path, ``mod:Class.build``)."""
HF_CONFIG_REF = "hf-config:"
"""``hf-config:PATH``: the ``transformers`` causal LM of a local ``config.json`` (or a folder
holding one), built on the meta device and traced like a user's factory. ``load_model`` takes
this route itself for the HF model types its analytic reader does not know."""


def is_factory_ref(ref: str | None) -> bool:
    """``ref`` names a module factory (a user's, or ``hf-config:PATH``), not a catalog model or
    a file."""
    if not ref:
        return False
    text = str(ref)
    return text.startswith(HF_CONFIG_REF) or (bool(_FACTORY.match(text))
                                              and not Path(text).exists())
