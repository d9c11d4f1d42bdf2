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


def test_lenet_is_the_textbook_network() -> None:
    # The same network from torch.nn modules, with the same (nonzero) biases.
    g = torch.Generator().manual_seed(0)
    params = [p + 0.1 * torch.randn(p.shape, generator=g) for p in init_lenet_params()]
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 20, 3),
        torch.nn.ReLU(),
        torch.nn.AvgPool2d(2),
        torch.nn.Conv2d(20, 50, 5),
        torch.nn.ReLU(),
        torch.nn.AvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(800, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    with torch.no_grad():
        for layer, (w, b) in zip(
            [net[0], net[3], net[7], net[9]],
            [(W1, b1), (W2, b2), (W3.T, b3), (W4.T, b4)],
        ):
            layer.weight.copy_(w)
            layer.bias.copy_(b)
    X = torch.randn(3, 1, 28, 28, generator=g)
    torch.testing.assert_close(lenet(X, params), net(X))


def test_weights_are_scaled_by_their_fan_in() -> None:
    params = init_lenet_params(generator=torch.Generator().manual_seed(0))
    for w, fan_in in zip(params[::2], (1 * 3 * 3, 20 * 5 * 5, 800, 128)):
        assert w.std().item() == pytest.approx((2 / fan_in) ** 0.5, rel=0.1)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in params[1::2])


def test_train_batch_returns_the_mean_loss_before_the_step() -> None:
    params = init_lenet_params(generator=torch.Generator().manual_seed(0))
    X, y = torch.randn(6, 1, 28, 28), torch.arange(6)
    expected = torch.nn.functional.cross_entropy(lenet(X, params), y).item()
    replicas = [get_params(params, CPU) for _ in range(2)]
    loss = train_batch(X, y, replicas, [CPU, CPU], lr=0.1)
    assert loss == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match=r"^6 inputs but 5 labels\.$"):
        split_batch(X, y[:5], [CPU])


def test_initial_weights_follow_their_generator_alone() -> None:
    torch.manual_seed(1)
    first = init_lenet_params(generator=torch.Generator().manual_seed(3))
    torch.manual_seed(2)
    again = init_lenet_params(generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_one_example_per_device_and_the_refusals() -> None:
    X, y = torch.randn(2, 1, 28, 28), torch.tensor([3, 4])
    X_shards, y_shards = split_batch(X, y, [CPU, CPU])  # exactly one each
    assert [s.shape[0] for s in X_shards] == [1, 1] and y_shards[1].tolist() == [4]
    with pytest.raises(
        ValueError, match=r"^A batch of 2 cannot be split across 3 devices\.$"
    ):
        split_batch(X, y, [CPU, CPU, CPU])
    with pytest.raises(ValueError, match=r"^allreduce needs at least one tensor\.$"):
        allreduce_naive([])
