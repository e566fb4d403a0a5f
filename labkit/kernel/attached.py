"""Ranks started by torchrun (on this machine or a cluster) that attach to the lab (kernel side).

`Lab.attach(n)` binds a TCP endpoint (loopback unless the user picks another address), writes
the lab's key to a file only its owner can read, and prints the command to run, e.g.

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 \\
        -m labkit.rank --connect HEAD:PORT --key-file ~/.labkit/lab.key

Each rank says `attach` (signed with the key); once all have, the kernel chooses backend and
device with the same rule as for forked ranks (`policy.choose`) and answers `welcome`. The
ranks then serve cells as forked ranks do. labkit did not start these processes, so it cannot
signal, kill or restart them: Stop travels as a message, a rank's death shows as missing
heartbeats, and a stuck cell leaves the lab unusable until the torchrun job is restarted.
"""

from __future__ import annotations

import os
import shlex
import socket
import time
from typing import Any

from labkit.kernel.channel import Channel, Stuck
from labkit.kernel.launcher import RankLauncher
from labkit.kernel.policy import Choice, choose, default_device
from labkit.kernel.results import LabError
from labkit.wire.key_file import write_key_file
from labkit.wire.messages import Exit, Init, Leave, Welcome

HEARTBEAT_LOST = 10.0  # seconds of silence after which an attached rank counts as gone
CANNOT_RESTART = (
    "this lab's ranks were started by torchrun, not by labkit, so labkit cannot restart "
    "them: it told them to leave, which ends the torchrun job (if a rank stuck inside a C++ "
    "op cannot leave, stop the job: Ctrl-C in its terminal, or scancel). Then call "
    "Lab.attach(...) again and start torchrun with the command it prints"
)


def torchrun_command(world_size: int, endpoint: str, key_file: str, nnodes: int = 1) -> str:
    """The command that starts `world_size` ranks attaching to `endpoint`."""
    if world_size % nnodes:
        raise ValueError(f"world_size {world_size} is not a multiple of nnodes {nnodes}")
    per_node = world_size // nnodes
    rdzv = "" if nnodes == 1 else " --rdzv-backend=c10d --rdzv-endpoint=HEAD_HOST:29500"
    return (
        f"torchrun --nnodes={nnodes} --nproc-per-node={per_node}{rdzv} "
        f"-m labkit.rank --connect {endpoint} --key-file {shlex.quote(key_file)}"
    )


def choose_attached(
    world_size: int, backend: str, device: str, attaches: dict[int, dict[str, Any]]
) -> Choice:
    """`policy.choose`, the forked ranks' rule, on the facts of the least-equipped node."""
    hosts: dict[str, int] = {}
    for h in attaches.values():
        hosts[h["host"]] = hosts.get(h["host"], 0) + 1
    facts = {
        "gpus": min(h.get("gpus", 0) for h in attaches.values()),
        "nccl": all(h.get("nccl", False) for h in attaches.values()),
        "cpus": min((h.get("cpus") or 0) for h in attaches.values()) or None,
    }
    choice = choose(world_size, backend, device, facts, ranks_per_host=max(hosts.values()))
    return Choice(
        choice.world_size,
        choice.backend,
        choice.device,
        choice.gpus,
        f"{choice.backend} on {choice.device}: {world_size} ranks attached from torchrun on "
        f"{', '.join(sorted(hosts))}",
    )


class TorchrunRanks(RankLauncher):
    """`world_size` ranks of a torchrun job that connect to this lab over TCP."""

    cannot_restart = CANNOT_RESTART

    def __init__(
        self,
        channel: Channel,
        world_size: int,
        backend: str,
        device: str,
        pg_timeout: float,
        key_file: str | None,
        nnodes: int,
        attach_timeout: float,
    ):
        super().__init__(channel)
        assert channel.listen is not None
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.pg_timeout = pg_timeout
        self.attach_timeout = attach_timeout
        self.key_file = write_key_file(
            key_file or os.path.join(channel.sock_dir, "lab.key"), channel.codec.key
        )
        host = channel.listen[0]
        bound = channel.endpoint("ctrl").rsplit(":", 1)[1]
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "*") else host
        self.endpoint = f"{shown}:{bound}"
        self.command = torchrun_command(world_size, self.endpoint, self.key_file, nnodes)

    def start(self) -> Choice:
        n, channel = self.world_size, self.channel
        channel.gen = 1
        deadline = time.monotonic() + self.attach_timeout
        try:
            attaches = channel.pump(set(range(n)), "attach", deadline=deadline)
        except Stuck:
            raise LabError(
                f"only {len(channel.routes)} of {n} ranks attached in "
                f"{self.attach_timeout:.0f} s; start them with:\n  {self.command}\n"
                f"(torchrun's nnodes x nproc-per-node must be {n})"
            ) from None
        bad = {r: h["world_size"] for r, h in attaches.items() if h["world_size"] != n}
        if bad:
            raise LabError(f"torchrun started WORLD_SIZE={bad.popitem()[1]}, the lab wants {n}")
        try:
            device = default_device(self.device)
            choice = choose_attached(self.world_size, self.backend, device, attaches)
        except ValueError as exc:
            raise LabError(f"the attached ranks cannot run as asked: {exc}") from None
        welcome = Welcome(
            type="welcome",
            gen=channel.gen,
            side="tcp://HOST:" + channel.endpoint("side").rsplit(":", 1)[1],
            backend=choice.backend,
            device=choice.device,
            pg_timeout=self.pg_timeout,
        )
        channel.send(range(n), welcome)
        channel.routes.clear()  # each rank now signs in again from its serving socket
        hellos = channel.pump(set(range(n)), "hello", deadline=deadline)
        self.pids = {r: h["pid"] for r, h in hellos.items()}
        channel.send(range(n), Init(type="init", port=None))
        channel.pump(set(range(n)), "ready", deadline=deadline)
        self.info = {r: dict(h, backend=choice.backend) for r, h in hellos.items()}
        self.choice = choice
        return choice

    def interrupt(self, ranks: list[int], cell: int) -> None:
        self.channel.send_interrupt(ranks, cell)

    def watch(self, pending: set[int], started: float) -> None:
        """No fork server reports their deaths: a rank that stops sending heartbeats is gone."""
        now = time.monotonic()
        for r in sorted(pending):
            seen = self.channel.status.get(r, {}).get("received", started)
            if now - max(seen, started) > HEARTBEAT_LOST:
                raise Stuck(
                    f"rank {r} sent no heartbeat for {HEARTBEAT_LOST:.0f} s: its process "
                    "may have died (see torchrun's output on its node)"
                )

    def abandon(self, why: str) -> None:
        """A cell the ranks did not finish: their heartbeat threads read `leave` and exit, even
        while their user code still runs, so the torchrun job ends instead of spinning on."""
        self.channel.send_side(list(self.pids), Leave(type="leave", why=why))
        self.channel.flush_side(timeout=2.0)

    def stop(self) -> None:
        """Ask torchrun's ranks to leave; their job then ends."""
        if self.pids:
            try:
                self.channel.send(self.pids, Exit(type="exit"))
                time.sleep(0.2)
            except Exception:  # noqa: BLE001 - the sockets may be gone already
                pass
        self.pids = {}
