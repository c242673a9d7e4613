"""Run a check in 2 gloo processes on CPU (the DDP and FSDP tests): ``run(check)`` spawns the
processes, each joins the group and calls ``check(rank, world)``; the outcome of every rank is
reported to the parent, which asserts that both passed (a failure's message names its rank's
exception). ``check`` must be picklable: a module-level function or a ``functools.partial``
of one."""
import os
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, results, check):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # (a rank that skips a collective fails the test in a minute instead of gloo's 30)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        check(rank, world)
        results[rank] = "ok"
    except Exception as e:  # reported to the parent
        results[rank] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def run(check, world=2):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, _free_port(), results, check), nprocs=world, join=True)
        assert dict(results) == {r: "ok" for r in range(world)}, dict(results)
