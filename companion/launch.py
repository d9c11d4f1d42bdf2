"""Run a standalone script in its own processes and get its results back.

Notebooks cannot ``mp.spawn`` a function defined in a cell (the workers cannot
import ``__main__``), so multi-process chapters launch a script instead: one
from ``companion/scripts/`` (what a reader copies to a cluster) or a check
from ``companion/checks/`` (the course's measurements around a script's own
functions), under ``python -m torch.distributed.run`` (torchrun) for several
processes, or under plain ``python``. The output streams into the notebook as
it runs; a time-out or an interrupt stops the whole process group, so nothing
is left running; the JSON results file comes back as a dict.

Start-up: a new ``python -m torch.distributed.run`` spends about 2 s importing
torch before it starts a worker, and more than half a second tearing its
modules down at the end. On Linux, ``launch`` therefore runs torchrun's own
``main`` in a process forked from a ``multiprocessing`` forkserver that has
imported it once: the same launcher, started in milliseconds, from a notebook
or a REPL (see ``_start``). Elsewhere, and from a script, it starts
``python -m torch.distributed.run``.

Devices: the scripts give each process a GPU of its own when the node has one
per process, and refuse a node with too few. ``launch`` therefore runs on the
GPUs when there are at least as many as processes, and otherwise hides them
(``CUDA_VISIBLE_DEVICES=""``), so that the run uses the CPU; a chapter that
compares runs with different process counts passes the same ``gpus=`` to each
(``gpus_for(1, 2, 4)``), so that they all ran on the same kind of device.
Used in chapters 08, 09 and 11 to 15.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from companion.devices import cpu_count, num_gpus

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "gpus_for",
    "launch",
    "script_path",
    "stop_process_group",
]

HERE = Path(__file__).resolve().parent
# A diagnostic that gloo prints on stdout in some torch versions (2.10 among
# them), from every process at once: it can land in the middle of another line.
GLOO_PEERS = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+\n?"
)
SCRIPTS = HERE / "scripts"
CHECKS = HERE / "checks"


class LaunchError(RuntimeError):
    """A launched script failed, or wrote no results."""


class LaunchTimeout(LaunchError):
    """A launched script ran past its time-out and was stopped."""


def script_path(name: str) -> Path:
    """Return the path of ``companion/scripts/<name>`` or ``companion/<name>``.

    ``"ddp_train.py"`` names a script, ``"checks/fsdp_memory.py"`` a check.
    """
    path = HERE / name if name.startswith("checks/") else SCRIPTS / name
    if not path.is_file():
        available = ", ".join(
            sorted(
                [p.name for p in SCRIPTS.glob("*.py") if p.name != "__init__.py"]
                + [
                    f"checks/{p.name}"
                    for p in CHECKS.glob("*.py")
                    if p.name != "__init__.py"
                ]
            )
        )
        raise FileNotFoundError(
            f"There is no script {name!r} in {path.parent}; available: {available}."
        )
    return path


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
    ``poll``, ``wait`` and ``kill``.
    """

    def __init__(self, argv: list[str], env: Mapping[str, str]) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch.distributed.run"])  # once per server
        read, write = os.pipe()
        pipe = multiprocessing.connection.Connection(write, readable=False)
        self._process = context.Process(
            target=_run_torchrun, args=(argv, dict(env), pipe)
        )
        self._process.start()
        pipe.close()  # the child holds its own copy: EOF once it and its workers end
        self.pid = self._process.pid
        self.stdout = os.fdopen(read, encoding="utf-8", errors="replace")

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("torchrun", timeout or 0.0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def _run_torchrun(
    argv: list[str], env: dict[str, str], pipe: multiprocessing.connection.Connection
) -> None:
    """In the forked child: what ``python -m torch.distributed.run ARGV`` does."""
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
        code = (
            exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        )
    except Exception:  # noqa: BLE001 - reported, as python reports an uncaught one
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no module teardown: the launcher's work is done


def _start(
    cmd: list[str], env: Mapping[str, str]
) -> subprocess.Popen[str] | _ForkedTorchrun:
    """Start ``cmd``: torchrun from the forkserver where that is safe, else anew.

    Safe means Linux, and a caller with no main script: a forkserver's child
    imports the caller's ``__main__`` file again, which a script without an
    ``if __name__ == "__main__":`` guard does not survive. A notebook kernel,
    a REPL and pytest-xdist's workers have none.
    """
    torchrun = cmd[1:3] == ["-m", "torch.distributed.run"]
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if torchrun and sys.platform == "linux" and main_file is None:
        return _ForkedTorchrun(cmd[3:], env)
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def stop_process_group(
    proc: subprocess.Popen[str] | _ForkedTorchrun, grace: float = 5.0
) -> None:
    """Stop ``proc`` and every process it started: SIGTERM, then SIGKILL."""
    if proc.poll() is not None and os.name != "posix":
        return
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
        proc.wait(timeout=grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    if os.name == "posix":
        try:  # children may outlive torchrun's own exit: kill the group regardless
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
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
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        results_file = Path(tmp) / "results.json"
        argv = [*map(str, args), *(["--results", str(results_file)] if results else [])]
        if nproc is None:
            cmd = [sys.executable, str(path), *argv]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                str(path),
                *argv,
            ]
        tail: collections.deque[str] = collections.deque(maxlen=20)
        proc = _start(cmd, child_env)
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
