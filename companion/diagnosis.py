"""Diagnose distributed failures: run the ranks, and read what the tools printed.

Chapter 15 runs ``companion/scripts/failures.py`` with one bug at a time and
shows what each tool prints. The functions here start the processes (one
per rank, as ``srun`` does, or under ``torchrun``), keep each rank's output
apart, ask running ranks for their stacks and Flight Recorder entries (torch's
worker server, on a Unix socket), and turn what the tools printed into a
diagnosis (which rank, which collective, which cause) that the chapter's
verdicts check. Used in chapter 15.
"""

from __future__ import annotations

import http.client
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from companion.harness import fast_start
from companion.harness.launch import (
    free_port,
    script_path,
    start_launcher,
    stop_process_group,
)

__all__ = [
    "BarrierReport",
    "Collective",
    "Drift",
    "Failure",
    "Frame",
    "Mismatch",
    "RootCause",
    "Run",
    "Watch",
    "ask_worker",
    "compare_flight_records",
    "excerpt",
    "find_barrier_report",
    "find_drift",
    "find_failures",
    "find_gloo_errors",
    "find_mismatch",
    "find_root_cause",
    "find_stacks",
    "find_watch",
    "flight_records_from_json",
    "op_name",
    "read_flight_records",
    "run_ranks",
    "run_torchrun",
    "sanitize",
    "stacks_on_demand",
    "torchrun_entry",
    "torchrun_summary",
    "where_stuck",
]


@dataclass
class Run:
    """What a launch left behind: each process's output and exit code."""

    outputs: list[str]  # one per rank (run_ranks), or torchrun's whole output
    returncodes: list[int | None]  # None: still running when it was stopped
    seconds: float  # from the start to the last exit
    timed_out: bool  # stopped after the time-out, not ended by itself
    probed: Any = None  # what ``probe`` returned, asked while the run went on

    @property
    def text(self) -> str:
        """All the output, rank after rank."""
        return "\n".join(self.outputs)


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """One thread per process, unbuffered output, and the CPU (GPUs hidden): the
    failures then end in seconds and print the same on every machine."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
        **(env or {}),
    }


def run_ranks(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    grace: float = 5.0,
    python: str = sys.executable,
    ranks: Sequence[int] | None = None,
    probe: Callable[[], Any] | None = None,
) -> Run:
    """Start one process per rank, as ``srun`` would, and wait for all of them.

    Each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, like torchrun's
    workers, but no agent watches them: when one fails, the others have
    ``grace`` seconds to print their own errors before they are stopped (an
    agent would stop them at once). After ``timeout`` seconds every process
    is stopped and ``timed_out`` is set. From a process with no ``__main__``
    file on Linux (a notebook), with ``python`` left as this interpreter, each
    rank is forked from a server that has imported torch (``fast_start``),
    unless a variable read at import differs from the server's.

    Args:
        script: a path, or the name of a file in ``companion/scripts/``.
        args: command-line arguments for the script.
        nproc: the number of processes (ranks).
        env: extra environment variables (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
        timeout: seconds before every process is stopped.
        grace: seconds the others may run on after the first failure.
        python: the interpreter (another environment, another torch).
        ranks: start only these ranks of ``nproc`` (the others never come);
            ``Run.outputs`` and ``returncodes`` follow this order.
        probe: called in a thread while the processes run; what it returns is
            ``Run.probed``.
    """
    path = Path(script) if os.sep in str(script) else script_path(str(script))
    started = list(range(nproc)) if ranks is None else list(ranks)
    # From a notebook, each rank forked from a preloaded Python (fast_start)
    server = fast_start.address() if python == sys.executable else None
    through = [] if server is None else [fast_start.CLIENT]
    if server is not None:
        env = {**(env or {}), fast_start.ADDRESS_VARIABLE: server}
    for _ in range(3):  # another program may take the free port before rank 0 does
        run = _run_ranks_once(
            [python, *through, str(path)],
            args,
            nproc,
            started,
            _child_env(env),
            timeout,
            grace,
            probe,
        )
        if "EADDRINUSE" not in run.outputs[0]:
            break
    return run


def _run_ranks_once(
    command: list[str],
    args: Sequence[str],
    nproc: int,
    ranks: list[int],
    env: Mapping[str, str],
    timeout: float,
    grace: float,
    probe: Callable[[], Any] | None,
) -> Run:
    port = str(free_port())
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        files = [Path(tmp, f"rank{rank}.txt") for rank in ranks]
        procs = []
        for rank, file in zip(ranks, files):
            rank_env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            with open(file, "w") as out:
                procs.append(
                    subprocess.Popen(
                        [*command, *map(str, args)],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**env, **rank_env},
                        start_new_session=True,
                    )
                )
        asking = _Probe(probe)
        deadline = stop_at = start + timeout
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > stop_at:
                break
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed and stop_at == deadline:  # the others may print their errors
                stop_at = min(deadline, now + grace)
            time.sleep(0.05)
        timed_out = time.monotonic() > deadline
        seconds = time.monotonic() - start
        codes = [p.poll() for p in procs]
        for p in procs:
            stop_process_group(p, grace=1.0)
        outputs = [f.read_text(errors="replace") for f in files]
    return Run(outputs, codes, seconds, timed_out, asking.result())


class _Probe:
    """``probe()`` in a thread, started now; ``result()`` waits for it."""

    def __init__(self, probe: Callable[[], Any] | None) -> None:
        self._value: Any = None
        self._thread = threading.Thread(target=self._run, args=(probe,), daemon=True)
        if probe is not None:
            self._thread.start()

    def _run(self, probe: Callable[[], Any]) -> None:
        self._value = probe()

    def result(self) -> Any:
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(timeout=30)
        return self._value


def run_torchrun(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    python: str = sys.executable,
    probe: Callable[[], Any] | None = None,
) -> Run:
    """Run ``script`` under ``torchrun --standalone`` and keep all it printed.

    ``--tee 3`` prefixes every line a worker prints with its rank
    (``[default1]:``); torchrun's own log and failure summary come unprefixed.
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` lets restarted workers meet again
    (PyTorch 2.14 reuses a store whose addresses can be stale after a
    restart); ``env`` may set it to ``"0"``. ``probe`` is called in a thread
    while torchrun runs; what it returns is ``Run.probed``. ``python`` is the
    interpreter that runs torchrun and the workers. From a process with no
    ``__main__`` file on Linux (a notebook, a REPL, a pytest-xdist worker), with
    ``python`` left as this interpreter, torchrun starts as ``launch`` starts
    it, forked from a server that has imported it
    (``companion.harness.launch.start_launcher``), 2 to 3 s sooner.
    """
    path = Path(script) if os.sep in str(script) else script_path(str(script))
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--tee=3",
        str(path),
        *map(str, args),
    ]
    start = time.monotonic()
    proc = start_launcher(
        cmd, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **_child_env(env)}
    )
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        stop_process_group(proc, grace=1.0)

    watchdog = threading.Timer(timeout, on_timeout)
    watchdog.start()
    asking = _Probe(probe)
    try:
        assert proc.stdout is not None
        output = proc.stdout.read()  # to the end: the launcher has exited
        proc.wait()
    except BaseException:  # an interrupt included: leave nothing running
        stop_process_group(proc)
        raise
    finally:
        watchdog.cancel()
        watchdog.join()  # a time-out that struck has stopped every process
        proc.stdout.close()
    seconds = time.monotonic() - start
    return Run([output], [proc.poll()], seconds, timed_out.is_set(), asking.result())


# ---- what the tools printed, as a diagnosis

# TORCH_DISTRIBUTED_DEBUG=DETAIL's operation names, and the Flight Recorder's
# ("gloo:all_reduce"), mapped to the torch.distributed functions.
_OPS = {
    "ALLREDUCE": "all_reduce",
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather_into_tensor",
    "BROADCAST": "broadcast",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor",
    "ALLTOALL": "all_to_all",
    "ALLTOALL_BASE": "all_to_all_single",
    "BARRIER": "barrier",
    "GATHER": "gather",
    "SCATTER": "scatter",
    "REDUCE": "reduce",
}


def op_name(name: str) -> str:
    """``ALLREDUCE`` or ``gloo:all_reduce`` -> ``all_reduce``."""
    name = name.split(":")[-1]
    return _OPS.get(name, name.lower())


@dataclass(frozen=True)
class Collective:
    """One rank's side of a collective, as a tool reported it."""

    rank: int
    op: str  # the torch.distributed function: "all_reduce", "broadcast", ...
    shape: tuple[int, ...] | None = None  # the (first) tensor's shape
    dtype: str | None = None
    sequence: int | None = None  # the collective's number in its group
    where: str = ""  # the function of the script that called it, if known
    state: str = ""  # the Flight Recorder's: "scheduled", "started", "completed"


@dataclass(frozen=True)
class Mismatch:
    """Collectives that differ between ranks: what DETAIL or the Flight Recorder saw."""

    collectives: tuple[Collective, ...]  # one per rank that reached the point
    missing: tuple[int, ...] = ()  # ranks that never issued it

    @property
    def ranks(self) -> list[int]:
        """The ranks that issued a collective at this point."""
        return [c.rank for c in self.collectives]

    @property
    def differs_in(self) -> list[str]:
        """Which of ``op``, ``shape``, ``dtype`` and ``where`` differ between ranks.

        ``where`` (the calling function) is known from the Flight Recorder's
        stacks only; two ranks in different functions issued unrelated
        collectives, even when op and shape agree.
        """
        return [
            field
            for field in ("op", "shape", "dtype", "where")
            if len({getattr(c, field) for c in self.collectives}) > 1
        ]


_FINGERPRINT = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\("
    r"SequenceNumber=(\d+), OpType=(\w+)"
    r"(?:, TensorShape=\[([\d, ]*)\], TensorDtypes=(\w+))?"
)


def find_mismatch(text: str) -> Mismatch | None:
    """The first mismatch ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reported, or None.

    DETAIL prints, on every rank, "Detected mismatch between collectives on
    ranks. Rank 0 is running collective: CollectiveFingerPrint(...), but Rank 1
    is running collective: CollectiveFingerPrint(...)"; the same in 2.10 and 2.14.
    """
    start = text.find("Detected mismatch between collectives on ranks")
    if start < 0:
        return None
    line = text[start:].split("\n", 1)[0]
    found = {}
    for rank, seq, op, shape, dtype in _FINGERPRINT.findall(line):
        dims = tuple(int(d) for d in shape.split(",") if d.strip()) if shape else None
        found[int(rank)] = Collective(
            int(rank), op_name(op), dims, dtype or None, int(seq)
        )
    return Mismatch(tuple(found[r] for r in sorted(found))) if found else None


@dataclass(frozen=True)
class BarrierReport:
    """What ``monitored_barrier`` said: who did not arrive, or who did."""

    missing: tuple[int, ...]  # ranks that rank 0 waited for in vain
    reached: tuple[int, ...]  # ranks that arrived but heard nothing from rank 0


def find_barrier_report(text: str) -> BarrierReport | None:
    """Parse ``monitored_barrier``'s errors, or None if there are none.

    Rank 0 names the ranks that did not arrive ("Rank 1 failed to pass
    monitoredBarrier in 1000 ms", or "Ranks 1, 3 failed ..." with
    ``wait_all_ranks=True``); a rank that arrived while rank 0 was elsewhere
    says "Rank 1 successfully reached monitoredBarrier, but received errors
    while waiting for send/recv from rank 0".
    """
    missing = set()
    for ranks in re.findall(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text):
        missing.update(int(r) for r in ranks.split(","))
    reached = {
        int(r)
        for r in re.findall(r"Rank (\d+) successfully reached monitoredBarrier", text)
    }
    if not missing and not reached:
        return None
    return BarrierReport(tuple(sorted(missing)), tuple(sorted(reached)))


def find_gloo_errors(outputs: Sequence[str]) -> dict[int, str]:
    """Each rank's gloo error, in a few words (no paths, no addresses).

    ``outputs`` holds one text per rank (``Run.outputs`` of ``run_ranks``).
    Whether a time-out struck in a send or a receive depends on timing, so
    the words do not say.
    """
    kinds = (
        (r"Timed out waiting (\d+) ?ms", "timed out after {} ms"),
        (r"Connection (?:closed|reset) by peer", "lost the connection to a peer"),
        (r"Received data size doesn't match", "received data of the wrong size"),
        (r"can't allocate memory|out of memory", "ran out of memory"),
    )
    found = {}
    for rank, text in enumerate(outputs):
        for pattern, words in kinds:
            match = re.search(pattern, text)
            if match:
                found[rank] = words.format(*match.groups())
                break
    return found


@dataclass(frozen=True)
class Failure:
    """One rank's entry in torchrun's failure summary."""

    rank: int
    exitcode: int
    signal: str | None  # "SIGKILL" when a signal ended it
    error: str  # the last line of its traceback (from @record's error file)
    has_error_file: bool  # False: "error_file: <N/A>" (no @record, or a signal)


@dataclass(frozen=True)
class RootCause(Failure):
    """The entry torchrun calls the root cause, and the other failed ranks."""

    others: dict[int, int]  # the other failed ranks and their exit codes


_SUMMARY_ENTRY = re.compile(
    r"\[\d+\]:\n(?P<entry>[^\n]*\n[^\n]*\n"
    r"\s*rank\s*: (?P<rank>\d+) \(local_rank: \d+\)\s*\n"
    r"\s*exitcode\s*: (?P<code>-?\d+) \(pid: \d+\)[^\n]*\n"
    r"\s*error_file: (?P<error_file>[^\n]*)\n"
    r"\s*traceback : (?P<traceback>.*?))(?=\n\[\d+\]:|\n-{20,}|\n={20,})",
    re.DOTALL,
)
_ROOT = "Root Cause (first observed failure):"


def _summary_entries(text: str) -> list[re.Match]:
    """The entries of torchrun's last failure summary, the root cause first."""
    root = text.rfind(_ROOT)
    if root < 0:
        return []
    failures = text.rfind("Failures:", 0, root)
    others = list(
        _SUMMARY_ENTRY.finditer(text, failures if failures >= 0 else root, root)
    )
    return list(_SUMMARY_ENTRY.finditer(text, root))[:1] + others


def find_failures(text: str) -> dict[int, Failure]:
    """Every rank's entry in the failure summary ``torchrun`` prints when its
    workers fail, by rank (the root cause first)."""
    failures = {}
    for entry in _summary_entries(text):
        traceback = entry["traceback"]
        lines = [line.strip() for line in traceback.splitlines() if line.strip()]
        signal_name = re.search(r"\((SIG\w+)\) received", traceback)
        failures[int(entry["rank"])] = Failure(
            rank=int(entry["rank"]),
            exitcode=int(entry["code"]),
            signal=signal_name.group(1) if signal_name else None,
            error=lines[-1] if lines else "",
            has_error_file=entry["error_file"].strip() != "<N/A>",
        )
    return failures


def find_root_cause(text: str) -> RootCause | None:
    """The entry torchrun's failure summary calls the root cause: the failure
    with the earliest time stamp, to the second (torchrun stamps a killed
    process when it notices it; @record stamps an exception when it is raised)."""
    failures = list(find_failures(text).values())
    if not failures:
        return None
    others = {f.rank: f.exitcode for f in failures[1:]}
    return RootCause(**vars(failures[0]), others=others)


@dataclass(frozen=True)
class Frame:
    file: str  # the file's name, without its folder
    line: int
    function: str


def find_stacks(outputs: Sequence[str] | str) -> dict[int, list[Frame]]:
    """Each rank's main thread in its last stack dump, innermost frame first.

    ``outputs``: one text per rank (``faulthandler``'s dumps, or the worker
    server's ``dump_traceback`` answers), or torchrun's output with ``--tee
    3``, whose lines start with ``[default<rank>]:``. A dump lists every
    thread, the newest first: the last block of the last dump is the main
    thread's.
    """
    if isinstance(outputs, str):
        per_rank: dict[int, list[str]] = {}
        for rank, line in re.findall(r"^\[default(\d+)\]:(.*)$", outputs, re.MULTILINE):
            per_rank.setdefault(int(rank), []).append(line)
        texts = {rank: "\n".join(lines) for rank, lines in per_rank.items()}
    else:
        texts = dict(enumerate(outputs))
    stacks = {}
    for rank, text in texts.items():
        blocks = re.split(
            r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$",
            text,
            flags=re.MULTILINE,
        )
        if len(blocks) < 2:
            continue
        frames = re.findall(
            r'^  File "([^"]+)", line (\d+) in (\S+)$', blocks[-1], re.MULTILINE
        )
        stacks[rank] = [Frame(Path(f).name, int(n), fn) for f, n, fn in frames]
    return stacks


def where_stuck(frames: Sequence[Frame], script: str = "failures.py") -> str:
    """The script's innermost function in a stack, and what it was calling."""
    for i, frame in enumerate(frames):
        if frame.file == script:
            inside = frames[i - 1].function if i else ""
            return f"{frame.function}" + (f" (in {inside})" if inside else "")
    return frames[0].function if frames else ""


def _collectives(
    entries: Sequence[Mapping], rank: int, script: str
) -> list[Collective]:
    """A rank's Flight Recorder entries of the default group, as Collectives."""
    found = []
    for e in entries:
        if e["process_group"][1] != "default_pg":
            continue
        callers = [
            f["name"] for f in e.get("frames", []) if f["filename"].endswith(script)
        ]
        found.append(
            Collective(
                rank=rank,
                op=op_name(e["profiling_name"]),
                shape=tuple((e.get("input_sizes") or [[]])[0]),
                dtype=(e.get("input_dtypes") or [None])[0],
                sequence=e["collective_seq_id"],
                where=callers[0] if callers else "",
                state=e.get("state", ""),
            )
        )
    return found


def read_flight_records(
    folder: str | Path, script: str = "failures.py"
) -> dict[int, list[Collective]]:
    """Each rank's Flight Recorder entries of the default group, oldest first.

    The files are what ``torch._C._distributed_c10d._dump_fr_trace()`` (gloo)
    or ``_dump_nccl_trace()`` returned, one per rank, named ``rank_<rank>``;
    pickles, so read only files you wrote yourself. ``where`` is the
    innermost function of ``script`` in each entry's stack.
    """
    records = {}
    for path in sorted(Path(folder).glob("rank_*")):
        rank = int(path.name.split("_")[1])
        entries = pickle.loads(path.read_bytes()).get("entries", [])
        records[rank] = _collectives(entries, rank, script)
    return records


def flight_records_from_json(answers: Mapping[int, str]) -> dict[int, list[Collective]]:
    """Each rank's Flight Recorder entries from the worker server's
    ``fr_trace_json`` answers (no stacks: ``where`` stays empty)."""
    return {
        rank: _collectives(json.loads(text).get("entries", []), rank, "")
        for rank, text in answers.items()
    }


class _UnixHTTP(http.client.HTTPConnection):
    """HTTP over a Unix socket, as torch's worker server speaks it."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def ask_worker(path: str | Path, handler: str, timeout: float = 5.0) -> str:
    """A worker server's answer to ``handler`` (``"dump_traceback"``: every
    thread's stack; ``"fr_trace_json"``: the Flight Recorder) on the Unix
    socket ``path``. Raises ``OSError`` when nothing answers."""
    connection = _UnixHTTP(str(path), timeout)
    try:
        connection.request("POST", f"/handler/{handler}")
        response = connection.getresponse()
        body = response.read().decode(errors="replace")
    finally:
        connection.close()
    if response.status != 200:
        raise OSError(f"the worker server answered {response.status} to {handler}")
    return body


def stacks_on_demand(
    folder: str | Path, wait_for: Mapping[int, str], timeout: float = 30.0
) -> dict[str, dict[int, str]]:
    """Ask every rank of a running job for its stacks and Flight Recorder.

    The ranks' worker servers listen on ``folder/rank<r>.sock``
    (``failures.py --debug-socket``). The ranks of ``wait_for`` are asked for
    their stacks until each shows its function (``{1: "load_batch"}``: rank
    1 has reached the hang) and, where every rank's Flight Recorder answers,
    until the records disagree (a rank that is still computing before its
    collective looks like one that waits in it), or for ``timeout`` seconds;
    then every rank's Flight Recorder is asked for at once, and the other
    ranks' stacks: ``{"stacks": {rank: text}, "flight_records": {rank:
    json}}``, without the ranks that did not answer.
    """
    deadline = time.monotonic() + timeout
    sockets: dict[int, Path] = {}
    stacks: dict[int, str] = {}
    answered = False  # once the ranks have answered, silence means they are gone
    while time.monotonic() < deadline:
        sockets = {
            int(p.stem.removeprefix("rank")): p for p in Path(folder).glob("rank*.sock")
        }
        try:
            stacks = {r: ask_worker(sockets[r], "dump_traceback") for r in wait_for}
            answered = True
        except (OSError, KeyError):  # not listening yet, or gone
            stacks = {}
            if answered:  # the run ended before the records disagreed
                break
        if stacks and all(f" in {wait_for[r]}" in stacks[r] for r in wait_for):
            try:
                records = {
                    r: ask_worker(p, "fr_trace_json") for r, p in sockets.items()
                }
            except OSError:  # no Flight Recorder handler here: the stacks decide
                break
            if compare_flight_records(flight_records_from_json(records)) is not None:
                break
        time.sleep(0.2)
    answers: dict[str, dict[int, str]] = {"stacks": stacks, "flight_records": {}}
    for rank, path in sorted(sockets.items()):  # quickly: the hang ends in seconds
        for key, handler in (
            ("flight_records", "fr_trace_json"),
            ("stacks", "dump_traceback"),
        ):
            if rank not in answers[key]:
                try:
                    answers[key][rank] = ask_worker(path, handler)
                except OSError:
                    pass
    return answers


def compare_flight_records(
    records: Mapping[int, Sequence[Collective]],
) -> Mismatch | None:
    """The first collective where the ranks' records disagree, or None.

    Ranks disagree when they issued different operations or shapes under the
    same sequence number, or when some ranks issued a collective that others
    never did (they were somewhere else: stuck, dead, or done). Each rank's
    ring buffer keeps only its last entries, so once it has wrapped the ranks'
    windows start at different numbers: the comparison starts at the latest
    of the ranks' first numbers, which every non-empty record still holds.
    """
    by_seq = {
        rank: {c.sequence: c for c in entries} for rank, entries in records.items()
    }
    kept = [min(s) for s in by_seq.values() if s]
    first = max(kept, default=0)
    union = set().union(*(s.keys() for s in by_seq.values()))
    sequences = sorted(q for q in union if q >= first)
    for seq in sequences:
        present = [by_seq[r][seq] for r in sorted(by_seq) if seq in by_seq[r]]
        missing = tuple(r for r in sorted(by_seq) if seq not in by_seq[r])
        mismatch = Mismatch(tuple(present), missing)
        if missing or mismatch.differs_in:
            return mismatch
    return None


@dataclass(frozen=True)
class Drift:
    """What the script's cross-rank checks caught."""

    kind: str  # "replicas", "shards" or "order"
    step: int | None  # replicas: the step after which they differed
    detail: str  # replicas: the parameter; shards: "N twice, M never"
    norm_gap: float | None = None  # replicas: how far apart the norms are
    sum_gap: float | None = None  # replicas: how far apart the sums are


def find_drift(text: str) -> Drift | None:
    """Parse the errors of ``check_replicas`` and ``check_data`` in failures.py."""
    match = re.search(
        r"the replicas differ after step (\d+): (\S+) has norm .*?"
        r"\(apart by (\S+); its sums by (\S+)\)",
        text,
        re.DOTALL,
    )
    if match:
        step, name, norms, sums = match.groups()
        return Drift("replicas", int(step), name, float(norms), float(sums))
    match = re.search(
        r"the ranks' shards overlap: (\d+) samples twice, (\d+) never", text
    )
    if match:
        return Drift("shards", None, f"{match.group(1)} twice, {match.group(2)} never")
    if "this epoch repeats the last one's order" in text:
        return Drift("order", None, "set_epoch")
    return None


@dataclass(frozen=True)
class Watch:
    """What the script's ``--watch`` stopped on."""

    step: int
    losses: dict[int, float]  # the ranks whose loss was not finite or spiked
    median: float  # the recent steps' median loss it compared with
    weights_finite: bool  # every rank's weights were still finite


def find_watch(text: str) -> Watch | None:
    """Parse the error ``failures.py --watch`` raises on every rank, or None."""
    match = re.search(
        r"step (\d+): the loss is (.*?), against a recent median of (\S+); stopped "
        r"before the gradients' all-reduce, every rank's weights still "
        r"(finite|not all finite)",
        " ".join(text.split()),
    )
    if not match:
        return None
    step, losses, median, weights = match.groups()
    found = re.findall(r"(\S+) on rank (\d+)", losses)
    return Watch(
        int(step),
        {int(r): float(v) for v, r in found},
        float(median),
        weights == "finite",
    )


# ---- printing: the lines that matter, without what changes from run to run

_VOLATILE = (
    (re.compile(r"\[?\d+\.\d+\.\d+\.\d+\]?:\d+"), "<address>"),  # [127.0.0.1]:port
    (re.compile(r"\(pid: \d+\)|PID \d+"), "<pid>"),
    (re.compile(r"\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d"), "<time>"),
    (
        re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ", re.MULTILINE),
        "",
    ),  # log prefixes
    (re.compile(r"\[[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ "), "["),  # C++ log prefixes
    (re.compile(r"0x[0-9a-f]{6,}"), "0x…"),  # thread ids, addresses
    (re.compile(r'/[^\s"]*/(site-packages|companion/scripts)/'), r".../\1/"),
    (re.compile(r"/\S*?/torchelastic_[^/\s]+/[^/\s]+/"), "<tmp>/"),
    (re.compile(r"\[/[^\]]*third_party/gloo/"), "[gloo/"),
    (re.compile(r"\bhost\s*: .*"), "host      : <host>"),
    (re.compile(r"[ \t]+$", re.MULTILINE), ""),
)


def sanitize(text: str) -> str:
    """``text`` without process ids, ports, times, host names and paths."""
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


# DETAIL's fingerprints end with the tensors' full TensorOptions, which says
# little that the dtype does not.
_OPTIONS = re.compile(r", TensorDeviceTypes=TensorOptions\((?:[^()]|\([^()]*\))*\)")


def excerpt(text: str, *patterns: str, limit: int = 6, width: int = 88) -> str:
    """The lines of ``text`` that match any of ``patterns``, sanitised, each
    once, at most ``limit`` of them, wrapped at ``width`` columns."""
    seen, kept = set(), []
    for line in _OPTIONS.sub("", sanitize(text)).splitlines():
        line = re.sub(r"^(\[default\d+\]:)?(\[rank\d+\]:)?\s*", "", line)
        if any(re.search(p, line) for p in patterns) and line not in seen:
            seen.add(line)
            kept.append(textwrap.fill(line, width, subsequent_indent="    "))
    return "\n".join(kept[:limit])


_FRAMES = re.compile(
    r"(traceback : )Traceback \(most recent call last\):\n(?:    .*\n|\s*\n)*  (\S.*)"
)


def _shown(block: str) -> str:
    """A piece of the failure summary, sanitised, its tracebacks cut to their
    last line, wrapped at 88 columns."""
    block = _FRAMES.sub(r"\1… \2", sanitize(block)).rstrip()
    return "\n".join(
        textwrap.fill(line, 88, subsequent_indent=" " * 14)
        for line in block.splitlines()
    )


def torchrun_summary(text: str) -> str:
    """The root cause in torchrun's failure summary, as :func:`_shown` shows it.
    (The other ranks' entries depend on timing: torchrun stops them once one
    fails, and they may or may not have failed by themselves.)"""
    start = text.rfind(_ROOT)
    end = text.find("=" * 20, start)
    if start < 0 or end < 0:
        return ""
    return _shown(text[start:end])


def torchrun_entry(text: str, rank: int) -> str:
    """Rank ``rank``'s entry in torchrun's failure summary, whether it is the root
    cause or one of the other failures, without its position in the summary."""
    for entry in _summary_entries(text):
        if int(entry["rank"]) == rank:
            return _shown(entry["entry"] + "\n")
    return ""
