"""The clean parent of a lab's ranks (runs as its own process, started by the kernel).

Started as `python -m labkit.rank.fork_server KERNEL_PID`, it imports torch once, never touches CUDA
(GPUs are counted through NVML), and then forks one rank per `spawn` request, so a start or a
restart costs a fork instead of a torch import, and CUDA used in the kernel cannot poison a rank.

It talks to the kernel over its stdin/stdout pipes, one JSON object per line (typed in
`labkit.wire.messages`):

    kernel -> server: SpawnCommand {"cmd": "spawn", "cfg": RankConfig.to_wire()}
                      SignalCommand {"cmd": "signal", "pids": [...], "sig": 9}   ExitCommand
    server -> kernel: ServerHello {"type": "facts", ...}   Spawned {"type": "spawned", ...}
                      Exited {"type": "exited", "pid": p, "rank": r, "code": c (< 0: signal)}

It creates each rank's stdout/stderr pipes before the fork and keeps a copy of their read ends:
when a rank dies, whatever it wrote that its own reader thread had not yet consumed (the last
lines before a segfault, `os._exit` or SIGKILL) is drained into the rank's log before the
kernel hears of the exit, so output written before a fault is never lost.

It only signals pids it forked and has not yet reaped, so a recycled pid is never hit. When the
kernel dies (stdin closes, or the parent-death signal, SIGTERM here), it kills its ranks,
removes the labs' shared-memory directories (`labkit.wire.shm`) and leaves; each rank in turn
dies with the server (parent-death signal and a heartbeat check of its parent pid).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import sys
import time

from labkit.rank.capture import MARKER
from labkit.wire import shm
from labkit.wire.config import RankConfig
from labkit.wire.framed import SCHEME
from labkit.wire.logfile import log_path
from labkit.wire.messages import Exited, ServerHello, ServerToKernel, Spawned, Warm

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies; leave now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: the heartbeat checks still apply
        pass
    if os.getppid() != parent:
        os._exit(1)


def facts() -> ServerHello:
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ServerHello(
        type="facts",
        torch=torch.__version__,
        gpus=gpus,
        cuda=torch.version.cuda,
        gloo=dist.is_gloo_available(),
        nccl=dist.is_nccl_available(),
        mpi=dist.is_mpi_available(),
        cpus=os.cpu_count(),
        pid=os.getpid(),
        python=sys.version.split()[0],
    )


class Server:
    def __init__(self, parent: int) -> None:
        self.parent = parent  # the kernel
        self.log_path: str | None = None  # where the kernel sends this process's stderr
        self.children: dict[int, int] = {}  # pid -> rank
        self.shm_dirs: set[str] = set()  # the labs' shared-memory directories, removed at exit
        # the labs' private socket directories (ctrl, side, the Stop board): their kernel
        # removes them at a stop; removed here when the kernel died without that
        self.sock_dirs: set[str] = set()
        self.pipes: dict[int, tuple[list[int], str | None]] = {}  # pid -> (read fds, log path)
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # the kernel died (PDEATHSIG), or someone else ended this server while its kernel
        # lives on
        signal.signal(signal.SIGTERM, lambda *_: self.leave(self._parent_gone(within=1.0)))

    def leave(self, kernel_gone: bool = False) -> None:
        """Kill the ranks, remove the labs' shared-memory segments (and, `kernel_gone`, their
        socket directories and this server's log, which a live kernel removes itself), and exit."""
        self.kill(list(self.children), signal.SIGKILL)
        for directory in self.shm_dirs:
            shm.remove(directory)
        if kernel_gone:
            for directory in self.sock_dirs:
                shutil.rmtree(directory, ignore_errors=True)
            if self.log_path:  # this server's own log: nobody is left to read it
                try:
                    os.unlink(self.log_path)
                except OSError:
                    pass
        os._exit(0)

    def say(self, msg: ServerToKernel) -> None:
        self.out.write(json.dumps(msg) + "\n")

    def spawn(self, cfg: RankConfig) -> None:
        pipes = [output_pipe(), output_pipe()]  # stdout, stderr: (read, write)
        cfg = dataclasses.replace(cfg, capture_fds=(pipes[0][0], pipes[1][0]))
        if cfg.shm_dir is not None:
            self.shm_dirs.add(cfg.shm_dir)
        if (sock_dir := _sock_dir(cfg)) is not None:
            self.sock_dirs.add(sock_dir)
        pid = os.fork()
        if pid == 0:
            os.dup2(pipes[0][1], 1)
            os.dup2(pipes[1][1], 2)
            for _, w in pipes:
                os.close(w)
            self._child(cfg)
        for _, w in pipes:
            os.close(w)
        for r, _ in pipes:
            os.set_blocking(r, False)
        log = log_path(cfg.log_dir, cfg.rank) if cfg.log_dir else None
        self.pipes[pid] = ([r for r, _ in pipes], log)
        self.children[pid] = cfg.rank
        self.say(Spawned(type="spawned", rank=cfg.rank, pid=pid, gen=cfg.gen))

    def _child(self, cfg: RankConfig) -> None:
        try:
            parent = os.getppid()
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):  # the server's handlers
                signal.signal(sig, signal.SIG_DFL)
            os.setpgid(0, 0)  # its own group: a signal to one rank never reaches another
            die_with_parent(parent)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            others = [fd for fds, _ in self.pipes.values() for fd in fds]  # other ranks' pipes
            for fd in (devnull, self.wake_r, self.wake_w, self.out.fileno(), *others):
                os.close(fd)
            from labkit.rank import worker

            worker.run(cfg)
        finally:
            os._exit(1)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rank = self.children.pop(pid, None)
            self.drain(pid)
            self.say(
                Exited(type="exited", pid=pid, rank=rank, code=os.waitstatus_to_exitcode(status))
            )

    def drain(self, pid: int) -> None:
        """Append what a dead rank left unread in its pipes to its log, then close them."""
        fds, log = self.pipes.pop(pid, ([], None))
        drain_into_log(fds, log)

    def kill(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            if pid in self.children:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def serve(self) -> None:
        stdin = sys.stdin.buffer
        buf = b""
        warmed = False
        while True:
            try:
                ready, _, _ = select.select([0, self.wake_r], [], [], 1.0 if warmed else 0.3)
            except InterruptedError:
                continue
            if not ready and not warmed:
                warm_up()
                warmed = True
                self.say(Warm(type="warm"))
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self.reap()
            if 0 not in ready:
                continue
            data = os.read(0, 65536)
            if not data:  # the kernel is gone (a live one says `exit` first)
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg["cmd"] == "spawn":
                    self.spawn(RankConfig.from_wire(msg["cfg"]))
                elif msg["cmd"] == "signal":
                    self.kill(msg["pids"], msg["sig"])
                elif msg["cmd"] == "exit":
                    self.leave()
        del stdin
        self.leave(kernel_gone=self._parent_gone(within=1.0))

    def _parent_gone(self, within: float) -> bool:
        """Whether the kernel died: this process gets a new parent then, once the kernel's
        last thread has ended. PDEATHSIG comes as the thread that forked this server ends, and
        stdin closes as the dying kernel's files are closed: both can come a moment before."""
        deadline = time.monotonic() + within
        while os.getppid() == self.parent:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


def _sock_dir(cfg: RankConfig) -> str | None:
    """The kernel's private socket directory a forked rank's ctrl link is in (None: none, or
    not a directory labkit made: `labkit-*` from tempfile.mkdtemp)."""
    if not cfg.ctrl.startswith(SCHEME):
        return None
    directory = os.path.dirname(cfg.ctrl.removeprefix(SCHEME))
    return directory if os.path.basename(directory).startswith("labkit-") else None


def warm_up() -> None:
    """Import what a rank's first optimizer would (torch._dynamo, ~1-2 s), while nobody waits.

    Done once the server has been idle for a moment, so it never delays the first fork; every
    rank forked after it skips that import (4 ranks importing it at once took 8-10 s each).
    """
    try:
        import torch._dynamo  # noqa: F401
        import torch.optim  # noqa: F401
    except Exception:  # noqa: BLE001 - an optional speed-up; ranks import it themselves if needed
        pass


def output_pipe() -> tuple[int, int]:
    """(read end, write end) for a rank's stdout or stderr: a Unix socket pair rather than a
    pipe, so the rank's reader can log bytes before it takes them (labkit.rank.capture) and
    whatever it has not taken when it dies is still there for `drain_into_log`."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return a.detach(), b.detach()


def drain_into_log(fds: list[int], log: str | None) -> None:
    """Read what is left in a dead rank's (non-blocking) pipes, append it to its log, and close
    them. Runs in the process that outlives the rank: the fork server, or a test in its place."""
    for fd in fds:
        data = b""
        try:
            while len(data) < (64 << 20):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                data += chunk
        except (BlockingIOError, OSError):  # empty (a grandchild may still hold it open)
            pass
        os.close(fd)
        data = data.replace(MARKER, b"")
        if data and log:
            try:
                with open(log, "ab") as f:
                    f.write(data)
            except OSError:
                pass


def main() -> None:
    parent = int(sys.argv[1])
    die_with_parent(parent, signal.SIGTERM)  # handled: its ranks and segments go with it
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # count GPUs without initialising CUDA
    server = Server(parent)
    server.log_path = sys.argv[2] if len(sys.argv) > 2 else None
    import torch  # noqa: F401 - the point of this process: import once, fork many times
    import torch.distributed  # noqa: F401

    import labkit.rank.worker  # noqa: F401 - so a fork needs no imports

    server.say(facts())
    server.serve()


if __name__ == "__main__":
    main()
