"""Write the arguments and a few environment variables it got to ``--results`` (no torch: starts fast).

Used by tests/test_launch.py. Without ``--results`` it writes nothing; with
``--skip-results`` it ignores the file it was given; with ``--miss`` it writes
its results and then exits with code 3, as a check does whose measurement
missed its formula.
"""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--results", default="")
parser.add_argument("--skip-results", action="store_true")
parser.add_argument("--miss", action="store_true")
args, rest = parser.parse_known_args()
print(f"echo_env: {len(rest)} extra argument(s)", flush=True)
if args.results and not args.skip_results:
    names = (
        "OMP_NUM_THREADS",
        "PYTHONUNBUFFERED",
        "COURSE_TEST_VALUE",
        "CUDA_VISIBLE_DEVICES",
    )
    with open(args.results, "w") as f:
        json.dump({"argv": rest, "env": {n: os.environ.get(n) for n in names}}, f)
if args.miss:
    print("echo_env: error: a measurement missed its formula", flush=True)
    raise SystemExit(3)
