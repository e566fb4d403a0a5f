"""The rank's torch.distributed set-up: environment, store, process group, device (rank side).

A forked rank gets the variables torchrun would set. Rank 0 binds the rendezvous store itself
on port 0 of the loopback address (TCPStore alone would listen on every interface) and says
the port in its `hello`; every rank joins the group under the prefix of its generation, so a
restart never meets an old group's keys. A rank started by torchrun joins with env:// as a
script would. `pick_device` is the one place a rank's device is decided.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
from typing import Any

from labkit.wire.config import RankConfig


def set_torchrun_environment(cfg: RankConfig) -> None:
    """The variables torchrun sets, for a rank forked by labkit on this machine."""
    os.environ.update(
        {
            "RANK": str(cfg.rank),
            "WORLD_SIZE": str(cfg.world_size),
            "LOCAL_RANK": str(cfg.local_rank),
            "LOCAL_WORLD_SIZE": str(cfg.local_world_size),
            "MASTER_ADDR": cfg.master_addr,
            "GROUP_RANK": "0",
            "ROLE_RANK": str(cfg.rank),
        }
    )
    # one machine: gloo and NCCL listen on loopback only, unless the user chose
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def bind_store(cfg: RankConfig) -> tuple[Any, int]:
    """Rank 0's TCPStore on a free port of `master_addr`: (store, port)."""
    import torch.distributed as dist

    listener = socket.create_server((cfg.master_addr, 0), backlog=128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        cfg.master_addr,
        port,
        cfg.world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=cfg.pg_timeout),
        master_listen_fd=listener.detach(),
    )
    return store, port


def join(cfg: RankConfig, store: Any, port: int | None) -> Any:
    """Form the default process group; returns the store the rank keeps (None if attached)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=cfg.pg_timeout)
    if cfg.attached:  # torchrun formed the rendezvous: join it as a script would
        dist.init_process_group(
            cfg.backend, rank=cfg.rank, world_size=cfg.world_size, timeout=timeout
        )
        return store
    os.environ["MASTER_PORT"] = str(port)
    if store is None:
        store = dist.TCPStore(
            cfg.master_addr, port, cfg.world_size, is_master=False, timeout=timeout
        )
    dist.init_process_group(
        cfg.backend,
        store=dist.PrefixStore(f"labkit/{cfg.gen}", store),
        rank=cfg.rank,
        world_size=cfg.world_size,
        timeout=timeout,
    )
    return store


def pick_device(cfg: RankConfig, torch: Any) -> Any:
    """The rank's device: `cuda:(local_rank % GPUs)` for a CUDA lab, else the CPU."""
    if cfg.device == "cuda":
        index = cfg.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def reuse_store_in_init(dist: Any, rank: Any) -> None:
    """Let a cell call `dist.init_process_group(...)` as a torchrun script does.

    MASTER_PORT belongs to rank 0's store, which labkit keeps open, so env:// would fail to
    bind it. A call without `store` or `init_method` joins that store under a fresh prefix
    instead (every rank counts its calls the same way); a destroyed group can be re-created.
    """
    real = dist.init_process_group
    calls = [0]

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("store") is None and kwargs.get("init_method") in (None, "env://"):
            if len(args) < 2 and rank.store is not None:
                calls[0] += 1
                kwargs.pop("init_method", None)
                kwargs["store"] = dist.PrefixStore(f"labkit/{rank.gen}/user{calls[0]}", rank.store)
                kwargs.setdefault("rank", rank.rank)
                kwargs.setdefault("world_size", rank.cfg.world_size)
        return real(*args, **kwargs)

    dist.init_process_group = init_process_group
