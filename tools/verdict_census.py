"""Count, per chapter, what nbval checks in the stored outputs.

    python tools/verdict_census.py            # a table per chapter
    python tools/verdict_census.py --list     # and the cells nbval cannot fail on

For every code cell it applies the sanitiser (tests/nbval_sanitize.cfg) as nbval
does and sorts the cell into one kind:

- verdict: prints at least one verdict (a line starting with ✓ or ✗);
- checked: no verdict, but text with digits left after masking (shapes, exact
  integers, tables of computed values) or text only (messages);
- masked: the sanitiser replaced some of its output with a placeholder and
  left no number except constants that stand in its source (a size, a
  title), with no verdict beside them: nbval cannot fail on what it computed
  (tidying alone, such as dropping trailing spaces, masks nothing);
- figure: only a figure (nbval does not compare images);
- no output.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = re.compile(
    r"^\[([\w-]+)\]\n(?:#.*\n)*regex: (.*)\nreplace: (.*)$", re.MULTILINE
)
PLACEHOLDER = re.compile(r"<[a-z]+>|\[measured …\]|~<approx>")


def patterns() -> list[tuple[re.Pattern[str], str]]:
    text = (ROOT / "tests" / "nbval_sanitize.cfg").read_text()
    return [(re.compile(regex), replace) for _, regex, replace in SECTION.findall(text)]


def output_text(cell: dict) -> tuple[str, bool]:
    """The cell's text outputs joined, and whether it shows a figure."""
    texts, figure = [], False
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            texts.append("".join(out["text"]))
        else:
            data = out.get("data", {})
            if "image/png" in data:
                figure = True
            elif "text/plain" in data:
                texts.append("".join(data["text/plain"]))
    return "".join(texts), figure


def kind(cell: dict, subs: list[tuple[re.Pattern[str], str]]) -> str:
    text, figure = output_text(cell)
    if not text.strip():
        return "figure" if figure else "no output"
    if re.search(r"^[✓✗] ", text, re.MULTILINE):
        return "verdict"
    masked = text
    for regex, replace in subs:
        masked = regex.sub(replace, masked)
    number = re.compile(r"\d+(?:\.\d+)?")
    left = set(number.findall(PLACEHOLDER.sub("", masked)))
    constants = set(number.findall("".join(cell["source"])))
    if PLACEHOLDER.search(masked) and left <= constants:
        return "masked"
    return "checked"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="list the masked cells")
    args = parser.parse_args(argv)
    subs = patterns()
    kinds = ("verdict", "checked", "masked", "figure", "no output")
    print(f"{'chapter':32} {'code':>5} " + " ".join(f"{k:>9}" for k in kinds))
    flagged = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = [
            c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"
        ]
        counts = dict.fromkeys(kinds, 0)
        for index, cell in enumerate(cells):
            k = kind(cell, subs)
            counts[k] += 1
            if k == "masked":
                flagged.append(
                    f"{path.name} code cell {index}: {''.join(cell['source'])[:70]!r}"
                )
        print(
            f"{path.stem:32} {len(cells):5d} "
            + " ".join(f"{counts[k]:9d}" for k in kinds)
        )
    if args.list:
        print(
            "\n".join(
                ["", "Cells whose every number is masked, with no verdict:", *flagged]
                if flagged
                else ["", "No masked cells."]
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
