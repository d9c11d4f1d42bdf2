"""tools/flake_hunt.py (make flake-hunt): its conditions, what it reads, what it reports."""

import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import flake_hunt as fh  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="notebooks.06_async" file="notebooks/06_async.ipynb" name="Cell 5"/>
<testcase classname="notebooks.06_async" file="notebooks/06_async.ipynb" name="Cell 13">
<failure message="differ">#x1B[94mCell 13: Cell outputs differ
Input:
x = 1
#x1B[94mTraceback:#x1B[0m
 mismatch 'stdout'
  - ✓ holds: yes
  + ✗ holds: NO</failure></testcase>
<testcase classname="notebooks.10_ens" file="notebooks/10_ens.ipynb" name="Cell 2">
<error message="raised">Traceback: ValueError</error></testcase>
</testsuite></testsuites>
"""


def test_conditions_set_what_they_promise(monkeypatch):
    monkeypatch.setattr(fh, "cores", lambda: 2)
    assert fh.condition_env("busy", False) == {}
    assert fh.condition_env("oversubscribed", False) == {"OMP_NUM_THREADS": "4"}
    scalar = fh.condition_env("scalar", False)
    assert scalar == {
        "OMP_NUM_THREADS": "1",
        "MKL_CBWR": "COMPATIBLE",
        "ATEN_CPU_CAPABILITY": "default",
    }
    # torch.compile's C++ does not build on the scalar path: compile chapters keep
    # a vectorised one (AVX2 on an AVX-512 CPU, else the CPU's own)
    compiled = fh.condition_env("scalar", True)
    assert compiled.get("ATEN_CPU_CAPABILITY") in (None, "avx2")
    # under avx2, with an Inductor cache of its own (not the AVX-512 kernels')
    if compiled.get("ATEN_CPU_CAPABILITY") == "avx2":
        assert compiled["TORCHINDUCTOR_CACHE_DIR"].endswith(
            "torchinductor_portable_avx2"
        )
    with pytest.raises(ValueError, match="Unknown condition 'hot'"):
        fh.condition_env("hot", False)


def test_failures_and_errors_are_read_from_the_junit_report(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    found = fh.failures(junit)
    assert [(nb, cell) for nb, cell, _ in found] == [
        ("06_async.ipynb", "Cell 13"),
        ("10_ens.ipynb", "Cell 2"),
    ]
    assert fh.short(found[0][2]) == (
        "Traceback:\n mismatch 'stdout'\n  - ✓ holds: yes\n  + ✗ holds: NO"
    )


def test_the_report_lists_each_change_with_its_diff():
    changes = [
        fh.Change(2, "busy", "06_async.ipynb", "Cell 13", "Traceback:\n- a\n+ b")
    ]
    text = fh.report(changes, 3, ["busy"], [Path("a"), Path("b")], 600)
    assert "| 2 | busy | 06_async.ipynb | Cell 13 |" in text
    assert "## 06_async.ipynb, Cell 13 (busy, round 2)" in text and "+ b" in text
    assert "3 round(s) of busy over 2 chapter(s)" in text
    assert "No compared output changed." in fh.report([], 1, ["busy"], [], 1)


def test_a_busy_core_is_busy_while_the_block_runs():
    """The spinner uses CPU inside the block and is gone after it (how much CPU
    it gets depends on the machine's load, so only "some" is asserted)."""
    with fh.busy_core(True) as spinner:
        process = psutil.Process(spinner.pid)
        deadline = time.monotonic() + 30
        while process.cpu_times().user == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process.cpu_times().user > 0
    assert not spinner.is_alive()
    with fh.busy_core(False) as nothing:
        assert nothing is None


def test_bad_arguments_are_refused_before_any_run(capsys):
    for argv, sentence in (
        (["--conditions", "busy,hot"], "unknown condition 'hot'; choose from busy"),
        (["--rounds", "0"], "--rounds must be 1 or more, not 0."),
    ):
        with pytest.raises(SystemExit):
            fh.main(argv)
        assert sentence in capsys.readouterr().err
