"""companion.harness.fast_start: workers forked from a preloaded Python behave as new ones."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import psutil
import pytest

from companion.harness import fast_start

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a Linux fork server")

REPORT = """
    import json, os, sys, torch
    print(json.dumps({
        "argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "path0": sys.path[0],
        "threads": torch.get_num_threads(), "pid": os.getpid(), "ppid": os.getppid(),
        "address": os.environ.get("COMPANION_FAST_START"),
    }))
"""


@pytest.fixture(scope="module", autouse=True)
def a_server_of_this_module():
    """End a server that another test file of this pytest-xdist worker started:
    it holds that moment's environment, and a worker whose variables read at
    import differ from it starts anew, which these tests would misread."""
    if fast_start._server is not None:
        process, _, alive = fast_start._server
        os.close(alive)  # the server ends when this pipe closes
        process.wait(timeout=60)
        fast_start._server = None


@pytest.fixture
def server(monkeypatch) -> str:
    """The server's address, as a notebook kernel (a ``__main__`` with no file) gets it."""
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    address = fast_start.address()
    assert address is not None
    return address


def server_pid() -> int:
    assert fast_start._server is not None
    return fast_start._server[0].pid


def write(folder: Path, name: str, code: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(code))
    return path


def run(address: str | None, script: Path, *args: str, **env: str):
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if address is not None:
        full[fast_start.ADDRESS_VARIABLE] = address
    return subprocess.run(
        [sys.executable, fast_start.CLIENT, str(script), *args],
        env=full,
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_worker_runs_the_script_as_a_new_python_would(server, tmp_path):
    script = write(tmp_path, "report.py", REPORT)
    forked = run(server, script, "a", "b")
    fresh = subprocess.run(
        [sys.executable, str(script), "a", "b"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert forked.returncode == 0 and forked.stderr == "", forked.stderr
    seen, expected = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert seen["ppid"] == server_pid()  # forked by the server, not started anew
    for key in ("argv", "name", "cwd", "path0", "threads", "address"):
        assert seen[key] == expected[key], key
    assert seen["threads"] == 1 and seen["address"] is None


@pytest.mark.parametrize(
    ("code", "returncode", "stderr"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('one sentence')", 1, "one sentence\n"),
        ("raise ValueError('bad input')", 1, "ValueError: bad input\n"),
        ("import sys; sys.exit(-1)", 255, ""),
        ("raise KeyboardInterrupt", -2, "KeyboardInterrupt\n"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
    ],
)
def test_the_client_ends_as_its_worker_did(server, tmp_path, code, returncode, stderr):
    done = run(server, write(tmp_path, "end.py", code))
    assert done.returncode == returncode
    assert done.stderr.endswith(stderr)


def started(script: Path, address: str, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A client that runs ``script``, and its worker's pid, once the worker runs."""
    client = subprocess.Popen(
        [sys.executable, fast_start.CLIENT, str(script), str(tmp_path / "pid")],
        env={**os.environ, fast_start.ADDRESS_VARIABLE: address},
        start_new_session=True,  # as torchrun starts its workers
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    return client, int((tmp_path / "pid").read_text())


SLEEPER = """
    import os, sys, time
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
"""


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie":
            return True
        time.sleep(0.05)
    return False


def test_a_signal_to_the_client_reaches_its_worker(server, tmp_path):
    client, worker = started(write(tmp_path, "sleep.py", SLEEPER), server, tmp_path)
    assert psutil.Process(worker).ppid() == server_pid()
    os.killpg(client.pid, signal.SIGTERM)  # what torchrun's agent does
    assert client.wait(timeout=30) == -signal.SIGTERM
    assert gone(worker)


def test_sigusr1_reaches_the_worker_s_handler(server, tmp_path):
    """Chapter 15 asks a hung rank for its stacks with ``kill -USR1``."""
    script = write(
        tmp_path,
        "usr1.py",
        'import signal\nsignal.signal(signal.SIGUSR1, lambda *_: print("asked"))\n'
        + textwrap.dedent(SLEEPER),
    )
    client, worker = started(script, server, tmp_path)
    os.kill(client.pid, signal.SIGUSR1)
    time.sleep(0.5)
    assert client.poll() is None and not gone(worker, within=0.1)
    os.killpg(client.pid, signal.SIGTERM)
    assert client.wait(timeout=30) == -signal.SIGTERM


def test_a_killed_client_takes_its_worker_with_it(server, tmp_path):
    client, worker = started(write(tmp_path, "sleep.py", SLEEPER), server, tmp_path)
    client.kill()  # SIGKILL: the client cannot pass it on; the server sees it go
    client.wait(timeout=30)
    assert gone(worker)


def test_workers_end_with_their_server(server, tmp_path):
    client, worker = started(write(tmp_path, "sleep.py", SLEEPER), server, tmp_path)
    fast_start._server[0].kill()
    fast_start._server[0].wait()
    assert gone(worker)
    assert client.wait(timeout=30) != 0


def test_a_variable_read_at_import_starts_a_new_python(server, tmp_path):
    script = write(tmp_path, "report.py", REPORT)
    level = "ERROR" if os.environ.get("TORCH_CPP_LOG_LEVEL") != "ERROR" else "INFO"
    done = run(server, script, TORCH_CPP_LOG_LEVEL=level)
    assert done.returncode == 0
    assert json.loads(done.stdout)["ppid"] == os.getpid()  # the client became it


def test_without_a_server_the_client_runs_python_itself(tmp_path):
    done = run(None, write(tmp_path, "report.py", REPORT))
    assert json.loads(done.stdout)["ppid"] == os.getpid()


def test_only_variables_read_at_import_must_match():
    server = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "TORCH_CPP_LOG_LEVEL": "WARNING"}
    worker = {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "1",  # read again in the worker
        "PYTHONUNBUFFERED": "1",  # the client's own flag
        "RANK": "1",
        "TORCH_CPP_LOG_LEVEL": "INFO",
        "PYTHONPATH": "/elsewhere",
    }
    assert fast_start.differs_at_import(server, worker) == [
        "PYTHONPATH",
        "TORCH_CPP_LOG_LEVEL",
    ]


def test_a_script_run_from_a_file_gets_no_server(monkeypatch):
    main = types.ModuleType("__main__")
    main.__file__ = __file__  # a reader's script: its workers start anew
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert fast_start.address() is None
