"""Chapter 16's measurements, heavy: this machine's roofline, collective fits, bucket sweep.

    python benchmarks/how_fast.py                         # all three, 2 and 4 processes
    python benchmarks/how_fast.py --only roofline
    python benchmarks/how_fast.py --processes 8 --max-bytes 1e9 --caps 1 5 25 100
    python benchmarks/how_fast.py --only ddp --compile --backend inductor

It prints, for the machine it runs on (its GPU when there is one):

1. the roofline: square products per dtype (float32, bfloat16, and TF32 on
   a GPU), copy and triad on ``--stream-mib`` buffers (at least twice the
   caches' total), the balance point;
2. the alpha-beta fit of every collective of
   ``companion/scripts/collective_bench.py`` for every group size from 2 to
   ``--processes``, with the held-out predictions (every other size is
   fitted, the others predicted);
3. DDP's bucket sweep on the course GPT (``companion/checks/cost_of_talking.py``):
   per ``bucket_cap_mb``, the buckets, the predicted cost of communication
   (the fit, the measured backward pass and the measured contention) and the
   measured one, and the predicted best size; with ``--compile``, the
   compiled variants too.

The chapter runs a reduced version of each (one launch of the check).
The exit status is 0 either way: the numbers are the result. Used in chapter 16.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from companion import gpus_for, launch
from companion.comm_costs import (
    assign_buckets,
    ddp_bucket_caps,
    fit_collectives,
    measured_contention,
    overlap_schedule,
)
from companion.hardware import UNKNOWN, bf16_matmul_support, cache_bytes
from companion.harness.devices import num_gpus, try_gpu
from companion.harness.timing import (
    format_ratio,
    format_table,
    format_time,
    paired_difference,
)
from companion.roofline import measure_roofline


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--only", choices=["roofline", "collectives", "ddp"])  # one part only
    add("--processes", type=int, default=4)  # the largest group of the collectives
    add("--max-bytes", type=float, default=2**28)  # largest message (256 MiB)
    add("--stream-mib", type=int, default=512)  # copy and triad buffers (MiB)
    add("--caps", type=float, nargs="+", default=[0.05, 0.25, 1, 4, 16, 100])  # MiB
    add("--n-layer", type=int, default=8)  # GPT blocks of the bucket sweep
    add("--n-embd", type=int, default=512)  # their width
    add("--compile", action="store_true")  # also the compiled DDP variants
    add("--backend", default="aot_eager")  # torch.compile's backend, with --compile
    return parser.parse_args()


def roofline_part() -> None:
    device = try_gpu()
    dtypes = (
        ("float32", "tf32", "bfloat16")
        if device.type == "cuda"
        else ("float32", "bfloat16")
    )
    # Without bfloat16 units a CPU converts every element, tens of times slower
    # than float32: a smaller bfloat16 product keeps its timing to seconds.
    slow_bf16 = device.type != "cuda" and bf16_matmul_support() in (None, UNKNOWN)
    sizes = {
        d: 16384
        if device.type == "cuda"
        else 512
        if d == "bfloat16" and slow_bf16
        else 2048
        for d in dtypes
    }
    # Buffers of at least twice the caches' total, so that memory serves them.
    mib = max(ARGS.stream_mib, 2 * (cache_bytes(device) or 0) // 2**20)
    roof, _ = measure_roofline(
        device=device,
        dtypes=dtypes,
        sizes=sizes,
        stream_bytes=mib * 2**20,
        min_run_time=1.0,
    )
    rows = [
        {
            "ceiling": f"{d} product, {sizes[d]} x {sizes[d]}",
            "rate": f"{roof.peaks[d] / 1e9:.4g} GFLOP/s",
        }
        for d in dtypes
    ]
    rows += [
        {"ceiling": f"copy, {mib} MiB", "rate": f"{roof.copy / 1e9:.4g} GB/s"},
        {"ceiling": f"triad, {mib} MiB", "rate": f"{roof.triad / 1e9:.4g} GB/s"},
    ]
    print(format_table(rows, title="The roofline"))
    print(f"balance point (float32): {roof.balance():.3g} FLOP/byte")


def collectives_part() -> None:
    groups = [str(n) for n in range(2, ARGS.processes + 1)]
    bench = launch(
        "collective_bench.py",
        [
            "--groups",
            *groups,
            "--max-bytes",
            str(ARGS.max_bytes),
            "--step",
            "4",
            "--blocks",
            "7",
        ],
        nproc=ARGS.processes,
        gpus=gpus_for(ARGS.processes),
        timeout=3600,
    )
    measured = bench["measurements"]
    sizes = sorted({r["bytes"] for r in measured})
    fits = fit_collectives(measured, sizes[::2])
    rows = []
    for (kind, n), fit in fits.items():
        held = [
            r
            for r in measured
            if (r["kind"], r["processes"]) == (kind, n) and r["bytes"] not in sizes[::2]
        ]
        worst = max(
            max(q, 1 / q)
            for q in (fit.predict(r["bytes"]) / r["seconds"] for r in held)
        )
        rows.append(
            {
                "collective": kind,
                "n": n,
                "alpha": format_time(fit.latency),
                "bus bandwidth": f"{fit.bus_bandwidth / 1e9:.3g} GB/s",
                "worst held-out prediction": format_ratio(worst),
            }
        )
    print(
        format_table(
            rows, title=f"Alpha-beta fits, {bench['backend']}", threads=bench["threads"]
        )
    )


def ddp_part() -> None:
    args = [
        "--caps",
        *map(str, ARGS.caps),
        "--n-layer",
        str(ARGS.n_layer),
        "--n-embd",
        str(ARGS.n_embd),
        "--rounds",
        "21",
        "--backend",
        ARGS.backend,
        "--max-bytes",
        "4096",
    ]
    talk = launch(
        "checks/cost_of_talking.py",
        args + (["--compile"] if ARGS.compile else []),
        nproc=2,
        gpus=gpus_for(2),
        timeout=3600,
    )
    ddp = talk["ddp"]
    plain, steps = ddp["plain"], ddp["step"]
    order = plain["ready_order"]
    grads = [plain["bytes"][i] for i in order]
    ready = [plain["ready"][i] for i in order]
    fit = fit_collectives(ddp["all_reduce"])["all_reduce", ddp["world_size"]]
    alone = steps["no communication"]["rounds"]  # subtracted round by round
    contention, _ = measured_contention(steps)
    kappa = min(1.0, max(0.0, contention))
    rows, predicted = [], {}
    for name, cap in ddp["caps"].items():
        buckets = assign_buckets(grads, ddp_bucket_caps(cap))
        plan = overlap_schedule(ready, grads, buckets, fit.predict, plain["backward"])
        predicted[name] = plan.cost(kappa)
        rows.append(
            {
                "bucket_cap_mb": name,
                "buckets": len(buckets),
                "predicted": format_time(predicted[name]),
                "measured": "{} ± {}".format(
                    *map(format_time, paired_difference(steps[name]["rounds"], alone))
                ),
            }
        )
    print(
        format_table(
            rows,
            title=f"DDP's communication per step (contention {contention:.2f})",
            threads=ddp["threads"],
        )
    )
    print(f"predicted best bucket_cap_mb: {min(predicted, key=predicted.get)}")
    if ARGS.compile:
        comp = ddp["compiled"]
        for name, t in comp["exposed"].items():
            print(
                f"{name}: step {format_time(comp['step'][name]['median'])}, "
                f"{t['collectives']} collectives, exposed {format_time(t['exposed'])}"
            )


def main() -> None:
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    print(f"{num_gpus()} GPU(s); torch {torch.__version__}")
    parts = {
        "roofline": roofline_part,
        "collectives": collectives_part,
        "ddp": ddp_part,
    }
    for name, part in parts.items():
        if ARGS.only in (None, name):
            part()


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.processes < 2 or ARGS.max_bytes < 64 or ARGS.stream_mib < 1:
        sys.exit(
            "--processes must be at least 2, --max-bytes 64 or more, --stream-mib positive."
        )
    main()
