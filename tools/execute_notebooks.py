"""Execute notebooks in place, as CI and the book expect them stored.

    python tools/execute_notebooks.py notebooks/01_tensors.ipynb [more ...]
    python tools/execute_notebooks.py --force ...   # store even on a busy machine

Each notebook runs in a fresh ``python3`` kernel with ``notebooks/`` as its
working folder. Outputs are stored only when they can be trusted:

- the machine must be quiet: before each notebook, other processes may use at
  most ``--max-busy`` of one core, and a short calibration benchmark must
  repeat within ``--max-spread`` (a number measured on a busy machine is a
  wrong number, and the prose around it becomes false);
- every verdict the notebook printed must hold (no line starting with ``✗``).

Stored stream outputs are tidied as nbval compares them and as a terminal
shows them: one block per stream and cell, and text overwritten by a carriage
return (a progress bar's earlier states) dropped.

After a successful run, the chapter's "verified on" line (a Markdown cell
tagged ``verified-on``, after the overview) is rewritten with the CPU, cores
and threads, torch version, date and the notebook's wall time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import nbformat
import psutil
import torch
from nbclient import NotebookClient
from nbval.plugin import coalesce_streams

VERIFIED_TAG = "verified-on"


class RefusedError(Exception):
    """The outputs were not stored; the message says why and what to do."""


def other_processes_load(seconds: float = 2.0) -> float:
    """Cores' worth of CPU that processes other than this one (and its children) use."""
    me = psutil.Process()
    mine = {me.pid, *(c.pid for c in me.children(recursive=True))}
    others = [p for p in psutil.process_iter() if p.pid not in mine]
    for p in others:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(seconds)
    total = 0.0
    for p in others:
        try:
            total += p.cpu_percent(None)
        except psutil.Error:
            pass
    return total / 100


def calibration_spread(repeats: int = 9) -> float:
    """Relative interquartile range of a short one-thread matrix-product benchmark.

    One thread: two threads on a virtual machine vary by 5-50 % even when
    nothing else runs, one by about 2 %.
    """
    a = torch.randn(256, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(40):
                a @ a
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


def check_quiet(max_busy: float, max_spread: float) -> None:
    """Raise RefusedError when the machine is too busy to measure on."""
    busy = other_processes_load()
    if busy > max_busy:
        raise RefusedError(
            f"other processes use {busy:.2f} cores' worth of CPU (at most {max_busy} "
            "allowed): "
            "stop them (tests, builds, other notebooks) and run again, or pass --force."
        )
    spread = min(
        calibration_spread() for _ in range(3)
    )  # a single hiccup is not a busy machine
    if spread > max_spread:
        raise RefusedError(
            f"a calibration benchmark varies by {spread:.0%} between repeats (at most "
            f"{max_spread:.0%} allowed): the machine is not quiet; run again later, or "
            "pass --force."
        )


def failed_verdicts(nb: nbformat.NotebookNode) -> list[str]:
    """Return 'cell N: line' for every printed verdict that does not hold."""
    failed = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            text = output.get("text", "") or output.get("data", {}).get(
                "text/plain", ""
            )
            failed += [
                f"cell {index}: {line}"
                for line in text.splitlines()
                if line.startswith("✗")
            ]
    return failed


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "an unknown CPU"


def verified_line(seconds: float) -> str:
    """The chapter's "verified on" sentence for a run that took ``seconds``."""
    cores = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count()
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    accel = f"{gpus} GPU(s)" if gpus else "no GPU"
    return (
        f"*Verified on: {cpu_model()}, {cores} cores, {torch.get_num_threads()} "
        "threads, "
        f"{accel}, torch {torch.__version__.split('+')[0]}, "
        f"{datetime.date.today().isoformat()}; this notebook ran in {seconds:.0f} s.*"
    )


def write_verified_line(nb: nbformat.NotebookNode, text: str) -> None:
    """Replace the cell tagged ``verified-on``, or add one after the first Markdown cell."""
    for cell in nb.cells:
        if VERIFIED_TAG in cell.get("metadata", {}).get("tags", []):
            cell.source = text
            return
    cell = nbformat.v4.new_markdown_cell(text, metadata={"tags": [VERIFIED_TAG]})
    first_markdown = next(
        i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
    )
    nb.cells.insert(first_markdown + 1, cell)


def tidy_streams(nb: nbformat.NotebookNode) -> None:
    """One output per stream and cell, with carriage returns applied (nbval's own rules)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = coalesce_streams(cell.outputs)


def execute(path: Path) -> float:
    """Execute the notebook at ``path``; store it if every verdict holds. Return the seconds."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    failed = failed_verdicts(nb)
    if failed:
        raise RefusedError(
            f"{len(failed)} verdict(s) do not hold, so the outputs were not stored: "
            + "; ".join(failed)
        )
    tidy_streams(nb)
    write_verified_line(nb, verified_line(elapsed))
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument(
        "--force", action="store_true", help="skip the quiet-machine check"
    )
    parser.add_argument(
        "--max-busy",
        type=float,
        default=0.15,
        help="cores' worth of CPU other processes may use (default: 0.15)",
    )
    parser.add_argument(
        "--max-spread",
        type=float,
        default=0.10,
        help="relative IQR of the calibration benchmark allowed (default: 0.10)",
    )
    args = parser.parse_args(argv)
    status = 0
    for path in args.notebooks:
        if not path.is_file():
            print(f"No notebook at {path}.", file=sys.stderr)
            return 2
        try:
            if not args.force:
                check_quiet(args.max_busy, args.max_spread)
            print(f"{path}: executed in {execute(path):.1f} s", flush=True)
        except RefusedError as err:
            print(f"{path}: not stored: {err}", file=sys.stderr, flush=True)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
