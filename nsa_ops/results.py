"""How committed results are written: the benches (bench/) and the training showcase
(nsa_ops.train) write a CSV under a '# header' line naming device, versions and commit, and a PNG.
"""
from __future__ import annotations

import csv
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from . import env


def commit() -> str:
    """The commit results name: NSA_COMMIT (for checkouts without .git, such as the copy a remote
    GPU runs), else `git describe` of this checkout (with -dirty), else "unknown"."""
    override = env.commit_override()
    if override:
        return override
    try:
        return subprocess.check_output(["git", "describe", "--always", "--dirty"], text=True,
                                       cwd=Path(__file__).resolve().parent,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_csv(path: Path, rows: list[dict], header: str,
              fields: Optional[Sequence[str]] = None) -> None:
    """Rows under a '# header' line; columns `fields`, or the first row's keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        f.write(f"# {header}\n")
        writer = csv.DictWriter(f, fieldnames=list(fields or rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def new_figure(*args, **kwargs):
    """`plt.subplots(*args, **kwargs)` on the file-only Agg backend; ImportError without
    matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: Path, title: str, fontsize: int = 7) -> None:
    """Title (the run header), lay out, write the PNG and release the figure."""
    import matplotlib.pyplot as plt
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
