"""The kernel's handle on a fork server: start it, fork ranks, signal them (kernel side).

A fork server is started with `sys.executable -m labkit.rank.fork_server` in its own session (so a
terminal's Ctrl-C does not hit it), with stderr going to a log file. A reader thread parses its
messages (JSON lines, typed in `labkit.wire.messages`); rank exits are handed to `on_exit`.

One spare server is kept warm, so the next `Lab` pays for a fork, not for importing torch: the
one `prewarm()` starts, or the server of a lab that stopped cleanly (`release`: all its ranks
forked, reported and exited). A spare is used only while what its ranks inherit from it is
what the kernel has now (working directory, environment, umask, nice level, CPUs, resource
limits: `_origin`); otherwise it is closed and a new one started. Code changed on disk is not
seen by a spare that imported it before: restart the kernel. The spare is closed when the
kernel exits; LABKIT_PREWARM=0 keeps none.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import labkit
from labkit.kernel.channel.sigint import uninterrupted
from labkit.kernel.inspection import log_dirs
from labkit.wire.config import RankConfig
from labkit.wire.messages import (
    ExitCommand,
    KernelToServer,
    ServerHello,
    ServerToKernel,
    SignalCommand,
    SpawnCommand,
)


def _umask() -> str | None:
    try:
        with open("/proc/self/status") as f:
            return next((line.split()[1] for line in f if line.startswith("Umask:")), None)
    except OSError:
        return None


def _origin() -> tuple:
    """What a fork server's ranks inherit from the kernel, as it is now: the working directory
    (its path and the directory itself: one removed and made again is another), the
    environment, the umask, the nice level, the CPUs it may run on and its resource limits."""
    try:
        here = os.stat(".")
        cwd: tuple = (os.getcwd(), here.st_ino, here.st_dev)
    except OSError:  # the directory was removed
        cwd = ()
    limits = tuple(
        resource.getrlimit(getattr(resource, name))
        for name in ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_MEMLOCK", "RLIMIT_NPROC")
        if hasattr(resource, name)
    )
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return cwd, dict(os.environ), _umask(), os.getpriority(os.PRIO_PROCESS, 0), affinity, limits


class ForkServer:
    def __init__(self) -> None:
        self.origin = _origin()
        self.owner = os.getpid()  # the kernel (a process forked from it must not close it)
        # Linux's parent-death signal follows the thread that starts the server: only one
        # started on the main thread outlives the lab that started it (`release`)
        self.on_main_thread = threading.current_thread() is threading.main_thread()
        root = os.path.dirname(os.path.dirname(os.path.abspath(labkit.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.log_path = log_dirs.fork_server_log()
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "labkit.rank.fork_server", str(os.getpid()), self.log_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            start_new_session=True,
        )
        self.facts: ServerHello | None = None
        self.warm = False  # its warm-up imports (labkit.rank.fork_server.warm_up) are done
        self.spawned: dict[tuple[int, int], int] = {}  # (gen, rank) -> pid
        self.asked = 0  # spawn commands sent (a clean server has reported as many `spawned`)
        # generations ended while starting (Stop, an error): a rank of one reported later
        # (forked after the kill was decided, on a busy machine) is killed when it is reported
        self.ended_gens: set[int] = set()
        self.exited: dict[int, int] = {}  # pid -> exit code (negative: signal)
        self.on_exit: Callable[[int, int | None, int], None] | None = None
        self.cond = threading.Condition()
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="labkit-forkserver", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self._handle(json.loads(line))
        except (ValueError, OSError):  # closed by close() while reading
            pass
        with self.cond:
            self.cond.notify_all()

    def _handle(self, msg: ServerToKernel) -> None:
        on_exit = None
        with self.cond:
            if msg["type"] == "facts":
                self.facts = msg
            elif msg["type"] == "spawned":
                self.spawned[(msg["gen"], msg["rank"])] = msg["pid"]
                self.exited.pop(msg["pid"], None)  # a pid used again: this one runs
                if msg["gen"] in self.ended_gens:
                    self.signal([msg["pid"]], signal.SIGKILL)
            elif msg["type"] == "exited":
                self.exited[msg["pid"]] = msg["code"]
                on_exit = self.on_exit  # the lab's, read with the exit (`reset` clears it)
            elif msg["type"] == "warm":
                self.warm = True
            self.cond.notify_all()
        if on_exit is not None:
            try:
                on_exit(msg["pid"], msg["rank"], msg["code"])
            except Exception as e:  # noqa: BLE001 - the reader must outlive a lab's handler
                print(f"labkit: a rank's exit was not handled: {e!r}", file=sys.stderr)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def reusable(self) -> bool:
        """Whether a lab may fork from this idle server: it and its reader run, this process
        started it, and what its ranks would inherit is what the kernel has now."""
        return (
            self.owner == os.getpid()
            and self.alive()
            and self.reader.is_alive()
            and self.origin == _origin()
        )

    def wait_facts(self, timeout: float = 120.0) -> ServerHello:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.facts is None:
                if not self.alive():
                    raise RuntimeError(
                        "the labkit fork server exited while starting; its log:\n" + self.read_log()
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the labkit fork server did not start in {timeout:.0f} s")
                self.cond.wait(min(left, 0.1))
        return self.facts

    def wait_warm(self, timeout: float = 60.0) -> bool:
        """Wait until the server's one-off warm-up (it imports torch._dynamo once it has been
        idle a moment) is done, so it no longer takes a core; False if it is not by `timeout`
        (the benchmark waits, so the import does not land in its timings)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.warm and self.alive() and time.monotonic() < deadline:
                self.cond.wait(0.1)
            return self.warm

    def read_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def _send(self, msg: KernelToServer) -> None:
        with self.lock:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]

    def spawn(self, cfg: RankConfig) -> None:
        """Fork one rank (`cfg` was checked when it was built, in the kernel)."""
        with self.cond:
            self.asked += 1
        self._send(SpawnCommand(cmd="spawn", cfg=cfg.to_wire()))

    def wait_pids(self, gen: int, ranks: list[int], timeout: float = 10.0) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all((gen, r) in self.spawned for r in ranks):
                if not self.alive() or time.monotonic() > deadline:
                    done = sum((gen, r) in self.spawned for r in ranks)
                    why = "it exited" if not self.alive() else f"not all in {timeout:.0f} s"
                    tail = self.read_log().strip() if not self.alive() else ""
                    raise RuntimeError(
                        f"the labkit fork server forked {done} of {len(ranks)} ranks ({why}); "
                        f"its log: {self.log_path}" + (f", which ends:\n{tail}" if tail else "")
                    )
                self.cond.wait(0.05)
            return {r: self.spawned[(gen, r)] for r in ranks}

    def signal(self, pids: list[int], sig: int) -> None:
        """Signal ranks this server forked (the server skips any pid it already reaped)."""
        if pids and self.alive():
            self._send(SignalCommand(cmd="signal", pids=pids, sig=int(sig)))

    def wait_exited(self, pids: list[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(p in self.exited for p in pids):
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive():
                    return False
                self.cond.wait(min(left, 0.05))
        return True

    def reset(self) -> bool:
        """Forget the ranks of the lab that used this server, if it is clean: alive, every rank
        asked for forked and reported, every one reported exited (so no late message of that lab
        can reach the next one's). False, and nothing forgotten, otherwise."""
        with self.cond:
            clean = (
                self.alive()
                and self.asked == len(self.spawned)
                and all(pid in self.exited for pid in self.spawned.values())
            )
            if clean:
                self.spawned.clear()
                self.exited.clear()
                self.ended_gens.clear()
                self.asked = 0
                self.on_exit = None
            return clean

    def close(self) -> None:
        if self.alive():
            try:
                self._send(ExitCommand(cmd="exit"))
                self.proc.stdin.close()  # type: ignore[union-attr]
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)  # our own child, by its Popen handle
                self.proc.wait()
        self.log.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


_spare: ForkServer | None = None
_spare_lock = threading.Lock()


def _drop(server: ForkServer | None) -> None:
    """Close a server this process started; forget one a parent started (a forked child)."""
    if server is not None and server.owner == os.getpid():
        server.close()


def keeps_spare() -> bool:
    """LABKIT_PREWARM=0: no spare server (none prewarmed, none kept after a stop)."""
    return os.environ.get("LABKIT_PREWARM", "1") != "0"


def prewarm() -> None:
    """Start a spare fork server now, so the next Lab does not wait for torch to import."""
    global _spare
    with _spare_lock:
        if _spare is not None and _spare.reusable():
            return
        stale, _spare = _spare, ForkServer()
    _drop(stale)


def take() -> ForkServer:
    """A started fork server: the spare if it is `reusable()`, else a new one."""
    global _spare
    with _spare_lock:
        server, _spare = _spare, None
    if server is not None and server.reusable():
        return server
    _drop(server)
    return ForkServer()


def release(server: ForkServer) -> None:
    """After a lab's stop: keep its fork server as the spare when it is clean
    (`ForkServer.reset`), reusable and started on the main thread, and no reusable spare is
    kept already (LABKIT_PREWARM=0: never); close it otherwise."""
    global _spare
    with uninterrupted():  # a Stop here must not lose the server before it is kept or closed
        keep = keeps_spare() and server.on_main_thread and server.reset() and server.reusable()
        with _spare_lock:
            if keep and (_spare is None or not _spare.reusable()):
                server, _spare = _spare, server  # the stale or dead spare is closed instead
        _drop(server)


@atexit.register  # after labkit.kernel.lab's `_stop_all` (registered later, so run earlier)
def close_spare() -> None:
    """Close the spare (at the kernel's exit; tests call it to end their run cleanly)."""
    global _spare
    with _spare_lock:
        server, _spare = _spare, None
    _drop(server)
