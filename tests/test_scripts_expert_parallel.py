"""expert_parallel.py: its pieces here, and launched on 2 and 4 gloo processes.

What is expected is computed here, independently of the script:

- with plain MLPs (``n_experts=0``) the script's copy of the model is the
  course's GPT (``companion.gpt``, with SDPA): the same parameters and
  logits, bit for bit, and the same text;
- the mixture of experts equals a loop over the choices, token by token in
  GShard's order (every token's first choice before any second one), each
  kept while its expert has a free slot: with and without dropped choices;
- the load-balancing loss is 1 when the router has no preference, and the
  capacity is ``companion.long_context.expert_capacity``;
- launched on 2 processes, the losses equal the same model trained here in
  one process on the same global batches, each rank's share routed alone.

``make test`` launches once (2 processes); 4 processes, dropless routing,
bad input and the chapter's checks on 4 processes are marked slow.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from launchers import one_sentence_under_torchrun

from companion.gpt import GPT, CharText, GPTConfig
from companion.harness.launch import launch
from companion.long_context import expert_capacity
from companion.scripts import expert_parallel as ep

pytestmark = pytest.mark.timeout(180)


def test_with_plain_mlps_it_is_the_course_gpt():
    ids, vocab = ep.zen_of_python()
    assert torch.equal(ids, CharText().ids) and vocab == CharText().vocab_size
    config = GPTConfig(vocab_size=vocab, n_layer=2, n_head=2, n_embd=16, sdpa=True)
    torch.manual_seed(3)
    ours = GPT(config)
    sizes = {k: v for k, v in asdict(config).items() if k != "sdpa"}
    torch.manual_seed(3)
    theirs = ep.GPT(ep.GPTConfig(**sizes, n_experts=0))
    mine, copied = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == copied.keys()
    assert all(torch.equal(mine[k], copied[k]) for k in mine)
    x, _ = ep.batch(ids, 3, 32, torch.Generator().manual_seed(0))
    assert torch.equal(ours(x), theirs(x))


def loop_over_choices(moe: ep.MoE, tokens: torch.Tensor) -> torch.Tensor:
    """The layer, one choice at a time: every token's first choice, then second
    ones, each kept while its expert has a free slot (dropless: always)."""
    probs = moe.router(tokens).softmax(dim=-1)
    gate, expert = probs.topk(moe.config.top_k, dim=-1)
    if moe.config.normalize_gates:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    capacity = moe.capacity(len(tokens))
    used = [0] * moe.config.n_experts
    out = torch.zeros_like(tokens)
    for choice in range(moe.config.top_k):
        for t in range(len(tokens)):
            e = int(expert[t, choice])
            if used[e] < capacity:
                used[e] += 1
                hidden = F.gelu(tokens[t] @ moe.fc[e]) @ moe.proj[e]
                out[t] += gate[t, choice] * hidden
    if moe.shared is not None:
        out += moe.shared.proj(F.gelu(moe.shared.fc(tokens)))
    return out


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 4.0, 0.0])
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_layer_is_a_loop_over_choices(capacity_factor, top_k):
    config = ep.GPTConfig(
        n_embd=8, n_experts=4, top_k=top_k, capacity_factor=capacity_factor
    )
    torch.manual_seed(0)
    moe = ep.MoE(config).double()
    tokens = torch.randn(1, 40, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(
            moe(tokens)[0], loop_over_choices(moe, tokens[0]), atol=1e-14
        )
    assert moe.load.sum() == 40 * top_k
    if capacity_factor:
        assert moe.capacity(40) == expert_capacity(40, 4, top_k, capacity_factor)
    else:  # dropless: an expert can take every token
        assert moe.capacity(40) == 40


def test_renormalised_gates_and_shared_experts_are_a_loop_too():
    config = ep.GPTConfig(
        n_embd=8, n_experts=4, top_k=2, capacity_factor=0, normalize_gates=True
    )
    torch.manual_seed(0)
    moe = ep.MoE(ep.GPTConfig(**{**config.__dict__, "n_shared": 1})).double()
    tokens = torch.randn(1, 40, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(
            moe(tokens)[0], loop_over_choices(moe, tokens[0]), atol=1e-14
        )
    assert moe.shared.fc.weight.shape == (4 * 8, 8)  # one expert's width


def test_the_balance_loss_is_one_without_preference():
    moe = ep.MoE(ep.GPTConfig(n_embd=8, n_experts=4, top_k=2))
    torch.nn.init.zeros_(moe.router.weight)
    moe(torch.randn(1, 16, 8))
    assert moe.aux_loss.item() == pytest.approx(1.0, abs=1e-6)


def whole_log(args: list[str], groups: int) -> dict:
    """The script's model trained here, in one process, each rank's share as a group."""
    parsed = ep.parse_args(args)
    return ep.train(ep.build(parsed, 0, 1), parsed, 0, 1, torch.device("cpu"), groups)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, args",
    [
        (2, ["--steps", "2", "--n-layer", "1", "--seq-len", "32"]),
        pytest.param(4, ["--steps", "2", "--experts", "8"], marks=pytest.mark.slow),
        pytest.param(
            2,
            ["--steps", "2", "--capacity-factor", "0", "--normalize-gates"]
            + ["--shared-experts", "1", "--n-layer", "1", "--seq-len", "32"],
            marks=pytest.mark.slow,
            id="dropless",
        ),
    ],
)
def test_experts_on_processes_train_as_one_process(nproc, args):
    result = launch("expert_parallel.py", args, nproc=nproc, timeout=150)
    assert result["device"] == "cpu" and result["backend"] == "gloo"
    expected = whole_log(args, groups=nproc)
    assert result["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert result["load"] == expected["load"]  # the same choices, counted exactly


@pytest.mark.slow
def test_experts_that_do_not_divide_are_one_sentence():
    said = one_sentence_under_torchrun("expert_parallel.py", ["--experts", "3"], 2)
    assert said == "--experts 3 must be a positive multiple of 2"


@pytest.mark.slow
def test_the_chapters_checks_on_four_processes():
    """Chapter 14 runs both checks in one launch (checks/long_context.py)."""
    result = launch("checks/long_context.py", nproc=4, timeout=400)
    for name in ("context", "experts"):
        assert all(result[name]["checks"].values()), (name, result[name]["checks"])
    assert result["experts"]["flops_per_byte"]["predicted"] == pytest.approx(
        2 * 64 * 4 / (3 * 8)  # hidden 4 d = 64, 4 ranks, float64
    )
