"""The book's structure: every chapter is listed, follows the skeleton, is stored
executed, and every file the prose tells readers to run exists."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PROSE = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "book").glob("*.md")),
]
PROSE += sorted((ROOT / "companion" / "scripts").glob("*.sbatch"))


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def text(cell: dict) -> str:
    return "".join(cell["source"])


def test_toc_lists_every_notebook_and_only_existing_files():
    listed = toc_files()
    for entry in listed:
        assert (ROOT / f"{entry}.md").is_file() or (
            ROOT / f"{entry}.ipynb"
        ).is_file(), entry
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.stem}" in listed, f"{nb.name} is missing from _toc.yml"


def test_readme_lists_every_chapter():
    readme = (ROOT / "README.md").read_text()
    for nb in NOTEBOOKS:
        assert f"(notebooks/{nb.name})" in readme, f"README.md does not list {nb.name}"


PATH_PATTERN = re.compile(
    r"(?:companion|notebooks|tools|tests|book)/[\w./-]+\.(?:py|ipynb|sbatch|sh|md|cfg)"
)


@pytest.mark.parametrize("doc", PROSE, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_named_in_prose_exist(doc):
    for name in PATH_PATTERN.findall(doc.read_text()):
        if "NN_" in name or "<" in name:  # placeholders in the how-to guide
            continue
        assert (ROOT / name).exists(), f"{doc.name} names {name}, which does not exist"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_follows_the_skeleton(nb):
    markdown = [text(c) for c in cells(nb) if c["cell_type"] == "markdown"]
    body = "\n".join(markdown)
    titles = [line for line in body.splitlines() if re.match(r"# \S", line)]
    assert len(titles) == 1, f"{nb.name} needs exactly one '#' title, has {titles}"
    assert re.match(r"\(\w+\)=\s*\n# ", markdown[0]), (
        f"{nb.name} must open with a label and its title"
    )
    for heading in ("## Overview", "## Summary", "## Exercises"):
        assert heading in body, f"{nb.name} has no {heading!r} section"
    exercises = re.findall(r":label: (\w+)", body)
    assert exercises, f"{nb.name} has no exercises"
    for label in exercises:
        assert re.search(
            rf"```{{solution-start}} {label}\s*\n:class: dropdown", body
        ), f"{nb.name}: exercise {label} has no hidden solution"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_every_named_figure_is_referred_to_in_the_text(nb):
    """A figure with a name (its cell's ``mystnb.figure.name``) is referred to with
    ``{numref}`` where the text draws its lesson; one nobody refers to is left
    for the reader to interpret alone."""
    names = [
        c["metadata"]["mystnb"]["figure"]["name"]
        for c in cells(nb)
        if "name" in c["metadata"].get("mystnb", {}).get("figure", {})
    ]
    prose = "\n".join(text(c) for c in cells(nb) if c["cell_type"] == "markdown")
    unreferenced = [n for n in names if f"{{numref}}`{n}`" not in prose]
    assert not unreferenced, f"{nb.name}: no {{numref}} refers to {unreferenced}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_every_stored_image_has_a_caption_and_alt_text(nb):
    """A plot is a figure: its cell gives ``mystnb.figure.caption`` and
    ``mystnb.image.alt`` (the browser check finds the same in the built page,
    minutes later)."""
    missing = []
    for i, cell in enumerate(cells(nb)):
        images = [
            kind
            for output in cell.get("outputs", [])
            for kind in output.get("data", {})
            if kind.startswith("image/")
        ]
        mystnb = cell["metadata"].get("mystnb", {})
        caption = (mystnb.get("figure", {}).get("caption") or "").strip()
        alt = (mystnb.get("image", {}).get("alt") or "").strip()
        if images and not (caption and alt and alt != caption):
            missing.append(i)
    assert not missing, (
        f"{nb.name}: cells {missing} store a plot without a caption and a distinct alt"
    )


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_executed_without_errors(nb):
    data = json.loads(nb.read_text())
    assert data["metadata"]["kernelspec"]["name"] == "python3"
    for cell in data["cells"]:
        if cell["cell_type"] != "code" or not text(cell).strip():
            continue
        assert cell["execution_count"] is not None, (
            f"{nb.name} has a cell never executed"
        )
        if "raises-exception" in cell["metadata"].get("tags", []):
            continue
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        assert not errors, f"{nb.name} stores an error: {errors[0]['ename']}"


def test_buttons_follow_the_repository_address():
    """No address: no repository, Binder or Colab button; an address: all three."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        from repository_buttons import enable_buttons
    finally:
        sys.path.pop(0)
    unset = SimpleNamespace(
        html_theme_options={"repository_url": "", "use_download_button": True}
    )
    enable_buttons(None, unset)
    assert unset.html_theme_options == {
        "repository_url": "",
        "use_download_button": True,
        "use_repository_button": False,
        "launch_buttons": {},
    }
    fork = SimpleNamespace(
        html_theme_options={"repository_url": "https://github.com/you/course"}
    )
    enable_buttons(None, fork)
    assert fork.html_theme_options["use_repository_button"] is True
    assert (
        fork.html_theme_options["launch_buttons"]["colab_url"]
        == "https://colab.research.google.com"
    )
    assert (
        fork.html_theme_options["launch_buttons"]["binderhub_url"]
        == "https://mybinder.org"
    )


def test_book_settings_keep_buttons_off_without_an_address():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert (
        "launch_buttons" not in config and "use_repository_button" not in config["html"]
    )
    assert "repository_buttons" in config["sphinx"]["local_extensions"]


def test_notebook_code_has_no_unused_names_and_fits_the_column():
    """`ruff check --select F,E501 notebooks`: no unused imports or undefined names
    (pyflakes), and no code line over 88 characters (it would scroll sideways in the
    book's column)."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    done = subprocess.run(
        [ruff, "check", "--select", "F,E501", "notebooks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def load_colab_tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import colab_cell
    finally:
        sys.path.pop(0)
    return colab_cell


def test_every_chapter_starts_with_the_current_colab_cell():
    """`python tools/colab_cell.py --check`: each notebook's first code cell is the
    one that _config.yml's repository.url gives (re-run the tool after changing it)."""
    done = subprocess.run(
        [sys.executable, "tools/colab_cell.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def run_cell_in(source: str, modules: dict, calls: list | None = None) -> list:
    """Run a cell's code as IPython would, with ``modules`` importable; return the
    line magics it called (also in ``calls``, when the cell raises)."""
    from IPython.core.inputtransformer2 import TransformerManager

    calls = [] if calls is None else calls
    shell = SimpleNamespace(
        run_line_magic=lambda name, line: calls.append((name, line))
    )
    code = TransformerManager().transform_cell(source)
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        exec(code, {"get_ipython": lambda: shell})
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name)
            else:
                sys.modules[name] = module
    return calls


@pytest.mark.parametrize("needs_d2l", [False, True])
def test_the_colab_cell_installs_from_the_repository_in_colab_only(needs_d2l):
    tool = load_colab_tool()
    source = tool.colab_cell_source(
        "https://github.com/someone/course", "main", needs_d2l=needs_d2l
    )
    colab = {"google.colab": SimpleNamespace(), "google": SimpleNamespace()}
    (magic,) = run_cell_in(source, colab)  # with this machine's torch, new enough
    assert magic[0] == "pip"
    assert magic[1].startswith("install --quiet --no-deps ")
    assert '"companion @ git+https://github.com/someone/course@main"' in magic[1]
    assert ("d2l==1.0.3" in magic[1].split()) == needs_d2l
    assert run_cell_in(source, {}) == []  # anywhere else: nothing


def test_in_colab_an_old_torch_is_replaced_first():
    from torch.torch_version import TorchVersion

    tool = load_colab_tool()
    source = tool.colab_cell_source("https://github.com/a/b", "main", needs_d2l=False)
    old_torch = SimpleNamespace(__version__=TorchVersion("2.9.0"))
    colab = {
        "google.colab": SimpleNamespace(),
        "google": SimpleNamespace(),
        "torch": old_torch,
    }
    calls = []
    with pytest.raises(SystemExit, match="restart the session"):
        run_cell_in(source, colab, calls)
    assert calls == [("pip", 'install --quiet "torch>=2.10" torchvision')]


def test_without_an_address_the_colab_cell_stops_in_colab_with_one_sentence():
    tool = load_colab_tool()
    source = tool.colab_cell_source("", "main", needs_d2l=False)
    colab = {"google.colab": SimpleNamespace(), "google": SimpleNamespace()}
    with pytest.raises(SystemExit, match=r"^Set repository.url in _config.yml"):
        run_cell_in(source, colab)
    assert run_cell_in(source, {}) == []


def test_binder_post_build_repeats_the_makefile_set_up():
    """Binder installs requirements.txt, then postBuild: the Makefile's other steps."""
    steps = [
        line
        for line in (ROOT / "postBuild").read_text().splitlines()
        if line.startswith("pip ")
    ]
    makefile = (ROOT / "Makefile").read_text()
    assert len(steps) == 2
    for step in steps:  # run by the venv's pip, or retried by tools/pip_install.sh
        args = step.removeprefix("pip install --quiet ")
        assert (
            f"$(BIN)/{step}\n" in makefile
            or f"bash tools/pip_install.sh $(VENV) {args}\n" in makefile
        ), step


def test_every_bibliography_entry_parses():
    """A merge that drops an entry's closing brace breaks the book build."""
    from pybtex.database import parse_file

    bib = ROOT / "book" / "references.bib"
    starts = re.findall(r"^@\w+\{([^,]+),", bib.read_text(), re.M)
    assert sorted(parse_file(str(bib)).entries) == sorted(starts)
