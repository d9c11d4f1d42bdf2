"""tools/verdict_parity.py: which verdict differences pass, and which fail."""

import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import verdict_parity as vp  # noqa: E402

GPU, OLD = vp.Context("2.14.1", gpu=True), vp.Context("2.10.0", gpu=False)


def notebook(*cells: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for text in cells:
        cell = nbformat.v4.new_code_cell("pass")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        nb.cells.append(cell)
    return nb


def statuses(stored, here, context, reasons=()) -> dict[str, str]:
    rows = vp.compare("ch", stored, here, context, list(reasons))
    return {r.claim: r.status for r in rows}


def test_verdicts_are_read_per_cell_without_their_measurement():
    nb = notebook(
        "a table\n✓ x is fast (at least 2x): yes  [measured 3.1×, noise ±5%]\n",
        "✗ y holds: NO\nnot a verdict: yes\n",
    )
    assert vp.verdicts(nb) == {
        0: {"x is fast (at least 2x)": "yes"},
        1: {"y holds": "NO"},
    }


def test_same_verdicts_pass_and_a_flip_fails():
    stored = {3: {"a": "yes", "b": "yes"}}
    here = {3: {"a": "yes", "b": "NO"}}
    assert statuses(stored, here, GPU) == {"a": "same", "b": "FAILED"}


def test_a_flip_passes_only_where_the_reasons_file_explains_it():
    reason = {"chapter": "ch", "claim": "b", "when": "torch 2.10", "reason": "r"}
    stored, here = {0: {"b holds": "yes"}}, {0: {"b holds": "NO"}}
    assert statuses(stored, here, OLD, [reason]) == {"b holds": "explained"}
    assert statuses(stored, here, GPU, [reason]) == {"b holds": "FAILED"}
    assert statuses(stored, here, OLD, [{**reason, "chapter": "other"}]) == {
        "b holds": "FAILED"
    }


def test_claims_that_name_their_device_may_differ_between_devices():
    stored = {5: {"on the CPU the calls return only when the work is done": "yes"}}
    here = {5: {"on the GPU the calls return before half of the work is done": "yes"}}
    assert set(statuses(stored, here, GPU).values()) == {"device"}
    failing = {5: {"on the GPU the calls return before half of the work is done": "NO"}}
    assert "FAILED" in statuses(stored, failing, GPU).values()


def test_a_verdict_that_vanished_fails_unless_it_names_its_device():
    assert statuses({1: {"a": "yes"}}, {}, GPU) == {"a": "FAILED"}


def test_the_reasons_file_parses_and_every_entry_is_complete():
    for entry in vp.load_reasons():
        assert {"chapter", "claim", "when", "reason"} <= entry.keys()
        assert entry["when"] in ("gpu", "cpu") or entry["when"].startswith("torch 2.")


def test_the_table_lists_failures_first():
    rows = [
        vp.Row("ch", 1, "a", "yes", "yes", "same"),
        vp.Row("ch", 2, "b|c", "yes", "NO", "FAILED"),
    ]
    lines = vp.table(rows).splitlines()
    assert lines[2].startswith("| ch | 2 | b\\|c |") and "FAILED" in lines[2]
