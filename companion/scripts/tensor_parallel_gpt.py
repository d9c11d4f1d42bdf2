"""Tensor parallelism on a small GPT: by hand, with DTensor, sequence parallel, 2-D.

    python tensor_parallel_gpt.py                                      # one process
    torchrun --standalone --nproc-per-node=2 tensor_parallel_gpt.py --layout hand
    torchrun --standalone --nproc-per-node=4 tensor_parallel_gpt.py --layout 2d
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=tp tensor_parallel_gpt.py  # each node
    srun --ntasks=2 --gpus-per-task=1 python tensor_parallel_gpt.py --layout sp

Every rank builds the same GPT (the course's model, from the sibling
gpt_model.py) from the same seed, splits each block over the ranks, and trains
with Adam on the same batches of the Zen of Python, read as characters.
``--layout``: ``hand``, Megatron-LM's f and g as two autograd functions; ``tp``,
the same split with DTensor's ``parallelize_module``; ``sp``, DTensor with
sequence parallelism (the LayerNorms work on a slice of the sequence); ``2d``,
DTensor's split within each row of a ``--dp`` x (processes / dp) mesh, FSDP2
along its columns. companion/checks/tensor_parallel.py checks each against the
plain model and counts what it sends and keeps.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from distributed_setup import fail, launched, setup_distributed, where_it_ran
from gpt_model import (
    DTYPES,
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    CharText,
    GPTConfig,
    build_model,
    global_batches,
    lm_loss,
)

# ---- settings and data

MODEL = ("n_layer", "n_head", "n_embd", "block_size")
LAYOUTS = ("hand", "tp", "sp", "2d")


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The model's sizes: the flags', and the text's vocabulary."""
    return GPTConfig(len(CharText().chars), **{k: getattr(args, k) for k in MODEL})


# ---- tensor parallelism by hand, as Megatron-LM writes it


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron-LM's f: the identity forward; backward all-reduces the gradient.

    Every rank feeds the same input to its slice of a layer, so each slice
    contributes part of the input's gradient: backward adds the parts up.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)
        if dist.get_world_size() > 1:  # alone, nothing to add (as in Megatron-LM)
            dist.all_reduce(grad)
        return grad


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron-LM's g: forward all-reduces the partial sums; identity backward.

    The output is the same on every rank, and so is its gradient, which each
    rank passes to its slice unchanged.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)
        if dist.get_world_size() > 1:
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def keep_slice(linear: nn.Linear, dim: int) -> nn.Linear:
    """A copy of ``linear`` with this rank's ``torch.chunk`` of its weight:
    dim 0, some output features (column-parallel); dim 1, some input features
    (row-parallel)."""
    weight = linear.weight.detach().chunk(dist.get_world_size(), dim)[dist.get_rank()]
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format))
    return layer


class ParallelMLP(nn.Module):
    """The MLP split over the ranks: ``g(proj(gelu(fc(f(x)))))``.

    ``fc`` keeps this rank's 4d/N output features, so the GELU needs nothing
    from the other ranks; ``proj`` keeps the matching input features and
    returns a partial sum of the output, which g adds up.
    """

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        self.fc, self.proj = keep_slice(mlp.fc, 0), keep_slice(mlp.proj, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToTensorParallel.apply(x)
        return ReduceFromTensorParallel.apply(self.proj(F.gelu(self.fc(x))))


class ParallelAttention(CausalSelfAttention):
    """Attention split over the ranks by heads: ``g(attention(f(x)))``.

    q, k and v keep the rows of this rank's n_head/N heads, attention runs on
    those heads alone (the model reshapes with -1 heads), and ``proj`` keeps
    the matching columns and returns a partial sum for g.
    """

    def __init__(self, attn: CausalSelfAttention) -> None:
        nn.Module.__init__(self)  # the layers come from ``attn``, sliced
        self.head_dim = attn.head_dim
        self.q, self.k, self.v = (keep_slice(p, 0) for p in (attn.q, attn.k, attn.v))
        self.proj = keep_slice(attn.proj, 1)
        self.register_buffer("future", attn.future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToTensorParallel.apply(x)
        return ReduceFromTensorParallel.apply(super().forward(x))


def split_block_by_hand(block: Block) -> Block:
    """Split ``block``'s attention and MLP over the ranks, in place."""
    block.attn, block.mlp = ParallelAttention(block.attn), ParallelMLP(block.mlp)
    return block


# ---- the same with DTensor, and with sequence parallelism


def tensor_parallel_plan(n_layer: int) -> dict:
    """Megatron-LM's split as a DTensor plan: q, k, v, fc by columns, proj by rows."""
    plan = {}
    for i in range(n_layer):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def sequence_parallel_plan(n_layer: int) -> dict:
    """The plan above with sequence parallelism, as torchtitan writes it.

    Between the blocks' halves the residual stream is split along the sequence
    (``Shard(1)``): the LayerNorms work on their slice, attention and the MLP
    all-gather their input, and each ``proj`` reduce-scatters its partial sums
    to the slices. Block 0 cuts the replicated embeddings into slices; the
    head gathers its input and returns replicated logits.
    """
    plan = tensor_parallel_plan(n_layer)
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    for i in range(n_layer):
        for name in ("ln_1", "ln_2"):
            plan[f"blocks.{i}.{name}"] = SequenceParallel()
        for name in ("attn", "mlp"):
            plan[f"blocks.{i}.{name}"] = gather
            plan[f"blocks.{i}.{name}.proj"] = RowwiseParallel(output_layouts=Shard(1))
    return plan | {
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            use_local_output=True,
        ),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def parallelize(model: GPT, layout: str, mesh) -> GPT:
    """Split ``model`` by ``layout`` in place: the blocks over ``mesh["tp"]``
    (``hand``: over all the ranks), and with ``2d`` FSDP2 along ``mesh["dp"]``."""
    if layout == "hand":  # the embeddings, LayerNorms and head stay replicated
        for block in model.blocks:
            split_block_by_hand(block)
        return model
    plan = sequence_parallel_plan if layout == "sp" else tensor_parallel_plan
    parallelize_module(model, mesh["tp"], plan(len(model.blocks)))
    if layout == "2d":  # FSDP2 shards each rank's TP slices along "dp"
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def build_mesh(args: argparse.Namespace, device) -> object:
    """The processes as a "dp" x "tp" mesh: ``--dp`` rows for 2d, else one row."""
    return init_device_mesh(device.type, args.mesh, mesh_dim_names=("dp", "tp"))


# ---- train


def local_batch(t: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's part of a global batch: its "dp" row's slice (the ranks of a
    row, which split the model, take the same)."""
    return t.tensor_split(mesh["dp"].size())[mesh["dp"].get_local_rank()]


def make_adam(model: nn.Module, lr: float) -> torch.optim.Adam:
    """Adam over ``model``'s parameters: the DTensors and the plain tensors apart.

    After ``parallelize_module`` the split layers' weights are DTensors and
    the rest (the embeddings; the LayerNorms without sequence parallelism)
    plain tensors. On a GPU, Adam's default implementation (``foreach``)
    updates a group's tensors with one kernel per operation and refuses a
    group that mixes the two ("got mixed torch.Tensor and DTensor"); on a CPU
    the default loops over the tensors and never meets it. One group of each
    works on both.
    """
    params = list(model.parameters())
    split = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return torch.optim.Adam([{"params": g} for g in (split, plain) if g], lr=lr)


def sum_partial_grads(model: nn.Module) -> None:
    """Sum once the gradients DTensor leaves partial (sequence parallelism's
    LayerNorm weights), which Adam would otherwise all-reduce at every read."""
    for p in model.parameters():
        grad = p.grad
        if isinstance(grad, DTensor) and any(q.is_partial() for q in grad.placements):
            placements = [Replicate() if q.is_partial() else q for q in grad.placements]
            p.grad = grad.redistribute(placements=placements)


def train_step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor):
    """One Adam step on a batch; its loss, detached."""
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    sum_partial_grads(model)
    optimizer.step()
    return loss.detach()


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The global batch's loss: the mean of the ranks' (equal slices, or the same)."""
    loss = loss.clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()  # .item(): waits for the device


# ---- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked before the processes meet; ``args.mesh``: (dp, tp)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--layout", choices=LAYOUTS, default="tp", help="the split (default: tp)")
    add("--dp", type=int, default=2, help="mesh rows for --layout 2d (default: 2)")
    add("--steps", type=int, default=5, help="training steps (default: 5)")
    add(
        "--batch-size", type=int, default=8, help="global batch, sequences (default: 8)"
    )
    add("--seq-len", type=int, default=64, help="characters per sequence (default: 64)")
    add("--lr", type=float, default=3e-3, help="Adam's learning rate (default: 3e-3)")
    add("--seed", type=int, default=0, help="of the model and batches (default: 0)")
    add("--dtype", choices=DTYPES, default="float32", help="(default: float32)")
    add("--n-layer", type=int, default=2, help="transformer blocks (default: 2)")
    add("--n-head", type=int, default=4, help="attention heads (default: 4)")
    add("--n-embd", type=int, default=64, help="width, in features (default: 64)")
    add("--block-size", type=int, default=64, help="longest sequence (default: 64)")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    world_size = launched().world_size
    dp = args.dp if args.layout == "2d" else 1
    if dp < 1 or world_size % dp:
        fail(f"--dp {dp} does not divide {world_size} processes into rows of a mesh.")
    args.mesh = (dp, world_size // dp)  # (data parallel, tensor parallel)
    if args.n_head % args.mesh[1] or args.n_embd % args.n_head:
        fail(
            f"--n-head {args.n_head} does not split over {args.mesh[1]} "
            "tensor-parallel processes, each of which keeps whole heads, or does "
            f"not divide --n-embd; use a number of processes that divides it."
        )
    if args.layout == "sp" and args.seq_len % world_size:
        fail(
            f"--seq-len {args.seq_len} does not split over {world_size} processes "
            f"for sequence parallelism; use a multiple of {world_size}."
        )
    if args.batch_size % dp:
        fail(f"--batch-size {args.batch_size} does not split over --dp {dp} rows.")
    if not 0 < args.seq_len <= min(args.block_size, 855):  # the text: 856 chars
        fail(f"--seq-len {args.seq_len} must be 1 to --block-size, under 856.")
    return args


@record
def main() -> None:
    args = parse_args()
    rank, _, device = setup_distributed(args.timeout)
    mesh = build_mesh(args, device)
    model = build_model(model_config(args), args.seed, args.dtype, device)
    model = parallelize(model, args.layout, mesh)
    optimizer = make_adam(model, args.lr)
    losses = []
    for step, (x, y) in enumerate(global_batches(args, device)):
        loss = train_step(model, optimizer, local_batch(x, mesh), local_batch(y, mesh))
        losses.append(mean_over_ranks(loss))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({**where_it_ran(device), "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
