"""Execute notebooks in place, as CI and the book expect them stored.

    python tools/execute_notebooks.py notebooks/01_tensors.ipynb [more ...]

Each runs in a fresh ``python3`` kernel with ``notebooks/`` as its working
folder; the time it took is printed, so a chapter's budget can be checked.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path) -> float:
    """Execute the notebook at ``path`` in place and return the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    nbformat.write(nb, path)
    return elapsed


def main(paths: list[str]) -> None:
    if not paths:
        sys.exit(__doc__)
    for name in paths:
        path = Path(name)
        if not path.is_file():
            sys.exit(f"No notebook at {path}.")
        print(f"{path}: executed in {execute(path):.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
