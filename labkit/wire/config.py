"""`RankConfig`: what a rank needs to start, checked once (built on the kernel, read on the rank).

The kernel builds one per rank it forks and sends it to its fork server as a JSON line
(`to_wire()`, the key as hex); the server rebuilds it (`from_wire()`) and the forked rank runs
with it. A torchrun rank builds its own from torchrun's environment and the kernel's `welcome`.

Imports only the standard library.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any

# NCCL for CUDA tensors, gloo for CPU tensors and objects: the policy's choice with a GPU per rank
MIXED = "cpu:gloo,cuda:nccl"
BACKENDS = ("gloo", "nccl", MIXED)  # resolved: the kernel or the torchrun rank replaced "auto"
DEVICES = ("cpu", "cuda")
ENDPOINT_SCHEMES = ("unix://", "ipc://", "tcp://")
MIN_KEY_BYTES = 16


@dataclass(frozen=True)
class RankConfig:
    """One rank's start-up settings. Raises ValueError naming a bad value and what is allowed."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    ctrl: str  # the kernel's ctrl endpoint (requests and replies)
    side: str  # the kernel's side endpoint (output, heartbeats, Stop)
    key: bytes  # the lab's signing key
    gen: int  # generation of the ranks; the kernel drops replies of an older one
    backend: str
    device: str
    log_dir: str | None  # where the rank appends to its log (labkit.wire.logfile); None: no log
    master_addr: str
    pg_timeout: float  # seconds, for the store and the process group
    master_port: int | None = None  # torchrun's store; None: rank 0 binds one (a forked lab)
    attached: bool = False  # started by torchrun (not forked): no parent in the lab
    threads: int | None = None  # torch.set_num_threads in the rank; None: leave torch's default
    capture_fds: tuple[int, int] | None = None  # read ends of the stdout/stderr pipes that the
    # fork server made before forking (it keeps copies to drain after a crash); None: the rank
    # makes its own pipes
    shm_dir: str | None = None  # the lab's shared-memory directory (labkit.wire.shm); None:
    # every tensor through the socket
    stop_board: str | None = None  # the lab's Stop board, a file the rank maps to see at a
    # cell's start whether Stop was pressed for it (labkit.wire.stop_board); None: the rank
    # reads its side socket there instead (ranks attached over TCP)
    key_file: str | None = None  # an attached rank's --key-file: removed when the rank finds
    # its kernel dead, if it is the kernel's own (labkit.wire.key_file.remove_orphaned_key)
    kernel: tuple[str, int] | None = None  # (host, pid) of an attached rank's kernel

    def __post_init__(self) -> None:
        _int_at_least("world_size", self.world_size, 1)
        _int_in("rank", self.rank, self.world_size)
        _int_at_least("local_world_size", self.local_world_size, 1)
        if self.local_world_size > self.world_size:
            raise ValueError(
                f"local_world_size must be in [1, world_size={self.world_size}], "
                f"got {self.local_world_size}"
            )
        _int_in("local_rank", self.local_rank, self.local_world_size)
        _int_at_least("gen", self.gen, 1)
        for name in ("ctrl", "side"):
            endpoint = getattr(self, name)
            if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_SCHEMES):
                raise ValueError(
                    f"{name} must be an endpoint starting with "
                    f"{', '.join(ENDPOINT_SCHEMES)}, got {endpoint!r}"
                )
        if not isinstance(self.key, bytes) or len(self.key) < MIN_KEY_BYTES:
            got = f"{len(self.key)} bytes" if isinstance(self.key, bytes) else repr(self.key)
            raise ValueError(f"key must be at least {MIN_KEY_BYTES} bytes, got {got}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.log_dir is not None and (not isinstance(self.log_dir, str) or not self.log_dir):
            raise ValueError(f"log_dir must be a directory path or None, got {self.log_dir!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(
                f"master_addr must be a host name or address, got {self.master_addr!r}"
            )
        if (
            isinstance(self.pg_timeout, bool)
            or not isinstance(self.pg_timeout, (int, float))
            or not self.pg_timeout > 0
        ):
            raise ValueError(f"pg_timeout must be a number of seconds > 0, got {self.pg_timeout!r}")
        if self.master_port is not None:
            _int_in("master_port", self.master_port, 65536, low=1)
        if self.threads is not None:
            _int_at_least("threads", self.threads, 1)
        if not isinstance(self.attached, bool):
            raise ValueError(f"attached must be True or False, got {self.attached!r}")
        if self.shm_dir is not None and not (
            isinstance(self.shm_dir, str) and self.shm_dir.startswith("/dev/shm/labkit-shm-")
        ):
            raise ValueError(
                f"shm_dir must be None or a /dev/shm/labkit-shm-* directory, got {self.shm_dir!r}"
            )
        if self.stop_board is not None and not (
            isinstance(self.stop_board, str) and os.path.isabs(self.stop_board)
        ):
            raise ValueError(
                f"stop_board must be None or an absolute file path, got {self.stop_board!r}"
            )
        if self.capture_fds is not None and (
            len(self.capture_fds) != 2
            or not all(_is_int(fd) and fd >= 0 for fd in self.capture_fds)
        ):
            raise ValueError(
                f"capture_fds must be None or two file descriptors (stdout, stderr), "
                f"got {self.capture_fds!r}"
            )

    def to_wire(self) -> dict[str, Any]:
        """A JSON-able dict: the key as hex, capture_fds as a list."""
        d = asdict(self)
        d["key"] = self.key.hex()
        if self.capture_fds is not None:
            d["capture_fds"] = list(self.capture_fds)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RankConfig:
        """The inverse of `to_wire()` (checks the values again)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown RankConfig field(s): {', '.join(unknown)}")
        d = dict(d)
        if not isinstance(d.get("key"), str):
            raise ValueError(f"key must be hex text on the wire, got {d.get('key')!r}")
        d["key"] = bytes.fromhex(d["key"])
        if d.get("capture_fds") is not None:
            d["capture_fds"] = tuple(d["capture_fds"])
        return cls(**d)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(name: str, value: Any, high: int, low: int = 0) -> None:
    if not _is_int(value) or not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
