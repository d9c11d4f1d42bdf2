"""The companion package: every exported name resolves, and importing it is cheap.

The course's checks start several processes at a time, each importing
``companion``; names are imported from their modules on first use, so a
process that launches a script or counts bytes does not load matplotlib.
"""

import subprocess
import sys

import companion


def test_every_exported_name_resolves_from_its_module():
    eager = {"LaunchError", "LaunchTimeout", "launch", "script_path"}
    assert set(companion.__all__) == set(companion._EXPORTS) | eager
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


def test_launch_stays_the_function_after_its_module_is_imported():
    code = (
        "import companion.harness.launch, companion; from companion import launch; "
        "print(callable(launch))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.strip() == "True"
