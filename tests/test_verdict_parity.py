"""tools/verdict_parity.py: which verdict differences pass, and which fail."""

import sys
from pathlib import Path

import nbformat
import pytest

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


def test_a_reason_can_name_every_release_before_one():
    before = {"chapter": "ch", "claim": "b", "when": "torch < 2.13", "reason": "r"}
    stored, here = {0: {"b holds": "yes"}}, {0: {}}
    for version in ("2.10.0", "2.11.0+cu130", "2.12.1"):
        context = vp.Context(version, gpu=False)
        assert statuses(stored, here, context, [before]) == {"b holds": "explained"}
    for version in ("2.13.0", "2.14.1"):
        context = vp.Context(version, gpu=True)
        assert statuses(stored, here, context, [before]) == {"b holds": "FAILED"}


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
        when = entry["when"]
        assert when in ("gpu", "cpu") or when.startswith(("torch 2.", "torch < 2."))


def test_the_table_lists_failures_first():
    rows = [
        vp.Row("ch", 1, "a", "yes", "yes", "same"),
        vp.Row("ch", 2, "b|c", "yes", "NO", "FAILED"),
    ]
    lines = vp.table(rows).splitlines()
    assert lines[2].startswith("| ch | 2 | b\\|c |") and "FAILED" in lines[2]


def timed_notebook(path, seconds: float, *sources: str) -> None:
    """A notebook whose stored run took ``seconds``, with one cell per source."""
    nb = nbformat.v4.new_notebook()
    for i, source in enumerate(sources or ["pass"]):
        cell = nbformat.v4.new_code_cell(source)
        stamp = f"2026-01-01T00:00:{0 if i == 0 else seconds:02.0f}Z"
        cell.metadata["execution"] = {
            "iopub.execute_input": "2026-01-01T00:00:00Z",
            "shell.execute_reply": stamp,
        }
        nb.cells.append(cell)
    nbformat.write(nb, path)


def test_streams_balance_the_stored_run_times(tmp_path):
    paths = []
    for name, seconds in (("a", 10), ("b", 8), ("c", 3), ("d", 2)):
        paths.append(tmp_path / f"{name}.ipynb")
        timed_notebook(paths[-1], seconds, "pass", "pass")
    assert vp.stored_seconds(paths[0]) == 10
    groups = vp.streams(paths, 2)
    assert sorted(p for g in groups for p in g) == paths
    totals = sorted(sum(vp.stored_seconds(p) for p in g) for g in groups)
    assert totals == [11, 12]  # 10 + 2 and 8 + 3
    assert vp.streams(paths, 9) == [
        [p] for p in sorted(paths, key=vp.stored_seconds, reverse=True)
    ]


def test_each_stream_gets_its_own_contiguous_cores(monkeypatch):
    monkeypatch.setattr(vp.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert vp.core_shares(1) == [None]
    assert vp.core_shares(4) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    with pytest.raises(SystemExit, match="--jobs 17 needs at least 17 cores"):
        vp.core_shares(17)


@pytest.mark.slow
def test_parallel_streams_run_pinned_kernels_and_keep_each_copy(tmp_path):
    """Two chapters at once on this machine's cores, one core each; the executed
    copies are saved, and a verdict that flips still fails the run."""
    code = (
        "import os; n = len(os.sched_getaffinity(0)); print('cores:', n)\n"
        'print(f\'✓ it holds: {"yes" if n == {n} else "NO"}\')'
    )
    cores = len(vp.os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs two cores")
    share = cores // 2
    for name in ("one", "two"):
        timed_notebook(tmp_path / f"{name}.ipynb", 1, code.replace("{n}", str(share)))
        nb = nbformat.read(tmp_path / f"{name}.ipynb", as_version=4)
        nb.cells[0].outputs = [
            nbformat.v4.new_output("stream", name="stdout", text="✓ it holds: yes\n")
        ]
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    paths = [tmp_path / "one.ipynb", tmp_path / "two.ipynb"]
    saved, table = tmp_path / "saved", tmp_path / "table.md"
    args = [
        *map(str, paths),
        "--jobs",
        "2",
        "--save",
        str(saved),
        "--table",
        str(table),
    ]
    assert vp.main(args) == 0
    for path in paths:
        out = nbformat.read(saved / path.name, as_version=4).cells[0].outputs
        assert out[0]["text"].startswith(f"cores: {share}\n")
    assert "| one | 0 | it holds | yes | yes | same |" in table.read_text()
    # unpinned, each kernel sees every core: the verdict flips and the run fails
    assert vp.main([*map(str, paths), "--table", str(table)]) == 1


@pytest.mark.slow
def test_a_cell_that_raises_is_named_and_the_cells_after_it_count_as_absent(
    tmp_path, capsys
):
    """The stored outputs are cleared before the run: a verdict in a cell after
    the one that raised is absent, not read back from the stored notebook."""
    nb = notebook("✓ first: yes\n", "", "✓ after: yes\n")
    nb.cells[0].source = "print('✓ first: yes')"
    nb.cells[1].source = "import sys; print('to stderr', file=sys.stderr); 1 / 0"
    nb.cells[2].source = "print('✓ after: yes')"
    path = tmp_path / "ch.ipynb"
    nbformat.write(nb, path)
    assert vp.main([str(path), "--table", str(tmp_path / "table.md")]) == 1
    said = capsys.readouterr().out
    assert (
        "FAILED ch: cell 1: ZeroDivisionError: division by zero "
        "(its stderr ends: to stderr)"
    ) in said
    table = (tmp_path / "table.md").read_text()
    assert "| ch | 2 | after | yes | absent | FAILED |" in table
