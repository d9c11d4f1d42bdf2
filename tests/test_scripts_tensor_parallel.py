"""Chapter 13's tensor-parallel script, and its check, launched on gloo processes.

Every expected number here is computed in this file, independently of the
script and of ``companion/checks/tensor_parallel.py``:

- the losses: the course's plain GPT trained in this process on the same
  batches, in float64 (every split must equal them to 1e-10);
- the collectives of a step: listed here layer by layer (which layer calls
  which collective on how many elements, in which phase) and added up;
- the bytes saved for backward: listed here tensor by tensor (what each
  layer keeps, and which of those a split divides by N), checked in this
  process against ``companion.gpt``'s formula for the plain model;
- the 2-D run's parameter bytes: the model's own parameters cut with
  ``torch.chunk``, as TP and then FSDP2 cut them.

``make test`` launches the check on 2 processes (the three 1-D splits) and the
script alone with plain python; bad input is refused in this process; the 2-D
launches, one process, and the failing check are marked slow.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from gpt_scripts import (
    FLOAT64,
    on_simulated_gpus,
    one_process_group,
    reference_losses,
    refusal,
)

from companion.checks import tensor_parallel as check
from companion.gpt import GPT, CharText, GPTConfig, saved_activation_bytes_formula
from companion.harness.launch import LaunchError, launch
from companion.scripts import tensor_parallel_gpt

pytestmark = pytest.mark.timeout(180)

NAME, CHECK = "tensor_parallel_gpt.py", "checks/tensor_parallel.py"
TOL = 1e-10  # float64; measured differences are about 1e-16
B, T = 8, 64  # the script's default batch
PHASES = ("forward", "backward", "optimizer")
CHECKS_1D = [
    "hand_block",
    "hand_collectives",
    "hand_losses",
    "tp_losses",
    "tp_gradients",
    "tp_collectives",
    "sp_losses",
    "sp_collectives",
    "activations",
]


HEADS = (
    "--n-head 4 does not split over 3 tensor-parallel processes, each of which keeps "
    "whole heads, or does not divide --n-embd; use a number of processes that "
    "divides it."
)


def default_config() -> GPTConfig:
    return GPTConfig(vocab_size=CharText().vocab_size)


def add_up(events: list[tuple[str, str, int, int]], b: int) -> dict:
    """Collectives listed as (phase, kind, input elements, output elements), added up."""
    steps: dict = {}
    for phase, kind, n_in, n_out in events:
        row = steps.setdefault(phase, {}).setdefault(
            kind, defaultdict(int, calls=0, input_bytes=0, output_bytes=0)
        )
        row["calls"] += 1
        row["input_bytes"] += n_in * b
        row["output_bytes"] += n_out * b
    return {p: {k: dict(r) for k, r in kinds.items()} for p, kinds in steps.items()}


def expected_collectives(config: GPTConfig, n: int, b: int = 8) -> dict:
    """One training step's collectives per phase, layer by layer."""
    d, V = config.n_embd, config.vocab_size
    stream = B * T * d  # the residual stream: every position, every feature
    hand, tp, sp = [], [], []
    for _ in range(config.n_layer):
        for _half in ("attention", "mlp"):
            # Megatron-LM: g sums the partial outputs, f sums the input gradients.
            hand += [("forward", "all-reduce", stream, stream)]
            hand += [("backward", "all-reduce", stream, stream)]
            # DTensor: proj makes its Partial output Replicate; in backward each
            # ColwiseParallel module (q, k, v; fc) reduces its own input gradient.
            tp += [("forward", "all-reduce", stream, stream)]
            tp += [("backward", "all-reduce", stream, stream)] * (
                3 if _half == "attention" else 1
            )
            # Sequence parallel: gather the LayerNorm's shards, scatter proj's sums.
            sp += [("forward", "all-gather", stream // n, stream)]
            sp += [("forward", "reduce-scatter", stream, stream // n)]
            sp += [("backward", "all-gather", stream // n, stream)]
            sp += [("backward", "reduce-scatter", stream, stream // n)]
            # The LayerNorm's weight has a Partial gradient, summed once after
            # the backward pass (left Partial, Adam would all-reduce it 3 times).
            sp += [("backward", "all-reduce", d, d)]
    shard = B * T * -(-V // n)  # one rank's logits, the vocabulary padded
    sp += [
        ("forward", "all-gather", stream // n, stream),  # the head's input
        ("forward", "all-gather", shard, n * shard),  # the logits
        ("backward", "reduce-scatter", stream, stream // n),  # the head's input
        ("backward", "all-gather", stream // n, stream),  # into the embeddings
    ]
    sp += [("backward", "all-reduce", d, d)]  # the final LayerNorm's weight
    empty = {"forward": {}, "backward": {}, "optimizer": {}}
    return {
        split: {**empty, **add_up(events, b)}
        for split, events in (("hand", hand), ("tp", tp), ("sp", sp))
    }


def expected_saved_bytes(config: GPTConfig, n: int, split: str, b: int = 8) -> int:
    """Bytes saved for backward per rank, tensor by tensor.

    ``tp``: heads and MLP features split over n; ``sp`` also splits the
    positions the LayerNorms see, while attention and MLP keep their whole,
    all-gathered input.
    """
    d, h, V = config.n_embd, config.n_head, config.vocab_size
    P = B * T
    heads = 1 if split == "plain" else n  # q, k, v, softmax, MLP features
    seq = n if split == "sp" else 1  # positions a LayerNorm sees
    block = [
        P // seq * d,  # ln_1's input
        2 * P // seq,  # its mean and inverse standard deviation
        P * d,  # attention's input (q, k and v share it)
        3 * P * d // heads,  # contiguous copies of q, k and v
        B * h * T * T // heads,  # the softmax's output
        P * d // heads,  # the heads side by side, proj's input
        P // seq * d,  # ln_2's input
        2 * P // seq,
        P * d,  # the MLP's input
        4 * P * d // heads,  # the GELU's input
        4 * P * d // heads,  # proj's input, the GELU's output
    ]
    around = [P // seq * (d + 2), P * d, P * V]  # ln_f, head's input, log-softmax
    around += [1]  # cross-entropy's total weight, a scalar
    integers = (2 * P + T) * 8  # token ids and targets, positions
    return (config.n_layer * sum(block) + sum(around)) * b + integers


def expected_parameter_bytes(dp: int, tp: int, b: int = 8) -> list[dict]:
    """Per rank of a dp x tp mesh: the parameters cut by TP, then dim 0 by FSDP2."""
    torch.manual_seed(0)
    model = GPT(default_config())
    out = []
    for rank in range(dp * tp):
        dp_rank, tp_rank = divmod(rank, tp)
        owned = padded = 0
        for name, p in model.named_parameters():
            kept = p.detach()
            leaf = name.rsplit(".", 2)[-2]  # the layer's own name
            if leaf in ("q", "k", "v", "fc"):
                kept = kept.chunk(tp, dim=0)[tp_rank]
            elif leaf == "proj":
                kept = kept.chunk(tp, dim=1)[tp_rank]
            pieces = kept.chunk(dp, dim=0)
            owned += pieces[dp_rank].numel() if dp_rank < len(pieces) else 0
            padded += pieces[0].numel()
        out.append({"local": owned * b, "storage": padded * b})
    return out


def test_the_plain_models_saved_bytes_in_this_process() -> None:
    """Measured here, without processes: the course's formula, this file's list, the
    check's formula and the check's measurement agree for the plain model."""
    config = default_config()
    course = sum(saved_activation_bytes_formula(config, B, T, 8).values())
    # companion/gpt.py leaves out one scalar, cross-entropy's total weight.
    assert expected_saved_bytes(config, 1, "plain") == course + 8
    predicted = check.predict_saved_bytes(config, B, T, 2, 8)
    assert predicted["plain"]["total"] == course + 8
    torch.manual_seed(0)
    model = GPT(config).to(torch.float64)
    x, y = CharText().batch(B, T, torch.Generator().manual_seed(0))
    assert check.saved_bytes(model, x, y) == course + 8


@pytest.mark.parametrize("n", [2, 4])
def test_the_checks_formulas_match_the_lists_here(n) -> None:
    config = default_config()
    predicted = check.predict_saved_bytes(config, B, T, n, 8)
    for split in ("tp", "sp"):
        assert predicted[split]["total"] == expected_saved_bytes(config, n, split)
    assert predicted["hand"] == predicted["tp"]
    collectives = check.predict_collectives(config, B, T, n, 8)
    expected = expected_collectives(config, n)
    for split in ("hand", "tp", "sp"):
        assert collectives[split] == expected[split], split
    torch.manual_seed(0)
    shapes = {k: list(p.shape) for k, p in GPT(config).named_parameters()}
    dp, tp = n // 2 or 1, 2
    assert [
        check.predict_parameter_bytes(shapes, dp, tp, r, 8) for r in range(dp * tp)
    ] == expected_parameter_bytes(dp, tp)


@pytest.mark.slow
def test_two_processes_split_three_ways_and_match_the_plain_model() -> None:
    """The one launch of the check in make test: every number against this file's."""
    out = launch(CHECK, ["--repeats", "2"], nproc=2, timeout=170)
    config = GPTConfig(**out["config"])
    assert out["world_size"] == 2 and out["dtype"] == "float64" and out["steps"] == 3
    assert out["device"] == "cpu" and out["backend"] == "gloo"
    assert out["checks"] == dict.fromkeys(CHECKS_1D, True)
    assert max(out["hand"]["block"]["max_diff"].values()) <= TOL
    # One block: g after attention and after the MLP, f before them in backward.
    stream = B * T * config.n_embd * 8
    two = {
        "all-reduce": {
            "calls": 2,
            "input_bytes": 2 * stream,
            "output_bytes": 2 * stream,
        }
    }
    assert out["hand"]["block"]["collectives"] == {"forward": two, "backward": two}

    reference = reference_losses(3)
    assert out["reference_losses"] == pytest.approx(reference, abs=TOL)
    expected = expected_collectives(config, 2)
    for split in ("hand", "tp", "sp"):
        run = out[split]
        assert max(abs(a - r) for a, r in zip(run["losses"], reference)) <= TOL
        assert max(run["max_diff"].values()) <= TOL, (split, run["max_diff"])
        assert len(run["collectives"]) == 3 and run["same_on_every_rank"]
        assert all(step == expected[split] for step in run["collectives"]), split

    measured = out["activations"]["measured"]
    assert set(measured) == {"plain", "hand", "tp", "sp"}
    for split, per_rank in measured.items():
        want = expected_saved_bytes(config, 2, "tp" if split == "hand" else split)
        assert per_rank == [want, want], split
    assert measured["plain"][0] > measured["tp"][0] > measured["sp"][0]

    timing = out["timing"]
    for key in ("plain_same_cpus", "plain_one_process", "hand", "tp", "sp"):
        assert 0 < timing[key] < 10, (key, timing)
    assert 0 < timing["all_reduce"] < 1 and timing["all_reduce_bytes"] == stream
    assert 0 < timing["all_reduce_in_step"] < 1
    samples = timing["samples"]  # timed in turn, one sample of each per round
    assert set(samples) == {"plain_one_process", "hand", "tp", "sp"}
    assert {len(v) for v in samples.values()} == {2}  # --repeats 2


@pytest.mark.slow
def test_the_script_alone_trains_as_the_plain_model() -> None:
    out = launch(
        NAME, ["--layout", "sp", "--steps", "2", *FLOAT64], nproc=None, timeout=90
    )
    assert out["device"] == "cpu" and out["backend"] == "gloo"
    assert out["losses"] == pytest.approx(reference_losses(2), abs=TOL, rel=0)


@pytest.mark.slow
def test_one_process_splits_nothing_and_sends_nothing() -> None:
    out = launch(CHECK, ["--repeats", "1"], nproc=None, timeout=120)
    assert out["checks"] == dict.fromkeys(CHECKS_1D, True)
    for split in ("hand", "tp", "sp"):
        assert out[split]["collectives"][0] == {p: {} for p in PHASES}


@pytest.mark.slow
def test_four_processes_on_a_2x2_mesh_match_the_plain_model() -> None:
    out = launch(CHECK, ["--layout", "2d"], nproc=4, timeout=170)
    assert out["mesh"] == {"dp": 2, "tp": 2} and out["world_size"] == 4
    reference = reference_losses(5)
    assert len(out["losses"]) == 5
    assert max(abs(a - r) for a, r in zip(out["losses"], reference)) <= TOL
    assert out["reference_losses"] == pytest.approx(reference, abs=TOL)
    measured = out["parameter_bytes"]["measured"]
    assert measured == expected_parameter_bytes(2, 2)
    # TP does not split the embeddings, LayerNorms and head: above P b / 4.
    whole = out["parameter_bytes"]["whole_model"]
    assert all(whole / 4 < m["local"] < whole / 2 for m in measured)
    assert out["checks"] == {"losses": True, "parameter_bytes": True}
    script = launch(
        NAME, ["--layout", "2d", "--steps", "3", *FLOAT64], nproc=4, timeout=170
    )
    assert script["losses"] == pytest.approx(reference[:3], abs=TOL, rel=0)


@pytest.mark.slow
def test_a_missed_tolerance_exits_with_code_3(capsys) -> None:
    """float32 cannot meet a 1e-15 tolerance: the check fails, one sentence from
    rank 0 (torchrun itself exits with 1 when a process fails)."""
    capsys.readouterr()
    with pytest.raises(LaunchError, match="exit code"):
        launch(
            CHECK,
            ["--dtype", "float32", "--tolerance", "1e-15", "--repeats", "1"],
            nproc=2,
            timeout=150,
        )
    errors = [line for line in capsys.readouterr().out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "beyond --tolerance 1e-15." in errors[0], errors
    assert errors[0].startswith("tensor_parallel.py: error: ")


@pytest.mark.parametrize(
    "args, world_size, expected",
    [
        (
            [],
            3,
            HEADS,
        ),
        (
            ["--layout", "sp", "--seq-len", "63"],
            2,
            (
                "--seq-len 63 does not split over 2 processes for sequence "
                "parallelism; use a multiple of 2."
            ),
        ),
        (
            ["--layout", "2d"],
            3,
            "--dp 2 does not divide 3 processes into rows of a mesh.",
        ),
        (
            ["--layout", "2d", "--dp", "1", "--n-head", "4"],
            3,
            HEADS,
        ),
        (
            ["--layout", "2d", "--batch-size", "6", "--dp", "4"],
            4,
            "--batch-size 6 does not split over --dp 4 rows.",
        ),
        (["--seq-len", "65"], 1, "--seq-len 65 must be 1 to --block-size, under 856."),
    ],
)
def test_bad_input_is_one_sentence(
    args, world_size, expected, monkeypatch, capsys
) -> None:
    err = refusal(
        lambda: tensor_parallel_gpt.parse_args(args),
        monkeypatch,
        capsys,
        world_size,
        NAME,
    )
    assert err == f"{NAME}: error: {expected}\n"


def test_split_dims_follow_megatron() -> None:
    """Column-parallel layers split their weight's rows, row-parallel its columns:
    the check's rule, and the slices the script's hand-split layers keep."""
    torch.manual_seed(0)
    names = [n for n, _ in GPT(default_config()).named_parameters()]
    dims = {n: check.split_dim(n) for n in names}
    assert {n for n, d in dims.items() if d == 0} == {
        f"blocks.{i}.{layer}.weight"
        for i in range(2)
        for layer in ("attn.q", "attn.k", "attn.v", "mlp.fc")
    }
    assert {n for n, d in dims.items() if d == 1} == {
        f"blocks.{i}.{layer}.proj.weight" for i in range(2) for layer in ("attn", "mlp")
    }


@pytest.mark.slow
def test_the_check_runs_on_two_simulated_gpus() -> None:
    """Every tensor of the check and the script on its GPU, every collective on nccl."""
    args = ["--repeats", "1"]
    out = on_simulated_gpus("checks/tensor_parallel.py", args, nproc=2, timeout=170)
    assert (out["device"], out["backend"]) == ("cuda", "nccl")
    assert out["checks"] == dict.fromkeys(CHECKS_1D, True)


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_make_adam_steps_a_split_model_with_a_gpus_default_foreach(layout):
    """The H100 run's crash, on the CPU: CUDA's Adam defaults to ``foreach``,
    which refuses a group mixing DTensors and plain tensors. With foreach
    forced here, one group raises as it did there; make_adam's two groups step."""
    tpg = tensor_parallel_gpt
    args = tpg.parse_args(["--layout", layout, "--steps", "1"])
    with one_process_group():
        mesh = tpg.build_mesh(args, torch.device("cpu"))
        (x, y), *_ = tpg.global_batches(args, "cpu")

        def split_model() -> torch.nn.Module:
            model = tpg.build_model(tpg.model_config(args), 0, args.dtype, "cpu")
            return tpg.parallelize(model, layout, mesh)

        mixed = split_model()
        one_group = torch.optim.Adam(mixed.parameters(), lr=1e-3, foreach=True)
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            tpg.train_step(mixed, one_group, x, y)
        model = split_model()
        optimizer = tpg.make_adam(model, 1e-3)
        for group in optimizer.param_groups:
            group["foreach"] = True
        before = [
            p.detach().full_tensor().clone()
            if isinstance(p, tpg.DTensor)
            else p.detach().clone()
            for p in model.parameters()
        ]
        tpg.train_step(model, optimizer, x, y)
    kinds = [
        {isinstance(p, tpg.DTensor) for p in g["params"]}
        for g in optimizer.param_groups
    ]
    assert kinds == [{True}, {False}]
    after = [
        p.detach().full_tensor() if isinstance(p, tpg.DTensor) else p.detach()
        for p in model.parameters()
    ]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
