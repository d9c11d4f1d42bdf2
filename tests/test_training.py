"""Tests of companion.training: accuracy, evaluation and the training loop."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from companion.training import accuracy, evaluate_accuracy, train_classifier


def blobs(n: int = 256, seed: int = 0) -> TensorDataset:
    """Two well separated Gaussian blobs in 2-D, labels 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    centres = torch.tensor([[-2.0, 2.0], [2.0, -2.0]])
    return TensorDataset(centres[labels] + 0.5 * torch.randn(n, 2, generator=g), labels)


def test_accuracy_counts_matching_argmax() -> None:
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, -1.0], [0.1, 0.2]])
    assert accuracy(logits, torch.tensor([0, 1, 1, 0])) == pytest.approx(0.5)


def test_evaluate_accuracy_restores_training_mode() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model.train()
    loader = DataLoader(blobs(32), batch_size=8)
    evaluate_accuracy(model, loader)
    assert model.training


def test_train_classifier_learns_and_returns_history() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
    train = DataLoader(blobs(256, seed=0), batch_size=32, shuffle=True)
    test = DataLoader(blobs(128, seed=1), batch_size=64)
    before = evaluate_accuracy(model, test)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = train_classifier(
        model, train, optimizer, num_epochs=3, test_batches=test, progress=False
    )

    assert set(history) == {"train loss", "train accuracy", "test accuracy"}
    assert all(len(values) == 3 for values in history.values())
    assert history["train loss"][-1] < history["train loss"][0]
    assert history["test accuracy"][-1] > 0.95 > before
    assert history["test accuracy"][-1] == evaluate_accuracy(model, test)


def test_train_classifier_reports_progress_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Linear(2, 2)
    train = DataLoader(blobs(64), batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_classifier(model, train, optimizer, num_epochs=2)
    out, err = capsys.readouterr()
    assert err == ""
    assert "epoch 1/2: 100%|" in out and "4/4" in out  # the finished tqdm bar stays
    assert re.search(r"^epoch 2/2: train loss \d\.\d{3}, train accuracy \d\.\d{3} \(", out, re.M)


def test_train_classifier_without_progress_is_silent(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [next(iter(DataLoader(blobs(8), batch_size=8)))]  # any re-iterable works
    history = train_classifier(model, batches, optimizer, num_epochs=1, progress=False)
    assert capsys.readouterr() == ("", "")
    assert set(history) == {"train loss", "train accuracy"}


class RecordingLinear(nn.Linear):
    """A linear layer that records where it was moved and where its inputs came from."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.moved_to: list[torch.device] = []
        self.input_devices: set[torch.device] = set()

    def to(self, *args, **kwargs):
        self.moved_to.append(torch.device(args[0]))
        return super().to(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_devices.add(x.device)
        return super().forward(x)


@pytest.mark.parametrize("device", [None, "cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
def test_train_classifier_moves_model_and_batches_to_the_device(device: str | None) -> None:
    model = RecordingLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(blobs(16), batch_size=8)
    train_classifier(model, loader, optimizer, num_epochs=1, device=device, progress=False)
    expected = torch.device(device or "cpu")
    assert model.moved_to == [expected]
    assert model.input_devices == {expected}
    assert model.weight.device == expected


def test_train_classifier_rejects_bad_input() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="num_epochs must be at least 1"):
        train_classifier(model, [], optimizer, num_epochs=0)
    with pytest.raises(ValueError, match="no training batches"):
        train_classifier(model, [], optimizer, num_epochs=1, progress=False)
