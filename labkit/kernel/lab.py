"""`Lab`: persistent rank processes driven from a notebook kernel (kernel side).

A lab owns a fork server (its ranks' clean parent), two ZeroMQ ROUTER sockets on loopback and
one background thread:

- `ctrl` is used only by the thread that calls the lab (requests out, replies in);
- `side` is read by the `labkit-io` thread: output lines are queued for the caller to print,
  heartbeats update each rank's status (the line it runs, the comm op it is inside).

Every call goes through `_pump`, the one loop that waits for replies. While it waits it prints
rank output as it arrives, notices dead ranks (the fork server reports exits at once), runs the
watchdog (`labkit.kernel.watchdog.diagnose`), shows the live status once a cell has run for a
second, and turns Ctrl-C (the notebook's Stop button) into SIGINT on the ranks. A cell that cannot
finish (a rank stuck in a collective, a dead peer, a hung Stop) is recovered by killing and
re-forking the ranks; the user is told that rank variables were lost.

Generations: each (re)start of the ranks has a new number, and messages from an older
generation are dropped, so a restart never mixes old and new replies.
"""

from __future__ import annotations

import ast
import atexit
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from labkit.kernel import spawn
from labkit.kernel.live import LiveStatus
from labkit.kernel.output import RankOutput
from labkit.kernel.policy import BACKENDS, DEVICES, Choice, check_world_size, choose
from labkit.kernel.rank_spec import parse_ranks
from labkit.kernel.results import CellState, LabError, RankResult, RemoteError, Results
from labkit.kernel.watchdog import diagnose
from labkit.wire.codec import AuthenticationError, Codec, new_key
from labkit.wire.logfile import LOG_HEADER

START_TIMEOUT = 120.0
HEARTBEAT_LOST = 10.0  # seconds of silence after which an attached rank counts as gone
STOP_GRACE = 2.0  # seconds ranks get to stop after SIGINT before they are restarted
_COLLECTIVE = re.compile(
    r"\b(all_reduce|all_gather\w*|reduce_scatter\w*|all_to_all\w*|broadcast|barrier|reduce|"
    r"scatter|gather)\s*\("
)

# lines of a crash report that say nothing to a learner (labkit's and Python's own frames)
_NOISE = re.compile(
    r"labkit[/\\]rank[/\\](worker|fork_server)\.py|<frozen runpy>|^Extension modules:"
)

_current: Lab | None = None
_labs: weakref.WeakSet[Lab] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for lab in list(_labs):
        lab.stop()


class LabkitWarning(UserWarning):
    """A warning of labkit's own (tests turn these into errors)."""


class _Stuck(Exception):
    """The cell cannot finish; the message says why (`died`: a rank whose death is the cause)."""

    def __init__(self, reason: str, died: int | None = None):
        super().__init__(reason)
        self.died = died


def current() -> Lab:
    """The lab that `%%ranks` uses: the last one created or started."""
    if _current is None or _current.closed:
        raise LabError("no lab is running: start one with labkit.Lab(n) or %lab start n")
    return _current


class Lab:
    """A set of persistent rank processes sharing one torch.distributed process group.

    Runs in the kernel. `Lab(4)` forks 4 ranks and returns when their process group is ready.
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
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="labkit-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.codec = Codec(new_key())
        self.ctx = zmq.Context()
        self.sock_dir = tempfile.mkdtemp(prefix="labkit-")  # 0700: only this user gets in
        self.listen = _listen  # (host, port): ranks attach over TCP (see Lab.attach)
        self.attached = _listen is not None
        self.broken: str | None = None  # why an attached lab cannot run cells any more
        self._side_out: deque[tuple[int, dict[str, Any]]] = deque()
        self._side_routes: dict[int, bytes] = {}
        self.ctrl = self._bind("ctrl")
        self.side = self._bind("side")
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.poller = zmq.Poller()
        self.poller.register(self.ctrl, zmq.POLLIN)
        self.poller.register(self.wake_r, zmq.POLLIN)
        self.events: deque[tuple[Any, ...]] = deque()
        self.status: dict[int, dict[str, Any]] = {}
        self.rejected = 0
        self.gen = 0
        self.pids: dict[int, int] = {}
        self.info: dict[int, dict[str, Any]] = {}
        self.offsets: dict[int, float] = {}
        self.dead: dict[int, int] = {}
        self.routes: dict[int, bytes] = {}  # rank -> ZeroMQ routing id of its ctrl socket
        self.choice: Choice | None = None
        self.server: spawn.ForkServer | None = None
        self.closed = False
        self._cell = 0
        self._seen_seq: dict[int, int] = {}
        self.output = RankOutput()
        self._lock = threading.RLock()
        self._io = threading.Thread(target=self._io_loop, name="labkit-io", daemon=True)
        self._io.start()
        _labs.add(self)
        if start:
            try:
                self.start()
            except BaseException:
                self.stop()
                raise

    # -- sockets and background thread ------------------------------------------------------
    def _bind(self, name: str) -> zmq.Socket:
        """A ROUTER on a Unix socket in a private directory (faster than TCP loopback)."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.listen is not None:  # attached ranks: TCP on the address the user chose
            host, port = self.listen
            sock.bind(f"tcp://{host}:{port if name == 'ctrl' else 0}")
            return sock
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes over its identity
        sock.bind(f"ipc://{os.path.join(self.sock_dir, name)}")
        return sock

    def _endpoint(self, sock: zmq.Socket) -> str:
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def _post(self, *event: Any) -> None:
        self.events.append(event)
        try:
            os.write(self.wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _io_loop(self) -> None:
        while not self.closed:
            try:
                while self._side_out:  # Stop for attached ranks (they cannot be signalled)
                    rank, out = self._side_out.popleft()
                    if rank in self._side_routes:
                        self.side.send_multipart([self._side_routes[rank], *self.codec.encode(out)])
                if not self.side.poll(50 if self.attached else 200):
                    continue
                frames = self.side.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            try:
                msg = self.codec.decode(frames[1:])
            except AuthenticationError as exc:
                self.rejected += 1
                self._post("rejected", str(exc))
                continue
            if msg.get("gen") != self.gen:
                continue
            self._side_routes[msg["rank"]] = frames[0].bytes
            if msg["type"] == "stream" and self.attached:  # their logs are on other machines
                self._log_attached(msg)
            if msg["type"] == "status":
                msg["received"] = time.monotonic()
                self.status[msg["rank"]] = msg
            elif msg["type"] == "stream":
                self._post("stream", msg)

    def _log_attached(self, msg: dict[str, Any]) -> None:
        path = os.path.join(self.log_dir, f"rank-{msg['rank']}.log")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "ab") as f:
                f.write(msg["text"].encode(errors="replace"))
        except OSError:
            pass

    def _on_exit(self, pid: int, rank: int | None, code: int) -> None:
        if rank is not None and self.pids.get(rank) == pid:
            self.dead[rank] = code
            self._post("exit", rank, code)

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.choice.world_size if self.choice else 0

    @property
    def backend(self) -> str:
        return self.choice.backend if self.choice else self.requested[1]

    @property
    def running(self) -> bool:
        return bool(self.pids) and not self.closed

    def start(self) -> Lab:
        """Fork the ranks and form their process group (kernel side)."""
        with self._lock:
            if self.closed:
                raise LabError("this lab was stopped; create a new one with labkit.Lab(n)")
            if self.running:
                raise LabError("the lab is already running; use restart() to start it anew")
            if self.server is None or not self.server.alive():
                self.server = spawn.take()
                self.server.on_exit = self._on_exit
            facts = self.server.wait_facts()
            world_size, backend, device = self.requested
            self.choice = choose(world_size, backend, device, facts)
            self._spawn_ranks()
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
        backend: str = "auto",
        device: str = "auto",
        timeout: float | None = None,
        pg_timeout: float = 1800,
        log_dir: str | None = None,
        wait: bool = True,
        attach_timeout: float = 600,
    ) -> Lab:
        """A lab whose ranks are started by torchrun (on this or other machines). Kernel side.

        Binds a TCP endpoint on `host` (loopback by default: pass the address other nodes
        reach, or "0.0.0.0", to take ranks from a cluster), writes the lab's key to `key_file`
        (mode 600; by default in a private temporary directory) and prints the torchrun command
        to run. With `wait`, returns once all `world_size` ranks attached and formed their
        process group; else call `lab.wait_attached()` later.
        """
        from labkit.rank import torchrun_entry as attach

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
            lab.key_file = attach.write_key_file(
                key_file or os.path.join(lab.sock_dir, "lab.key"), lab.codec.key
            )
            bound = lab._endpoint(lab.ctrl).rsplit(":", 1)[1]
            shown = socket.gethostname() if host in ("0.0.0.0", "::", "*") else host
            lab.endpoint = f"{shown}:{bound}"
            lab.command = attach.torchrun_command(world_size, lab.endpoint, lab.key_file, nnodes)
            print(f"waiting for {world_size} ranks; start them with:\n  {lab.command}", flush=True)
            if wait:
                lab.wait_attached(attach_timeout)
        except BaseException:
            lab.stop()
            raise
        return lab

    def wait_attached(self, timeout: float = 600) -> Lab:
        """Wait for torchrun's ranks to attach and form their process group (kernel side)."""
        with self._lock:
            n = self.requested[0]
            assert self.attached and n is not None
            self.gen = 1
            deadline = time.monotonic() + timeout
            try:
                attaches = self._pump(set(range(n)), "attach", deadline=deadline)
            except _Stuck:
                raise LabError(
                    f"only {len(self.routes)} of {n} ranks attached in {timeout:.0f} s; start "
                    f"them with:\n  {self.command}\n(torchrun's nnodes x nproc-per-node must "
                    f"be {n})"
                ) from None
            bad = {r: h["world_size"] for r, h in attaches.items() if h["world_size"] != n}
            if bad:
                raise LabError(f"torchrun started WORLD_SIZE={bad.popitem()[1]}, the lab wants {n}")
            welcome = {
                "type": "welcome",
                "gen": self.gen,
                "side": "tcp://HOST:" + self._endpoint(self.side).rsplit(":", 1)[1],
                "backend": self.requested[1],
                "device": self.requested[2],
                "pg_timeout": self.pg_timeout,
            }
            self._send(range(n), welcome)
            self.routes.clear()  # each rank now signs in again from its serving socket
            hellos = self._pump(set(range(n)), "hello", deadline=deadline)
            self.pids = {r: h["pid"] for r, h in hellos.items()}
            self._send(range(n), {"type": "init", "port": None})
            self._pump(set(range(n)), "ready", deadline=deadline)
            gpus = max(h.get("gpus", 0) for h in attaches.values())
            devices = {h["device"].split(":")[0] for h in hellos.values()}
            hosts = sorted({h["host"] for h in hellos.values()})
            device = "cuda" if "cuda" in devices else "cpu"
            backend = self.requested[1]
            if backend == "auto":
                backend = "nccl" if device == "cuda" else "gloo"
            self.choice = Choice(
                n,
                backend,
                device,
                gpus,
                f"{backend} on {device}: {n} ranks attached from torchrun on {', '.join(hosts)}",
            )
            self.info = {r: dict(h, backend=backend) for r, h in hellos.items()}
            self._measure_offsets()
            global _current
            _current = self
            return self

    def _spawn_ranks(self) -> None:
        assert self.server is not None and self.choice is not None
        self.gen += 1
        self.status.clear()
        self.events.clear()
        self.dead.clear()
        self._seen_seq = {}
        n = self.choice.world_size
        base = {
            "world_size": n,
            "local_world_size": n,
            "ctrl": self._endpoint(self.ctrl),
            "side": self._endpoint(self.side),
            "key": self.codec.key,
            "gen": self.gen,
            "backend": self.choice.backend,
            "device": self.choice.device,
            "log_dir": self.log_dir,
            "master_addr": "127.0.0.1",
            "pg_timeout": self.pg_timeout,
        }
        deadline = time.monotonic() + START_TIMEOUT
        try:
            for r in range(n):
                self.server.spawn(dict(base, rank=r, local_rank=r))
            self.pids = self.server.wait_pids(self.gen, list(range(n)))
            hellos = self._pump(set(range(n)), "hello", deadline=deadline)
            self.info = {r: dict(h, backend=self.choice.backend) for r, h in hellos.items()}
            self._send(range(n), {"type": "init", "port": hellos[0]["port"]})
            self._pump(set(range(n)), "ready", deadline=deadline)
            self._measure_offsets()
        except BaseException:
            try:  # ranks forked but not yet reported must be killed too
                self.server.wait_pids(self.gen, list(range(n)), timeout=2.0)
            except (RuntimeError, KeyboardInterrupt):
                pass
            self._kill_ranks()
            raise

    def _measure_offsets(self) -> None:
        """Clock offset of each rank: its time minus the kernel's at the ping's midpoint."""
        ranks = list(self.pids)
        t0 = time.time()
        self._send(ranks, {"type": "ping", "id": 0})
        pongs = self._pump(set(ranks), "pong", msg_id=0, deadline=time.monotonic() + 10)
        t1 = time.time()
        self.offsets = {r: pongs[r]["time"] - (t0 + t1) / 2 for r in ranks}

    def _kill_ranks(self) -> None:
        pids = list(self.pids.values())
        if self.server is not None:  # also ranks forked before an interrupted start-up
            with self.server.cond:
                pids += [p for (g, _), p in self.server.spawned.items() if g == self.gen]
            pids = sorted(set(pids))
        self.pids = {}
        if self.server is not None and pids:
            self.server.signal(pids, signal.SIGKILL)
            self.server.wait_exited(pids, timeout=5)

    def restart(self, world_size: int | None = None) -> Lab:
        """Kill the ranks and fork new ones (variables on the ranks are lost). Kernel side."""
        if self.attached:
            raise LabError(
                "this lab's ranks were started by torchrun, not by labkit, so labkit cannot "
                "restart them: stop the torchrun job (Ctrl-C in its terminal, or scancel), "
                "then call Lab.attach(...) again and start torchrun with the command it prints"
            )
        with self._lock:
            if self.closed:
                raise LabError("this lab was stopped; create a new one with labkit.Lab(n)")
            if world_size is not None:
                check_world_size(world_size)
                self.requested = (world_size, *self.requested[1:])
            self._kill_ranks()
            if world_size is not None or self.choice is None:
                assert self.server is not None
                self.choice = choose(*self.requested, self.server.wait_facts())
            self._spawn_ranks()
            return self

    def stop(self) -> None:
        """End the ranks and the fork server (kernel side). Safe to call twice."""
        global _current
        with self._lock:
            if self.closed:
                return
            pids = list(self.pids.values())
            if self.attached and pids:  # ask torchrun's ranks to leave; their job then ends
                try:
                    self._send(self.pids, {"type": "exit"})
                    time.sleep(0.2)
                except zmq.ZMQError:
                    pass
            if self.server is not None and pids:
                self.server.signal(pids, signal.SIGTERM)
                if not self.server.wait_exited(pids, timeout=1.0):
                    self.server.signal(pids, signal.SIGKILL)
                    self.server.wait_exited(pids, timeout=5)
            self.pids = {}
            self.closed = True
            if self.server is not None:
                self.server.close()
            self._io.join(timeout=2)
            self.ctx.destroy(linger=0)
            os.close(self.wake_r)
            os.close(self.wake_w)
            shutil.rmtree(self.sock_dir, ignore_errors=True)
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

    # -- the one waiting loop ---------------------------------------------------------------
    def _send(self, ranks: Iterable[int], msg: dict[str, Any]) -> None:
        frames = self.codec.encode(msg)
        for r in ranks:
            ident = self.routes.get(r) or f"r{r}".encode()
            self.ctrl.send_multipart([ident, *frames], copy=False)

    def _pump(
        self,
        pending: set[int],
        expect: str,
        *,
        msg_id: int | None = None,
        deadline: float | None = None,
        replies: dict[int, dict[str, Any]] | None = None,
        watch: Callable[[set[int]], None] | None = None,
    ) -> dict[int, dict[str, Any]]:
        replies = {} if replies is None else replies
        pending = set(pending) - set(replies)
        while pending:
            ready = dict(self.poller.poll(100))
            if self.ctrl in ready:
                while self.ctrl.poll(0):
                    frames = self.ctrl.recv_multipart(copy=False)
                    try:
                        msg = self.codec.decode(frames[1:])
                    except AuthenticationError as exc:
                        self.rejected += 1
                        warnings.warn(
                            f"labkit rejected a message: {exc}", LabkitWarning, stacklevel=2
                        )
                        continue
                    except Exception as exc:  # noqa: BLE001 - signed, but the kernel cannot unpickle it
                        msg = self._undecodable(frames[0].bytes, exc, expect, msg_id)
                        if msg is None:
                            continue
                    if msg.get("gen") != self.gen:
                        continue
                    self.routes[msg["rank"]] = frames[0].bytes
                    if msg["type"] == "fatal":
                        err = msg["error"]
                        raise LabError(
                            f"rank {msg['rank']} failed to start: {err['type']}: "
                            f"{err['message']}\n{err['traceback']}"
                        )
                    if msg["type"] == expect and msg.get("id") == msg_id:
                        replies[msg["rank"]] = msg
                        pending.discard(msg["rank"])
            if self.wake_r in ready:
                try:
                    os.read(self.wake_r, 65536)
                except BlockingIOError:
                    pass
            self._drain_events(pending)
            if deadline is not None and time.monotonic() > deadline and pending:
                raise _Stuck(f"no reply from rank(s) {sorted(pending)} in time")
            if watch is not None:
                watch(pending)
        return replies

    def _undecodable(
        self, ident: bytes, exc: Exception, expect: str, msg_id: int | None
    ) -> dict[str, Any] | None:
        """A genuine reply whose value the kernel cannot rebuild: report it, do not hang."""
        rank = next((r for r, i in self.routes.items() if i == ident), None)
        if rank is None or expect != "done":
            return None
        return {
            "type": "done",
            "id": msg_id,
            "rank": rank,
            "gen": self.gen,
            "error": None,
            "value_error": f"the value could not be rebuilt in the kernel: "
            f"{type(exc).__name__}: {exc}",
        }

    def log_tail(self, rank: int, lines: int = 12) -> str:
        """The last lines of a rank's log (what it printed last, even if it crashed)."""
        path = os.path.join(self.log_dir, f"rank-{rank}.log")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        text = text[text.rfind(LOG_HEADER) :]  # only this process's output
        keep = [line for line in text.splitlines(True)[1:] if not _NOISE.search(line)]
        return "".join(keep[-lines:]).rstrip()

    def _drain_events(self, pending: set[int]) -> None:
        while self.events:
            kind, *rest = self.events.popleft()
            if kind == "stream":
                self._show_stream(rest[0])
            elif kind == "exit":
                rank, code = rest
                how = (
                    f"killed by signal {signal.Signals(-code).name}"
                    if code < 0
                    else f"exited with code {code}"
                )
                text = f"rank {rank} died ({how})"
                tail = self.log_tail(rank)
                if tail:
                    last = "".join(f"  | {line}" for line in tail.splitlines(True))
                    text += f"; its last output (all of it: %lab logs {rank}):\n{last.rstrip()}"
                raise _Stuck(text, died=rank)
            elif kind == "rejected":
                warnings.warn(f"labkit rejected a message: {rest[0]}", LabkitWarning, stacklevel=3)

    def _show_stream(self, msg: dict[str, Any]) -> None:
        self._seen_seq[msg["rank"]] = msg["seq"]
        self.output.show(msg)

    def _catch_up_streams(self, replies: dict[int, dict[str, Any]]) -> None:
        """Output travels beside replies: wait (briefly) for every line sent before `done`."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            self._drain_events(set())
            if all(self._seen_seq.get(r, 0) >= m.get("stream_seq", 0) for r, m in replies.items()):
                return
            time.sleep(0.001)

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
        self._drain_events(set())

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
        had to be stopped (then the ranks were restarted).
        """
        with self._lock:
            self._check_usable()
            targets = self.ranks(ranks)
            msg: dict[str, Any] = {"type": "exec", "display": display}
            if callable(code_or_function):
                import cloudpickle

                msg["fn"] = cloudpickle.dumps(code_or_function)
            elif isinstance(code_or_function, str):
                ast.parse(code_or_function, "<cell>")  # a SyntaxError surfaces here, once
                msg["code"] = code_or_function
                if len(targets) < self.world_size and _COLLECTIVE.search(code_or_function):
                    absent = sorted(set(range(self.world_size)) - set(targets))
                    warnings.warn(
                        f"this cell runs on ranks {targets} only, and it calls a collective; a "
                        f"collective on the whole group waits for ranks {absent} forever "
                        "(labkit will stop it). Use a group: dist.new_group(...)",
                        LabkitWarning,
                        stacklevel=2,
                    )
            else:
                raise TypeError(
                    "run() takes code as a str or a function, got "
                    f"{type(code_or_function).__name__}"
                )
            self._cell += 1
            msg["id"] = cell = self._cell
            return self._run_cell(cell, msg, targets, timeout or self.timeout)

    def _run_cell(
        self, cell: int, msg: dict[str, Any], targets: list[int], timeout: float | None
    ) -> Results:
        self.output.reset()
        replies: dict[int, dict[str, Any]] = {}
        live = LiveStatus(targets, lab=self)
        started = time.monotonic()
        deadline = started + timeout if timeout else None

        def watch(pending: set[int]) -> None:
            states = self._cell_states(cell, targets, pending, replies)
            live.update(states, time.monotonic() - started)
            blocked = {
                s.rank: dict(s.op, blocked_s=s.blocked_s)
                for s in states
                if s.op is not None and s.state == "running"
            }
            why_not = {s.rank: s.state for s in states if s.state != "running"}
            progress = {r: m.get("progress") for r, m in replies.items()}
            for r in pending:
                st = self.status.get(r, {})
                if st.get("busy") == cell:
                    progress[r] = st.get("progress")
            reason = diagnose(blocked, set(pending), why_not, progress=progress)
            if reason:
                raise _Stuck(reason)
            if self.attached:  # no fork server reports their deaths: watch the heartbeats
                now = time.monotonic()
                for r in sorted(pending):
                    seen = self.status.get(r, {}).get("received", started)
                    if now - max(seen, started) > HEARTBEAT_LOST:
                        raise _Stuck(
                            f"rank {r} sent no heartbeat for {HEARTBEAT_LOST:.0f} s: its process "
                            "may have died (see torchrun's output on its node)"
                        )

        self._send(targets, msg)
        try:
            try:
                self._pump(
                    set(targets),
                    "done",
                    msg_id=cell,
                    deadline=deadline,
                    replies=replies,
                    watch=watch,
                )
            except KeyboardInterrupt:
                self._stop_cell(cell, targets, replies, watch)
        except _Stuck as stuck:
            if deadline is not None and time.monotonic() > deadline:
                stuck = _Stuck(f"the cell ran past its timeout of {timeout} s ({stuck})")
            self._recover(str(stuck), replies, started, died=stuck.died)
        finally:
            live.close()
        self._catch_up_streams(replies)
        return self._results(replies)

    def _stop_cell(
        self,
        cell: int,
        targets: list[int],
        replies: dict[int, dict[str, Any]],
        watch: Callable[[set[int]], None],
    ) -> None:
        """Stop pressed: SIGINT the running ranks; if they do not stop, recover."""
        running = [r for r in targets if r not in replies]
        if self.attached:
            for r in running:
                self._side_out.append((r, {"type": "interrupt", "cell": cell}))
        else:
            assert self.server is not None
            self.server.signal([self.pids[r] for r in running], signal.SIGINT)
        try:
            self._pump(
                set(running),
                "done",
                msg_id=cell,
                deadline=time.monotonic() + STOP_GRACE,
                replies=replies,
                watch=watch,
            )
        except KeyboardInterrupt:
            raise _Stuck("Stop was pressed twice") from None
        except _Stuck as stuck:
            still = sorted(set(running) - set(replies))
            raise _Stuck(
                f"Stop was pressed, and rank(s) {still} did not stop within "
                f"{STOP_GRACE:.0f} s ({stuck})"
            ) from None

    def _cell_states(
        self, cell: int, targets: list[int], pending: set[int], replies: dict[int, dict[str, Any]]
    ) -> list[CellState]:
        states = []
        for r in range(self.world_size):
            if r in pending:
                st = self.status.get(r, {})
                op = st.get("op") if st.get("busy") == cell else None
                blocked = st["time"] - op["since"] if op else 0.0
                states.append(CellState(r, "running", st.get("line"), op, blocked))
            elif r in replies:
                err = replies[r].get("error")
                states.append(CellState(r, f"raised {err['type']}" if err else "finished"))
            elif r in self.dead:
                states.append(CellState(r, "died"))
            else:
                states.append(CellState(r, "is not running this cell"))
        return states

    def _recover(
        self,
        reason: str,
        replies: dict[int, dict[str, Any]],
        started: float,
        died: int | None = None,
    ) -> None:
        t0 = time.monotonic()
        if self.attached:  # torchrun's ranks: labkit can neither kill nor re-fork them
            self.broken = (
                f"{reason}\nThe ranks were started by torchrun, so labkit cannot restart them: "
                "stop the torchrun job (Ctrl-C in its terminal, or scancel), call "
                "Lab.attach(...) again and rerun the torchrun command it prints."
            )
            errors = {r: m["error"] for r, m in replies.items() if m.get("error")}
            if errors:
                raise RemoteError(errors, self.broken)
            raise LabError(self.broken)
        self.restart()
        errors = {r: m["error"] for r, m in replies.items() if m.get("error")}
        if errors and died is not None:  # the death is the root cause; the peers' errors follow
            reason += f"\nbecause rank {died} died, " + "; ".join(
                f"rank {r} raised {e['type']}: {(e['message'].splitlines() or [''])[0][:160]}"
                for r, e in sorted(errors.items())
            )
        note = (
            f"{reason}\nlabkit stopped the cell after {t0 - started:.1f} s and restarted the "
            f"ranks in {time.monotonic() - t0:.2f} s: variables on the ranks were lost."
        )
        if errors and died is None:
            raise RemoteError(errors, note)
        raise LabError(note)

    def _results(self, replies: dict[int, dict[str, Any]]) -> Results:
        results = Results()
        for r, m in sorted(replies.items()):
            err = m.get("error")
            if err is not None and r in self.offsets:
                err["time"] -= self.offsets[r]
            results[r] = RankResult(
                r,
                m.get("value"),
                self.output.of(r),
                m.get("duration", 0.0),
                err,
                m.get("display"),
                m.get("value_error"),
            )
        return results

    def _request(self, msg: dict[str, Any], ranks: Any = None) -> Results:
        with self._lock:
            self._check_usable()
            targets = self.ranks(ranks)
            self._cell += 1
            msg["id"] = self._cell
            self.output.reset()
            self._send(targets, msg)
            try:
                replies = self._pump(
                    set(targets), "done", msg_id=self._cell, deadline=time.monotonic() + 60
                )
            except _Stuck as stuck:
                self._recover(str(stuck), {}, time.monotonic())
                raise  # unreachable: _recover raises
            return self._results(replies)

    def pull(self, name: str, ranks: Any = None) -> dict[int, Any]:
        """{rank: value} of a name (or attribute path) on the ranks; tensors arrive on the CPU."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"pull() takes a variable name such as 'x', got {name!r}")
        results = self._request({"type": "pull", "name": name}, ranks)
        results.raise_for_errors()
        for r, res in results.items():
            if res.value_error:
                raise LabError(f"pull({name!r}) from rank {r}: {res.value_error}")
        return results.values_by_rank

    def push(self, ranks: Any = None, **names: Any) -> None:
        """Bind names on the ranks: `lab.push(lr=0.1)` (tensors arrive on the ranks' CPU)."""
        if not names:
            raise ValueError("push() needs names to bind, e.g. lab.push(lr=0.1)")
        self._request({"type": "push", "names": names}, ranks).raise_for_errors()

    def trace(self, cell: int | None = None, *, enabled: bool | None = None) -> list[Any]:
        """Comm and span records of the last cell (or `cell`), on the kernel's clock."""
        msg: dict[str, Any] = {"type": "trace", "cell": cell}
        if enabled is not None:
            msg["enabled"] = enabled
        results = self._request(msg)
        records = []
        for r, res in results.items():
            for rec in res.value or []:
                rec.start -= self.offsets.get(r, 0.0)
                if rec.end:
                    rec.end -= self.offsets.get(r, 0.0)
                records.append(rec)
        return sorted(records, key=lambda rec: (rec.start, rec.rank))

    @property
    def last_cell(self) -> int:
        return self._cell

    def ranks_info(self) -> list[dict[str, Any]]:
        """One dict per rank: rank, pid, host, device, backend, num_cpus."""
        return [
            {
                "rank": r,
                "pid": self.pids.get(r),
                "host": h.get("host"),
                "device": h.get("device"),
                "backend": h.get("backend"),
                "num_cpus": h.get("num_cpus"),
            }
            for r, h in sorted(self.info.items())
        ]

    def status_report(self) -> dict[str, Any]:
        """What `%lab status` shows: the choice, and per rank its pid, device and liveness."""
        now = time.monotonic()
        rows = []
        for info in self.ranks_info():
            r = info["rank"]
            st = self.status.get(r, {})
            age = now - st["received"] if "received" in st else None
            alive = r not in self.dead and (age is None or age < 5)
            rows.append(
                dict(info, alive=alive, busy=st.get("busy") is not None, heartbeat_age_s=age)
            )
        return {
            "running": self.running,
            "world_size": self.world_size,
            "backend": self.backend,
            "choice": self.choice.reason if self.choice else "",
            "log_dir": self.log_dir,
            "ranks": rows,
        }
