"""Play one process of a cluster job for every case of a plan: fake GPUs, a launcher's environment.

Usage: ``python fake_cluster.py PLAN.json RANK_IN_PLAN OUT.json``. For each case of the
plan (a script, its arguments, the environment its launcher would set for
this process, the GPUs this process sees, its host name) it sets that
environment, fakes ``torch.cuda`` (device count, each GPU's uuid) and the host
name, runs the script with ``runpy`` as ``__main__``, and records what the
script decided instead of letting it start training:

- ``init_process_group`` is replaced: it records the backend, ``device_id``
  and the rendezvous address the script chose, waits until every process of
  the case got there, and ends the script;
- ``sys.exit`` is wrapped: it records the exit code and the exception being
  handled (the script's ``UsageError``), so the test sees the sentence every
  rank reached, not only the one rank 0 printed;
- ``dist.rendezvous`` records the address the script chose, then connects to
  127.0.0.1 (a host name such as ``node1`` from a fake node list does not
  resolve here).

One process runs every case in turn (torch is imported once); the processes
of a case meet at its rendezvous, so they stay in step.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import time
import types

import torch
import torch.distributed as dist

LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
)

plan_file, me, out_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
plan = json.loads(open(plan_file).read())
real_exit, real_rendezvous, real_hostname = (
    sys.exit,
    dist.rendezvous,
    __import__("socket").gethostname,
)
record: dict = {}


class Done(BaseException):
    """Raised by the fake init_process_group: the decision is made, stop the script."""


def fake_rendezvous(url, *args, **kwargs):
    record["master"] = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    return real_rendezvous(url, *args, **kwargs)


def fake_init(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    device_id=None,
    **kwargs,
):
    record.update(
        backend=backend,
        device_id=None if device_id is None else str(device_id),
        rank=rank,
        world_size=world_size,
    )
    if store is not None:  # leave together: rank 0 may host the store
        store.add("fake/arrived", 1)
        while store.add("fake/arrived", 0) < world_size:
            time.sleep(0.01)
        store.add("fake/left", 1)
        while rank == 0 and store.add("fake/left", 0) < world_size:
            time.sleep(0.01)
    raise Done


def fake_exit(code=0):
    handled = sys.exc_info()[1]
    record["exit_code"] = code
    if handled is not None and not isinstance(handled, SystemExit):
        record["error"] = str(handled)
    real_exit(code)


results = []
for case in plan:
    process = case["processes"][me]
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        del os.environ[name]
    os.environ.update(process["env"])
    uuids = process["gpus"]
    torch.cuda.is_available = lambda uuids=uuids: bool(uuids)
    torch.cuda.device_count = lambda uuids=uuids: len(uuids)
    torch.cuda.get_device_properties = lambda i, uuids=uuids: types.SimpleNamespace(
        uuid=uuids[i], name="fake"
    )
    torch.cuda.set_device = lambda device: record.update(set_device=str(device))
    dist.is_nccl_available = lambda: True
    dist.init_process_group = fake_init
    dist.rendezvous = fake_rendezvous
    sys.modules["socket"].gethostname = lambda host=process["host"]: host
    sys.exit = fake_exit
    record = {"case": case["name"], "script": case["script"]}
    stderr, stdout = io.StringIO(), io.StringIO()
    sys.argv = [case["script"], *case["args"]]
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            runpy.run_path(case["script"], run_name="__main__")
            record["exit_code"] = 0
        except Done:
            pass
        except SystemExit as exc:
            record.setdefault("exit_code", exc.code)
    sys.exit = real_exit
    record.update(stderr=stderr.getvalue(), stdout=stdout.getvalue())
    if os.environ.get("FAKE_CLUSTER_DEBUG"):
        print(
            me,
            case["name"],
            case["script"],
            record.get("backend"),
            record.get("exit_code"),
            file=sys.__stderr__,
            flush=True,
        )
    results.append(record)

sys.modules["socket"].gethostname = real_hostname
with open(out_file, "w") as f:
    json.dump(results, f)
