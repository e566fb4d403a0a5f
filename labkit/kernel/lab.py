"""`Lab`: persistent rank processes driven from a notebook kernel (kernel side).

The lab is the public API (start, run, pull, push, trace, stacks, debug, restart, stop) over:

- a `Channel` (labkit.kernel.channel.channel): the sockets, the I/O thread and the one waiting loop;
- a launcher (labkit.kernel.launch.launcher): `ForkedRanks` forks the ranks here, `TorchrunRanks`
  takes ranks that torchrun started; the lab calls the same methods on either;
- a `CellRun` per call (labkit.kernel.cell.cell_run): watch, Stop and diagnosis of one cell.

A cell that cannot finish (a rank stuck in a collective, a dead peer, a hung Stop) comes back
from its `CellRun` as stuck; the lab then restarts the ranks (variables are lost, and the user
is told so), or, for ranks it cannot restart, says what to do and refuses further cells.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from labkit.kernel.cell.cell_run import CellOutcome, CellRun, exec_message, recovery_note, results
from labkit.kernel.cell.live import ranks_info, status_report
from labkit.kernel.cell.rank_spec import parse_ranks
from labkit.kernel.channel.channel import Channel, Stuck
from labkit.kernel.inspection.debug import post_mortem
from labkit.kernel.inspection.log_dirs import new_log_dir
from labkit.kernel.inspection.logs import read_tail
from labkit.kernel.inspection.stacks import STACKS_TIMEOUT, RankStacks, lab_stacks
from labkit.kernel.lab_data import DataRequests
from labkit.kernel.launch.attached import TorchrunRanks
from labkit.kernel.launch.forked import ForkedRanks
from labkit.kernel.launch.launcher import RankLauncher
from labkit.kernel.launch.policy import BACKENDS, DEVICES, check_world_size, threads_per_rank
from labkit.kernel.results import LabError, LabkitWarning, RemoteError, Results
from labkit.kernel.script_run import load_script
from labkit.wire.codec import Codec, new_key

__all__ = ["Lab", "LabError", "LabkitWarning", "current"]

_current: Lab | None = None
_labs: weakref.WeakSet[Lab] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for lab in list(_labs):
        lab.stop()


def current() -> Lab:
    """The lab that `%%ranks` uses: the last one created or started (kernel side).

    Example: ``labkit.current().pull("x")`` in a notebook that started its lab with `%lab`."""
    if _current is None or _current.closed:
        raise LabError("no lab is running: start one with labkit.Lab(n) or %lab start n")
    return _current


class Lab(DataRequests):
    """A set of persistent rank processes sharing one torch.distributed process group.

    Runs in the kernel; its ranks are processes of their own. `Lab(4)` forks 4 ranks (default:
    one per GPU, else 4; backend and device chosen by the policy, `lab.choice.reason` says why)
    and returns when their process group is ready. Example::

        lab = labkit.Lab(4)
        lab.run("x = torch.ones(2) * rank; dist.all_reduce(x)")
        lab.pull("x")  # {0: tensor([6., 6.]), 1: ..., 2: ..., 3: ...}
        lab.stop()
    """

    def __init__(
        self,
        world_size: int | None = None,
        *,
        backend: str = "auto",
        device: str = "auto",
        timeout: float | None = None,
        pg_timeout: float = 1800,
        log_dir: str | None = None,
        threads: int | None = None,
        start: bool = True,
        _listen: tuple[str, int] | None = None,
    ):
        if world_size is not None:
            check_world_size(world_size)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
        self.requested = (world_size, backend, device)
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self.log_dir = log_dir or new_log_dir()
        os.makedirs(self.log_dir, exist_ok=True)
        threads_per_rank(None, 1, threads)  # bad input raises here, before the channel exists
        self.channel = Channel(Codec(new_key()), self.log_dir, _listen)
        self.launcher: RankLauncher = ForkedRanks(self.channel, self.requested, pg_timeout, threads)
        self.broken: str | None = None  # why a lab of attached ranks cannot run cells any more
        self.offsets: dict[int, float] = {}
        self.closed = False
        self._cell = 0
        self._lock = threading.RLock()
        _labs.add(self)
        if start:
            try:
                self.start()
            except BaseException:
                self.stop()
                raise

    # -- what the ranks are -----------------------------------------------------------------
    @property
    def choice(self):  # noqa: ANN201 - policy.Choice, or None before the ranks started
        return self.launcher.choice

    @property
    def world_size(self) -> int:
        return self.choice.world_size if self.choice else 0

    @property
    def backend(self) -> str:
        return self.choice.backend if self.choice else self.requested[1]

    @property
    def pids(self) -> dict[int, int]:
        return self.launcher.pids

    @property
    def info(self) -> dict[int, dict[str, Any]]:
        return self.launcher.info

    @property
    def dead(self) -> dict[int, int]:
        return self.channel.dead

    @property
    def server(self) -> Any:
        """The fork server handle (None for ranks started by torchrun, and after `stop()`: a
        cleanly stopped lab's server is kept for the next `Lab`)."""
        return self.launcher.server

    @property
    def attached(self) -> bool:
        return isinstance(self.launcher, TorchrunRanks)

    @property
    def running(self) -> bool:
        return bool(self.pids) and not self.closed

    @property
    def last_cell(self) -> int:
        return self._cell

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> Lab:
        """Start the ranks and form their process group (kernel side)."""
        with self._lock:
            if self.closed:
                raise LabError("this lab was stopped; create a new one with labkit.Lab(n)")
            if self.running:
                raise LabError("the lab is already running; use restart() to start it anew")
            try:
                self.launcher.start()
                self.offsets = self.launcher.clock_offsets()
            except Stuck as exc:  # a rank died or did not answer while starting
                raise LabError(f"the ranks could not start: {exc}") from None
            global _current
            _current = self
            return self

    @classmethod
    def attach(
        cls,
        world_size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        key_file: str | None = None,
        *,
        nnodes: int = 1,
        rdzv: str | None = None,
        allow: list[str] | None = None,
        backend: str = "auto",
        device: str = "auto",
        timeout: float | None = None,
        pg_timeout: float = 1800,
        log_dir: str | None = None,
        wait: bool = True,
        attach_timeout: float = 600,
    ) -> Lab:
        """A lab whose ranks are started by torchrun (on this or other machines). Kernel side;
        `torchrun ... -m labkit.rank --connect HOST:PORT` on each node starts the ranks.

        Binds a TCP endpoint on `host` (loopback by default: pass the address other nodes
        reach, or "0.0.0.0", to take ranks from a cluster), writes the lab's key to `key_file`
        (mode 600; by default in a private temporary directory) and prints the torchrun command
        to run (`rdzv`: the HOST:PORT of torchrun's rendezvous on the first node). `allow`:
        the addresses, networks or host names ranks may connect from (default: any that
        holds the key). With `wait`, returns once all `world_size` ranks attached and formed
        their process group (showing how many arrived); else call `lab.wait_attached()` later.
        Example: ``lab = labkit.Lab.attach(8, host="10.0.0.5", nnodes=2, rdzv="node001:29500")``
        """
        check_world_size(world_size)
        lab = cls(
            world_size,
            backend=backend,
            device=device,
            timeout=timeout,
            pg_timeout=pg_timeout,
            log_dir=log_dir,
            start=False,
            _listen=(host, port),
        )
        try:
            lab.launcher = TorchrunRanks(
                lab.channel, world_size, backend, device, pg_timeout, key_file, nnodes,
                attach_timeout, rdzv, allow,
            )  # fmt: skip
            if wait:
                lab.wait_attached(attach_timeout)
        except BaseException:
            lab.stop()
            raise
        return lab

    # attached labs only: the torchrun command to run, the endpoint it names, the key file
    command = property(lambda self: getattr(self.launcher, "command", ""))
    endpoint = property(lambda self: getattr(self.launcher, "endpoint", ""))
    key_file = property(lambda self: getattr(self.launcher, "key_file", ""))

    def wait_attached(self, timeout: float = 600) -> Lab:
        """Wait for torchrun's ranks to attach and form their process group (kernel side)."""
        assert isinstance(self.launcher, TorchrunRanks), "only a lab made by Lab.attach waits"
        self.launcher.attach_timeout = timeout
        return self.start()

    def restart(self, world_size: int | None = None) -> Lab:
        """Kill the ranks and start new ones (variables on the ranks are lost). Kernel side.

        Example: ``lab.restart()``, or ``lab.restart(2)`` for 2 ranks from now on."""
        if self.launcher.cannot_restart:
            raise LabError(self.launcher.cannot_restart)
        with self._lock:
            if self.closed:
                raise LabError("this lab was stopped; create a new one with labkit.Lab(n)")
            if world_size is not None:
                check_world_size(world_size)
                self.requested = (world_size, *self.requested[1:])
                self.launcher.resize(world_size)
            self.launcher.kill()
            self.launcher.start()
            self.offsets = self.launcher.clock_offsets()
            return self

    def stop(self) -> None:
        """End the ranks and close the channel; the fork server is kept for the next `Lab` when
        every rank it forked has exited, else closed. Kernel side; safe to call twice.
        Example: ``lab.stop()`` (or ``with labkit.Lab(2) as lab: ...``)."""
        global _current
        with self._lock:
            if self.closed:
                return
            self.launcher.stop()
            self.closed = True
            self.channel.close()
            if _current is self:
                _current = None

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self.closed else ("running" if self.running else "not started")
        what = self.choice.reason if self.choice else "not started"
        return f"<labkit.Lab {state}: {what}>"

    # -- running code -----------------------------------------------------------------------
    def ranks(self, spec: Any = None) -> list[int]:
        """The ranks a call targets: None/'all' for every rank, or '0,2', '1-3', [0, 2]."""
        return parse_ranks(spec, self.world_size)

    def _check_usable(self) -> None:
        if self.closed:
            raise LabError("this lab was stopped; create a new one with labkit.Lab(n)")
        if self.broken:
            raise LabError(self.broken)
        if not self.running:
            raise LabError("the lab's ranks are not running; call lab.start() or lab.restart()")
        if self.dead:
            dead = ", ".join(f"rank {r} (code {c})" for r, c in sorted(self.dead.items()))
            raise LabError(
                f"{dead} died after the last cell; call lab.restart() "
                "(or %lab restart) to start the ranks again"
            )
        self.channel.drain_events()

    def run(
        self,
        code_or_function: str | Callable[..., Any],
        ranks: Any = None,
        timeout: float | None = None,
        *,
        display: bool = True,
    ) -> Results:
        """Run code (a string) or a function on the ranks, all at once. Kernel side.

        A function is called on every target rank with the rank's namespace entries that match
        its parameter names (`def step(rank, world_size): ...`). Returns {rank: RankResult}
        with value, output, duration and error; it raises only for bad input or when the cell
        had to be stopped (then the ranks were restarted). Example::

            lab.run("y = rank * 2; y")[1].value  # 2: the value of rank 1's last expression
            lab.run(lambda rank, world_size: rank / world_size, ranks="0,2")
        """
        with self._lock:
            self._check_usable()
            targets = self.ranks(ranks)
            msg = exec_message(code_or_function, targets, self.world_size, display)
            return self._call(msg, targets, timeout or self.timeout)

    def run_script(self, path: str, argv: Any = (), timeout: float | None = None) -> Results:
        """Run a torchrun script unchanged on every rank, as `__main__` with `sys.argv` set
        (kernel side; the kernel reads the file: labkit.kernel.script_run). A rank whose script
        raised, or exited with a code other than 0, has an error in the results
        (`results.raise_for_errors()` raises them); the values are None. Example:
        ``lab.run_script("examples/ddp_digits.py", ["--epochs", "1"])`` (as `%lab run`)."""
        return self.run(load_script(path, argv), timeout=timeout, display=False)

    def _call(self, msg: Any, targets: list[int], timeout: float | None) -> Results:
        """Send one request to `targets` as a new cell and wait for its results."""
        self._cell += 1
        msg["id"] = self._cell
        run = CellRun(
            self.channel, self.launcher, self.world_size, self._cell, targets, timeout, self
        )
        outcome = run.run(msg)
        if outcome.stuck is not None:
            self._recover(outcome)
        return results(outcome.replies, self.channel.output, self.offsets)

    def _recover(self, outcome: CellOutcome) -> None:
        """A stuck cell: restart the ranks where labkit can, then raise what happened."""
        t0 = time.monotonic()
        cannot = self.launcher.cannot_restart
        if cannot:
            self.broken = recovery_note(outcome, t0 - outcome.started, None, cannot)
            self.launcher.abandon(str(outcome.stuck))
            note = self.broken
        else:
            self.restart()
            note = recovery_note(outcome, t0 - outcome.started, time.monotonic() - t0, cannot or "")
        assert outcome.stuck is not None
        if outcome.errors and outcome.stuck.died is None:  # else the death is the root cause
            raise RemoteError(outcome.errors, note)
        raise LabError(note)

    debug = post_mortem  # lab.debug(rank): pdb on the rank's last exception (inspection.debug)

    # -- what the notebook shows about the ranks --------------------------------------------
    def stacks(self, ranks: Any = None, timeout: float = STACKS_TIMEOUT) -> RankStacks:
        """Each rank's Python stacks now, idle or busy, also from another thread while a cell
        runs (labkit.kernel.inspection.stacks). A rank that is dead, or silent for `timeout` s,
        says so. Kernel side; the ranks answer from their heartbeat thread. Example:
        ``lab.stacks([1])`` prints rank 1's threads, innermost frame first (as `%lab stacks 1`).
        """
        return lab_stacks(self, ranks, timeout)

    def log_tail(self, rank: int, lines: int = 12) -> str:
        """The last lines of a rank's log (what it printed last, even if it crashed)."""
        return read_tail(self.log_dir, rank, lines=lines, drop_noise=True)

    def ranks_info(self) -> list[dict[str, Any]]:
        """One dict per rank: rank, pid, host, device, backend, num_cpus, threads."""
        return ranks_info(self.info, self.pids)

    def status_report(self) -> dict[str, Any]:
        """What `%lab status` shows: the choice, and per rank its pid, device and liveness."""
        return status_report(self, self.channel.status)
