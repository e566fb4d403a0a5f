"""The rank process: a persistent namespace that runs the kernel's cells (runs on the rank).

A rank is forked by `labkit.rank.fork_server` (or started by torchrun with `--connect`), connects
two sockets to the kernel and serves requests until told to exit:

- `ctrl` (main thread only, this module; a forked rank's is a plain Unix stream socket,
  labkit.rank.link, an attached rank's a ZeroMQ DEALER over TCP): requests in (`init`,
  `exec`, `pull`, `push`, `trace`, `ping`, `exit`), replies out (`hello`, `ready`, `done`,
  `pong`, `fatal`).
- `side` (any thread, behind a lock; labkit.rank.side): output lines, the heartbeat, and what
  the kernel sends beside the requests: Stop (latched, never lost), `leave`, `ask_stacks`.

`side` is a ZeroMQ DEALER. No socket sets a ZeroMQ identity: the kernel routes to the socket
that proved who it is with a signed message, so another process cannot take over a rank's
route by claiming its name.

The messages are typed in `labkit.wire.messages`; what a rank starts with, in `RankConfig`.

Rank 0 binds the rendezvous store on port 0 and reports the real port in its `hello`; the kernel
passes it to every rank in `init`, and each rank then joins the process group. Ctrl-C reaches a
rank as SIGINT and raises KeyboardInterrupt only while user code runs.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import builtins
import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
import time
import types
from typing import Any

import zmq

from labkit.rank import debugger, process_group, progress, torch_compat, trace
from labkit.rank.capture import Capture
from labkit.rank.link import CtrlLink
from labkit.rank.side import SideChannel
from labkit.rank.user_code import (
    call_function,
    describe,
    format_error,
    no_input,
    run_code,
)
from labkit.wire.codec import Codec
from labkit.wire.config import RankConfig
from labkit.wire.framed import SCHEME, LinkBroken, header
from labkit.wire.key_file import remove_orphaned_key
from labkit.wire.logfile import log_path
from labkit.wire.messages import (
    Debug,
    Done,
    Exec,
    Fatal,
    Hello,
    Init,
    Ping,
    Pong,
    Pull,
    Push,
    RankToKernel,
    Ready,
    Stacks,
    Stream,
    Trace,
)
from labkit.wire.stop_board import StopBoard

REQUESTS = ("exec", "pull", "push", "trace", "debug")  # requests with a cell id, taken at most once
MAX_VALUE_BYTES = 1 << 30  # what a value may add to its reply (tensors in /dev/shm do not count)


class Rank(SideChannel):
    def __init__(self, cfg: RankConfig):
        self.cfg = cfg
        self.rank = cfg.rank
        self.gen = cfg.gen
        self.codec = Codec(cfg.key, cfg.shm_dir, recycle=True)  # its one receiver: the kernel
        self.ctx = zmq.Context()
        self.ctrl = self._connect(cfg.ctrl)
        self.side = self._connect(cfg.side)
        self.side_lock = threading.Lock()
        self.stream_seq = 0
        self.busy_cell: int | None = None
        self.quiet_since = time.monotonic()
        self.in_user_code = False
        self.taken = 0  # the id of the last request taken (ids only grow)
        self.stop_cell: int | None = None  # Stop latched for this cell
        self.stopped_at = 0.0  # when KeyboardInterrupt was last raised for it
        self.stacks_out: list[Stacks] = []  # answers to `ask_stacks`, sent after `side_lock`
        self.board = StopBoard(cfg.stop_board) if cfg.stop_board else None
        self.store: Any = None
        self.ns: dict[str, Any] = {}

    def _connect(self, endpoint: str) -> Any:
        if endpoint.startswith(SCHEME):  # a forked rank's ctrl: no ZeroMQ thread in between
            return CtrlLink(endpoint)
        sock = self.ctx.socket(zmq.DEALER)  # no identity: the kernel routes by signed messages
        if self.cfg.attached:  # over TCP: notice a kernel that is gone
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        return sock

    # -- sending ---------------------------------------------------------------------------
    def reply(self, msg: RankToKernel) -> None:
        self.ctrl.send_multipart(self._encode(msg), copy=False)

    def _encode(self, msg: RankToKernel) -> list[Any]:
        msg.update(rank=self.rank, gen=self.gen)
        return self.codec.encode(msg)

    def stream(self, name: str, text: str) -> None:
        self.send_side(Stream(type="stream", name=name, text=text, cell=self.busy_cell))

    # -- start-up --------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        if not cfg.attached:  # torchrun already set these for an attached rank
            process_group.set_torchrun_environment(cfg)
        log = log_path(cfg.log_dir, self.rank) if cfg.log_dir else None
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        header = f"rank {self.rank} pid {os.getpid()} generation {self.gen} started {started}"
        self.capture = Capture(self.stream, log, cfg.capture_fds, header)
        if cfg.attached:
            self._leave_when_kernel_goes()
        faulthandler.enable(all_threads=False)  # a segfault's traceback goes to output and log
        builtins.input = no_input
        sys.breakpointhook = debugger.breakpoint_hook(self)
        signal.signal(signal.SIGINT, self._on_sigint)
        progress.install(self.send_side, lambda: self.busy_cell)  # tqdm bars: to the kernel
        threading.Thread(target=self._heartbeat, name="labkit-heartbeat", daemon=True).start()
        import torch
        import torch.distributed as dist

        torch_compat.provide_renames()  # torch < 2.13: its collective names, said at first use
        trace.install()
        port = None
        if self.rank == 0 and cfg.master_port is None:
            self.store, port = process_group.bind_store(cfg)
        process_group.accept_script_calls(dist, self)
        self.device = process_group.pick_device(cfg, torch)
        self.ns = self._namespace(torch, dist)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        # torch's ~170,000 objects live as long as the rank: keep them out of the collector,
        # whose full collections scanned them all (~100 ms, a pause in some cell)
        gc.freeze()
        self.reply(
            Hello(
                type="hello",
                pid=os.getpid(),
                host=socket.gethostname(),
                port=port,
                device=str(self.device),
                time=time.time(),
                num_cpus=os.cpu_count(),
                threads=torch.get_num_threads(),
            )
        )

    def _namespace(self, torch: Any, dist: Any) -> dict[str, Any]:
        import torch.nn as nn
        import torch.nn.functional as F

        # the namespace is the module `__main__`, as a script's is: what a cell defines pickles
        # by reference (an RPC to a function or class from a cell finds it on the callee)
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        cfg = self.cfg
        main.__dict__.update(
            __builtins__=__builtins__,
            rank=self.rank,
            world_size=cfg.world_size,
            local_rank=cfg.local_rank,
            device=self.device,
            torch=torch,
            dist=dist,
            nn=nn,
            F=F,
        )
        return main.__dict__

    def init_group(self, msg: Init) -> None:
        t0 = time.time()
        self.store = process_group.join(self.cfg, self.store, msg["port"])
        self.reply(Ready(type="ready", init_s=time.time() - t0))

    # -- serving ---------------------------------------------------------------------------
    def serve(self) -> None:
        handlers: dict[str, Any] = {
            "init": self.init_group,
            "exec": self.execute,
            "pull": self.pull,
            "push": self.push,
            "trace": self.send_trace,
            "ping": self.pong,
            "debug": self.debug,
            "debug_input": lambda msg: None,  # for a session that ended already
        }
        while True:
            try:
                msg = self.codec.decode(self.ctrl.recv_multipart(copy=False))
            except KeyboardInterrupt:
                continue
            except LinkBroken as exc:  # the kernel is gone, or its link is corrupt: leave
                print(f"labkit rank {self.rank}: leaving: ctrl link: {exc}", file=sys.stderr)
                if self.cfg.key_file and self.cfg.kernel:  # attached: the key of a dead kernel
                    remove_orphaned_key(self.cfg.key_file, *self.cfg.kernel)
                self.capture.flush(timeout=1.0)
                os._exit(1)
            except Exception as exc:  # a forged or corrupt message: log it, never unpickle
                print(f"labkit rank {self.rank}: rejected a message: {exc}", file=sys.stderr)
                continue
            if msg["type"] == "exit":
                self.capture.flush(timeout=1.0)
                os._exit(0)
            if msg["type"] in REQUESTS:
                if msg["id"] <= self.taken:  # sent again (a Stop cut the send short): once only
                    continue
                self.taken = msg["id"]
            try:
                handlers[msg["type"]](msg)
            except KeyboardInterrupt:
                pass

    # -- requests --------------------------------------------------------------------------
    def execute(self, msg: Exec) -> None:
        cell = msg["id"]
        trace.begin_cell(cell, self.rank)
        self.busy_since = time.monotonic()
        self.busy_cell = cell
        value = error = None
        t0 = time.perf_counter()
        self._take_stop(cell)  # a Stop pressed before this rank took the cell
        try:
            try:
                self.in_user_code = True
                if self.stop_cell == cell:
                    self.stopped_at = time.monotonic()  # the heartbeat need not signal it too
                    raise KeyboardInterrupt("Stop was pressed before this rank started the cell")
                if msg.get("fn") is not None:
                    value = call_function(msg["fn"], self.ns)
                else:
                    value = run_code(msg["code"], f"<cell-{cell}>", self.ns)
            finally:  # from here on a late Stop signal is ignored (_on_sigint) ...
                self.in_user_code = False
        except BaseException as exc:  # noqa: BLE001 - a user's error of any kind is reported
            # ... one that landed in `finally` before it is this cell's KeyboardInterrupt: the
            # cell still ends here and replies (it used to escape to `serve`: no reply, a hang)
            self.in_user_code = False
            error = format_error(exc)
            debugger.keep(exc)
        duration = time.perf_counter() - t0
        trace.end_cell()  # torch's own collectives (DDP's buckets), from its Flight Recorder
        self.capture.flush()
        self.busy_cell = None
        self.quiet_since = time.monotonic()
        reply = Done(
            type="done",
            id=cell,
            duration=duration,
            error=error,
            t_end=time.time(),
            stream_seq=self.stream_seq,
            progress=trace.progress(),
        )
        if value is not None and msg.get("display", True):
            reply["display"] = describe(value)
        self._reply_with_value(reply, value if msg.get("want_value", True) else None)

    def _reply_with_value(self, reply: Done, value: Any) -> None:
        """Send `reply` with `value`, encoded once. A value that cannot be pickled, or whose
        message would carry over MAX_VALUE_BYTES (tensors that go through /dev/shm do not
        count), goes as `value_error` instead, and the segments written for it are freed."""
        if value is not None:
            reply["value"] = value
            pool = self.codec.pool
            if pool is not None:
                pool.written = []
            try:
                frames = self._encode(reply)
                size = header(frames)[1]
                if size > MAX_VALUE_BYTES:
                    raise ValueError(
                        f"it is {size / 2**20:.0f} MiB once pickled, over the "
                        f"{MAX_VALUE_BYTES >> 20} MiB limit (tensors that go through shared "
                        "memory do not count)"
                    )
            except Exception as exc:  # noqa: BLE001
                if pool is not None:
                    pool.give_back(pool.written or [])
                del reply["value"]
                reply["value_error"] = (
                    f"the value ({type(value).__name__}) could not be sent "
                    f"to the kernel: {type(exc).__name__}: {exc}"
                )
            else:
                self.ctrl.send_multipart(frames, copy=False)
                return
            finally:
                if pool is not None:
                    pool.written = None
        self.reply(reply)

    def pull(self, msg: Pull) -> None:
        reply = Done(type="done", id=msg["id"], error=None)
        try:
            value = eval(msg["name"], self.ns)  # a name or an attribute path such as model.fc
        except BaseException as exc:  # noqa: BLE001
            reply["error"] = format_error(exc)
            value = None
        self._reply_with_value(reply, value)

    def push(self, msg: Push) -> None:
        self.ns.update(msg["names"])
        self.reply(Done(type="done", id=msg["id"], error=None))

    def send_trace(self, msg: Trace) -> None:
        if "enabled" in msg:
            trace.set_enabled(msg["enabled"])
        self.reply(
            Done(type="done", id=msg["id"], error=None, value=trace.records(msg.get("cell")))
        )

    def pong(self, msg: Ping) -> None:
        self.reply(Pong(type="pong", id=msg["id"], time=time.time()))

    def debug(self, msg: Debug) -> None:
        found, stopped = debugger.post_mortem(self, msg["id"])
        why = KeyboardInterrupt(f"Stop was pressed while rank {self.rank} was in the debugger")
        self.reply(
            Done(
                type="done", id=msg["id"], error=format_error(why) if stopped else None, value=found
            )
        )


def run(cfg: RankConfig) -> None:
    """Entry point of a rank (never returns)."""
    rank = Rank(cfg)
    try:
        rank.start()
        rank.serve()
    except BaseException as exc:  # start-up failed: tell the kernel why, then leave
        try:
            rank.reply(Fatal(type="fatal", error=format_error(exc)))
            time.sleep(0.2)
        finally:
            os._exit(1)
