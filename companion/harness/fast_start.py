"""Start a worker process in milliseconds: fork it from a Python that has imported torch.

A rank spends about 1 s importing torch, and 1 s more importing Dynamo, which
``DistributedDataParallel`` and DTensor load when they start; four ranks on two
cores wait about 5 s before they compute anything. From a notebook, the
course's launchers (``companion.harness.launch``, ``companion.diagnosis.run_ranks``)
therefore start each rank through this module, as Android starts its apps from
its zygote:

- a *server*, started once per kernel, imports ``PRELOAD`` and waits on a Unix
  socket;
- the launcher runs ``python fast_start.py SCRIPT ARGS`` where it would run
  ``python SCRIPT ARGS``. That *client* imports nothing heavy: it sends the
  server its arguments, environment, working directory and standard streams,
  the server forks a *worker* that runs ``SCRIPT`` as ``__main__``, and the
  client stays in the worker's place until it ends: it passes the signals it
  gets on to the worker's process group and exits as the worker did (with its
  exit code, or killed by the same signal). When the client dies, or the
  server ends, the worker's group is killed.

torchrun, srun-like launchers and the scripts see the same exit codes and
streams as before, and the signals a launcher sends reach the worker's process
group (its children too); ``ps`` shows a worker under the server's command line,
and its pid is not the one its launcher knows (the client's). A worker differs
from a new Python in what was decided at import: its thread count and
``TORCH_DISTRIBUTED_DEBUG`` are read again from its environment, its random
generators are seeded again at random (as a new process's are), and where
another variable read at import differs from the server's
(``TORCH_CPP_LOG_LEVEL``, ``TORCH_LOGS``, ``ATEN_CPU_CAPABILITY``,
``TORCHINDUCTOR_*``, ``PYTHONPATH``, ...: ``IMPORT_TIME``), the server answers
"start anew" and the client runs ``python SCRIPT ARGS`` itself, as it does when
no server answers. Python's string hashes keep the server's seed in every
worker. Scripts copied to a cluster run under plain torchrun or srun, without
any of this.
"""

# The client runs as a file, before anything heavy: standard library only here.
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys

ADDRESS_VARIABLE = "COMPANION_FAST_START"  # the server's socket, for the client
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.nn.parallel",
    "torch._dynamo",  # DDP and DTensor import it when they start
)
# Variables that Python, torch or their libraries read when they are imported:
# a worker whose value differs from the server's starts anew.
IMPORT_TIME = re.compile(
    r"^(PYTHON(?!UNBUFFERED$)\w*|LD_\w+|LOGLEVEL|ATEN_\w+|MKL_\w+|KMP_\w+|GOMP_\w+"
    r"|OMP_(?!NUM_THREADS$)\w+|OPENBLAS_\w+|TRITON_\w+|PT2_\w+|PYTORCH_\w+"
    r"|TORCHINDUCTOR_\w+|TORCHDYNAMO_\w+|TORCH_DYNAMO\w*|TORCH_(CPP_LOG_LEVEL|LOGS\w*"
    r"|TRACE|COMPILE\w*|SHOW_CPP_STACKTRACES|CUDA_SANITIZER|\w*PRECOMPILE))$"
)
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
MESSAGE_BYTES = 1 << 20
CLIENT = os.path.abspath(__file__)  # run as a file: ``python CLIENT SCRIPT ARGS``
_server: tuple[object, str, int] | None = None  # (its Popen, socket, alive pipe)


def address() -> str | None:
    """The server's socket, for ``ADDRESS_VARIABLE``; the server starts on the first call.

    None where workers start anew: off Linux, and in a program run from a file
    (its workers would import its ``__main__`` again). A notebook kernel, a
    REPL and pytest-xdist's workers have no such file. The server ends with
    this process: it waits on a pipe that only this process holds open.
    """
    import subprocess
    import tempfile
    import time

    global _server
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if sys.platform != "linux" or main_file is not None:
        return None
    if _server is None or _server[0].poll() is not None:
        folder = tempfile.mkdtemp(prefix="fast-start-")
        path = os.path.join(folder, "socket")
        read, write = os.pipe()
        with open(os.path.join(folder, "server.log"), "wb") as log:
            server = subprocess.Popen(
                [sys.executable, CLIENT, "--serve", path, str(read)],
                pass_fds=[read],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # an interrupt of the kernel is not its
            )
        os.close(read)
        _server = (server, path, write)  # ``write`` stays open while we live
        for _ in range(500):  # it listens before it imports torch: milliseconds
            if os.path.exists(path) or server.poll() is not None:
                break
            time.sleep(0.01)
    return _server[1]


def differs_at_import(server: dict[str, str], worker: dict[str, str]) -> list[str]:
    """The variables read at import whose values differ between two environments."""
    names = {n for n in (*server, *worker) if IMPORT_TIME.match(n)}
    return sorted(n for n in names if server.get(n) != worker.get(n))


def exit_code(exit_: SystemExit) -> int:
    """The status python exits with for this ``SystemExit``, its message printed."""
    if isinstance(exit_.code, int) or exit_.code is None:
        return exit_.code or 0
    print(exit_.code, file=sys.stderr)  # a message: python prints it, exits with 1
    return 1


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to the group that ``pid`` leads, or to ``pid`` before it leads one."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, sig)
            return
        except ProcessLookupError:
            continue


# --- the client ---------------------------------------------------------------


def _unbuffered() -> bool:
    """Whether this Python runs as ``python -u`` (or with ``PYTHONUNBUFFERED``)."""
    return bool(getattr(sys.stdout, "write_through", False))


def _run_anew(argv: list[str]) -> None:
    flags = ["-u"] if _unbuffered() else []
    os.execv(sys.executable, [sys.executable, *flags, *argv])


def client(argv: list[str]) -> None:
    """Run ``argv`` (a script and its arguments) in a worker forked by the server."""
    address = os.environ.pop(ADDRESS_VARIABLE, None)
    if not address:
        _run_anew(argv)
    request = {
        "argv": argv,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "unbuffered": _unbuffered(),
    }
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(address)
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        answer = json.loads(sock.recv(MESSAGE_BYTES) or b'{"anew": true}')
    except OSError:  # no server (any more): a new Python still works
        answer = {"anew": True}
    if answer.get("anew"):
        _run_anew(argv)
    pid = answer["pid"]
    for name in FORWARDED:
        signal.signal(getattr(signal, name), lambda sig, _: _signal_group(pid, sig))
    message = sock.recv(MESSAGE_BYTES)  # the worker's wait status, when it ends
    if not message:  # the server ended: so does the worker, which it forked
        _signal_group(pid, signal.SIGKILL)
        print("fast_start: the server ended before the worker did", file=sys.stderr)
        sys.exit(1)
    status = json.loads(message)["status"]
    if os.WIFSIGNALED(status):  # end as the worker did, killed by its signal
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # whose disposition cannot be changed
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


# --- the server -----------------------------------------------------------------


def serve(path: str, alive_fd: int) -> None:
    """Import ``PRELOAD``, then fork a worker for each client until ``alive_fd`` closes.

    The socket listens before the imports, so that a client that comes early
    waits for them instead of starting anew. The server's one thread waits in
    ``select`` for a client, a child's exit (``SIGCHLD``, through a wake-up
    pipe) or the kernel's end; when it ends, every worker's group is killed.
    """
    import importlib
    import selectors

    startup_env = dict(os.environ)  # before the imports, which may add to it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    for name in PRELOAD:
        importlib.import_module(name)
    if sys.modules["torch"].cuda.is_initialized():  # a fork could not use CUDA
        startup_env = None  # every worker starts anew
    sys.stdout.flush()
    sys.stderr.flush()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select
    workers: dict[int, socket.socket | None] = {}  # pid -> its client's connection
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "client")
    selector.register(alive_fd, selectors.EVENT_READ, "parent")
    selector.register(wake_read, selectors.EVENT_READ, "child ended")
    server_fds = [listener.fileno(), alive_fd, wake_read, wake_write]
    try:
        while True:
            for key, _ in selector.select():
                if key.data == "parent":  # the kernel ended
                    return
                if key.data == "child ended":
                    os.read(wake_read, 4096)
                elif key.data == "client":
                    _accept(listener, startup_env, workers, selector, server_fds)
                else:  # a client's connection closed: its worker goes too
                    _signal_group(key.data, signal.SIGKILL)
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    workers[key.data] = None
            _report_ended(workers, selector)
    finally:
        for pid in workers:
            _signal_group(pid, signal.SIGKILL)


def _accept(listener, startup_env, workers, selector, server_fds) -> None:
    """Take one client's request: fork its worker, or answer that it start anew."""
    import selectors

    conn, _ = listener.accept()
    fds: list[int] = []
    pid = None
    try:
        message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
        request = json.loads(message)  # an empty message (a client gone) fails here
        differ = (
            ["CUDA, initialised in the server"]
            if startup_env is None
            else differs_at_import(startup_env, request["env"])
        )
        if len(fds) != 3 or differ:
            print("a worker started anew; differing:", differ, flush=True)
            conn.send(json.dumps({"anew": True}).encode())
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            others = [c.fileno() for c in workers.values() if c is not None]
            _work(request, fds, [conn.fileno(), *others, *server_fds])
        workers[pid] = conn
        selector.register(conn, selectors.EVENT_READ, pid)
        conn.send(json.dumps({"pid": pid}).encode())
    except (OSError, ValueError, KeyError) as error:  # the client went away
        print("a client went away:", error, flush=True)
        if pid is not None:  # its worker goes too; it is reaped as the others are
            _signal_group(pid, signal.SIGKILL)
        else:
            conn.close()
    finally:
        for fd in fds:  # the worker has its own copies
            os.close(fd)


def _report_ended(workers: dict, selector) -> None:
    """Send each ended worker's wait status to its client, and forget the worker."""
    while workers:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is None:
            continue
        selector.unregister(conn)
        try:
            conn.send(json.dumps({"status": status}).encode())
        except OSError:  # its client is gone
            pass
        conn.close()


def _work(request: dict, fds: list[int], close: list[int]) -> None:
    """In the forked worker: become ``python [-u] SCRIPT ARGS``, run it, and exit."""
    code, sig = 1, 0
    try:
        code, sig = _become_and_run(request, fds, close)
    finally:  # whatever happens, never return into the server's loop
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            _libc().fflush(None)  # what C code printed (gloo, say)
        finally:
            if sig:  # end as python does after an uncaught KeyboardInterrupt
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            os._exit(code & 0xFF)


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _become_and_run(request: dict, fds: list[int], close: list[int]) -> tuple[int, int]:
    import io
    import random
    import runpy
    import threading
    import traceback

    import torch
    import torch.distributed

    libc = _libc()
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
    os.setsid()  # a process group of its own, which the client's signals reach
    signal.set_wakeup_fd(-1)
    for fd in close:
        os.close(fd)
    if os.getppid() == 1:  # the server ended before prctl took hold
        return 1, 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    libc.fflush(None)  # anything C buffered in the server goes to its log
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = request["unbuffered"]
    if unbuffered:  # as python -u does, for C's stdout too (_IONBF)
        import ctypes

        libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, 2, 0)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False),
        encoding="utf-8",
        write_through=unbuffered,
        line_buffering=not unbuffered and os.isatty(1),
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script, *_ = sys.argv = list(request["argv"])
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    # What a new process decides at import, decided again from this environment.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    torch.distributed.set_debug_level_from_env()
    torch.seed()  # a new process seeds its generator at random
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code, sig = 0, 0
    try:
        runpy.run_path(os.path.abspath(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_code(exit_)
    except KeyboardInterrupt:
        traceback.print_exc()
        sig = signal.SIGINT
    except BaseException:  # noqa: BLE001 - reported as python reports an uncaught one
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # as at interpreter exit: wait for non-daemon threads
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - as python reports one at exit
        traceback.print_exc()
    return code, sig


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder, whose modules are not the workers'
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        client(sys.argv[1:])
