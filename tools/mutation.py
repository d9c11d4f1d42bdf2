"""Summarise a mutmut run (`make mutation`): the mutation score per module.

Reads mutmut's results in ``mutants/companion/**/*.py.meta`` and prints, for each
module, the mutants the tests caught (failed or timed out), those that
survived, those no fast test covers, and those not run yet (a run limited
with ``MUTANTS=``); then the score, caught / (caught + survived + not covered).

    python tools/mutation.py [companion.harness.timing companion.data ...]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

CAUGHT = {
    1,
    3,
    36,
    37,
    -24,
    24,
    152,
    255,
}  # tests failed, pytest error, timeouts, type check
SURVIVED = {0}
NOT_COVERED = {5, 33}
NOT_RUN = {None}


def summarise(root: Path, modules: list[str]) -> list[tuple[str, Counter]]:
    rows = []
    for meta in sorted(root.glob("companion/**/*.py.meta")):
        module = ".".join(meta.relative_to(root).with_suffix("").with_suffix("").parts)
        if modules and module not in modules:
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"].values()
        counts = Counter()
        for code in codes:
            if code in CAUGHT:
                counts["caught"] += 1
            elif code in SURVIVED:
                counts["survived"] += 1
            elif code in NOT_COVERED:
                counts["not covered"] += 1
            elif code in NOT_RUN:
                counts["not run"] += 1
            else:
                counts["other"] += 1  # suspicious, segfault, interrupted
        if codes:
            rows.append((module, counts))
    return rows


def main() -> None:
    rows = summarise(Path("mutants"), sys.argv[1:])
    if not rows:
        sys.exit("No mutmut results in mutants/: run `make mutation` first.")
    columns = ["caught", "survived", "not covered", "not run", "other"]
    print(f"{'module':<24}" + "".join(f"{c:>13}" for c in columns) + f"{'score':>8}")
    total = Counter()
    for module, counts in rows + [("total", None)]:
        counts = counts if counts is not None else total
        if module != "total":
            total.update(counts)
        judged = (
            counts["caught"]
            + counts["survived"]
            + counts["not covered"]
            + counts["other"]
        )
        score = f"{100 * counts['caught'] / judged:.0f} %" if judged else "-"
        print(
            f"{module:<24}"
            + "".join(f"{counts[c]:>13}" for c in columns)
            + f"{score:>8}"
        )


if __name__ == "__main__":
    main()
