"""Pipeline parallelism on a small GPT: GPipe, 1F1B and interleaved 1F1B, their bubbles and the activations each stage holds.

Launch lines:
    torchrun --standalone --nproc-per-node=2 pipeline_gpt.py --check
    torchrun --standalone --nproc-per-node=4 pipeline_gpt.py --check --microbatches 4,8
    python pipeline_gpt.py --check                                   # one stage
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=pipeline pipeline_gpt.py --check                  # on each of 2 nodes
    srun --ntasks=4 --gpus-per-task=1 python pipeline_gpt.py --check   # under SLURM

Every process builds the same small GPT (the course's model, copied here so
the script stands alone) from the same seed and keeps one contiguous part of
it, a *stage*: with p processes the first stage holds the embeddings and the
first n_layer / p blocks, the last stage the last blocks, the final LayerNorm
and the head. ``torch.distributed.pipelining`` (``PipelineStage`` and a
schedule) splits each global batch into m micro-batches, sends activations
forward and their gradients backward between neighbouring stages, and
computes the loss of each micro-batch on the last stage. With
``--schedules interleaved`` each process holds two stages instead (process r
holds stages r and r + p, one n_layer / 2p of the blocks each) and runs
``ScheduleInterleaved1F1B``.

For each schedule and each micro-batch count it trains ``--steps`` steps with
Adam on the same global batches of the Zen of Python, read as characters,
from the same initial model, and measures:

- The timeline: every stage records when it starts and ends the forward and
  the backward pass of each micro-batch (it wraps ``forward_one_chunk`` and
  ``backward_one_chunk``), on a clock started by a barrier at the start of the
  step. The *bubble* of a step is the fraction of the step, from its common
  start to the last stage's end, that a process spends outside those
  computations (waiting, and sending and receiving), averaged over the
  processes. With equal stages that take t_f and t_b per micro-batch and
  instant communication, GPipe and 1F1B both take (m + p - 1)(t_f + t_b) for
  m (t_f + t_b) of work per stage: a bubble of (p - 1) / (m + p - 1). The
  interleaved schedule cuts each process's work into v = 2 stages: (p - 1) /
  (v m + p - 1). The first step of each setting is a warm-up (the stages
  exchange shapes) and is not timed; the bubble reported is the median over
  the timed steps.
- The activations each process keeps for backward: autograd's saved-tensor
  hooks count the bytes of every storage saved in a forward pass (each once,
  the stage's parameters and buffers left out) until the backward pass frees
  it, and the peak over the step is reported, beside the largest number of
  micro-batches in flight (forward done, backward not yet) read from the
  timeline, both from the timed steps (the warm-up step runs an extra forward
  pass to exchange shapes). GPipe runs all m forward passes first: m in flight on every
  stage. 1F1B starts backward passes as soon as the last stage can: stage s
  of p holds at most min(m, p - s). The peak bytes divided by the bytes of one
  micro-batch (one forward pass of the stage, counted alone) give the
  measured number in flight.
- The losses: the mean of the micro-batches' losses, which is the global
  batch's loss. With ``--check``, rank 0 also trains the plain model (one
  process, the whole batch, no pipeline) and every setting's losses must equal
  its losses within ``--tolerance``.

With ``--check``, a loss that misses the tolerance or a number in flight that
differs from its formula ends the run with exit code 3. The timings are
reported, not checked: with more processes than cores (4 stages on 2 cores)
busy stages share a core and stretch, and the bubble shrinks below the
formula. All processes decide together: nccl with one GPU each when every
process has a GPU of its own, gloo on the CPUs otherwise.

Writes: a few lines per setting on rank 0; with ``--results FILE``, JSON from
rank 0: the settings, ``runs`` (per schedule and micro-batch count: losses,
step times, the seconds each process computed per step (``work_seconds``),
bubbles and their formula, the timeline of the last timed step, peak saved
bytes and micro-batches in flight per stage), ``reference_losses`` with
``--check``, ``checks`` and ``seconds``.

Exit codes: 0 done (and, with ``--check``, every check holds); 3 a loss or a
count missed its check, said in one sentence by rank 0; 2 bad input (e.g.
blocks that do not split evenly into stages, a batch that does not split into
micro-batches), said in one sentence by rank 0; 1 anything unexpected (a
traceback). Needs PyTorch 2.6 or newer.
"""

import argparse
import codecs
import collections
import contextlib
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
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

import torch

SCRIPT = Path(__file__).name
MIN_TORCH = (2, 6)  # torch.distributed.pipelining with runtime shape inference


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
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
except ImportError as err:
    fail(
        "this script needs torch.distributed.pipelining, which this PyTorch "
        f"{torch.__version__} lacks ({err}); use PyTorch 2.6 or newer."
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


# ------------------------------------------------------------ the pipeline


DTYPES = {"float32": torch.float32, "float64": torch.float64}
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
}
STAGES_PER_PROCESS = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


class GPTStage(nn.Module):
    """Blocks ``first`` to ``last - 1`` of ``model``; the embeddings too on the
    first stage, the final LayerNorm and the head on the last."""

    def __init__(self, model: GPT, first: int, last: int) -> None:
        super().__init__()
        self.is_first, self.is_last = first == 0, last == len(model.blocks)
        if self.is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleList(model.blocks[first:last])
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # token ids in
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x  # logits out


class Recorder:
    """The forward ("F") and backward ("B") passes of one process's stages in a step."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        """A new step: forget the events, restart the clock."""
        self.events: list[list] = []  # [kind, stage, micro-batch, start, end]
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that records when each forward and backward pass starts and ends."""

    def __init__(self, *args, recorder: Recorder, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorder = recorder

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        start = self.recorder.now()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self.recorder.events.append(
            ["F", self.stage_index, fwd_chunk_id, start, self.recorder.now()]
        )
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        start = self.recorder.now()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.recorder.events.append(
            ["B", self.stage_index, bwd_chunk_id, start, self.recorder.now()]
        )
        return out


class Held:
    """A tensor autograd saved, wrapped so that its release can be seen."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def unpack(saved: object) -> torch.Tensor:
    return saved.tensor if isinstance(saved, Held) else saved


class LiveSaved:
    """The bytes autograd keeps for backward at each moment of a ``with`` block, and their peak.

    Each storage counts once however many of its views are saved, from its
    first save until the last of them is released (the backward pass frees
    them); the storages of ``exclude`` (parameters, buffers) never count.
    """

    def __init__(self, exclude) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, list[int]] = {}  # address: [saves alive, bytes]
        self.live = self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)

    def pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self.excluded or storage.nbytes() == 0:
            return tensor
        entry = self.storages.setdefault(address, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        held = Held(tensor)
        weakref.finalize(held, self.release, address)
        return held

    def release(self, address: int) -> None:
        entry = self.storages[address]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[address]

    def __enter__(self) -> Self:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)


def bubble_formula(schedule: str, stages: int, microbatches: int) -> float:
    """The idle fraction of a step with equal stages and instant communication.

    ``stages`` is the number of processes p; the interleaved schedule runs v = 2
    stages on each: (p - 1) / (v m + p - 1).
    """
    v = STAGES_PER_PROCESS[schedule]
    return (stages - 1) / (v * microbatches + stages - 1)


def in_flight_formula(
    schedule: str, stages: int, microbatches: int
) -> list[int] | None:
    """Micro-batches whose activations each stage holds at most (None: not predicted)."""
    if schedule == "gpipe":
        return [microbatches] * stages
    if schedule == "1f1b":
        return [min(microbatches, stages - s) for s in range(stages)]
    return None


def most_in_flight(events: list[list]) -> int:
    """The most micro-batches forwarded and not yet backwarded, in the order the passes ended."""
    held = most = 0
    for kind, *_ in sorted(events, key=lambda e: e[4]):
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def build_model(config: GPTConfig, seed: int, dtype: torch.dtype, device) -> GPT:
    """The same GPT on every rank: initialised in float32 from ``seed``, then cast."""
    torch.manual_seed(seed)
    return GPT(config).to(device=device, dtype=dtype)


def global_batches(
    text: CharText, args, device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank and for every setting."""
    g = torch.Generator().manual_seed(args.seed)
    batches = [text.batch(args.batch_size, args.seq_len, g) for _ in range(args.steps)]
    return [(x.to(device), y.to(device)) for x, y in batches]


def microbatch_bytes(stage: GPTStage, x: torch.Tensor, y: torch.Tensor, exclude) -> int:
    """Bytes saved for backward by one micro-batch's forward pass through ``stage``
    (and the loss on the last stage), counted alone."""
    with LiveSaved(exclude) as saved:
        out = stage(x)
        if stage.is_last:
            lm_loss(out, y)
    return saved.peak


def run_setting(
    schedule: str, microbatches: int, args, config: GPTConfig, batches, device
) -> dict:
    """Train ``args.steps`` steps with one schedule and micro-batch count; measure each step.

    Returns this rank's record: losses (on the last stage's rank), the end of
    each step and its busy seconds, the timeline of the last step, the peak
    saved bytes and those of one micro-batch.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    v = STAGES_PER_PROCESS[schedule]
    n_stages, per_stage = p * v, config.n_layer // (p * v)
    model = build_model(config, args.seed, DTYPES[args.dtype], device)
    ids = [rank + k * p for k in range(v)]  # interleaved: stages r and r + p
    modules = [GPTStage(model, s * per_stage, (s + 1) * per_stage) for s in ids]
    recorder = Recorder()
    stages = [
        TimedStage(module, s, n_stages, device, recorder=recorder)
        for s, module in zip(ids, modules)
    ]
    exclude = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    optimizer = torch.optim.Adam(
        [q for m in modules for q in m.parameters()], lr=args.lr
    )
    pipeline = SCHEDULES[schedule](
        stages if v > 1 else stages[0], n_microbatches=microbatches, loss_fn=lm_loss
    )
    has_first = any(m.is_first for m in modules)
    has_last = any(m.is_last for m in modules)
    record = {"losses": [], "ends": [], "busy": [], "peaks": []}
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        inputs = (x,) if has_first else ()
        extra = {"target": y, "losses": losses} if has_last else {}
        dist.barrier()
        recorder.start()
        with LiveSaved(exclude) as saved:
            pipeline.step(*inputs, **extra, return_outputs=False)
        record["ends"].append(recorder.now())
        optimizer.step()
        record["busy"].append(sum(e[4] - e[3] for e in recorder.events))
        record["peaks"].append(saved.peak)
        if has_last:  # equal micro-batches: their mean is the global batch's loss
            record["losses"].append(torch.stack(losses).mean().item())
    record["events"] = recorder.events
    record["in_flight"] = most_in_flight(recorder.events)
    record["microbatch_bytes"] = None
    if v == 1:  # one micro-batch's saved bytes, counted alone
        xs, ys = (
            batches[0][0].tensor_split(microbatches),
            batches[0][1].tensor_split(microbatches),
        )
        x0 = xs[0]
        if not modules[0].is_first:
            x0 = torch.zeros(
                *xs[0].shape, config.n_embd, dtype=DTYPES[args.dtype], device=device
            ).requires_grad_()
        record["microbatch_bytes"] = microbatch_bytes(modules[0], x0, ys[0], exclude)
    return record


def summarize(schedule: str, microbatches: int, records: list[dict]) -> dict:
    """One setting from every rank's record: losses, bubbles, in flight, bytes."""
    p = len(records)
    losses = next(r["losses"] for r in records if r["losses"])
    makespans = [max(r["ends"][i] for r in records) for i in range(len(losses))]
    bubbles = [
        1 - statistics.mean(r["busy"][i] for r in records) / makespans[i]
        for i in range(len(losses))
    ]
    work = [statistics.mean(r["busy"][i] for r in records) for i in range(len(losses))]
    timed = slice(1, None) if len(losses) > 1 else slice(None)  # skip the warm-up
    last = len(losses) - 1
    return {
        "schedule": schedule,
        "microbatches": microbatches,
        "losses": losses,
        "step_seconds": makespans,
        "bubbles": bubbles,
        "bubble": statistics.median(bubbles[timed]),
        "work_seconds": statistics.median(work[timed]),  # per process, per step
        "bubble_formula": bubble_formula(schedule, p, microbatches),
        "timeline": {
            "makespan": makespans[last],
            "events": [r["events"] for r in records],
        },
        "in_flight": [r["in_flight"] for r in records],
        "in_flight_formula": in_flight_formula(schedule, p, microbatches),
        # The warm-up step runs one more forward pass to exchange shapes: its
        # peak is not the schedule's.
        "peak_saved_bytes": [max(r["peaks"][1:] or r["peaks"]) for r in records],
        "microbatch_saved_bytes": [r["microbatch_bytes"] for r in records],
    }


def reference_losses(config, args, batches, device) -> list[float]:
    """The plain model's losses: one process, the whole batch, no pipeline."""
    model = build_model(config, args.seed, DTYPES[args.dtype], device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def judge(
    runs: list[dict], reference: list[float] | None, tolerance: float
) -> tuple[dict, str]:
    """The checks, and the sentence for exit code 3 ("" if every check holds)."""
    checks: dict[str, bool] = {}
    failure = ""
    for run in runs:
        name = f"{run['schedule']}, m = {run['microbatches']}"
        if reference is not None:
            run["loss_difference"] = max(
                abs(a - b) for a, b in zip(run["losses"], reference)
            )
            checks[f"{name}: losses"] = run["loss_difference"] <= tolerance
            if not checks[f"{name}: losses"] and not failure:
                failure = (
                    f"{name}: the losses differ from the plain model's by "
                    f"{run['loss_difference']:.1e}, more than --tolerance {tolerance:g}."
                )
        formula = run["in_flight_formula"]
        if formula is None:
            continue
        measured = [
            peak / one if one else 0.0
            for peak, one in zip(run["peak_saved_bytes"], run["microbatch_saved_bytes"])
        ]
        run["in_flight_from_bytes"] = measured
        ok = run["in_flight"] == formula and all(
            abs(m - f) <= 0.05 * f for m, f in zip(measured, formula)
        )
        checks[f"{name}: micro-batches in flight"] = ok
        if not ok and not failure:
            failure = (
                f"{name}: the stages held {run['in_flight']} micro-batches "
                f"({', '.join(f'{m:.2f}' for m in measured)} by their bytes), "
                f"not {formula} as the schedule's formula says."
            )
    return checks, failure


def parse_args() -> argparse.Namespace:
    """The flags, checked before the processes meet."""
    parser = ArgumentParser(
        prog=SCRIPT,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--schedules",
        default="gpipe,1f1b",
        help="comma-separated, from gpipe, 1f1b, interleaved (default: gpipe,1f1b)",
    )
    add(
        "--microbatches",
        default="8",
        help="comma-separated micro-batch counts m, such as 2,4,8; 1F1B needs at "
        "least one per process (default: 8)",
    )
    add(
        "--steps",
        type=int,
        default=4,
        help="training steps per setting, the first a warm-up (default: 4)",
    )
    add(
        "--batch-size",
        type=int,
        default=32,
        help="global batch in sequences, a multiple of every m (default: 32)",
    )
    add("--seq-len", type=int, default=64, help="characters per sequence (default: 64)")
    add("--lr", type=float, default=3e-3, help="Adam's learning rate (default: 3e-3)")
    add("--seed", type=int, default=0, help="of the model and the batches (default: 0)")
    add(
        "--dtype",
        choices=sorted(DTYPES),
        default="float64",
        help="of parameters and activations (default: float64)",
    )
    add(
        "--n-layer",
        type=int,
        default=4,
        help="transformer blocks, a multiple of the number of stages (default: 4)",
    )
    add("--n-head", type=int, default=4, help="attention heads (default: 4)")
    add(
        "--n-embd",
        type=int,
        default=64,
        help="width, a multiple of --n-head (default: 64)",
    )
    add(
        "--check",
        action="store_true",
        help="compare every setting's losses with a plain one-process run and the "
        "micro-batches in flight with their formula; exit 3 on a miss (default: off)",
    )
    add(
        "--tolerance",
        type=float,
        help="largest loss difference from the plain run that counts as equal "
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
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown or not args.schedules:
        parser.error(
            f"--schedules takes {', '.join(SCHEDULES)}, not {unknown[0] if unknown else 'nothing'!r}."
        )
    try:
        args.microbatches = [int(m) for m in args.microbatches.split(",")]
    except ValueError:
        parser.error(
            f"--microbatches takes whole numbers such as 1,2,4,8, not {args.microbatches!r}."
        )
    for flag in ("steps", "batch_size", "seq_len", "n_layer", "n_head", "n_embd"):
        if getattr(args, flag) < 1:
            parser.error(
                f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}."
            )
    if min(args.microbatches) < 1:
        parser.error(
            f"--microbatches must be at least 1, not {min(args.microbatches)}."
        )
    if (
        (args.tolerance is not None and args.tolerance <= 0)
        or args.timeout <= 0
        or args.lr <= 0
    ):
        parser.error("--tolerance, --timeout and --lr must be positive.")
    uneven = [m for m in args.microbatches if args.batch_size % m]
    if uneven:
        # Unequal micro-batches would weigh their losses unequally in the mean.
        parser.error(
            f"--batch-size {args.batch_size} does not split into {uneven[0]} equal "
            "micro-batches; use a multiple of every micro-batch count."
        )
    p = read_topology()[2]
    for schedule in args.schedules:
        stages = p * STAGES_PER_PROCESS[schedule]
        if args.n_layer % stages:
            parser.error(
                f"--n-layer {args.n_layer} does not split into {stages} equal stages "
                f"({schedule} on {p} processes); use a multiple of {stages}."
            )
        if schedule != "gpipe" and min(args.microbatches) < p:
            parser.error(
                f"the {schedule} schedule needs at least {p} micro-batches (one per "
                f"process), not {min(args.microbatches)}."
            )
        odd = [m for m in args.microbatches if m % p]
        if schedule == "interleaved" and odd:
            parser.error(
                f"the interleaved schedule needs a multiple of {p} micro-batches "
                f"(one per process), not {odd[0]}."
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
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    dtype = DTYPES[args.dtype]
    tolerance = args.tolerance or (1e-10 if dtype == torch.float64 else 1e-4)
    rank, _, p, device = setup_distributed(args.timeout)
    print0(
        f"{p} stage{'s' if p > 1 else ''} on {device.type}: {config.n_layer} blocks of "
        f"width {config.n_embd} in {args.dtype}, global batch {args.batch_size} x "
        f"{args.seq_len}, {args.steps} steps per setting"
    )
    batches = global_batches(text, args, device)
    runs = []
    for schedule in args.schedules:
        for m in args.microbatches:
            record = run_setting(schedule, m, args, config, batches, device)
            everyone = [None] * p
            dist.all_gather_object(everyone, record)
            run = summarize(schedule, m, everyone)
            runs.append(run)
            flight = "/".join(map(str, run["in_flight"]))
            step = statistics.median(run["step_seconds"][1:] or run["step_seconds"])
            print0(  # ~: a measured fraction, which differs from run to run
                f"{schedule:<11} m = {m:<2}  step {step * 1e3:.1f} ms, bubble "
                f"~{run['bubble']:.2f} (formula {run['bubble_formula']:.2f}), "
                f"in flight per stage {flight}"
            )
    failure = ""
    if rank == 0:
        reference = (
            reference_losses(config, args, batches, device) if args.check else None
        )
        checks, failure = judge(runs, reference, tolerance)
        if args.check:
            worst = max(r["loss_difference"] for r in runs)
            print0(
                f"checks: losses {'ok' if all(v for k, v in checks.items() if k.endswith('losses')) else 'MISSED'} "
                f"(largest difference ~{worst:.1e}), micro-batches in flight "
                f"{'ok' if all(v for k, v in checks.items() if k.endswith('flight')) else 'MISSED'}"
            )
        if args.results:
            results = {
                "script": SCRIPT,
                "torch": str(torch.__version__),
                "world_size": p,
                "backend": dist.get_backend(),
                "device": device.type,
                "config": asdict(config),
                "dtype": args.dtype,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "lr": args.lr,
                "seed": args.seed,
                "runs": runs,
                "reference_losses": reference,
                "tolerance": tolerance,
                "checks": checks,
                "seconds": time.perf_counter() - wall,
            }
            with open(args.results, "w") as f:
                json.dump(results, f, indent=1)
    verdict = [failure]
    dist.broadcast_object_list(verdict, src=0)  # every rank exits with the same code
    dist.destroy_process_group()
    if verdict[0]:
        fail(verdict[0], code=3)


if __name__ == "__main__":
    run_main(main)
