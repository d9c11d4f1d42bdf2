"""Helpers for the tests of chapters 12-13's GPT scripts and their checks.

The scripts (fsdp_gpt.py, tensor_parallel_gpt.py, pipeline_gpt.py) import
the course's model from their sibling gpt_model.py; their checks
(companion/checks/) measure around the scripts' own functions. What the tests
expect is computed here, independently of both.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from launchers import SIMULATED_GPU

from companion.gpt import GPT, CharText, GPTConfig, lm_loss
from companion.harness.launch import launch

# The scripts train in float32 by default; their tests compare with one
# process in float64, as the checks do.
FLOAT64 = ["--dtype", "float64"]


def check_model_copy(script: ModuleType) -> None:
    """The scripts' model (gpt_model.py): the same parameters, logits and batches as
    companion.gpt's, bit for bit."""
    text, copy_text = CharText(), script.CharText()
    assert copy_text.chars == text.chars and torch.equal(text.ids, copy_text.ids)
    for sizes in ({}, {"n_layer": 3, "n_head": 2, "n_embd": 24, "block_size": 32}):
        config = GPTConfig(vocab_size=text.vocab_size, **sizes)
        torch.manual_seed(3)
        ours = GPT(config)
        torch.manual_seed(3)
        sizes = {k: v for k, v in asdict(config).items() if k != "sdpa"}
        theirs = script.GPT(script.GPTConfig(**sizes))
        mine, copied = dict(ours.named_parameters()), dict(theirs.named_parameters())
        assert mine.keys() == copied.keys()
        assert all(torch.equal(mine[k], copied[k]) for k in mine)
        g1, g2 = (torch.Generator().manual_seed(5) for _ in range(2))
        (x, y), (x2, y2) = text.batch(4, 16, g1), copy_text.batch(4, 16, g2)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(ours(x), theirs(x))
        assert torch.equal(lm_loss(ours(x), y), script.lm_loss(theirs(x), y))


def reference_losses(
    steps: int, *, batch_size: int = 8, seq_len: int = 64, n_layer: int = 2
) -> list[float]:
    """The plain model in this process, the whole batch, float64, Adam at 3e-3,
    seed 0: what every layout must reproduce, written out here."""
    text = CharText()
    config = GPTConfig(vocab_size=text.vocab_size, block_size=64, n_layer=n_layer)
    torch.manual_seed(0)
    model = GPT(config).to(torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    batches = [text.batch(batch_size, seq_len, g) for _ in range(steps)]
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def refusal(
    run, monkeypatch, capsys, world_size: int, name: str, argv: list[str] = ()
) -> str:
    """Call ``run()`` (a ``parse_args`` or a check's ``main``) as one of
    ``world_size`` processes started as ``name argv``; assert that it exits
    with code 2 and return what it printed on stderr."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(sys, "argv", [name, *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run()
    assert stopped.value.code == 2
    return capsys.readouterr().err


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A gloo process group of this process alone, destroyed afterwards."""
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def on_simulated_gpus(program: str, args: list, nproc: int, timeout: float) -> dict:
    """Launch ``program`` (a check or a script in companion/) on its GPU path, one
    simulated GPU per process (tests/programs/simulated_gpu.py): the collectives
    go through gloo, and a CPU tensor in a collective or beside a GPU tensor
    raises what CUDA or nccl would."""
    path = Path(__file__).resolve().parents[1] / "companion" / program
    gpus = ",".join(map(str, range(nproc)))  # launch hides this machine's (no) GPUs
    return launch(
        SIMULATED_GPU,
        [path, *args],
        nproc=nproc,
        timeout=timeout,
        env={"CUDA_VISIBLE_DEVICES": gpus},
    )
