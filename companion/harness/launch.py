"""Run a standalone script in its own processes and get its results back.

Notebooks cannot ``mp.spawn`` a function defined in a cell (the workers cannot
import ``__main__``), so multi-process chapters launch a script instead: one
from ``companion/scripts/`` (what a reader copies to a cluster) or a check
from ``companion/checks/`` (the course's measurements around a script's own
functions), under ``python -m torch.distributed.run`` (torchrun) for several
processes, or under plain ``python``. The output streams into the notebook as
it runs; a time-out or an interrupt stops the whole process group (workers
forked by ``fast_start`` go with their clients, which are in it), so nothing
is left running; the JSON results file comes back as a dict.

Start-up: a new ``python -m torch.distributed.run`` spends about 2 s importing
torch before it starts a worker, and more than half a second tearing its
modules down at the end. From a notebook or a REPL on Linux, ``launch``
therefore runs torchrun's own ``main`` in a process forked from a
``multiprocessing`` forkserver that has imported it: the same launcher, which
starts in milliseconds from the second launch on (the first starts the server).
The server, an idle process, stays until the kernel ends. From a script, on
macOS or on Windows, ``launch`` starts ``python -m torch.distributed.run``
(see ``start_launcher``).

Each worker would then spend 1 to 2.5 s importing torch (and Dynamo, which
DDP and DTensor load); four of them on two cores wait about 5 s. From a
notebook or a REPL on Linux, ``launch`` therefore has torchrun (or plain
``python``) start ``companion/harness/fast_start.py SCRIPT ARGS`` instead of
``SCRIPT ARGS``: a worker forked from a server that has imported torch takes
the place of a new Python, in a fraction of a second (see ``fast_start``).

Devices: the scripts give each process a GPU of its own when the node has one
per process, and refuse a node with too few. ``launch`` therefore runs on the
GPUs when there are at least as many as processes, and otherwise hides them
(``CUDA_VISIBLE_DEVICES=""``), so that the run uses the CPU; a chapter that
compares runs with different process counts passes the same ``gpus=`` to each
(``gpus_for(1, 2, 4)``), so that they all ran on the same kind of device.
Used in chapters 08, 09 and 11 to 16.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from companion.harness import fast_start
from companion.harness.devices import cpu_count, num_gpus

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "free_port",
    "gpus_for",
    "launch",
    "script_path",
    "start_launcher",
    "stop_process_group",
]

PACKAGE = Path(__file__).resolve().parents[1]  # companion/
# A diagnostic that gloo prints on stdout in some torch versions (2.10 among
# them), from every process at once: it can land in the middle of another line.
GLOO_PEERS = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+\n?"
)
SCRIPTS = PACKAGE / "scripts"
CHECKS = PACKAGE / "checks"
SIBLINGS = ("distributed_setup", "gpt_model")  # modules the scripts import


def script_paths() -> list[Path]:
    """Every script of ``companion/scripts`` (its sibling modules left out)."""
    return sorted(
        p for p in SCRIPTS.glob("*.py") if p.stem not in {"__init__", *SIBLINGS}
    )


class LaunchError(RuntimeError):
    """A launched script failed, or wrote no results."""


class LaunchTimeout(LaunchError):
    """A launched script ran past its time-out and was stopped."""


def script_path(name: str) -> Path:
    """Return the path of ``companion/scripts/<name>`` or ``companion/<name>``.

    ``"ddp_train.py"`` names a script, ``"checks/fsdp_memory.py"`` a check.
    """
    path = PACKAGE / name if name.startswith("checks/") else SCRIPTS / name
    if not path.is_file():
        available = ", ".join(
            sorted(
                [p.name for p in script_paths()]
                + [
                    f"checks/{p.name}"
                    for p in CHECKS.glob("*.py")
                    if not p.name.startswith("_")
                ]
            )
        )
        raise FileNotFoundError(
            f"There is no script {name!r} in {path.parent}; available: {available}."
        )
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a group's ``MASTER_PORT``.

    Another program can take it before the group binds it; the launches that
    use it are short, and a taken port ends in the scripts' one sentence.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpus_for(*nprocs: int | None) -> bool:
    """Whether runs with each of these process counts can all have a GPU per process.

    ``None`` counts as one process (plain python). Pass the answer as
    ``launch(..., gpus=...)`` to every run a chapter compares.
    """
    return num_gpus() >= max(n or 1 for n in nprocs)


class _ForkedTorchrun:
    """torchrun's ``main`` in a process forked from a preloaded forkserver.

    It offers what ``launch`` and ``stop_process_group`` use of a ``Popen``:
    ``pid``, ``stdout`` (the launcher's and its workers' output, one pipe),
    ``poll``, ``wait`` and ``kill``. Raises ``OSError`` where no forkserver
    can start (no Unix sockets, say).
    """

    def __init__(self, argv: list[str], env: Mapping[str, str]) -> None:
        pinned = multiprocessing.get_start_method(allow_none=True)
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch.distributed.run"])  # once per server
        read, write = os.pipe()
        pipe = multiprocessing.connection.Connection(write, readable=False)
        self._process = context.Process(
            target=_run_torchrun, args=(argv, dict(env), pipe)
        )
        try:
            self._process.start()
        except BaseException:
            os.close(read)
            raise
        finally:
            pipe.close()  # the child has its own copy: EOF once it and its workers end
            if pinned is None:  # starting a Process pins the default start method
                multiprocessing.set_start_method(None, force=True)  # unpin it
        self.pid = self._process.pid
        self.stdout = os.fdopen(read, encoding="utf-8", errors="replace")
        self._lock = threading.Lock()  # a time-out's thread may wait beside launch's

    def poll(self) -> int | None:
        with self._lock:
            return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            self._process.join(timeout)
            code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired("torchrun", timeout or 0.0)
        return code

    def kill(self) -> None:
        self._process.kill()


def _run_torchrun(
    argv: list[str], env: dict[str, str], pipe: multiprocessing.connection.Connection
) -> None:
    """In the forked child: what ``python -m torch.distributed.run ARGV`` does.

    One difference: torch's modules were imported in the forkserver, under the
    environment of the first launch, so variables read at import time
    (``LOGLEVEL``, ``TORCH_CPP_LOG_LEVEL``) passed in ``env`` reach the
    workers but not this launcher.
    """
    os.setsid()  # a process group of its own, as Popen(start_new_session=True)
    for fd in (1, 2):  # the launcher's and the workers' output into the pipe
        os.dup2(pipe.fileno(), fd)
    pipe.close()
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        from torch.distributed.run import main

        main(argv)
    except SystemExit as exit_:
        code = fast_start.exit_code(exit_)
    except Exception:  # noqa: BLE001 - reported, as python reports an uncaught one
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no module teardown: the launcher's work is done


def start_launcher(
    cmd: list[str], env: Mapping[str, str]
) -> subprocess.Popen[str] | _ForkedTorchrun:
    """Start ``cmd``, its output in ``.stdout``: ``[sys.executable, "-m",
    "torch.distributed.run", ...]`` from the forkserver where that is safe,
    anything else (another interpreter's torchrun too) as a new process.

    The forked launcher offers only what ``launch`` and ``stop_process_group``
    use of a ``Popen``: ``pid``, ``stdout``, ``poll``, ``wait`` and ``kill``.

    Safe means Linux (Windows has no forkserver; on macOS, forking a process
    that has imported torch is not safe), and a caller with no main script: a
    forkserver's child imports the caller's ``__main__`` file again, which a
    script without an ``if __name__ == "__main__":`` guard does not survive.
    A notebook kernel, a REPL and pytest-xdist's workers have none.

    The forkserver is the process's one server: if something else started it
    first (a ``DataLoader`` with ``multiprocessing_context="forkserver"``, or
    Python 3.14's default start method), it has not imported torchrun, and
    each launch imports it again, as a new process would.
    """
    torchrun = cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if torchrun and sys.platform == "linux" and main_file is None:
        try:
            return _ForkedTorchrun(cmd[3:], env)
        except OSError:  # no forkserver here: a new process still works
            pass
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _signal_group(proc: subprocess.Popen[str] | _ForkedTorchrun, sig: int) -> None:
    """Send ``sig`` to the process group that ``proc`` leads, else to ``proc``.

    A forked launcher becomes its group's leader a moment after it starts; a
    process that has exited and been waited for is left alone (its pid may
    be another's by now).
    """
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:  # it ended in between
                pass


def stop_process_group(
    proc: subprocess.Popen[str] | _ForkedTorchrun, grace: float = 5.0
) -> None:
    """Stop ``proc`` and every process it started: SIGTERM, then SIGKILL."""
    if proc.poll() is not None and os.name != "posix":
        return
    try:
        if os.name == "posix":
            _signal_group(proc, signal.SIGTERM)
        else:
            proc.terminate()
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    if os.name == "posix":  # children may outlive torchrun's exit: kill the group
        _signal_group(proc, signal.SIGKILL)
    else:
        proc.kill()
    proc.wait()


def launch(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nproc: int | None = 2,
    gpus: bool | None = None,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    results: bool = True,
    allow_misses: bool = False,
) -> dict[str, Any]:
    """Run ``script`` and return the JSON results it wrote.

    Args:
        script: a path, or the name of a file in ``companion/scripts/``.
        args: command-line arguments for the script.
        nproc: processes to start with ``torchrun --standalone``; ``None`` runs
            plain ``python script`` (one process, no launcher).
        gpus: run on the GPUs (True: there must be one per process), or on
            the CPU with the GPUs hidden (False); None: on the GPUs when there
            is one per process, else on the CPU.
        timeout: seconds before the whole process group is stopped.
        env: extra environment variables. ``OMP_NUM_THREADS`` defaults to the
            cores divided by the processes, so processes do not oversubscribe.
        results: append ``--results FILE`` to the arguments and return the
            JSON the script writes there; with False, return ``{}``.
        allow_misses: for a check of ``companion/checks/``, which writes its
            results and then exits with code 3 when a measurement missed its
            formula: return those results all the same, so that the chapter
            prints the verdicts, the missed one with ✗, instead of stopping
            at an error. A run that failed without writing results still
            raises ``LaunchError``.

    Raises:
        ValueError: ``nproc`` is not a positive whole number or None, or
            ``gpus=True`` on a machine with fewer GPUs than processes.
        LaunchTimeout: the script ran longer than ``timeout``.
        LaunchError: the script exited with an error or wrote no results.
    """
    if nproc is not None and (
        isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1
    ):
        raise ValueError(
            "nproc must be a whole number of processes, at least 1, or None for plain "
            "python; "
            f"not {nproc!r}."
        )
    path = Path(script) if Path(script).is_file() else script_path(str(script))
    workers = nproc or 1
    if gpus and not gpus_for(workers):
        raise ValueError(
            f"gpus=True needs a GPU for each of the {workers} processes; this "
            f"machine has {num_gpus()}."
        )
    use_gpus = gpus_for(workers) if gpus is None else gpus
    child_env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, cpu_count() // workers)),
        "PYTHONUNBUFFERED": "1",
        **({} if use_gpus else {"CUDA_VISIBLE_DEVICES": ""}),
        **(env or {}),
    }
    server = fast_start.address()  # workers forked from a preloaded Python
    if server is not None:
        child_env[fast_start.ADDRESS_VARIABLE] = server
    through = [] if server is None else [fast_start.CLIENT]
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        results_file = Path(tmp) / "results.json"
        argv = [*map(str, args), *(["--results", str(results_file)] if results else [])]
        if nproc is None:
            cmd = [sys.executable, *through, str(path), *argv]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                *through,
                str(path),
                *argv,
            ]
        tail: collections.deque[str] = collections.deque(maxlen=20)
        proc = start_launcher(cmd, child_env)
        timed_out = threading.Event()

        def on_timeout() -> None:
            timed_out.set()
            stop_process_group(proc)

        watchdog = threading.Timer(timeout, on_timeout)
        watchdog.start()
        try:
            assert proc.stdout is not None
            # Read in the calling thread, so that a notebook shows the lines
            # in the cell that launched the script.
            for line in proc.stdout:
                if timed_out.is_set():
                    continue  # the dying processes' complaints about SIGTERM
                line = GLOO_PEERS.sub("", line)  # torch 2.10's gloo, every process
                if not line:
                    continue
                print(line, end="", flush=True)
                tail.append(line.rstrip())
            returncode = proc.wait()
        except BaseException:  # KeyboardInterrupt included: leave nothing running
            stop_process_group(proc)
            raise
        finally:
            watchdog.cancel()
        if timed_out.is_set():
            stop_process_group(
                proc
            )  # the group may still hold children of a dead launcher
            raise LaunchTimeout(
                f"{path.name} did not finish within {timeout:g} s and was stopped, "
                "with every process it started."
            )
        if returncode != 0:
            stop_process_group(proc)
            if not (allow_misses and results and results_file.is_file()):
                last = next((t for t in reversed(tail) if t.strip()), "no output")
                raise LaunchError(
                    f"{path.name} failed with exit code {returncode}; its last "
                    f"line: {last}"
                )
        if not results:
            return {}
        if not results_file.is_file():
            raise LaunchError(f"{path.name} finished but wrote no results file.")
        return json.loads(results_file.read_text())
