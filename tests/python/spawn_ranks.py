"""Spawning a test's ranks: processes (torch.multiprocessing, spawn) that meet through a TCPStore
on 127.0.0.1. A job that outlives its time limit is a failure, never waited out."""
import datetime
import random
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_ranks(entry, name, world, job_timeout_s, extra=(), store_timeout_s=60, poll_s=2,
                note=""):
    """Runs entry(rank, world, port, seed, *extra) in `world` processes, with a fresh seed
    (printed); fails on any rank's exception or when the job outlives job_timeout_s."""
    server = dist.TCPStore("127.0.0.1", 0, None, True,
                           datetime.timedelta(seconds=store_timeout_s), wait_for_workers=False)
    seed = random.randrange(1 << 31)
    print(f"{name}: world {world}, seed {seed}{note}")
    ctx = mp.start_processes(entry, args=(world, server.port, seed, *extra), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + job_timeout_s
    try:
        while not ctx.join(timeout=poll_s):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: ranks still running after {job_timeout_s} s "
                                     f"(seed {seed})")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
