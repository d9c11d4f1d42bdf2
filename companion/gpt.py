"""A small GPT-style language model and the text it learns, for chapters 12-13.

The model follows GPT-2 (Radford et al., 2019) as nanoGPT writes it, made
small enough to train in seconds on two CPU cores: token and position
embeddings, ``n_layer`` pre-LayerNorm blocks of causal self-attention and an
MLP, a final LayerNorm and a linear head. Two choices make it convenient for
the chapters on memory and model parallelism:

- The query, key and value projections are three ``nn.Linear`` layers (not
  one fused layer), so that tensor parallelism can split each by columns and
  every rank keeps whole heads; the attention reshapes with ``-1`` heads for
  the same reason.
- Attention is written out (``q @ k^T``, mask, softmax, ``@ v``) by default,
  so that the ``T x T`` score matrix it keeps for backward is visible;
  ``sdpa=True`` calls ``F.scaled_dot_product_attention`` instead, whose fused
  kernels do not keep that matrix.

There is no dropout and no bias anywhere, so that every saved tensor and
every parameter follows from a short formula, and runs are deterministic.
The standalone GPT scripts of chapters 12-13 import this model, less the
notebooks' options, from ``companion/scripts/gpt_model.py`` (they import only
torch, the standard library and their siblings); ``tests/gpt_scripts.py`` checks that the two agree.
``plain_losses`` trains it in one process: the reference that the checks of
those scripts (``companion/checks/``) compare every parallel layout with.
"""

from __future__ import annotations

import codecs
import contextlib
import copy
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from companion.harness.notebook import CourseError
from companion.memory import Checkpointed

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "CharText",
    "GPTConfig",
    "add_checkpoints",
    "count_parameters_formula",
    "lm_loss",
    "plain_losses",
    "saved_activation_bytes_formula",
    "zen_of_python",
]


@dataclass(frozen=True)
class GPTConfig:
    """The model's sizes. The defaults train in seconds on two CPU cores."""

    vocab_size: int = 64
    block_size: int = 64  # the longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    sdpa: bool = False  # True: F.scaled_dot_product_attention

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise CourseError(
                f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})."
            )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.head_dim = d // config.n_head
        self.sdpa = config.sdpa
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        # True above the diagonal: the future positions that t may not see.
        future = torch.ones(config.block_size, config.block_size, dtype=torch.bool)
        self.register_buffer("future", future.triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds only some of them.
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )  # (B, heads, T, head_dim)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(self.future[:T, :T], float("-inf"))
            y = scores.softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads side by side again
        return self.proj(y)


class MLP(nn.Module):
    """Two linear layers with a GELU between them, 4x wider inside."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One transformer block: attention, then the MLP, each with a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=False)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-style language model: token ids (B, T) in, logits (B, T, vocab) out."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise CourseError(
                f"sequences of {T} tokens are longer than the model's block_size "
                f"({self.config.block_size})."
            )
        positions = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def add_checkpoints(model: GPT, where: str) -> GPT:
    """A copy of ``model`` with activation checkpointing in every block.

    ``where`` is ``"block"`` (each whole block), ``"attention"`` or ``"mlp"``
    (that part of each block); the copy shares no tensors with ``model``.
    """
    choices = ("block", "attention", "mlp")
    if where not in choices:
        raise CourseError(
            f"cannot checkpoint {where!r}; choose one of {', '.join(choices)}."
        )
    model = copy.deepcopy(model)
    for i, block in enumerate(model.blocks):
        if where == "block":
            model.blocks[i] = Checkpointed(block)
        elif where == "attention":
            block.attn = Checkpointed(block.attn)
        else:
            block.mlp = Checkpointed(block.mlp)
    return model


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) for linear and embedding weights."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def count_parameters_formula(config: GPTConfig) -> int:
    """The model's parameter count, from its sizes.

    Each block has 12 d^2 + 2 d parameters: q, k, v and the attention's output
    projection (4 d^2), the MLP (d x 4d and 4d x d: 8 d^2) and two LayerNorm
    weights (2 d). Around the blocks: the token embedding and the head
    (vocab x d each), the position embedding (block_size x d) and the final
    LayerNorm (d).
    """
    d, L = config.n_embd, config.n_layer
    return (
        L * (12 * d * d + 2 * d)
        + 2 * config.vocab_size * d
        + (config.block_size * d + d)
    )


def saved_activation_bytes_formula(
    config: GPTConfig, batch_size: int, seq_len: int, dtype_bytes: int = 4
) -> dict[str, int]:
    """Bytes autograd saves for backward in one forward pass and the loss.

    Per block, in elements of ``batch_size x seq_len`` (B T) positions:

    - the two LayerNorms keep their input (d each) and a mean and an inverse
      standard deviation (1 each): 2 d + 4;
    - q, k and v share their input, the first LayerNorm's output (d);
      the attention keeps contiguous copies of q, k and v (3 d);
      the output projection keeps the heads side by side (d);
    - the second LayerNorm's output feeds the MLP (d), whose GELU keeps its
      input (4 d) and whose last layer keeps the GELU's output (4 d);
    - without ``sdpa``, the softmax keeps its output: a T x T matrix per head,
      n_head x T per position. With ``sdpa`` the fused kernel keeps a
      log-sum-exp per head and position instead (n_head); its output, laid out
      heads side by side, is the output projection's input already counted.

    That is 16 d + 4 (+ n_head T, or + n_head with sdpa) per position and
    block. Around the blocks: the final LayerNorm (d + 2), the head's input (d),
    the log-softmax of the loss (vocab), and the int64 token ids and targets.
    """
    B, T, d = batch_size, seq_len, config.n_embd
    h, V, L = config.n_head, config.vocab_size, config.n_layer
    attention = h if config.sdpa else h * T
    per_block = (16 * d + 4 + attention) * B * T * dtype_bytes
    return {
        "blocks": L * per_block,
        "embedding and head": (d + 2 + d + V) * B * T * dtype_bytes
        + 2 * B * T * 8  # token ids and targets, int64
        + T * 8,  # the positions 0..T-1, int64
    }


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token predictions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def plain_losses(
    config: GPTConfig,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> list[float]:
    """The losses of the plain model, trained with Adam on whole ``batches``.

    The reference that every parallel layout of chapters 12-13 must reproduce:
    one process, the whole global batch, the model initialised in float32 from
    ``seed`` and then cast to ``dtype``, as the standalone scripts do.
    """
    torch.manual_seed(seed)
    model = GPT(config).to(device=device, dtype=dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def zen_of_python() -> str:
    """The Zen of Python (``import this``): a text every Python install ships."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
        import this
    return codecs.decode(this.s, "rot13")


class CharText:
    """A text as character ids, cut into (input, next-character target) batches.

    Args:
        text: the training text (default: the Zen of Python).
    """

    def __init__(self, text: str | None = None) -> None:
        text = zen_of_python() if text is None else text
        self.chars = sorted(set(text))
        if len(text) < 2:
            raise CourseError("the text needs at least two characters to learn from.")
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([self.index[c] for c in text])

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(
        self, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows of ``seq_len`` ids and their targets."""
        if seq_len >= len(self.ids):
            raise CourseError(
                f"a sequence of {seq_len} characters does not fit in a text of "
                f"{len(self.ids)}."
            )
        starts = torch.randint(
            len(self.ids) - seq_len, (batch_size,), generator=generator
        )
        windows = torch.stack([self.ids[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())
