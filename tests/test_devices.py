"""companion.harness.devices: honest fallbacks on a CPU-only machine, and with GPUs."""

import pytest
import torch

from companion.harness import devices
from companion.harness.devices import (
    DeviceError,
    describe_hardware,
    get_backend,
    try_all_gpus,
    try_gpu,
)


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
    assert try_gpu() == torch.device("cuda:0")
    assert try_gpu(1) == torch.device("cuda:1")
    assert try_gpu(2) == torch.device("cpu")


def test_try_all_gpus_simulates_k_cpu_devices(no_gpus):
    assert try_all_gpus() == [torch.device("cpu")]
    assert try_all_gpus(4) == [torch.device("cpu")] * 4


def test_try_all_gpus_with_gpus(two_gpus):
    assert try_all_gpus() == [torch.device("cuda:0"), torch.device("cuda:1")]
    assert try_all_gpus(1) == [torch.device("cuda:0")]
    assert try_all_gpus(2) == [torch.device("cuda:0"), torch.device("cuda:1")]


def test_try_all_gpus_shares_the_gpus_there_are(two_gpus):
    # Chapter 07 asks for 2 devices; on a machine with fewer GPUs the replicas
    # share them.
    assert try_all_gpus(3) == [
        torch.device("cuda:0"),
        torch.device("cuda:1"),
        torch.device("cuda:0"),
    ]


def test_try_all_gpus_refuses_zero(no_gpus):
    with pytest.raises(DeviceError, match="at least one device"):
        try_all_gpus(0)


@pytest.mark.parametrize("nccl", [True, False], ids=["with-nccl", "without-nccl"])
def test_backend_nccl_for_cuda_gloo_for_cpu(monkeypatch, no_gpus, nccl):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)
    assert get_backend("cpu") == "gloo"
    assert get_backend() == "gloo"  # no GPUs here
    assert get_backend("cuda") == ("nccl" if nccl else "gloo")


def test_backend_for_this_machine_with_gpus(monkeypatch, two_gpus):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert get_backend() == "nccl"
    monkeypatch.setattr(devices, "num_gpus", lambda: 1)
    assert get_backend() == "nccl"
    assert get_backend("cpu") == "gloo"  # CPU tensors need gloo even on a GPU machine
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    assert get_backend("cuda") == "gloo"


@pytest.mark.parametrize(
    "available, count, expected",
    [(False, 3, 0), (True, 3, 3), (True, 0, 0)],
    ids=["no-cuda", "3-gpus", "none"],
)
def test_num_gpus_asks_cuda_only_when_it_is_available(
    monkeypatch, available, count, expected
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert devices.num_gpus() == expected


def test_cpu_count_is_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr(
        devices.os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False
    )
    assert devices.cpu_count() == 3
    monkeypatch.delattr(
        devices.os, "sched_getaffinity", raising=False
    )  # macOS, Windows
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 12)
    assert devices.cpu_count() == 12
    monkeypatch.setattr(devices.os, "cpu_count", lambda: None)
    assert devices.cpu_count() == 1


def test_describe_hardware_without_gpus(monkeypatch, no_gpus):
    monkeypatch.setattr(devices, "cpu_name", lambda: "Test CPU 9000")
    monkeypatch.setattr(devices, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "__version__", "2.9.1+cpu")
    # tests/conftest.py runs every test with one thread
    assert (
        describe_hardware() == "Test CPU 9000, 2 cores, no GPU, torch 2.9.1, 1 thread"
    )
    assert describe_hardware("1").endswith(", 1 thread")  # a table's threads, as text
    assert describe_hardware(4).endswith(", 4 threads")
    assert describe_hardware("1 and 2").endswith(", 1 and 2 threads")


def test_describe_hardware_names_each_kind_of_gpu(monkeypatch):
    monkeypatch.setattr(devices, "num_gpus", lambda: 3)
    monkeypatch.setattr(devices, "cpu_name", lambda: "Test CPU 9000")
    monkeypatch.setattr(devices, "cpu_count", lambda: 64)
    names = {0: "B200", 1: "A100", 2: "B200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    assert describe_hardware().startswith(
        "Test CPU 9000, 64 cores, 3 x GPU (A100, B200), torch "
    )


def test_cpu_name_is_a_real_name():
    name = devices.cpu_name()
    assert name and name == name.strip() and "model name" not in name


def test_try_all_gpus_on_one_gpu_gives_replicas_of_it(monkeypatch):
    monkeypatch.setattr(devices, "num_gpus", lambda: 1)
    assert try_all_gpus(2) == [torch.device("cuda:0"), torch.device("cuda:0")]
    assert try_all_gpus() == [torch.device("cuda:0")]


def test_cpu_name_reads_the_model_name_line(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\n"
        "model name\t: AMD EPYC 7B13 64-Core Processor: rev 2\nflags\t\t: fpu\n",
        encoding="utf-8",
    )
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            return real_open(cpuinfo, *args, **kwargs)
        raise AssertionError(f"cpu_name opened {path}")

    monkeypatch.setattr("builtins.open", fake_open)
    # everything after the first colon, even a colon in the name itself
    assert devices.cpu_name() == "AMD EPYC 7B13 64-Core Processor: rev 2"


def test_cpu_name_without_proc_falls_back_to_the_platform(monkeypatch):
    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr("builtins.open", no_proc)
    monkeypatch.setattr(devices.platform, "processor", lambda: "")
    monkeypatch.setattr(devices.platform, "machine", lambda: "arm64")
    assert devices.cpu_name() == "arm64"
    monkeypatch.setattr(devices.platform, "processor", lambda: "i386")
    assert devices.cpu_name() == "i386"
