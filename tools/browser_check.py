"""Check the built book the way a reader sees it: every page in headless Chromium.

    python tools/browser_check.py [BUILD_DIR] [--screenshots DIR | --no-screenshots]

BUILD_DIR is the built HTML (default ``_build/html``). Every page is opened at
1400 px with the network switched off, and each of these is a problem:

- an image that did not load;
- a link to a page of the book, or to an anchor in it, that does not exist;
- an error in the browser console;
- a code or output block wider than the text column (it would scroll sideways);
- more than one output block for one stream (stdout or stderr) in a cell;
- a progress-bar remnant (a bar below 100 % left in an output);
- a figure without a caption;
- math that MathJax did not render (with the network off, so MathJax must be
  served with the book);
- a repository, Binder or Colab button whose address is not the book's
  ``repository.url`` (or any such button when the address is unset).

A screenshot of the top of each chapter at a phone width (390 px) and a desktop
width (1400 px) is saved under DIR (default ``BUILD_DIR/../screenshots``);
``make test`` skips them (``--no-screenshots``), ``make test-browser`` keeps them.

Exit codes: 0 no problem; 1 problems, listed page by page; 2 Chromium or its
driver is missing (one line says how to install them).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

ROOT = Path(__file__).resolve().parents[1]
DESKTOP, PHONE = (1400, 900), (390, 844)
INSTALL_HINT = (
    "the browser check did not run: Chromium and chromedriver are not installed "
    "(Debian: sudo apt-get install chromium chromium-driver); then run `make "
    "test-browser`"
)

# Runs in the page; returns [[rule, detail], ...].
PAGE_CHECKS = r"""
const problems = [];
const add = (rule, detail) => problems.push([rule, String(detail).slice(0, 120)]);
// Open every collapsed block first, so that hidden code is measured too.
document.querySelectorAll('details').forEach(d => { d.open = true; });
document.querySelectorAll('.toggle-hidden').forEach(e => e.classList.remove('toggle-hidden'));
for (const img of document.querySelectorAll('article img')) {
  if (!img.complete || img.naturalWidth === 0) add('missing image', img.getAttribute('src'));
}
for (const pre of document.querySelectorAll('article pre')) {
  if (pre.clientWidth > 0 && pre.scrollWidth > pre.clientWidth + 1) {
    const line = pre.textContent.split('\n').reduce((a, b) => (b.length > a.length ? b : a), '');
    add('wider than the column', `${pre.scrollWidth} px > ${pre.clientWidth} px: ${line.trim()}`);
  }
}
document.querySelectorAll('.cell_output').forEach((out, i) => {
  for (const stream of ['stream', 'stderr']) {
    const n = Array.from(out.children).filter(c => c.classList.contains('output') && c.classList.contains(stream)).length;
    if (n > 1) add('output split into blocks', `cell output ${i + 1}: ${n} ${stream === 'stream' ? 'stdout' : 'stderr'} blocks`);
  }
  const bar = out.textContent.match(/(?<![\d.])(\d{1,2})%\|[^\n]*/);
  if (bar) add('progress-bar remnant', bar[0]);
});
for (const img of document.querySelectorAll('.cell_output img')) {
  const figure = img.closest('figure');
  if (!figure || !figure.querySelector('figcaption')) add('figure without a caption', img.getAttribute('alt') || img.getAttribute('src'));
}
for (const math of document.querySelectorAll('article .math')) {
  if (!math.querySelector('mjx-container')) add('math not rendered', math.textContent);
}
const launch = document.querySelectorAll('.dropdown-launch-buttons a, a[title="Source repository"]');
const links = Array.from(document.querySelectorAll('article a[href]')).map(a => a.href);
return [problems, Array.from(launch).map(a => a.href), links];
"""
WAIT_FOR_MATHJAX = """
const done = arguments[0];
if (window.MathJax && MathJax.startup && MathJax.startup.promise) MathJax.startup.promise.then(() => done(true), () => done(false));
else done(document.querySelectorAll('.math').length === 0);
"""


def chromium_paths() -> tuple[str, str] | None:
    """The Chromium binary and its driver, or None when either is missing."""
    browser = (
        shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextmanager
def open_browser(paths: tuple[str, str], size: tuple[int, int] = DESKTOP) -> Iterator:
    """Headless Chromium with the network off and the console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={size[0]},{size[1]}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(paths[1]), options=options)
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd(
            "Network.emulateNetworkConditions",
            {
                "offline": True,
                "latency": 0,
                "downloadThroughput": -1,
                "uploadThroughput": -1,
            },
        )
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()


def ids_in(page: Path, cache: dict[Path, set[str]]) -> set[str]:
    """The element ids of a built page (the anchors a link may point to)."""
    if page not in cache:
        cache[page] = set(
            re.findall(r'\sid="([^"]+)"', page.read_text(errors="replace"))
        )
    return cache[page]


def broken_links(
    links: list[str], build: Path, cache: dict[Path, set[str]]
) -> list[tuple[str, str]]:
    """Links into the book (file:// addresses) whose page or anchor does not exist."""
    problems = []
    for href in links:
        parts = urlsplit(href)
        if parts.scheme != "file":
            continue
        target = Path(unquote(parts.path))
        if build.resolve() not in target.resolve().parents:
            continue  # outside the book: not ours to check
        if not target.is_file():
            problems.append(("broken link", href.split("/html/", 1)[-1]))
        elif parts.fragment and unquote(parts.fragment) not in ids_in(target, cache):
            problems.append(("broken anchor", href.split("/html/", 1)[-1]))
    return problems


def wrong_buttons(buttons: list[str], repository: str) -> list[tuple[str, str]]:
    """Repository and launch buttons that do not lead to ``repository``."""
    if not repository:
        return [("button with no address set", href) for href in buttons]
    path = urlsplit(repository).path.strip("/")
    return [("button to another address", href) for href in buttons if path not in href]


def check_page(
    driver, page: Path, build: Path, repository: str, cache: dict
) -> list[tuple[str, str]]:
    """Open one page and return its problems as (rule, detail) pairs."""
    driver.get_log("browser")  # forget the previous page's messages
    driver.get(page.resolve().as_uri())
    rendered = driver.execute_async_script(WAIT_FOR_MATHJAX)
    problems, buttons, links = driver.execute_script(PAGE_CHECKS)
    problems = [tuple(p) for p in problems]
    if not rendered:
        problems.append(("math not rendered", "MathJax did not start"))
    problems += broken_links(links, build, cache)
    problems += wrong_buttons(buttons, repository)
    problems += [
        ("console error", entry["message"])
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE"
    ]
    return problems


def repository_url(config: Path = ROOT / "_config.yml") -> str:
    """The book's ``repository.url`` setting ("" when unset)."""
    settings = yaml.safe_load(config.read_text()) or {}
    return (settings.get("repository") or {}).get("url") or ""


def save_screenshots(paths: tuple[str, str], pages: list[Path], folder: Path) -> None:
    """The top of each chapter at a phone and a desktop width."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in (("phone", PHONE), ("desktop", DESKTOP)):
        with open_browser(paths, size) as driver:
            for page in pages:
                driver.get(page.resolve().as_uri())
                driver.execute_async_script(WAIT_FOR_MATHJAX)
                driver.save_screenshot(str(folder / f"{page.stem}-{name}.png"))


def check_book(
    build: Path, repository: str, paths: tuple[str, str]
) -> dict[str, list[tuple[str, str]]]:
    """Every page's problems, by the page's path inside ``build``."""
    pages = sorted(
        p
        for p in build.rglob("*.html")
        if "_static" not in p.parts and "_sources" not in p.parts
    )
    cache: dict[Path, set[str]] = {}
    with open_browser(paths) as driver:
        return {
            str(p.relative_to(build)): check_page(driver, p, build, repository, cache)
            for p in pages
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", nargs="?", type=Path, default=ROOT / "_build" / "html")
    parser.add_argument(
        "--screenshots",
        type=Path,
        help="where to save screenshots (default: next to BUILD)",
    )
    parser.add_argument(
        "--no-screenshots",
        action="store_true",
        help="check the pages only (make test: the screenshots are for people)",
    )
    args = parser.parse_args(argv)
    if not (args.build / "index.html").is_file():
        print(
            f"browser check: no built book in {args.build}; run `make book` first",
            file=sys.stderr,
        )
        return 2
    paths = chromium_paths()
    if paths is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    report = check_book(args.build, repository_url(), paths)
    shots = None
    if not args.no_screenshots:
        shots = args.screenshots or args.build.parent / "screenshots"
        chapters = sorted((args.build / "notebooks").glob("*.html"))
        save_screenshots(paths, chapters, shots)
    bad = {page: problems for page, problems in report.items() if problems}
    for page, problems in bad.items():
        print(f"{page}: {len(problems)} problem(s)")
        for rule, detail in problems:
            print(f"  {rule}: {detail}")
    total = sum(len(p) for p in bad.values())
    print(
        f"browser check: {len(report)} pages, {total} problem(s); "
        + (f"screenshots in {shots}" if shots else "no screenshots")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
