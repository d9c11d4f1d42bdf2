"""The nbval sanitiser masks exactly the measured values it is meant to mask.

Each pattern of tests/nbval_sanitize.cfg gets one string it must mask and one
it must leave alone, so that a pattern that grows to hide a conclusion (a
verdict's answer, a constant in a claim, a computed integer) fails here.
"""

import re
from pathlib import Path

import pytest
from nbval.plugin import get_sanitize_patterns

CONFIG = Path(__file__).with_name("nbval_sanitize.cfg")
SECTION = re.compile(
    r"^\[([\w-]+)\]\n(?:#.*\n)*regex: (.*)\nreplace: (.*)$", re.MULTILINE
)
PATTERNS = {
    name: (regex, replace)
    for name, regex, replace in SECTION.findall(CONFIG.read_text())
}

# section: (masked, expected after masking, left alone)
EXAMPLES = {
    "durations": (
        "one epoch on cpu: 805 ms; measured cost -1.2 ms",
        "one epoch on cpu: <time>; measured cost <time>",
        "epoch 8/8: 23 batches",
    ),
    "ratios": ("speed-up 1.62×", "speed-up <ratio>", "at least 2x faster (target 5x)"),
    "rates": ("4,067 images/s", "<rate>", "global batch 128 = 2 x 64"),
    "hardware": (
        "Measured on: AMD EPYC, 2 cores",
        "Measured on: <hardware>",
        "measured once",
    ),
    "verdict-evidence": (
        "✓ matches: yes  [measured 1.62×, noise ±8%]",
        "✓ matches: yes  [measured …]",
        "✓ matches DDP (within 1e-05): yes",
    ),
    "approximate": (
        "test accuracy ~0.953",
        "test accuracy ~<approx>",
        "test accuracy 0.953",
    ),
    "tqdm-elapsed": (
        "23/23 [00:01<00:00, 17.21batch/s, loss ~1.7]",
        "23/23 [<elapsed>, loss ~1.7]",
        "[rank 0] step 50/200",
    ),
    "trailing-spaces": ("done   \nnext", "done\nnext", "a  b\n"),
    "replica-norms": (
        "0.weight has norm 3.773106 on rank 0,",
        "0.weight has norm <norm> on rank 0,",
        "the replicas differ after step 11 on rank 0",
    ),
    "peak-memory": (
        "peak resident set since the process started 931 MiB",
        "peak resident set since the process started <memory>",
        "2.30 MiB saved for backward",
    ),
    "cpu-peak-estimate": (
        "peak fp32 estimate: 157 GFLOP/s = 2 cores x 2.45 GHz x 32 FLOP/cycle (AVX2)",
        "<this CPU's peak estimate>",
        "fp32 matmul (2048 x 2048): 74.7 GFLOP/s",
    ),
    "peak-share": (
        (
            "76.4 GFLOP/s is 1.02× the matmul rate (0.49× the estimated peak) of this "
            "machine."
        ),
        "76.4 GFLOP/s is 1.02× the matmul rate of this machine.",
        "the estimated peak (see chapter 06)",
    ),
    "ddp-resnet-epoch-log": (
        "epoch 1/4: loss 1.430, test accuracy 19.5%, 14.13 s",
        "epoch 1/4: loss <loss>, test accuracy <accuracy>, 14.13 s",
        "ResNet-18 (width 16): 701,178 parameters; global batch 128 = 2 x 64.",
    ),
    "spmd-differences": (
        "fully_shard          max diff vs DDP = 2.2e-07",
        "fully_shard          max diff vs DDP = <difference>",
        "4 processes on cpu, 5 steps, global batch 128",
    ),
    "table-rules": (
        "variant  time\n-------  ------\n",
        "variant  time\n<rule>\n",
        "a -- b\n-1  -2\n",
    ),
    "column-gaps": (
        "        module   eager\nmodels  loop     vmap\n<rule>\n8       <time>  1.5",
        "~~module~~eager\nmodels~~loop~~vmap\n<rule>\n8~~<time>~~1.5",
        "a b c\n 1 2\n",
    ),
}


def apply(name: str, text: str) -> str:
    regex, replace = PATTERNS[name]
    return re.sub(regex, replace, text)


def test_every_pattern_has_examples_and_nbval_reads_them_all():
    assert set(PATTERNS) == set(EXAMPLES)
    # nbval's own parser must see the same patterns (a comment between the
    # regex and replace lines would silently drop one).
    assert sorted(get_sanitize_patterns(CONFIG.read_text())) == sorted(
        PATTERNS.values()
    )


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_pattern_masks_its_example(name):
    masked, expected, _ = EXAMPLES[name]
    assert apply(name, masked) == expected


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_pattern_leaves_other_text_alone(name):
    _, _, untouched = EXAMPLES[name]
    assert apply(name, untouched) == untouched


def test_a_verdict_answer_survives_every_pattern():
    line = (
        "✗ compiled is faster than eager (at least 2x): NO  [measured 1.10×, noise ±5%]"
    )
    for name in PATTERNS:  # in file order, as nbval applies them
        line = apply(name, line)
    assert line == "✗ compiled is faster than eager (at least 2x): NO~~[measured …]"


def test_peak_lines_compare_equal_with_and_without_a_known_peak():
    """Chapter 06 on a CPU whose peak is known, and under ATEN_CPU_CAPABILITY=default (unknown)."""
    known = (
        "matmul reaches 0.48× the estimated peak\n"
        "76.4 GFLOP/s is 1.02× the matmul rate (0.49× the estimated peak) of this "
        "machine."
    )
    unknown = (
        "matmul vs peak: unknown, only measured numbers are reported\n"
        "80.1 GFLOP/s is 0.98× the matmul rate of this machine."
    )
    for name in PATTERNS:  # in file order, as nbval applies them
        known, unknown = apply(name, known), apply(name, unknown)
    assert known == unknown


def stored_outputs() -> str:
    import json

    texts = []
    for path in sorted((CONFIG.parents[1] / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            for out in cell.get("outputs", []):
                texts.append(
                    "".join(out.get("text", ""))
                    or "".join(out.get("data", {}).get("text/plain", ""))
                )
    return "\n".join(texts)


def test_every_pattern_masks_something_in_the_stored_notebooks():
    """A pattern that matches no stored output is dead weight, or hides a typo."""
    text = stored_outputs()
    unused = [
        name for name, (regex, _) in PATTERNS.items() if not re.search(regex, text)
    ]
    assert unused == []
