"""Ranks started by torchrun (on this machine or a cluster) that attach to the lab (kernel side).

`Lab.attach(n)` binds a TCP endpoint (loopback unless the user picks another address), writes
the lab's key to a file only its owner can read, and prints the command to run, e.g.

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 \\
        -m labkit.rank --connect HEAD:PORT --key-file ~/.labkit/lab.key

Each rank says `attach` (signed with the key); the kernel shows how many of N arrived, turns
away a rank that attaches twice or late, fails at once on a WORLD_SIZE that is not the lab's,
and gives up (naming the missing ranks) after `attach_timeout`. Once all have attached, the
kernel chooses backend and device with the same rule as for forked ranks (`policy.choose`)
and answers `welcome`. The ranks then serve cells as forked ranks do. labkit did not start
these processes, so it cannot signal, kill or restart them: Stop travels as a message, a
rank's death shows as missing heartbeats, and a stuck cell leaves the lab unusable until the
torchrun job is restarted.
"""

from __future__ import annotations

import os
import shlex
import socket
import time
from typing import Any

from labkit.kernel.channel.admission import parse_allow
from labkit.kernel.channel.channel import Channel, Stuck
from labkit.kernel.launch.launcher import RankLauncher
from labkit.kernel.launch.policy import Choice, choose, default_device
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


PROGRESS_EVERY = 1.0  # seconds between two "k of N ranks attached" lines


def torchrun_command(
    world_size: int, endpoint: str, key_file: str, nnodes: int = 1, rdzv: str | None = None
) -> str:
    """The command that starts `world_size` ranks attaching to `endpoint`; `rdzv` is the
    HOST:PORT of torchrun's rendezvous (on the first node) when there are several nodes."""
    if world_size % nnodes:
        raise ValueError(f"world_size {world_size} is not a multiple of nnodes {nnodes}")
    per_node = world_size // nnodes
    rdzv = rdzv or "HEAD_HOST:29500"
    rdzv = "" if nnodes == 1 else f" --rdzv-backend=c10d --rdzv-endpoint={rdzv}"
    return (
        f"torchrun --nnodes={nnodes} --nproc-per-node={per_node}{rdzv} "
        f"-m labkit.rank --connect {endpoint} --key-file {shlex.quote(key_file)}"
    )


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def arrived(attaches: dict[int, dict[str, Any]], n: int) -> str:
    """ "3 of 4 ranks attached (node0: 2, node1: 1)"."""
    hosts: dict[str, int] = {}
    for h in attaches.values():
        hosts[h["host"]] = hosts.get(h["host"], 0) + 1
    where = ", ".join(f"{h}: {k}" for h, k in sorted(hosts.items()))
    return f"{len(attaches)} of {n} ranks attached" + (f" ({where})" if where else "")


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
        rdzv: str | None = None,
        allow: list[str] | str | None = None,
    ):
        super().__init__(channel)
        assert channel.listen is not None
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.pg_timeout = pg_timeout
        self.attach_timeout = attach_timeout
        channel.allow = parse_allow(allow)
        self.key_file = write_key_file(
            key_file or os.path.join(channel.sock_dir, "lab.key"), channel.codec.key
        )
        host = channel.listen[0]
        bound = channel.endpoint("ctrl").rsplit(":", 1)[1]
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "*") else host
        self.endpoint = f"{shown}:{bound}"
        self.command = torchrun_command(world_size, self.endpoint, self.key_file, nnodes, rdzv)
        print(f"waiting for {world_size} ranks; start them with:\n  {self.command}", flush=True)

    def start(self) -> Choice:
        n, channel = self.world_size, self.channel
        channel.gen = 1
        deadline = time.monotonic() + self.attach_timeout
        attaches: dict[int, dict[str, Any]] = {}
        shown = [0, 0.0]  # how many arrived at the last progress line, and when it was shown

        def progress(pending: set[int]) -> None:
            self._check_world_size(attaches)
            now = time.monotonic()
            if len(attaches) != shown[0] and (not pending or now - shown[1] >= PROGRESS_EVERY):
                print(f"labkit: {arrived(attaches, n)}", flush=True)
                shown[:] = [len(attaches), now]

        channel.attaching = True
        try:
            channel.pump(
                set(range(n)), "attach", deadline=deadline, replies=attaches, watch=progress
            )
        except Stuck:
            self._send_away(attaches, "the lab gave up waiting for the other ranks")
            raise LabError(self._timeout_text(attaches)) from None
        except BaseException:
            self._send_away(attaches, "the lab stopped waiting for ranks")
            raise
        finally:
            channel.attaching = False
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
            kernel=(socket.gethostname(), os.getpid()),
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

    def _check_world_size(self, attaches: dict[int, dict[str, Any]]) -> None:
        """Fail at once when torchrun's WORLD_SIZE is not the lab's (no need to wait for all)."""
        n = self.world_size
        bad = next((h for h in attaches.values() if h["world_size"] != n), None)
        if bad is not None:
            raise LabError(
                f"torchrun started WORLD_SIZE={bad['world_size']} (rank {bad['rank']} on "
                f"{bad['host']}), but this lab wants {n} ranks: torchrun's nnodes x "
                f"nproc-per-node must be {n}; rerun the command Lab.attach printed:\n  "
                f"{self.command}"
            )

    def _timeout_text(self, attaches: dict[int, dict[str, Any]]) -> str:
        n, channel = self.world_size, self.channel
        missing = _spans([r for r in range(n) if r not in attaches])
        text = (
            f"only {arrived(attaches, n)} in {self.attach_timeout:.0f} s (missing: rank "
            f"{missing}); start them with:\n  {self.command}\n(torchrun's nnodes x "
            f"nproc-per-node must be {n})"
        )
        if channel.rejected:
            text += (
                f"\n{channel.rejected} message(s) were rejected (a wrong key file, a replayed "
                "message, or a host not allowed): see the warnings above"
            )
        return text

    def _send_away(self, attaches: dict[int, dict[str, Any]], why: str) -> None:
        """Ranks that attached but will not be welcomed exit at once, saying why."""
        routes = [self.channel.routes[r] for r in attaches if r in self.channel.routes]
        for route in routes:
            self.channel.refuse(route, why)
        if routes:
            time.sleep(0.2)  # the sockets close with the lab: let the answers leave first

    def interrupt(self, ranks: list[int], cell: int) -> None:
        self.channel.send_interrupt(ranks, cell)

    def watch(self, pending: set[int], started: float) -> None:
        """No fork server reports their deaths: a rank that stops sending heartbeats is gone."""
        now = time.monotonic()
        for r in sorted(pending):
            seen = self.channel.status.get(r, {}).get("received", started)
            if now - max(seen, started) > HEARTBEAT_LOST:
                host = self.info.get(r, {}).get("host", "its node")
                raise Stuck(
                    f"rank {r} (on {host}) sent no heartbeat for {HEARTBEAT_LOST:.0f} s: its "
                    "process, or its node, died or hangs (see torchrun's output there)",
                    died=r,
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
