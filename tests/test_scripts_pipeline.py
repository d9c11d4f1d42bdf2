"""Chapter 13's pipeline script, and its check, launched on gloo processes.

Every expected number is computed here, independently of the script and of
``companion/checks/pipeline.py``:

- the losses: the course's plain GPT trained in this process on the same
  batches, in float64 (every schedule and micro-batch count must give them
  to 1e-10);
- the idle fraction of a step with equal stages, (p - 1) / (m + p - 1), and
  (p - 1) / (2 m + p - 1) with two stages per process, from its definition:
  slots of work over slots of the schedule;
- the micro-batches each stage holds: all m with GPipe; with 1F1B, stage s of
  p at most p - s, counted by replaying the schedule's order of passes here.

``make test`` launches the check on 2 processes and the script alone with
plain python; the 4-process and interleaved runs are marked slow (chapter 13
runs both with verdicts). Bad input is refused in this process.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from gpt_scripts import (
    FLOAT64,
    on_simulated_gpus,
    reference_losses,
    refusal,
)

from companion.checks import pipeline as check
from companion.gpt import GPT, CharText, GPTConfig
from companion.harness.launch import launch
from companion.parallel_costs import bubble_fraction, replay_schedule, timeline_bubble
from companion.scripts import pipeline_gpt

pytestmark = pytest.mark.timeout(180)

NAME, CHECK = "pipeline_gpt.py", "checks/pipeline.py"
TOL = 1e-10


def plain_losses(steps: int) -> list[float]:
    """The plain model of 4 blocks on the whole batch of 32 x 64."""
    return reference_losses(steps, batch_size=32, n_layer=4)


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


def test_the_stages_chain_to_companion_gpt() -> None:
    """gpt_model's GPT, cut into stages and run one after another, is the plain
    model bit for bit."""
    text = CharText()
    config = GPTConfig(vocab_size=text.vocab_size, block_size=32, n_layer=4)
    torch.manual_seed(1)
    ours = GPT(config)
    torch.manual_seed(1)
    theirs = pipeline_gpt.GPT(pipeline_gpt.GPTConfig(text.vocab_size, 32, 4))
    x, _ = text.batch(3, 32, torch.Generator().manual_seed(2))
    for cuts in ([0, 4], [0, 2, 4], [0, 1, 2, 3, 4]):
        pairs = itertools.pairwise(cuts)
        stages = [pipeline_gpt.GPTStage(theirs, a, b) for a, b in pairs]
        h = x
        for stage in stages:
            h = stage(h)
        assert torch.equal(h, ours(x))
        owned = [q for stage in stages for q in stage.parameters()]
        assert len(owned) == len(list(theirs.parameters()))


@pytest.mark.parametrize("p, m", [(1, 4), (2, 1), (2, 8), (4, 8), (4, 2)])
def test_the_formulas(p, m) -> None:
    for v in pipeline_gpt.STAGES_PER_PROCESS.values():
        assert bubble_fraction(p, m, v) == pytest.approx(idle_fraction(p, m, v))
    assert pipeline_gpt.STAGES_PER_PROCESS["interleaved"] == 2
    assert check.in_flight_formula("gpipe", p, m) == [m] * p
    assert check.in_flight_formula("1f1b", p, m) == one_f_one_b_in_flight(p, m)


@pytest.mark.parametrize(
    "p, m, expected",
    # Counted from torch's own action lists (ScheduleInterleaved1F1B's
    # pipeline_order) on torch 2.10 and 2.14: stage passes in flight.
    [
        (2, 2, [4, 3]),
        (2, 4, [5, 3]),
        (2, 8, [5, 3]),
        (4, 4, [8, 8, 7, 5]),
        (4, 8, [11, 9, 7, 5]),
    ],
)
def test_the_interleaved_formula(p, m, expected) -> None:
    assert check.in_flight_formula("interleaved", p, m) == expected


@pytest.mark.parametrize("p", [2, 4])
def test_the_zero_bubble_formulas(p) -> None:
    """Counted from the check's timelines (2 and 4 processes; ZB1P on torch
    2.10 and 2.14, the V-shaped ones on 2.13 and 2.14): stage passes in
    flight, the same on every process."""
    assert check.in_flight_formula("zb1p", p, p) == [2 * p] * p
    assert check.in_flight_formula("zb1p", p, 4 * p) == [2 * p] * p
    assert check.in_flight_formula("zbv", p, 2 * p) == [2 * p] * p
    assert check.in_flight_formula("dualpipev", p, 4 * p) == [2 * p + 1] * p
    assert [pipeline_gpt.stage_ids("zbv", r, p) for r in range(p)] == [
        [r, 2 * p - 1 - r] for r in range(p)
    ]
    assert pipeline_gpt.stage_ids("interleaved", 1, p) == [1, 1 + p]
    assert pipeline_gpt.stage_ids("zb1p", 1, p) == [1, 1 + p]


def torch_order(schedule: str, p: int, m: int) -> list[list[list]]:
    """The passes torch's zero-bubble schedule gives each of p processes, as
    the check records them (one unit of time each, an overlapped pair in
    turn), computed by the schedule's own planner without starting any
    process."""
    from torch.distributed.pipelining import schedules

    cls = pipeline_gpt.SCHEDULES[schedule]
    plan = cls.__new__(cls)  # the planners need only these numbers
    plan.pp_group_size, plan._n_microbatches, plan.num_stages = p, m, 2 * p
    plan.n_local_stages = 2
    plan.microbatches_per_round = p  # ZB1P's, with m a multiple of p
    kind = {
        schedules.F: "F",
        schedules.B: "B",
        schedules.I: "I",
        schedules.W: "W",
    }
    events = []
    for rank in range(p):
        passes = []
        for action in filter(None, plan._calculate_single_rank_operations(rank)):
            for part in action.sub_actions or [action]:
                t = float(len(passes))
                passes.append(
                    [
                        kind[part.computation_type],
                        part.stage_index,
                        part.microbatch_index,
                        t,
                        t + 1,
                    ]
                )
        events.append(passes)
    return events


@pytest.mark.parametrize("schedule", sorted(pipeline_gpt.ZERO_BUBBLE))
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_torchs_own_zero_bubble_orders_meet_the_formulas(schedule, p) -> None:
    """Chapter 13's formulas at more processes than it runs: torch's plans,
    replayed with equal passes, idle (p - 1)/(6m + p - 1) of the step, and hold
    2p (ZB1P, ZBV) or 2p + 1 (DualPipeV) stage passes on every process."""
    for m in (p, 2 * p, 4 * p) if schedule == "zb1p" else (2 * p, 4 * p):
        events = torch_order(schedule, p, m)
        assert timeline_bubble(replay_schedule(events)) == pytest.approx(
            (p - 1) / (6 * m + p - 1), abs=1e-12
        )
        held = [check.most_in_flight(passes) for passes in events]
        assert held == check.in_flight_formula(schedule, p, m)


@pytest.mark.parametrize("w", [1.0, 2.0, 3.0])
def test_longer_weight_passes_idle_zb1p_no_more_but_zbv_more(w) -> None:
    """Chapter 13's exercise: with F = I = 1, ZB1P's plan idles p - 1 passes
    per process however long W is; ZBV's, planned for equal passes, idles
    more once W is longer than F at 4 processes (not at 2)."""
    for p in (2, 4):
        for schedule in ("zb1p", "zbv"):
            replay = replay_schedule(torch_order(schedule, p, 4 * p), weight_grad=w)
            busy = [sum(e[4] - e[3] for e in passes) for passes in replay["events"]]
            idle = {replay["makespan"] - b for b in busy}
            longer = schedule == "zbv" and p == 4 and w > 1
            assert (min(idle) > p - 1) if longer else (idle == {p - 1})


def test_a_split_backward_pass_releases_at_its_weight_pass() -> None:
    events = [  # in the order they ran: F 0, F 1, I 0, F 2, W 0, I 1, W 1, I 2, W 2
        ["F", 0, 0, 0.0, 0.1],
        ["F", 0, 1, 0.1, 0.2],
        ["I", 0, 0, 0.2, 0.3],
        ["F", 0, 2, 0.3, 0.4],  # three held: the input pass released nothing
        ["W", 0, 0, 0.4, 0.5],
        ["I", 0, 1, 0.5, 0.6],
        ["W", 0, 1, 0.6, 0.7],
        ["I", 0, 2, 0.7, 0.8],
        ["W", 0, 2, 0.8, 0.9],
    ]
    assert check.most_in_flight(events) == 3


def test_in_flight_follows_the_order_the_passes_ended() -> None:
    events = [  # kind, stage, micro-batch, start, end: listed out of order
        ["B", 0, 0, 0.5, 0.6],
        ["F", 0, 0, 0.0, 0.1],
        ["F", 0, 1, 0.1, 0.2],
        ["F", 0, 2, 0.6, 0.7],
        ["B", 0, 1, 0.7, 0.8],
        ["B", 0, 2, 0.8, 0.9],
    ]
    assert check.most_in_flight(events) == 2


@pytest.fixture(scope="module")
def two() -> dict:
    args = ["--microbatches", "2,4", "--steps", "2"]
    return launch(CHECK, args, nproc=2, timeout=150)


@pytest.mark.slow
def test_two_stages_train_as_one_process_with_either_schedule(two) -> None:
    """One test for the one launch of the check in make test."""
    reference = plain_losses(2)
    assert two["device"] == "cpu" and two["backend"] == "gloo"
    assert two["reference_losses"] == pytest.approx(reference, abs=TOL, rel=0)
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
def test_the_script_alone_trains_as_the_plain_model() -> None:
    args = ["--steps", "2", "--microbatches", "2", "--batch-size", "8", *FLOAT64]
    out = launch(NAME, args, nproc=None, timeout=90)
    assert out["device"] == "cpu" and out["backend"] == "gloo"
    reference = reference_losses(2, batch_size=8, n_layer=4)
    assert out["losses"] == pytest.approx(reference, abs=TOL, rel=0)


@pytest.mark.slow
def test_four_stages_hold_what_each_schedule_promises() -> None:
    run = launch(CHECK, ["--microbatches", "8", "--steps", "2"], nproc=4)
    reference = plain_losses(2)
    gpipe, one_f = run["runs"]
    assert gpipe["in_flight"] == [8, 8, 8, 8]
    assert one_f["in_flight"] == [4, 3, 2, 1]
    for r in run["runs"]:
        assert r["losses"] == pytest.approx(reference, abs=TOL, rel=0)


@pytest.mark.slow
def test_the_interleaved_schedule_trains_as_one_process() -> None:
    args = ["--schedules", "interleaved", "--microbatches", "2,4", "--steps", "2"]
    run = launch(CHECK, args, nproc=2)
    reference = plain_losses(2)
    for r in run["runs"]:
        assert r["losses"] == pytest.approx(reference, abs=TOL, rel=0)
        assert r["bubble_formula"] == pytest.approx(
            idle_fraction(2, r["microbatches"], 2)
        )
        stages = {e[1] for passes in r["timeline"]["events"] for e in passes}
        assert stages == {0, 1, 2, 3}
        assert r["in_flight"] == r["in_flight_formula"]
        assert r["microbatch_saved_bytes"] == [None, None]
    assert all(run["checks"].values()) and len(run["checks"]) == 4
    args = [
        "--schedule",
        "interleaved",
        "--microbatches",
        "4",
        "--steps",
        "2",
        *FLOAT64,
    ]
    script = launch(NAME, args, nproc=2)
    assert script["losses"] == pytest.approx(reference, abs=TOL, rel=0)


@pytest.mark.parametrize("schedule", sorted(pipeline_gpt.V_SHAPED))
def test_the_v_shaped_schedules_are_refused_before_torch_2_13(
    schedule, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(pipeline_gpt.torch, "__version__", "2.12.1+cpu")
    args = ["--schedule", schedule, "--microbatches", "4"]
    err = refusal(lambda: pipeline_gpt.parse_args(args), monkeypatch, capsys, 2, NAME)
    assert err.startswith(
        f"{NAME}: error: the {schedule} schedule runs here on torch 2.13 or newer, "
        "not 2.12.1+cpu: torch 2.10 fails"
    )


@pytest.mark.slow
def test_the_zero_bubble_schedules_train_as_one_process() -> None:
    """ZB1P, ZBV and DualPipeV (backward passes split into input and weight
    passes; the V-shaped two where torch is 2.13 or newer, the test above
    checks the refusal elsewhere): the plain model's losses, every pass of
    every micro-batch on every stage, and the activations of the formula."""
    schedules = ["zb1p"]
    if pipeline_gpt.torch_version() >= (2, 13):
        schedules += sorted(pipeline_gpt.V_SHAPED)
    args = ["--schedules", ",".join(schedules), "--microbatches", "4", "--steps", "2"]
    run = launch(CHECK, args, nproc=2)
    reference = plain_losses(2)
    for r in run["runs"]:
        assert r["losses"] == pytest.approx(reference, abs=TOL, rel=0)
        events = r["timeline"]["events"]
        for rank, passes in enumerate(events):
            assert {e[1] for e in passes} == set(
                pipeline_gpt.stage_ids(r["schedule"], rank, 2)
            )
            forwards = sorted((e[1], e[2]) for e in passes if e[0] == "F")
            inputs = sorted((e[1], e[2]) for e in passes if e[0] in "BI")
            weights = sorted((e[1], e[2]) for e in passes if e[0] in "BW")
            assert forwards == inputs == weights  # each pass once per micro-batch
            assert len(forwards) == 2 * 4
        assert any(e[0] == "W" for passes in events for e in passes)
        assert r["in_flight"] == r["in_flight_formula"]
    assert all(run["checks"].values()) and len(run["checks"]) == 2 * len(schedules)
    script = launch(NAME, ["--schedule", "zb1p", *args[2:], *FLOAT64], nproc=2)
    assert script["losses"] == pytest.approx(reference, abs=TOL, rel=0)


def test_a_missed_loss_is_one_sentence() -> None:
    run = {
        "schedule": "gpipe",
        "microbatches": 2,
        "losses": [3.0, 2.5],
        "in_flight": [2, 2],
        "in_flight_formula": [2, 2],
        "peak_saved_bytes": [200, 200],
        "microbatch_saved_bytes": [100, 100],
    }
    checks, failure = check.judge([run], [3.0, 2.4], 1e-10)
    assert checks == {
        "gpipe, m = 2: losses": False,
        "gpipe, m = 2: micro-batches in flight": True,
    }
    assert failure.startswith(
        "gpipe, m = 2: the losses differ from the plain model's by 1.0e-01"
    )


def test_a_miscount_in_flight_is_one_sentence() -> None:
    run = {
        "schedule": "1f1b",
        "microbatches": 4,
        "losses": [3.0],
        "in_flight": [2, 1],
        "in_flight_formula": [2, 1],
        "peak_saved_bytes": [300, 100],
        "microbatch_saved_bytes": [100, 100],
    }
    checks, failure = check.judge([run], [3.0], 1e-10)
    assert checks == {
        "1f1b, m = 4: losses": True,
        "1f1b, m = 4: micro-batches in flight": False,
    }
    assert (
        "held [2, 1] micro-batches (3.00, 1.00 by their bytes), not [2, 1]" in failure
    )


def test_interleaved_counts_are_judged_without_bytes() -> None:
    run = {
        "schedule": "interleaved",
        "microbatches": 4,
        "losses": [3.0],
        "in_flight": [5, 2],
        "in_flight_formula": [5, 3],
        "peak_saved_bytes": [500, 300],
        "microbatch_saved_bytes": [None, None],
    }
    checks, failure = check.judge([run], [3.0], 1e-10)
    assert checks["interleaved, m = 4: micro-batches in flight"] is False
    assert failure == (
        "interleaved, m = 4: the processes held [5, 2] micro-batches, not [5, 3] as "
        "the schedule's formula says."
    )


@pytest.mark.parametrize(
    "args, world_size, expected",
    [
        (
            ["--n-layer", "3"],
            2,
            (
                "--n-layer 3 does not split into 2 equal stages (1f1b on 2 processes); "
                "use a multiple of 2."
            ),
        ),
        (
            ["--schedule", "interleaved"],
            4,
            (
                "--n-layer 4 does not split into 8 equal stages (interleaved on 4 "
                "processes); use a multiple of 8."
            ),
        ),
        (
            ["--microbatches", "1"],
            2,
            (
                "the 1f1b schedule needs a multiple of 2 micro-batches (at least one per "
                "process), not 1."
            ),
        ),
        (
            ["--schedule", "interleaved", "--microbatches", "3", "--batch-size", "36"],
            2,
            (
                "the interleaved schedule needs a multiple of 2 micro-batches (at least "
                "one per process), not 3."
            ),
        ),
        (
            ["--schedule", "gpipe", "--microbatches", "3"],
            1,
            (
                "--batch-size 32 does not split into 3 equal micro-batches; use a "
                "multiple of --microbatches."
            ),
        ),
        (["--n-head", "3"], 1, "--n-embd 64 is not a multiple of --n-head 3."),
        (
            ["--schedule", "zb1p", "--microbatches", "6", "--batch-size", "36"]
            + ["--n-layer", "8"],
            4,
            (
                "the zb1p schedule needs a multiple of 4 micro-batches (at least "
                "one per process), not 6."
            ),
        ),
        (
            ["--schedule", "zbv", "--microbatches", "2"],
            2,
            "the zbv schedule needs at least 4 micro-batches (one per stage), not 2.",
        ),
    ],
)
def test_bad_input_is_one_sentence(
    args, world_size, expected, monkeypatch, capsys
) -> None:
    err = refusal(
        lambda: pipeline_gpt.parse_args(args), monkeypatch, capsys, world_size, NAME
    )
    assert err == f"{NAME}: error: {expected}\n"


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, here
@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--schedules", "zb"],
            "--schedules takes gpipe, 1f1b, interleaved, zb1p, zbv, dualpipev, not "
            "'zb'.",
        ),
        (
            ["--microbatches", "two"],
            "--microbatches takes whole numbers such as 2,4,8, not 'two'.",
        ),
        (
            ["--microbatches", "2,3"],
            (
                "--batch-size 32 does not split into 3 equal micro-batches; use a "
                "multiple of --microbatches."
            ),
        ),
    ],
)
def test_the_checks_bad_input_is_one_sentence(args, expected, monkeypatch, capsys):
    """The check refuses every setting the script would refuse, before the processes meet."""
    err = refusal(check.main, monkeypatch, capsys, 1, "pipeline.py", args)
    assert err == f"pipeline.py: error: {expected}\n"


@pytest.mark.slow
def test_the_check_runs_on_two_simulated_gpus() -> None:
    """Every tensor of the check and the script on its GPU, every collective on nccl."""
    args = ["--steps", "2", "--microbatches", "2", "--schedules", "gpipe,interleaved"]
    out = on_simulated_gpus("checks/pipeline.py", args, nproc=2, timeout=170)
    assert (out["device"], out["backend"]) == ("cuda", "nccl")
    assert all(out["checks"].values())
