"""The rank's torch.distributed set-up: environment, store, process group, device (rank side).

A forked rank gets the variables torchrun would set. Rank 0 binds the rendezvous store itself
on port 0 of the loopback address (TCPStore alone would listen on every interface) and says
the port in its `hello`; every rank joins the group under the prefix of its generation, so a
restart never meets an old group's keys. A rank started by torchrun joins with env:// as a
script would. `pick_device` is the one place a rank's device is decided.

`accept_script_calls` lets code written for torchrun call `init_process_group` and
`destroy_process_group` in a cell or a script while the lab keeps its group for the next cell.
`rpc.init_rpc` needs nothing of its own: its env:// rendezvous joins rank 0's store (see
`set_torchrun_environment`), beside the lab's group, and `rpc.shutdown()` leaves that group up.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import socket
from typing import Any
from urllib.parse import parse_qs, urlparse

from labkit.rank import flight_recorder, torch_compat
from labkit.wire.config import RankConfig


def set_torchrun_environment(cfg: RankConfig) -> None:
    """The variables torchrun sets, for a rank forked by labkit on this machine (MASTER_PORT
    comes with the store's port, in `join`)."""
    os.environ.update(
        {
            "RANK": str(cfg.rank),
            "WORLD_SIZE": str(cfg.world_size),
            "LOCAL_RANK": str(cfg.local_rank),
            "LOCAL_WORLD_SIZE": str(cfg.local_world_size),
            "MASTER_ADDR": cfg.master_addr,
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "ROLE_RANK": str(cfg.rank),
            "ROLE_WORLD_SIZE": str(cfg.world_size),
            # a script that asks dist.is_torchelastic_launched() is told yes, as under torchrun
            "TORCHELASTIC_RUN_ID": "labkit",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            # MASTER_PORT is rank 0's store, which the lab keeps open as torchrun's agent keeps
            # its own: an env:// rendezvous in a cell (rpc.init_rpc makes one) joins it as a
            # client, as a torchrun worker does, instead of trying to bind the port again
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    # one machine: gloo, NCCL and RPC (TensorPipe) listen on loopback only, unless the user chose
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")


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

    flight_recorder.enable()  # torch records the group's collectives (lab.stacks shows them)
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


def accept_script_calls(dist: Any, rank: Any) -> None:
    """Let a cell or a script call `init_process_group` and `destroy_process_group` as a
    torchrun script does (rank side, once at start-up; every rank installs it).

    The user still calls the real functions; each is wrapped in place, in `torch.distributed`
    and in `distributed_c10d` (as the tracer's are), and the wrapper only decides what the call
    means in a lab whose default group is already up:

    - `init_process_group(...)` while a default group is up: that group is the one a torchrun
      script asks for, so a call that agrees with it (backend, world size and rank, read as
      torch reads them: the arguments, else the init_method URL, else RANK and WORLD_SIZE)
      returns at once; one that disagrees raises a ValueError naming the rank and what differs.
    - `init_process_group(...)` with no default group (destroyed for real, through
      `destroy_process_group.__wrapped__`): MASTER_PORT belongs to rank 0's store, which labkit
      keeps open, so env:// would fail to bind it; a call without `store` or `init_method` joins
      that store under a fresh prefix instead (every rank counts its calls the same way).
    - `destroy_process_group()` (no group, or the WORLD group) destroys every other group, as
      torch does, but keeps the default group for the next cell, so `dist.is_initialized()`
      stays True: the group is really there. `destroy_process_group(subgroup)` destroys it.

    Rank 0 prints a one-line note the first time each call is taken this way.
    """
    import torch.distributed.distributed_c10d as c10d

    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
    if hasattr(real_init, "__labkit_real__"):
        return
    signature = inspect.signature(real_init)
    calls = [0]
    noted: set[str] = set()

    def note(what: str, text: str) -> None:
        if rank.rank == 0 and what not in noted:
            noted.add(what)
            print(f"labkit: {text}", flush=True)

    @functools.wraps(real_init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if dist.is_initialized():
            bound = signature.bind(*args, **kwargs).arguments
            have = {
                "backend": dist.get_backend(),
                "world_size": dist.get_world_size(),
                "rank": dist.get_rank(),
            }
            differs = init_disagreement(bound, have, rank.cfg.device, os.environ)
            if differs:
                raise ValueError(
                    f"rank {rank.rank}: init_process_group({_call_text(bound)}) asks for another "
                    f"group than the lab's, which is already up ({have['backend']}, world size "
                    f"{have['world_size']}): {'; '.join(differs)}. Call it as the torchrun script "
                    "would (the lab set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or start "
                    "the lab you want: labkit.Lab(n, backend=...) or lab.restart(n)"
                )
            note(
                "init",
                f"init_process_group: the lab's process group ({have['backend']}, world size "
                f"{have['world_size']}) is already up; the call uses it",
            )
            return None
        if kwargs.get("store") is None and kwargs.get("init_method") in (None, "env://"):
            if len(args) < 2 and rank.store is not None:
                calls[0] += 1
                kwargs.pop("init_method", None)
                kwargs["store"] = dist.PrefixStore(f"labkit/{rank.gen}/user{calls[0]}", rank.store)
                kwargs.setdefault("rank", rank.rank)
                kwargs.setdefault("world_size", rank.cfg.world_size)
        return real_init(*args, **kwargs)

    @functools.wraps(real_destroy)
    def destroy_process_group(group: Any = None) -> None:
        whole = group is None or group == c10d.GroupMember.WORLD
        if not whole or not dist.is_initialized():
            return real_destroy(group)
        registry = torch_compat.get("group_registry")
        if registry is None:
            note("destroy", f"destroy_process_group: {torch_compat.missing('group_registry')}")
            return None
        world, get_default = registry
        default = get_default()
        for pg in reversed(list(world.pg_map)):  # the user's subgroups, newest first
            if pg is not default:
                real_destroy(pg)
        note(
            "destroy",
            "destroy_process_group: the lab keeps its default group for the next cell "
            "(other groups are destroyed)",
        )
        return None

    for name, wrapper, real in (
        ("init_process_group", init_process_group, real_init),
        ("destroy_process_group", destroy_process_group, real_destroy),
    ):
        wrapper.__labkit_real__ = real  # type: ignore[attr-defined]
        setattr(dist, name, wrapper)
        if getattr(c10d, name, None) is real:
            setattr(c10d, name, wrapper)


def init_disagreement(
    bound: dict[str, Any], have: dict[str, Any], device: str, env: Any
) -> list[str]:
    """What an `init_process_group` call asks for that the group `have` is not (pure).

    `bound` are the call's arguments by name; a value the call leaves to torch is read where
    torch reads it (the init_method URL's query, then RANK and WORLD_SIZE for env://). A
    backend such as "cpu:gloo,cuda:nccl" is compared for the lab's device ("cpu" or "cuda").
    """
    differs = []
    wanted = _backend_for(bound.get("backend"), device)
    lab_backend = _backend_for(have["backend"], device)
    if wanted is not None and wanted != lab_backend:
        differs.append(f"backend {bound['backend']!r} here, {have['backend']!r} in the lab")
    init_method = bound.get("init_method")
    query = parse_qs(urlparse(init_method).query) if isinstance(init_method, str) else {}
    from_env = bound.get("store") is None and (init_method is None or init_method == "env://")
    for name, env_name in (("world_size", "WORLD_SIZE"), ("rank", "RANK")):
        value = bound.get(name, -1)
        if value is None or value == -1:
            value = query[name][0] if name in query else env.get(env_name) if from_env else None
        if value is not None and int(value) != have[name]:
            differs.append(f"{name} {int(value)} here, {have[name]} in the lab")
    return differs


def _backend_for(backend: Any, device: str) -> str | None:
    """The backend a `backend` argument picks for `device` (None: torch's default)."""
    if backend is None:
        return None
    text = str(backend).lower()
    if ":" not in text:
        return text
    pairs = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
    return pairs.get(device, "none")


def _call_text(bound: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in bound.items())
