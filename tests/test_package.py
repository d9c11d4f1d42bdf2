"""The companion package: every exported name resolves, and importing it is cheap.

The course's checks start several processes at a time, each importing
``companion``; names are imported from their modules on first use, so a
process that launches a script or counts bytes does not load matplotlib.
"""

import pkgutil
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import companion

ROOT = Path(__file__).resolve().parents[1]


def test_every_exported_name_resolves_from_its_module():
    assert set(companion.__all__) == set(companion._EXPORTS)
    for name in companion.__all__:
        value = getattr(companion, name)
        assert getattr(value, "__name__", name) == name or not callable(value)


def test_an_unknown_name_is_an_attribute_error():
    try:
        companion.no_such_helper  # noqa: B018
    except AttributeError as err:
        assert "no_such_helper" in str(err)
    else:
        raise AssertionError("no error")


def test_importing_the_package_loads_no_plotting_library():
    code = "import sys, companion; from companion import launch; print('matplotlib' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.strip() == "False"


def test_no_export_shares_a_name_with_a_module_of_the_package():
    """Importing ``companion.X`` binds ``companion.X`` to the module: an export
    named like a module (``launch`` once was) would be shadowed by it."""
    modules = {m.name for m in pkgutil.iter_modules(companion.__path__)}
    assert not modules & set(companion.__all__)


def test_a_wheel_holds_every_module_of_the_package(tmp_path):
    """What ``pip install`` from git (Colab's first cell) gets, not the editable
    install that the tests run on."""
    source = tmp_path / "source"  # a copy: setuptools' build/ keeps stale files
    shutil.copytree(ROOT / "companion", source / "companion")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    here = {str(p.relative_to(ROOT)) for p in (ROOT / "companion").rglob("*.py")}
    assert here <= inside, sorted(here - inside)
