"""d2l 1.0.3 works in the pinned stack (installed without its stale pins).

The seeds' idiom `from d2l import torch as d2l` must keep working, and the
helpers the course mentions must behave as the text says, including the two
that fall short on a CPU-only machine (which is why `companion` has its own).
"""

import subprocess
import sys

import pytest
import torch

# A real import: d2l is part of the course environment (the Makefile installs
# it with --no-deps), so a missing d2l fails these tests instead of skipping them.
from d2l import torch as d2l


def test_import_is_clean():
    # A fresh interpreter with warnings as errors: no deprecation noise from the import.
    subprocess.run(
        [sys.executable, "-W", "error", "-c", "from d2l import torch as d2l"],
        check=True,
        timeout=120,
    )


def test_timer_and_benchmark(capsys):
    timer = d2l.Timer()
    torch.randn(100, 100) @ torch.randn(100, 100)
    assert timer.stop() > 0
    with d2l.Benchmark("d2l"):
        pass
    assert capsys.readouterr().out.startswith("d2l: ")


def test_accuracy_counts_correct_predictions():
    logits = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]])
    assert float(d2l.accuracy(logits, torch.tensor([0, 1, 1]))) == 2.0


def test_resnet18_small_input_variant_takes_28x28():
    net = d2l.resnet18(10, 1)
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="documents the CPU-only behaviour"
)
def test_cpu_only_shortcomings_companion_fixes():
    import companion

    assert d2l.try_gpu() == torch.device("cpu")
    assert d2l.try_all_gpus() == []  # its docstring promises [cpu()]
    assert companion.try_all_gpus() == [torch.device("cpu")]
    with pytest.raises(ValueError, match="non cpu device"):
        d2l.split_batch(torch.zeros(4, 2), torch.zeros(4), [torch.device("cpu")] * 2)
