"""companion/scripts/ddp_resnet.py and its check, companion/checks/ddp_scaling.py, for real.

make test launches the check once with 2 processes (training with the
script's own functions, then the timing of a step's parts); make test-slow
launches the script itself in more ways, and on the simulated GPU path.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launchers import SIMULATED_GPU, two_agents

from companion import launch, script_path
from companion.scripts import ddp_resnet
from companion.scripts.ddp_resnet import resnet18

# Tiny settings: a narrow ResNet-18, 32 training images, two epochs.
TINY = ["--width", "4", "--epochs", "2", "--global-batch-size", "16"]


def save_images(path: Path, train: int, test: int, label: int | None = None, size=28):
    gen = torch.Generator().manual_seed(0)

    def labels(n: int) -> torch.Tensor:
        return (
            torch.full((n,), label)
            if label is not None
            else torch.randint(0, 10, (n,), generator=gen)
        )

    torch.save(
        {
            "train_images": torch.rand(train, 1, size, size, generator=gen),
            "train_labels": labels(train),
            "test_images": torch.rand(test, 1, size, size, generator=gen),
            "test_labels": labels(test),
        },
        path,
    )
    return str(path)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A data file in the format the script expects: 32 training and 12 test images."""
    return save_images(tmp_path_factory.mktemp("data") / "images.pt", 32, 12)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_the_check_trains_with_the_script_and_times_the_parts(data_file: str) -> None:
    args = [
        "--data",
        data_file,
        *TINY,
        "--timing-rounds",
        "2",
        "--also-global-batch-size",
        "8",
    ]
    results = launch("checks/ddp_scaling.py", args, nproc=2, timeout=200)
    assert results["world_size"] == 2 and results["data"] == "images.pt"
    assert (results["device"], results["backend"]) == ("cpu", "gloo")
    assert results["micro_batch_size"] * 2 == results["global_batch_size"] == 16
    # 32 training images in global batches of 16: 2 steps per epoch, 2 epochs.
    assert results["steps_per_epoch"] == 2 and len(results["loss_curve"]) == 4
    assert results["test_accuracy"] == results["test_accuracy_curve"][-1]
    timing = results["timing"]
    assert timing["gradient_floats"] == results["parameters"] and timing["rounds"] == 2
    assert (
        min(timing["compute_time"], timing["allreduce_time"], timing["step_time"]) > 0
    )
    assert all(len(v) == 2 for v in timing["samples"].values())
    also = results["also_timing"]
    assert (timing["global_batch_size"], also["global_batch_size"]) == (16, 8)
    assert also["gradient_floats"] == timing["gradient_floats"]
    # The width-4 model's 0.2 MB of gradients: one bucket, as DDP's rule says.
    buckets = results["ddp_buckets"]
    assert buckets["gradient_bytes"] == 4 * results["parameters"]
    assert buckets["bucket_bytes"] == [buckets["gradient_bytes"]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_first_loss_is_the_global_batch_mean(data_file: str) -> None:
    """Step 1's logged loss is the mean over the global batch, split the way DDP splits it.

    Recomputed here from the same seed: the sampler's first permutation, the
    same initial model, and, on 2 processes, each half of the batch through
    its own replica (BatchNorm normalises each half with its own statistics).
    """
    blob = torch.load(data_file, weights_only=True)
    images, labels = blob["train_images"], blob["train_labels"]
    # DistributedSampler, seed 0, epoch 0: the first permutation of the 32 images
    first_batch = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:16]
    for nproc in (None, 2):
        results = launch("ddp_resnet.py", ["--data", data_file, *TINY], nproc=nproc)
        torch.manual_seed(0)
        model = resnet18(num_classes=10, in_channels=1, width=4)
        shards = [first_batch[rank :: nproc or 1] for rank in range(nproc or 1)]
        with torch.no_grad():
            losses = [F.cross_entropy(model(images[i]), labels[i]) for i in shards]
        expected = sum(losses) / len(shards)
        assert results["loss_curve"][0] == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_uneven_data_drops_the_last_batch_and_counts_every_test_image(tmp_path) -> None:
    """41 training images in global batches of 16: 2 steps per epoch; 13 test images over 2 ranks (7 + 6).

    Every label is 3, so a model that trained at all predicts 3 everywhere and
    the accuracy is exactly 1 only if both ranks' counts are summed.
    """
    path = save_images(tmp_path / "threes.pt", 41, 13, label=3, size=8)
    results = launch("ddp_resnet.py", ["--data", path, *TINY], nproc=2)
    assert results["steps_per_epoch"] == 2 and len(results["loss_curve"]) == 4
    assert results["data"] == "threes.pt"  # no name in the file: the file's name
    assert results["test_accuracy_curve"][-1] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_synthetic_data_by_default_and_the_loss_falls() -> None:
    args = ["--width", "4", "--epochs", "3", "--global-batch-size", "64"]
    results = launch("ddp_resnet.py", args, nproc=None)
    assert results["data"] == "synthetic images" and results["steps_per_epoch"] == 16
    curve = results["loss_curve"]  # the last epoch's mean loss is below the first's
    assert sum(curve[-16:]) < sum(curve[:16])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gpu_path_runs_on_a_simulated_gpu(tmp_path) -> None:
    """nccl and cuda:0, as on a GPU machine; the simulation raises what CUDA would."""
    out = tmp_path / "results.json"
    args = ["--width", "2", "--epochs", "1", "--global-batch-size", "256"]
    subprocess.run(
        [
            sys.executable,
            SIMULATED_GPU,
            script_path("ddp_resnet.py"),
            *args,
            "--results",
            out,
        ],
        check=True,
        timeout=280,
    )
    results = json.loads(out.read_text())
    assert (results["device"], results["backend"]) == ("cuda", "nccl")
    assert results["steps_per_epoch"] == 4 and len(results["loss_curve"]) == 4


@pytest.mark.parametrize(
    "content, said",
    [
        (None, "there is no data file"),
        (b"not a torch file", "cannot load"),
        (
            {"train_images": torch.zeros(2, 1, 28, 28)},
            "must hold a dict of the tensors",
        ),
    ],
)
def test_a_bad_data_file_is_one_sentence(tmp_path, capsys, content, said) -> None:
    path = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(SystemExit) as stop:
        ddp_resnet.load_data(str(path))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and said in err


@pytest.mark.timeout(150)
def test_a_bad_file_from_the_command_line_is_one_line_and_exit_code_2(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, script_path("ddp_resnet.py"), "--data", tmp_path / "none.pt"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("ddp_resnet.py: error: there is no data file")


def test_the_model_is_resnet18_at_width_64() -> None:
    n = sum(p.numel() for p in resnet18(10, 1, 64).parameters())
    assert n == 11_172_810
    assert resnet18(10, 3, 8)(torch.rand(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_loopback_nodes_train_as_one_node_of_two(data_file: str, tmp_path) -> None:
    args = ["--data", data_file, *TINY]
    two_nodes = two_agents("ddp_resnet.py", args, tmp_path)
    one_node = launch("ddp_resnet.py", args, nproc=2)
    assert two_nodes["world_size"] == 2
    assert two_nodes["loss_curve"] == pytest.approx(one_node["loss_curve"], abs=1e-6)
