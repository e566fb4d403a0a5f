"""The lab's key in a file only its owner can read: the kernel writes it, a torchrun rank reads it.

`Lab.attach(...)` writes the key (hex, one line, mode 600) and prints the torchrun command that
names the file; each rank torchrun starts reads it to sign and check its messages. A key file
that others can read is refused, since whoever holds the key can run code on the ranks.

Imports only the standard library.
"""

from __future__ import annotations

import os


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
