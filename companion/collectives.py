"""Count the collectives of a training step: calls and bytes, per kind and phase.

``CollectiveCounter`` is PyTorch's ``CommDebugMode``
(``torch.distributed.tensor.debug``), which sees every collective a process
dispatches: DTensor's functional collectives, and those of
``torch.distributed`` (c10d), such as FSDP2's all-gathers and reduce-scatters
or a hand-written ``all_reduce``. It adds the bytes of each call's input and
output, and files each call under a phase of the step: ``forward`` (with the
loss), ``backward`` and ``optimizer``, which ``follow(model, optimizer)``
switches as the step goes on. The counts are what one rank sees. Used in
chapters 12 and 13.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any, Self

import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

__all__ = ["PHASES", "CollectiveCounter", "add_counts"]

PHASES = ("forward", "backward", "optimizer")

# op -> (kind, its input, its output): an argument's position, or "out" for
# what the op returns. c10d's ops write into an argument, the output first.
OPS: dict[str, tuple[str, int, int | str]] = {
    "all_reduce": ("all-reduce", 0, "out"),  # functional collectives (DTensor)
    "all_gather_into_tensor": ("all-gather", 0, "out"),
    "reduce_scatter_tensor": ("reduce-scatter", 0, "out"),
    "all_to_all_single": ("all-to-all", 0, "out"),  # Shard -> Shard on nccl
    "allreduce_": ("all-reduce", 0, 0),  # c10d (torch.distributed)
    "_allgather_base_": ("all-gather", 1, 0),
    "allgather_": ("all-gather", 1, 0),
    "_reduce_scatter_base_": ("reduce-scatter", 1, 0),
    "reduce_scatter_": ("reduce-scatter", 1, 0),
    "broadcast_": ("broadcast", 0, 0),
}


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value``: a tensor, or a (nested) list or tuple."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _tracker_hooking_each_module_once() -> Any:
    """``CommDebugMode``'s module tracker with the fix of pytorch/pytorch#191452.

    Before that fix (July 2026) the tracker hooked a module's end of forward
    again at every call without removing the previous hook, so a module run
    twice under one mode (two micro-batches in one step) popped its list of
    parents twice and raised an IndexError: torch 2.10 and 2.11 raise it (2.11
    was first caught on the GPU machine). This tracker removes the previous
    hook first, as the fixed releases do; on those it changes nothing.
    """
    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker

    class Tracker(_CommModeModuleTracker):
        def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
            if not self.is_bw:
                stale = self.register_forward_hook_handles.pop(
                    self._get_mod_name(mod), None
                )
                if stale is not None:
                    stale.remove()
            super()._fw_pre_hook(mod, input)

    return Tracker()


def add_counts(*counts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Add up counts of the form ``{kind: {"calls", "input_bytes", "output_bytes"}}``."""
    total: dict[str, dict[str, int]] = {}
    for kinds in counts:
        for kind, row in kinds.items():
            into = total.setdefault(kind, dict.fromkeys(row, 0))
            for key, value in row.items():
                into[key] += value
    return total


class CollectiveCounter(CommDebugMode):
    """``CommDebugMode`` that also counts bytes and phases.

    ::

        with CollectiveCounter().follow(model, optimizer) as counter:
            train_step(model, optimizer, x, y)
        counter.counts  # {"forward": {"all-reduce": {"calls": 4, ...}}, ...}

    ``counts`` maps each phase to the kinds of collective seen in it, each
    with its calls and the bytes of their inputs and outputs; ``total()``
    adds the phases up.
    """

    def __init__(self) -> None:
        super().__init__()
        self.advanced_module_tracker = _tracker_hooking_each_module_once()
        self.phase = PHASES[0]
        self.counts: dict[str, dict[str, dict[str, int]]] = {p: {} for p in PHASES}
        self._handles: list[Any] = []
        self._quiet = warnings.catch_warnings()

    def follow(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> Self:
        """Switch phases with ``model`` and ``optimizer``: forward when the model
        starts, backward when the gradient of its output arrives, optimizer when
        ``optimizer.step`` starts."""

        def phase(name: str) -> Callable[..., None]:
            return lambda *_: setattr(self, "phase", name)

        def watch_output(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(phase("backward"))

        self._handles += [
            model.register_forward_pre_hook(phase("forward")),
            model.register_forward_hook(watch_output),
        ]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(phase("optimizer")))
        return self

    def total(self) -> dict[str, dict[str, int]]:
        """The counts of every phase added up."""
        return add_counts(*self.counts.values())

    def __enter__(self) -> Self:
        self._quiet.__enter__()
        # Noise that the mode itself causes: its module tracker hooks every
        # module's backward, which PyTorch warns about when the model's input
        # (token ids) needs no gradient; and under a dispatch mode the model's
        # output is a view, which FSDP2 warns about (in-place ops on it would
        # skip its hooks; the steps make none).
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* view")
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._quiet.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:  # CommDebugMode counted a collective
            name = re.sub(r"^.*::|\..*$", "", func.name())
            kind, source, target = OPS.get(name, (name, 0, "out"))
            row = self.counts[self.phase].setdefault(
                kind, {"calls": 0, "input_bytes": 0, "output_bytes": 0}
            )
            row["calls"] += 1
            row["input_bytes"] += _nbytes(args[source])
            row["output_bytes"] += _nbytes(out if target == "out" else args[target])
        return out
