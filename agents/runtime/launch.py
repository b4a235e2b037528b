"""Start one process per rank and a ``torch.distributed`` group among them.

:func:`spawn` runs ``fn(rank, world, *args)`` in ``world`` fresh processes (spawn start
method), each already in a process group: NCCL with one GPU per rank when ``backend`` is
``nccl``, gloo on the CPU otherwise. Ranks hand results back as JSON files in a folder the
caller names, which :func:`spawn` collects in rank order.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RankFn = Callable[..., Any]


def free_port() -> int:
    """A TCP port on the loopback interface that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    backend: str,
    port: int,
    out_dir: str,
    timeout_s: float,
    fn: RankFn,
    args: tuple[Any, ...],
) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


def spawn(
    fn: RankFn,
    world: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return each rank's JSON-ready
    result in rank order.

    ``fn`` must be importable (a module-level function) and its arguments picklable.

    Raises:
        RuntimeError: a rank failed (the child's traceback is in the message).
    """
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(
            f"{world} ranks need {world} GPUs; this host has {torch.cuda.device_count()}"
        )
    with tempfile.TemporaryDirectory(prefix="mixfleet-rt-") as out_dir:
        port = free_port()
        mp.start_processes(
            _entry,
            args=(world, backend, port, out_dir, timeout_s, fn, args),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json"), encoding="utf-8") as fh:
                results.append(json.load(fh))
        return results
