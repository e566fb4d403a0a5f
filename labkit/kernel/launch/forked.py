"""Ranks forked on this machine by a fork server (kernel side).

The fork server (labkit.rank.fork_server, driven through labkit.kernel.launch.spawn) has torch
imported already, so a start or restart costs a fork. Rank 0 binds the rendezvous store on
port 0 and says the port in its `hello`; the kernel hands it to every rank in `init`.
labkit owns these processes: Stop is a message the rank latches, a stuck cell is recovered by
SIGKILL and a new fork, and the fork server reports each exit the moment it happens.
"""

from __future__ import annotations

import signal
import time

from labkit.kernel.channel.channel import Channel
from labkit.kernel.launch import spawn
from labkit.kernel.launch.launcher import RankLauncher
from labkit.kernel.launch.policy import Choice, choose, default_device, threads_per_rank
from labkit.wire.config import RankConfig
from labkit.wire.messages import Init

START_TIMEOUT = 120.0


class ForkedRanks(RankLauncher):
    """`world_size` ranks forked from a fork server on this machine."""

    def __init__(
        self,
        channel: Channel,
        requested: tuple[int | None, str, str],
        pg_timeout: float,
        threads: int | None = None,
    ):
        super().__init__(channel)
        self.requested = requested  # (world_size or None, backend, device) as the user asked
        self.pg_timeout = pg_timeout
        self.threads = threads  # torch threads per rank as the user asked (None: shared out)
        self._server: spawn.ForkServer | None = None

    @property
    def server(self) -> spawn.ForkServer | None:
        return self._server

    def _on_exit(self, pid: int, rank: int | None, code: int) -> None:
        if rank is not None and self.pids.get(rank) == pid:
            self.channel.rank_exited(rank, code)

    def start(self) -> Choice:
        if self._server is None or not self._server.alive():
            self._server = spawn.take()
            self._server.on_exit = self._on_exit
        if self.choice is None or self.choice.world_size != self.requested[0]:
            world_size, backend, device = self.requested
            device = default_device(device)
            self.choice = choose(world_size, backend, device, self._server.wait_facts())
        self._spawn()
        return self.choice

    def resize(self, world_size: int) -> None:
        """The next start forks `world_size` ranks."""
        self.requested = (world_size, *self.requested[1:])

    def _spawn(self) -> None:
        server, choice, channel = self._server, self.choice, self.channel
        assert server is not None and choice is not None
        gen = channel.new_generation()
        n = choice.world_size
        threads = threads_per_rank(server.wait_facts().get("cpus"), n, self.threads)
        deadline = time.monotonic() + START_TIMEOUT
        try:
            for r in range(n):
                server.spawn(
                    RankConfig(
                        rank=r,
                        world_size=n,
                        local_rank=r,
                        local_world_size=n,
                        ctrl=channel.endpoint("ctrl"),
                        side=channel.endpoint("side"),
                        key=channel.codec.key,
                        gen=gen,
                        backend=choice.backend,
                        device=choice.device,
                        log_dir=channel.log_dir,
                        master_addr="127.0.0.1",
                        pg_timeout=self.pg_timeout,
                        threads=threads,
                        shm_dir=channel.shm_dir,
                        stop_board=channel.stop_board.path if channel.stop_board else None,
                    )
                )
            # the start's own deadline: forking 16 ranks on a busy 2-core machine can take >10 s
            self.pids = server.wait_pids(gen, list(range(n)), deadline - time.monotonic())
            hellos = channel.pump(set(range(n)), "hello", deadline=deadline)
            self.info = {r: dict(h, backend=choice.backend) for r, h in hellos.items()}
            channel.send(range(n), Init(type="init", port=hellos[0]["port"]))
            channel.pump(set(range(n)), "ready", deadline=deadline)
        except BaseException:
            try:  # ranks forked but not yet reported must be killed too
                server.wait_pids(gen, list(range(n)), timeout=2.0)
            except (RuntimeError, KeyboardInterrupt):
                pass
            self.kill()
            raise

    def clock_offsets(self) -> dict[int, float]:
        """Zero: forked ranks run on this machine and read its one wall clock, as the kernel
        does. (A measured offset would only add the ping's error: up to half its round trip,
        tens of ms on a busy machine, enough to put a stage's span before its predecessor's.)
        """
        return dict.fromkeys(self.pids, 0.0)

    def interrupt(self, ranks: list[int], cell: int) -> None:
        """Stop as a message naming the cell, latched by the rank (labkit.rank.side).

        Not SIGINT: a signal names no cell, so one that arrives late (the fork server relays it)
        would stop the next cell instead.
        """
        self.channel.send_interrupt(ranks, cell)

    def kill(self) -> None:
        pids = list(self.pids.values())
        server = self._server
        if server is not None:  # also ranks forked before an interrupted start-up
            with server.cond:
                gen = self.channel.gen
                server.ended_gens.add(gen)  # and any reported after this (ForkServer._handle)
                pids += [p for (g, _), p in server.spawned.items() if g == gen]
            pids = sorted(set(pids))
        self.pids = {}
        if server is not None and pids:
            server.signal(pids, signal.SIGKILL)
            server.wait_exited(pids, timeout=5)

    def stop(self) -> None:
        pids = list(self.pids.values())
        server = self._server
        if server is not None and pids:
            server.signal(pids, signal.SIGTERM)
            if not server.wait_exited(pids, timeout=1.0):
                server.signal(pids, signal.SIGKILL)
                server.wait_exited(pids, timeout=5)
        self.pids = {}
        if server is not None:
            self._server = None
            spawn.release(server)  # the next Lab's, when clean
