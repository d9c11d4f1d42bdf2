"""`python -m companion.doctor` prints a useful report and the right advice."""

import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torchvision

from companion import doctor
from companion.doctor import collect_report
from companion.harness import devices


@pytest.fixture
def machine(monkeypatch):
    """A machine described by the test: CPU, cores, GPUs and backends are stubbed.

    Returns a function that sets the number of GPUs and whether nccl exists.
    """
    monkeypatch.setattr(doctor, "cpu_name", lambda: "Test CPU 9000")
    monkeypatch.setattr(doctor, "cpu_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(name=f"Fake GPU {i}", total_memory=24 * 2**30),
    )
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(dist, "is_gloo_available", lambda: True)
    monkeypatch.setattr(dist, "is_mpi_available", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch, "get_num_interop_threads", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def configure(gpus: int, nccl: bool) -> None:
        monkeypatch.setattr(torch.version, "cuda", "12.8" if gpus else None)
        monkeypatch.setattr(doctor, "num_gpus", lambda: gpus)
        monkeypatch.setattr(
            devices, "num_gpus", lambda: gpus
        )  # what get_backend() asks
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)

    return configure


def test_report_on_a_cpu_only_machine(machine):
    machine(gpus=0, nccl=False)
    report = collect_report()
    assert list(report)[:8] == [
        "Python",
        "Platform",
        "torch",
        "torchvision",
        "d2l",
        "CUDA (built with)",
        "cuDNN",
        "GPUs",
    ]
    v = sys.version_info
    assert report["Python"] == f"{v.major}.{v.minor}.{v.micro}"
    assert report["Platform"].startswith(platform.system())
    assert report["torch"] == torch.__version__
    assert (
        torchvision.__version__.split("+")[0] == report["torchvision"]
    )  # pip lists no "+cu130"
    assert report["d2l"] == "1.0.3"  # the version the Makefile pins
    assert report["CUDA (built with)"] == "none (CPU build)"
    assert report["CPU vector ISA"] == "AVX2"
    assert report["Inter-op threads"] == "4"
    assert (report["cuDNN"], report["GPUs"]) == ("n/a", "0")
    assert not any(key.startswith("  cuda:") for key in report)
    assert report["CUDA_VISIBLE_DEVICES"] == "(not set)"
    assert report["OMP_NUM_THREADS"] == "1"
    assert report["CPU"] == "Test CPU 9000 (2 cores available)"
    assert report["Intra-op threads"] == "1"  # set by tests/conftest.py
    assert report["Distributed backends"] == "gloo"
    assert report["Default backend here"] == "gloo"


def test_report_lists_each_gpu(machine, monkeypatch):
    machine(gpus=2, nccl=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    report = collect_report()
    assert (report["CUDA (built with)"], report["cuDNN"], report["GPUs"]) == (
        "12.8",
        "90100",
        "2",
    )
    assert report["  cuda:0"] == "Fake GPU 0, 24.0 GiB"
    assert report["  cuda:1"] == "Fake GPU 1, 24.0 GiB"
    assert list(report).index("  cuda:1") == list(report).index("GPUs") + 2
    assert report["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert report["Distributed backends"] == "gloo, nccl"
    assert report["Default backend here"] == "nccl"


@pytest.mark.parametrize(
    "available, gloo, mpi, text",
    [
        (True, True, True, "gloo, nccl, mpi"),
        (True, False, False, "nccl"),
        (True, False, True, "nccl, mpi"),
        (False, True, True, "torch.distributed unavailable"),
    ],
)
def test_report_names_the_distributed_backends(
    machine, monkeypatch, available, gloo, mpi, text
):
    machine(gpus=1, nccl=True)
    monkeypatch.setattr(dist, "is_available", lambda: available)
    monkeypatch.setattr(dist, "is_gloo_available", lambda: gloo)
    monkeypatch.setattr(dist, "is_mpi_available", lambda: mpi)
    monkeypatch.delenv("OMP_NUM_THREADS")
    report = collect_report()
    assert report["Distributed backends"] == text
    assert report["OMP_NUM_THREADS"] == "(not set)"


def test_report_without_any_backend(machine, monkeypatch):
    machine(gpus=0, nccl=False)
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    assert collect_report()["Distributed backends"] == "none"


def test_version_of_a_missing_package():
    assert doctor._version("no-such-package-in-this-course") == "not installed"


NO_GPU = (
    "No GPU: every chapter runs on the CPU; multi-device chapters use CPU replicas "
    "or gloo processes, which show the algorithms but not speed-ups."
)


@pytest.mark.parametrize(
    "gpus, cores, advice",
    [
        ("0", 8, [NO_GPU]),
        (
            "0",
            2,
            [
                NO_GPU,
                (
                    "Only 2 CPU cores: run at most 2 processes at once, one thread "
                    "each "
                    "(torchrun sets OMP_NUM_THREADS=1)."
                ),
            ],
        ),
        (
            "1",
            4,
            [
                "One GPU: chapters run on cuda:0; runs of several processes use "
                "the CPU and gloo (nccl needs a GPU per process)."
            ],
        ),
        (
            "3",
            3,
            [
                "3 GPUs: multi-device chapters use real GPUs and nccl.",
                (
                    "Only 3 CPU cores: run at most 3 processes at once, one thread "
                    "each "
                    "(torchrun sets OMP_NUM_THREADS=1)."
                ),
            ],
        ),
    ],
)
def test_advice_for_each_machine(monkeypatch, gpus, cores, advice):
    monkeypatch.setattr(doctor, "cpu_count", lambda: cores)
    assert doctor._advice({"GPUs": gpus}) == advice


def test_main_prints_aligned_report_then_advice(monkeypatch, capsys):
    monkeypatch.setattr(
        doctor,
        "collect_report",
        lambda: {"torch": "2.0", "GPUs": "1", "Long name": "x"},
    )
    monkeypatch.setattr(doctor, "cpu_count", lambda: 16)
    monkeypatch.setattr(doctor, "version_warnings", lambda: [])
    doctor.main()
    assert capsys.readouterr().out.splitlines() == [
        "companion doctor: what this machine offers the course",
        "  torch      2.0",
        "  GPUs       1",
        "  Long name  x",
        "- One GPU: chapters run on cuda:0; runs of several processes use the CPU "
        "and gloo (nccl needs a GPU per process).",
    ]


def test_doctor_command_prints_report_and_advice():
    out = subprocess.run(
        [sys.executable, "-m", "companion.doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0].startswith("companion doctor")
    for key in ("torch", "GPUs", "Distributed backends", "Intra-op threads", "CPU"):
        assert any(line.strip().startswith(key) for line in lines), key
    assert any(line.startswith("- ") for line in lines)  # at least one line of advice


@pytest.mark.parametrize(
    "torch_version, python, said",
    [
        ("2.14.1+cu130", (3, 11), []),
        ("2.10.0", (3, 12), []),
        ("2.9.1", (3, 11), ["torch 2.9.1 is outside", "install a newer one"]),
        ("2.16.0", (3, 11), ["torch 2.16.0 is outside", "may print what"]),
        ("2.12.0", (3, 10), ["Python 3.10 is older than the 3.11"]),
    ],
)
def test_versions_outside_the_tested_range_are_warned_about(
    torch_version, python, said
):
    text = " ".join(doctor.version_warnings(torch_version, python))
    assert all(part in text for part in said) and (text == "") == (said == [])


def test_the_floor_is_the_one_declared_and_tested():
    """pyproject.toml declares it, the Makefile's test-oldest installs it."""
    root = Path(__file__).resolve().parents[1]
    low = ".".join(map(str, doctor.TORCH_TESTED[0]))
    assert f'"torch>={low}"' in (root / "pyproject.toml").read_text()
    assert f"OLDEST_TORCH := {low}." in (root / "Makefile").read_text()
    pinned = (root / "requirements.txt").read_text().split("torch==")[1].split()[0]
    assert tuple(map(int, pinned.split(".")[:2])) == doctor.TORCH_TESTED[1]
