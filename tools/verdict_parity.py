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
on any failure. ``--save DIR`` keeps each executed copy (a failing cell's
output and traceback included). ``--jobs N`` executes the chapters in N
streams at once, each kernel on its own share of the CPU cores (the streams
balanced by the stored run's time): faster on a many-core machine, but the
streams share memory bandwidth and the GPU, so a timing verdict that flips
in a parallel run is rerun alone before it is believed. Used by ``make
test-gpu`` and ``make test-oldest``.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
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
        """``"gpu"``, ``"cpu"``, ``"torch 2.10"`` (a version prefix) or
        ``"torch < 2.13"`` (every release before it)."""
        if when in ("gpu", "cpu"):
            return self.gpu == (when == "gpu")
        if when.startswith("torch < "):
            return release(self.torch) < release(when[8:])
        return when.startswith("torch ") and self.torch.startswith(when[6:])


def release(version: str) -> tuple[int, ...]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``: the numbers a version compares by."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


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
            if was == now or (
                was == "absent" and now == "yes" and DEVICE_CLAIM.match(claim)
            ):
                status = "same" if was == now else "device"
            elif now == "absent" and DEVICE_CLAIM.match(claim):
                status = "device"
            else:
                status = "explained" if reason else "FAILED"
            rows.append(Row(chapter, cell, claim, was, now, status, reason))
    return rows


# A kernel that first restricts itself to some CPU cores, so that torch's
# thread pool (sized when torch is imported, later) fits its share.
PINNED_LAUNCHER = (
    "import os, runpy, sys; os.sched_setaffinity(0, {cores}); "
    "sys.argv[0] = 'ipykernel_launcher'; "
    "runpy.run_module('ipykernel_launcher', run_name='__main__', alter_sys=True)"
)


def kernel_manager(
    python: str, workdir: Path, cores: list[int] | None = None
) -> KernelManager:
    """A kernel manager that starts ``python -m ipykernel_launcher``, on ``cores``."""
    spec = workdir / "kernels" / "course-parity"
    spec.mkdir(parents=True, exist_ok=True)
    if cores is None:
        argv = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    else:
        code = PINNED_LAUNCHER.format(cores=sorted(cores))
        argv = [python, "-c", code, "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "parity", "language": "python"})
    )
    specs = KernelSpecManager(kernel_dirs=[str(spec.parent)])
    return KernelManager(kernel_name="course-parity", kernel_spec_manager=specs)


def execute(
    path: Path, python: str, timeout: float, cores: list[int] | None = None
) -> tuple[nbformat.NotebookNode, str]:
    """Run a copy of the notebook in a fresh kernel; return it and the error, if any.

    The stored outputs are cleared first: a cell after one that raised keeps
    none, so its verdicts count as absent, not as the stored ones.
    """
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    with tempfile.TemporaryDirectory() as tmp:
        client = NotebookClient(
            nb,
            km=kernel_manager(python, Path(tmp), cores),
            timeout=timeout,
            resources={"metadata": {"path": str(path.parent)}},
        )
        try:
            client.execute()
        except CellExecutionError as err:
            return nb, describe_error(nb, err)
    return nb, ""


def describe_error(nb: nbformat.NotebookNode, err: CellExecutionError) -> str:
    """One line: the cell that raised, the exception, and the cell's last stderr line.

    The stderr line matters where the kernel could not format the traceback
    (IPython then prints it to stderr and sends none).
    """
    index = next(
        (
            i
            for i, c in enumerate(nb.cells)
            if any(o.output_type == "error" for o in c.get("outputs", []))
        ),
        None,
    )
    if index is None:  # no error output: the last cell that ran
        index = max(
            (i for i, c in enumerate(nb.cells) if c.get("execution_count")), default=-1
        )
    stderr = [
        line.strip()
        for o in (nb.cells[index].get("outputs", []) if index >= 0 else [])
        if o.output_type == "stream" and o.name == "stderr"
        for line in o.text.splitlines()
        if line.strip()
    ]
    where = f"cell {index}: " if index >= 0 else ""
    said = f" (its stderr ends: {stderr[-1]})" if stderr else ""
    return f"{where}{err.ename}: {err.evalue}{said}"


def stored_seconds(path: Path) -> float:
    """How long the stored run of a notebook took, from its cells' time stamps."""
    stamps = [
        cell.metadata["execution"]
        for cell in nbformat.read(path, as_version=4).cells
        if "execution" in cell.get("metadata", {})
    ]
    if not stamps:
        return 0.0
    start = stamps[0].get("iopub.execute_input")
    end = stamps[-1].get("shell.execute_reply")
    if not (start and end):
        return 0.0
    parse = datetime.fromisoformat
    return (parse(end) - parse(start)).total_seconds()


def streams(paths: list[Path], jobs: int) -> list[list[Path]]:
    """Split the notebooks into ``jobs`` streams of about equal stored time."""
    groups: list[list[Path]] = [[] for _ in range(max(1, min(jobs, len(paths))))]
    totals = [0.0] * len(groups)
    for path in sorted(paths, key=stored_seconds, reverse=True):
        i = totals.index(min(totals))
        groups[i].append(path)
        totals[i] += stored_seconds(path)
    return [sorted(group) for group in groups]


def core_shares(jobs: int) -> list[list[int] | None]:
    """This process's cores in ``jobs`` contiguous shares; ``[None]`` for one job."""
    if jobs <= 1:
        return [None]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < jobs:
        raise SystemExit(
            f"--jobs {jobs} needs at least {jobs} cores; there are {len(cores)}."
        )
    size = len(cores) // jobs
    return [cores[i * size : (i + 1) * size] for i in range(jobs)]


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


def run_chapter(
    path: Path,
    args: argparse.Namespace,
    context: Context,
    reasons: list[dict],
    cores: list[int] | None,
) -> tuple[list[Row], bool]:
    """Execute one chapter, compare its verdicts, print its line; (rows, failed)."""
    start = time.monotonic()
    fresh, error = execute(path, args.python, args.timeout, cores)
    if args.save:
        nbformat.write(fresh, args.save / path.name)
    chapter = path.stem
    found = compare(
        chapter,
        verdicts(nbformat.read(path, as_version=4)),
        verdicts(fresh),
        context,
        reasons,
    )
    bad = [r for r in found if r.status == "FAILED"]
    counts = {
        s: sum(r.status == s for r in found) for s in ("same", "device", "explained")
    }
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines = []
    if error:
        lines.append(f"FAILED {chapter}: {error} ({summary})")
    else:
        mark = "FAILED" if bad else "ok"
        lines.append(
            f"{mark} {chapter}: {summary or 'no verdicts'}, "
            f"{len(bad)} unexplained, {time.monotonic() - start:.0f} s"
        )
    lines += [
        f"    cell {r.cell}: {r.claim}: stored {r.stored}, here {r.here}" for r in bad
    ]
    print("\n".join(lines), flush=True)  # one print: streams do not interleave
    return found, bool(error or bad)


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
    parser.add_argument("--save", type=Path, help="a folder for the executed copies")
    parser.add_argument(
        "--jobs", type=int, default=1, help="chapters executed at once, on shared cores"
    )
    args = parser.parse_args(argv)
    args.python = os.path.abspath(args.python)  # the kernel starts in notebooks/
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
    context = probe(args.python)
    groups, shares = streams(paths, args.jobs), core_shares(args.jobs)
    print(
        f"verdict parity: torch {context.torch}, {'GPU' if context.gpu else 'no GPU'}"
        + (f", {len(groups)} streams at once" if len(groups) > 1 else "")
    )
    reasons = load_reasons()

    def run_stream(i: int) -> list[tuple[list[Row], bool]]:
        cores = shares[i] if len(groups) > 1 else None
        return [run_chapter(p, args, context, reasons, cores) for p in groups[i]]

    with ThreadPoolExecutor(len(groups)) as pool:
        done = [
            result
            for stream in pool.map(run_stream, range(len(groups)))
            for result in stream
        ]
    rows = [row for found, _ in done for row in found]
    failed = sum(bad for _, bad in done)
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(table(rows))
    print(f"parity table: {args.table}; {failed} chapter(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
