"""FSDP2 on a small GPT: the bytes each rank holds, the traffic per step, sharded checkpoints.

Launch lines:
    torchrun --standalone --nproc-per-node=4 fsdp_gpt.py --check --save ckpt
    torchrun --standalone --nproc-per-node=2 fsdp_gpt.py --check --load ckpt
    python fsdp_gpt.py --check                                       # one process
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=fsdp fsdp_gpt.py --save ckpt                      # on each of 2 nodes
    srun --ntasks=4 --gpus-per-task=1 python fsdp_gpt.py --save ckpt   # under SLURM

Every rank builds the same small GPT (the course's model, copied here so the
script stands alone) from the same seed, in float64 by default, and applies
``torch.distributed.fsdp.fully_shard`` (FSDP2) to each transformer block and
then to the whole model (the root, which keeps the embeddings, the final
LayerNorm and the head). Each rank trains with Adam on its slice of the same
global batches of the Zen of Python, read as characters; the loss reported
for a step is the mean over all ranks, which is the loss of the global batch.

It measures three things and writes each beside its formula:

- Bytes per rank after the first step, read from the local shards
  (``DTensor.to_local()``) of the parameters, their gradients and Adam's
  state. FSDP2 splits dim 0 of every parameter as ``torch.chunk`` does:
  ``c = ceil(rows / N)`` rows for each rank while rows last, so the last ranks
  may get fewer (even none), and each rank allocates ``c`` rows whatever it
  got (dim-0 padding). "local" counts the elements a rank owns; "storage"
  counts the memory behind them, with the padding. Gradients of one FSDP unit
  share one flat buffer (the reduce-scatter's output). Adam's ``exp_avg`` and
  ``exp_avg_sq`` follow the local shard without padding; its ``step`` is a
  plain float32 scalar per parameter tensor, kept whole on every rank (not
  sharded). The ZeRO-1, ZeRO-2 and ZeRO-3 formulas for the same model are
  written beside the measurement.
- Collectives per training step, counted by wrapping the functions FSDP2
  calls through ``torch.distributed`` (``all_gather_single`` and
  ``reduce_scatter_single`` in torch 2.14; ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` in older releases): their number and the bytes
  of their input and output tensors. Each FSDP unit all-gathers its
  parameters (one flat buffer: N times its padded shard) before its forward,
  again before its backward if it resharded after forward, and
  reduce-scatters its gradients once. This is counted for three settings of
  ``reshard_after_forward``: "on" (True for every block; the root left to
  FSDP's default, which in torch 2.14 keeps the root unsharded after forward,
  since its backward begins at once), "off" (False everywhere) and "all-on"
  (True passed to the root too, which torch 2.14 honours). With one process
  FSDP2 calls no collective at all. Beside the traffic, the bytes of unsharded
  parameters alive between forward and backward: the memory that resharding
  saves.
- Checkpoints. ``--save DIR`` writes the model and Adam's state with
  ``torch.distributed.checkpoint`` (DCP): every rank writes its own shard
  (``__RANK_0.distcp``), rank 0 the ``.metadata``, into ``DIR.tmp``, which
  rank 0 renames to ``DIR`` once every rank is done (an old ``DIR`` is moved
  to ``DIR.old`` and removed last, so an interrupted save never destroys the
  previous checkpoint; DIR must be on a file system that every node sees).
  Then the classic way, for comparison: the full state gathered to rank 0
  (``StateDictOptions(full_state_dict=True, cpu_offload=True)``: every rank
  takes part in all-gathering each tensor, one at a time, and only rank 0
  keeps the result, on the CPU) and written with ``torch.save`` to
  ``DIR/full_state.pt`` (a temporary file, then ``os.replace``), which
  ``torch.load(weights_only=True)`` reads into the plain model. For each it
  reports the seconds on rank 0, the bytes of tensors each rank holds in the
  state dict it saves, the growth of rank 0's peak resident memory
  (``ru_maxrss``, KiB; 0 when the save stayed below an earlier peak, so
  small models show mostly noise) and, on CUDA,
  ``torch.cuda.max_memory_allocated()``. ``--load DIR`` reads a DCP
  checkpoint, saved by any number of processes (DCP reshards), and training
  continues at the saved step with the same batches, so its losses continue
  those of an uninterrupted run. The model's sizes, dtype and training
  settings default to the checkpoint's.

The formulas describe FSDP2 as torch 2.14 implements it; the results say
under ``checks`` whether each measurement meets its formula. With
``--check``, rank 0 also trains the plain model (no FSDP, one process, the
whole batch) from step 0 and compares the losses, and a miss of any check
ends the run with exit code 3. All processes decide together: nccl with one
GPU each when every process has a GPU of its own, gloo on the CPUs
otherwise.

Writes: a few lines per run on rank 0; with ``--results FILE``, JSON from
rank 0: the settings, ``steps`` and ``losses`` (and ``reference_losses``
with ``--check``), ``memory`` (measured and predicted per rank, the ZeRO
formulas, every parameter's split), ``communication`` (per setting: counts
per step, prediction, unsharded bytes after forward), ``checkpoint`` (save
and load), ``checks`` and ``seconds``.

Exit codes: 0 done (and, with ``--check``, every number matches); 3 a loss
missed ``--tolerance`` or a measurement missed its formula, said in one
sentence by rank 0; 2 bad input (e.g. a batch that does not split evenly, a
missing or broken checkpoint), said in one sentence by rank 0; 1 anything
unexpected (a traceback). Needs PyTorch 2.6 or newer.
"""

import argparse
import codecs
import collections
import contextlib
import datetime
import functools
import inspect
import io
import json
import logging
import math
import os
import re
import shutil
import socket
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh
except ImportError as err:
    fail(
        "this script needs torch.distributed.fsdp.fully_shard, "
        "torch.distributed.tensor and torch.distributed.checkpoint, which this "
        f"PyTorch {torch.__version__} lacks ({err}); use PyTorch 2.6 or newer."
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


# ------------------------------------------------------------ the model's data


DTYPES = {"float32": torch.float32, "float64": torch.float64}
SETTINGS = ("on", "off", "all-on")  # reshard_after_forward, see shard_model()
STEP_BYTES = 4  # Adam's step counter: a float32 scalar per parameter tensor
MODEL_DEFAULTS = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}
TRAIN_DEFAULTS = {
    "batch_size": 8,
    "seq_len": 64,
    "lr": 3e-3,
    "seed": 0,
    "dtype": "float64",
}
CHECKPOINT_FORMAT = f"{SCRIPT} sharded checkpoint (torch.distributed.checkpoint)"


def build_model(config: GPTConfig, seed: int, dtype: torch.dtype, device) -> GPT:
    """The same GPT on every rank: initialised in float32 from ``seed``, then cast."""
    torch.manual_seed(seed)
    return GPT(config).to(device=device, dtype=dtype)


def global_batches(
    text: CharText, args, start: int, count: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of steps ``start`` to ``start + count - 1``.

    The same on every rank and in every run: a resumed run draws the batches
    of the steps it skips and drops them, so that step s sees the same batch
    as in an uninterrupted run.
    """
    g = torch.Generator().manual_seed(args.seed)
    batches = [
        text.batch(args.batch_size, args.seq_len, g) for _ in range(start + count)
    ]
    return [(x.to(device), y.to(device)) for x, y in batches[start:]]


def local_slice(t: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of the global batch (dim 0)."""
    return t.tensor_split(dist.get_world_size())[dist.get_rank()]


def units_of(model: GPT) -> list[dict]:
    """The FSDP units (each block, then the root) and the shapes of their parameters."""
    units = [
        {"name": f"blocks.{i}", "parameters": []} for i in range(len(model.blocks))
    ]
    units.append({"name": "root", "parameters": []})
    for name, p in model.named_parameters():
        index = int(name.split(".")[1]) if name.startswith("blocks.") else -1
        units[index]["parameters"].append({"name": name, "shape": list(p.shape)})
    return units


def shard_model(model: GPT, mesh, setting: str) -> GPT:
    """``fully_shard`` each block, then the root, in place.

    ``setting`` picks ``reshard_after_forward``: "on" passes True to every
    block and leaves the root to FSDP's default, which keeps the root's
    parameters unsharded after forward (its backward begins at once); "off"
    passes False everywhere; "all-on" passes True to the root too.
    """
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=setting != "off")
    if setting == "on":
        return fully_shard(model, mesh=mesh)
    return fully_shard(model, mesh=mesh, reshard_after_forward=setting == "all-on")


# ------------------------------------------------------------ measurements


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors) -> dict:
    """``local``: bytes of the elements; ``storage``: bytes of the distinct memory behind them."""
    tensors = [local(t) for t in tensors]
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[(s.device, s.data_ptr())] = s.nbytes()
    return {
        "local": sum(t.numel() * t.element_size() for t in tensors),
        "storage": sum(storages.values()),
    }


def measure_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of this rank's parameters, gradients and Adam state (after a step)."""
    params = list(model.parameters())
    state = [s for per_param in optimizer.state.values() for s in per_param.items()]
    steps = [v for k, v in state if k == "step"]
    return {
        "parameters": tensor_bytes(params),
        "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": tensor_bytes(
            v for k, v in state if k != "step" and isinstance(v, torch.Tensor)
        ),
        "step_counters": {
            "count": len(steps),
            "bytes": sum(local(v).numel() * local(v).element_size() for v in steps),
            "dtype": sorted({str(v.dtype) for v in steps}),
            "sharded": any(isinstance(v, DTensor) for v in steps),
        },
    }


def chunk_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` owns when ``torch.chunk`` splits ``rows`` in ``world_size``."""
    per_rank = math.ceil(rows / world_size)
    return max(0, min(per_rank, rows - rank * per_rank))


def padded_shard(shape: list[int], world_size: int) -> int:
    """Elements each rank allocates for a parameter: ``ceil(rows / N)`` rows, padded."""
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def predict_state(units: list[dict], world_size: int, rank: int, dtype_bytes: int):
    """What ``measure_state`` should find on ``rank``: ZeRO-3 as FSDP2 splits dim 0."""
    shapes = [p["shape"] for u in units for p in u["parameters"]]
    owned = (
        sum(chunk_rows(s[0], world_size, rank) * math.prod(s[1:]) for s in shapes)
        * dtype_bytes
    )
    padded = sum(padded_shard(s, world_size) for s in shapes) * dtype_bytes
    return {
        "parameters": {"local": owned, "storage": padded},
        # One flat buffer per unit: the reduce-scatter's output, padded.
        "gradients": {"local": owned, "storage": padded},
        # exp_avg and exp_avg_sq: zeros_like the local shard, without padding.
        "optimizer_state": {"local": 2 * owned, "storage": 2 * owned},
        "step_counters": {
            "count": len(shapes),
            "bytes": STEP_BYTES * len(shapes),
            "dtype": ["torch.float32"],
            "sharded": False,
        },
    }


def zero_formulas(n_params: int, n_tensors: int, world_size: int, b: int) -> dict:
    """Bytes per rank for Adam under each ZeRO stage: P params of b bytes, N ranks."""
    psi, n = n_params * b, world_size
    return {
        "P": n_params,
        "bytes_per_element": b,
        "N": n,
        "step_counters_bytes": STEP_BYTES * n_tensors,  # on top, in every row
        "stages": {
            "no sharding (DDP)": {
                "parameters": psi,
                "gradients": psi,
                "optimizer_state": 2 * psi,
            },
            "ZeRO-1": {
                "parameters": psi,
                "gradients": psi,
                "optimizer_state": 2 * psi / n,
            },
            "ZeRO-2": {
                "parameters": psi,
                "gradients": psi / n,
                "optimizer_state": 2 * psi / n,
            },
            "ZeRO-3": {
                "parameters": psi / n,
                "gradients": psi / n,
                "optimizer_state": 2 * psi / n,
            },
        },
    }


# torch.distributed function -> (kind, name of its input, name of its output)
COLLECTIVES = {
    "all_gather_single": ("all-gather", "input_tensor", "output_tensor"),
    "all_gather_into_tensor": ("all-gather", "input_tensor", "output_tensor"),
    "reduce_scatter_single": ("reduce-scatter", "input", "output"),
    "reduce_scatter_tensor": ("reduce-scatter", "input", "output"),
    "all_reduce": ("all-reduce", "tensor", "tensor"),
    "broadcast": ("broadcast", "tensor", "tensor"),
}


class CountCollectives:
    """Count the collectives called through ``torch.distributed`` in a ``with`` block.

    FSDP2 calls them as attributes of the ``torch.distributed`` module, so
    wrapping them there sees every call; ``counts`` maps each kind to its
    calls and the bytes of its input and output tensors. A call made inside
    another counted one (an old name forwarding to a new one) counts once.
    """

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self._depth = 0
        self._saved: dict = {}

    def __enter__(self):
        for name, (kind, source, target) in COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(original, kind, source, target))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _wrap(self, original, kind: str, source: str, target: str):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self._depth == 0:
                named = signature.bind(*args, **kwargs).arguments
                row = self.counts.setdefault(
                    kind, {"calls": 0, "input_bytes": 0, "output_bytes": 0}
                )
                row["calls"] += 1
                for key, tensor in (("input_bytes", source), ("output_bytes", target)):
                    row[key] += named[tensor].numel() * named[tensor].element_size()
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def unsharded_parameter_bytes(model: nn.Module) -> int:
    """Bytes behind the parameters that are unsharded right now (plain tensors, not DTensors)."""
    storages = {}
    for p in model.parameters():
        if not isinstance(p, DTensor):
            s = p.untyped_storage()
            storages[(s.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


def predict_communication(
    units: list[dict], world_size: int, dtype_bytes: int, setting: str
) -> dict:
    """Collectives of one training step, and the unsharded bytes after forward.

    Unit u's padded shard has S_u elements; its all-gather sends S_u and
    receives N S_u, its reduce-scatter sends N S_u and keeps S_u. Every unit
    all-gathers before forward; a unit that resharded after forward gathers
    again before backward. One process: no collectives.
    """
    n = world_size
    shard = {
        u["name"]: sum(padded_shard(p["shape"], n) for p in u["parameters"])
        * dtype_bytes
        for u in units
    }
    resharded = {
        name: (setting != "off") if name != "root" else setting == "all-on"
        for name in shard
    }
    kept = sum(n * s for name, s in shard.items() if not resharded[name])
    if n == 1:
        return {"collectives": {}, "unsharded_bytes_after_forward": kept}
    gathers = {name: 2 if resharded[name] else 1 for name in shard}
    return {
        "collectives": {
            "all-gather": {
                "calls": sum(gathers.values()),
                "input_bytes": sum(gathers[u] * s for u, s in shard.items()),
                "output_bytes": sum(gathers[u] * n * s for u, s in shard.items()),
            },
            "reduce-scatter": {
                "calls": len(shard),
                "input_bytes": sum(n * s for s in shard.values()),
                "output_bytes": sum(shard.values()),
            },
        },
        "unsharded_bytes_after_forward": kept,
    }


# ------------------------------------------------------------ training


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list,
    on_first_step=None,
) -> tuple[list[float], list[dict], int]:
    """Train on ``batches``; return the global losses, each step's collectives, and
    the unsharded parameter bytes between the first forward and its backward.

    ``on_first_step()`` runs after the first optimizer step, while the
    gradients still exist.
    """
    losses, collectives, after_forward = [], [], 0
    for step, (x, y) in enumerate(batches):
        x, y = local_slice(x), local_slice(y)
        optimizer.zero_grad(set_to_none=True)
        with CountCollectives() as counter:
            loss = lm_loss(model(x), y)
            if step == 0:
                after_forward = unsharded_parameter_bytes(model)
            loss.backward()
            optimizer.step()
        collectives.append(counter.counts)
        if step == 0 and on_first_step is not None:
            on_first_step()
        # The local loss is the mean over this rank's slice; the slices are
        # equal, so the mean of the ranks' losses is the global batch's loss.
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        losses.append(loss.item() / dist.get_world_size())  # .item(): a sync point
    return losses, collectives, after_forward


def reference_losses(config, args, text, start, count, device) -> list[float]:
    """Losses of the plain model (no FSDP, the whole batch) for steps start..start+count-1."""
    model = build_model(config, args.seed, DTYPES[args.dtype], device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for x, y in global_batches(text, args, 0, start + count, device):
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[start:]


# ------------------------------------------------------------ checkpoints


def max_rss_kib() -> int | None:
    """Peak resident memory of this process so far, in KiB (None where unknown)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # macOS: bytes


@contextlib.contextmanager
def measured(device: torch.device):
    """Time a collective block on rank 0 and record its memory; yields the record."""
    record: dict = {}
    dist.barrier()  # everyone starts together
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss, start = max_rss_kib(), time.perf_counter()
    yield record
    dist.barrier()  # and the last one to finish ends it
    record["seconds"] = time.perf_counter() - start
    after = max_rss_kib()
    record["max_rss_growth_kib"] = None if rss is None else after - rss
    record["cuda_max_memory_allocated"] = (
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    )


def state_dict_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict, local shards for DTensors."""
    if isinstance(state, dict):
        return sum(state_dict_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_dict_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        t = local(state)
        return t.numel() * t.element_size()
    return 0


def files_in(folder: Path) -> list[dict]:
    return [
        {"name": p.name, "bytes": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file()
    ]


def save_checkpoints(model, optimizer, folder: Path, meta: dict, device) -> dict:
    """Save with DCP (sharded), then gathered on rank 0 with torch.save; measure both."""
    rank = dist.get_rank()
    tmp = folder.with_name(folder.name + ".tmp")
    old = folder.with_name(folder.name + ".old")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of an interrupted save
        tmp.mkdir(parents=True)
    with measured(device) as sharded:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: no copies
        sharded["held_bytes"] = state_dict_bytes([model_sd, optim_sd])
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
        dist.barrier()  # every shard is on disk before the checkpoint becomes DIR
        if rank == 0:
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            if folder.exists():
                shutil.rmtree(old, ignore_errors=True)
                folder.rename(old)  # DIR.old stays whole until DIR is
            tmp.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
    # The classic way: every tensor all-gathered, kept (on the CPU) by rank 0 only.
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with measured(device) as gathered:
        model_sd = get_model_state_dict(model, options=full)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=full)
        gathered["held_bytes"] = state_dict_bytes([model_sd, optim_sd])
        if rank == 0:
            target = folder / "full_state.pt"
            partial = target.with_suffix(".pt.tmp")
            torch.save(
                {"model": model_sd, "optimizer": optim_sd, "meta": meta}, partial
            )
            os.replace(partial, target)  # readers see the old file or the new one
    del model_sd, optim_sd
    result = {"path": str(folder)}
    for name, record in (("dcp", sharded), ("gathered", gathered)):
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, record.pop("held_bytes"))
        result[name] = {**record, "held_bytes_per_rank": held}
    if rank == 0:
        written = files_in(folder)
        result["dcp"]["files"] = [f for f in written if f["name"] != "full_state.pt"]
        result["gathered"]["files"] = [
            f for f in written if f["name"] == "full_state.pt"
        ]
    return result


def read_meta(folder: Path) -> dict:
    """The checkpoint's meta.json; every way it can be missing or broken is one sentence."""
    hint = "give a directory that this script wrote with --save"
    if not folder.is_dir():
        old = folder.with_name(folder.name + ".old")
        if (old / "meta.json").is_file():  # a save stopped between its two renames
            raise UsageError(
                f"there is no checkpoint directory {folder}, but {old.name} holds "
                f"the one before an interrupted save; rename it to {folder.name}."
            )
        raise UsageError(f"there is no checkpoint directory {folder}; {hint}.")
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        raise UsageError(
            f"{folder} holds no meta.json, so it is not a complete checkpoint of "
            f"this script (an interrupted save leaves {folder.name}.tmp); {hint}."
        ) from None
    except (OSError, ValueError):
        raise UsageError(
            f"{folder / 'meta.json'} is not readable JSON; {hint}."
        ) from None
    needed = {"format", "step", "world_size", "config", "train"}
    if (
        not isinstance(meta, dict)
        or not needed <= meta.keys()
        or not isinstance(meta["step"], int)
        or not all(isinstance(meta[k], dict) for k in ("config", "train"))
    ):
        raise UsageError(f"{folder / 'meta.json'} is not this script's; {hint}.")
    if not (folder / ".metadata").is_file():
        raise UsageError(f"{folder} lacks DCP's .metadata file; {hint}.")
    return meta


def drop_records(record: logging.LogRecord) -> bool:
    """A logging filter that lets nothing through."""
    return False


def load_checkpoint(model, optimizer, folder: Path, device) -> dict:
    """Load a DCP checkpoint saved by any number of processes into this sharding."""
    with measured(device) as record:
        # For an optimizer without state yet, get_state_dict takes one step with
        # zero gradients and lr 0, so that Adam's state exists to be loaded into.
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        # DCP logs a failed read, with its traceback, on the root logger before
        # raising; the error is said once, below, in one sentence instead.
        root_logger = logging.getLogger()
        root_logger.addFilter(drop_records)
        try:
            dcp.load(state, checkpoint_id=folder)
        # DCP gathers every rank's failure and raises it on all of them, as a
        # CheckpointException, which derives from BaseException, not Exception.
        except (dcp.CheckpointException, OSError, RuntimeError, ValueError) as err:
            name = type(err).__name__
            raise UsageError(
                f"cannot read the sharded checkpoint in {folder} ({name}): it is "
                "damaged or incomplete; save it again with --save."
            ) from None
        finally:
            root_logger.removeFilter(drop_records)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
    record["path"] = str(folder)
    return record


# ------------------------------------------------------------ main


def settings_from(args, meta: dict | None) -> None:
    """Fill the flags left unset: from the checkpoint when loading, else the defaults.

    The model's sizes and dtype must match a checkpoint's; the training
    settings may differ, except under --check, which compares with a plain
    run from step 0 with one set of settings.
    """
    for group, defaults in (("config", MODEL_DEFAULTS), ("train", TRAIN_DEFAULTS)):
        for key, default in defaults.items():
            saved = meta[group].get(key) if meta else None
            given = getattr(args, key)
            if given is None:
                setattr(args, key, default if saved is None else saved)
            elif saved is not None and given != saved:
                fixed = group == "config" or key == "dtype"
                if fixed or args.check:
                    flag = "--" + key.replace("_", "-")
                    raise UsageError(
                        f"{flag} {given} differs from the checkpoint's {saved}"
                        f"{'' if fixed else ' (--check compares with one run from step 0)'}; "
                        f"leave {flag} out to use the checkpoint's."
                    )


def parse_args() -> tuple[argparse.Namespace, dict | None]:
    """The flags, checked before the processes meet; and the checkpoint's meta.json, if loading."""
    parser = ArgumentParser(
        prog=SCRIPT,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--steps", type=int, default=10, help="training steps in this run (default: 10)"
    )
    add(
        "--batch-size",
        type=int,
        help="global batch in sequences, a multiple of the number of processes "
        "(default: 8, or the checkpoint's)",
    )
    add(
        "--seq-len",
        type=int,
        help="characters per sequence, at most --block-size (default: 64, or the "
        "checkpoint's)",
    )
    add(
        "--lr",
        type=float,
        help="Adam's learning rate (default: 3e-3, or the checkpoint's)",
    )
    add(
        "--seed",
        type=int,
        help="seed of the model and the batches (default: 0, or the checkpoint's)",
    )
    add(
        "--dtype",
        choices=sorted(DTYPES),
        help="of parameters, gradients and Adam's state (default: float64, or the "
        "checkpoint's)",
    )
    add(
        "--n-layer",
        type=int,
        help="transformer blocks (default: 2, or the checkpoint's)",
    )
    add("--n-head", type=int, help="attention heads (default: 4, or the checkpoint's)")
    add(
        "--n-embd",
        type=int,
        help="width, a multiple of --n-head (default: 64, or the checkpoint's)",
    )
    add(
        "--block-size",
        type=int,
        help="longest sequence the model takes (default: 64, or the checkpoint's)",
    )
    add(
        "--reshard-after-forward",
        choices=("on", "off"),
        default="on",
        help="of the blocks while training; the root keeps FSDP's default (default: "
        "on); the collectives are counted for on, off and all-on regardless",
    )
    add(
        "--save",
        default="",
        metavar="DIR",
        help="directory for the checkpoints written after training (default: none)",
    )
    add(
        "--load",
        default="",
        metavar="DIR",
        help="sharded checkpoint directory to resume from (default: none)",
    )
    add(
        "--check",
        action="store_true",
        help="compare the losses with a plain one-process run and every measurement "
        "with its formula; exit 3 on a miss (default: off)",
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
    world_size = read_topology()[2]
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}.")
    if (args.tolerance is not None and args.tolerance <= 0) or args.timeout <= 0:
        parser.error("--tolerance and --timeout must be positive.")
    meta = read_meta(Path(args.load).resolve()) if args.load else None
    if args.save and Path(args.save).exists() and not Path(args.save).is_dir():
        parser.error(f"--save {args.save} is a file; give a directory.")
    settings_from(args, meta)
    for key in ("n_layer", "n_head", "n_embd", "block_size", "seq_len"):
        if getattr(args, key) < 1:
            flag = "--" + key.replace("_", "-")
            parser.error(f"{flag} must be at least 1, not {getattr(args, key)}.")
    if args.batch_size < 1 or args.batch_size % world_size:
        # An uneven split gives the ranks slices of different sizes: the mean
        # of their losses is then not the global batch's loss.
        parser.error(
            f"--batch-size {args.batch_size} does not split evenly over {world_size} "
            f"processes; use a multiple of {world_size}."
        )
    if args.seq_len > args.block_size:
        parser.error(
            f"--seq-len {args.seq_len} is longer than --block-size {args.block_size}; "
            "shorten it or widen the model."
        )
    if args.lr <= 0:
        parser.error(f"--lr must be positive, not {args.lr:g}.")
    return args, meta


def judge(args, run: dict, everyone: list[dict], tolerance: float) -> tuple[dict, str]:
    """On rank 0: predictions, the checks, and the sentence for exit code 3 ("" if none)."""
    n, b, units = run["world_size"], run["dtype_bytes"], run["units"]
    predicted_state = [predict_state(units, n, r, b) for r in range(n)]
    predicted_comm = {s: predict_communication(units, n, b, s) for s in SETTINGS}
    measured_states = [e["state"] for e in everyone]
    checks = {
        "memory": measured_states == predicted_state,
        "communication": all(
            step == predicted_comm[s]["collectives"]
            for e in everyone
            for s in SETTINGS
            for step in e["communication"][s]["per_step"]
        )
        and all(
            e["communication"][s]["unsharded_bytes_after_forward"]
            == predicted_comm[s]["unsharded_bytes_after_forward"]
            for e in everyone
            for s in SETTINGS
        ),
    }
    diff = None
    if run["reference_losses"] is not None:
        diff = max(abs(a - r) for a, r in zip(run["losses"], run["reference_losses"]))
        checks["losses"] = diff <= tolerance
    communication = everyone[0]["communication"]
    results = {
        **{k: v for k, v in run.items() if k != "units"},
        "max_loss_diff": diff,
        "tolerance": tolerance,
        "memory": {
            "measured": measured_states,
            "predicted": predicted_state,
            "zero": zero_formulas(run["n_params"], run["n_param_tensors"], n, b),
            "units": [
                {
                    "name": u["name"],
                    "numel": sum(math.prod(p["shape"]) for p in u["parameters"]),
                    "padded_shard_numel": sum(
                        padded_shard(p["shape"], n) for p in u["parameters"]
                    ),
                    "parameters": [
                        {
                            **p,
                            "rows_per_rank": [
                                chunk_rows(p["shape"][0], n, r) for r in range(n)
                            ],
                            "padded_rows": math.ceil(p["shape"][0] / n),
                        }
                        for p in u["parameters"]
                    ],
                }
                for u in units
            ],
        },
        "communication": {
            s: {
                **communication[s],
                "predicted": predicted_comm[s]["collectives"],
                "predicted_unsharded_bytes_after_forward": predicted_comm[s][
                    "unsharded_bytes_after_forward"
                ],
                "same_on_every_rank": all(
                    e["communication"][s] == communication[s] for e in everyone
                ),
            }
            for s in SETTINGS
        },
        "checks": checks,
    }
    mine = measured_states[0]
    print0(
        f"rank 0 holds {mine['parameters']['storage']} B of parameters, "
        f"{mine['gradients']['storage']} B of gradients and "
        f"{mine['optimizer_state']['storage'] + mine['step_counters']['bytes']} B of "
        f"Adam state; the model's parameters take {run['n_params'] * b} B"
    )
    for s in SETTINGS:
        counts = communication[s]["per_step"][0]
        said = [
            f"{v['calls']} {k}s ({v['output_bytes']} B out)" for k, v in counts.items()
        ]
        print0(
            f"reshard_after_forward {s:6s}: {', '.join(said) or 'no collectives'} per "
            f"step; {communication[s]['unsharded_bytes_after_forward']} B unsharded "
            "between forward and backward"
        )
    print0(
        "checks: "
        + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items())
        + ("" if diff is None else f" (largest loss difference ~{diff:.1e})")
    )
    failure = ""
    if args.check and not checks.get("losses", True):
        failure = (
            f"the losses ended {diff:.1e} from the plain one-process run, beyond "
            f"--tolerance {tolerance:g}"
        )
    elif args.check and not checks["memory"]:
        failure = (
            "the bytes a rank holds differ from the ZeRO-3 formula; see memory in "
            "the results"
        )
    elif args.check and not checks["communication"]:
        failure = (
            "the collectives of a step differ from their formula; see communication "
            "in the results"
        )
    return results, failure


def main() -> None:
    wall = time.perf_counter()
    args, meta = parse_args()
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
    start = meta["step"] if meta else 0

    rank, _, world_size, device = setup_distributed(args.timeout)
    seconds = {"setup": time.perf_counter() - wall}
    mesh = init_device_mesh(device.type, (world_size,))
    print0(
        f"{world_size} process{'es' if world_size > 1 else ''} on {device.type}: {config.n_layer} blocks of width "
        f"{config.n_embd} in {args.dtype}, global batch {args.batch_size} x "
        f"{args.seq_len}, steps {start} to {start + args.steps - 1}"
    )
    model = build_model(config, args.seed, dtype, device)
    units = units_of(model)
    shard_model(model, mesh, args.reshard_after_forward)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    batches = global_batches(text, args, start, args.steps, device)

    checkpoint: dict = {}
    if args.load:
        folder = Path(args.load).resolve()
        checkpoint["load"] = load_checkpoint(model, optimizer, folder, device)
        checkpoint["load"].update(saved_by_world_size=meta["world_size"], step=start)
        print0(
            f"loaded {folder.name} (saved by {meta['world_size']} processes at step "
            f"{start}) in {checkpoint['load']['seconds']:.2f} s"
        )

    state: dict = {}
    tic = time.perf_counter()
    losses, per_step, after_forward = train(
        model,
        optimizer,
        batches,
        on_first_step=lambda: state.update(measure_state(model, optimizer)),
    )
    seconds["train"] = time.perf_counter() - tic
    for step, loss in enumerate(losses, start):
        print0(f"step {step:3d}  loss {loss:.6f}")

    # One counted step for each other setting, on a fresh model: the counts
    # and sizes do not depend on the values.
    tic = time.perf_counter()
    communication = {
        args.reshard_after_forward: {
            "per_step": per_step,
            "unsharded_bytes_after_forward": after_forward,
        }
    }
    for setting in SETTINGS:
        if setting not in communication:
            other = build_model(config, args.seed, dtype, device)
            shard_model(other, mesh, setting)
            other_optimizer = torch.optim.Adam(other.parameters(), lr=args.lr)
            _, counts, kept = train(other, other_optimizer, batches[:1])
            communication[setting] = {
                "per_step": counts,
                "unsharded_bytes_after_forward": kept,
            }
    seconds["other_settings"] = time.perf_counter() - tic
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"state": state, "communication": communication})

    if args.save:
        folder = Path(args.save).resolve()
        meta_out = {
            "format": CHECKPOINT_FORMAT,
            "step": start + args.steps,
            "world_size": world_size,
            "config": {k: getattr(args, k) for k in MODEL_DEFAULTS},
            "train": {k: getattr(args, k) for k in TRAIN_DEFAULTS},
            "torch": str(
                torch.__version__
            ),  # a plain str: torch.load(weights_only=True)
        }
        checkpoint["save"] = save_checkpoints(
            model, optimizer, folder, meta_out, device
        )
        print0(
            f"saved {folder.name}: sharded with DCP in "
            f"{checkpoint['save']['dcp']['seconds']:.3f} s, gathered to rank 0 and "
            f"torch.save in {checkpoint['save']['gathered']['seconds']:.3f} s"
        )

    failure = ""
    if rank == 0:
        reference = None
        if args.check:
            tic = time.perf_counter()
            reference = reference_losses(config, args, text, start, args.steps, device)
            seconds["reference"] = time.perf_counter() - tic
        run = {
            "script": SCRIPT,
            "torch": str(torch.__version__),
            "world_size": world_size,
            "backend": dist.get_backend(),
            "device": device.type,
            "config": asdict(config),
            "n_params": sum(
                math.prod(p["shape"]) for u in units for p in u["parameters"]
            ),
            "n_param_tensors": sum(len(u["parameters"]) for u in units),
            "dtype": args.dtype,
            "dtype_bytes": dtype.itemsize,
            "batch_size": args.batch_size,
            "micro_batch_size": args.batch_size // world_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "seed": args.seed,
            "reshard_after_forward": args.reshard_after_forward,
            "steps": list(range(start, start + args.steps)),
            "losses": losses,
            "reference_losses": reference,
            "units": units,
            "checkpoint": checkpoint,
            "cuda_max_memory_allocated": (
                torch.cuda.max_memory_allocated(device)
                if device.type == "cuda"
                else None
            ),
            "seconds": seconds,
        }
        results, failure = judge(args, run, everyone, tolerance)
        seconds["total"] = time.perf_counter() - wall
        if args.results:
            with open(args.results, "w") as f:
                json.dump(results, f, indent=1)
    verdict = [failure]
    dist.broadcast_object_list(verdict, src=0)  # every rank exits with the same code
    dist.destroy_process_group()
    if verdict[0]:
        fail(verdict[0], code=3)


if __name__ == "__main__":
    run_main(main)
