"""No stored output shows what the machine decided, unless the sanitiser masks it.

A reader's machine has its own CPU, cores, vector instructions and GPU; a
stored output that prints them passes nbval only on a machine like the one it
was executed on (chapter 12 once printed "bfloat16 matrix instructions on this
CPU: none", and an AVX-512 BF16 EPYC read "avx512_bf16"). Such facts belong in
the chapter's "verified on" line, in a ``Measured on:`` line or in a verdict's
``[measured ...]`` bracket, which the sanitiser masks. This test applies the
sanitiser (tests/nbval_sanitize.cfg) to every stored output and looks for
what is left.
"""

import json
import re
from pathlib import Path

import pytest
from nbval.plugin import get_sanitize_patterns

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PATTERNS = get_sanitize_patterns(
    (Path(__file__).with_name("nbval_sanitize.cfg")).read_text()
)
MACHINE = {
    "a CPU's name": r"\b(EPYC|Xeon|Ryzen|Threadripper|Core\(TM\)|Graviton|Neoverse|"
    r"Apple M\d|AuthenticAMD|GenuineIntel)\b",
    "a CPU feature": r"\b(avx512\w*|avx2|amx_\w+|avx_vnni|sse4_\d|asimd|sve2?|neon)\b",
    "a core count": r"\b\d+ (CPU |physical |logical )?cores?\b",
    "a GPU's name": r"\b(NVIDIA|Tesla|GeForce|RTX|A100|H100|H200|L4|T4|V100)\b",
}


def stored_texts(path: Path) -> list[tuple[int, str]]:
    cells = json.loads(path.read_text())["cells"]
    texts = []
    for index, cell in enumerate(cells):
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            texts.append((index, "".join(text)))
    return texts


def sanitised(text: str) -> str:
    for regex, replace in PATTERNS:
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_output_prints_the_machine(path):
    found = [
        f"cell {index}: {kind}: {match.group(0)!r} in {line.strip()!r}"
        for index, text in stored_texts(path)
        for line in sanitised(text).splitlines()
        for kind, pattern in MACHINE.items()
        for match in [re.search(pattern, line)]
        if match
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line, kind",
    [
        ("bfloat16 matrix instructions on this CPU: avx512_bf16", "a CPU feature"),
        ("Only 2 CPU cores: run at most 2 processes", "a core count"),
        ("running on an AMD EPYC", "a CPU's name"),
        ("GPU 0: NVIDIA H100 80GB HBM3", "a GPU's name"),
    ],
)
def test_the_scan_finds_each_kind(line, kind):
    assert re.search(MACHINE[kind], sanitised(line))


def test_masked_lines_pass():
    for line in (
        "Measured on: AMD EPYC, 2 cores, no GPU, torch 2.14.1, 2 threads",
        "✓ claim: yes  [measured bf16 instructions: avx512_bf16]",
        "peak fp32 estimate: 157 GFLOP/s = 2 cores x 2.45 GHz x 32 FLOP/cycle (AVX2)",
    ):
        assert not any(re.search(p, sanitised(line)) for p in MACHINE.values()), line
