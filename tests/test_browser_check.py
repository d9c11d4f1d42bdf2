"""The browser check catches each rule broken on a page made for it, and passes a good page.

These tests open real pages in headless Chromium. Where Chromium is not
installed they are skipped with the one line that says how to get it; CI
(which sets CI=1) installs it and never skips them.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import browser_check as bc  # noqa: E402

PATHS = bc.chromium_paths()
needs_chromium = pytest.mark.skipif(
    PATHS is None and not os.environ.get("CI"), reason=bc.INSTALL_HINT
)

PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
GOOD = f"""
<h1 id="top">A good page</h1>
<p><a href="index.html#top">home</a> and <a href="https://pytorch.org">outside</a></p>
<pre>print("short line")</pre>
<div class="cell_output"><div class="output stream"><pre>epoch 1: 100%|#####| 23/23
done</pre></div>
<figure><img src="{PNG}" alt="one pixel"><figcaption>Fig. 1.1 One pixel.</figcaption></figure></div>
"""
BROKEN = {  # rule: the page's body
    "missing image": '<img src="nowhere.png" alt="gone">',
    "broken link": '<a href="missing.html">a chapter that is not there</a>',
    "broken anchor": '<a href="index.html#no-such-section">a section that is not there</a>',
    "console error": '<script>console.error("something failed")</script>',
    "wider than the column": "<pre>" + "x = 1  " * 60 + "</pre>",
    "output split into blocks": (
        '<div class="cell_output"><div class="output stream"><pre>line 1</pre></div>'
        '<div class="output stream"><pre>line 2</pre></div></div>'
    ),
    "progress-bar remnant": (
        '<div class="cell_output"><div class="output stream"><pre>'
        "epoch 1:  30%|###       | 7/23\nepoch 1: 100%|##########| "
        "23/23</pre></div></div>"
    ),
    "figure without a caption": f'<div class="cell_output"><img src="{PNG}" alt="a plot"></div>',
    "math not rendered": r'<p><span class="math notranslate nohighlight">\(x^2\)</span></p>',
    "button with no address set": (
        '<div class="dropdown-launch-buttons"><a href="https://mybinder.org/v2/gh/'
        'someone/course/main?urlpath=lab">Binder</a></div>'
    ),
}


def page(body: str, head: str = "") -> str:
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><style>article '
        "{ width: 600px } "
        "pre "
        f"{{ overflow: auto }}</style>{head}</head><body><article>{body}</article></body></html>"
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, list[tuple[str, str]]]:
    build = tmp_path_factory.mktemp("html")
    (build / "index.html").write_text(page(GOOD))
    for n, body in enumerate(BROKEN.values()):
        (build / f"broken{n}.html").write_text(page(body))
    return bc.check_book(build, repository="", paths=PATHS)


@needs_chromium
def test_a_good_page_has_no_problem(report):
    assert report["index.html"] == []


@needs_chromium
@pytest.mark.parametrize("n, rule", list(enumerate(BROKEN)))
def test_each_broken_rule_is_reported(report, n, rule):
    also = (
        {"console error"} if rule == "missing image" else set()
    )  # the browser logs the failed load too
    assert {found for found, _ in report[f"broken{n}.html"]} == {rule} | also


@needs_chromium
def test_math_renders_offline_with_the_mathjax_served_by_the_book(tmp_path):
    import importlib.util

    package = Path(importlib.util.find_spec("sphinx-mathjax-offline").origin).parent
    shutil.copytree(package / "static" / "mathjax", tmp_path / "_static" / "mathjax")
    math = r'<p><span class="math notranslate nohighlight">\(x^2 + \frac{1}{2}\)</span></p>'
    (tmp_path / "index.html").write_text(
        page(math, head='<script defer src="_static/mathjax/tex-chtml.js"></script>')
    )
    assert bc.check_book(tmp_path, repository="", paths=PATHS) == {"index.html": []}


def test_buttons_must_lead_to_the_books_own_repository():
    binder = "https://mybinder.org/v2/gh/you/course/main?urlpath=lab/tree/notebooks/01_tensors.ipynb"
    assert bc.wrong_buttons([binder], "https://github.com/you/course") == []
    assert bc.wrong_buttons([binder], "https://github.com/someone-else/course") == [
        ("button to another address", binder)
    ]
    assert bc.wrong_buttons([binder], "") == [("button with no address set", binder)]


def test_no_chromium_is_one_line_and_exit_code_2(monkeypatch, tmp_path, capsys):
    (tmp_path / "index.html").write_text(page(GOOD))
    monkeypatch.setattr(bc, "chromium_paths", lambda: None)
    assert bc.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == bc.INSTALL_HINT


def test_no_built_book_is_one_line(tmp_path, capsys):
    assert bc.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@needs_chromium
def test_screenshots_are_saved_unless_switched_off(tmp_path, capsys):
    build = tmp_path / "html"
    (build / "notebooks").mkdir(parents=True)
    (build / "index.html").write_text(page(GOOD))
    (build / "notebooks" / "01_x.html").write_text(page("<p>A chapter.</p>"))
    assert bc.main([str(build), "--no-screenshots"]) == 0
    assert capsys.readouterr().out.endswith("0 problem(s); no screenshots\n")
    assert not (tmp_path / "screenshots").exists()
    assert bc.main([str(build)]) == 0
    assert sorted(p.name for p in (tmp_path / "screenshots").iterdir()) == [
        "01_x-desktop.png",
        "01_x-phone.png",
    ]
