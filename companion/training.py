"""Training helpers shared by the chapters: accuracy, evaluation, a training loop.

``train_classifier`` is the loop chapter 04 builds by hand, with a tqdm
progress bar per epoch; it returns a history that ``plot_history`` draws.

Used in chapters 04, 07 and 08.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from companion.harness.timing import Benchmark, format_time

__all__ = ["accuracy", "evaluate_accuracy", "train_classifier"]


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Return the fraction of rows of ``logits`` whose arg-max equals ``labels``."""
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"{logits.shape[0]} predictions but {labels.shape[0]} labels.")
    if labels.numel() == 0:
        raise ValueError("accuracy of an empty batch is undefined.")
    # .item() copies to the host: a synchronisation point on a GPU.
    return (logits.argmax(dim=1) == labels).float().mean().item()


@torch.no_grad()
def evaluate_accuracy(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | str = "cpu",
) -> float:
    """Return ``model``'s accuracy over all ``(inputs, labels)`` batches.

    The model is put in evaluation mode for the pass and restored afterwards.
    """
    was_training = model.training
    model.eval()
    correct = total = 0
    try:
        for inputs, labels in batches:
            inputs, labels = inputs.to(device), labels.to(device)
            correct += (model(inputs).argmax(dim=1) == labels).sum().item()
            total += labels.numel()
    finally:
        model.train(was_training)
    if total == 0:
        raise ValueError("evaluate_accuracy got no batches.")
    return correct / total


def train_classifier(
    model: nn.Module,
    train_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    num_epochs: int,
    test_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> dict[str, list[float]]:
    """Train ``model`` for ``num_epochs`` epochs and return its history.

    Each epoch runs ``zero_grad``, ``backward`` and ``step`` on every batch of
    ``train_batches`` (a ``DataLoader`` or any re-iterable of ``(inputs,
    labels)``), then measures accuracy on ``test_batches`` if given.

    Args:
        model: a classifier returning logits of shape ``(batch, classes)``.
        optimizer: an optimizer over ``model``'s parameters.
        num_epochs: passes over ``train_batches``.
        test_batches: evaluated in ``eval`` mode after each epoch.
        loss_fn: loss of ``(logits, labels)``.
        device: where to train; by default the device the model's parameters
            are on. The model is moved there and each batch is copied there
            with ``non_blocking=True`` (pin the batches to overlap the copies).
        progress: show a tqdm bar per epoch and print one summary line per
            epoch (on stdout, so bars and lines keep their order).

    Returns:
        ``{"train loss": [...], "train accuracy": [...]}`` with one value per
        epoch (loss and accuracy averaged over the epoch's examples while the
        model was learning), plus ``"test accuracy"`` when ``test_batches``
        is given.
    """
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be at least 1, not {num_epochs}.")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    model.to(device)
    history: dict[str, list[float]] = {"train loss": [], "train accuracy": []}
    if test_batches is not None:
        history["test accuracy"] = []
    for epoch in range(1, num_epochs + 1):
        model.train()
        # Sums stay on the device: calling .item() on every step would make
        # the host wait for the accelerator each time.
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        count = 0
        bar = tqdm(
            train_batches,
            desc=f"epoch {epoch}/{num_epochs}",
            unit="batch",
            file=sys.stdout,  # looked up now: Jupyter replaces sys.stdout
            leave=True,
            mininterval=0.5,  # seconds between redraws: fewer states stored in notebooks
            disable=not progress,
        )
        # Benchmark synchronises the accelerator at both ends: the time covers
        # the epoch's work, not just the queueing of it.
        with Benchmark(quiet=True) as epoch_time:
            for step, (inputs, labels) in enumerate(bar):
                # non_blocking: from pinned memory the copy need not hold up
                # Python; from pageable memory, or on a CPU, it changes nothing.
                inputs = inputs.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                logits = model(inputs)
                loss = loss_fn(logits, labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach() * labels.numel()
                correct += (logits.argmax(dim=1) == labels).sum()
                count += labels.numel()
                if progress and step % 10 == 0:
                    # .item() is a sync, so rarely; "~" marks a
                    # value that varies between machines
                    bar.set_postfix_str(f"loss ~{loss.item():.3f}", refresh=False)
        if count == 0:
            raise ValueError("train_classifier got no training batches.")
        history["train loss"].append(loss_sum.item() / count)
        history["train accuracy"].append(correct.item() / count)
        # "~" marks values that vary between machines (float rounding grows
        # during training); the notebook checks mask them and check verdicts.
        line = (
            f"epoch {epoch}/{num_epochs}: train loss ~{history['train loss'][-1]:.3f}, "
            f"train accuracy ~{history['train accuracy'][-1]:.3f}"
        )
        if test_batches is not None:
            history["test accuracy"].append(
                evaluate_accuracy(model, test_batches, device)
            )
            line += f", test accuracy ~{history['test accuracy'][-1]:.3f}"
        if progress:
            print(
                f"{line} ({format_time(epoch_time.elapsed)} training)",
                file=sys.stdout,
                flush=True,
            )
    return history
