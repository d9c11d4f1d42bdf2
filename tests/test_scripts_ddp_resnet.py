"""Launch companion/scripts/ddp_resnet.py for real: plain python, torchrun with 1 and 2 processes."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from companion import LaunchError, launch, script_path
from companion.scripts import ddp_resnet
from companion.scripts.ddp_resnet import resnet18

# Tiny settings: a narrow ResNet-18, 32 training images, two epochs, two timing rounds.
TINY = [
    "--width",
    "4",
    "--epochs",
    "2",
    "--global-batch-size",
    "16",
    "--max-train",
    "32",
    "--timing-steps",
    "2",
]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A data file in the format the script expects: 40 training and 12 test images."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("data") / "images.pt"
    torch.save(
        {
            "name": "test images",
            "train_images": torch.rand(40, 1, 28, 28, generator=gen),
            "train_labels": torch.randint(0, 10, (40,), generator=gen),
            "test_images": torch.rand(12, 1, 28, 28, generator=gen),
            "test_labels": torch.randint(0, 10, (12,), generator=gen),
        },
        path,
    )
    return str(path)


# None: plain python, no launcher. Both slow: chapter 08 launches the script with 1
# and 2 processes in make test.
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [None, 2])
def test_trains_and_reports(data_file: str, nproc: int | None) -> None:
    results = launch(
        "ddp_resnet.py", ["--data", data_file, *TINY], nproc=nproc, timeout=110
    )
    nproc = nproc or 1
    assert results["world_size"] == nproc
    assert results["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
    assert results["data"] == "test images"
    assert results["micro_batch_size"] * nproc == results["global_batch_size"] == 16
    # 32 training images in global batches of 16: 2 steps per epoch, 2 epochs.
    assert results["steps_per_epoch"] == 2 and len(results["loss_curve"]) == 4
    assert len(results["test_accuracy_curve"]) == 2
    assert results["test_accuracy"] == results["test_accuracy_curve"][-1]
    assert results["throughput"] > 0 and results["threads"] >= 1
    timing = results["timing"]
    assert timing["gradient_floats"] == results["parameters"]
    assert (
        0 < timing["compute_time"]
        and 0 < timing["allreduce_time"]
        and 0 < timing["step_time"]
    )
    assert timing["rounds"] == 2


@pytest.mark.slow
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
    first_batch = torch.randperm(32, generator=torch.Generator().manual_seed(0))[
        :16
    ]  # DistributedSampler, seed 0
    for nproc in (1, 2):
        results = launch("ddp_resnet.py", args, nproc=nproc, timeout=110)
        assert "timing" not in results
        torch.manual_seed(0)
        model = resnet18(num_classes=10, in_channels=1, width=4)
        shards = [
            first_batch[rank::nproc] for rank in range(nproc)
        ]  # each rank's micro-batch
        with torch.no_grad():
            expected = (
                sum(F.cross_entropy(model(images[i]), labels[i]) for i in shards)
                / nproc
            )
        assert results["loss_curve"][0] == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.timeout(150)
def test_bad_data_file_gives_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.pt"
    torch.save({"train_images": torch.zeros(2, 1, 28, 28)}, bad)
    proc = subprocess.run(
        [sys.executable, str(script_path("ddp_resnet.py")), "--data", str(bad)],
        capture_output=True,
        text=True,
        timeout=55,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("ddp_resnet.py: error: ")
    assert "lacks the tensors train_labels, test_images, test_labels" in proc.stderr
    with pytest.raises(LaunchError, match="exit code 2"):
        launch(
            "ddp_resnet.py",
            ["--data", str(tmp_path / "missing.pt")],
            nproc=None,
            timeout=55,
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_uneven_data_drops_the_last_batch_and_counts_every_test_image(tmp_path) -> None:
    """41 training images in global batches of 16: 2 steps per epoch; 13 test images over 2 ranks (7 + 6).

    Every label is 3, so a model that trained at all predicts 3 everywhere and
    the accuracy is exactly 1 only if both ranks' counts are summed.
    """
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "threes.pt"
    torch.save(
        {
            "train_images": torch.rand(41, 1, 8, 8, generator=gen),
            "train_labels": torch.full((41,), 3),
            "test_images": torch.rand(13, 1, 8, 8, generator=gen),
            "test_labels": torch.full((13,), 3),
        },
        path,
    )
    results = launch(
        "ddp_resnet.py",
        [
            "--data",
            str(path),
            "--width",
            "4",
            "--epochs",
            "2",
            "--global-batch-size",
            "16",
            "--timing-steps",
            "0",
        ],
        nproc=2,
        timeout=110,
    )
    assert results["steps_per_epoch"] == 2 and len(results["loss_curve"]) == 4
    assert results["data"] == "threes.pt"  # no name in the file: the file's name
    assert results["test_accuracy_curve"][-1] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_synthetic_data_by_default_and_the_loss_falls() -> None:
    results = launch(
        "ddp_resnet.py",
        [
            "--width",
            "4",
            "--epochs",
            "3",
            "--global-batch-size",
            "16",
            "--max-train",
            "64",
            "--max-test",
            "32",
            "--timing-steps",
            "0",
        ],
        nproc=None,
        timeout=110,
    )
    assert results["data"].startswith("synthetic images (no --data given")
    assert results["steps_per_epoch"] == 4 and len(results["loss_curve"]) == 12
    curve = results["loss_curve"]
    assert sum(curve[-4:]) < sum(
        curve[:4]
    )  # the last epoch's mean loss is below the first's


@pytest.mark.timeout(150)
def test_a_global_batch_that_does_not_split_is_one_sentence(capsys) -> None:
    with pytest.raises(LaunchError, match="exit code"):
        launch(
            "ddp_resnet.py",
            ["--global-batch-size", "15", "--width", "4"],
            nproc=2,
            timeout=110,
        )
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if "ddp_resnet.py: error:" in line
    ]
    assert lines == [
        (
            "ddp_resnet.py: error: the global batch (15) does not split evenly over 2 "
            "processes; "
            "use a multiple of 2."
        )
    ]  # once: rank 0 only


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--epochs", "0"], "--epochs must be at least 1, not 0."),
        (["--width", "0"], "--width must be at least 1, not 0."),
        (
            ["--global-batch-size", "0"],
            "--global-batch-size must be at least 1, not 0.",
        ),
        (["--max-train", "-1"], "--max-train must not be negative, not -1."),
        (["--timing-steps", "-2"], "--timing-steps must not be negative, not -2."),
        (["--timeout", "0"], "--timeout must be positive, not 0.0."),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    ],
)
def test_bad_arguments_get_one_line(argv, expected, capsys, monkeypatch) -> None:
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as info:
        ddp_resnet.parse_args(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"ddp_resnet.py: error: {expected}"]


class Evil:
    def __reduce__(self):
        return (print, ("this would run when loaded",))


def test_each_bad_data_file_gets_its_own_sentence(tmp_path) -> None:
    torch.save({"train_images": Evil()}, tmp_path / "code.pt")
    (tmp_path / "truncated.pt").write_bytes(b"PK\x03\x04 half a zip")
    (tmp_path / "garbage.pt").write_bytes(b"hello world")
    torch.save(
        {"train_images": [1, 2], "train_labels": torch.zeros(2)}, tmp_path / "lists.pt"
    )
    said = {}
    for name in ("code.pt", "truncated.pt", "garbage.pt", "missing.pt", "lists.pt"):
        with pytest.raises(ddp_resnet.UsageError) as info:
            ddp_resnet.load_data(str(tmp_path / name), 0, 0, 0)
        said[name] = str(info.value)
    assert "run as code, so it was refused; save plain tensors" in said["code.pt"]
    assert said["truncated.pt"].endswith(
        "is truncated or not a file written with torch.save; save it again (see "
        "--help)."
    )
    assert said["garbage.pt"].endswith(
        "is truncated or not a file written with torch.save; save it again (see "
        "--help)."
    )
    assert "there is no data file" in said["missing.pt"]
    assert (
        "lacks the tensors train_images, test_images, test_labels;" in said["lists.pt"]
    )
