"""Tests that need a CUDA GPU: `make test-gpu` runs them; elsewhere they are skipped.

What a CPU can check of the GPU paths, it checks elsewhere (the simulated GPU
of tests/programs/simulated_gpu.py); these check what only a GPU has: that
timings wait for the GPU, and that a script's GPU run computes what its CPU
run computes.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from companion import benchmark, try_all_gpus, try_gpu
from companion.harness.launch import script_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_devices_are_the_gpus():
    assert try_gpu().type == "cuda"
    assert [d.type for d in try_all_gpus(2)] == ["cuda", "cuda"]


def test_benchmark_waits_for_the_gpu():
    """A host clock that did not wait would report the launch, far less than the work."""
    a = torch.randn(4096, 4096, device="cuda")
    timing = benchmark(torch.mm, a, a, min_run_time=0.3)
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    for _ in range(10):
        torch.mm(a, a)
    end.record()
    end.synchronize()
    on_gpu = start.elapsed_time(end) / 1e3 / 10
    assert 0.7 < timing.median / on_gpu < 1.4


def test_ddp_train_on_the_gpu_computes_what_it_computes_on_the_cpu(tmp_path):
    """float64: the devices differ only by rounding, far below 1e-10."""
    args = [
        "--steps",
        "24",
        "--samples",
        "256",
        "--global-batch-size",
        "32",
        "--dtype",
        "float64",
    ]
    finals = {}
    for device, visible in (("cuda", "0"), ("cpu", "")):
        folder = tmp_path / device
        subprocess.run(
            [
                sys.executable,
                script_path("ddp_train.py"),
                *args,
                "--checkpoint-dir",
                folder,
                "--results",
                folder / "r.json",
            ],
            check=True,
            timeout=300,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": visible},
        )
        assert json.loads((folder / "r.json").read_text())["device"] == device
        state = torch.load(
            sorted(folder.glob("step-*.pt"))[-1], map_location="cpu", weights_only=True
        )
        finals[device] = list(state["model"].values())
    for a, b in zip(finals["cuda"], finals["cpu"]):
        assert (a - b).abs().max().item() < 1e-10


def test_a_recorded_snapshot_agrees_with_the_allocators_statistics(tmp_path):
    """A tensor made in a phase shows up in the snapshot's walk with the bytes
    it asked for, and freeing it brings the walk back where it began; the
    allocator's own statistics count its block, rounded up to 512 bytes. The
    file written for the memory viewer holds the trace, with stacks."""
    import pickle

    from companion.memory import cuda_memory, record_snapshot

    kept = {}
    timeline = record_snapshot(
        {
            "make": lambda: kept.update(t=torch.empty(1000, device="cuda")),
            "free": lambda: kept.clear(),
        },
        path=tmp_path / "snapshot.pickle",
    )
    written = pickle.loads((tmp_path / "snapshot.pickle").read_bytes())
    allocs = [e for e in written["device_traces"][0] if e["action"] == "alloc"]
    assert any(e["size"] == 4000 and e["frames"] for e in allocs)  # with its stack
    after = cuda_memory()
    assert timeline.reserved[-1] == after["reserved"]
    assert timeline.at_end_of("make") - timeline.allocated[0] == 4000  # 1,000 floats
    assert timeline.allocated[-1] == timeline.allocated[0]
    assert timeline.allocated[-1] <= after["allocated"]  # whole blocks
    assert timeline.peak_phase() == "make"
    kept["t"] = torch.empty(1000, device="cuda")
    assert cuda_memory()["allocated"] - after["allocated"] == 4096  # a 512-byte block
