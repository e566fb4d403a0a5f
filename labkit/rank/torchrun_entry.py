"""The entry point of a rank started by torchrun that attaches to a notebook's lab (rank side).

`Lab.attach(n)` in the notebook binds a TCP endpoint (loopback unless the user picks another
address), writes the lab's key to a file readable only by its owner, and prints the command to
run, for example

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 \\
        -m labkit.rank --connect HEAD:PORT --key-file ~/.labkit/lab.key

Each rank torchrun starts runs `main()` below: it reads RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from torchrun's environment, says `attach` to
the kernel (signed with the key) with what its node has (GPUs, NCCL, cores), gets a `welcome`
(the side endpoint, and the backend and device the kernel chose for every rank), and
then serves cells exactly as a forked rank does, except that it joins its process group with
env:// (torchrun formed the rendezvous) and that labkit cannot restart it: a stuck cell is
recovered by restarting the torchrun job. A rank leaves when the kernel says `exit` or when its
connection to the kernel drops (ZeroMQ heartbeats), so a dead notebook frees the GPUs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any, cast

from labkit.wire.config import RankConfig
from labkit.wire.key_file import read_key_file
from labkit.wire.messages import Attach, Welcome

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
WELCOME_TIMEOUT = 120.0


def _torchrun_env() -> dict[str, str]:
    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise SystemExit(
            f"labkit.rank --connect: {', '.join(missing)} not set; start it with torchrun "
            "(torchrun --nproc-per-node=N -m labkit.rank --connect HOST:PORT --key-file F)"
        )
    return {k: os.environ[k] for k in ENV}


def _read_key(path: str) -> bytes:
    """The lab's key from `path`, or exit with what is wrong with the file on this node."""
    where = f"on this node ({socket.gethostname()})"
    try:
        return read_key_file(path)
    except FileNotFoundError:
        raise SystemExit(
            f"labkit.rank: key file {path} not found {where}. Lab.attach wrote it on the "
            "notebook's machine: put it where every node can read it (a shared home "
            "directory), or copy it to the same path on each node, keeping mode 600"
        ) from None
    except PermissionError as exc:  # readable by others, or not readable by us
        raise SystemExit(f"labkit.rank: {exc} ({where})") from None
    except ValueError:
        raise SystemExit(
            f"labkit.rank: key file {path} {where} does not hold a lab key (one line of hex, "
            "as Lab.attach writes it)"
        ) from None


def _handshake(endpoint: str, codec: Any, hello: Attach) -> Welcome:
    """Say `attach` until the kernel answers with `welcome` (rank side)."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(codec.encode(dict(hello)))
        deadline = time.monotonic() + WELCOME_TIMEOUT
        while time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            try:
                msg = codec.decode(sock.recv_multipart())
            except Exception as exc:  # noqa: BLE001 - forged or another lab's: never unpickled
                print(f"labkit: rejected a message from {endpoint}: {exc}", file=sys.stderr)
                continue
            if msg.get("type") == "welcome":
                return cast(Welcome, msg)
            if msg.get("type") == "refused":
                raise SystemExit(f"labkit: the lab at {endpoint} refused rank: {msg['why']}")
        raise SystemExit(
            f"labkit: no answer from a lab at {endpoint} in {WELCOME_TIMEOUT:.0f} s "
            "(is Lab.attach(...) waiting in the notebook, and is the key file the lab's?)"
        )
    finally:
        sock.close(linger=0)


def main(argv: list[str] | None = None) -> None:
    """`python -m labkit.rank --connect HOST:PORT --key-file F` (run by torchrun)."""
    p = argparse.ArgumentParser(prog="python -m labkit.rank")
    p.add_argument("--connect", required=True, metavar="HOST:PORT", help="the lab's endpoint")
    p.add_argument("--key-file", required=True, help="the file Lab.attach wrote (mode 600)")
    p.add_argument("--log-dir", help="also keep each rank's output here, on this node")
    args = p.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    if not host or not port.isdigit():
        p.error(f"--connect takes HOST:PORT, got {args.connect!r}")

    from labkit.rank import worker
    from labkit.wire.codec import Codec

    env = _torchrun_env()
    codec = Codec(_read_key(args.key_file))
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    welcome = _handshake(
        f"tcp://{host}:{port}",
        codec,
        Attach(
            type="attach",
            rank=rank,
            gen=1,
            world_size=world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            gpus=gpus,
            nccl=dist.is_nccl_available(),
            cpus=os.cpu_count(),
        ),
    )
    if args.log_dir:
        os.makedirs(args.log_dir, mode=0o700, exist_ok=True)
    worker.run(
        RankConfig(
            attached=True,
            rank=rank,
            world_size=world_size,
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            ctrl=f"tcp://{host}:{port}",
            side=welcome["side"].replace("HOST", host),
            key=codec.key,
            gen=welcome["gen"],
            backend=welcome["backend"],
            device=welcome["device"],
            log_dir=args.log_dir,
            pg_timeout=welcome["pg_timeout"],
            key_file=os.path.abspath(os.path.expanduser(args.key_file)),
            kernel=(str(welcome["kernel"][0]), int(welcome["kernel"][1])),
        )
    )
