"""Chapter 17's sweep, full size: every layout predicted from this machine, then run.

    python benchmarks/layouts.py                       # 17 layouts on 4 processes
    python benchmarks/layouts.py --steps 20 --n-embd 256
    python benchmarks/layouts.py --processes 8 --n-head 8 --n-layer 8 --batch-size 32

It launches ``companion/checks/layouts.py`` with ``--layouts full`` (the
chapter's twelve, and more micro-batch counts and recomputation; those the
sizes cannot split are left out, named), with twice the chapter's timed
steps by default, prints each layout's predicted and measured step and
memory, and the comparison the chapter judges: the rank correlation of the
two orders, the model's shortlist of three and how much slower the best of
it ran than the fastest measured, the memory ratios. The exit status is 0
either way: the numbers are the result. Used in chapter 17.
"""

from __future__ import annotations

import argparse
import sys

from companion import gpus_for, launch
from companion.harness.timing import format_ratio, format_table, format_time
from companion.parallel_costs import compare_layouts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--processes", type=int, default=4)  # 4 or more, even
    add("--steps", type=int, default=10)  # timed steps per layout
    add("--n-layer", type=int, default=4)
    add("--n-head", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--batch-size", type=int, default=16)
    add("--seq-len", type=int, default=64)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.processes < 4 or args.processes % 2:
        sys.exit("--processes must be an even number, at least 4.")
    flags = ["--layouts", "full", "--steps", str(args.steps)]
    for flag in ("n_layer", "n_head", "n_embd", "batch_size", "seq_len"):
        flags += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    measured = launch(
        "checks/layouts.py",
        flags,
        nproc=args.processes,
        gpus=gpus_for(args.processes),
        timeout=3600,
    )
    runs = measured["runs"]
    rows = [
        {
            "layout": name,
            "predicted step": format_time(run["predicted"]["step"]["total"]),
            "measured step": format_time(run["seconds"]),
            "ratio": format_ratio(run["seconds"] / run["predicted"]["step"]["total"]),
            "predicted MiB": f"{run['predicted']['memory']['total'] / 2**20:.2f}",
            "measured MiB": f"{max(run['peak_bytes']) / 2**20:.2f}",
        }
        for name, run in sorted(runs.items(), key=lambda item: item[1]["seconds"])
    ]
    print(format_table(rows, title=f"{len(runs)} layouts, fastest measured first"))
    verdict = compare_layouts(runs, best=3)
    ratios = verdict["memory_ratio"].values()
    print(
        f"rank correlation {verdict['spearman']:.2f} (p-value "
        f"{verdict['p_value']:.1g}); the model's three best: "
        f"{'; '.join(verdict['shortlist'])}, the best of them "
        f"{verdict['shortlist_over_fastest']:.2f}x the fastest measured "
        f"({'; '.join(verdict['measured_best'])}); measured memory over "
        f"predicted from {min(ratios):.2f} to {max(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
