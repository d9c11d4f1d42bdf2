"""`python -m companion.doctor` prints a useful report."""

import subprocess
import sys

import torch

from companion.doctor import collect_report


def test_report_matches_what_torch_sees():
    report = collect_report()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert report["GPUs"] == str(gpus)
    assert report["torch"] == torch.__version__
    assert report["Intra-op threads"] == str(torch.get_num_threads())
    assert "gloo" in report["Distributed backends"]
    assert report["Default backend here"] == ("nccl" if gpus else "gloo")


def test_doctor_command_prints_report_and_advice():
    out = subprocess.run(
        [sys.executable, "-m", "companion.doctor"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    lines = out.splitlines()
    assert lines[0].startswith("companion doctor")
    for key in ("torch", "GPUs", "Distributed backends", "Intra-op threads", "CPU"):
        assert any(line.strip().startswith(key) for line in lines), key
    assert any(line.startswith("- ") for line in lines)  # at least one line of advice
