"""What several benchmark scripts do the same way: print a result table, save a figure.

Imported by the scripts as ``common`` (they run as ``python benchmarks/<name>.py``, which puts
this folder first on ``sys.path``); no logic the package needs lives here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

FIGURE_DPI = 120


def print_table(table, formats: Mapping[str, str], *, width: int = 200) -> None:
    """``table`` (a pandas DataFrame) without its index, columns in ``formats`` formatted
    with those format strings (``"{:.3f}"``)."""
    import pandas as pd

    pd.set_option("display.width", width)
    print(table.to_string(index=False,
                          formatters={k: v.format for k, v in formats.items()}))


def save_png(fig, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
