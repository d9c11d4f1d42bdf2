"""Checkpoints that survive a crash mid-write and refuse to run code when read.

- ``save_checkpoint`` writes to a temporary file in the target's folder and
  renames it over the target with ``os.replace`` (atomic on POSIX and
  Windows): readers see the old checkpoint or the new one, never half of one.
- ``load_checkpoint`` reads with ``torch.load(weights_only=True)``, which
  rebuilds tensors and plain containers only; a file holding anything else,
  or a truncated or corrupt file, raises ``CheckpointError`` with one sentence.

Used in chapter 04.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from companion.harness.notebook import CourseError

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint"]


class CheckpointError(CourseError):
    """A checkpoint could not be written or read; the message says why in one sentence."""


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **extra: Any,
) -> Path:
    """Write the model's (and optimizer's) state to ``path`` atomically.

    Args:
        path: the checkpoint file; its folder is created if needed.
        model: the model whose ``state_dict`` is saved (pass the unwrapped
            model, not a DDP or compiled wrapper).
        optimizer: saved too when given, so that training can resume.
        **extra: plain values to store alongside (``epoch=3``, a history dict).

    Returns:
        The path written.

    Raises:
        CheckpointError: the state could not be serialised or written; any
            previous checkpoint at ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"model": model.state_dict(), **extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    # The temporary file lives in the same folder: os.replace is only atomic
    # within one file system.
    fd, tmp_name = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
    )
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename
        os.replace(tmp_name, path)
    except BaseException as exc:  # Ctrl-C too: never leave a half-written file
        Path(tmp_name).unlink(missing_ok=True)
        if not isinstance(exc, Exception):
            raise
        raise CheckpointError(
            f"Could not write the checkpoint {path} ({type(exc).__name__}: "
            f"{_first_line(exc)}); "
            f"any previous checkpoint there is unchanged."
        ) from exc
    return path


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    map_location: str | torch.device | None = "cpu",
) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` and restore its states.

    Args:
        path: the checkpoint file.
        model: if given, its parameters are replaced by the saved ones.
        optimizer: if given, its state is replaced by the saved one.
        map_location: where the tensors go (``"cpu"`` loads a GPU-saved file
            on any machine; ``None`` keeps the devices they were saved from).

    Returns:
        The whole checkpoint: ``"model"``, ``"optimizer"`` and the extras.

    Raises:
        CheckpointError: the file is missing, truncated or corrupt, holds
            objects other than tensors and plain values, or does not fit the
            model. The file itself is never modified.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"There is no checkpoint file at {path}.")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        unsafe = re.search(r"Unsupported global: GLOBAL [\w.]+", str(exc))
        if unsafe:
            raise CheckpointError(
                f"{path} holds objects other than tensors and plain values "
                f"({unsafe.group(0)}), so it was not loaded; only load it with "
                f"torch.load(weights_only=False) if you trust whoever made it."
            ) from None
        raise _corrupt(path) from None
    except (RuntimeError, EOFError, ValueError, OSError):
        raise _corrupt(path) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a checkpoint written by save_checkpoint.")
    try:
        if model is not None:
            model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(
            f"{path} does not fit this model or optimizer ({_first_line(exc)})."
        ) from None
    return state


def _corrupt(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} is truncated or corrupt and was not loaded (the file is left as it "
        "is); "
        f"load an earlier checkpoint or train again."
    )


def _first_line(exc: BaseException) -> str:
    """Return the first informative line of an error message (skipping a "...:" header)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]
    return lines[0].rstrip(".") if lines else "no details"
