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
    assert accuracy(logits, torch.tensor([0, 1, 0, 1])) == 1.0
    with pytest.raises(ValueError, match=r"^4 predictions but 3 labels\.$"):
        accuracy(logits, torch.tensor([0, 1, 1]))
    with pytest.raises(
        ValueError, match=r"^accuracy of an empty batch is undefined\.$"
    ):
        accuracy(logits[:0], torch.tensor([], dtype=torch.long))


class ModeRecorder(nn.Module):
    """Predicts class 1 when x[:, 0] > 0, and records the mode of each forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return torch.stack([-x[:, 0], x[:, 0]], dim=1) * self.scale


@pytest.mark.parametrize("start_in_training_mode", [True, False])
def test_evaluate_accuracy_evaluates_in_eval_mode_and_restores_it(
    start_in_training_mode: bool,
) -> None:
    model = ModeRecorder()
    model.train(start_in_training_mode)
    batches = [(torch.tensor([[1.0], [-1.0]]), torch.tensor([1, 0]))] * 3
    assert evaluate_accuracy(model, batches) == 1.0
    assert model.modes == [False, False, False]  # every batch in eval() mode
    assert model.training is start_in_training_mode


def test_evaluate_accuracy_switches_dropout_off() -> None:
    # In training mode, dropout would zero about half the logits and miss some.
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.9))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2) * 10)
        model[0].bias.zero_()
    points = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).repeat(64, 1)
    labels = torch.tensor([0, 1]).repeat(64)
    assert evaluate_accuracy(model.train(), [(points, labels)]) == 1.0
    assert model.training


def test_evaluate_accuracy_weights_batches_by_their_size() -> None:
    # 3 of 3 right, then 0 of 1: 3/4 of the examples (a mean of batch accuracies
    # would say 1/2).
    batches = [
        (torch.tensor([[1.0], [2.0], [-1.0]]), torch.tensor([1, 1, 0])),
        (torch.tensor([[5.0]]), torch.tensor([0])),
    ]
    assert evaluate_accuracy(ModeRecorder(), batches) == 0.75
    with pytest.raises(ValueError, match=r"^evaluate_accuracy got no batches\.$"):
        evaluate_accuracy(ModeRecorder(), [])


def test_evaluate_accuracy_computes_no_gradients() -> None:
    model = ModeRecorder()
    grads = []
    model.register_forward_hook(lambda m, i, out: grads.append(out.requires_grad))
    evaluate_accuracy(model, [(torch.tensor([[1.0]]), torch.tensor([1]))])
    assert grads == [False]


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


def test_train_classifier_reports_progress_on_stdout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = nn.Linear(2, 2)
    train = DataLoader(blobs(64), batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_classifier(model, train, optimizer, num_epochs=2)
    out, err = capsys.readouterr()
    assert err == ""
    assert "epoch 1/2: 100%|" in out and "4/4" in out  # the finished tqdm bar stays
    assert re.search(
        r"4/4 \[[^]]*batch/s, loss ~\d\.\d{3}\]", out
    )  # units and the loss postfix
    assert re.search(
        r"^epoch 2/2: train loss ~\d\.\d{3}, train accuracy ~\d\.\d{3} \(", out, re.M
    )
    assert re.search(r"^epoch 2/2: .* \(\d+(\.\d+)? [mun]?s training\)$", out, re.M)


def test_train_classifier_history_is_the_mean_over_examples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # With a learning rate of 0 the model never changes, so the epoch's loss and
    # accuracy are those of the fixed model over all 40 examples (batches 16, 16, 8).
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    data = blobs(40, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    history = train_classifier(
        model,
        DataLoader(data, batch_size=16),
        optimizer,
        num_epochs=2,
        test_batches=DataLoader(data, batch_size=40),
    )
    inputs, labels = data.tensors
    with torch.no_grad():
        logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    right = (logits.argmax(dim=1) == labels).float().mean().item()
    assert history["train loss"] == pytest.approx([loss, loss], rel=1e-6)
    assert history["train accuracy"] == pytest.approx([right, right])
    assert history["test accuracy"] == pytest.approx([right, right])
    assert 0 < right < 1  # an untrained model: a wrong count would show
    summary = f"epoch 2/2: train loss ~{loss:.3f}, train accuracy ~{right:.3f}, test accuracy ~{right:.3f} ("
    assert summary in capsys.readouterr().out


def test_train_classifier_without_progress_is_silent(
    capsys: pytest.CaptureFixture[str],
) -> None:
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


@pytest.mark.parametrize(
    "device", [None, "cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
)
def test_train_classifier_moves_model_and_batches_to_the_device(
    device: str | None,
) -> None:
    model = RecordingLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(blobs(16), batch_size=8)
    train_classifier(
        model, loader, optimizer, num_epochs=1, device=device, progress=False
    )
    expected = torch.device(device or "cpu")
    assert model.moved_to == [expected]
    assert model.input_devices == {expected}
    assert model.weight.device == expected


def test_train_classifier_copies_batches_with_non_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both the inputs and the labels go to the device with non_blocking=True, so
    that pinned batches can overlap with the step (chapter 06)."""
    calls = []
    original = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        calls.append(kwargs.get("non_blocking", False))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(blobs(16), batch_size=8)
    train_classifier(model, loader, optimizer, num_epochs=1, progress=False)
    assert calls.count(True) == 4  # two batches, inputs and labels
    assert model.weight.device.type == "cpu"


def test_train_classifier_rejects_bad_input() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^num_epochs must be at least 1, not 0\.$"):
        train_classifier(model, [], optimizer, num_epochs=0)
    with pytest.raises(
        ValueError, match=r"^train_classifier got no training batches\.$"
    ):
        train_classifier(model, [], optimizer, num_epochs=1, progress=False)
    train_classifier(
        model,
        [(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))],
        optimizer,
        num_epochs=1,
        progress=False,
    )
