"""companion.harness.launch: results back from real processes; time-outs and interrupts leave nothing behind.

The two-process runs happen inside a real Jupyter kernel, as in a notebook.
"""

import ast
import multiprocessing
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

from companion.diagnosis import run_torchrun
from companion.harness.devices import cpu_count
from companion.harness.launch import (
    LaunchError,
    LaunchTimeout,
    free_port,
    gpus_for,
    launch,
    script_path,
)

HANG = str(Path(__file__).parent / "programs" / "hang.py")
ECHO = str(Path(__file__).parent / "programs" / "echo_env.py")


def recorded_pids(pid_dir: Path) -> set[int]:
    """The pids the hang script's processes wrote, and their parents: the launcher,
    or a ``fast_start`` server that forked them and stays for the next launch."""
    pids = set()
    for f in pid_dir.iterdir():
        pids.add(int(f.name))
        parent = int(f.read_text())
        if not is_fast_start_server(parent):
            pids.add(parent)
    return pids


def is_fast_start_server(pid: int) -> bool:
    try:
        return "--serve" in psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return False


def left_running(pid_dir: Path) -> set[int]:
    """The recorded processes still running, and any process whose command line
    names ``pid_dir``: a launcher, or a ``fast_start`` client in a worker's place."""
    named = set()
    for proc in psutil.process_iter(["cmdline"]):
        if str(pid_dir) in " ".join(proc.info["cmdline"] or ()):
            named.add(proc.pid)
    return alive(recorded_pids(pid_dir) | named)


def wait_for_files(pid_dir: Path, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(list(pid_dir.iterdir())) < count:
        assert time.monotonic() < deadline, "the hang script never started"
        time.sleep(0.2)


def alive(pids: set[int]) -> set[int]:
    return {
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    }


@pytest.fixture
def no_main_script(monkeypatch):
    """What a notebook kernel looks like to ``launch``: a ``__main__`` with no file."""
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))


@pytest.fixture
def main_script(monkeypatch):
    """What a reader's script looks like to ``launch``: a ``__main__`` file."""
    main = types.ModuleType("__main__")
    main.__file__ = __file__
    monkeypatch.setitem(sys.modules, "__main__", main)


TORCHRUN_HELP = [sys.executable, "-m", "torch.distributed.run", "--help"]


def started_with(cmd: list[str]) -> type:
    """The kind of process ``start_launcher`` starts for ``cmd`` (run to its end)."""
    launching = sys.modules["companion.harness.launch"]  # the module, not the function
    proc = launching.start_launcher(cmd, {})
    assert "usage:" in proc.stdout.read() and proc.wait() == 0
    return type(proc)


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver path is Linux's")
def test_from_a_notebook_torchrun_starts_from_the_forkserver(no_main_script, capsys):
    assert started_with(TORCHRUN_HELP).__name__ == "_ForkedTorchrun"
    out = launch(ECHO, ["a"], nproc=2, timeout=120, env={"COURSE_TEST_VALUE": "42"})
    assert out["argv"] == ["a"] and out["env"]["COURSE_TEST_VALUE"] == "42"
    assert out["env"]["OMP_NUM_THREADS"] == str(max(1, cpu_count() // 2))
    assert capsys.readouterr().out.count("echo_env: 1 extra argument(s)") == 2


@pytest.mark.slow  # the same Popen path as from a script, below
def test_on_macos_torchrun_starts_anew(no_main_script, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert started_with(TORCHRUN_HELP) is subprocess.Popen


def test_from_a_script_torchrun_starts_anew(main_script):
    assert started_with(TORCHRUN_HELP) is subprocess.Popen


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver path is Linux's")
def test_another_python_s_torchrun_starts_anew(no_main_script, tmp_path):
    other = tmp_path / "python"  # another interpreter: a stub that says it ran
    other.write_text('#!/bin/sh\necho "the other python: $*"\n')
    other.chmod(0o755)
    launching = sys.modules["companion.harness.launch"]
    proc = launching.start_launcher([str(other), *TORCHRUN_HELP[1:]], {})
    assert proc.stdout.read() == "the other python: -m torch.distributed.run --help\n"
    assert proc.wait() == 0 and type(proc) is subprocess.Popen


@pytest.mark.slow  # the forked launcher's time-out also runs in the test below
@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver path is Linux's")
def test_run_torchrun_from_the_forkserver_stops_a_hang(no_main_script, tmp_path):
    run = run_torchrun(HANG, ["--pid-dir", str(tmp_path)], timeout=8)
    assert run.timed_out and run.returncodes[0] != 0
    assert "rank 1 waiting" in run.text  # what was printed before the time-out
    assert len(list(tmp_path.iterdir())) == 2  # two workers
    assert not left_running(tmp_path)


@pytest.mark.parametrize(
    "caller",
    ["no_main_script", pytest.param("main_script", marks=pytest.mark.slow)],
)
def test_a_failure_and_a_time_out_read_the_same_from_either_start(
    caller, request, tmp_path, capsys
):
    request.getfixturevalue(caller)
    with pytest.raises(LaunchError, match="hang.py failed with exit code 1"):
        launch(HANG, ["--pid-dir", str(tmp_path), "--fail"], nproc=2, timeout=60)
    assert "ChildFailedError" in capsys.readouterr().out  # torchrun's own report
    with pytest.raises(LaunchTimeout, match="hang.py did not finish within 10 s"):
        launch(HANG, ["--pid-dir", str(tmp_path)], nproc=2, timeout=10)
    assert len(list(tmp_path.iterdir())) == 2  # two workers
    assert not left_running(tmp_path)


def test_a_launch_leaves_the_start_method_unset(no_main_script):
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(None, force=True)  # as in a fresh kernel
    try:
        launch(ECHO, nproc=2, timeout=120)
        assert multiprocessing.get_start_method(allow_none=True) is None
    finally:
        multiprocessing.set_start_method(before, force=True)


def test_plain_python_runs_one_process():
    assert launch("hello_distributed.py", nproc=None, timeout=60)["world_size"] == 1


def test_failing_script_gives_one_sentence(tmp_path):
    with pytest.raises(
        LaunchError, match="exit code 3; its last line: hang.py: something went wrong"
    ):
        launch(HANG, ["--pid-dir", str(tmp_path), "--fail"], nproc=None, timeout=60)


def test_results_env_and_threads_reach_the_script(capsys):
    out = launch(
        ECHO, ["a", "b"], nproc=None, timeout=60, env={"COURSE_TEST_VALUE": "42"}
    )
    assert out["argv"] == [
        "a",
        "b",
    ]  # --results was appended after the script's own arguments
    assert (
        out["env"]["COURSE_TEST_VALUE"] == "42"
        and out["env"]["PYTHONUNBUFFERED"] == "1"
    )
    assert int(out["env"]["OMP_NUM_THREADS"]) >= 1
    out = launch(
        ECHO, nproc=None, timeout=60, env={"OMP_NUM_THREADS": "7"}
    )  # env= wins over the default
    assert out["env"]["OMP_NUM_THREADS"] == "7"
    assert (
        "echo_env: 0 extra argument(s)" in capsys.readouterr().out
    )  # the output streams through


def test_results_false_passes_no_results_file_and_returns_nothing(capsys):
    assert launch(ECHO, ["x"], nproc=None, timeout=60, results=False) == {}
    assert (
        "echo_env: 1 extra argument(s)" in capsys.readouterr().out
    )  # it ran, without --results


def test_a_script_that_writes_no_results_is_an_error():
    with pytest.raises(
        LaunchError, match="echo_env.py finished but wrote no results file."
    ):
        launch(ECHO, ["--skip-results"], nproc=None, timeout=60)


def test_a_check_that_missed_returns_its_results_only_when_allowed():
    with pytest.raises(LaunchError, match="exit code 3; its last line: echo_env: "):
        launch(ECHO, ["--miss"], nproc=None, timeout=60)
    out = launch(ECHO, ["--miss"], nproc=None, timeout=60, allow_misses=True)
    assert out["argv"] == []  # the results it wrote before it exited with 3
    with pytest.raises(LaunchError, match="exit code 3"):  # no results: an error
        launch(ECHO, ["--miss", "--skip-results"], nproc=None, allow_misses=True)


@pytest.mark.parametrize("nproc", [0, -1, 1.5, True])
def test_a_bad_process_count_is_one_sentence(nproc):
    with pytest.raises(
        ValueError,
        match=f"nproc must be a whole number of processes, at least 1, or None "
        f"for plain python; not {nproc!r}.",
    ):
        launch("hello_distributed.py", nproc=nproc, timeout=60)


def test_unknown_script_is_one_sentence():
    with pytest.raises(
        FileNotFoundError,
        match="There is no script 'nope.py'.*available: .*hello_distributed.py",
    ):
        script_path("nope.py")


@pytest.fixture
def kernel():
    manager, client = start_new_kernel(kernel_name="python3")
    yield manager, client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def run_in_kernel(client, code: str, timeout: float = 180) -> str:
    """Execute ``code`` in the kernel; return what it printed (stdout and errors)."""
    msg_id = client.execute(textwrap.dedent(code))
    out = []
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            out.append(f"{content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


@pytest.mark.slow  # chapters 09 and 11 launch their scripts from a kernel in make test
def test_from_a_notebook_kernel(kernel, tmp_path):
    _, client = kernel
    out = run_in_kernel(
        client,
        """
        from companion import launch, setup_notebook
        setup_notebook()
        print("RESULT", launch("hello_distributed.py", nproc=2, timeout=120))
    """,
    )
    assert "2 process(es) on cpu: sum = 3" in out  # streamed into the cell
    result = next(line for line in out.splitlines() if line.startswith("RESULT "))
    assert ast.literal_eval(result.removeprefix("RESULT ")) == {
        "device": "cpu",
        "backend": "gloo",
        "world_size": 2,
        "threads": 1,
        "sum": 3.0,
    }

    start = time.monotonic()
    out = run_in_kernel(
        client,
        f"launch({HANG!r}, ['--pid-dir', {str(tmp_path)!r}], nproc=2, timeout=15)",
    )
    assert time.monotonic() - start < 40
    assert "LaunchTimeout: hang.py did not finish within 15 s" in out
    assert "Traceback" not in out  # one sentence, thanks to setup_notebook()
    assert len(list(tmp_path.iterdir())) == 2  # two workers
    assert not left_running(tmp_path)


def test_interrupting_the_kernel_leaves_no_process(kernel, tmp_path):
    manager, client = kernel
    msg_id = client.execute(
        f"from companion import launch\nlaunch({HANG!r}, ['--pid-dir', "
        f"{str(tmp_path)!r}], nproc=2, timeout=300)"
    )
    wait_for_files(tmp_path, 2)
    manager.interrupt_kernel()  # what the notebook's stop button does
    reply = client.get_shell_msg(timeout=60)
    while (
        reply["parent_header"].get("msg_id") != msg_id
    ):  # skip replies to earlier requests
        reply = client.get_shell_msg(timeout=60)
    assert (
        reply["content"]["status"] == "error"
        and reply["content"]["ename"] == "KeyboardInterrupt"
    )
    assert not left_running(tmp_path)


def test_gloos_peer_count_lines_are_left_out(tmp_path, capsys):
    """torch 2.10's gloo prints "[Gloo] Rank N is connected to M peer ranks" on stdout."""
    script = tmp_path / "chatty.py"
    gloo = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
    gloo += "connected peer ranks is : 1"
    script.write_text(
        f'print("{gloo}")\n'
        f'print("the script\'s {gloo}own line")\n'  # two processes' output interleaved
        'print("another line")\n'
    )
    launch(script, nproc=None, timeout=60, results=False)
    assert capsys.readouterr().out == "the script's own line\nanother line\n"


def test_gpus_false_hides_the_gpus_and_checks_resolve_by_name():
    assert (
        launch(ECHO, nproc=None, timeout=60, gpus=False)["env"]["CUDA_VISIBLE_DEVICES"]
        == ""
    )
    assert script_path("checks/ddp_scaling.py").parent.name == "checks"
    if not gpus_for(2):  # this machine has fewer than 2 GPUs
        with pytest.raises(ValueError, match="gpus=True needs a GPU for each of the 2"):
            launch(ECHO, nproc=2, gpus=True)


def test_a_free_port_can_be_bound_and_listened_on():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
