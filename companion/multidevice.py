"""Data-parallel training written by hand: LeNet, parameter copies, allreduce.

The pieces of data parallelism, each small enough to read in one go:

- ``init_lenet_params`` and ``lenet``: a LeNet written with plain tensors, so
  that every parameter is a tensor we copy and update ourselves;
- ``get_params``: one copy of the parameters per device;
- ``allreduce_naive`` (reduce to device 0, then broadcast) and
  ``allreduce_ring`` (reduce-scatter, then all-gather, over chunks);
- ``split_batch``: one shard of a minibatch per device;
- ``train_batch``: one SGD step over ``k`` devices.

Without GPUs the devices are ``k`` replicas on the CPU: the algorithm is the
same, nothing runs faster. Used in chapter 07.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "init_lenet_params",
    "lenet",
    "get_params",
    "allreduce_naive",
    "allreduce_ring",
    "split_batch",
    "train_batch",
]

# Shapes of LeNet's parameters, in the order ``lenet`` uses them.
# A layer's weight and bias share a line, hence the formatter is kept out.
LENET_SHAPES: list[tuple[int, ...]] = [
    (20, 1, 3, 3), (20,),  # convolution 1: 1 -> 20 channels, 3x3
    (50, 20, 5, 5), (50,),  # convolution 2: 20 -> 50 channels, 5x5
    (800, 128), (128,),  # fully connected: 50 * 4 * 4 -> 128
    (128, 10), (10,),  # fully connected: 128 -> 10 classes
]  # fmt: skip

Allreduce = Callable[[list[torch.Tensor]], list[int]]


def init_lenet_params(
    *, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Return LeNet's eight parameters: weights ~ N(0, 2 / fan_in), biases 0.

    The weights are scaled by their fan-in (He initialisation), so that ReLU
    activations keep their size from layer to layer and training starts fast.
    """
    params = []
    for shape in LENET_SHAPES:
        if len(shape) == 1:
            params.append(torch.zeros(shape, dtype=dtype))
        else:
            fan_in = shape[0] if len(shape) == 2 else shape[1] * shape[2] * shape[3]
            w = torch.randn(shape, generator=generator, dtype=dtype)
            params.append(w * (2.0 / fan_in) ** 0.5)
    return params


def lenet(X: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Return LeNet's logits for images ``X`` of shape ``(n, 1, 28, 28)``."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h = F.avg_pool2d(F.relu(F.conv2d(X, W1, b1)), kernel_size=2)  # (n, 20, 13, 13)
    h = F.avg_pool2d(F.relu(F.conv2d(h, W2, b2)), kernel_size=2)  # (n, 50, 4, 4)
    h = F.relu(h.flatten(start_dim=1) @ W3 + b3)  # (n, 128)
    return h @ W4 + b4  # (n, 10)


def get_params(
    params: Sequence[torch.Tensor], device: torch.device | str
) -> list[torch.Tensor]:
    """Return a copy of ``params`` on ``device``, each tensor requiring gradients.

    The copy is real even when ``device`` is where the tensors already are:
    ``tensor.to(device)`` would return the tensor itself, and two "replicas" on
    the CPU would then share one set of parameters and gradients.
    """
    return [p.detach().to(device, copy=True).requires_grad_() for p in params]


def allreduce_naive(data: list[torch.Tensor]) -> list[int]:
    """Sum the tensors in ``data`` (one per device) in place: reduce, then broadcast.

    Device 0 receives every other tensor and adds it to its own, then sends the
    sum back to each device. Returns the number of elements each device sent:
    device 0 sends ``(k - 1) * n``, the others ``n`` each.
    """
    _check_same_shape(data)
    root, n = data[0], data[0].numel()
    for t in data[1:]:
        root += t.to(root.device)
    for t in data[1:]:
        t.copy_(root)  # copy_ works across devices
    return [(len(data) - 1) * n] + [n] * (len(data) - 1)


def allreduce_ring(data: list[torch.Tensor]) -> list[int]:
    """Sum the tensors in ``data`` (one per device) in place with the ring algorithm.

    Each tensor is cut into ``k`` chunks and the devices form a ring, device
    ``i`` sending only to device ``i + 1``. In ``k - 1`` reduce-scatter steps,
    every device passes one chunk on and adds the chunk it receives; afterwards
    device ``i`` holds the complete sum of chunk ``i + 1``. In ``k - 1``
    all-gather steps, the complete chunks travel once around the ring. Returns
    the number of elements each device sent: about ``2 (k - 1) n / k``, the
    same for every device, however large ``k`` is.
    """
    _check_same_shape(data)
    k = len(data)
    # Views into each device's tensor: updating a chunk updates the tensor.
    chunks = [list(t.view(-1).tensor_split(k)) for t in data]
    sent = [0] * k

    def ring_step(
        chunk_sent_by: list[int],
        receive: Callable[[torch.Tensor, torch.Tensor], object],
    ) -> None:
        # Device i sends its chunk chunk_sent_by[i] to device i + 1. All devices
        # send at once: take every message before any device changes a chunk
        # (copy=True matters for replicas that share one CPU).
        messages = []
        for i, c in enumerate(chunk_sent_by):
            dst = (i + 1) % k
            messages.append((dst, c, chunks[i][c].to(data[dst].device, copy=True)))
            sent[i] += chunks[i][c].numel()
        for dst, c, message in messages:
            receive(chunks[dst][c], message)

    for step in range(k - 1):  # reduce-scatter: add the incoming chunk to ours
        ring_step([(i - step) % k for i in range(k)], torch.Tensor.add_)
    for step in range(k - 1):  # all-gather: replace ours with the complete chunk
        ring_step([(i + 1 - step) % k for i in range(k)], torch.Tensor.copy_)
    return sent


def _check_same_shape(data: list[torch.Tensor]) -> None:
    if not data:
        raise ValueError("allreduce needs at least one tensor.")
    if any(t.shape != data[0].shape for t in data):
        raise ValueError(
            "allreduce needs tensors of one shape, got "
            f"{[tuple(t.shape) for t in data]}."
        )
    if any(not t.is_contiguous() for t in data):
        raise ValueError(
            "allreduce works in place on contiguous tensors; call .contiguous() first."
        )


def split_batch(
    X: torch.Tensor, y: torch.Tensor, devices: Sequence[torch.device | str]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a minibatch into one shard per device, as equal as possible.

    Shards differ in size by at most one example when the batch does not
    divide evenly; ``train_batch`` weighs every example equally regardless.
    """
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"{X.shape[0]} inputs but {y.shape[0]} labels.")
    if X.shape[0] < len(devices):
        raise ValueError(
            f"A batch of {X.shape[0]} cannot be split across {len(devices)} devices."
        )
    k = len(devices)
    return (
        [x.to(d) for x, d in zip(X.tensor_split(k), devices)],
        [t.to(d) for t, d in zip(y.tensor_split(k), devices)],
    )


def train_batch(
    X: torch.Tensor,
    y: torch.Tensor,
    device_params: Sequence[Sequence[torch.Tensor]],
    devices: Sequence[torch.device | str],
    lr: float,
    allreduce: Allreduce = allreduce_ring,
) -> float:
    """Take one minibatch SGD step over ``len(devices)`` devices; return the mean loss.

    Each device computes the summed loss of its shard and its gradients; an
    allreduce adds the gradients up, so that every device holds the gradient
    of the whole batch; every device then applies the same update to its own
    copy of the parameters, which therefore stay identical.
    """
    X_shards, y_shards = split_batch(X, y, devices)
    # On GPUs each call returns once its kernels are queued, so one device
    # computes while Python queues the next one's work; small kernels mostly
    # take turns. On the CPU the replicas run one after the other.
    losses = [
        F.cross_entropy(lenet(X_shard, params), y_shard, reduction="sum")
        for X_shard, y_shard, params in zip(X_shards, y_shards, device_params)
    ]
    for loss in losses:
        loss.backward()
    with torch.no_grad():
        for i in range(len(device_params[0])):
            allreduce([params[i].grad for params in device_params])
        for params in device_params:
            for p in params:
                p -= lr * p.grad / X.shape[0]  # the mean over the whole batch
                p.grad.zero_()
    # .item() waits for each device: a synchronisation point.
    return sum(loss.item() for loss in losses) / X.shape[0]
