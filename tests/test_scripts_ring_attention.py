"""ring_attention.py: its pieces here, and launched on 2 and 4 gloo processes.

What is expected is computed here, independently of the script:

- the splits deal out every position exactly once;
- in a world of one process, every method is attention: its output equals
  ``F.scaled_dot_product_attention``, with as many key-value heads as query
  heads or fewer; the ring's hand-written backward pass passes
  ``torch.autograd.gradcheck`` (numerical derivatives, float64); in bfloat16
  it accumulates in float32, as close to float64 attention as SDPA's own
  bfloat16 kernel;
- launched on 2 processes, the copy model's losses equal the same model
  trained here on the whole sequences in one process.

``make test`` launches once (2 processes); 4 processes, the all-gather
variant, bad input, the chapter's check on 2 processes and torch's own
``context_parallel`` on the CPU are marked slow.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launchers import one_sentence_under_torchrun

from companion.harness.launch import launch
from companion.scripts import ring_attention as ra

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def alone():
    """A process group of this one process (the ring has one rank)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("split", ["plain", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_splits_deal_out_every_position_once(split, world_size):
    T = 4 * world_size
    held = [ra.positions(T, r, world_size, split) for r in range(world_size)]
    assert sorted(torch.cat(held).tolist()) == list(range(T))
    if split == "zigzag":  # one early chunk and one late chunk each
        assert all(p[0] < T // 2 <= p[-1] for p in held)
    x = torch.arange(T).view(1, T) * 10
    assert torch.equal(
        ra.shard(x, 1, 1 % world_size, world_size, split)[0] // 10, held[1 % world_size]
    )


def test_copy_batches_repeat_their_first_half():
    x, y = ra.copy_batch(3, 8, 5, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 8)
    assert torch.equal(x[:, :4], x[:, 4:]) and torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y[:, -1], x[:, 0])


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_alone_it_is_attention(alone, causal, method, kv_heads):
    q = torch.randn(2, 4, 8, 4, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, kv_heads, 8, 4, dtype=torch.float64, requires_grad=True)
        for _ in "kv"
    )
    out = ra.attention(q, k, v, causal, "zigzag", method)
    gqa = kv_heads < 4
    reference = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=gqa
    )
    assert torch.allclose(out, reference, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected = torch.autograd.grad(reference.sum(), (q, k, v))
    assert all(
        torch.allclose(g, e, atol=1e-12, rtol=0) for g, e in zip(grads, expected)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_the_backward_ring_passes_gradcheck(alone, causal):
    q = torch.randn(1, 4, 6, 3, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True) for _ in "kv"
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: ra.RingAttention.apply(q, k, v, causal, "plain"), (q, k, v)
    )


def test_bfloat16_accumulates_in_float32(alone):
    """The running sums and the log-sum-exp stay in float32: the ring's bfloat16
    output is as close to float64 attention as SDPA's own bfloat16 kernel."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g).bfloat16() for _ in "qkv")
    exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)))
    out, lse = ra.ring_forward(q, k, v, False, "plain")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    fused = F.scaled_dot_product_attention(q, k, v)
    ours = (out.double() - exact).abs().max()
    theirs = (fused.double() - exact).abs().max()
    assert ours <= 1.5 * theirs


def whole_losses(args: list[str]) -> list[float]:
    """The script's copy model trained here, in one process, on the whole sequences."""
    parsed = ra.parse_args(args)
    torch.manual_seed(parsed.seed)
    model = ra.CopyModel(
        parsed.vocab,
        parsed.seq_len,
        parsed.n_embd,
        parsed.n_head,
        "local",
        parsed.n_kv_head,
    )
    return ra.train(model, parsed, 0, 1, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, args",
    [
        (2, ["--steps", "3"]),
        pytest.param(4, ["--steps", "3", "--split", "plain"], marks=pytest.mark.slow),
        pytest.param(
            4, ["--steps", "3", "--method", "allgather"], marks=pytest.mark.slow
        ),
        pytest.param(
            2,
            [
                "--steps",
                "3",
                "--method",
                "ulysses",
                "--n-head",
                "4",
                "--n-kv-head",
                "2",
            ],
            marks=pytest.mark.slow,
            id="ulysses-gqa",
        ),
    ],
)
def test_split_training_equals_one_process(nproc, args):
    result = launch("ring_attention.py", args, nproc=nproc, timeout=150)
    assert result["device"] == "cpu" and result["backend"] == "gloo"
    assert result["losses"] == pytest.approx(whole_losses(args), abs=1e-5)


@pytest.mark.slow
def test_bad_sequence_length_is_one_sentence():
    said = one_sentence_under_torchrun("ring_attention.py", ["--seq-len", "36"], 4)
    assert said == "--seq-len 36 must be even and a multiple of 8"


@pytest.mark.slow
def test_the_chapters_check_on_two_processes():
    result = launch("checks/context_parallel.py", nproc=2, timeout=200)
    assert all(result["checks"].values()), result["checks"]
    tried = result["torch_context_parallel"]["allgather"]  # no CUDA here
    assert not tried["ran"] and tried["error"] == "NotImplementedError"
    bf16 = next(c for c in result["cases"] if c["dtype"] == "bfloat16")
    assert bf16["tolerance"] == 1.5 * bf16["kernel_max_diff"] > 0
    # the trained model, given a plain split's positions, loses what it learned
    run = result["training"]["run"]
    held_out, guess = run["held_out_losses"], math.log(run["vocab"])
    assert held_out["plain split's"] >= (held_out["right"] + guess) / 2


@pytest.mark.slow
def test_torch_context_parallel_needs_cuda_kernels(alone):
    """What chapter 14 says: on a CPU torch's context_parallel raises (2.10 to 2.14);
    and SDPA works again afterwards (torch 2.10 left its own version in place)."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in "qkv")
    sdpa = F.scaled_dot_product_attention
    with pytest.raises(NotImplementedError, match="flash_attention_for_cpu"):
        ra.torch_context_parallel(q, k, v, torch.device("cpu"))
    assert F.scaled_dot_product_attention is sdpa
    assert sdpa(q, k, v, is_causal=True).shape == q.shape
