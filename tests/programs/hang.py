"""A script that never finishes: it records its pid (and its parent's), then sleeps.

Used by tests/test_launch.py to check that time-outs and interrupts leave no
process behind. ``--fail`` makes it exit with an error instead.
"""

import argparse
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--pid-dir", required=True)  # folder for one file per process
parser.add_argument("--fail", action="store_true")  # print a line and exit 3
parser.add_argument("--results", default="")  # appended by companion.harness.launch
args = parser.parse_args()

if args.fail:
    print("hang.py: something went wrong on purpose", flush=True)
    raise SystemExit(3)
Path(args.pid_dir, f"{os.getpid()}").write_text(str(os.getppid()))
print(f"rank {os.environ.get('RANK', '0')} waiting", flush=True)
while True:
    time.sleep(1)
