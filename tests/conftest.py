"""Shared fixtures: a 4-rank CPU lab reused by a module's tests (kernel side)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can import the `distributed` harness


@pytest.fixture(scope="module")
def lab():
    import labkit

    lab = labkit.Lab(4, device="cpu")
    yield lab
    lab.stop()


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
