"""The small GPT of chapters 12-13: sizes, causality, both attentions, learning."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from companion import CourseError
from companion.gpt import (
    GPT,
    CharText,
    GPTConfig,
    add_checkpoints,
    count_parameters_formula,
    lm_loss,
    zen_of_python,
)
from companion.memory import Checkpointed

SMALL = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=8)


@pytest.mark.parametrize(
    "config",
    [
        SMALL,
        GPTConfig(),
        GPTConfig(vocab_size=50, block_size=32, n_layer=3, n_head=4, n_embd=24),
    ],
)
def test_the_parameter_formula_counts_every_parameter(config: GPTConfig) -> None:
    model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == count_parameters_formula(
        config
    )


def test_logits_have_one_row_per_position_and_token() -> None:
    idx = torch.randint(SMALL.vocab_size, (3, 5))
    assert GPT(SMALL)(idx).shape == (3, 5, SMALL.vocab_size)


@pytest.mark.parametrize("sdpa", [False, True])
def test_a_position_does_not_see_the_future(sdpa: bool) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL.__dict__, "sdpa": sdpa}))
    idx = torch.randint(SMALL.vocab_size, (2, 10))
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % SMALL.vocab_size
    before, after = model(idx), model(changed)
    assert torch.equal(before[:, :6], after[:, :6])
    assert not torch.allclose(before[:, 6:], after[:, 6:])


def test_fused_attention_computes_the_written_out_one() -> None:
    torch.manual_seed(0)
    written_out = GPT(SMALL)
    fused = GPT(GPTConfig(**{**SMALL.__dict__, "sdpa": True}))
    fused.load_state_dict(written_out.state_dict())
    idx = torch.randint(SMALL.vocab_size, (4, 16))
    torch.testing.assert_close(fused(idx), written_out(idx), rtol=1e-5, atol=1e-6)


def test_too_long_a_sequence_is_one_sentence() -> None:
    idx = torch.zeros(1, SMALL.block_size + 1, dtype=torch.long)
    with pytest.raises(CourseError, match=r"^sequences of 17 tokens are longer"):
        GPT(SMALL)(idx)


def test_heads_must_divide_the_width() -> None:
    with pytest.raises(CourseError, match="multiple of n_head"):
        GPTConfig(n_head=3, n_embd=8)


def test_zen_of_python_is_returned_not_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = zen_of_python()
    assert text.startswith("The Zen of Python, by Tim Peters")
    assert capsys.readouterr().out == ""


def test_batches_are_windows_of_the_text_and_their_next_characters() -> None:
    text = CharText("abcdefghij")
    x, y = text.batch(4, 5, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 5)
    for inputs, targets in zip(x, y):
        window = text.decode(inputs) + text.decode(targets[-1:])
        assert window in "abcdefghij"
        assert text.decode(targets) == window[1:]


@pytest.mark.parametrize(
    ("text", "seq_len", "message"),
    [("a", 1, "at least two characters"), ("abc", 3, "does not fit")],
)
def test_bad_text_or_length_is_one_sentence(
    text: str, seq_len: int, message: str
) -> None:
    with pytest.raises(CourseError, match=message):
        CharText(text).batch(1, seq_len, torch.Generator())


def test_the_model_learns_the_zen_of_python() -> None:
    torch.manual_seed(0)
    text = CharText()
    model = GPT(GPTConfig(vocab_size=text.vocab_size, block_size=32, n_layer=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        x, y = text.batch(16, 32, generator)
        loss = lm_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # A uniform guess costs log(vocab) ~ 3.7 nats per character.
    assert losses[0] > 3.0
    assert sum(losses[-10:]) / 10 < 2.5


@pytest.mark.parametrize("where", ["block", "attention", "mlp"])
def test_checkpointed_copies_give_the_same_gradients(where: str) -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx, targets = torch.randint(SMALL.vocab_size, (2, 2, 12))
    copy_ = add_checkpoints(model, where)
    block = copy_.blocks[0]
    wrapped = {"block": "", "attention": "attn", "mlp": "mlp"}[where]
    assert isinstance(getattr(block, wrapped) if wrapped else block, Checkpointed)
    for m in (model, copy_):
        lm_loss(m(idx), targets).backward()
    for plain, kept in zip(model.parameters(), copy_.parameters()):
        assert torch.equal(plain.grad, kept.grad)


def test_checkpointing_an_unknown_part_is_one_sentence() -> None:
    with pytest.raises(
        CourseError,
        match=r"^cannot checkpoint 'head'; choose one of block, attention, mlp\.$",
    ):
        add_checkpoints(GPT(SMALL), "head")


@pytest.mark.parametrize("where", ["block", "attention", "mlp"])
def test_the_original_model_is_left_as_it_was(where: str) -> None:
    model = GPT(SMALL)
    copy_ = add_checkpoints(model, where)
    assert not any(isinstance(m, Checkpointed) for m in model.modules())
    assert not {p.data_ptr() for p in model.parameters()} & {
        p.data_ptr() for p in copy_.parameters()
    }  # the copy shares no tensors


def reference_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The GPT written out with plain tensor operations, one head at a time."""

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * weight

    T = idx.shape[1]
    x = model.tok_emb.weight[idx] + model.pos_emb.weight[:T]
    for block in model.blocks:
        a, h = block.attn, norm(x, block.ln_1.weight)
        q, k, v = (h @ lin.weight.T for lin in (a.q, a.k, a.v))
        heads = []
        for s in range(0, q.shape[-1], a.head_dim):
            qh, kh, vh = (t[..., s : s + a.head_dim] for t in (q, k, v))
            scores = qh @ kh.transpose(1, 2) / a.head_dim**0.5
            future = torch.ones(T, T, dtype=torch.bool).triu(1)
            heads.append(scores.masked_fill(future, -torch.inf).softmax(-1) @ vh)
        x = x + torch.cat(heads, -1) @ a.proj.weight.T
        h = norm(x, block.ln_2.weight)
        x = x + F.gelu(h @ block.mlp.fc.weight.T) @ block.mlp.proj.weight.T
    return norm(x, model.ln_f.weight) @ model.head.weight.T


@pytest.mark.parametrize("sdpa", [False, True])
def test_the_model_computes_the_written_out_gpt(sdpa: bool) -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    model = GPT(replace(config, sdpa=sdpa)).double()
    for p in model.parameters():  # away from the initial 0.02 scale and unit norms
        torch.nn.init.normal_(p, std=0.5)
    idx = torch.randint(11, (3, 6))
    torch.testing.assert_close(model(idx), reference_forward(model, idx))
    assert "blocks.0.attn.future" not in model.state_dict()  # a mask, not a weight


def test_batches_follow_their_generator_alone() -> None:
    text = CharText("abcdefghijklmnopqrstuvwxyz" * 4)
    torch.manual_seed(1)
    first = text.batch(4, 8, torch.Generator().manual_seed(5))
    torch.manual_seed(2)
    again = text.batch(4, 8, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert CharText("ab").vocab_size == 2  # two characters are enough
