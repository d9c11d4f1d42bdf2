"""Tests of companion.multidevice: allreduce, batch splitting, the k-device step."""

import pytest
import torch

from companion.multidevice import (
    allreduce_naive,
    allreduce_ring,
    get_params,
    init_lenet_params,
    lenet,
    split_batch,
    train_batch,
)

CPU = torch.device("cpu")


def test_lenet_shapes() -> None:
    params = init_lenet_params(generator=torch.Generator().manual_seed(0))
    assert len(params) == 8
    assert lenet(torch.rand(3, 1, 28, 28), params).shape == (3, 10)


def test_get_params_copies_even_on_the_same_device() -> None:
    params = init_lenet_params()
    copy = get_params(params, CPU)
    assert all(c.requires_grad and not p.requires_grad for c, p in zip(copy, params))
    assert all(c.data_ptr() != p.data_ptr() for c, p in zip(copy, params))
    copy[1].data += 1.0
    assert params[1].abs().sum() == 0  # the original biases are still zero


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 5, 12, 101])
def test_ring_equals_naive_equals_sum_exactly(k: int, n: int) -> None:
    # Small integers in float64: every order of summation gives the exact sum,
    # so the comparison can be exact even though the algorithms add in different orders.
    gen = torch.Generator().manual_seed(k * 1000 + n)
    data = [torch.randint(-50, 50, (n,), generator=gen).double() for _ in range(k)]
    expected = torch.stack(data).sum(dim=0)
    naive, ring = [t.clone() for t in data], [t.clone() for t in data]
    allreduce_naive(naive)
    allreduce_ring(ring)
    for t in naive + ring:
        assert torch.equal(t, expected)


def test_ring_equals_naive_on_random_matrices() -> None:
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(20, 3, 3, generator=gen, dtype=torch.float64) for _ in range(4)]
    expected = torch.stack(data).sum(dim=0)
    naive, ring = [t.clone() for t in data], [t.clone() for t in data]
    allreduce_naive(naive)
    allreduce_ring(ring)
    for a, b in zip(naive, ring):
        torch.testing.assert_close(a, expected, rtol=0, atol=1e-13)
        torch.testing.assert_close(b, expected, rtol=0, atol=1e-13)


def test_elements_sent() -> None:
    n, k = 100, 4
    assert allreduce_naive([torch.zeros(n) for _ in range(k)]) == [(k - 1) * n] + [
        n
    ] * (k - 1)
    # The ring: every device sends 2 (k - 1) chunks of n / k elements.
    assert (
        allreduce_ring([torch.zeros(n) for _ in range(k)]) == [2 * (k - 1) * n // k] * k
    )


def test_allreduce_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one shape"):
        allreduce_ring([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match="contiguous"):
        allreduce_naive([torch.zeros(3, 3).t(), torch.zeros(3, 3).t()])


def test_split_batch() -> None:
    X, y = torch.arange(20).reshape(5, 4), torch.arange(5)
    X_shards, y_shards = split_batch(X, y, [CPU, CPU])
    assert [len(s) for s in X_shards] == [3, 2]
    assert torch.equal(torch.cat(X_shards), X) and torch.equal(torch.cat(y_shards), y)
    with pytest.raises(ValueError, match="cannot be split"):
        split_batch(X[:1], y[:1], [CPU, CPU])


@pytest.mark.parametrize("allreduce", [allreduce_naive, allreduce_ring])
@pytest.mark.parametrize("k", [2, 3])
def test_k_device_step_equals_one_device_step(allreduce, k: int) -> None:
    """Steps over k devices match steps on one device with the whole batch.

    In float64 the only differences are rounding in a different order of
    summation, about 1e-16; the tolerance 1e-12 leaves room for three steps
    and still fails on any real mistake (a missing allreduce is off by ~1e-3).
    """
    gen = torch.Generator().manual_seed(0)
    params = init_lenet_params(generator=gen, dtype=torch.float64)
    X = torch.rand(
        10, 1, 28, 28, generator=gen, dtype=torch.float64
    )  # 10 = 4 + 3 + 3 for k = 3
    y = torch.randint(0, 10, (10,), generator=gen)
    one = [get_params(params, CPU)]
    many = [get_params(params, CPU) for _ in range(k)]
    for _ in range(3):
        loss_one = train_batch(X, y, one, [CPU], lr=0.5, allreduce=allreduce)
        loss_many = train_batch(X, y, many, [CPU] * k, lr=0.5, allreduce=allreduce)
        assert loss_many == pytest.approx(loss_one, rel=0, abs=1e-12)
    for replica in many:
        for p, q in zip(replica, one[0]):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    # The check can fail: the parameters did move, by far more than the tolerance.
    assert max((p - q).abs().max().item() for p, q in zip(one[0], params)) > 1e-3


def test_without_allreduce_replicas_drift_apart() -> None:
    """The control: skipping the allreduce breaks the equality the test above checks."""
    gen = torch.Generator().manual_seed(0)
    params = init_lenet_params(generator=gen, dtype=torch.float64)
    X = torch.rand(8, 1, 28, 28, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (8,), generator=gen)
    one = [get_params(params, CPU)]
    many = [get_params(params, CPU) for _ in range(2)]
    train_batch(X, y, one, [CPU], lr=0.5)
    train_batch(
        X, y, many, [CPU, CPU], lr=0.5, allreduce=lambda grads: [0] * len(grads)
    )
    assert max((p - q).abs().max().item() for p, q in zip(many[0], one[0])) > 1e-6
