"""Chapter 12's FSDP2 script, and its check, launched for real on gloo processes.

Every expected number here is computed in this file, independently of the
script and of ``companion/checks/fsdp_memory.py``:

- the losses: the course's plain GPT trained in this process on the same
  batches, in float64 (FSDP's must equal them to 1e-10);
- the bytes each rank holds: the model's parameter shapes, split along dim 0
  as ``torch.chunk`` splits them (owned) and padded to ``ceil(rows / N)``
  rows (allocated); Adam keeps two shard-sized tensors and a 4-byte step
  counter per parameter tensor, the counters whole on every rank;
- the collectives of a step: per FSDP unit one all-gather before forward,
  one more before backward if it resharded after forward (the root only when
  told explicitly), one reduce-scatter of the gradients; none alone; with
  mixed precision, gathered in bfloat16 (2 bytes) and reduced in float32 (4);
  in 2 micro-batches twice the all-gathers, and the reduce-scatters once
  (the whole model's gradients held between the parts) or twice (a shard);
- each rank's peak during a step: at least its shards, Adam's state and its
  micro-batch's saved activations (the course's formula), and less than a
  further four copies of the whole model's parameters;
- checkpoints: saved by one number of processes and resumed by another, the
  losses continue the uninterrupted run; the file gathered to rank 0 holds
  the same tensors as the sharded checkpoint; a missing or broken checkpoint
  is one sentence and exit code 2.

``make test`` launches nothing: bad input is refused in this process, and
chapter 12 runs the check on 2 and 4 processes in every nbval run. Every
launch here is marked slow.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from gpt_scripts import (
    FLOAT64,
    check_model_copy,
    on_simulated_gpus,
    one_process_group,
    reference_losses,
    refusal,
)
from torch.distributed.tensor import init_device_mesh

from companion.checks import fsdp_memory
from companion.gpt import GPT, GPTConfig, saved_activation_bytes_formula
from companion.harness.launch import LaunchError, launch
from companion.scripts import fsdp_gpt, pipeline_gpt, tensor_parallel_gpt

pytestmark = pytest.mark.timeout(180)

NAME, CHECK = "fsdp_gpt.py", "checks/fsdp_memory.py"
TOL = 1e-10  # float64; measured differences are about 1e-16
SETTINGS = ("on", "off", "all-on", "on, bf16")
ACCUMULATION = {"on, 2 parts, sync last": "last", "on, 2 parts, sync each": "each"}
CHECKS = {"memory": True, "communication": True, "losses": True, "accumulation": True}


def unit_shapes(config: dict) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of each FSDP unit's parameters, written out from the model's definition."""
    d, v = config["n_embd"], config["vocab_size"]
    block = [(d,), (d, d), (d, d), (d, d), (d, d), (d,), (4 * d, d), (d, 4 * d)]
    units = {f"blocks.{i}": block for i in range(config["n_layer"])}
    units["root"] = [(v, d), (config["block_size"], d), (d,), (v, d)]
    return units


def owned_rows(rows: int, n: int, rank: int) -> int:
    chunks = torch.arange(rows).chunk(n)  # FSDP2 shards dim 0 as torch.chunk does
    return len(chunks[rank]) if rank < len(chunks) else 0


def expected_state(config: dict, n: int, rank: int, b: int = 8) -> dict:
    shapes = [s for unit in unit_shapes(config).values() for s in unit]
    owned = b * sum(owned_rows(s[0], n, rank) * math.prod(s[1:]) for s in shapes)
    padded = b * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)
    return {
        "parameters": {"local": owned, "storage": padded},
        "gradients": {"local": owned, "storage": padded},
        "optimizer_state": {"local": 2 * owned, "storage": 2 * owned},
        "step_counters": {
            "count": len(shapes),
            "bytes": 4 * len(shapes),
            "dtype": ["torch.float32"],
            "sharded": False,
        },
    }


def expected_communication(config: dict, n: int, setting: str, b: int = 8) -> tuple:
    """(collectives of one step, unsharded bytes between forward and backward)."""
    numel = {
        name: sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)
        for name, shapes in unit_shapes(config).items()
    }
    gathered, reduced = (2, 4) if setting.endswith("bf16") else (b, b)
    kept = {"on": ["root"], "off": list(numel), "all-on": []}[setting.split(",")[0]]
    unsharded = sum(n * numel[u] * gathered for u in kept)
    if n == 1:
        return {}, unsharded
    gathers = {u: 1 if u in kept else 2 for u in numel}
    return {
        "all-gather": {
            "calls": sum(gathers.values()),
            "input_bytes": gathered * sum(gathers[u] * numel[u] for u in numel),
            "output_bytes": gathered * n * sum(gathers[u] * numel[u] for u in numel),
        },
        "reduce-scatter": {
            "calls": len(numel),
            "input_bytes": reduced * n * sum(numel.values()),
            "output_bytes": reduced * sum(numel.values()),
        },
    }, unsharded


def expected_accumulation(config: dict, n: int, sync: str, b: int = 8) -> tuple:
    """(collectives of one step in 2 micro-batches, the bytes held between them)."""
    once, _ = expected_communication(config, n, "on", b)
    shapes = [s for unit in unit_shapes(config).values() for s in unit]
    whole = b * sum(math.prod(s) for s in shapes)  # unsharded gradients
    padded = b * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)
    held = (whole if sync == "last" else padded) + b  # and the first part's loss
    if n == 1:
        return {}, held
    reduces = 2 if sync == "each" else 1
    gather, scatter = once["all-gather"], once["reduce-scatter"]
    return {
        "all-gather": {k: 2 * v for k, v in gather.items()},
        "reduce-scatter": {k: reduces * v for k, v in scatter.items()},
    }, held


def damaged(folder: Path, name: str = NAME) -> str:
    """The one sentence for a checkpoint that DCP cannot read."""
    return (
        f"{name}: error: cannot read the sharded checkpoint in {folder} "
        "(CheckpointException): it is damaged or incomplete; save it again with --save."
    )


def assert_losses_match(out: dict, first: int, count: int) -> None:
    reference = reference_losses(first + count)[first:]
    assert out["steps"] == list(range(first, first + count))
    diffs = [abs(a - r) for a, r in zip(out["losses"], reference, strict=True)]
    assert max(diffs) <= TOL, (out["losses"], reference)


def assert_measurements_match(out: dict) -> None:
    n, config = out["world_size"], out["config"]
    assert out["device"] == "cpu" and out["backend"] == "gloo" and out["threads"] >= 1
    measured = out["memory"]["measured"]
    assert measured == [expected_state(config, n, r) for r in range(n)]
    # The shards partition the model: every element is owned exactly once.
    assert sum(m["parameters"]["local"] for m in measured) == 8 * out["n_params"]
    for setting in SETTINGS:
        comm = out["communication"][setting]
        collectives, unsharded = expected_communication(config, n, setting)
        assert comm["per_step"] and all(s == collectives for s in comm["per_step"]), (
            setting,
            comm,
        )
        assert comm["unsharded_bytes_after_forward"] == unsharded, (setting, comm)
        assert comm["same_on_every_rank"]
    # One process has nothing to reduce: the check counts no accumulation.
    assert (set(ACCUMULATION) <= out["communication"].keys()) == (n > 1)
    for setting, sync in ACCUMULATION.items() if n > 1 else ():
        comm = out["communication"][setting]
        collectives, held = expected_accumulation(config, n, sync)
        assert comm["per_step"] == [collectives], (setting, comm)
        held_per_rank = comm["gradient_bytes_between_microbatches_per_rank"]
        assert held_per_rank == [held] * n, (setting, comm)  # padded: the same
    assert_losses_match(out, out["steps"][0], len(out["steps"]))
    assert out["reference_losses"] == pytest.approx(
        reference_losses(out["steps"][-1] + 1)[out["steps"][0] :], abs=TOL
    )
    assert out["checks"] == CHECKS
    assert out["cuda_peak_bytes_per_rank"] is None  # no GPU here
    assert_peaks_plausible(out)


def assert_peaks_plausible(out: dict) -> None:
    """The last step's peak on every rank: the rank's shards and Adam's state,
    its micro-batch's saved activations, and some gathered units on top."""
    n, config = out["world_size"], out["config"]
    gpt = GPTConfig(**config)
    activations = sum(
        saved_activation_bytes_formula(gpt, 8 // n, 64, dtype_bytes=8).values()
    )
    assert out["peak"]["step"] == len(out["steps"]) - 1
    for rank, peak in enumerate(out["peak"]["bytes_per_rank"]):
        state = expected_state(config, n, rank)
        at_rest = state["parameters"]["storage"] + state["optimizer_state"]["storage"]
        assert (
            at_rest + activations
            < peak
            < at_rest + activations + 4 * 8 * out["n_params"]
        ), (rank, peak, at_rest, activations)


def test_the_gpt_scripts_share_one_model_the_course_model() -> None:
    """fsdp_gpt, tensor_parallel_gpt and pipeline_gpt import gpt_model.py's GPT."""
    scripts = (fsdp_gpt, tensor_parallel_gpt, pipeline_gpt)
    assert len({(s.GPT, s.CharText, s.lm_loss, s.build_model) for s in scripts}) == 1
    check_model_copy(fsdp_gpt)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_checks_formulas_match_the_lists_here(n) -> None:
    config = {"n_layer": 2, "n_embd": 64, "vocab_size": 45, "block_size": 64}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config))
    units = fsdp_memory.units_of(model)
    assert {u["name"]: [tuple(p["shape"]) for p in u["parameters"]] for u in units} == (
        unit_shapes(config)
    )
    for rank in range(n):
        assert fsdp_memory.predict_state(units, n, rank, 8) == expected_state(
            config, n, rank
        )
    for setting in SETTINGS:
        predicted = fsdp_memory.predict_communication(units, n, 8, setting)
        collectives, unsharded = expected_communication(config, n, setting)
        assert predicted == {
            "collectives": collectives,
            "unsharded_bytes_after_forward": unsharded,
            "gradient_bytes_between_microbatches": None,
        }
    for setting, sync in ACCUMULATION.items():
        predicted = fsdp_memory.predict_communication(units, n, 8, setting)
        collectives, held = expected_accumulation(config, n, sync)
        assert predicted["collectives"] == collectives
        assert predicted["gradient_bytes_between_microbatches"] == held


@pytest.mark.parametrize("shards, replicate", [(2, 2), (1, 2), (2, 3)])
def test_hsdp_adds_an_all_reduce_of_each_reduced_shard(shards, replicate) -> None:
    """HSDP: FSDP's collectives within a replica of ``shards`` processes, then
    one all-reduce per unit of what its reduce-scatter kept (with one shard:
    of the whole gradients, as DDP), once per step however often it
    reduce-scatters (``set_requires_all_reduce``)."""
    config = {"n_layer": 2, "n_embd": 64, "vocab_size": 45, "block_size": 64}
    torch.manual_seed(0)
    units = fsdp_memory.units_of(GPT(GPTConfig(**config)))
    shapes = [s for unit in unit_shapes(config).values() for s in unit]
    kept = sum(-(-s[0] // shards) * math.prod(s[1:]) for s in shapes)  # elements
    for setting in ("on", "on, bf16", "on, 2 parts, sync each"):
        predicted = fsdp_memory.predict_communication(
            units, shards, 8, setting, replicate
        )
        within = fsdp_memory.predict_communication(units, shards, 8, setting)
        reduced = kept * (4 if setting.endswith("bf16") else 8)
        all_reduce = {
            "calls": 3,
            "input_bytes": reduced,
            "output_bytes": reduced,
        }
        assert predicted["collectives"] == within["collectives"] | {
            "all-reduce": all_reduce
        }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[dict, Path]:
    """The check on 2 processes: train 3 steps, count, judge, save; its results and checkpoint."""
    ckpt = tmp_path_factory.mktemp("two") / "ckpt"
    return launch(CHECK, ["--steps", "3", "--save", ckpt], nproc=2, timeout=150), ckpt


@pytest.mark.slow
def test_two_processes_match_one_process_every_formula_and_both_checkpoints(
    two, tmp_path
) -> None:
    """One test for the one launch of the check, so that pytest-xdist starts it once.

    DCP writes a file per rank, each rank holding its shard; the gathered
    checkpoint is one file, all of it held by rank 0; both hold the same state.
    """
    out, ckpt = two
    assert out["world_size"] == 2 and out["dtype"] == "float64"
    assert_measurements_match(out)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "full_state.pt",
        "meta.json",
    ]
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt"]  # no .tmp left
    assert json.loads((ckpt / "meta.json").read_text())["step"] == 3
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=True)
    gathered = torch.load(ckpt / "full_state.pt", weights_only=True)
    assert converted["model"].keys() == gathered["model"].keys()
    for fqn, tensor in gathered["model"].items():
        assert torch.equal(converted["model"][fqn], tensor)
    assert (
        converted["optimizer"]["state"].keys() == gathered["optimizer"]["state"].keys()
    )
    for fqn, state in gathered["optimizer"]["state"].items():
        assert state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            assert torch.equal(converted["optimizer"]["state"][fqn][key], value)
    # The gathered file loads into the plain model (strict: same keys and shapes).
    plain = GPT(GPTConfig(vocab_size=out["config"]["vocab_size"])).to(torch.float64)
    plain.load_state_dict(gathered["model"])
    full = 3 * 8 * out["n_params"] + 4 * out["n_param_tensors"]
    shards = [
        m["parameters"]["local"]
        + m["optimizer_state"]["local"]
        + m["step_counters"]["bytes"]
        for m in out["memory"]["measured"]
    ]
    save = out["checkpoint"]["save"]
    assert save["dcp"]["held_bytes_per_rank"] == shards
    assert save["gathered"]["held_bytes_per_rank"] == [full, 0]
    tensors = 4 * out["n_param_tensors"]  # parameter, exp_avg, exp_avg_sq, step
    assert save["dcp"]["tensors_per_rank"] == [tensors, tensors]
    assert save["gathered"]["tensors_per_rank"] == [tensors, 0]
    assert [f["name"] for f in save["gathered"]["files"]] == ["full_state.pt"]


@pytest.mark.slow
def test_the_script_alone_resumes_what_two_processes_saved(two) -> None:
    """The script itself, under plain python: it reshards the 2 ranks' checkpoint
    (and accumulates the gradients of 2 micro-batches, which changes only the
    rounding)."""
    _, ckpt = two
    args = ["--steps", "2", "--load", ckpt, "--microbatches", "2"]
    out = launch(NAME, args, nproc=None, timeout=90)
    assert out["device"] == "cpu" and out["backend"] == "gloo"
    assert_losses_match(out, 3, 2)


@pytest.mark.parametrize("case", ["missing", "interrupted", "no meta.json", "not ours"])
def test_a_missing_checkpoint_is_one_sentence(
    case, tmp_path, monkeypatch, capsys
) -> None:
    folder = tmp_path / "ckpt"
    if case == "interrupted":  # a save stopped between its two renames
        (tmp_path / "ckpt.old").mkdir()
        (tmp_path / "ckpt.old" / "meta.json").write_text("{}")
    elif case != "missing":
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"half a save")
    if case == "not ours":
        (folder / "meta.json").write_text('{"step": 3}')
    args = ["--load", str(folder)]
    err = refusal(lambda: fsdp_gpt.parse_args(args), monkeypatch, capsys, 4, NAME)
    expected = {
        "missing": f"there is no checkpoint directory {folder}; give a directory "
        "that this script wrote with --save.",
        "interrupted": f"there is no checkpoint directory {folder}, but ckpt.old "
        "holds the one before an interrupted save; rename it to ckpt.",
        "no meta.json": f"{folder} holds no meta.json, so it is not a complete "
        "checkpoint of this script (an interrupted save leaves ckpt.tmp); give a "
        "directory that this script wrote with --save.",
        "not ours": f"{folder / 'meta.json'} is not this script's; give a directory "
        "that this script wrote with --save.",
    }[case]
    assert err == f"{NAME}: error: {expected}\n"


@pytest.mark.slow  # its fixture trains 2 processes (20 s); the other refusals stay fast
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, here
def test_a_checkpoints_sizes_cannot_change(two, monkeypatch, capsys) -> None:
    _, ckpt = two
    args = ["--load", str(ckpt), "--n-embd", "32"]
    err = refusal(lambda: fsdp_gpt.parse_args(args), monkeypatch, capsys, 2, NAME)
    assert err == (
        f"{NAME}: error: --n-embd 32 differs from the checkpoint's 64; leave it out.\n"
    )
    # The check compares with one plain run from step 0: no other settings either.
    args = ["--load", str(ckpt), "--lr", "0.01"]
    err = refusal(fsdp_memory.main, monkeypatch, capsys, 2, "fsdp_memory.py", args)
    assert err == (
        "fsdp_memory.py: error: --lr differs from the checkpoint's; leave it out.\n"
    )


@pytest.mark.parametrize(
    "args, world_size, expected",
    [
        (
            ["--batch-size", "8"],
            3,
            "--batch-size 8 does not split evenly over 3 processes; use a multiple of 3.",
        ),
        (
            ["--seq-len", "65"],
            1,
            "--seq-len 65 must be 1 to --block-size, under 856.",
        ),
        (["--n-head", "3"], 1, "--n-embd 64 is not a multiple of --n-head 3."),
        (
            ["--microbatches", "3"],
            2,
            (
                "--batch-size 8 does not split into 3 equal micro-batches on each "
                "of 2 processes; use a multiple of 6."
            ),
        ),
        (["--microbatches", "0"], 1, "--microbatches must be at least 1, not 0."),
        (
            ["--replicate", "3"],
            4,
            "--replicate 3 does not divide the 4 processes into equal replicas; "
            "give a divisor of the process count.",
        ),
        (["--replicate", "0"], 2, "--replicate must be at least 1, not 0."),
    ],
)
def test_bad_input_is_one_sentence(
    args, world_size, expected, monkeypatch, capsys
) -> None:
    err = refusal(
        lambda: fsdp_gpt.parse_args(args), monkeypatch, capsys, world_size, NAME
    )
    assert err == f"{NAME}: error: {expected}\n"


def test_a_damaged_checkpoint_is_one_sentence(tmp_path, monkeypatch, capsys) -> None:
    """meta.json is fine, DCP's .metadata is not: DCP fails (and would log a
    traceback); the script says it in one sentence, in this process."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    settings = dict(zip(fsdp_gpt.SETTINGS, [2, 4, 64, 64, "float64", 8, 64, 3e-3, 0]))
    meta = {"step": 2, "world_size": 2, "settings": settings}
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / ".metadata").write_bytes(b"not a pickle")
    monkeypatch.setattr("sys.argv", [NAME])
    args = fsdp_gpt.parse_args(["--load", str(folder)])
    capsys.readouterr()
    with one_process_group():
        model = fsdp_gpt.build_model(fsdp_gpt.model_config(args), 0, "float64", "cpu")
        fsdp_gpt.shard_model(model, init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        with pytest.raises(SystemExit) as stopped:
            fsdp_gpt.load_checkpoint(model, optimizer, folder)
    assert stopped.value.code == 2
    out = capsys.readouterr()
    assert out.err == damaged(folder) + "\n"
    assert "Traceback" not in out.out + out.err


@pytest.mark.slow
def test_one_two_and_four_processes_train_alike_with_either_resharding() -> None:
    runs = {
        "1": launch(CHECK, ["--steps", "4"], nproc=None, timeout=90),
        "4": launch(CHECK, ["--steps", "4"], nproc=4, timeout=150),
    }
    for out in runs.values():
        assert_measurements_match(out)
    # At 4 processes the vocabulary's rows do not split evenly: padding shows.
    measured = runs["4"]["memory"]["measured"]
    assert len({m["parameters"]["local"] for m in measured}) > 1
    assert measured[-1]["parameters"]["storage"] > measured[-1]["parameters"]["local"]
    off = launch(
        NAME,
        ["--steps", "4", "--reshard-after-forward", "off", *FLOAT64],
        nproc=2,
        timeout=120,
    )
    assert_losses_match(off, 0, 4)


@pytest.mark.slow
def test_hsdp_on_four_processes_meets_its_formulas_and_resumes_as_fsdp(
    tmp_path,
) -> None:
    """2 replicas of 2 shards: the check's formulas and losses, each replica's
    ranks holding FSDP-over-2's bytes, and a checkpoint that plain FSDP on 2
    resumes."""
    ckpt = tmp_path / "ckpt"
    out = launch(
        CHECK,
        ["--steps", "3", "--replicate", "2", "--save", ckpt],
        nproc=4,
        timeout=150,
    )
    assert out["replicate"] == 2 and all(out["checks"].values()), out["checks"]
    assert_losses_match(out, 0, 3)
    # Each replica holds the model as 2 processes of FSDP would.
    measured = out["memory"]["measured"]
    assert measured == [expected_state(out["config"], 2, r % 2) for r in range(4)]
    collectives, _ = expected_communication(out["config"], 2, "on")
    reduced = collectives["reduce-scatter"]["output_bytes"]
    assert out["communication"]["on"]["per_step"][0] == collectives | {
        "all-reduce": {"calls": 3, "input_bytes": reduced, "output_bytes": reduced}
    }
    resumed = launch(NAME, ["--steps", "2", "--load", ckpt], nproc=2, timeout=120)
    assert_losses_match(resumed, 3, 2)


@pytest.mark.slow
def test_four_processes_save_and_two_resume_as_if_never_stopped(
    tmp_path, capsys
) -> None:
    ckpt = tmp_path / "ckpt"
    saved = launch(
        NAME, ["--steps", "3", "--save", ckpt, *FLOAT64], nproc=4, timeout=150
    )
    assert_losses_match(saved, 0, 3)
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(4)
    ]
    # Load and save again into the same directory: the new one replaces it whole.
    resumed = launch(
        CHECK, ["--steps", "3", "--load", ckpt, "--save", ckpt], nproc=2, timeout=150
    )
    assert resumed["checkpoint"]["load"]["saved_by_world_size"] == 4
    assert_measurements_match(resumed)
    assert json.loads((ckpt / "meta.json").read_text())["step"] == 6
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp, no .old

    # A shard cut short: every rank fails inside DCP, each says it in one sentence.
    shard = ckpt / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    with pytest.raises(LaunchError, match="exit code"):  # torchrun's own: 1
        launch(NAME, ["--load", ckpt], nproc=2, timeout=120)
    errors = [line for line in capsys.readouterr().out.splitlines() if "error:" in line]
    assert errors and set(errors) == {damaged(ckpt)}, errors


@pytest.mark.slow
def test_a_missed_tolerance_exits_with_code_3(capsys) -> None:
    """float32 cannot meet float64's tolerance: the check can fail. (torchrun
    itself exits with 1 when a process fails; rank 0's sentence says why.)"""
    with pytest.raises(LaunchError, match="exit code"):
        launch(
            CHECK,
            ["--steps", "2", "--dtype", "float32", "--tolerance", "1e-12"],
            nproc=2,
            timeout=120,
        )
    errors = [line for line in capsys.readouterr().out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "beyond --tolerance 1e-12" in errors[0], errors
    assert errors[0].startswith("fsdp_memory.py: error: the losses ended ")


@pytest.mark.slow
def test_the_check_runs_on_two_simulated_gpus(tmp_path) -> None:
    """Every tensor of the check and the script on its GPU, every collective on nccl.

    (Loading is left out: the simulation refuses DCP's own ``torch.load`` of
    non-tensor items, which it cannot tell from a reader's.)"""
    args = ["--steps", "2", "--save", tmp_path / "ckpt"]
    out = on_simulated_gpus("checks/fsdp_memory.py", args, nproc=2, timeout=170)
    assert (out["device"], out["backend"]) == ("cuda", "nccl")
    assert out["checks"] == CHECKS
    assert len(out["cuda_peak_bytes_per_rank"]) == 2  # 0 each: a simulated GPU
