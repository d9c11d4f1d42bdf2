"""Run a script as if its node had GPUs, on a machine without one.

    python tests/programs/simulated_gpu.py SCRIPT [ARGS ...]
    torchrun --nproc-per-node=2 tests/programs/simulated_gpu.py SCRIPT [ARGS ...]
    SIMULATED_GPUS=4 CUDA_VISIBLE_DEVICES=1,3 torchrun --nproc-per-node=2 ...

The node has ``SIMULATED_GPUS`` GPUs (default: ``LOCAL_WORLD_SIZE``, else 1),
and a process sees those that ``CUDA_VISIBLE_DEVICES`` lists, renumbered from
0, as CUDA does (all of them when it is unset, none when it is empty). The
script takes its GPU path, asks for the nccl backend, puts its model and
batches on ``cuda:N``, and trains for real: the tensors are on the CPU and the
collectives go through gloo. Meanwhile every tensor remembers which GPU it
would live on, and the simulation fails, with the error CUDA or nccl would
raise, when the script

- names a GPU it does not see, ``cuda:N`` with N at least the number it sees
  ("invalid device ordinal"): in ``.to``, a factory, ``set_device``,
  ``init_process_group(device_id=...)`` or DDP's ``device_ids``;
- wraps a model in DDP with ``device_ids`` other than the model's GPU (its
  forward pass would move the inputs to another GPU than the weights');
- puts two processes of one node on one GPU (nccl: "Duplicate GPU detected");
- passes a tensor that lives on the CPU to a collective (nccl has no CPU
  backend: "No backend type associated with device type cpu");
- computes with tensors on two devices together, a CPU and a GPU or two GPUs
  ("Expected all tensors to be on the same device"), 0-dim CPU tensors
  excepted as in CUDA;
- calls ``torch.load`` without ``map_location`` (a checkpoint saved on
  ``cuda:1`` would load onto ``cuda:1``);
- chooses another backend than nccl for its GPU.

How a tensor's place is known: a ``TorchFunctionMode`` sees every torch call.
It rewrites ``cuda`` devices to the CPU, and marks the storage of what a call
returns: "cuda:N" when the call put it on GPU N or computed it from a tensor
there, "cpu" when the call made it on the CPU (a factory with no device,
``.cpu()``), and nothing when torch's own code made it on a device it was
given (in the simulation torch's internals get the CPU where they would get
the GPU, so their tensors are not judged). ``.to("cuda")`` copies, as on a
real GPU, so a forgotten reassignment shows. Written for
``tests/test_simulated_gpu.py``; the scripts' tests run every script under it.
"""

from __future__ import annotations

import atexit
import functools
import os
import runpy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

TORCH_DIR = str(Path(torch.__file__).parent)
HERE = str(Path(__file__).resolve())
CPU = "cpu"
_places: dict[int, tuple[str, StorageWeakRef]] = {}
_visible: list[int] = []  # the node's GPUs this process sees, as cuda:0, cuda:1, ...
_current = {"index": 0}  # torch.cuda.set_device's choice


class SimulationError(RuntimeError):
    """What CUDA or nccl would have raised on a real GPU."""


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor)
        return None


def place_of(t: torch.Tensor) -> str | None:
    """Where ``t`` would live on a GPU machine: "cuda:N", "cpu", or None (not known)."""
    storage = _storage(t)
    if storage is None:
        return None
    ref = StorageWeakRef(storage)
    known = _places.get(ref.cdata)
    return known[0] if known and not known[1].expired() else None


def mark(t: torch.Tensor, place: str | None) -> None:
    storage = _storage(t)
    if storage is not None and place is not None:
        ref = StorageWeakRef(storage)
        _places[ref.cdata] = (place, ref)


def _is_cuda(device: object) -> bool:
    return isinstance(device, (str, torch.device)) and str(device).startswith("cuda")


def _is_gpu(place: str | None) -> bool:
    return place is not None and place.startswith("cuda")


def gpu_place(device: str | torch.device | int | None) -> str:
    """``cuda:N`` for a device that names GPU N, or the current GPU; refuse an unseen one."""
    named = isinstance(device, (str, torch.device))
    index = torch.device(device).index if named else device  # an int, or None
    index = _current["index"] if index is None else index
    if not 0 <= index < len(_visible):
        raise SimulationError(
            f"CUDA error: invalid device ordinal (cuda:{index}; this process sees "
            f"{len(_visible)} GPU(s))"
        )
    return f"cuda:{index}"


def _is_cpu(device: object) -> bool:
    return isinstance(device, (str, torch.device)) and str(device).startswith("cpu")


def _to_cpu(value: object) -> object:
    return torch.device("cpu") if _is_cuda(value) else value


def _from_user_code() -> bool:
    """Whether the torch call being handled was made by code outside torch."""
    frame = sys._getframe(2)
    while frame and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(TORCH_DIR)


def _tensors(values) -> list[torch.Tensor]:
    return [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]


def _two_devices(name: str, a: str, b: str) -> SimulationError:
    return SimulationError(
        f"{name}: Expected all tensors to be on the same device, but found at "
        f"least two devices, {a} and {b}!"
    )


NAMING = {torch.device, torch._C._nn._parse_to}
PROPERTIES = {
    torch.Tensor.device.__get__: torch.device,
    torch.Tensor.is_cuda.__get__: lambda place: True,
    torch.Tensor.get_device: lambda place: torch.device(place).index,
}
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
UNCHECKED = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_}


class SimulatedGPU(TorchFunctionMode):
    """Keep every tensor on the CPU while tracking where it would live on a GPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in NAMING:  # naming a GPU is allowed; using one is simulated
            return func(*args, **kwargs)
        if func in MOVES:
            return self._move(func, args, kwargs)
        if func in PROPERTIES and _from_user_code() and _is_gpu(place_of(args[0])):
            return PROPERTIES[func](place_of(args[0]))  # the script sees its GPU
        named = [v for v in tree_flatten((args, kwargs))[0] if _is_cuda(v)]
        wants_gpu = [gpu_place(v) for v in named]
        wants_cpu = any(_is_cpu(v) for v in tree_flatten((args, kwargs))[0])
        args, kwargs = tree_map(_to_cpu, (args, kwargs))
        inputs = _tensors((args, kwargs))
        places = {place_of(t) for t in inputs}
        gpus = sorted(p for p in places if _is_gpu(p))
        out = func(*args, **kwargs)
        if gpus and func not in UNCHECKED and _tensors(out):
            name = getattr(func, "__name__", func)
            if len(gpus) > 1:
                raise _two_devices(name, *gpus[:2])
            if any(place_of(t) == CPU and t.dim() > 0 for t in inputs):
                raise _two_devices(name, gpus[0], CPU)
        if wants_gpu or (gpus and not wants_cpu):
            place = (wants_gpu or gpus)[0]
        elif wants_cpu or inputs:
            place = CPU if (wants_cpu or places == {CPU}) else None
            if wants_cpu and not _from_user_code():
                place = (
                    None  # torch's internals use the CPU where they would use the GPU
                )
        else:  # a factory with no device: the CPU, on every machine
            place = CPU
        for t in _tensors(out):
            if place_of(t) is None or place is not None:
                mark(t, place)
        return out

    def _move(self, func, args, kwargs):
        source, rest = args[0], args[1:]
        values = tree_flatten((rest, kwargs))[0]
        other = next((v for v in values if isinstance(v, torch.Tensor)), None)
        if func is torch.Tensor.cuda:  # .cuda(device=None, non_blocking=False)
            target = gpu_place(rest[0] if rest else kwargs.get("device"))
        elif any(_is_cuda(v) for v in values):
            target = gpu_place(next(v for v in values if _is_cuda(v)))
        elif func is torch.Tensor.cpu or any(_is_cpu(v) for v in values):
            target = CPU if _from_user_code() else None
        elif other is not None:
            target = place_of(other)
        else:  # a dtype change: it stays where it is
            target = place_of(source)
        rest, kwargs = tree_map(_to_cpu, (rest, kwargs))
        if func is torch.Tensor.cuda:
            out = source.to(
                *[a for a in rest if not isinstance(a, int)],
                **{k: v for k, v in kwargs.items() if k != "device"},
            )
        elif func is torch.Tensor.cpu:
            out = source
        else:
            out = func(source, *rest, **kwargs)
        moves = target is not None and target != place_of(source)
        if (
            moves
            and out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        ):
            out = out.clone()  # a real move to another device copies
        mark(out, target)
        return out


def _check_collective(name: str, fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        tensors = _tensors((args, kwargs))
        for p2p in [
            a for a in tree_flatten((args, kwargs))[0] if isinstance(a, dist.P2POp)
        ]:
            tensors.append(p2p.tensor)
        for t in tensors:
            if place_of(t) == CPU:
                raise SimulationError(
                    f"dist.{name} on a CPU tensor under nccl: No backend type "
                    "associated with device type cpu"
                )
        return fn(*args, **kwargs)

    return checked


COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "gather",
    "scatter",
)


class FakeEvent:
    """``torch.cuda.Event`` with the host clock (everything ran when recorded)."""

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self.time = None

    def record(self, stream: object = None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.time - self.time) * 1000.0


def visible_gpus(node_gpus: int, listed: str | None) -> list[int]:
    """The node's GPUs a process sees, as CUDA reads ``CUDA_VISIBLE_DEVICES``:
    all when unset, the listed ones in order up to the first that is not there."""
    if listed is None:
        return list(range(node_gpus))
    seen = []
    for entry in listed.split(","):
        if not entry.strip().isdigit() or int(entry) >= node_gpus:
            break
        seen.append(int(entry))
    return seen


def refuse_shared_gpus(device_id: torch.device) -> None:
    """Raise nccl's error if another process of this node took the same GPU."""
    node = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "0"))
    mine = (node, _visible[torch.device(gpu_place(device_id)).index])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    twins = [r for r, gpu in enumerate(everyone) if gpu == mine]
    if len(twins) > 1:
        raise SimulationError(
            f"Duplicate GPU detected : rank {twins[0]} and rank {twins[1]} both on "
            f"CUDA device {mine[1]} of node {node}"
        )


def install(node_gpus: int, listed: str | None) -> None:
    """Patch torch so that the script sees the node's GPUs that ``listed`` names
    (``CUDA_VISIBLE_DEVICES``) and runs on the CPU."""
    _visible[:] = visible_gpus(node_gpus, listed)
    cuda = torch.cuda  # is_available() stays False, so that torch's internals
    cuda.device_count = lambda: len(_visible)  # never reach for a CUDA driver
    cuda.set_device = lambda d: _current.update(index=torch.device(gpu_place(d)).index)
    cuda.current_device = lambda: _current["index"]
    cuda.synchronize = lambda device=None: None
    cuda.get_device_name = lambda device=None: "Simulated GPU"
    cuda.is_bf16_supported = lambda *a, **k: True
    for name in (
        "max_memory_allocated",
        "memory_allocated",
        "max_memory_reserved",
        "memory_reserved",
    ):
        setattr(cuda, name, lambda device=None: 0)
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Event = FakeEvent
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: None
    # torch.random.fork_rng saves and restores every GPU's generator
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": None

    original_init = dist.init_process_group

    def init_process_group(backend=None, *args, device_id=None, **kwargs):
        if device_id is not None and backend not in ("nccl", None):
            raise SimulationError(
                f"a GPU process asked for the {backend} backend, not nccl"
            )
        original_init("gloo", *args, **kwargs)
        # The script sees nccl, so it leaves the group to python's exit, where a
        # gloo group can abort the process (pytorch#179291): destroy it first.
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
        if device_id is not None:
            refuse_shared_gpus(device_id)

    dist.init_process_group = init_process_group
    dist.get_backend = functools.partial(
        lambda fn, group=None: "nccl" if fn(group) == "gloo" else fn(group),
        dist.get_backend,
    )
    from torch.distributed import distributed_c10d

    for name in COLLECTIVES:  # both names: P2POp compares its op with c10d's own
        checked = _check_collective(name, getattr(distributed_c10d, name))
        setattr(distributed_c10d, name, checked)
        setattr(dist, name, checked)
    # dist.P2POp accepts only the isend and irecv that c10d knows, by identity.
    dist.distributed_c10d.isend, dist.distributed_c10d.irecv = dist.isend, dist.irecv

    from torch.distributed import device_mesh
    from torch.nn.parallel import DistributedDataParallel

    original_mesh = device_mesh.init_device_mesh

    def init_device_mesh(device_type, *args, **kwargs):
        return original_mesh(
            "cpu" if device_type == "cuda" else device_type, *args, **kwargs
        )

    device_mesh.init_device_mesh = init_device_mesh
    dist.init_device_mesh = init_device_mesh
    original_ddp = DistributedDataParallel.__init__

    def ddp_init(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if device_ids:  # its forward pass moves the inputs to device_ids[0]
            named = gpu_place(device_ids[0])
            held = sorted({place_of(p) for p in module.parameters()} - {named, None})
            if held:
                raise _two_devices("DistributedDataParallel", named, held[0])
        original_ddp(self, module, None, None, *args, **kwargs)

    DistributedDataParallel.__init__ = ddp_init
    original_load = torch.load

    def load(f, map_location=None, *args, **kwargs):
        if map_location is None and _from_user_code():  # torch's own loads are its own
            raise SimulationError(
                "torch.load without map_location: a file saved on another GPU "
                "would load onto that GPU"
            )
        return original_load(f, tree_map(_to_cpu, map_location), *args, **kwargs)

    torch.load = load


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: {Path(__file__).name} SCRIPT [ARGS ...]")
    script = sys.argv[1]
    env = os.environ
    node_gpus = int(env.get("SIMULATED_GPUS", env.get("LOCAL_WORLD_SIZE", 1)))
    install(node_gpus, env.get("CUDA_VISIBLE_DEVICES"))
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    with SimulatedGPU():
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
