"""Helpers for the tests of the GPT scripts of chapters 12-13 (fsdp_gpt.py,
tensor_parallel_gpt.py, pipeline_gpt.py), which carry a copy of the course's
model so that each stands alone."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict
from types import ModuleType

import pytest
import torch

from companion.gpt import GPT, CharText, GPTConfig, lm_loss
from companion.launch import script_path


def load_script(name: str) -> ModuleType:
    """Import ``companion/scripts/NAME`` as a module, without running its main()."""
    spec = importlib.util.spec_from_file_location(
        name.removesuffix(".py"), script_path(name)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_model_copy(script: ModuleType) -> None:
    """The script's copy of the model: the same parameters, logits and batches, bit for bit."""
    text, copy_text = CharText(), script.CharText()
    assert torch.equal(text.ids, copy_text.ids)
    for sizes in (
        {},
        {"n_layer": 3, "n_head": 2, "n_embd": 24, "block_size": 32},
        {"sdpa": True},
    ):
        config = GPTConfig(vocab_size=text.vocab_size, **sizes)
        torch.manual_seed(3)
        ours = GPT(config)
        torch.manual_seed(3)
        theirs = script.GPT(script.GPTConfig(**asdict(config)))
        mine, copied = dict(ours.named_parameters()), dict(theirs.named_parameters())
        assert mine.keys() == copied.keys()
        assert all(torch.equal(mine[k], copied[k]) for k in mine)
        g1, g2 = (torch.Generator().manual_seed(5) for _ in range(2))
        (x, y), (x2, y2) = text.batch(4, 16, g1), copy_text.batch(4, 16, g2)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(ours(x), theirs(x))
        assert torch.equal(lm_loss(ours(x), y), script.lm_loss(theirs(x), y))
    with pytest.raises(script.UsageError, match="multiple of n_head"):
        script.GPTConfig(n_head=3, n_embd=8)


def run_in_process(
    script: ModuleType, monkeypatch, capsys, args: list[str], world_size: int
) -> tuple[int, str]:
    """Run the script's main() here as rank 0 of ``world_size``; return its exit code and stderr.

    Every case is refused before the processes would meet; ``--timeout 5``
    bounds the wait if one were not.
    """
    for name, value in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", world_size)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(sys, "argv", [script.SCRIPT, *args, "--timeout", "5"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        script.run_main(script.main)
    return stopped.value.code, capsys.readouterr().err
