"""The lab's key in a file only its owner can read: the kernel writes it, a torchrun rank reads it.

`Lab.attach(...)` writes the key (hex, one line, mode 600) and prints the torchrun command that
names the file; each rank torchrun starts reads it to sign and check its messages. A key file
that others can read is refused, since whoever holds the key can run code on the ranks.

A kernel removes the key (its default file, in its private `labkit-*` socket directory) when
its lab stops; when the kernel was killed instead, the attached ranks on its host find it gone
and remove that file and directory (`remove_orphaned_key`), so a dead notebook leaves nothing.

Imports only the standard library and labkit.wire.sock_dir.
"""

from __future__ import annotations

import os
import socket

from labkit.wire.sock_dir import OWNER, kernel_alive


def write_key_file(path: str, key: bytes) -> str:
    """Write the lab's key as hex to `path`, readable and writable by its owner only (kernel)."""
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode on open; make sure
        os.write(fd, key.hex().encode() + b"\n")
    finally:
        os.close(fd)
    return path


def read_key_file(path: str) -> bytes:
    """The key in `path`; PermissionError if others can read or write the file (rank)."""
    path = os.path.expanduser(path)
    mode = os.stat(path).st_mode & 0o077
    if mode:
        raise PermissionError(
            f"key file {path} is readable by others (mode {oct(os.stat(path).st_mode & 0o777)}); "
            "run chmod 600 on it"
        )
    with open(path) as f:
        return bytes.fromhex(f.read().strip())


KEY_NAME = "lab.key"  # the kernel's default key file, in its private socket directory


def remove_orphaned_key(path: str, host: str, pid: int) -> bool:
    """Remove the key file a dead kernel made for itself, and its directory (rank, attached).

    Only the kernel's own default file (`labkit-*/lab.key`, alone there but for the kernel's
    `labkit.wire.sock_dir.OWNER` note), only on the
    kernel's host, and only once its pid is gone: a key file the user chose is theirs to keep,
    and a kernel still alive (Stop ended the torchrun job; the same command attaches again)
    still needs its key. Returns whether it removed anything; never raises."""
    folder = os.path.dirname(path)
    if os.path.basename(path) != KEY_NAME or not os.path.basename(folder).startswith("labkit-"):
        return False
    if host != socket.gethostname() or kernel_alive(pid):
        return False
    try:
        if not set(os.listdir(folder)) <= {KEY_NAME, OWNER}:
            return False
        os.unlink(path)
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    except OSError:  # another rank of the node removed it first
        return False
    return True
