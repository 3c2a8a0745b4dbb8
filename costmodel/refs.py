"""What a ``--model`` reference names: a user's ``nn.Module`` factory, or something to load.

Its own module so that the loader (``models.py``) and the tracer (``factory.py``) both read
the rule without importing each other.
"""

from __future__ import annotations

import re
from pathlib import Path

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
"""``package.module:callable`` (the callable may be an attribute path, ``mod:Class.build``)."""


def is_factory_ref(ref: str | None) -> bool:
    """``ref`` names a user's module factory, not a catalog model or a file."""
    return bool(ref) and bool(_FACTORY.match(str(ref))) and not Path(str(ref)).exists()
