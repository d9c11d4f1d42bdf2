"""Cause distributed failures on purpose, and read what the tools printed.

Chapter 15 runs ``companion/scripts/failures.py`` with one bug at a time and
shows what each tool prints. The functions here start the processes (one
per rank, as ``srun`` does, or under ``torchrun``), keep each rank's output
apart, and turn what the tools printed into a diagnosis (which rank, which
collective, which cause) that the chapter's verdicts check. Used in chapter 15.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from companion.launch import stop_process_group, script_path

__all__ = [
    "BarrierReport",
    "Collective",
    "Drift",
    "Failure",
    "Frame",
    "Mismatch",
    "RootCause",
    "Run",
    "compare_flight_records",
    "excerpt",
    "find_barrier_report",
    "find_drift",
    "find_gloo_errors",
    "find_mismatch",
    "find_failures",
    "find_root_cause",
    "find_stacks",
    "op_name",
    "read_flight_records",
    "run_ranks",
    "run_torchrun",
    "sanitize",
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

    @property
    def text(self) -> str:
        """All the output, rank after rank."""
        return "\n".join(self.outputs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
) -> Run:
    """Start one process per rank, as ``srun`` would, and wait for all of them.

    Each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, like torchrun's
    workers, but no agent watches them: when one fails, the others have
    ``grace`` seconds to print their own errors before they are stopped (an
    agent would stop them at once). After ``timeout`` seconds every process
    is stopped and ``timed_out`` is set.

    Args:
        script: a path, or the name of a file in ``companion/scripts/``.
        args: command-line arguments for the script.
        nproc: the number of processes (ranks).
        env: extra environment variables (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
        timeout: seconds before every process is stopped.
        grace: seconds the others may run on after the first failure.
        python: the interpreter (another environment, another torch).
    """
    path = Path(script) if os.sep in str(script) else script_path(str(script))
    for _ in range(3):  # another program may take the free port before rank 0 does
        run = _run_ranks_once(
            path, args, nproc, _child_env(env), timeout, grace, python
        )
        if "EADDRINUSE" not in run.outputs[0]:
            break
    return run


def _run_ranks_once(
    path: Path,
    args: Sequence[str],
    nproc: int,
    env: Mapping[str, str],
    timeout: float,
    grace: float,
    python: str,
) -> Run:
    port = str(_free_port())
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        files = [Path(tmp, f"rank{rank}.txt") for rank in range(nproc)]
        procs = []
        for rank, file in enumerate(files):
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
                        [python, str(path), *map(str, args)],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**env, **rank_env},
                        start_new_session=True,
                    )
                )
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
    return Run(outputs, codes, seconds, timed_out)


def run_torchrun(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    python: str = sys.executable,
) -> Run:
    """Run ``script`` under ``torchrun --standalone`` and keep all it printed.

    ``--tee 3`` prefixes every line a worker prints with its rank
    (``[default1]:``); torchrun's own log and failure summary come unprefixed.
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` lets restarted workers meet again
    (PyTorch 2.14 reuses a store whose addresses are stale after a restart).
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
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_child_env(env), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        stop_process_group(proc, grace=1.0)
        output, _ = proc.communicate()
        timed_out = True
    return Run([output], [proc.returncode], time.monotonic() - start, timed_out)


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
    """Each rank's last stack dump by ``faulthandler``, innermost frame first.

    ``outputs``: one text per rank, or torchrun's output with ``--tee 3``,
    whose lines start with ``[default<rank>]:``. Only the dumping thread's
    first block is kept (the main thread, in these scripts).
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
        entries = []
        for e in pickle.loads(path.read_bytes()).get("entries", []):
            if e["process_group"][1] != "default_pg":
                continue
            callers = [
                f["name"] for f in e.get("frames", []) if f["filename"].endswith(script)
            ]
            entries.append(
                Collective(
                    rank=rank,
                    op=op_name(e["profiling_name"]),
                    shape=tuple((e.get("input_sizes") or [[]])[0]),
                    dtype=(e.get("input_dtypes") or [None])[0],
                    sequence=e["collective_seq_id"],
                    where=callers[0] if callers else "",
                )
            )
        records[rank] = entries
    return records


def compare_flight_records(
    records: Mapping[int, Sequence[Collective]],
) -> Mismatch | None:
    """The first collective where the ranks' records disagree, or None.

    Ranks disagree when they issued different operations or shapes under the
    same sequence number, or when some ranks issued a collective that others
    never did (they were somewhere else: stuck, dead, or done).
    """
    by_seq = {
        rank: {c.sequence: c for c in entries} for rank, entries in records.items()
    }
    sequences = sorted(set().union(*(s.keys() for s in by_seq.values())))
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


def find_drift(text: str) -> Drift | None:
    """Parse the errors of ``check_replicas`` and ``check_data`` in failures.py."""
    match = re.search(r"the replicas differ after step (\d+): (\S+) has norm", text)
    if match:
        return Drift("replicas", int(match.group(1)), match.group(2))
    match = re.search(
        r"the ranks' shards overlap: (\d+) samples twice, (\d+) never", text
    )
    if match:
        return Drift("shards", None, f"{match.group(1)} twice, {match.group(2)} never")
    if "this epoch repeats the last one's order" in text:
        return Drift("order", None, "set_epoch")
    return None


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
