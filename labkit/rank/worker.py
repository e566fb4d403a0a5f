"""The rank process: a persistent namespace that runs the kernel's cells (runs on the rank).

A rank is forked by `labkit.rank.fork_server` (or started by torchrun with `--connect`), connects
two ZeroMQ DEALER sockets to the kernel and serves requests until told to exit:

- `ctrl` (main thread only): requests in (`init`, `exec`, `pull`, `push`, `trace`, `ping`,
  `exit`), replies out (`hello`, `ready`, `done`, `pong`).
- `side` (any thread, behind a lock): output lines (`stream`) and the heartbeat (`status`: busy
  or idle, the cell line running, the comm op the rank is inside).

Rank 0 binds the rendezvous store on port 0 and reports the real port in its `hello`; the kernel
passes it to every rank in `init`, and each rank then joins the process group. Ctrl-C reaches a
rank as SIGINT and raises KeyboardInterrupt only while user code runs.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import ast
import builtins
import datetime
import faulthandler
import functools
import linecache
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from labkit.rank import trace
from labkit.rank.capture import Capture
from labkit.wire.codec import Codec, dumps

HEARTBEAT_IDLE = 1.0
HEARTBEAT_BUSY = 0.25
MAX_VALUE_BYTES = 1 << 30


class Rank:
    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.rank: int = cfg["rank"]
        self.gen: int = cfg["gen"]
        self.codec = Codec(cfg["key"])
        self.ctx = zmq.Context()
        ident = f"r{self.rank}".encode()
        self.ctrl = self._connect(cfg["ctrl"], ident)
        self.side = self._connect(cfg["side"], ident)
        self.side_lock = threading.Lock()
        self.stream_seq = 0
        self.busy_cell: int | None = None
        self.in_user_code = False
        self.store: Any = None
        self.ns: dict[str, Any] = {}

    def _connect(self, endpoint: str, ident: bytes) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        if self.cfg.get("attached"):  # over TCP: the kernel routes by the id it saw sign in
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
        else:
            sock.setsockopt(zmq.IDENTITY, ident)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        return sock

    def _leave_when_kernel_goes(self) -> None:
        """An attached rank has no parent in the lab: leave when the kernel's link drops."""
        monitor = self.ctrl.get_monitor_socket(zmq.EVENT_DISCONNECTED)

        def watch() -> None:
            from zmq.utils.monitor import recv_monitor_message

            recv_monitor_message(monitor)  # the link dropped (or its heartbeats timed out)
            print(f"labkit rank {self.rank}: the lab's kernel is gone; leaving", file=sys.stderr)
            time.sleep(0.2)  # let the capture thread log that line
            os._exit(1)

        threading.Thread(target=watch, name="labkit-kernel-link", daemon=True).start()

    def _take_interrupts(self) -> None:
        """Stop pressed for an attached rank arrives on `side` (labkit cannot signal it)."""
        while self.side.poll(0):
            try:
                msg = self.codec.decode(self.side.recv_multipart(copy=False))
            except Exception as exc:  # noqa: BLE001 - forged: log it, never unpickle
                print(f"labkit rank {self.rank}: rejected a message: {exc}", file=sys.stderr)
                continue
            if msg.get("type") == "interrupt" and self.in_user_code:
                os.kill(os.getpid(), signal.SIGINT)

    # -- sending ---------------------------------------------------------------------------
    def reply(self, msg: dict[str, Any]) -> None:
        msg.update(rank=self.rank, gen=self.gen)
        self.ctrl.send_multipart(self.codec.encode(msg), copy=False)

    def send_side(self, msg: dict[str, Any]) -> None:
        msg.update(rank=self.rank, gen=self.gen)
        with self.side_lock:
            if msg["type"] == "stream":
                self.stream_seq += 1
                msg["seq"] = self.stream_seq
            self.side.send_multipart(self.codec.encode(msg), copy=False)

    def stream(self, name: str, text: str) -> None:
        self.send_side({"type": "stream", "name": name, "text": text, "cell": self.busy_cell})

    # -- start-up --------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        if not cfg.get("attached"):  # torchrun already set these for an attached rank
            os.environ.update(
                {
                    "RANK": str(self.rank),
                    "WORLD_SIZE": str(cfg["world_size"]),
                    "LOCAL_RANK": str(cfg["local_rank"]),
                    "LOCAL_WORLD_SIZE": str(cfg["local_world_size"]),
                    "MASTER_ADDR": cfg["master_addr"],
                    "GROUP_RANK": "0",
                    "ROLE_RANK": str(self.rank),
                }
            )
            # one machine: gloo and NCCL listen on loopback only, unless the user chose
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        log_dir = cfg.get("log_dir")
        log = os.path.join(log_dir, f"rank-{self.rank}.log") if log_dir else None
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        header = f"rank {self.rank} pid {os.getpid()} generation {self.gen} started {started}"
        self.capture = Capture(self.stream, log, cfg.get("capture_fds"), header)
        if cfg.get("attached"):
            self._leave_when_kernel_goes()
        faulthandler.enable(
            all_threads=False
        )  # a segfault leaves its Python traceback in the output and log
        builtins.input = _no_input
        sys.breakpointhook = _no_breakpoint
        signal.signal(signal.SIGINT, self._on_sigint)
        threading.Thread(target=self._heartbeat, name="labkit-heartbeat", daemon=True).start()
        import torch
        import torch.distributed as dist

        trace.install()
        port = None
        if self.rank == 0 and cfg.get("master_port") is None:
            # bind the store's socket ourselves: TCPStore alone listens on every interface
            listener = socket.create_server((cfg["master_addr"], 0), backlog=128)
            port = listener.getsockname()[1]
            self.store = dist.TCPStore(
                cfg["master_addr"],
                port,
                cfg["world_size"],
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=cfg["pg_timeout"]),
                master_listen_fd=listener.detach(),
            )
        if not cfg.get("attached"):
            _reuse_store_in_init(dist, self)
        self.device = self._pick_device(torch)
        self.ns = self._namespace(torch, dist)
        self.reply(
            {
                "type": "hello",
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "port": port,
                "device": str(self.device),
                "time": time.time(),
                "num_cpus": os.cpu_count(),
            }
        )

    def _pick_device(self, torch: Any) -> Any:
        if self.cfg["device"] == "cuda":
            index = self.cfg["local_rank"] % torch.cuda.device_count()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def _namespace(self, torch: Any, dist: Any) -> dict[str, Any]:
        import torch.nn as nn
        import torch.nn.functional as F

        cfg = self.cfg
        return {
            "__name__": "__main__",
            "__builtins__": __builtins__,
            "rank": self.rank,
            "world_size": cfg["world_size"],
            "local_rank": cfg["local_rank"],
            "device": self.device,
            "torch": torch,
            "dist": dist,
            "nn": nn,
            "F": F,
        }

    def init_group(self, msg: dict[str, Any]) -> None:
        import torch.distributed as dist

        cfg = self.cfg
        timeout = datetime.timedelta(seconds=cfg["pg_timeout"])
        if cfg.get("attached"):  # torchrun formed the rendezvous: join it as a script would
            t0 = time.time()
            dist.init_process_group(
                cfg["backend"], rank=self.rank, world_size=cfg["world_size"], timeout=timeout
            )
            self.reply({"type": "ready", "init_s": time.time() - t0})
            return
        os.environ["MASTER_PORT"] = str(msg["port"])
        if self.store is None:
            self.store = dist.TCPStore(
                cfg["master_addr"], msg["port"], cfg["world_size"], is_master=False, timeout=timeout
            )
        t0 = time.time()
        store = dist.PrefixStore(f"labkit/{self.gen}", self.store)
        dist.init_process_group(
            cfg["backend"],
            store=store,
            rank=self.rank,
            world_size=cfg["world_size"],
            timeout=timeout,
        )
        self.reply({"type": "ready", "init_s": time.time() - t0})

    # -- serving ---------------------------------------------------------------------------
    def serve(self) -> None:
        handlers = {
            "init": self.init_group,
            "exec": self.execute,
            "pull": self.pull,
            "push": self.push,
            "trace": self.send_trace,
            "ping": self.pong,
        }
        while True:
            try:
                msg = self.codec.decode(self.ctrl.recv_multipart(copy=False))
            except KeyboardInterrupt:
                continue
            except Exception as exc:  # a forged or corrupt message: log it, never unpickle
                print(f"labkit rank {self.rank}: rejected a message: {exc}", file=sys.stderr)
                continue
            if msg["type"] == "exit":
                self.capture.flush(timeout=1.0)
                os._exit(0)
            try:
                handlers[msg["type"]](msg)
            except KeyboardInterrupt:
                pass

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.in_user_code:
            raise KeyboardInterrupt

    def _heartbeat(self) -> None:
        parent = os.getppid()
        while True:
            busy = self.busy_cell is not None
            time.sleep(HEARTBEAT_BUSY if busy else HEARTBEAT_IDLE)
            if os.getppid() != parent:  # our parent died: the lab is gone
                os._exit(1)
            if self.cfg.get("attached"):
                with self.side_lock:
                    self._take_interrupts()
            status = {"type": "status", "busy": self.busy_cell, "time": time.time()}
            if self.busy_cell is not None:
                status.update(
                    line=self._running_line(), op=trace.current(), progress=trace.progress()
                )
            try:
                self.send_side(status)
            except zmq.ZMQError:
                return

    def _running_line(self) -> int | None:
        frame = sys._current_frames().get(threading.main_thread().ident)
        line = None
        while frame is not None:
            if frame.f_code.co_filename.startswith("<cell-"):
                line = frame.f_lineno
            frame = frame.f_back
        return line

    # -- requests --------------------------------------------------------------------------
    def execute(self, msg: dict[str, Any]) -> None:
        cell = msg["id"]
        trace.begin_cell(cell, self.rank)
        self.busy_cell = cell
        value = error = None
        t0 = time.perf_counter()
        try:
            self.in_user_code = True
            if msg.get("fn") is not None:
                value = self._call(msg["fn"])
            else:
                value = self._run_code(msg["code"], f"<cell-{cell}>")
        except BaseException as exc:  # noqa: BLE001 - a user's error of any kind is reported
            error = _format_error(exc)
        finally:
            self.in_user_code = False
        duration = time.perf_counter() - t0
        self.capture.flush()
        self.busy_cell = None
        reply = {
            "type": "done",
            "id": cell,
            "duration": duration,
            "error": error,
            "t_end": time.time(),
            "stream_seq": self.stream_seq,
            "progress": trace.progress(),
        }
        if value is not None and msg.get("display", True):
            reply["display"] = describe(value)
        self._reply_with_value(reply, value if msg.get("want_value", True) else None)

    def _call(self, fn_bytes: bytes) -> Any:
        import inspect

        import cloudpickle

        fn = cloudpickle.loads(fn_bytes)
        # a function from the notebook sees the rank's names (dist, torch, device, ...) where
        # the kernel had none of its own
        for name, value in self.ns.items():
            if not name.startswith("__"):
                fn.__globals__.setdefault(name, value)
        params = inspect.signature(fn).parameters
        kwargs = {k: self.ns[k] for k in params if k in self.ns}
        return fn(**kwargs)

    def _run_code(self, code: str, filename: str) -> Any:
        tree = ast.parse(code, filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        exec(compile(tree, filename, "exec"), self.ns)
        if last is None:
            return None
        return eval(compile(ast.Expression(last.value), filename, "eval"), self.ns)

    def _reply_with_value(self, reply: dict[str, Any], value: Any) -> None:
        if value is not None:
            try:
                header, buffers = dumps(value)
                size = len(header) + sum(b.raw().nbytes for b in buffers)
                if size > MAX_VALUE_BYTES:
                    raise ValueError(
                        f"it is {size / 2**20:.0f} MiB, over the {MAX_VALUE_BYTES >> 20} MiB limit"
                    )
                reply["value"] = value
            except Exception as exc:  # noqa: BLE001
                reply["value_error"] = (
                    f"the value ({type(value).__name__}) could not be sent "
                    f"to the kernel: {type(exc).__name__}: {exc}"
                )
        self.reply(reply)

    def pull(self, msg: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"type": "done", "id": msg["id"], "error": None}
        try:
            value = eval(msg["name"], self.ns)  # a name or an attribute path such as model.fc
        except BaseException as exc:  # noqa: BLE001
            reply["error"] = _format_error(exc)
            value = None
        self._reply_with_value(reply, value)

    def push(self, msg: dict[str, Any]) -> None:
        self.ns.update(msg["names"])
        self.reply({"type": "done", "id": msg["id"], "error": None})

    def send_trace(self, msg: dict[str, Any]) -> None:
        if "enabled" in msg:
            trace.set_enabled(msg["enabled"])
        self.reply(
            {
                "type": "done",
                "id": msg["id"],
                "error": None,
                "value": trace.records(msg.get("cell")),
            }
        )

    def pong(self, msg: dict[str, Any]) -> None:
        self.reply({"type": "pong", "id": msg["id"], "time": time.time()})


def describe(value: Any) -> dict[str, Any]:
    """What the kernel needs to show a cell's last value richly (computed on the rank)."""
    info: dict[str, Any] = {"type": type(value).__name__}
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<repr failed: {type(exc).__name__}: {exc}>"
    info["text"] = text if len(text) <= 20_000 else text[:20_000] + " ..."
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        info["tensor"] = {
            "shape": tuple(value.shape),
            "dtype": str(value.dtype),
            "device": str(value.device),
            "requires_grad": value.requires_grad,
        }
    return info


def _reuse_store_in_init(dist: Any, rank: Rank) -> None:
    """Let a cell call `dist.init_process_group(...)` as a torchrun script does.

    MASTER_PORT belongs to rank 0's store, which labkit keeps open, so env:// would fail to
    bind it. A call without `store` or `init_method` joins that store under a fresh prefix
    instead (every rank counts its calls the same way); a destroyed group can be re-created.
    """
    real = dist.init_process_group
    calls = [0]

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("store") is None and kwargs.get("init_method") in (None, "env://"):
            if len(args) < 2 and rank.store is not None:
                calls[0] += 1
                kwargs.pop("init_method", None)
                kwargs["store"] = dist.PrefixStore(f"labkit/{rank.gen}/user{calls[0]}", rank.store)
                kwargs.setdefault("rank", rank.rank)
                kwargs.setdefault("world_size", rank.cfg["world_size"])
        return real(*args, **kwargs)

    dist.init_process_group = init_process_group


def _no_input(prompt: Any = "") -> str:
    rank = os.environ.get("RANK", "?")
    raise EOFError(
        f"input() cannot read on rank {rank}: ranks have no keyboard (stdin is /dev/null). "
        "Set the value in the cell, or send it with lab.push(name=value)"
    )


def _no_breakpoint(*args: Any, **kwargs: Any) -> None:
    rank = os.environ.get("RANK", "?")
    raise RuntimeError(
        f"breakpoint() cannot stop on rank {rank}: ranks have no terminal to debug in. "
        "Print the values you need, or lab.pull() them into the notebook"
    )


def _format_error(exc: BaseException) -> dict[str, Any]:
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.endswith(os.path.join("labkit", "rank", "worker.py"))
    ]
    text = "".join(traceback.format_list(frames)) if frames else ""
    text += "".join(traceback.format_exception_only(type(exc), exc))
    return {"type": type(exc).__name__, "message": str(exc), "traceback": text, "time": time.time()}


def run(cfg: dict[str, Any]) -> None:
    """Entry point of a rank (never returns)."""
    rank = Rank(cfg)
    try:
        rank.start()
        rank.serve()
    except BaseException as exc:  # start-up failed: tell the kernel why, then leave
        try:
            rank.reply({"type": "fatal", "error": _format_error(exc)})
            time.sleep(0.2)
        finally:
            os._exit(1)
