"""Launch companion/scripts/ddp_resnet.py for real: plain python, torchrun with 1 and 2 processes."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from companion import LaunchError, launch, script_path
from companion.scripts.ddp_resnet import resnet18

# Tiny settings: a narrow ResNet-18, 32 training images, two epochs, two timing rounds.
TINY = ["--width", "4", "--epochs", "2", "--global-batch-size", "16", "--max-train", "32", "--timing-steps", "2"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A data file in the format the script expects: 40 training and 12 test images."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("data") / "images.pt"
    torch.save({
        "name": "test images",
        "train_images": torch.rand(40, 1, 28, 28, generator=gen),
        "train_labels": torch.randint(0, 10, (40,), generator=gen),
        "test_images": torch.rand(12, 1, 28, 28, generator=gen),
        "test_labels": torch.randint(0, 10, (12,), generator=gen),
    }, path)  # fmt: skip
    return str(path)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [None, 2])  # None: plain python, no launcher
def test_trains_and_reports(data_file: str, nproc: int | None) -> None:
    results = launch("ddp_resnet.py", ["--data", data_file, *TINY], nproc=nproc, timeout=110)
    nproc = nproc or 1
    assert results["world_size"] == nproc
    assert results["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
    assert results["data"] == "test images"
    assert results["micro_batch_size"] * nproc == results["global_batch_size"] == 16
    # 32 training images in global batches of 16: 2 steps per epoch, 2 epochs.
    assert results["steps_per_epoch"] == 2 and len(results["loss_curve"]) == 4
    assert all(math.isfinite(x) and x > 0 for x in results["loss_curve"])
    assert len(results["test_accuracy_curve"]) == 2
    # 12 test images: the accuracy is a whole number of twelfths.
    assert results["test_accuracy"] * 12 == pytest.approx(round(results["test_accuracy"] * 12))
    assert results["throughput"] > 0 and results["threads"] >= 1
    timing = results["timing"]
    assert timing["gradient_floats"] == results["parameters"]
    assert 0 < timing["compute_time"] and 0 < timing["allreduce_time"] and 0 < timing["step_time"]
    assert timing["compute_time_per_image"] * results["micro_batch_size"] == pytest.approx(timing["compute_time"])


@pytest.mark.timeout(240)
def test_first_loss_is_the_global_batch_mean(data_file: str) -> None:
    """Step 1's logged loss is the mean over the global batch, split the way DDP splits it.

    Recomputed here from the same seed: the sampler's first permutation, the
    same initial model, and, on 2 processes, each half of the batch through
    its own replica (BatchNorm normalises each half with its own statistics).
    """
    args = ["--data", data_file, *TINY[:-2], "--timing-steps", "0", "--epochs", "1"]
    blob = torch.load(data_file, weights_only=True)
    images, labels = blob["train_images"][:32], blob["train_labels"][:32]
    first_batch = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:16]  # DistributedSampler, seed 0
    for nproc in (1, 2):
        results = launch("ddp_resnet.py", args, nproc=nproc, timeout=110)
        assert "timing" not in results
        torch.manual_seed(0)
        model = resnet18(num_classes=10, in_channels=1, width=4)
        shards = [first_batch[rank::nproc] for rank in range(nproc)]  # each rank's micro-batch
        with torch.no_grad():
            expected = sum(F.cross_entropy(model(images[i]), labels[i]) for i in shards) / nproc
        assert results["loss_curve"][0] == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.timeout(150)
def test_bad_data_file_gives_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.pt"
    torch.save({"train_images": torch.zeros(2, 1, 28, 28)}, bad)
    proc = subprocess.run(
        [sys.executable, str(script_path("ddp_resnet.py")), "--data", str(bad)],
        capture_output=True, text=True, timeout=55,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "lacks train_labels, test_images, test_labels" in proc.stderr
    with pytest.raises(LaunchError, match="exit code 2"):
        launch("ddp_resnet.py", ["--data", str(tmp_path / "missing.pt")], nproc=None, timeout=55)
