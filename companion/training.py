"""Training helpers shared by the chapters: accuracy and evaluation.

Used in chapters 04, 07 and 08.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["accuracy", "evaluate_accuracy"]


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
