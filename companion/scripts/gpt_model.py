"""The course's GPT and the text it learns: the model the GPT scripts import.

``fsdp_gpt.py``, ``tensor_parallel_gpt.py`` and ``pipeline_gpt.py`` import it
as a sibling, as nanoGPT's ``train.py`` imports ``model.py``. It is
``companion/gpt.py``'s model without the options the notebooks use (fused
attention, recomputation, formulas); a test checks that the two agree bit for
bit. Three ``nn.Linear`` layers for the query, key and value (not one fused
layer) let tensor parallelism split each by columns; no dropout and no bias
keep runs deterministic.
"""

import codecs
import contextlib
import io
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 64  # the longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.head_dim = d // config.n_head
        self.q, self.k, self.v, self.proj = (
            nn.Linear(d, d, bias=False) for _ in range(4)
        )
        future = torch.ones(config.block_size, config.block_size, dtype=torch.bool)
        self.register_buffer("future", future.triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # -1 heads below: a tensor-parallel rank holds some
        q, k, v = (
            p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.future[:T, :T], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
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
    """Token ids (B, T) in, logits (B, T, vocab) out."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token predictions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class CharText:
    """The Zen of Python as character ids, cut into (input, target) batches."""

    def __init__(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
            import this
        text = codecs.decode(this.s, "rot13")
        self.chars = sorted(set(text))
        self.ids = torch.tensor([self.chars.index(c) for c in text])

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator):
        """``batch_size`` random windows of ``seq_len`` ids, and the next ids."""
        starts = torch.randint(
            len(self.ids) - seq_len, (batch_size,), generator=generator
        )
        windows = torch.stack([self.ids[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def build_model(config: GPTConfig, seed: int, dtype: str, device) -> GPT:
    """The same GPT on every rank: initialised in float32 from ``seed``, then cast."""
    torch.manual_seed(seed)
    return GPT(config).to(device=device, dtype=DTYPES[dtype])


def global_batches(args, device, start: int = 0, count: int | None = None) -> list:
    """The global batches of steps ``start`` to ``start + count - 1`` (``count``:
    ``args.steps``), the same on every rank and in every run (a resumed run draws
    the steps it skips), from ``args.seed``, ``args.batch_size``, ``args.seq_len``."""
    count = args.steps if count is None else count
    text, g = CharText(), torch.Generator().manual_seed(args.seed)
    batches = [
        text.batch(args.batch_size, args.seq_len, g) for _ in range(start + count)
    ]
    return [(x.to(device), y.to(device)) for x, y in batches[start:]]
