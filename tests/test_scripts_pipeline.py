"""Launch chapter 13's pipeline script for real, with 2 and 4 gloo processes.

Every expected number is computed here, independently of the script's own
formulas and checks:

- the losses: the course's plain GPT (``companion.gpt``) trained in this
  process on the same batches, in float64 (every schedule and micro-batch
  count must give them to 1e-10);
- the idle fraction of a step with equal stages, (p - 1) / (m + p - 1), and
  (p - 1) / (2 m + p - 1) with two stages per process, from its definition:
  slots of work over slots of the schedule;
- the micro-batches each stage holds: all m with GPipe; with 1F1B, stage s of
  p at most p - s, counted by replaying the schedule's order of passes here.

``make test`` runs one 2-process launch; the 4-process and interleaved runs
are marked slow (chapter 13 runs both with verdicts in ``make test``). Bad
input runs ``main()`` in this process: it is refused before the processes
would meet.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict

import pytest
import torch
from gpt_scripts import check_model_copy, load_script, run_in_process

from companion.gpt import GPT, CharText, GPTConfig, lm_loss
from companion.launch import launch

pytestmark = pytest.mark.timeout(180)

NAME = "pipeline_gpt.py"
TOL = 1e-10


@pytest.fixture(scope="module")
def script():
    return load_script(NAME)


def plain_losses(steps: int, n_layer: int = 4, batch: int = 32) -> list[float]:
    """The plain model in one process on the whole batch of ``batch`` x 64, float64, Adam."""
    text = CharText()
    config = GPTConfig(vocab_size=text.vocab_size, block_size=64, n_layer=n_layer)
    torch.manual_seed(0)
    model = GPT(config).to(torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    batches = [text.batch(batch, 64, g) for _ in range(steps)]
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def one_f_one_b_in_flight(p: int, m: int) -> list[int]:
    """Replay 1F1B on each stage: p - s - 1 warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards; count the most
    micro-batches held."""
    most = []
    for s in range(p):
        warmup = min(m, p - s - 1)
        order = ["F"] * warmup
        forwards, backwards = warmup, 0
        while backwards < m:
            if forwards < m:
                order.append("F")
                forwards += 1
            order.append("B")
            backwards += 1
        held = peak = 0
        for kind in order:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        most.append(peak)
    return most


def idle_fraction(p: int, m: int, v: int = 1) -> float:
    """Slots of a fill-drain schedule: v m of work per process, p - 1 more to fill and drain."""
    work, total = v * m, v * m + p - 1
    return (total - work) / total


def test_the_scripts_model_is_companion_gpt(script) -> None:
    check_model_copy(script)


def test_the_stages_chain_to_companion_gpt(script) -> None:
    """The copied model, cut into stages and run one after another, is the plain model bit for bit."""
    text = CharText()
    config = GPTConfig(vocab_size=text.vocab_size, block_size=32, n_layer=4)
    torch.manual_seed(1)
    ours = GPT(config)
    torch.manual_seed(1)
    theirs = script.GPT(script.GPTConfig(**asdict(config)))
    x, _ = text.batch(3, 32, torch.Generator().manual_seed(2))
    for cuts in ([0, 4], [0, 2, 4], [0, 1, 2, 3, 4]):
        stages = [script.GPTStage(theirs, a, b) for a, b in itertools.pairwise(cuts)]
        h = x
        for stage in stages:
            h = stage(h)
        assert torch.equal(h, ours(x))
        owned = [q for stage in stages for q in stage.parameters()]
        assert len(owned) == len(list(theirs.parameters()))


@pytest.mark.parametrize("p, m", [(1, 4), (2, 1), (2, 8), (4, 8), (4, 2)])
def test_the_formulas(script, p, m) -> None:
    assert script.bubble_formula("gpipe", p, m) == pytest.approx(idle_fraction(p, m))
    assert script.bubble_formula("1f1b", p, m) == pytest.approx(idle_fraction(p, m))
    assert script.bubble_formula("interleaved", p, m) == pytest.approx(
        idle_fraction(p, m, v=2)
    )
    assert script.in_flight_formula("gpipe", p, m) == [m] * p
    assert script.in_flight_formula("1f1b", p, m) == one_f_one_b_in_flight(p, m)
    assert script.in_flight_formula("interleaved", p, m) is None


def test_in_flight_follows_the_order_the_passes_ended(script) -> None:
    events = [  # kind, stage, micro-batch, start, end: listed out of order
        ["B", 0, 0, 0.5, 0.6],
        ["F", 0, 0, 0.0, 0.1],
        ["F", 0, 1, 0.1, 0.2],
        ["F", 0, 2, 0.6, 0.7],
        ["B", 0, 1, 0.7, 0.8],
        ["B", 0, 2, 0.8, 0.9],
    ]
    assert script.most_in_flight(events) == 2


def test_live_saved_counts_each_storage_until_backward_frees_it(script) -> None:
    layer = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)
    with script.LiveSaved(layer.parameters()) as saved:
        h = layer(x)
        y = torch.tanh(h)  # saves its output, 8 x 16 float32
        z = (y * y).sum()  # saves y once, though twice as an argument
        assert saved.live == 8 * 16 * 4 * 2  # x for the weight's gradient, and y
        z.backward()
    assert saved.peak == 8 * 16 * 4 * 2
    assert saved.live == 0 and not saved.storages


@pytest.fixture(scope="module")
def two() -> dict:
    args = ["--microbatches", "2,4", "--steps", "2", "--check"]
    return launch(NAME, args, nproc=2, timeout=150)


def test_two_stages_train_as_one_process_with_either_schedule(two) -> None:
    """One test for the one launch in make test."""
    reference = plain_losses(2)
    runs = {(r["schedule"], r["microbatches"]): r for r in two["runs"]}
    assert set(runs) == {("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)}
    for (schedule, m), run in runs.items():
        assert run["losses"] == pytest.approx(reference, abs=TOL, rel=0)
        expected = [m, m] if schedule == "gpipe" else one_f_one_b_in_flight(2, m)
        assert run["in_flight"] == expected
        assert all(
            peak == pytest.approx(n * one, rel=0.05)
            for peak, n, one in zip(
                run["peak_saved_bytes"], expected, run["microbatch_saved_bytes"]
            )
        )
        assert run["bubble_formula"] == pytest.approx(idle_fraction(2, m))
        assert 0 <= run["bubble"] < 1
        events = run["timeline"]["events"]
        for stage, passes in enumerate(events):  # every pass of every micro-batch once
            assert sorted((e[0], e[1], e[2]) for e in passes) == sorted(
                (kind, stage, i) for kind in "FB" for i in range(m)
            )
    assert all(two["checks"].values()) and len(two["checks"]) == 8


@pytest.mark.slow
def test_four_stages_hold_what_each_schedule_promises() -> None:
    run = launch(NAME, ["--microbatches", "8", "--steps", "2", "--check"], nproc=4)
    reference = plain_losses(2)
    gpipe, one_f = run["runs"]
    assert gpipe["in_flight"] == [8, 8, 8, 8]
    assert one_f["in_flight"] == [4, 3, 2, 1]
    for r in run["runs"]:
        assert r["losses"] == pytest.approx(reference, abs=TOL, rel=0)


@pytest.mark.slow
def test_the_interleaved_schedule_trains_as_one_process() -> None:
    args = ["--schedules", "interleaved", "--microbatches", "2,4", "--steps", "2"]
    run = launch(NAME, [*args, "--check"], nproc=2)
    reference = plain_losses(2)
    for r in run["runs"]:
        assert r["losses"] == pytest.approx(reference, abs=TOL, rel=0)
        assert r["bubble_formula"] == pytest.approx(
            idle_fraction(2, r["microbatches"], 2)
        )
        stages = {e[1] for passes in r["timeline"]["events"] for e in passes}
        assert stages == {0, 1, 2, 3}


def test_a_missed_loss_is_one_sentence(script) -> None:
    run = {
        "schedule": "gpipe",
        "microbatches": 2,
        "losses": [3.0, 2.5],
        "in_flight": [2, 2],
        "in_flight_formula": [2, 2],
        "peak_saved_bytes": [200, 200],
        "microbatch_saved_bytes": [100, 100],
    }
    checks, failure = script.judge([run], [3.0, 2.4], 1e-10)
    assert checks == {
        "gpipe, m = 2: losses": False,
        "gpipe, m = 2: micro-batches in flight": True,
    }
    assert failure.startswith(
        "gpipe, m = 2: the losses differ from the plain model's by 1.0e-01"
    )


def test_a_miscount_in_flight_is_one_sentence(script) -> None:
    run = {
        "schedule": "1f1b",
        "microbatches": 4,
        "losses": [3.0],
        "in_flight": [2, 1],
        "in_flight_formula": [2, 1],
        "peak_saved_bytes": [300, 100],
        "microbatch_saved_bytes": [100, 100],
    }
    checks, failure = script.judge([run], None, 1e-10)
    assert checks == {"1f1b, m = 4: micro-batches in flight": False}
    assert (
        "held [2, 1] micro-batches (3.00, 1.00 by their bytes), not [2, 1]" in failure
    )


@pytest.mark.parametrize(
    "args, world_size, expected",
    [
        (
            ["--n-layer", "3"],
            2,
            (
                "--n-layer 3 does not split into 2 equal stages (gpipe on 2 processes); "
                "use a multiple of 2."
            ),
        ),
        (
            ["--schedules", "interleaved"],
            4,
            (
                "--n-layer 4 does not split into 8 equal stages (interleaved on 4 "
                "processes); use a multiple of 8."
            ),
        ),
        (
            ["--microbatches", "1,2"],
            2,
            "the 1f1b schedule needs at least 2 micro-batches (one per process), not 1.",
        ),
        (
            [
                "--schedules",
                "interleaved",
                "--microbatches",
                "2,3",
                "--batch-size",
                "36",
            ],
            2,
            (
                "the interleaved schedule needs a multiple of 2 micro-batches (one per "
                "process), not 3."
            ),
        ),
        (
            ["--microbatches", "3"],
            1,
            (
                "--batch-size 32 does not split into 3 equal micro-batches; use a "
                "multiple of every micro-batch count."
            ),
        ),
        (
            ["--schedules", "zb"],
            1,
            "--schedules takes gpipe, 1f1b, interleaved, not 'zb'.",
        ),
        (
            ["--microbatches", "two"],
            1,
            "--microbatches takes whole numbers such as 1,2,4,8, not 'two'.",
        ),
        (["--n-head", "3"], 1, "n_embd (64) must be a multiple of n_head (3)."),
    ],
)
def test_bad_input_is_one_sentence(
    args, world_size, expected, script, monkeypatch, capsys
) -> None:
    code, err = run_in_process(script, monkeypatch, capsys, args, world_size)
    assert (code, err) == (2, f"{NAME}: error: {expected}\n")
