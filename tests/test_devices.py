"""companion.devices: honest fallbacks on a CPU-only machine, and with GPUs."""

import pytest
import torch

from companion import devices
from companion.devices import DeviceError, describe_hardware, get_backend, try_all_gpus, try_gpu


@pytest.fixture
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "num_gpus", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(devices, "num_gpus", lambda: 2)


def test_try_gpu_falls_back_to_cpu(no_gpus):
    assert try_gpu() == torch.device("cpu")
    assert try_gpu(3) == torch.device("cpu")


def test_try_gpu_picks_existing_gpu(two_gpus):
    assert try_gpu(1) == torch.device("cuda:1")
    assert try_gpu(2) == torch.device("cpu")


def test_try_all_gpus_simulates_k_cpu_devices(no_gpus):
    assert try_all_gpus() == [torch.device("cpu")]
    assert try_all_gpus(4) == [torch.device("cpu")] * 4


def test_try_all_gpus_with_gpus(two_gpus):
    assert try_all_gpus() == [torch.device("cuda:0"), torch.device("cuda:1")]
    assert try_all_gpus(1) == [torch.device("cuda:0")]


def test_try_all_gpus_refuses_more_than_there_are(two_gpus):
    with pytest.raises(DeviceError, match="3 devices were requested but this machine has 2 GPU"):
        try_all_gpus(3)


def test_try_all_gpus_refuses_zero(no_gpus):
    with pytest.raises(DeviceError, match="at least one device"):
        try_all_gpus(0)


def test_backend_nccl_for_cuda_gloo_for_cpu(no_gpus):
    assert get_backend("cpu") == "gloo"
    assert get_backend() == "gloo"
    expected = "nccl" if torch.distributed.is_nccl_available() else "gloo"
    assert get_backend("cuda") == expected


def test_describe_hardware_names_cores_and_torch():
    text = describe_hardware()
    assert f"{devices.cpu_count()} cores" in text
    assert torch.__version__.split("+")[0] in text


def test_real_machine_is_consistent():
    # Whatever this machine is, try_all_gpus() matches what torch reports.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(try_all_gpus()) == max(gpus, 1)
