"""pipeline_gpt.py's schedules: their bubbles and the activations each stage holds.

    launch("checks/pipeline.py", ["--schedules", "gpipe,1f1b", "--microbatches",
           "2,4,8"], nproc=2)
    torchrun --standalone --nproc-per-node=4 companion/checks/pipeline.py

For each schedule of ``--schedules`` and each count of ``--microbatches`` it
builds pipeline_gpt.py's stages and schedule and trains ``--steps`` steps with
the script's own ``train_step`` (its other flags too; ``--dtype`` float64
unless given), from the same initial
model on the same batches, and measures:

- the timeline: when each stage starts and ends the forward and the backward
  pass of each micro-batch, from a barrier at the start of the step, on the
  device's own timeline (``companion.checks._shared.DeviceClock``: CUDA events on a
  GPU, read after the step, so that timing every pass adds no
  synchronisation; the host clock on a CPU). The bubble of a step is the share of
  the step, from its common start to the last stage's end, that a process
  spends outside those passes (waiting, sending, receiving), averaged over
  the processes, against (p - 1) / (v m + p - 1), v the stages per process
  (``companion.parallel_costs.bubble_fraction``); for the zero-bubble
  schedules, against their own order of passes replayed with equal forward,
  input-gradient and weight-gradient passes (``replay_schedule``). The first step exchanges
  shapes and is not timed; the bubble reported is the median of the others;
- the micro-batches in flight on each process (forward done, backward or,
  where it is split into an input-gradient pass I and a weight-gradient pass
  W, its W not yet), read from the timeline, against the schedule's formula:
  all m for GPipe, p - r on process r for 1F1B, (v - 1) p + 2 (p - 1 - r) + 1
  stage passes for the interleaved schedule, 2p for ZB1P and ZBV and 2p + 1
  for DualPipeV on every process (``in_flight_formula``);
- the activations each process keeps for backward
  (``companion.memory.SavedTensors``, live from a save until backward frees
  it): their peak over a step; with one stage per process also divided by
  one micro-batch's (a forward pass of the stage counted alone), which must
  give the count above;
- the losses, against the plain model's (``companion.gpt.plain_losses``).

Writes rank 0's results (``--results FILE``) for chapter 13. Exit codes: 0
every check holds; 3 a loss or a count missed, said in one sentence; 2 bad
input; 1 crashed. The timings are reported, not checked: they depend on the
machine (more processes than cores stretch the busy stages). The counts of
micro-batches and bytes were verified on torch 2.10 and 2.14.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from companion.checks._shared import (
    DeviceClock,
    clock,
    every_rank,
    finish,
    print0,
    tolerance,
)
from companion.gpt import GPTConfig, plain_losses
from companion.memory import SavedTensors
from companion.parallel_costs import bubble_fraction, replay_schedule, timeline_bubble
from companion.scripts import pipeline_gpt


def in_flight_formula(schedule: str, p: int, m: int) -> list[int]:
    """Micro-batches whose activations each of the p processes holds at most.

    GPipe: all m. 1F1B: p - r on process r (its warm-up forward passes and
    one more). Interleaved, counted per stage pass (a micro-batch in each of
    the process's v stages counts v times): the warm-up of torch's (and
    Megatron-LM's) schedule, (v - 1) p + 2 (p - 1 - r), and one more, at
    most v m. The zero-bubble schedules, per stage pass: 2p on every process
    for ZB1P (m a multiple of p; its warm-up is (v - 1) p + p - 1 - r forward
    passes, and process r delays its weight passes by r more) and for ZBV
    (m >= 2p), the activations of 1F1B's first process on every process;
    2p + 1 for DualPipeV (m >= 2p; measured on torch 2.13 and 2.14, 2 and 4
    processes; DeepSeek's DualPipe README gives PP + 1 for PP stages). A
    split backward pass releases a micro-batch when its weight pass ends.
    """
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(m, p - r) for r in range(p)]
    if schedule in ("zb1p", "zbv"):  # every process alike, as 1F1B's first
        return [2 * p] * p
    if schedule == "dualpipev":  # one more (its overlapped F and B)
        return [2 * p + 1] * p
    v = pipeline_gpt.STAGES_PER_PROCESS[schedule]
    return [min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)]


def most_in_flight(events: list[list]) -> int:
    """The most micro-batches forwarded and not yet backwarded, in the order the
    passes ended: a whole backward pass ("B") releases one, and so does a
    weight pass ("W"), which needs what the forward pass saved until it ends."""
    held = most = 0
    for kind, *_ in sorted(events, key=lambda e: e[4]):
        held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        most = max(most, held)
    return most


class Recorder:
    """The forward ("F") and backward ("B") passes of one process's stages in a step.

    Each pass is marked where it starts and ends on the device's timeline
    (``DeviceClock``: no synchronisation inside the step on a GPU); ``events``
    reads the marks as seconds since the step began, after the step.
    """

    def __init__(self, device: torch.device) -> None:
        self.clock = DeviceClock(device)
        self.start()

    def start(self) -> None:
        """A new step: forget the passes, mark its start."""
        self.marks: list[list] = []  # [kind, stage, micro-batch, start, end]
        self.t0 = self.clock.mark()

    def mark(self) -> Any:
        """A mark now (the step's end, say), for ``seconds``."""
        return self.clock.mark()

    def seconds(self, mark: Any) -> float:
        """Seconds from the step's start to ``mark``."""
        return self.clock.seconds(self.t0, mark)

    def events(self) -> list[list]:
        """The step's passes: [kind, stage, micro-batch, start, end], in seconds."""
        return [[*m[:3], self.seconds(m[3]), self.seconds(m[4])] for m in self.marks]

    def watch(self, stage: Any) -> None:
        """Record each pass ``stage`` runs (it wraps the stage's own methods): a
        backward pass is "B" when whole, "I" when it computes only the input's
        gradient (``full_backward=False``), whose weight gradient "W" follows."""
        passes = (
            ("F", "forward_one_chunk"),
            ("B", "backward_one_chunk"),
            ("W", "backward_weight_one_chunk"),
        )
        for kind, name in passes:
            setattr(stage, name, self._timed(stage, kind, getattr(stage, name)))

    def _timed(self, stage: Any, kind: str, run: Any) -> Any:
        def timed(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = self.mark()
            out = run(chunk, *args, **kwargs)
            split = kind == "B" and not kwargs.get("full_backward", True)
            mark = ["I" if split else kind, stage.stage_index, chunk, start]
            self.marks.append([*mark, self.mark()])
            return out

        return timed


def run_setting(schedule: str, m: int, args: argparse.Namespace, batches, device):
    """Train ``args.steps`` steps with one schedule and micro-batch count; this
    rank's losses, step ends, busy seconds, timeline and saved bytes."""
    config = pipeline_gpt.model_config(args)
    model = pipeline_gpt.build_model(config, args.seed, args.dtype, device)
    pipeline = pipeline_gpt.build_pipeline(model, schedule, m, device)
    modules = pipeline.modules
    params = [q for module in modules for q in module.parameters()]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    kept = [t for module in modules for t in (*module.parameters(), *module.buffers())]
    recorder = Recorder(device)
    for stage in pipeline.stages:
        recorder.watch(stage)
    record: dict[str, Any] = {"losses": [], "ends": [], "busy": [], "peaks": []}
    step = pipeline.schedule.step

    def measured_step(*step_args: Any, **kwargs: Any) -> Any:
        with SavedTensors(exclude=kept) as saved:
            out = step(*step_args, **kwargs)
        record["ends"].append(recorder.mark())  # read as seconds after the step
        record["peaks"].append(saved.peak)
        return out

    pipeline.schedule.step = measured_step
    for x, y in batches:
        dist.barrier()  # every process starts the step's clock together
        recorder.start()
        loss = pipeline_gpt.train_step(pipeline, optimizer, x, y)
        events = recorder.events()
        record["ends"][-1] = recorder.seconds(record["ends"][-1])
        record["busy"].append(sum(e[4] - e[3] for e in events))
        record["losses"].append(pipeline_gpt.loss_from_last_stage(loss, device))
    record["events"] = events
    record["in_flight"] = most_in_flight(events)
    record["microbatch_bytes"] = None
    if len(modules) == 1:  # one micro-batch's saved bytes, counted alone
        x, y = (t.tensor_split(m)[0] for t in batches[0])
        if not modules[0].is_first:  # activations arrive instead of token ids
            shape = (*x.shape, config.n_embd)
            dtype = pipeline_gpt.DTYPES[args.dtype]
            x = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
        with SavedTensors(exclude=kept) as saved:
            out = modules[0](x)
            if modules[0].is_last:
                pipeline_gpt.lm_loss(out, y)
        record["microbatch_bytes"] = saved.peak
    return record


def summarize(schedule: str, m: int, records: list[dict]) -> dict:
    """One setting from every rank's record: losses, bubbles, in flight, bytes."""
    p, steps = len(records), range(len(records[0]["losses"]))
    makespans = [max(r["ends"][i] for r in records) for i in steps]
    work = [statistics.mean(r["busy"][i] for r in records) for i in steps]
    bubbles = [1 - w / span for w, span in zip(work, makespans)]
    timed = slice(1, None) if len(makespans) > 1 else slice(None)  # no warm-up
    return {
        "schedule": schedule,
        "microbatches": m,
        "losses": records[0]["losses"],
        "step_seconds": makespans,
        "bubbles": bubbles,
        "bubble": statistics.median(bubbles[timed]),
        "work_seconds": statistics.median(work[timed]),  # per process, per step
        # The zero-bubble schedules have no closed form here: their own order
        # of passes, replayed with equal forward, input and weight passes.
        "bubble_formula": (
            timeline_bubble(replay_schedule([r["events"] for r in records]))
            if schedule in pipeline_gpt.ZERO_BUBBLE
            else bubble_fraction(p, m, pipeline_gpt.STAGES_PER_PROCESS[schedule])
        ),
        "timeline": {
            "makespan": makespans[-1],
            "events": [r["events"] for r in records],
        },
        "in_flight": [r["in_flight"] for r in records],
        "in_flight_formula": in_flight_formula(schedule, p, m),
        # The warm-up step runs one more forward pass to exchange shapes.
        "peak_saved_bytes": [max(r["peaks"][timed]) for r in records],
        "microbatch_saved_bytes": [r["microbatch_bytes"] for r in records],
    }


def judge(runs: list[dict], reference: list[float], tol: float) -> tuple[dict, str]:
    """The checks, and the sentence for exit code 3 ("" if every check holds)."""
    checks: dict[str, bool] = {}
    failures = []
    for run in runs:
        name = f"{run['schedule']}, m = {run['microbatches']}"
        diff = max(abs(a - b) for a, b in zip(run["losses"], reference))
        run["loss_difference"] = diff
        checks[f"{name}: losses"] = diff <= tol
        if diff > tol:
            failures.append(
                f"{name}: the losses differ from the plain model's by {diff:.1e}, "
                f"more than --tolerance {tol:g}."
            )
        formula = run["in_flight_formula"]
        ok = run["in_flight"] == formula
        measured = []
        if None not in run["microbatch_saved_bytes"]:  # one stage per process
            measured = [
                peak / one
                for peak, one in zip(
                    run["peak_saved_bytes"], run["microbatch_saved_bytes"]
                )
            ]
            run["in_flight_from_bytes"] = measured
            ok = ok and all(abs(a - f) <= 0.05 * f for a, f in zip(measured, formula))
        checks[f"{name}: micro-batches in flight"] = ok
        if not ok:
            by_bytes = ", ".join(f"{a:.2f}" for a in measured)
            failures.append(
                f"{name}: the processes held {run['in_flight']} micro-batches"
                + (f" ({by_bytes} by their bytes)" if measured else "")
                + f", not {formula} as the schedule's formula says."
            )
    return checks, (failures or [""])[0]


@record
def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--schedules", default="gpipe,1f1b", help="(default: gpipe,1f1b)")
    own.add_argument("--microbatches", default="8", help="counts m (default: 8)")
    own.add_argument("--tolerance", type=float, help="of the losses (default: 1e-10)")
    mine, rest = own.parse_known_args()
    schedules = [s.strip() for s in mine.schedules.split(",")]
    if not set(schedules) <= set(pipeline_gpt.SCHEDULES):
        choices = ", ".join(pipeline_gpt.SCHEDULES)
        pipeline_gpt.fail(f"--schedules takes {choices}, not {mine.schedules!r}.")
    try:
        counts = [int(m) for m in mine.microbatches.split(",")]
    except ValueError:
        pipeline_gpt.fail(
            "--microbatches takes whole numbers such as 2,4,8, not "
            f"{mine.microbatches!r}."
        )
    settings = [(s, m) for s in schedules for m in counts]
    # The script's own checks of every setting, before the processes meet.
    for s, m in settings:
        args = pipeline_gpt.parse_args(
            ["--dtype", "float64", *rest, "--schedule", s, "--microbatches", str(m)]
        )
    rank, p, device = pipeline_gpt.setup_distributed(args.timeout)
    wall = clock()
    config = pipeline_gpt.model_config(args)
    print0(
        f"{p} stage{'s' if p > 1 else ''} on {device.type}: {config.n_layer} blocks of "
        f"width {config.n_embd} in {args.dtype}, global batch {args.batch_size} x "
        f"{args.seq_len}, {args.steps} steps per setting"
    )
    batches = pipeline_gpt.global_batches(args, device)
    runs, split = [], pipeline_gpt.ZERO_BUBBLE
    for schedule, m in settings:
        run = summarize(
            schedule, m, every_rank(run_setting(schedule, m, args, batches, device))
        )
        runs.append(run)
        flight = "/".join(map(str, run["in_flight"]))
        step = statistics.median(run["step_seconds"][1:] or run["step_seconds"])
        print0(  # ~: a measured fraction, which differs from run to run
            f"{schedule:<11} m = {m:<2}  step {step * 1e3:.1f} ms, bubble "
            f"~{run['bubble']:.2f} ({'replayed' if schedule in split else 'formula'} "
            f"{run['bubble_formula']:.2f}), "
            f"in flight per process {flight}"
        )
    results, failure = None, ""
    if rank == 0:
        reference = plain_losses(
            GPTConfig(**asdict(config)),
            batches,
            lr=args.lr,
            seed=args.seed,
            dtype=pipeline_gpt.DTYPES[args.dtype],
            device=device,
        )
        tol = tolerance(args.dtype, mine.tolerance)
        checks, failure = judge(runs, reference, tol)
        losses_ok = all(v for k, v in checks.items() if k.endswith("losses"))
        flight_ok = all(v for k, v in checks.items() if k.endswith("flight"))
        print0(
            f"checks: losses {'ok' if losses_ok else 'MISSED'} (largest difference "
            f"~{max(r['loss_difference'] for r in runs):.1e}), micro-batches in "
            f"flight {'ok' if flight_ok else 'MISSED'}"
        )
        results = {
            **pipeline_gpt.where_it_ran(device),
            "check": "pipeline.py",
            "torch": str(torch.__version__),
            "world_size": p,
            "config": asdict(config),
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "seed": args.seed,
            "runs": runs,
            "reference_losses": reference,
            "tolerance": tol,
            "checks": checks,
            "seconds": clock() - wall,
        }
    finish(results, failure, args.results)


if __name__ == "__main__":
    main()
