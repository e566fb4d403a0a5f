"""pull, push and trace: the lab's requests that move data, not code (kernel side).

`Lab` inherits these; they go through the same locked, checked call as a cell
(`Lab._call`), with a fixed timeout, `REQUEST_TIMEOUT`.
"""

from __future__ import annotations

from typing import Any

from labkit.kernel.results import LabError, Results
from labkit.wire.messages import Pull, Push, Trace

REQUEST_TIMEOUT = 60.0  # seconds for pull, push and trace


class DataRequests:
    """pull, push and trace, mixed into `Lab` (which provides `_lock`, `_check_usable`,
    `_call`, `ranks` and `offsets`)."""

    def _request(self, msg: Any, ranks: Any = None) -> Results:
        with self._lock:
            self._check_usable()
            return self._call(msg, self.ranks(ranks), REQUEST_TIMEOUT)

    def pull(self, name: str, ranks: Any = None) -> dict[int, Any]:
        """{rank: value} of a name (or attribute path) on the ranks; tensors arrive on the CPU.

        Kernel side: the ranks send the value (tensors of 1 MiB or more through /dev/shm).
        Example: ``lab.pull("model.fc.weight", ranks=[0, 1])``."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"pull() takes a variable name such as 'x', got {name!r}")
        res = self._request(Pull(type="pull", id=0, name=name), ranks)
        res.raise_for_errors()
        for r, one in res.items():
            if one.value_error:
                raise LabError(f"pull({name!r}) from rank {r}: {one.value_error}")
        return res.values_by_rank

    def push(self, ranks: Any = None, **names: Any) -> None:
        """Bind names on the ranks: `lab.push(lr=0.1)` (tensors arrive on the ranks' CPU).

        Kernel side; each target rank binds the names in its namespace. Example:
        ``lab.push(ranks="1-3", w=torch.zeros(4))``, then ``%%ranks`` cells can use `w`."""
        if not names:
            raise ValueError("push() needs names to bind, e.g. lab.push(lr=0.1)")
        self._request(Push(type="push", id=0, names=names), ranks).raise_for_errors()

    def trace(self, cell: int | None = None, *, enabled: bool | None = None) -> list[Any]:
        """Comm and span records of the last cell (or `cell`), on the kernel's clock.

        Kernel side; the ranks record every torch.distributed call of a cell as it runs.
        Example: ``[(r.rank, r.op, r.bytes) for r in lab.trace() if r.kind == "comm"]``."""
        msg = Trace(type="trace", id=0, cell=cell)
        if enabled is not None:
            msg["enabled"] = enabled
        records = []
        for r, res in self._request(msg).items():
            for rec in res.value or []:
                rec.start -= self.offsets.get(r, 0.0)
                if rec.end:
                    rec.end -= self.offsets.get(r, 0.0)
                records.append(rec)
        return sorted(records, key=lambda rec: (rec.start, rec.rank))
