"""companion.roofline: counted FLOPs and bytes, the measured ceilings, MFU's formula."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap
from torch.utils.flop_counter import FlopCounterMode

from companion.ensemble import SGD, init_ensemble, make_train_step
from companion.gpt import GPT, CharText, GPTConfig, lm_loss
from companion.harness.notebook import CourseError
from companion.roofline import (
    DATASHEET_PEAKS,
    Roofline,
    count_kernel,
    datasheet_peaks,
    gpt_flops_per_token,
    measure_roofline,
    plot_roofline,
)


def test_a_product_counts_its_flops_and_three_matrices() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    c = count_kernel(torch.mm, a, b)
    assert c.product_flops == 2 * 64 * 32 * 16 and c.other_flops == 0
    assert c.bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert c.intensity == c.flops / c.bytes


def test_elementwise_work_counts_one_flop_per_element_and_every_byte() -> None:
    x = torch.randn(1000)
    c = count_kernel(torch.softmax, x, 0)
    assert (c.product_flops, c.other_flops, c.bytes) == (0, 1000, 8000)


def test_an_out_argument_is_written_not_read() -> None:
    a, b, out = torch.ones(100), torch.ones(100), torch.empty(100)
    assert count_kernel(torch.add, a, b, out=out).bytes == 3 * 400
    assert count_kernel(lambda: a.add_(b)).bytes == 3 * 400  # read a, b; write a


def test_views_move_nothing_and_a_broadcast_counts_once() -> None:
    x = torch.randn(64, 64)
    assert count_kernel(lambda: x.t()[1:].unsqueeze(0)).bytes == 0
    row = torch.randn(1, 64).expand(64, 64)  # 64 numbers seen 4096 times
    c = count_kernel(torch.mul, x, row)
    assert c.bytes == 4 * (64 * 64 + 64 + 64 * 64)


def test_a_copy_moves_bytes_but_does_no_arithmetic() -> None:
    x = torch.randn(256)
    c = count_kernel(torch.clone, x)
    assert (c.flops, c.bytes) == (0, 2 * 1024)


def test_the_same_tensor_read_twice_counts_once() -> None:
    x = torch.randn(100)
    assert count_kernel(torch.mul, x, x).bytes == 2 * 400


def test_vmapped_steps_are_counted_as_the_batched_operations() -> None:
    sgd = SGD()
    template, params, state = init_ensemble(4, sgd)
    step = vmap(make_train_step(template, sgd), in_dims=(0, 0, None, None))
    points, labels = torch.randn(8, 2), torch.randint(0, 2, (8,))
    c = count_kernel(step, params, state, points, labels)
    # forward 2-32-2 MLP on 8 points, 4 models: 2 products; backward: 3 more
    forward = 2 * 4 * 8 * (2 * 32 + 32 * 2)
    assert c.product_flops >= forward and c.bytes > 0


@pytest.mark.parametrize("n_layer, n_embd, seq_len", [(1, 32, 16), (2, 64, 32)])
def test_the_mfu_formula_is_what_the_flop_counter_counts(n_layer, n_embd, seq_len):
    text = CharText()
    config = GPTConfig(
        vocab_size=text.vocab_size, block_size=seq_len, n_layer=n_layer, n_embd=n_embd
    )
    model = GPT(config)
    x, y = text.batch(3, seq_len, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(x), y).backward()
    per_token = gpt_flops_per_token(n_layer, n_embd, seq_len, text.vocab_size)
    assert per_token["total"] == per_token["6N"] + per_token["attention"]
    assert counter.get_total_flops() == per_token["total"] * x.numel()


def test_the_roofline_is_the_lower_of_its_two_ceilings() -> None:
    roof = Roofline(peaks={"float32": 100e9}, copy=10e9, triad=20e9)
    assert roof.bandwidth == 20e9
    assert roof.balance() == 5.0
    assert roof.ceiling(1.0) == 20e9 and roof.ceiling(50.0) == 100e9


def test_measure_roofline_times_ceilings_and_kernels_together() -> None:
    x = torch.randn(256, 256)
    roof, timed = measure_roofline(
        {
            "softmax": lambda: torch.softmax(x, -1),
            "layer norm": lambda: F.layer_norm(x, (256,)),
        },
        sizes={"float32": 64, "bfloat16": 32},
        stream_bytes=2**20,
        min_run_time=0.01,
        repeats=2,
    )
    assert set(roof.peaks) == {"float32", "bfloat16"} and min(roof.peaks.values()) > 0
    assert roof.copy > 0 and roof.triad > 0 and roof.sizes["bfloat16"] == 32
    assert set(timed) == {"softmax", "layer norm"}
    assert all(t.median > 0 for t in timed.values())
    with pytest.raises(CourseError, match="kernel names may not be"):
        measure_roofline({"copy": lambda: None}, sizes={"float32": 8, "bfloat16": 8})


def test_plot_roofline_draws_the_roofs_and_the_points() -> None:
    roof = Roofline(peaks={"float32": 100e9, "bfloat16": 400e9}, copy=10e9, triad=20e9)
    ax = plot_roofline(
        roof, {"a": (0.1, 1e9), "b": (50.0, 80e9)}, dtypes=("float32", "bfloat16")
    )
    assert len(ax.lines) == 3  # two roofs and the balance point
    assert [t.get_text() for t in ax.texts] == ["a", "b"]


def test_labels_near_the_roof_go_below_it_and_step_down_from_close_neighbours() -> None:
    roof = Roofline(peaks={"float32": 100e9}, copy=10e9, triad=10e9)  # balance 10
    points = {  # intensity, FLOP/s: the first three near the roof, close together
        "near 20": (20.0, 90e9),
        "near 8": (8.0, 70e9),
        "near 40": (40.0, 95e9),
        "far below": (0.1, 0.1e9),
        "also far": (0.2, 0.1e9),
        "near 500": (500.0, 99e9),
    }
    ax = plot_roofline(roof, points)
    offsets = {t.get_text(): t.xyann[1] for t in ax.texts}
    crowded = {"a": (8.0, 90e9), "b": (20.0, 90e9), "c": (30.0, 90e9)}
    ax = plot_roofline(roof, crowded)  # c is less than 4x right of both
    assert [t.xyann[1] for t in ax.texts] == [-10, -21, -32]
    assert offsets == {
        "near 8": -10,
        "near 20": -21,  # under its left neighbour's label, which it would meet
        "near 40": -10,
        "near 500": -10,  # more than 4x to the right: room enough
        "far below": -10,  # the others alternate below and above
        "also far": 4,
    }


@pytest.mark.parametrize(
    "name, model",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA L4", "L4"),
    ],
)
def test_datasheet_peaks_are_found_by_the_gpus_name(name, model) -> None:
    found, peaks = datasheet_peaks(name)
    assert found == model and peaks is DATASHEET_PEAKS[model]


def test_an_unknown_gpu_has_no_datasheet_entry() -> None:
    assert datasheet_peaks("NVIDIA L40S") is None
    assert datasheet_peaks("AMD Instinct MI300X") is None


def test_the_datasheets_peaks_rise_from_float32_to_tf32_to_bfloat16() -> None:
    """A guard against typing a number into the wrong column (the values are
    NVIDIA's datasheets', which no test can re-derive)."""
    for peaks in DATASHEET_PEAKS.values():
        assert (
            peaks["float32"]
            < peaks["tf32"]
            < peaks["bfloat16"]
            < peaks["bfloat16 sparse"]
        )
    assert datasheet_peaks("NVIDIA GH200 480GB") is None  # not an H200


@pytest.mark.slow
def test_the_benchmark_rejects_bad_input() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "how_fast.py"
    done = subprocess.run(
        [sys.executable, script, "--processes", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--processes must be at least 2" in done.stderr
