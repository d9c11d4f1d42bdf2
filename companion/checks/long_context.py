"""Chapter 14's two checks in one set of processes: the sequence, then the experts.

    torchrun --standalone --nproc-per-node=4 companion/checks/long_context.py

Runs the checks of ``context_parallel.py`` (ring attention, the all-gather
and Ulysses against one process) and of ``expert_parallel.py`` (experts
against one process), each with its default arguments, one after the other
in the same processes: on a small machine, starting 4 processes costs more
than either check. Each check also runs alone. Rank 0 writes both results
(``--results FILE``) as ``{"context": ..., "experts": ...}``. Exit codes: 0
every count meets its formula; 3 one missed, said in one sentence; 2 bad
input; 1 crashed.
"""

from __future__ import annotations

import argparse

from torch.distributed.elastic.multiprocessing.errors import record

from companion.checks import context_parallel, expert_parallel
from companion.checks._shared import finish


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--timeout", type=float, default=300, help="seconds to wait for other ranks")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    timeout = ["--timeout", str(args.timeout)]
    _, _, device = context_parallel.ra.setup_distributed(args.timeout)
    context, missed = context_parallel.run(context_parallel.parse_args(timeout), device)
    experts, missed_too = expert_parallel.run(
        expert_parallel.parse_args(timeout), device
    )
    both = {"context": context, "experts": experts} if context else None
    finish(both, missed or missed_too, args.results)


if __name__ == "__main__":
    main()
