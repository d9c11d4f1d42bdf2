"""tools/execute_notebooks.py stores stream outputs the way nbval compares them."""

import re
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from execute_notebooks import tidy_streams  # noqa: E402


def test_progress_bar_states_and_split_streams_are_tidied():
    bar = [
        new_output("stream", name="stdout", text=t)
        for t in (
            "\repoch 1/2:   0%|          | 0/23",
            "\repoch 1/2: 100%|##########| 23/23",
            "\nepoch 1/2: train loss ~1.79\n",
        )
    ]
    figure = new_output("display_data", data={"text/plain": "<Figure>"})
    warning = new_output("stream", name="stderr", text="a warning\n")
    nb = new_notebook(
        cells=[
            new_markdown_cell("text"),
            new_code_cell(outputs=[*bar, warning, figure]),
        ]
    )
    tidy_streams(nb)
    outputs = nb.cells[1].outputs
    assert [o.output_type for o in outputs] == ["stream", "stream", "display_data"]
    assert (
        outputs[0].text
        == "epoch 1/2: 100%|##########| 23/23\nepoch 1/2: train loss ~1.79\n"
    )
    assert outputs[1].text == "a warning\n"
    assert nb.cells[0].source == "text"


def test_every_stored_notebook_is_tidy():
    """What `make execute` stores: one block per stream, no overwritten progress-bar states."""
    for path in sorted(
        (Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")
    ):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            names = [o.name for o in cell.outputs if o.output_type == "stream"]
            assert len(names) == len(set(names)), (
                f"{path.name} cell {i}: a stream split in {len(names)} blocks"
            )
            assert not any(
                re.search(r"\r(?!\n)", o.text)
                for o in cell.outputs
                if o.output_type == "stream"
            ), f"{path.name} cell {i}: text overwritten by a carriage return is stored"
