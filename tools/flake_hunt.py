"""`make flake-hunt`: every chapter under hostile conditions, round after round.

    python tools/flake_hunt.py                       # 3 rounds, every chapter
    python tools/flake_hunt.py --rounds 1 notebooks/06_*.ipynb
    python tools/flake_hunt.py --conditions busy     # one condition only

A stored output passes nbval on the machine that stored it; readers' machines
and CI's runners are busier, have other CPUs and other thread counts. This
tool runs nbval over the chapters, as ``make test`` does, under each of these
conditions in turn, for ``--rounds`` rounds:

- ``busy``: another process keeps one core busy the whole time;
- ``scalar``: one thread, ATen's scalar kernels and MKL's reproducible mode
  (the portable pass's settings; ``torch.compile`` chapters keep a vectorised
  path, as ``tools/run_portable.sh`` explains);
- ``oversubscribed``: twice as many threads as cores.

It lists every cell whose compared output changed, with nbval's diff, in a
Markdown report (``--report``, by default ``tools/flake_report.md``, kept in
the repository so that the next contributor sees the last hunt), and exits
with 1 if any did. Chapter authors run it before they commit stored outputs
(CONTRIBUTING.md). It is not part of ``make test``: a round over every chapter
takes about half an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "tools" / "flake_report.md"
CONDITIONS = ("busy", "scalar", "oversubscribed")
COLOURS = re.compile(r"(?:#x1B|\x1b)\[\d+m")  # JUnit escapes the terminal's colours


@dataclass(frozen=True)
class Change:
    """A cell whose compared output changed under a condition."""

    round: int
    condition: str
    notebook: str
    cell: str
    diff: str


def cores() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0))


def condition_env(condition: str, compiled: bool) -> dict[str, str]:
    """The environment variables of a condition, for a chapter that compiles or not."""
    if condition == "scalar":
        env = {"OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE"}
        if not compiled:
            env["ATEN_CPU_CAPABILITY"] = "default"
        elif "avx512f" in Path("/proc/cpuinfo").read_text():
            env["ATEN_CPU_CAPABILITY"] = "avx2"
            # A cache of its own, as tools/run_portable.sh explains: a kernel
            # cached under AVX-512 computed garbage when loaded under "avx2".
            tmp = os.environ.get("TMPDIR", "/tmp")
            env["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/torchinductor_portable_avx2"
        return env
    if condition == "oversubscribed":
        return {"OMP_NUM_THREADS": str(2 * cores())}
    if condition == "busy":
        return {}
    raise ValueError(f"Unknown condition {condition!r}; choose from {CONDITIONS}.")


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[multiprocessing.Process | None]:
    """Keep one core busy (a spinning process, yielded) while the block runs."""
    if not on:
        yield None
        return
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        yield spinner
    finally:
        spinner.terminate()
        spinner.join()


def failures(junit: Path) -> list[tuple[str, str, str]]:
    """(notebook, cell, message) for every failed or erroring test in a JUnit file."""
    found = []
    for case in ET.parse(junit).iter("testcase"):
        for problem in [*case.iter("failure"), *case.iter("error")]:
            notebook = Path(case.get("file") or case.get("classname", "")).name
            found.append((notebook, case.get("name", ""), problem.text or ""))
    return found


def run_nbval(notebooks: list[Path], env: dict[str, str]) -> list[tuple[str, str, str]]:
    """nbval over ``notebooks`` in ``env``, as make test runs it; the failures."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                *map(str, notebooks),
                "--nbval",
                "--nbval-current-env",
                "--nbval-sanitize-with",
                str(ROOT / "tests" / "nbval_sanitize.cfg"),
                "-p",
                "no:cacheprovider",
                "-q",
                "-o",
                "junit_family=xunit1",
                f"--junitxml={junit}",
            ],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=False,
        )
        if not junit.is_file():
            return [("(all)", "(none)", "pytest wrote no report: it could not start.")]
        return failures(junit)


def short(diff: str, lines: int = 30) -> str:
    """The part of nbval's message that shows the difference, without colours."""
    kept = [line for line in COLOURS.sub("", diff).splitlines() if line.strip()]
    start = next((i for i, line in enumerate(kept) if line.startswith("Traceback")), 0)
    kept = kept[start:]
    return "\n".join(kept[:lines] + (["..."] if len(kept) > lines else []))


def report(
    changes: list[Change],
    rounds: int,
    conditions: list[str],
    notebooks: list[Path],
    seconds: float,
) -> str:
    """The Markdown report of a hunt."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    head = [
        "# Flake hunt report",
        "",
        f"Written by `tools/flake_hunt.py` on {when}: {rounds} round(s) of "
        f"{', '.join(conditions)} over {len(notebooks)} chapter(s) on a machine "
        f"with {cores()} cores ({cpu}), in {seconds / 60:.0f} minutes.",
        "",
    ]
    if not changes:
        return "\n".join(head + ["No compared output changed.", ""])
    lines = head + [
        f"{len(changes)} cell(s) changed:",
        "",
        "| round | condition | chapter | cell |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {c.round} | {c.condition} | {c.notebook} | {c.cell} |" for c in changes
    ]
    for c in changes:
        lines += [
            "",
            f"## {c.notebook}, {c.cell} ({c.condition}, round {c.round})",
            "",
            "```",
            short(c.diff),
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--conditions", default=",".join(CONDITIONS), help="comma-separated"
    )
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    conditions = [c for c in args.conditions.split(",") if c]
    for c in conditions:  # an unknown name fails here, before any run
        if c not in CONDITIONS:
            parser.error(
                f"unknown condition {c!r}; choose from {', '.join(CONDITIONS)}."
            )
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more, not {args.rounds}.")
    notebooks = args.notebooks or sorted(
        (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")
    )
    compiled = {nb for nb in notebooks if "torch.compile(" in nb.read_text()}
    start, changes = time.monotonic(), []
    for round_ in range(1, args.rounds + 1):
        for condition in conditions:
            t, found = time.monotonic(), []
            with busy_core(condition == "busy"):
                for notebook in notebooks:  # one at a time: the report grows as it goes
                    env = condition_env(condition, notebook in compiled)
                    changed = run_nbval([notebook], env)
                    found += changed
                    for nb, cell, _ in changed:
                        print(f"    {nb} {cell}", flush=True)
            changes += [Change(round_, condition, *f) for f in found]
            print(
                f"round {round_}, {condition}: {len(found)} cell(s) changed, "
                f"{time.monotonic() - t:.0f} s",
                flush=True,
            )
            # after every condition, so that an interrupted hunt leaves its findings
            args.report.write_text(
                report(
                    changes,
                    args.rounds,
                    conditions,
                    notebooks,
                    time.monotonic() - start,
                )
            )
    print(f"report: {args.report}; {len(changes)} change(s)")
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main())
