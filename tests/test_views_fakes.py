"""A tiny fake lab for the view tests (no ranks, no browser), and a check of the fake itself.

`FakeLab` answers `pull`, `run`, `trace` and `ranks_info` from per-rank namespaces held in the
test process; `run(code)` executes the code in each rank's namespace and returns the value of
its last expression, as the real lab does.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FakeResult:
    value: Any


class FakeLab:
    def __init__(self, world_size: int, *, device: str = "cpu", num_cpus: int = 2,
                 records: list | None = None) -> None:  # fmt: skip
        self.world_size = world_size
        self.namespaces = [{"rank": r, "world_size": world_size, "torch": torch}
                           for r in range(world_size)]  # fmt: skip
        self.records = records or []
        self.device = device
        self.num_cpus = num_cpus
        self.calls: list[tuple[str, Any]] = []

    def _ranks(self, ranks: Any) -> list[int]:
        return list(range(self.world_size)) if ranks is None else list(ranks)

    def pull(self, name: str, ranks: Any = None) -> dict[int, Any]:
        self.calls.append(("pull", name))
        return {r: self.namespaces[r][name] for r in self._ranks(ranks)}

    def run(self, code: str, ranks: Any = None) -> dict[int, FakeResult]:
        self.calls.append(("run", code))
        tree = ast.parse(code)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        out = {}
        for r in self._ranks(ranks):
            ns = self.namespaces[r]
            exec(compile(tree, "<cell>", "exec"), ns)  # noqa: S102  (a fake rank runs cells)
            value = (
                eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns) if last else None
            )
            out[r] = FakeResult(value)
        return out

    def trace(self, cell: int | None = None) -> list:
        self.calls.append(("trace", cell))
        return [r for r in self.records if cell is None or r.cell == cell]

    def ranks_info(self) -> list[dict[str, Any]]:
        return [
            {"rank": r, "pid": 1000 + r, "host": "h", "device": self.device, "backend": "gloo",
             "num_cpus": self.num_cpus}
            for r in range(self.world_size)
        ]  # fmt: skip


def test_fake_lab_runs_code_per_rank() -> None:
    lab = FakeLab(2)
    results = lab.run("x = rank * 10\nx + 1")
    assert {r: res.value for r, res in results.items()} == {0: 1, 1: 11}
    assert lab.pull("x") == {0: 0, 1: 10}
