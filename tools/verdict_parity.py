"""Execute the chapters afresh and compare every verdict with the stored one.

    python tools/verdict_parity.py                       # every chapter, this Python
    python tools/verdict_parity.py notebooks/05_*.ipynb  # some chapters
    python tools/verdict_parity.py --python .venv-oldest/bin/python   # another torch

The stored notebooks were executed on a CPU with the pinned torch; nbval checks
them there, output for output. On another machine (a GPU: ``make test-gpu``)
or another torch (``make test-oldest``) the numbers and some printed lines
differ by design, but the conclusions must not: this tool executes each
chapter in a fresh kernel (nothing is stored), collects the verdicts each cell
printed (``✓ claim: yes`` / ``✗ claim: NO``), and compares them cell by cell
with the stored ones.

- A chapter that raises is a failure.
- A verdict that does not hold here is a failure, unless
  ``tests/verdict_parity.toml`` explains it for this context.
- A claim only one side printed is fine when it names its device ("on the
  GPU ...", "on the CPU ...": cells that measure what only one kind of device
  has); any other is a failure unless the reasons file explains it.

It prints one line per chapter, writes a parity table (chapter, cell,
verdict, stored, here, reason) as Markdown to ``--table``, and exits with 1
on any failure. Used by ``make test-gpu`` and ``make test-oldest``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
REASONS = ROOT / "tests" / "verdict_parity.toml"
VERDICT = re.compile(r"^([✓✗]) (.*): (yes|NO)(?:  \[measured .*\])?$")
DEVICE_CLAIM = re.compile(r"^on (the|a) (GPU|CPU)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Context:
    """What the fresh run ran on: its torch, and whether it had a GPU."""

    torch: str
    gpu: bool

    def matches(self, when: str) -> bool:
        """``"gpu"``, ``"cpu"``, or ``"torch 2.10"`` (a version prefix)."""
        if when in ("gpu", "cpu"):
            return self.gpu == (when == "gpu")
        return when.startswith("torch ") and self.torch.startswith(when[6:])


@dataclass(frozen=True)
class Row:
    chapter: str
    cell: int
    claim: str
    stored: str  # "yes", "NO" or "absent"
    here: str
    status: str  # "same", "device", "explained" or "FAILED"
    reason: str = ""


def verdicts(nb: nbformat.NotebookNode) -> dict[int, dict[str, str]]:
    """The verdicts each code cell printed: ``{cell index: {claim: "yes" or "NO"}}``."""
    found: dict[int, dict[str, str]] = {}
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            text = output.get("text", "") or output.get("data", {}).get(
                "text/plain", ""
            )
            for line in text.splitlines():
                match = VERDICT.match(line.strip())
                if match:
                    found.setdefault(index, {})[match[2]] = match[3]
    return found


def load_reasons(path: Path = REASONS) -> list[dict]:
    """The explained differences: chapter, claim (a substring), when, reason."""
    if not path.is_file():
        return []
    return tomllib.loads(path.read_text()).get("difference", [])


def compare(
    chapter: str,
    stored: dict[int, dict[str, str]],
    here: dict[int, dict[str, str]],
    context: Context,
    reasons: list[dict],
) -> list[Row]:
    """One row per verdict that either side printed; see the module's rules."""
    rows = []
    for cell in sorted(stored.keys() | here.keys()):
        before, after = stored.get(cell, {}), here.get(cell, {})
        for claim in sorted(before.keys() | after.keys()):
            was, now = before.get(claim, "absent"), after.get(claim, "absent")
            reason = next(
                (
                    r["reason"]
                    for r in reasons
                    if r["chapter"] == chapter
                    and r["claim"] in claim
                    and context.matches(r["when"])
                ),
                "",
            )
            if was == now or (was == "absent" and now == "yes"
                              and DEVICE_CLAIM.match(claim)):  # fmt: skip
                status = "same" if was == now else "device"
            elif now == "absent" and DEVICE_CLAIM.match(claim):
                status = "device"
            else:
                status = "explained" if reason else "FAILED"
            rows.append(Row(chapter, cell, claim, was, now, status, reason))
    return rows


def kernel_manager(python: str, workdir: Path) -> KernelManager:
    """A kernel manager that starts ``python -m ipykernel_launcher``."""
    spec = workdir / "kernels" / "course-parity"
    spec.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "parity", "language": "python"})
    )
    specs = KernelSpecManager(kernel_dirs=[str(spec.parent)])
    return KernelManager(kernel_name="course-parity", kernel_spec_manager=specs)


def execute(
    path: Path, python: str, timeout: float
) -> tuple[nbformat.NotebookNode, str]:
    """Run a copy of the notebook in a fresh kernel; return it and the error, if any."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        client = NotebookClient(
            nb,
            km=kernel_manager(python, Path(tmp)),
            timeout=timeout,
            resources={"metadata": {"path": str(path.parent)}},
        )
        try:
            client.execute()
        except CellExecutionError as err:
            lines = [line for line in str(err).splitlines() if line.strip()]
            return nb, lines[-1] if lines else "a cell raised"
    return nb, ""


def probe(python: str) -> Context:
    """Ask ``python`` which torch it has and whether it sees a GPU."""
    code = "import torch; print(torch.__version__.split('+')[0], torch.cuda.is_available())"
    out = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    return Context(torch=out[0], gpu=out[1] == "True")


def table(rows: list[Row]) -> str:
    """The parity table, as Markdown: differences first, then the rest."""
    lines = [
        "| chapter | cell | verdict | stored (CPU) | here | status | reason |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {"FAILED": 0, "explained": 1, "device": 2, "same": 3}
    for r in sorted(rows, key=lambda r: (order[r.status], r.chapter, r.cell)):
        claim = r.claim.replace("|", "\\|")
        lines.append(
            f"| {r.chapter} | {r.cell} | {claim} | {r.stored} | {r.here} | "
            f"{r.status} | {r.reason} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--python", default=sys.executable, help="the kernel's Python")
    parser.add_argument(
        "--table", type=Path, default=ROOT / "_build" / "verdict_parity.md"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    args = parser.parse_args(argv)
    args.python = os.path.abspath(args.python)  # the kernel starts in notebooks/
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    context = probe(args.python)
    print(
        f"verdict parity: torch {context.torch}, {'GPU' if context.gpu else 'no GPU'}"
    )
    reasons, rows, failed = load_reasons(), [], 0
    for path in paths:
        start = time.monotonic()
        fresh, error = execute(path, args.python, args.timeout)
        chapter = path.stem
        found = compare(
            chapter, verdicts(nbformat.read(path, as_version=4)), verdicts(fresh),
            context, reasons,
        )  # fmt: skip
        rows += found
        bad = [r for r in found if r.status == "FAILED"]
        counts = {
            s: sum(r.status == s for r in found)
            for s in ("same", "device", "explained")
        }
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        if error:
            print(f"FAILED {chapter}: {error} ({summary})", flush=True)
        else:
            mark = "FAILED" if bad else "ok"
            print(f"{mark} {chapter}: {summary or 'no verdicts'}, "
                  f"{len(bad)} unexplained, {time.monotonic() - start:.0f} s", flush=True)  # fmt: skip
        failed += bool(error or bad)
        for r in bad:
            print(f"    cell {r.cell}: {r.claim}: stored {r.stored}, here {r.here}")
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(table(rows))
    print(f"parity table: {args.table}; {failed} chapter(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
