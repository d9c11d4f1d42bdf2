"""Where training memory goes: bytes counted on the model, and their formulas.

Training holds four kinds of tensors besides its temporaries:

- the parameters, their gradients and the optimizer's state, which stay for
  the whole run and scale with the number of parameters;
- the activations that autograd saves in the forward pass for the backward
  pass, which scale with the batch and the sequence.

``state_bytes`` measures the first three on a model and its optimizer, and
``state_bytes_formula`` predicts them from the parameter count.
``SavedTensors`` measures the fourth with autograd's saved-tensor hooks: it
adds up the storages packed for backward, each once, leaving out the
parameters and buffers (a layer saves its weight, but that memory is the
model's anyway). ``LiveTensors`` follows the tensors themselves: every
storage an operation creates, at its current size, while it lives, and the
most alive at once (what selective checkpointing keeps, which the hooks do
not see, and a step's peak). ``memory_timeline`` follows the allocator
instead: the bytes allocated, event by event, through the phases of a
training step, as the PyTorch profiler records them; on CUDA,
``cuda_memory`` reads the caching allocator's statistics, and
``record_snapshot`` turns its recorded history into allocated and reserved
bytes over a step (``plot_snapshot`` draws it). For sharded models,
``tensor_bytes`` counts what one rank holds (a DTensor's local shard, and
the storage behind it) and ``shard_rows`` predicts a shard's rows. Used in
chapters 12 and 13.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from companion.harness.notebook import CourseError

__all__ = [
    "CATEGORIES",
    "OPTIMIZER_COPIES",
    "Checkpointed",
    "LiveTensors",
    "MemoryTimeline",
    "SavedTensors",
    "SnapshotTimeline",
    "cuda_memory",
    "memory_timeline",
    "plot_snapshot",
    "record_snapshot",
    "shard_rows",
    "snapshot_timeline",
    "state_bytes",
    "state_bytes_formula",
    "tensor_bytes",
]

# Tensors of the parameters' size that each optimizer keeps per parameter.
OPTIMIZER_COPIES = {"sgd": 0, "sgd-momentum": 1, "adam": 2}


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.nelement() * t.element_size() for t in tensors)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes held by the parameters, their gradients and the optimizer's state.

    Gradients count once they exist (after a backward pass), and the optimizer's
    state once it exists (after its first step).
    """
    params = list(model.parameters())
    state = [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "parameters": _nbytes(params),
        "gradients": _nbytes(p.grad for p in params if p.grad is not None),
        "optimizer state": _nbytes(state),
    }


def state_bytes_formula(
    n_params: int,
    optimizer: str,
    *,
    n_tensors: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, int]:
    """Predict ``state_bytes`` from the parameter count.

    Args:
        n_params: number of parameters (elements, not tensors).
        optimizer: ``"sgd"``, ``"sgd-momentum"`` or ``"adam"``.
        n_tensors: number of parameter tensors; Adam keeps a float32 step
            counter for each (4 bytes), which the formula adds.
        dtype: the parameters' dtype; gradients and state share it.
    """
    if optimizer not in OPTIMIZER_COPIES:
        raise CourseError(
            f"no formula for the optimizer {optimizer!r}; choose one of "
            f"{', '.join(OPTIMIZER_COPIES)}."
        )
    per_param = n_params * dtype.itemsize
    steps = 4 * n_tensors if optimizer == "adam" else 0
    return {
        "parameters": per_param,
        "gradients": per_param,
        "optimizer state": OPTIMIZER_COPIES[optimizer] * per_param + steps,
    }


class SavedTensors:
    """Count the bytes autograd saves for backward inside a ``with`` block.

    Wrap one forward pass::

        with SavedTensors(exclude=[*model.parameters(), *model.buffers()]) as saved:
            loss = loss_fn(model(x), y)
        saved.nbytes

    Each storage counts once, whole, however many views of it are saved; the
    storages of ``exclude`` do not count; a DTensor counts its local tensor,
    the part this rank holds. A storage is *live* from its first save until
    autograd lets go of the last of them (a backward pass frees them):
    ``live`` is the bytes held now and ``peak`` the most held at once, for a
    block that runs backward passes too, such as a pipeline's step.
    ``by_dtype`` splits ``nbytes`` by the dtype of the tensors saved.

    Selective activation checkpointing (``create_selective_checkpoint_contexts``)
    keeps the outputs its policy saves outside these hooks (torch 2.10 to
    2.14, unless 2.14's ``respect_saved_tensors_hooks=True``): count those
    with ``LiveTensors``.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage(t).data_ptr() for t in exclude}
        self._saves: dict[int, list[int]] = {}  # address: [saves alive, bytes]
        self.nbytes = 0  # every storage saved, counted when it became live
        self.by_dtype: dict[torch.dtype, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Held:
        storage = _storage(tensor)
        address = storage.data_ptr()
        if address in self._excluded or storage.nbytes() == 0:
            return tensor
        entry = self._saves.setdefault(address, [0, storage.nbytes()])
        if entry[0] == 0:
            self.nbytes += entry[1]
            self.by_dtype[tensor.dtype] = self.by_dtype.get(tensor.dtype, 0) + entry[1]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, address)  # when autograd lets go
        return held

    def _release(self, address: int) -> None:
        entry = self._saves[address]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._saves[address]

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, traceback)


class _Held:
    """A saved tensor, wrapped so that its release can be seen.

    It keeps a detached alias (the same storage), as torch asks of a pack
    hook: the tensor itself would close a reference cycle through its
    ``grad_fn`` wherever an operation saves its own output (softmax, say),
    which Python's garbage collector cannot see through, and which only a
    backward pass that runs that node breaks (a weight-gradient pass of a
    zero-bubble pipeline does not).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()


def _unpack(saved: torch.Tensor | _Held) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Held) else saved


class LiveTensors(TorchDispatchMode):
    """Follow the bytes of the tensors that operations create inside a ``with`` block.

    ::

        with LiveTensors(track=[*model.parameters()]) as tensors:
            loss = loss_fn(model(x), y)
        tensors.live  # bytes alive now: the tracked ones, and those made inside
        tensors.peak  # the most alive at once, read after every operation

    Every storage that an operation inside the block creates counts from then
    until it dies, at its current size: FSDP2 frees a gathered parameter by
    resizing its storage to zero (``UntypedStorage.resize_``, which no
    dispatch mode sees, so the block watches that method too), and gathers it
    again by resizing it back. ``track`` adds storages that exist already
    (parameters, optimizer state), counted from the start; other storages
    that existed before the block do not count. A DTensor counts its local
    tensor. What the allocator adds (rounding, caching, buffers of the
    communication library) is not seen: on CUDA compare with
    ``torch.cuda.max_memory_allocated``. Used in chapter 12.
    """

    def __init__(self, track: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id of a followed storage: its bytes
        self._refs: dict[int, weakref.ref] = {}
        for tensor in track:
            self._follow(_storage(tensor))
        self._resize: Callable[..., Any] = torch.UntypedStorage.resize_

    def _follow(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._refs and self._refs[key]() is storage:
            return
        self._sizes[key] = storage.nbytes()
        # The storage's Python object lives exactly as long as the storage.
        self._refs[key] = weakref.ref(storage, lambda _: self._forget(key))
        self._add(self._sizes[key])

    def _forget(self, key: int) -> None:
        self._refs.pop(key, None)
        self._add(-self._sizes.pop(key, 0))

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        """``UntypedStorage.resize_``, counted: a followed storage changes size, and
        one resized from nothing (FSDP2 gathering a parameter) is followed."""
        before = storage.nbytes()
        self._resize(storage, size)
        key = id(storage)
        if key in self._refs and self._refs[key]() is storage:
            self._add(storage.nbytes() - self._sizes[key])
            self._sizes[key] = storage.nbytes()
        elif before == 0:
            self._follow(storage)

    def __enter__(self) -> Self:
        self._resize = torch.UntypedStorage.resize_
        resized = self._resized
        torch.UntypedStorage.resize_ = lambda storage, size: resized(storage, size)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = {
            id(_storage(t))
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:  # outputs on new storage: allocated here
            if isinstance(t, torch.Tensor) and id(_storage(t)) not in before:
                self._follow(_storage(t))
        return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the part this rank holds), else ``tensor``."""
    # No DTensor exists unless its module was imported; importing it takes a second.
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(tensor, module.DTensor):
        with torch.no_grad():  # no autograd node, inside a saved-tensor hook too
            return tensor.to_local()
    return tensor


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    return _local(tensor).untyped_storage()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes of the elements this rank holds, and of the memory behind them.

    ``local`` counts the elements (a DTensor's local shard); ``storage`` the
    distinct storages behind them, each once, with any padding (FSDP2
    allocates ``ceil(rows / N)`` rows of every shard).
    """
    tensors = [_local(t) for t in tensors]
    storages = {
        (t.untyped_storage().device, t.untyped_storage().data_ptr()): (
            t.untyped_storage().nbytes()
        )
        for t in tensors
    }
    return {"local": _nbytes(tensors), "storage": sum(storages.values())}


def shard_rows(rows: int, parts: int, index: int) -> int:
    """Rows of dim 0 that part ``index`` gets when ``torch.chunk`` cuts ``rows``.

    ``ceil(rows / parts)`` each while rows last, so the last parts may get
    fewer, even none: how FSDP2 shards a parameter and tensor parallelism a
    weight.
    """
    per_part = math.ceil(rows / parts)
    return max(0, min(per_part, rows - index * per_part))


class Checkpointed(nn.Module):
    """``module`` under activation checkpointing.

    The forward pass keeps only the module's inputs; the backward pass runs the
    module's forward again to rebuild what its gradients need
    (``torch.utils.checkpoint``, non-reentrant). Same results, less memory,
    more computation.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.module, *args, use_reentrant=False)


# The memory profiler's categories, in the order of its timeline's columns.
CATEGORIES = (
    "parameters",
    "optimizer state",
    "inputs",
    "temporaries",
    "activations",
    "gradients",
    "autograd detail",
    "unknown",
)


@dataclass(frozen=True)
class MemoryTimeline:
    """Bytes allocated per category, after each change, as the memory profiler saw them."""

    times: list[float]  # seconds since the first phase began
    bytes: dict[str, list[int]]  # category -> bytes allocated at each time
    phases: dict[str, tuple[float, float]]  # phase name -> (start, end), seconds

    @property
    def total(self) -> list[int]:
        """Bytes allocated at each time, all categories together."""
        return [sum(column) for column in zip(*self.bytes.values())]

    def peak(self, category: str | None = None) -> int:
        """Most bytes allocated at once, in one category or (None) in all."""
        return max(self.total if category is None else self.bytes[category])

    def at_end_of(self, phase: str, category: str | None = None) -> int:
        """Bytes allocated when ``phase`` ended, in one category or (None) in all."""
        end = self.phases[phase][1]
        last = max(i for i, t in enumerate(self.times) if t <= end)
        values = self.total if category is None else self.bytes[category]
        return values[last]

    def at_peak(self, category: str | None = None) -> int:
        """Bytes in one category (or all) when all categories together peaked."""
        total = self.total
        first = total.index(max(total))
        return total[first] if category is None else self.bytes[category][first]

    def peak_phase(self) -> str:
        """The phase in which all categories together peaked first ("" if outside)."""
        total = self.total
        when = self.times[total.index(max(total))]
        return next((n for n, (a, b) in self.phases.items() if a <= when <= b), "")


def memory_timeline(phases: Mapping[str, Callable[[], Any]]) -> MemoryTimeline:
    """Run the ``phases`` in order under the memory profiler; return its timeline.

    ``torch.profiler.profile(profile_memory=True, record_shapes=True,
    with_stack=True)`` records every allocation and free on the CPU, and its
    memory timeline sorts each tensor into a category (``CATEGORIES``) from
    the operations that used it: a tensor the optimizer reads and writes is
    optimizer state, a tensor made in the forward pass and used in the backward
    pass is an activation. Each phase runs inside a ``record_function`` range
    of its name. Tensors that exist before the first phase count from the start.

    PyTorch marks this timeline deprecated in favour of CUDA memory snapshots
    (``torch.cuda.memory._record_memory_history``), which a CPU does not have;
    the warning is silenced here.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no status lines on stderr
    with profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    ) as prof:
        for name, run in phases.items():
            with record_function(name):
                run()
    ranges = {
        e.name: (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.name in phases
    }
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "memory.json")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            prof.export_memory_timeline(path, device="cpu")
        with open(path, encoding="utf-8") as f:
            times, sizes = json.load(f)
    # Events count microseconds from the trace's start, the timeline from the epoch.
    offset = prof.profiler.kineto_results.trace_start_ns() / 1e3
    start = min(begin for begin, _ in ranges.values())
    times = [t - offset for t in times]
    columns = list(zip(*sizes))[1:]  # column 0 is unused
    return MemoryTimeline(
        times=[(t - start) / 1e6 for t in times],
        bytes={name: list(values) for name, values in zip(CATEGORIES, columns)},
        phases={
            n: ((a - start) / 1e6, (b - start) / 1e6) for n, (a, b) in ranges.items()
        },
    )


def cuda_memory(device: torch.device | str | int | None = None) -> dict[str, int]:
    """What the CUDA caching allocator reports for ``device``, in bytes.

    ``allocated``: held by tensors now; ``reserved``: taken from the GPU by the
    allocator, which keeps freed blocks for reuse (allocated plus its cache);
    ``peak``: the most allocated at once since the last
    ``torch.cuda.reset_peak_memory_stats``. Used in chapter 12.
    """
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
    }


@dataclass(frozen=True)
class SnapshotTimeline:
    """Bytes the CUDA caching allocator had allocated and reserved, event by event.

    Allocated bytes are those the tensors asked for (``snapshot_timeline``).

    Index 0 is before the first recorded event, index i after event i; each
    phase covers the events ``range(*phases[name])``.
    """

    allocated: list[int]
    reserved: list[int]
    phases: dict[str, tuple[int, int]]

    def peak(self) -> int:
        """Most bytes allocated at once."""
        return max(self.allocated)

    def peak_phase(self) -> str:
        """The phase whose events reached the peak first ("" if none did)."""
        event = self.allocated.index(self.peak())  # after event number `event`
        return next(
            (n for n, (a, b) in self.phases.items() if a < event <= b),
            "",
        )

    def at_end_of(self, phase: str) -> int:
        """Bytes allocated when ``phase`` ended."""
        return self.allocated[self.phases[phase][1]]


def snapshot_timeline(
    snapshot: Mapping[str, Any], marks: Mapping[str, int], device_index: int = 0
) -> SnapshotTimeline:
    """Allocated and reserved bytes after each event of a CUDA memory snapshot.

    ``snapshot`` is what ``torch.cuda.memory._snapshot()`` returns while
    ``_record_memory_history`` runs: the segments the allocator holds now
    (each cut into blocks), and a trace of its events per device. An
    ``alloc`` adds the bytes a tensor asked for and a ``free_completed``
    removes them; a ``segment_alloc`` (a ``cudaMalloc``) adds to the reserved
    bytes and a ``segment_free`` removes, and so do a ``segment_map`` and a
    ``segment_unmap``, with which the allocator grows and shrinks its
    segments under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
    (mapping more physical memory into one segment's address range, not
    asking ``cudaMalloc`` for another). The trace records the bytes asked
    for, not the block's size rounded up to 512 bytes (an H100 run with torch
    2.11 showed 4,000 for a 1,000-float tensor whose block is 4,096), so the
    allocated bytes here are the bytes asked for, the same measure as a
    tensor's ``nbytes``; ``torch.cuda.memory_allocated`` counts whole blocks
    and is a little larger. Walking back from what the live blocks asked for
    gives the values before the first event, so blocks allocated before
    recording began count too. ``marks`` gives, per phase in order, the
    number of events recorded when it ended.
    """
    trace = snapshot["device_traces"][device_index]
    segments = [
        s for s in snapshot["segments"] if s.get("device", device_index) == device_index
    ]
    steps = {"alloc": (1, 0), "free_completed": (-1, 0)}
    steps |= {"segment_alloc": (0, 1), "segment_free": (0, -1)}
    steps |= {"segment_map": (0, 1), "segment_unmap": (0, -1)}
    deltas = [
        (a * e["size"], r * e["size"])
        for e in trace
        for a, r in [steps.get(e["action"], (0, 0))]
    ]
    asked = sum(
        b["requested_size"]
        for s in segments
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    )
    allocated = [asked - sum(a for a, _ in deltas)]
    reserved = [sum(s["total_size"] for s in segments) - sum(r for _, r in deltas)]
    for a, r in deltas:
        allocated.append(allocated[-1] + a)
        reserved.append(reserved[-1] + r)
    phases, start = {}, 0
    for name, end in marks.items():
        phases[name] = (start, min(end, len(trace)))
        start = phases[name][1]
    return SnapshotTimeline(allocated, reserved, phases)


def record_snapshot(
    phases: Mapping[str, Callable[[], Any]],
    device: torch.device | str | None = None,
    path: str | os.PathLike | None = None,
) -> SnapshotTimeline:
    """Run the ``phases`` in order on a CUDA device, recording the allocator's events.

    ``torch.cuda.memory._record_memory_history`` keeps every allocation and
    free with the Python stack that made it; after each phase a snapshot
    counts the events so far. With ``path``, the whole snapshot is also
    written there (``torch.cuda.memory._dump_snapshot``): a pickle that
    PyTorch's viewer at pytorch.org/memory_viz draws as stacks of tensors,
    each with the line of code that allocated it. PyTorch recommends these
    snapshots for CUDA memory; the profiler's ``memory_timeline`` is its
    older view. Used in chapter 12.
    """
    device = torch.device("cuda" if device is None else device)
    index = torch.cuda.current_device() if device.index is None else device.index
    memory = torch.cuda.memory
    torch.cuda.synchronize(device)
    memory._record_memory_history(
        enabled="all",
        context="all",  # a stack for every allocation and free
        stacks="python",  # Python frames only: C++ ones make it slow and large
        max_entries=1_000_000,
        clear_history=True,
    )
    marks = {}
    try:
        for name, run in phases.items():
            run()
            torch.cuda.synchronize(device)
            marks[name] = len(memory._snapshot()["device_traces"][index])
        snapshot = memory._snapshot()
        if path is not None:
            memory._dump_snapshot(os.fspath(path))
    finally:
        memory._record_memory_history(enabled=None)
    return snapshot_timeline(snapshot, marks, index)


def plot_snapshot(timeline: SnapshotTimeline, ax: Any = None) -> Any:
    """Draw allocated and reserved MiB over the allocator's events, phases shaded.

    Returns the matplotlib axes (new ones when ``ax`` is None). Used in chapter 12.
    """
    from companion.harness.plotting import new_axes

    if ax is None:
        (ax,) = new_axes(width=7.0, height=3.4)
    mib = 2**20
    events = range(len(timeline.allocated))
    ax.step(
        events, [b / mib for b in timeline.reserved], where="post", label="reserved"
    )
    ax.step(
        events, [b / mib for b in timeline.allocated], where="post", label="allocated"
    )
    for i, (name, (start, end)) in enumerate(timeline.phases.items()):
        ax.axvspan(start, end, color="0.9" if i % 2 else "0.97", zorder=0)
        ax.annotate(
            name,
            ((start + end) / 2, 1.0),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    peak = timeline.allocated.index(timeline.peak())
    ax.plot(peak, timeline.peak() / mib, "k*", markersize=10, label="peak")
    ax.set(xlabel="allocator events since the step began", ylabel="MiB")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)
    return ax
