"""Tensor parallelism on a small GPT: by hand, with DTensor, with sequence parallelism, and 2-D.

Launch lines:
    torchrun --standalone --nproc-per-node=2 tensor_parallel_gpt.py --check
    torchrun --standalone --nproc-per-node=4 tensor_parallel_gpt.py --layout 2d --check
    python tensor_parallel_gpt.py --check                            # one process
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=tp tensor_parallel_gpt.py --layout 2d      # on each of 2 nodes
    srun --ntasks=2 --gpus-per-task=1 python tensor_parallel_gpt.py --check   # SLURM

Every rank builds the same small GPT (the course's model, copied here so the
script stands alone) from the same seed, in float64 by default, and trains it
with Adam on the same batches of the Zen of Python, read as characters.

``--layout tp`` (the default; N processes, N dividing the heads and the
sequence length) splits each block over the N ranks in three ways and checks
each against the plain model, computed by every rank alone:

- By hand, as Megatron-LM does: two autograd functions, f
  (``CopyToTensorParallel``: identity forward, all-reduce of the gradient in
  backward) and g (``ReduceFromTensorParallel``: all-reduce forward, identity
  backward). The MLP's ``fc`` keeps 4d/N output features (rows of its
  weight), the GELU runs on them locally, ``proj`` keeps the matching input
  features (columns) and returns a partial sum that g adds up; attention
  keeps n_head/N whole heads (q, k, v by rows, ``proj`` by columns). One
  block is compared with the unsharded block (output, input gradient, each
  rank's slice of every weight gradient), then a whole model of such blocks
  trains. Formula: per block 2 all-reduces forward and 2 backward, each of
  the B T d elements of the residual stream.
- With DTensor: ``parallelize_module`` on the whole model, q, k, v and fc
  ``ColwiseParallel``, the two ``proj`` ``RowwiseParallel``. Its logits,
  loss, per-rank gradients and losses are compared with the plain model's
  and the hand-written version's. Formula: per block 2 all-reduces forward
  and 4 backward, of B T d elements each: every ``ColwiseParallel`` module
  turns its own input gradient from Partial into Replicate, so q, k and v
  make three where f makes one (a fused qkv layer would make one).
- With sequence parallelism (as torchtitan does): the LayerNorms
  ``SequenceParallel`` (the residual stream is split along the sequence),
  attention and MLP inputs all-gathered (``PrepareModuleInput``), both
  ``proj`` reduce-scattered to the sequence shards (``RowwiseParallel(
  output_layouts=Shard(1))``), the head ``ColwiseParallel`` from sequence
  shards to replicated logits, the embeddings replicated and cut into
  sequence shards (no communication) on entering block 0. Each all-reduce
  becomes an all-gather and a reduce-scatter. Formula per step: all-gathers
  of B T d elements, 2 per block forward and 2 backward, one of the head's
  input and one of the gradient entering the embeddings; one all-gather of
  the logits, B T V' elements, V' the vocabulary padded to a multiple of N;
  reduce-scatters of B T d elements, 2 per block forward and 2 backward and
  one of the head's input gradient; and the LayerNorm weights, replicated,
  get partial gradients, which DTensor all-reduces each time they are read,
  not once: Adam (foreach, as in torch 2.14) reads each gradient three times
  (one lerp, one addcmul of grad by grad), so 3 (2L + 1) all-reduces of d
  elements in the optimizer step.

Collectives are counted per phase (forward with the loss, backward,
optimizer step) with ``CommDebugMode``, extended here to add up the bytes
of each collective's input and output; the hand-written functions count
their own all-reduces too, and ``CommDebugMode`` must see the same.

Activation memory: the bytes autograd saves for backward in one forward
pass and the loss, per rank (each storage once, a DTensor's local tensor,
parameters and buffers left out), for the plain model, TP by hand, TP with
DTensor and TP with sequence parallelism, each against a formula in
elements per position (B T positions) and block: plain 16d + 4 + hT (two
LayerNorm inputs and their mean and rstd, 2d + 4; the attention's input
and its copies of q, k, v and of the heads side by side, 5d; the softmax,
hT; the MLP's input, GELU input and output, 9d); TP 4d + 4 + (12d + hT)/N
(the LayerNorms and the inputs of attention and MLP stay whole); TP+SP
2d + (14d + 4 + hT)/N (the LayerNorms are split too, but the all-gathered
inputs of attention and MLP are saved whole: DTensor keeps them, where
Megatron-LM saves its shard and all-gathers again in backward). Around the
blocks: final LayerNorm (d + 2, split by N under SP), head input (d), the
loss's log-softmax (V), the int64 token ids, targets and positions, and
one scalar, the cross-entropy's total weight.

Timing, for a cost model (reported, never checked): the median of
``--repeats`` forward and backward passes after a warm-up, between
barriers: the plain model alone on rank 0 with N times the threads of one
process (the same CPUs) and with one process's threads, the hand-written
and DTensor TP models, TP+SP; one all-reduce of B T d elements, alone
between barriers (5 x ``--repeats`` calls) and as the hand-written model's
timed steps ran them (``all_reduce_in_step``, the median call: a better
guide to what a step pays, since a lone call between barriers often waits
for the other process to be scheduled); and a barrier alone.

``--layout 2d`` (``--mesh DPxTP`` processes, default 2x2) builds a 2-D
mesh (``init_device_mesh`` with dims "dp" and "tp"), applies the TP plan
above on mesh["tp"], then ``fully_shard`` (FSDP2) to each block and the
root on mesh["dp"]. The TP ranks of one DP group take the same slice of
each global batch. After ``--steps`` Adam steps the losses are compared
with the plain model trained by rank 0 on the global batches. Parameter
bytes per rank are read from the local shards: a TP-split weight keeps
its ``torch.chunk`` slice along the split dimension (rows for q, k, v and
fc, columns for the two ``proj``), FSDP2 then keeps its chunk of dim 0
of that (padded to ceil(rows / DP) rows in storage); the other
parameters are split by FSDP2 alone. That is roughly P b / (DP TP), more
for the embeddings, LayerNorms and head, which TP does not split.

Writes: a few lines per run on rank 0; with ``--results FILE``, JSON from
rank 0: the settings and ``reference_losses`` (the plain model); for tp,
``hand`` (the block check, then training), ``tp`` (DTensor) and ``sp``
(sequence parallel), each with ``losses``, ``max_diff`` (largest
differences over the ranks), ``collectives`` per step and phase beside
``predicted``; ``activations`` (``measured`` per rank, ``predicted``) and
``timing`` (seconds); for 2d, ``losses``, ``parameter_bytes`` (measured
per rank, predicted, rough) and every parameter's placements on rank 0;
``checks`` (name: true or false) and ``seconds``.

Exit codes: 0 done (and, with ``--check``, every check passed); 3 a check
missed its tolerance or formula, said in one sentence by rank 0; 2 bad
input (e.g. heads that do not split over the processes, a mesh that does
not fit them), said in one sentence by rank 0; 1 anything unexpected (a
traceback). Needs PyTorch 2.6 or newer.
"""

import argparse
import codecs
import collections
import contextlib
import copy
import datetime
import io
import json
import math
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SCRIPT = Path(__file__).name
MIN_TORCH = (2, 6)  # fully_shard in torch.distributed.fsdp


class UsageError(Exception):
    """Bad input: the message is one sentence saying what is wrong and what to do."""


class RendezvousError(UsageError):
    """The processes could not meet: only the process that saw it can say so."""


def env_rank(local: bool = False) -> int:
    """This process's (local) rank as its launcher set it; 0 without a launcher."""
    names = ("LOCAL_RANK", "SLURM_LOCALID") if local else ("RANK", "SLURM_PROCID")
    return int(os.environ.get(names[0], os.environ.get(names[1], "0")))


def fail(message: str, code: int = 2, printer: bool | None = None) -> None:
    """Print ``SCRIPT: error: message`` (on rank 0 unless told otherwise) and exit with ``code``."""
    if env_rank() == 0 if printer is None else printer:
        print(f"{SCRIPT}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


if tuple(int(n) for n in re.findall(r"\d+", torch.__version__)[:2]) < MIN_TORCH:
    fail(
        f"this script needs PyTorch {'.'.join(map(str, MIN_TORCH))} or newer, not "
        f"{torch.__version__}; "
        "upgrade it with pip install --upgrade torch."
    )


# These come after the version check, which names what an old torch lacks.
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
except ImportError as err:
    fail(
        "this script needs torch.distributed.fsdp.fully_shard, "
        "torch.distributed.tensor and torch.distributed.tensor.parallel, which "
        f"this PyTorch {torch.__version__} lacks ({err}); use PyTorch 2.6 or newer."
    )


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """Print one line on rank 0, not the usage block (``--help`` shows that), and exit with code 2."""
        fail(message)


# ---------------------------------------------------------------- processes


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_host(nodelist: str) -> str:
    """Return the first host of a SLURM node list: ``gpu[07-08,10],cpu1`` -> ``gpu07``; "" if there is none."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)


def read_topology() -> tuple[int, int, int]:
    """Return ``rank, local_rank, world_size``; set MASTER_ADDR and MASTER_PORT if unset.

    From torchrun (RANK, LOCAL_RANK, WORLD_SIZE), else from srun (SLURM_PROCID,
    SLURM_LOCALID, SLURM_NTASKS; rank 0 runs on the first node of the step,
    which hosts the rendezvous, on a port derived from the job id), else one process.
    """
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env:
        if "MASTER_ADDR" not in env:
            nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
            host = (
                "127.0.0.1"
                if nodes == 1
                else first_host(
                    env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
                )
            )
            if not host:
                raise UsageError(
                    "under SLURM on several nodes the processes meet on the first "
                    "node, but neither "
                    "MASTER_ADDR nor a node list (SLURM_JOB_NODELIST) names it; set "
                    "MASTER_ADDR."
                )
            env["MASTER_ADDR"] = host
        env.setdefault(
            "MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        )
        return (
            int(env["SLURM_PROCID"]),
            int(env["SLURM_LOCALID"]),
            int(env["SLURM_NTASKS"]),
        )
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))  # alone: any free port will do
    return 0, 0, 1


def describe_process(local_rank: int) -> dict:
    """This process's host and the GPU it would use: ``cuda:(local_rank % GPUs it sees)``.

    Under ``srun --gpus-per-task=1`` each process sees one GPU, its own, as
    ``cuda:0``; under torchrun every process of a node sees all of its GPUs.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = None
    if count:
        index = local_rank % count
        gpu = {
            "index": index,
            "uuid": str(
                getattr(torch.cuda.get_device_properties(index), "uuid", index)
            ),
        }
    return {"host": socket.gethostname(), "gpu": gpu}


def gpu_problem(everyone: list[dict]) -> str:
    """Why the processes in ``everyone`` cannot each have a GPU of their own ("" if they can)."""
    without = [i for i, p in enumerate(everyone) if p["gpu"] is None]
    shared = collections.Counter(
        (p["host"], p["gpu"]["uuid"]) for p in everyone if p["gpu"]
    )
    if len(without) == len(everyone):
        return "no process sees a GPU"
    if without:
        return f"{len(without)} of the {len(everyone)} processes see no GPU (rank {without[0]})"
    if max(shared.values()) > 1:
        host = next(h for (h, _), n in shared.items() if n > 1)
        users = sum(n for (h, _), n in shared.items() if h == host)
        return f"{host} has {sum(h == host for h, _ in shared)} GPU(s) for {users} processes"
    return "" if dist.is_nccl_available() else "this PyTorch was built without nccl"


def meet(rank: int, world_size: int, timeout: float) -> tuple[dist.Store, list[dict]]:
    """Reach the rendezvous at MASTER_ADDR:MASTER_PORT; return its store and every process's report."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store, _, _ = next(
            dist.rendezvous(
                "env://",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        )
    except dist.DistError as err:
        if "EADDRINUSE" in str(err) or "already in use" in str(err):
            raise RendezvousError(
                f"port {where} is already in use; set MASTER_PORT to a free port."
            ) from None
        if "waiting for clients" in str(err):
            joined = re.search(r"(\d+)/(\d+) clients", str(err))
            count = (
                f"only {joined[1]} of {joined[2]} processes"
                if joined
                else "not every process"
            )
            raise RendezvousError(
                f"{count} reached the rendezvous at {where} within {timeout:g} s; "
                "start all "
                "of them, and check that every node can reach that address."
            ) from None
        raise RendezvousError(
            f"cannot reach the rendezvous at {where} within {timeout:g} s; check "
            "MASTER_ADDR "
            "and MASTER_PORT, and that rank 0 is running."
        ) from None
    # Every process reports its host and GPU; all read all reports, so all decide alike.
    key = f"{SCRIPT}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{key}{rank}", json.dumps(describe_process(env_rank(local=True))))
    everyone = [json.loads(store.get(f"{key}{r}")) for r in range(world_size)]
    store.add(f"{key}read", 1)
    deadline = time.monotonic() + timeout
    while (
        rank == 0
        and store.add(f"{key}read", 0) < world_size
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)  # rank 0 may host the store: it stays until everyone has read
    return store, everyone


def setup_distributed(timeout: float = 600.0) -> tuple[int, int, int, torch.device]:
    """Join the process group and return ``rank, local_rank, world_size, device``.

    Every process reports its GPU at the rendezvous and all take the same
    decision: nccl and a GPU each when every process has a GPU of its own,
    else gloo on the CPU for all (a mix of the two would hang).
    """
    rank, local_rank, world_size = read_topology()
    store, everyone = meet(rank, world_size, timeout)
    problem = gpu_problem(everyone)
    if problem:
        device, backend = torch.device("cpu"), "gloo"
        if any(p["gpu"] for p in everyone) and rank == 0:
            print(
                f"{SCRIPT}: note: {problem}, so every process runs on the CPU with "
                "gloo.",
                flush=True,
            )
    else:
        device, backend = (
            torch.device("cuda", local_rank % torch.cuda.device_count()),
            "nccl",
        )
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )
    return rank, local_rank, world_size, device


def run_main(main) -> None:
    """Call ``main()``; a UsageError ends every process with exit code 2 and one sentence."""
    try:
        main()
    except UsageError as err:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Errors the processes agree on are said by rank 0; one that stopped them
        # from meeting, by the first process of each node that saw it.
        fail(str(err), printer=env_rank(local=isinstance(err, RendezvousError)) == 0)


def print0(*args: object) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, flush=True)


# ------------------------------------- the course's GPT (companion/gpt.py)


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
            raise UsageError(
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
            raise UsageError(
                f"sequences of {T} tokens are longer than the model's block_size "
                f"({self.config.block_size})."
            )
        positions = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) for linear and embedding weights."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token predictions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


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
            raise UsageError("the text needs at least two characters to learn from.")
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
            raise UsageError(
                f"a sequence of {seq_len} characters does not fit in a text of "
                f"{len(self.ids)}."
            )
        starts = torch.randint(
            len(self.ids) - seq_len, (batch_size,), generator=generator
        )
        windows = torch.stack([self.ids[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# ------------------------------------------------------------ settings and data


DTYPES = {"float32": torch.float32, "float64": torch.float64}
MODEL_DEFAULTS = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}
DEFAULT_STEPS = {"tp": 3, "2d": 5}
PHASES = ("forward", "backward", "optimizer")


def build_model(config: GPTConfig, seed: int, dtype: torch.dtype, device) -> GPT:
    """The same GPT on every rank: initialised in float32 from ``seed``, then cast."""
    torch.manual_seed(seed)
    return GPT(config).to(device=device, dtype=dtype)


def global_batches(text: CharText, args, device: torch.device) -> list[tuple]:
    """The ``--steps`` global batches, the same on every rank."""
    g = torch.Generator().manual_seed(args.seed)
    batches = [text.batch(args.batch_size, args.seq_len, g) for _ in range(args.steps)]
    return [(x.to(device), y.to(device)) for x, y in batches]


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local tensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def split_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits a parameter along (None: kept whole).

    q, k, v and fc are column-parallel: each rank keeps some output features,
    rows of the weight (dim 0); the two ``proj`` are row-parallel: some input
    features, columns of the weight (dim 1).
    """
    if re.search(r"\.(q|k|v|fc)\.weight$", name):
        return 0
    if re.search(r"\.proj\.weight$", name):
        return 1
    return None


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two tensors of the same shape."""
    return (local(a) - local(b)).abs().max().item()


# ---------------------------------------- tensor parallelism by hand (Megatron-LM)


class AllReduceCounter:
    """The all-reduces that f and g make, per phase ("forward", "backward")."""

    def __init__(self) -> None:
        self.counts: dict[str, dict] = {}
        self.seconds: list[float] = []  # of each all-reduce, as it ran

    def add(self, phase: str, tensor: torch.Tensor) -> None:
        row = self.counts.setdefault(phase, {}).setdefault(
            "all-reduce", {"calls": 0, "input_bytes": 0, "output_bytes": 0}
        )
        nbytes = tensor.numel() * tensor.element_size()
        row["calls"] += 1
        row["input_bytes"] += nbytes
        row["output_bytes"] += nbytes

    def take(self, phase: str) -> dict:
        """The counts of ``phase`` so far, which start again from zero."""
        return self.counts.pop(phase, {})


def all_reduce(tensor: torch.Tensor, counter: AllReduceCounter, phase: str):
    """Sum ``tensor`` over the group in place and count it; alone, nothing to do."""
    if dist.get_world_size() > 1:
        tic = time.perf_counter()
        dist.all_reduce(tensor)
        counter.seconds.append(time.perf_counter() - tic)
        counter.add(phase, tensor)
    return tensor


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron-LM's f: identity forward; backward all-reduces the gradient.

    Every rank feeds the same input to its slice of a layer, so each slice
    contributes part of the input's gradient: backward adds the parts up.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, counter: AllReduceCounter) -> torch.Tensor:
        ctx.counter = counter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        return all_reduce(grad, ctx.counter, "backward"), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron-LM's g: forward all-reduces the partial sums; identity backward.

    The output is the same on every rank, and so is its gradient, which each
    rank passes to its slice unchanged.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, counter: AllReduceCounter) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        return all_reduce(out, counter, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def linear_from(weight: torch.Tensor) -> nn.Linear:
    """A bias-free linear layer holding a copy of ``weight`` (out x in features)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format))
    return layer


def split_output_features(linear: nn.Linear, rank: int, world_size: int):
    """Column-parallel: this rank's rows of the weight (``torch.chunk``)."""
    return linear_from(linear.weight.detach().chunk(world_size, dim=0)[rank])


def split_input_features(linear: nn.Linear, rank: int, world_size: int):
    """Row-parallel: this rank's columns of the weight (``torch.chunk``)."""
    return linear_from(linear.weight.detach().chunk(world_size, dim=1)[rank])


class ParallelMLP(nn.Module):
    """The MLP split over the group: ``g(proj(gelu(fc(f(x)))))``.

    ``fc`` keeps this rank's 4d/N output features, so the GELU needs nothing
    from the other ranks; ``proj`` keeps the matching 4d/N input features and
    returns a partial sum of the output, which g adds up.
    """

    def __init__(
        self, mlp: MLP, counter: AllReduceCounter, rank: int, world_size: int
    ) -> None:
        super().__init__()
        self.fc = split_output_features(mlp.fc, rank, world_size)
        self.proj = split_input_features(mlp.proj, rank, world_size)
        self.counter = counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToTensorParallel.apply(x, self.counter)
        partial = self.proj(F.gelu(self.fc(x)))
        return ReduceFromTensorParallel.apply(partial, self.counter)


class ParallelAttention(CausalSelfAttention):
    """Attention split over the group by heads: ``g(attention(f(x)))``.

    q, k and v keep the rows of this rank's n_head/N heads, the attention
    runs on those heads alone (the model reshapes with -1 heads), and
    ``proj`` keeps the matching columns and returns a partial sum for g.
    """

    def __init__(
        self,
        attn: CausalSelfAttention,
        counter: AllReduceCounter,
        rank: int,
        world_size: int,
    ) -> None:
        nn.Module.__init__(self)  # the layers come from ``attn``, split
        self.head_dim, self.sdpa = attn.head_dim, attn.sdpa
        self.q, self.k, self.v = (
            split_output_features(layer, rank, world_size)
            for layer in (attn.q, attn.k, attn.v)
        )
        self.proj = split_input_features(attn.proj, rank, world_size)
        self.register_buffer("future", attn.future, persistent=False)
        self.counter = counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToTensorParallel.apply(x, self.counter)
        return ReduceFromTensorParallel.apply(super().forward(x), self.counter)


def split_block_by_hand(block: Block, counter: AllReduceCounter) -> Block:
    """A copy of ``block`` with its attention and MLP split over the group."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    block = copy.deepcopy(block)
    block.attn = ParallelAttention(block.attn, counter, rank, world_size)
    block.mlp = ParallelMLP(block.mlp, counter, rank, world_size)
    return block


def split_model_by_hand(model: GPT, counter: AllReduceCounter) -> GPT:
    """A copy of ``model`` with every block split; the rest stays replicated."""
    model = copy.deepcopy(model)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = split_block_by_hand(block, counter)
    return model


def check_block(block: Block, shape: tuple, seed: int) -> dict:
    """One block, whole and split by hand, on the same input and output gradient.

    Returns the largest differences (output, input gradient, this rank's
    slice of every weight gradient) and the all-reduces of one forward and
    one backward pass of the split block.
    """
    counter = AllReduceCounter()
    whole = copy.deepcopy(block)
    split = split_block_by_hand(block, counter)
    weight = whole.ln_1.weight
    g = torch.Generator().manual_seed(seed)
    x, upstream = (
        torch.randn(shape, generator=g, dtype=weight.dtype).to(weight.device)
        for _ in range(2)
    )
    x_whole, x_split = (x.clone().requires_grad_() for _ in range(2))
    out_whole = whole(x_whole)
    out_whole.backward(upstream)
    out_split = split(x_split)
    forward = counter.take("forward")
    out_split.backward(upstream)
    backward = counter.take("backward")
    full_grads = {name: p.grad for name, p in whole.named_parameters()}
    rank, world_size = dist.get_rank(), dist.get_world_size()
    weight_diffs = []
    for name, p in split.named_parameters():
        dim = split_dim("." + name)
        expected = full_grads[name]
        if dim is not None:
            expected = expected.chunk(world_size, dim=dim)[rank]
        weight_diffs.append(max_diff(p.grad, expected))
    return {
        "max_diff": {
            "output": max_diff(out_split, out_whole),
            "input_gradient": max_diff(x_split.grad, x_whole.grad),
            "weight_gradients": max(weight_diffs),
        },
        "collectives": {"forward": forward, "backward": backward},
    }


# ---------------------------------------------------------------- with DTensor


def tensor_parallel_plan(n_layer: int) -> dict:
    """Megatron-LM's split as a DTensor plan: q, k, v, fc by columns, proj by rows."""
    plan = {}
    for i in range(n_layer):
        plan |= {
            f"blocks.{i}.attn.q": ColwiseParallel(),
            f"blocks.{i}.attn.k": ColwiseParallel(),
            f"blocks.{i}.attn.v": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(),
            f"blocks.{i}.mlp.fc": ColwiseParallel(),
            f"blocks.{i}.mlp.proj": RowwiseParallel(),
        }
    return plan


def sequence_parallel_plan(n_layer: int) -> dict:
    """The plan above with sequence parallelism (as torchtitan writes it).

    Between the blocks' halves the residual stream is split along the
    sequence (``Shard(1)``): the LayerNorms work on their shard, attention
    and MLP all-gather their input, and each ``proj`` reduce-scatters its
    partial sums to the sequence shards. The embeddings stay replicated;
    block 0 cuts its input into shards (a local slice).
    """
    plan = {
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            use_local_output=True,
        ),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    for i in range(n_layer):
        plan |= {
            f"blocks.{i}.ln_1": SequenceParallel(),
            f"blocks.{i}.attn": PrepareModuleInput(**gather),
            f"blocks.{i}.attn.q": ColwiseParallel(),
            f"blocks.{i}.attn.k": ColwiseParallel(),
            f"blocks.{i}.attn.v": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.ln_2": SequenceParallel(),
            f"blocks.{i}.mlp": PrepareModuleInput(**gather),
            f"blocks.{i}.mlp.fc": ColwiseParallel(),
            f"blocks.{i}.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


# torch op name -> kind of collective
COLLECTIVE_KINDS = {
    "all_reduce": "all-reduce",
    "allreduce_": "all-reduce",
    "all_gather_into_tensor": "all-gather",
    "_allgather_base_": "all-gather",
    "allgather_": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
    "_reduce_scatter_base_": "reduce-scatter",
    "reduce_scatter_": "reduce-scatter",
}


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in ``value``, a tensor or a (nested) list or tuple."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


class CountCollectives(CommDebugMode):
    """``CommDebugMode``, plus the bytes of each collective's input and output.

    It sees DTensor's collectives and those of ``torch.distributed``;
    ``counts`` maps each phase (set ``phase`` as the step goes on) to the
    kinds of collective, their calls and bytes, as this rank sees them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = PHASES[0]
        self.counts: dict[str, dict[str, dict[str, int]]] = {p: {} for p in PHASES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:  # CommDebugMode counted a collective
            name = re.sub(r"^.*::|\..*$", "", func.name())
            row = self.counts[self.phase].setdefault(
                COLLECTIVE_KINDS.get(name, name),
                {"calls": 0, "input_bytes": 0, "output_bytes": 0},
            )
            row["calls"] += 1
            row["input_bytes"] += nbytes(args[0])
            row["output_bytes"] += nbytes(out)
        return out


# ------------------------------------------------------------ training


def train(
    model: nn.Module, batches: list, lr: float, counter: AllReduceCounter | None = None
) -> dict:
    """Train with Adam on whole batches (every rank the same); return the losses,
    each step's collectives per phase, and the first step's logits and
    gradients (this rank's local tensors).

    ``counter``: the hand-written functions' own count, reported beside
    what ``CountCollectives`` saw.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    out: dict = {"losses": [], "collectives": [], "own_count": []}
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        with CountCollectives() as counted:
            logits = model(x)
            loss = lm_loss(logits, y)
            counted.phase = "backward"
            loss.backward()
            if step == 0:
                out["logits"] = local(logits).detach().clone()
                out["gradients"] = {
                    name: local(p.grad).detach().clone()
                    for name, p in model.named_parameters()
                }
            counted.phase = "optimizer"
            optimizer.step()
        out["collectives"].append(counted.counts)
        if counter is not None:
            out["own_count"].append({p: counter.take(p) for p in PHASES})
        out["losses"].append(loss.item())
    return out


# ------------------------------------------------------------ activations


def local_storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind this rank's part of ``t``."""
    with torch.no_grad():
        return local(t).untyped_storage()


def saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward pass and the loss.

    This rank's storages, each counted once however many tensors view it;
    parameters and buffers (their local tensors) left out.
    """
    skip = {
        local_storage(t).data_ptr() for t in (*model.parameters(), *model.buffers())
    }
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local_storage(t)
        if storage.data_ptr() not in skip and storage.nbytes() > 0:
            storages.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x), y)
    total = sum(storages.values())  # while the graph keeps every saved tensor alive
    del loss
    return total


def predict_saved_bytes(
    config: GPTConfig, batch_size: int, seq_len: int, world_size: int, b: int
) -> dict[str, dict[str, int]]:
    """Bytes saved for backward per rank, for each split: plain, tp, sp.

    In elements per position and block (P = B T positions, N ranks, d wide,
    h heads): plain 16d + 4 + hT; TP 4d + 4 + (12d + hT)/N, since both
    LayerNorms (2d + 4) and the inputs of attention and MLP (2d) stay whole
    while q, k, v and the heads side by side (4d), the softmax (hT) and the
    GELU's input and output (8d) are split; TP+SP 2d + (14d + 4 + hT)/N,
    since the LayerNorms are split too while DTensor saves the all-gathered
    inputs of attention and MLP whole. Around the blocks: the final
    LayerNorm (d + 2, split under SP), the head's input (d), the loss's
    log-softmax (V), plus the int64 ids and targets (2P) and positions (T),
    and one scalar, the cross-entropy's total weight (which the formula in
    companion/gpt.py leaves out).
    """
    B, T, N = batch_size, seq_len, world_size
    d, h, V, L = config.n_embd, config.n_head, config.vocab_size, config.n_layer
    P, P_local = B * T, B * T // N
    blocks = {
        "plain": P * (16 * d + 4 + h * T),
        "tp": P * (4 * d + 4) + P * (12 * d + h * T) // N,
        "sp": P * 2 * d + P_local * (14 * d + 4 + h * T),
    }
    around = {
        "plain": P * (2 * d + 2 + V),
        "tp": P * (2 * d + 2 + V),
        "sp": P_local * (d + 2) + P * (d + V),
    }
    integers = (2 * P + T) * 8
    scalar = b  # cross-entropy keeps its total weight for backward
    return {
        split: {
            "blocks": L * blocks[split] * b,
            "embedding and head": around[split] * b + integers + scalar,
            "total": L * blocks[split] * b + around[split] * b + integers + scalar,
        }
        for split in blocks
    }


# ------------------------------------------------------------ collectives


def row(calls: int, input_bytes: int, output_bytes: int) -> dict:
    return {"calls": calls, "input_bytes": input_bytes, "output_bytes": output_bytes}


def predict_collectives(
    config: GPTConfig, batch_size: int, seq_len: int, world_size: int, b: int
) -> dict[str, dict]:
    """Collectives of one training step per phase, for hand, block, tp and sp.

    S = B T d b bytes, the residual stream. Hand (Megatron-LM's f and g):
    2 all-reduces of S per block forward, 2 backward; ``block`` is one
    block's forward and backward. DTensor TP: 2 per block forward, 4
    backward (q, k, v and fc each all-reduce their input gradient). SP:
    all-gathers of S/N in, S out: 2L + 1 forward (attention and MLP inputs,
    the head's input), 2L + 1 backward (proj output gradients, the gradient
    entering the embeddings), plus the logits, B T V' b out with V' the
    vocabulary rounded up to a multiple of N; reduce-scatters of S in, S/N
    out: 2L forward (the proj outputs), 2L + 1 backward (attention, MLP and
    head input gradients); and 3 (2L + 1) all-reduces of d b bytes in the
    optimizer step: the replicated LayerNorm weights keep Partial gradients,
    which DTensor all-reduces each time Adam reads them (three times).
    One process: none.
    """
    B, T, N = batch_size, seq_len, world_size
    d, V, L = config.n_embd, config.vocab_size, config.n_layer
    S = B * T * d * b
    if N == 1:
        empty = {phase: {} for phase in PHASES}
        return {
            "hand": empty,
            "block": {phase: {} for phase in PHASES[:2]},
            "tp": empty,
            "sp": empty,
        }

    def all_reduce(calls: int, size: int = S) -> dict:
        return {"all-reduce": row(calls, calls * size, calls * size)}

    logits = B * T * math.ceil(V / N) * b  # one rank's padded share of the logits
    return {
        "hand": {
            "forward": all_reduce(2 * L),
            "backward": all_reduce(2 * L),
            "optimizer": {},
        },
        "block": {"forward": all_reduce(2), "backward": all_reduce(2)},
        "tp": {
            "forward": all_reduce(2 * L),
            "backward": all_reduce(4 * L),
            "optimizer": {},
        },
        "sp": {
            "forward": {
                "all-gather": row(
                    2 * L + 2,
                    (2 * L + 1) * S // N + logits,
                    (2 * L + 1) * S + N * logits,
                ),
                "reduce-scatter": row(2 * L, 2 * L * S, 2 * L * S // N),
            },
            "backward": {
                "all-gather": row(2 * L + 1, (2 * L + 1) * S // N, (2 * L + 1) * S),
                "reduce-scatter": row(2 * L + 1, (2 * L + 1) * S, (2 * L + 1) * S // N),
            },
            "optimizer": all_reduce(3 * (2 * L + 1), d * b),
        },
    }


# ------------------------------------------------------------ timing


def median_seconds(fn, repeats: int, together: bool = True) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after a warm-up.

    ``together``: every rank calls it, between two barriers (so the slowest
    rank sets the time); else this rank alone.
    """
    fn()
    times = []
    for _ in range(repeats):
        if together:
            dist.barrier()
        tic = time.perf_counter()
        fn()
        if together:
            dist.barrier()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """A function that runs one forward and backward pass of ``model``."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()

    return step


def measure_times(
    models: dict, plain: GPT, x, y, repeats: int, dtype, counter: AllReduceCounter
) -> dict:
    """Seconds per forward and backward pass, and of one all-reduce of B T d.

    The all-reduce is timed twice: alone, between barriers, and inside the
    hand-split model's timed steps (``counter``'s record, the median call).
    """
    n = dist.get_world_size()
    threads = torch.get_num_threads()
    seconds: dict = {"threads_per_process": threads}
    if dist.get_rank() == 0:  # the others wait at the barrier below
        torch.set_num_threads(n * threads)
        seconds["plain_same_cpus"] = median_seconds(
            forward_backward(plain, x, y), repeats, together=False
        )
        torch.set_num_threads(threads)
        seconds["plain_one_process"] = median_seconds(
            forward_backward(plain, x, y), repeats, together=False
        )
    dist.barrier()
    for name, model in models.items():
        counter.seconds.clear()
        seconds[name] = median_seconds(forward_backward(model, x, y), repeats)
        if name == "hand" and counter.seconds:
            seconds["all_reduce_in_step"] = statistics.median(counter.seconds)
    stream = torch.randn(x.numel() * plain.config.n_embd, dtype=dtype).to(x.device)
    # Short calls, noisy on a shared CPU: more repeats for a steady median.
    many = 5 * repeats
    seconds["all_reduce"] = median_seconds(lambda: dist.all_reduce(stream), many)
    seconds["all_reduce_bytes"] = stream.numel() * stream.element_size()
    seconds["barrier"] = median_seconds(lambda: None, many)
    return seconds


# ------------------------------------------------------------ --layout tp


def run_tp(args, config: GPTConfig, batches: list, device: torch.device) -> dict:
    """Everything ``--layout tp`` measures on this rank."""
    dtype = DTYPES[args.dtype]
    n = dist.get_world_size()
    mesh = init_device_mesh(device.type, (n,))
    plain = build_model(config, args.seed, dtype, device)
    mine: dict = {}

    tic = time.perf_counter()
    shape = (args.batch_size, args.seq_len, config.n_embd)
    mine["block"] = check_block(plain.blocks[0], shape, args.seed + 1)
    reference = train(copy.deepcopy(plain), batches, args.lr)
    counter = AllReduceCounter()
    hand = split_model_by_hand(plain, counter)
    mine["hand"] = train(hand, batches, args.lr, counter)
    models = {"hand": hand}
    for split, plan in (
        ("tp", tensor_parallel_plan(config.n_layer)),
        ("sp", sequence_parallel_plan(config.n_layer)),
    ):
        models[split] = parallelize_module(copy.deepcopy(plain), mesh, plan)
        mine[split] = train(models[split], batches, args.lr)
    mine["seconds_train"] = time.perf_counter() - tic

    # Differences from the plain model, and between the two ways of splitting.
    for split in ("hand", "tp", "sp"):
        run = mine[split]
        run["max_diff"] = {
            "logits": max_diff(run.pop("logits"), reference["logits"]),
            "losses": max(
                abs(a - r) for a, r in zip(run["losses"], reference["losses"])
            ),
        }
    hand_grads = mine["hand"].pop("gradients")
    mine["tp"]["max_diff"]["gradients_vs_hand"] = max(
        max_diff(g, hand_grads[name]) for name, g in mine["tp"]["gradients"].items()
    )
    for split in ("tp", "sp"):
        del mine[split]["gradients"]
    mine["reference_losses"] = reference["losses"]

    tic = time.perf_counter()
    x, y = batches[0]
    mine["activations"] = {
        split: saved_bytes(model, x, y)
        for split, model in (("plain", plain), *models.items())
    }
    mine["seconds_activations"] = time.perf_counter() - tic
    tic = time.perf_counter()
    mine["timing"] = measure_times(models, plain, x, y, args.repeats, dtype, counter)
    mine["seconds_timing"] = time.perf_counter() - tic
    return mine


def judge_tp(args, config: GPTConfig, everyone: list[dict], tolerance: float):
    """On rank 0: the results, the checks and the sentence for exit code 3."""
    n, b = len(everyone), DTYPES[args.dtype].itemsize
    predicted = predict_collectives(config, args.batch_size, args.seq_len, n, b)
    saved = predict_saved_bytes(config, args.batch_size, args.seq_len, n, b)
    saved["hand"] = saved["tp"]

    def largest(split: str, key: str) -> float:
        return max(e[split]["max_diff"][key] for e in everyone)

    def every_step(split: str, source: str = "collectives") -> bool:
        return all(
            step == predicted[split] for e in everyone for step in e[split][source]
        )

    block_diff = max(max(e["block"]["max_diff"].values()) for e in everyone)
    checks = {
        "hand_block": block_diff <= tolerance,
        "hand_collectives": all(
            e["block"]["collectives"] == predicted["block"] for e in everyone
        )
        and every_step("hand", "own_count")
        and every_step("hand"),
        "hand_losses": max(largest("hand", k) for k in ("logits", "losses"))
        <= tolerance,
        "tp_losses": max(largest("tp", k) for k in ("logits", "losses")) <= tolerance,
        "tp_gradients": largest("tp", "gradients_vs_hand") <= tolerance,
        "tp_collectives": every_step("tp"),
        "sp_losses": max(largest("sp", k) for k in ("logits", "losses")) <= tolerance,
        "sp_collectives": every_step("sp"),
        "activations": all(
            e["activations"][split] == saved[split]["total"]
            for e in everyone
            for split in saved
        ),
    }
    first = everyone[0]
    results = {
        "reference_losses": first["reference_losses"],
        "hand": {
            "block": {
                "max_diff": {
                    k: max(e["block"]["max_diff"][k] for e in everyone)
                    for k in first["block"]["max_diff"]
                },
                "collectives": first["block"]["collectives"],
                "predicted": predicted["block"],
            },
        },
        "activations": {
            "measured": {
                split: [e["activations"][split] for e in everyone] for split in saved
            },
            "predicted": saved,
        },
        "timing": first["timing"],
        "seconds_per_part": {
            k: first[k]
            for k in ("seconds_train", "seconds_activations", "seconds_timing")
        },
    }
    for split in ("hand", "tp", "sp"):
        results.setdefault(split, {}).update(
            losses=first[split]["losses"],
            max_diff={
                k: max(e[split]["max_diff"][k] for e in everyone)
                for k in first[split]["max_diff"]
            },
            collectives=first[split]["collectives"],
            predicted=predicted[split],
            same_on_every_rank=all(
                e[split]["collectives"] == first[split]["collectives"] for e in everyone
            ),
        )
    results["hand"]["own_count"] = first["hand"]["own_count"]
    timing = first["timing"]
    print0(
        f"one block split by hand: largest difference ~{block_diff:.1e}; "
        f"{len(first['hand']['losses'])} steps of each split, largest loss "
        "difference from the plain model: "
        + ", ".join(
            f"{s} ~{results[s]['max_diff']['losses']:.1e}" for s in ("hand", "tp", "sp")
        )
    )
    for split in ("hand", "tp", "sp"):
        step = first[split]["collectives"][0]
        said = [
            f"{phase} "
            + (" + ".join(f"{v['calls']} {k}" for k, v in step[phase].items()) or "-")
            for phase in PHASES
        ]
        print0(f"{split:4s} collectives per step: {', '.join(said)}")
    print0(
        "saved for backward on rank 0: "
        + ", ".join(
            f"{split} {first['activations'][split]} B" for split in first["activations"]
        )
    )
    if "plain_same_cpus" in timing:
        print0(
            f"forward+backward: plain {timing['plain_same_cpus'] * 1e3:.1f} ms "
            f"(one process, all {n} processes' threads), hand TP "
            f"{timing['hand'] * 1e3:.1f} ms, DTensor TP {timing['tp'] * 1e3:.1f} ms, "
            f"TP+SP {timing['sp'] * 1e3:.1f} ms; an all-reduce of "
            f"{timing['all_reduce_bytes']} B: {timing['all_reduce'] * 1e3:.2f} ms "
            f"alone, {timing.get('all_reduce_in_step', math.nan) * 1e3:.2f} ms "
            "inside the hand-split steps"
        )
    sentences = {
        "hand_block": f"the block split by hand differs from the whole block by "
        f"{block_diff:.1e}, beyond --tolerance {tolerance:g}",
        "hand_collectives": "the all-reduces of the block split by hand differ from "
        "their formula; see hand in the results",
        "hand_losses": "the model split by hand ended "
        f"{results['hand']['max_diff']['losses']:.1e} from the plain model's "
        f"losses, beyond --tolerance {tolerance:g}",
        "tp_losses": "DTensor tensor parallelism ended "
        f"{results['tp']['max_diff']['losses']:.1e} from the plain model's losses, "
        f"beyond --tolerance {tolerance:g}",
        "tp_gradients": "DTensor's gradients differ from the hand-written ones by "
        f"{largest('tp', 'gradients_vs_hand'):.1e}, beyond --tolerance "
        f"{tolerance:g}",
        "tp_collectives": "DTensor's collectives differ from their formula; see tp "
        "in the results",
        "sp_losses": "sequence parallelism ended "
        f"{results['sp']['max_diff']['losses']:.1e} from the plain model's losses, "
        f"beyond --tolerance {tolerance:g}",
        "sp_collectives": "the collectives of sequence parallelism differ from "
        "their formula; see sp in the results",
        "activations": "the bytes saved for backward differ from their formula; "
        "see activations in the results",
    }
    failure = next((sentences[k] for k, ok in checks.items() if not ok), "")
    return results, checks, failure


# ------------------------------------------------------------ --layout 2d


def predict_parameter_bytes(
    shapes: dict[str, list[int]], dp: int, tp: int, rank: int, b: int
) -> dict[str, int]:
    """Parameter bytes on ``rank`` of a dp x tp mesh (rank = dp_rank * tp + tp_rank).

    TP keeps a ``torch.chunk`` slice of a split weight along its split
    dimension; FSDP2 keeps a chunk of dim 0 of what TP left ("local"), and
    allocates ceil(rows / dp) rows of it ("storage").
    """
    dp_rank, tp_rank = divmod(rank, tp)
    owned = padded = 0
    for name, shape in shapes.items():
        kept = list(shape)
        dim = split_dim(name)
        if dim is not None:
            kept[dim] = chunk_rows(kept[dim], tp, tp_rank)
        rest = math.prod(kept[1:])
        owned += chunk_rows(kept[0], dp, dp_rank) * rest
        padded += math.ceil(kept[0] / dp) * rest
    return {"local": owned * b, "storage": padded * b}


def chunk_rows(rows: int, parts: int, index: int) -> int:
    """Rows that part ``index`` gets when ``torch.chunk`` splits ``rows`` in ``parts``."""
    per_part = math.ceil(rows / parts)
    return max(0, min(per_part, rows - index * per_part))


def tensor_bytes(tensors) -> dict[str, int]:
    """``local``: bytes of the elements; ``storage``: of the distinct memory behind them."""
    tensors = [local(t) for t in tensors]
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[(s.device, s.data_ptr())] = s.nbytes()
    return {
        "local": sum(t.numel() * t.element_size() for t in tensors),
        "storage": sum(storages.values()),
    }


def run_2d(args, config: GPTConfig, batches: list, device: torch.device) -> dict:
    """Train with TP inside each DP group and FSDP2 across them; this rank's view."""
    dp, tp = args.mesh
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(config, args.seed, DTYPES[args.dtype], device)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(config.n_layer))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    tic = time.perf_counter()
    for x, y in batches:
        # The TP ranks of one DP group take the same slice of the global batch.
        x, y = x.tensor_split(dp)[dp_rank], y.tensor_split(dp)[dp_rank]
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        # Each DP group's loss is its slice's mean; the slices are equal, so the
        # mean over all ranks (each DP group counted TP times) is the batch's.
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    return {
        "losses": losses,
        "seconds_train": time.perf_counter() - tic,
        "parameter_bytes": tensor_bytes(model.parameters()),
        "placements": {
            name: {
                "placements": [str(p) for p in param.placements],
                "mesh": list(param.device_mesh.mesh_dim_names or ()),
                "local_shape": list(local(param).shape),
            }
            for name, param in model.named_parameters()
        },
    }


def judge_2d(args, config, everyone, reference, shapes, tolerance):
    """On rank 0: the results, the checks and the sentence for exit code 3."""
    dp, tp = args.mesh
    b = DTYPES[args.dtype].itemsize
    n_params = sum(math.prod(s) for s in shapes.values())
    predicted = [predict_parameter_bytes(shapes, dp, tp, r, b) for r in range(dp * tp)]
    measured = [e["parameter_bytes"] for e in everyone]
    losses = everyone[0]["losses"]
    diff = max(abs(a - r) for a, r in zip(losses, reference))
    checks = {
        "losses": diff <= tolerance,
        "parameter_bytes": measured == predicted,
    }
    results = {
        "mesh": {"dp": dp, "tp": tp},
        "losses": losses,
        "reference_losses": reference,
        "max_diff": {"losses": diff},
        "parameter_bytes": {
            "measured": measured,
            "predicted": predicted,
            "rough": n_params * b / (dp * tp),
            "whole_model": n_params * b,
        },
        "placements_rank0": everyone[0]["placements"],
        "seconds_train": everyone[0]["seconds_train"],
    }
    print0(
        f"dp {dp} x tp {tp}: {len(losses)} steps, largest loss difference from the "
        f"plain model ~{diff:.1e}; parameters per rank "
        f"{[m['local'] for m in measured]} B (roughly {n_params * b // (dp * tp)} B)"
    )
    failure = ""
    if not checks["losses"]:
        failure = (
            f"the 2-D run ended {diff:.1e} from the plain model's losses, beyond "
            f"--tolerance {tolerance:g}"
        )
    elif not checks["parameter_bytes"]:
        failure = (
            "the parameter bytes per rank differ from their formula; see "
            "parameter_bytes in the results"
        )
    return results, checks, failure


# ------------------------------------------------------------ main


def parse_mesh(text: str, world_size: int) -> tuple[int, int]:
    """``--mesh DPxTP``, checked against the number of processes."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise UsageError(
            f"--mesh {text} is not of the form DPxTP with two positive whole "
            "numbers (e.g. 2x2)."
        )
    dp, tp = int(match[1]), int(match[2])
    if dp * tp != world_size:
        raise UsageError(
            f"--mesh {text} needs {dp * tp} processes, not {world_size}; start "
            f"{dp * tp}, or give a mesh DPxTP with DP x TP = {world_size}."
        )
    return dp, tp


def parse_args() -> argparse.Namespace:
    """The flags, checked before the processes meet."""
    parser = ArgumentParser(
        prog=SCRIPT,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--layout",
        choices=("tp", "2d"),
        default="tp",
        help="tp: by hand, DTensor and sequence parallel over all processes; 2d: "
        "DTensor TP inside FSDP2 on a DPxTP mesh (default: tp)",
    )
    add(
        "--mesh",
        help="DPxTP for --layout 2d, DP x TP processes (default: 2x2)",
    )
    add(
        "--steps",
        type=int,
        help="Adam steps of each run (default: 3 for tp, 5 for 2d)",
    )
    add(
        "--batch-size",
        type=int,
        default=8,
        help="global batch in sequences (default: 8)",
    )
    add(
        "--seq-len",
        type=int,
        default=64,
        help="characters per sequence, at most --block-size (default: 64)",
    )
    add("--lr", type=float, default=3e-3, help="Adam's learning rate (default: 3e-3)")
    add("--seed", type=int, default=0, help="of the model and the batches (default: 0)")
    add(
        "--dtype",
        choices=sorted(DTYPES),
        default="float64",
        help="of parameters, activations and Adam's state (default: float64)",
    )
    add("--n-layer", type=int, default=2, help="transformer blocks (default: 2)")
    add("--n-head", type=int, default=4, help="attention heads (default: 4)")
    add(
        "--n-embd",
        type=int,
        default=64,
        help="width, a multiple of --n-head (default: 64)",
    )
    add(
        "--block-size",
        type=int,
        default=64,
        help="longest sequence the model takes (default: 64)",
    )
    add(
        "--repeats",
        type=int,
        default=9,
        help="timed repeats of each measurement, after a warm-up, for --layout tp "
        "(default: 9)",
    )
    add(
        "--check",
        action="store_true",
        help="exit 3 when a result misses its tolerance or formula (default: off)",
    )
    add(
        "--tolerance",
        type=float,
        help="largest difference from the plain model that counts as equal "
        "(default: 1e-10 in float64, 1e-4 in float32)",
    )
    add(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the processes wait for each other (default: 600, PyTorch's own)",
    )
    add(
        "--results",
        default="",
        metavar="FILE",
        help="JSON file rank 0 writes (default: none)",
    )
    args = parser.parse_args()
    world_size = read_topology()[2]
    args.steps = DEFAULT_STEPS[args.layout] if args.steps is None else args.steps
    for key in ("steps", "batch_size", "seq_len", "n_layer", "n_head", "n_embd"):
        if getattr(args, key) < 1:
            flag = "--" + key.replace("_", "-")
            parser.error(f"{flag} must be at least 1, not {getattr(args, key)}.")
    if args.block_size < 1 or args.repeats < 1:
        parser.error("--block-size and --repeats must be at least 1.")
    if (args.tolerance is not None and args.tolerance <= 0) or args.timeout <= 0:
        parser.error("--tolerance and --timeout must be positive.")
    if args.lr <= 0:
        parser.error(f"--lr must be positive, not {args.lr:g}.")
    if args.seq_len > args.block_size:
        parser.error(
            f"--seq-len {args.seq_len} is longer than --block-size {args.block_size}; "
            "shorten it or widen the model."
        )
    mesh = None
    if args.layout == "tp" and args.mesh is not None:
        parser.error("--mesh is for --layout 2d; leave it out, or add --layout 2d.")
    if args.layout == "2d":
        mesh = parse_mesh(args.mesh or "2x2", world_size)
    tp = world_size if mesh is None else mesh[1]
    if args.n_head % tp:
        parser.error(
            f"--n-head {args.n_head} does not split over {tp} tensor-parallel "
            f"processes, each of which keeps whole heads; use a number of them that "
            f"divides {args.n_head}."
        )
    args.mesh = mesh
    if args.layout == "tp" and args.seq_len % world_size:
        parser.error(
            f"--seq-len {args.seq_len} does not split over {world_size} processes "
            f"for sequence parallelism; use a multiple of {world_size}."
        )
    if args.layout == "2d" and args.batch_size % mesh[0]:
        parser.error(
            f"--batch-size {args.batch_size} does not split evenly over "
            f"{args.mesh[0]} data-parallel groups; use a multiple of "
            f"{args.mesh[0]}."
        )
    return args


def main() -> None:
    wall = time.perf_counter()
    args = parse_args()
    text = CharText()
    if args.seq_len >= len(text.ids):
        raise UsageError(
            f"--seq-len {args.seq_len} does not fit in the text of {len(text.ids)} "
            "characters; shorten it."
        )
    config = GPTConfig(
        vocab_size=text.vocab_size,
        **{k: getattr(args, k) for k in MODEL_DEFAULTS},
    )
    dtype = DTYPES[args.dtype]
    tolerance = args.tolerance or (1e-10 if dtype == torch.float64 else 1e-4)

    rank, _, world_size, device = setup_distributed(args.timeout)
    seconds = {"setup": time.perf_counter() - wall}
    layout = (
        f"dp {args.mesh[0]} x tp {args.mesh[1]}"
        if args.layout == "2d"
        else f"tensor parallel over {world_size}"
    )
    print0(
        f"{world_size} process{'es' if world_size > 1 else ''} on {device.type}, "
        f"{layout}: {config.n_layer} blocks of width {config.n_embd}, "
        f"{config.n_head} heads, in {args.dtype}, batch {args.batch_size} x "
        f"{args.seq_len}, {args.steps} steps"
    )
    batches = global_batches(text, args, device)
    tic = time.perf_counter()
    if args.layout == "tp":
        mine = run_tp(args, config, batches, device)
    else:
        mine = run_2d(args, config, batches, device)
    seconds["run"] = time.perf_counter() - tic
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)

    failure = ""
    if rank == 0:
        if args.layout == "tp":
            results, checks, failure = judge_tp(args, config, everyone, tolerance)
        else:
            tic = time.perf_counter()
            plain = build_model(config, args.seed, dtype, device)
            reference = train(plain, batches, args.lr)["losses"]
            seconds["reference"] = time.perf_counter() - tic
            shapes = {n: list(p.shape) for n, p in plain.named_parameters()}
            results, checks, failure = judge_2d(
                args, config, everyone, reference, shapes, tolerance
            )
        print0(
            "checks: "
            + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items())
        )
        seconds["total"] = time.perf_counter() - wall
        if args.results:
            settings = {
                "script": SCRIPT,
                "torch": str(torch.__version__),
                "layout": args.layout,
                "world_size": world_size,
                "backend": dist.get_backend(),
                "device": device.type,
                "config": asdict(config),
                "dtype": args.dtype,
                "dtype_bytes": dtype.itemsize,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "lr": args.lr,
                "seed": args.seed,
                "steps": args.steps,
                "tolerance": tolerance,
            }
            with open(args.results, "w") as f:
                json.dump(
                    {**settings, **results, "checks": checks, "seconds": seconds},
                    f,
                    indent=1,
                )
        if not args.check:
            failure = ""
    verdict = [failure]
    dist.broadcast_object_list(verdict, src=0)  # every rank exits with the same code
    dist.destroy_process_group()
    if verdict[0]:
        fail(f"{verdict[0]}.", code=3)


if __name__ == "__main__":
    run_main(main)
