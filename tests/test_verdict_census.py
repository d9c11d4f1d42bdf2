"""tools/verdict_census.py sorts a code cell by what nbval can fail on in its output."""

import sys
from pathlib import Path

import pytest
from nbformat.v4 import new_code_cell, new_output

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from verdict_census import kind, patterns


def cell(source: str, text: str) -> dict:
    return new_code_cell(source, outputs=[new_output("stream", text=text)])


@pytest.mark.parametrize(
    ("source", "text", "expected"),
    [
        (
            "print(check(...))",
            "speed-up 1.62×\n✓ compiled is faster: yes  [measured 1.62×]\n",
            "verdict",
        ),
        # every number a time, and the sizes are the source's own constants
        (
            "for n in (64, 256): print(n, benchmark(f, n))",
            "64  14.6 us\n256  315 us\n",
            "masked",
        ),
        # a computed count survives the masking
        ("print(len(loader), benchmark(f))", "23 batches: 64.4 ms\n", "checked"),
        # only trailing spaces are tidied away: nothing was masked
        ("print(inspect.getsource(f))", "def f(x):   \n    return x\n", "checked"),
        ("plt.show()", "", "no output"),
    ],
)
def test_kind(source, text, expected):
    assert kind(cell(source, text), patterns()) == expected
