"""Time one training step of an ensemble: module loop, functional loop, eager and compiled vmap.

Chapter 10's speed table, as a script to re-check on a quiet machine:

    python benchmarks/ensemble_speed.py                      # 8, 32, 128 models, SGD, 1 thread
    python benchmarks/ensemble_speed.py --optimizer adam --threads 2
    python benchmarks/ensemble_speed.py --models 32 128 --min-run-time 2

It prints the table (median time per step, speed-ups over the loop of
``nn.Module``s with ``torch.optim`` optimizers, compile time apart) and, for
every count of at least ``--target-from`` models, the verdict on whether the
compiled step beat that loop by ``--target`` times beyond the timing noise.
The exit status is 0 either way: the numbers are the result. Used in chapter 10.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from companion.ensemble import (
    SGD,
    Adam,
    benchmark_ensemble,
    format_speed_table,
    speed_verdicts,
)
from companion.harness.devices import try_gpu


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", type=int, nargs="+", default=[8, 32, 128]
    )  # ensemble sizes
    parser.add_argument(
        "--optimizer", choices=["sgd", "adam"], default="sgd"
    )  # optimiser
    parser.add_argument(
        "--threads", type=int, default=1
    )  # intra-op threads (compile and timing)
    parser.add_argument(
        "--min-run-time", type=float, default=1.0
    )  # seconds of timing per entry
    parser.add_argument("--mode", default=None)  # torch.compile mode; None = "default"
    parser.add_argument(
        "--target", type=float, default=5.0
    )  # wanted speed-up over the module loop
    parser.add_argument(
        "--target-from", type=int, default=32
    )  # check it from this many models
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if min(args.models) < 1 or args.threads < 1 or args.min_run_time <= 0:
        sys.exit(
            "--models and --threads need positive numbers, --min-run-time a positive time."
        )
    # torch.compile logs "No CUDA runtime is found" on CPU-only machines.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    optimizer = SGD() if args.optimizer == "sgd" else Adam()
    device = try_gpu()
    rows = benchmark_ensemble(
        args.models,
        optimizer=optimizer,
        min_run_time=args.min_run_time,
        compile_mode=args.mode,
        device=device,
    )
    print(format_speed_table(rows))
    for verdict in speed_verdicts(
        rows, target=args.target, from_models=args.target_from
    ):
        print(verdict)


if __name__ == "__main__":
    main()
