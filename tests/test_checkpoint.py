"""Tests of companion.checkpoint: atomic writes, safe and clear reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from companion.checkpoint import (
    CheckpointError,
    _first_line,
    load_checkpoint,
    save_checkpoint,
)
from companion.harness.notebook import CourseError


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_round_trip_restores_model_optimizer_and_extras(tmp_path: Path) -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()  # creates momentum buffers, so the optimizer has state
    path = save_checkpoint(
        tmp_path / "run" / "ckpt.pt",
        model,
        optimizer,
        epoch=3,
        history={"loss": [0.5, 0.25]},
    )

    fresh = make_model()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = load_checkpoint(path, fresh, fresh_opt)

    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert state["epoch"] == 3
    assert state["history"] == {"loss": [0.5, 0.25]}
    saved_buf = optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["momentum_buffer"], saved_buf)
    assert [p.name for p in path.parent.iterdir()] == [
        "ckpt.pt"
    ]  # no temporary file left


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    model = make_model()
    path = save_checkpoint(tmp_path / "ckpt.pt", model, epoch=1)
    before = path.read_bytes()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(CheckpointError, match="previous checkpoint there is unchanged"):
        save_checkpoint(
            path, model, epoch=2, note=lambda: None
        )  # a lambda cannot be pickled
    assert path.read_bytes() == before
    assert load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_interrupted_write_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_checkpoint(tmp_path / "ckpt.pt", make_model(), epoch=1)
    before = path.read_bytes()

    def half_write(obj, f) -> None:  # writes some bytes, then "the job is killed"
        f.write(before[: len(before) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, make_model(), epoch=2)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_gives_one_sentence_and_is_left_alone(
    tmp_path: Path, damage: str
) -> None:
    path = save_checkpoint(tmp_path / "ckpt.pt", make_model())
    data = path.read_bytes()
    damaged = {
        "truncate": data[: len(data) // 2],
        "garbage": b"not a checkpoint" * 8,
        "empty": b"",
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, make_model())
    message = str(info.value)
    assert message == (
        f"{path} is truncated or corrupt and was not loaded (the file is left as it "
        "is); load an earlier checkpoint or train again."
    )
    assert "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert path.read_bytes() == damaged
    assert isinstance(info.value, CourseError)  # shown as one line in notebooks


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="There is no checkpoint file at"):
        load_checkpoint(tmp_path / "nope.pt")


class _Payload:
    def __reduce__(self):
        return (exec, ("raise SystemExit('the payload ran')",))


def test_code_in_the_file_is_refused_not_run(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": _Payload()}, path)
    with pytest.raises(
        CheckpointError, match="GLOBAL .*exec.*weights_only=False"
    ) as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


def test_wrong_architecture_is_one_sentence(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt.pt", make_model())
    with pytest.raises(
        CheckpointError,
        match=r"does not fit this model or optimizer \(Missing key\(s\) in state_dict",
    ) as info:
        load_checkpoint(path, nn.Linear(3, 2))
    assert "\n" not in str(info.value)


def test_not_a_checkpoint_dict(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save(torch.zeros(3), path)
    with pytest.raises(
        CheckpointError, match="not a checkpoint written by save_checkpoint"
    ):
        load_checkpoint(path)


def test_map_location_moves_tensors(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt.pt", make_model())
    state = load_checkpoint(path, map_location="meta")
    assert all(t.device.type == "meta" for t in state["model"].values())


def test_messages_name_the_cause_in_its_first_informative_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(obj, f) -> None:
        raise RuntimeError("Cannot save:\n  disk quota exceeded.\n  (errno 122)")

    monkeypatch.setattr(torch, "save", refuse)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path / "ckpt.pt", make_model())
    assert str(info.value) == (
        f"Could not write the checkpoint {tmp_path / 'ckpt.pt'} (RuntimeError: disk "
        "quota exceeded); any previous checkpoint there is unchanged."
    )


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        (
            "Error(s) in loading:\n\tsize mismatch for 0.weight.",
            "size mismatch for 0.weight",
        ),
        ("one line only:", "one line only:"),  # a lone header is all there is
        ("first.\nsecond", "first"),
        ("..first.", "..first"),  # only trailing dots go
        ("", "no details"),
    ],
)
def test_first_line(message: str, shown: str) -> None:
    assert _first_line(RuntimeError(message)) == shown


def test_the_temporary_file_sits_beside_the_checkpoint_in_new_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs" / "a" / "ckpt.pt"  # folders that do not exist yet
    seen = []
    real_replace = os.replace

    def watch(src, dst) -> None:  # the rename that completes the write
        seen.append(Path(src))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", watch)
    save_checkpoint(path, make_model())
    (tmp,) = seen
    assert tmp.parent == path.parent
    assert tmp.name.startswith(".ckpt.pt.") and tmp.name.endswith(".tmp")
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]
