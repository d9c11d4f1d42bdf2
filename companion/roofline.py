"""How fast could it be: this machine's roofline, kernels' FLOPs and bytes, and MFU.

Chapter 16 measures the two ceilings that bound most deep-learning code and
places kernels under them:

- ``count_kernel`` runs a function once and counts its FLOPs (the matrix
  products as ``torch.utils.flop_counter`` counts them, plus one FLOP per
  element of every other operation's largest operand) and the bytes every
  operation reads and writes (views move none): the minimum traffic of the
  operations as eager PyTorch runs them, one after another;
- ``measure_roofline`` times, in one interleaved benchmark, square matrix
  products per dtype (the peaks), a copy and a STREAM triad (the bandwidth)
  and the kernels given, so that a busy spell slows all of them alike;
- ``Roofline.ceiling`` is the best rate a kernel of a given arithmetic
  intensity can reach: min(peak, intensity x bandwidth); ``plot_roofline``
  draws it with the kernels;
- ``gpt_flops_per_token`` counts a GPT's training FLOPs as PaLM and
  torchtitan do (6 N plus attention), for MFU;
- ``DATASHEET_PEAKS`` and ``datasheet_peaks`` hold GPUs' dense peaks per
  dtype from their datasheets.

Used in chapter 16.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from companion.harness.devices import describe_hardware
from companion.harness.notebook import CourseError
from companion.harness.timing import Timing, benchmark_interleaved

__all__ = [
    "DATASHEET_PEAKS",
    "KernelCount",
    "Roofline",
    "count_kernel",
    "datasheet_peaks",
    "gpt_flops_per_token",
    "measure_roofline",
    "plot_roofline",
]

aten = torch.ops.aten
# Operations that only move or create values: no FLOPs, only bytes.
_COPIES = {
    aten.copy_,
    aten._to_copy,
    aten.clone,
    aten.cat,
    aten.stack,
    aten.embedding,
    aten.index_select,
    aten.index,
    aten.zero_,
    aten.fill_,
    aten.zeros,
    aten.ones,
    aten.full,
    aten.zeros_like,
    aten.ones_like,
    aten.new_zeros,
    aten.new_empty,
    aten.empty_like,
    aten.empty,
    aten.empty_strided,
    aten.scalar_tensor,
}
# Operations that allocate without touching the memory: no bytes either.
_ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty}


def _distinct_elements(t: torch.Tensor) -> int:
    """Elements a tensor holds, counting a broadcast (stride-0) dim once."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0)


def _distinct_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        if key not in seen:
            seen.add(key)
            total += _distinct_elements(t) * t.element_size()
    return total


class _Traffic(TorchDispatchMode):
    """Counts each operation's bytes read and written, and its non-product FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.other_flops = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.is_view or packet in _ALLOCATIONS:
            return out
        # An ``out=`` argument is written, not read.
        written = {
            a.name
            for a in func._schema.arguments
            if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
        }
        read_args = (args, {k: v for k, v in kwargs.items() if k not in written})
        reads = [t for t in tree_leaves(read_args) if isinstance(t, torch.Tensor)]
        writes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.bytes += _distinct_bytes(reads) + _distinct_bytes(writes)
        self.ops += 1
        if packet not in flop_registry and packet not in _COPIES:
            operands = [_distinct_elements(t) for t in reads + writes]
            self.other_flops += max(operands, default=0)
        return out


@dataclass(frozen=True)
class KernelCount:
    """What one call of a kernel does: FLOPs and bytes moved."""

    product_flops: int  # matrix products, as torch.utils.flop_counter counts them
    other_flops: int  # one per element of every other operation's largest operand
    bytes: int  # every operation's reads and writes
    ops: int  # operations dispatched

    @property
    def flops(self) -> int:
        return self.product_flops + self.other_flops

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else math.inf


def count_kernel(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> KernelCount:
    """Run ``fn(*args, **kwargs)`` once and count its FLOPs and bytes.

    The bytes are those of the operations PyTorch dispatches (eager, one after
    another), each reading its inputs and writing its outputs once: a fused
    kernel moves fewer, the caches can serve some of them.
    """
    with FlopCounterMode(display=False) as products, _Traffic() as traffic:
        fn(*args, **kwargs)
    return KernelCount(
        products.get_total_flops(), traffic.other_flops, traffic.bytes, traffic.ops
    )


@dataclass(frozen=True)
class Roofline:
    """Measured ceilings: peak FLOP/s per dtype, and memory bandwidth."""

    peaks: dict[str, float]  # FLOP/s of large square products, by dtype
    copy: float  # bytes/s of a copy, read + write (STREAM's count)
    triad: float  # bytes/s of a = b + s x c, two reads and a write
    sizes: dict[str, int] = field(default_factory=dict)  # n of each n x n product
    hardware: str = ""

    @property
    def bandwidth(self) -> float:
        """The best of copy and triad: a limit another simple kernel beats is none."""
        return max(self.copy, self.triad)

    def balance(self, dtype: str = "float32") -> float:
        """The intensity (FLOP/byte) where the two ceilings meet."""
        return self.peaks[dtype] / self.bandwidth

    def ceiling(self, intensity: float, dtype: str = "float32") -> float:
        """The best FLOP/s a kernel of this intensity can reach here."""
        return min(self.peaks[dtype], intensity * self.bandwidth)


def _default_sizes(device: torch.device, dtypes: Sequence[str]) -> dict[str, int]:
    """n x n products large enough to approach the peak, small enough to time fast."""
    if device.type == "cuda":
        return {d: 8192 for d in dtypes}
    # Without bfloat16 units a CPU converts every element, tens of times slower:
    # a smaller product, so that timing it takes no longer than float32's.
    from companion.hardware import UNKNOWN, bf16_matmul_support

    slow = bf16_matmul_support() in (None, UNKNOWN)
    return {d: (256 if d == "bfloat16" and slow else 1024) for d in dtypes}


_DTYPES = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16}


def _square_product(n: int, dtype: str, device: torch.device) -> Callable[[], None]:
    a = torch.randn(n, n, device=device, dtype=_DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=_DTYPES[dtype])
    out = torch.empty(n, n, device=device, dtype=_DTYPES[dtype])
    # float32 in float32 whatever the session set (nanoGPT sets "high", which
    # would time TF32 as float32), and "tf32" on the GPU's TF32 tensor cores.
    precision = "high" if dtype == "tf32" else "highest"

    def product() -> None:
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            torch.mm(a, b, out=out)
        finally:
            torch.set_float32_matmul_precision(before)

    return product


def measure_roofline(
    kernels: Mapping[str, Callable[[], Any]] | None = None,
    *,
    device: torch.device | str = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    sizes: Mapping[str, int] | None = None,
    stream_bytes: int = 2**27,
    min_run_time: float = 0.1,
    repeats: int = 5,
) -> tuple[Roofline, dict[str, Timing]]:
    """Measure the ceilings and time ``kernels``, all in one interleaved benchmark.

    The peaks are square products per dtype (``"tf32"``: float32 on a GPU's
    TF32 tensor cores); the bandwidth a copy and a triad of ``stream_bytes``
    buffers, which should exceed the caches. Returns the roofline and each
    kernel's ``Timing``.
    """
    device = torch.device(device)
    sizes = dict(sizes or _default_sizes(device, dtypes))
    n = stream_bytes // 4
    a, b, c = (torch.ones(n, device=device) for _ in range(3))
    ceilings = {f"product {d}": _square_product(sizes[d], d, device) for d in dtypes}
    ceilings |= {
        "copy": lambda: a.copy_(b),
        "triad": lambda: torch.add(b, c, alpha=3.0, out=a),
    }
    if kernels and set(kernels) & set(ceilings):
        raise CourseError(f"kernel names may not be {sorted(ceilings)}.")
    timings = benchmark_interleaved(
        {**ceilings, **(kernels or {})}, min_run_time=min_run_time, repeats=repeats
    )
    peaks = {d: 2 * sizes[d] ** 3 / timings[f"product {d}"].median for d in dtypes}
    roofline = Roofline(
        peaks=peaks,
        copy=2 * a.nbytes / timings["copy"].median,
        triad=3 * a.nbytes / timings["triad"].median,
        sizes=sizes,
        hardware=describe_hardware(),
    )
    return roofline, {k: timings[k] for k in (kernels or {})}


def plot_roofline(
    roofline: Roofline,
    points: Mapping[str, tuple[float, float]],
    *,
    dtypes: Sequence[str] = ("float32",),
    ax=None,
    title: str = "",
):
    """Draw the roofline (log-log) and the kernels at (intensity, FLOP/s).

    One roof per dtype in ``dtypes``; the dotted line marks float32's
    balance point. Returns the axes.
    """
    import matplotlib.pyplot as plt

    from companion.harness.plotting import new_axes

    if ax is None:
        (ax,) = new_axes(width=6.4, height=4.0)
    xs = [i for i, _ in points.values()] + [roofline.balance(d) for d in dtypes]
    low, high = min(xs) / 4, max(xs) * 4
    grid = [low * (high / low) ** (k / 200) for k in range(201)]
    styles = ["-", "--", "-."]
    for k, dtype in enumerate(dtypes):
        ax.plot(
            grid,
            [roofline.ceiling(x, dtype) / 1e9 for x in grid],
            styles[k % 3],
            color="black",
            linewidth=1.2,
            label=f"roof, {dtype} peak",
        )
    ax.axvline(roofline.balance(), color="grey", linestyle=":", linewidth=1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # Labels go below the points near their roof, so as not to cross it, each
    # one line lower than the labels of such points less than 4x to its left,
    # which it would meet; the others alternate above and below.
    near_roof: dict[str, int] = {}
    for name, (x, y) in sorted(points.items(), key=lambda item: item[1][0]):
        if y > roofline.ceiling(x) / 2:
            taken = {o for n, o in near_roof.items() if x < 4 * points[n][0]}
            near_roof[name] = next(o for o in range(-10, -200, -11) if o not in taken)
    for k, (name, (x, y)) in enumerate(points.items()):
        ax.scatter([x], [y / 1e9], color=colors[k % len(colors)], zorder=3)
        offset = near_roof.get(name, -10 if k % 2 else 4)
        ax.annotate(
            name,
            (x, y / 1e9),
            textcoords="offset points",
            xytext=(5, offset),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("GFLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def gpt_flops_per_token(
    n_layer: int, n_embd: int, seq_len: int, vocab_size: int
) -> dict[str, int]:
    """Training FLOPs per token of a GPT, as PaLM and torchtitan count them.

    6 N for the N parameters of the matrix products (each multiplied in the
    forward pass, and twice in the backward pass: 2 + 4 FLOPs per parameter
    and token), where N is 12 L d^2 for the blocks and V d for the head (the
    embeddings are lookups, no products); plus 12 L T d for attention's two
    T x T products (Q K^T and the weights times V), counted over the whole
    sequence, as the written-out attention computes it. Recomputation is
    not counted: it is work, not progress.
    """
    n = 12 * n_layer * n_embd**2 + vocab_size * n_embd
    attention = 12 * n_layer * seq_len * n_embd
    return {
        "parameters": n,
        "6N": 6 * n,
        "attention": attention,
        "total": 6 * n + attention,
    }


# Dense peaks (no 2:4 sparsity) in FLOP/s and memory bandwidth in bytes/s, from
# NVIDIA's datasheets; "bfloat16 sparse" is the number with sparsity that
# datasheets print first, twice the dense one.
DATASHEET_PEAKS: dict[str, dict[str, float]] = {
    "H100 SXM": {
        "float32": 67e12,
        "tf32": 494.7e12,
        "bfloat16": 989.4e12,
        "bfloat16 sparse": 1978.9e12,
        "bandwidth": 3.35e12,
    },
    "H100 PCIe": {
        "float32": 51.2e12,
        "tf32": 378e12,
        "bfloat16": 756e12,
        "bfloat16 sparse": 1513e12,
        "bandwidth": 2.0e12,
    },
    "H100 NVL": {
        "float32": 60e12,
        "tf32": 417.5e12,
        "bfloat16": 835.5e12,
        "bfloat16 sparse": 1671e12,
        "bandwidth": 3.9e12,
    },
    "H200": {
        "float32": 67e12,
        "tf32": 494.7e12,
        "bfloat16": 989.4e12,
        "bfloat16 sparse": 1978.9e12,
        "bandwidth": 4.8e12,
    },
    "A100": {
        "float32": 19.5e12,
        "tf32": 156e12,
        "bfloat16": 312e12,
        "bfloat16 sparse": 624e12,
        "bandwidth": 2.0e12,
    },  # 80 GB SXM
    "A100 40GB": {
        "float32": 19.5e12,
        "tf32": 156e12,
        "bfloat16": 312e12,
        "bfloat16 sparse": 624e12,
        "bandwidth": 1.555e12,
    },
    "L4": {
        "float32": 30.3e12,
        "tf32": 60e12,
        "bfloat16": 121e12,
        "bfloat16 sparse": 242e12,
        "bandwidth": 0.3e12,
    },
}


def datasheet_peaks(device_name: str) -> tuple[str, dict[str, float]] | None:
    """The datasheet entry for a GPU name such as ``torch.cuda.get_device_name()``.

    Returns ``(model, peaks)``, or None for a GPU the table lacks.
    """
    tokens = device_name.upper().replace("-", " ").split()
    if "H100" in tokens:
        model = next(
            (m for m in ("H100 PCIe", "H100 NVL") if m.split()[1].upper() in tokens),
            "H100 SXM",
        )
    elif "A100" in tokens and "40GB" in tokens:
        model = "A100 40GB"
    else:
        model = next((m for m in ("H200", "A100", "L4") if m in tokens), None)
    return (model, DATASHEET_PEAKS[model]) if model else None
