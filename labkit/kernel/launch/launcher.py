"""One interface for the ways a lab's ranks come to exist (kernel side).

`ForkedRanks` (labkit.kernel.launch.forked) forks them from a fork server on this machine;
`TorchrunRanks` (labkit.kernel.launch.attached) waits for ranks that torchrun started, here or on a
cluster, to attach. The lab calls only the methods below, so what differs between the two
lives in the two classes, not in branches of the lab.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from labkit.kernel.channel.channel import Channel
from labkit.kernel.launch.policy import Choice
from labkit.wire.messages import Ping


class RankLauncher(ABC):
    """Starts, interrupts and ends a lab's ranks over its channel."""

    #: why labkit cannot restart these ranks (None: it can)
    cannot_restart: str | None = None

    def __init__(self, channel: Channel):
        self.channel = channel
        self.pids: dict[int, int] = {}  # rank -> pid (on its host)
        self.info: dict[int, dict] = {}  # rank -> what it said in its hello, with the backend
        self.choice: Choice | None = None

    @abstractmethod
    def start(self) -> Choice:
        """Bring the ranks up and form their process group; returns what was chosen."""

    @abstractmethod
    def interrupt(self, ranks: list[int], cell: int) -> None:
        """Stop pressed: make `ranks` raise KeyboardInterrupt in the user code of `cell`."""

    def watch(self, pending: set[int], started: float) -> None:
        """Raise `Stuck` if a rank in `pending` is known to be gone (called while a cell runs).

        By default nothing to do: a fork server reports a rank's death the moment it happens.
        """
        return None

    def abandon(self, why: str) -> None:
        """The lab gave up on these ranks (they cannot be restarted): tell them to leave.

        Nothing to do where labkit kills and restarts its ranks itself.
        """
        return None

    def kill(self) -> None:
        """End the ranks at once, to start them anew (only where `cannot_restart` is None)."""
        raise NotImplementedError

    def resize(self, world_size: int) -> None:
        """The next start brings up `world_size` ranks (only where `cannot_restart` is None)."""
        raise NotImplementedError

    @abstractmethod
    def stop(self) -> None:
        """End the ranks and release what the launcher holds. Safe to call twice."""

    def clock_offsets(self, pings: int = 5) -> dict[int, float]:
        """Each rank's clock minus the kernel's, to put its records on the kernel's clock.

        Measured by pings, since ranks elsewhere (torchrun's) may run on other machines'
        clocks: the rank's time minus the kernel's at a ping's midpoint. The error is at most
        half the ping's round trip, which a busy machine stretches to tens of ms: of `pings`
        pings, the one with the shortest round trip is kept.
        """
        ranks = list(self.pids)
        best: dict[int, tuple[float, float]] = {}  # rank -> (round trip, offset)
        for _ in range(pings):
            t0 = time.time()
            self.channel.send(ranks, Ping(type="ping", id=0))
            pongs = self.channel.pump(set(ranks), "pong", msg_id=0, deadline=time.monotonic() + 10)
            t1 = time.time()
            for r in ranks:
                sample = (t1 - t0, pongs[r]["time"] - (t0 + t1) / 2)
                best[r] = min(best.get(r, sample), sample)
        return {r: offset for r, (_, offset) in best.items()}

    @property
    def server(self):  # noqa: ANN201 - the fork server handle, where there is one
        return None
