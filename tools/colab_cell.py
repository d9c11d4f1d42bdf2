"""The first code cell of every chapter: in Google Colab, and only there, install
what the chapter imports that Colab lacks (the companion package, and d2l where
the chapter uses it).

    python tools/colab_cell.py           # write the cell into every notebook
    python tools/colab_cell.py --check   # exit 1 if a notebook's cell is stale

The address comes from the book's one setting, ``repository.url`` (and
``repository.branch``) in ``_config.yml``, which also decides whether the book
shows its Colab button. Colab already has torch, numpy, matplotlib,
scikit-learn, tqdm and psutil, so both packages are installed without their
dependencies; where Colab's torch is older than the course supports, the cell
installs a newer one first and asks for a restart of the session. The cell is removed from the rendered book (tag ``remove-cell``);
anywhere but Colab it does nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
MARKER = "# In Google Colab only:"
TORCH_FLOOR = (2, 10)  # the oldest torch the course supports (pyproject.toml)
D2L = "d2l==1.0.3"


def repository() -> tuple[str, str]:
    """Return ``(url, branch)`` from ``_config.yml`` (url may be empty)."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = config.get("repository") or {}
    return (repo.get("url") or "").rstrip("/"), repo.get("branch") or "main"


def colab_cell_source(url: str, branch: str, *, needs_d2l: bool) -> str:
    """The cell's code for a chapter, given the repository address."""
    if not url:
        return (
            f"{MARKER} this copy of the course sets no repository.url in\n"
            "# _config.yml, so there is no address to install its companion package from.\n"
            "import sys\n\n"
            'if "google.colab" in sys.modules:\n'
            '    raise SystemExit("Set repository.url in _config.yml to run this in Colab.")'
        )
    packages = f'"companion @ git+{url}@{branch}"' + (f" {D2L}" if needs_d2l else "")
    what = "the companion package" + (" and d2l" if needs_d2l else "")
    return (
        f"{MARKER} a torch the chapters support, and {what}.\n"
        "import sys\n\n"
        'if "google.colab" in sys.modules:\n'
        "    import torch\n\n"
        f"    if torch.__version__ < {TORCH_FLOOR}:  # TorchVersion compares with tuples\n"
        f'        %pip install --quiet "torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}" torchvision\n'
        '        raise SystemExit("A newer torch is installed: restart the session "\n'
        '                         "(Runtime > Restart session) and run this notebook again.")\n'
        f"    %pip install --quiet --no-deps {packages}"
    )


def expected_cell(notebook: nbformat.NotebookNode, url: str, branch: str) -> str:
    needs_d2l = any(
        "from d2l import" in c.source or "import d2l" in c.source
        for c in notebook.cells
        if c.cell_type == "code"
    )
    return colab_cell_source(url, branch, needs_d2l=needs_d2l)


def first_code_cell(notebook: nbformat.NotebookNode) -> int:
    return next(i for i, c in enumerate(notebook.cells) if c.cell_type == "code")


def update(path: Path, url: str, branch: str, *, check: bool) -> bool:
    """Put the current cell first among the code cells; return whether it was."""
    notebook = nbformat.read(path, as_version=4)
    source = expected_cell(notebook, url, branch)
    i = first_code_cell(notebook)
    cell = notebook.cells[i]
    if cell.source.startswith(MARKER):
        if cell.source == source:
            return True
        if not check:
            cell.source = source
    elif not check:
        new = nbformat.v4.new_code_cell(source, metadata={"tags": ["remove-cell"]})
        new["id"] = "colab-install"
        notebook.cells.insert(i, new)
    if not check:
        nbformat.write(notebook, path)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing")
    args = parser.parse_args(argv)
    url, branch = repository()
    stale = [
        p.name
        for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
        if not update(p, url, branch, check=args.check)
    ]
    if stale and args.check:
        print(f"Colab cell missing or stale in {', '.join(stale)}: run {__file__}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
