"""Exercise checkers for the notebooks (kernel side).

Each notebook's exercises live in a module here (`labkit.exercises.collective_checks`, ...). A
checker runs the learner's answer (often a function, run on the ranks with `lab.run`) against
a reference and returns a `Verdict`, which shows as a green "right" or a red "not yet" with
what differed. `reveal(text)` shows a solution only when the learner asks for it.

`run_on_ranks` runs an answer on every rank and turns a raised error or a cell the lab had to
stop (a deadlock, a hang) into a "not yet"; `comm_ops` reads which collectives each rank called,
for checkers that ask for a given collective and not only for the right numbers.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from labkit.kernel.results import LabError

CHECK_TIMEOUT = 120.0  # seconds an answer may run on the ranks before it counts as hanging

# names the tracer records for one collective, folded to the exercise's word for it: torch 2.13
# deprecates all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning) for *_single, and
# the functional collectives are recorded under the old names
OP_FAMILY = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


@dataclass
class Verdict:
    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"{'right' if self.ok else 'not yet'}: {self.message}"

    def _repr_html_(self) -> str:
        color, word = ("#1a7f37", "✔ right") if self.ok else ("#cf222e", "✘ not yet")
        return (
            f"<div style='border-left:4px solid {color};padding:2px 8px'>"
            f"<b style='color:{color}'>{word}</b> — {html.escape(self.message)}</div>"
        )


@dataclass
class Solution:
    code: str

    def __repr__(self) -> str:
        return self.code

    def _repr_html_(self) -> str:
        code = html.escape(self.code)
        return f"<details open><summary>solution</summary><pre>{code}</pre></details>"


def right(message: str = "matches the reference") -> Verdict:
    return Verdict(True, message)


def wrong(message: str) -> Verdict:
    return Verdict(False, message)


def reveal(code: str) -> Solution:
    """A solution, shown only when a learner evaluates it."""
    return Solution(code.strip("\n"))


def rank_error(results: Any) -> Verdict | None:
    """The lowest rank's error in `results` (from `lab.run`) as a verdict; None when none raised."""
    if results.errors:
        r = min(results.errors)
        err = results.errors[r]
        return wrong(f"rank {r} raised {err['type']}: {err['message']}")
    return None


def run_on_ranks(lab: Any, fn: Any, *, display: bool = True) -> tuple[Any, Verdict | None]:
    """Run `fn` on every rank with `lab.run` (kernel side; tracing is switched on first, so
    `comm_ops` can read what it called). Returns (results, None), or (None, a wrong verdict)
    when a rank raised or the lab had to stop the cell: the watchdog's diagnosis, or a run
    past CHECK_TIMEOUT (a hang the watchdog cannot prove, e.g. ranks that disagree on which
    groups they create); the ranks are then fresh."""
    timeout = min(t for t in (lab.timeout, CHECK_TIMEOUT) if t)
    try:
        lab.trace(enabled=True)
        results = lab.run(fn, timeout=timeout, display=display)
    except LabError as err:
        return None, wrong(f"the cell could not finish: {str(err).splitlines()[0]}")
    return results, rank_error(results)


def comm_ops(lab: Any) -> dict[int, list[str]]:
    """{rank: the collectives and p2p ops it called in the last cell, in order}, with names
    folded by OP_FAMILY (kernel side; reads `lab.trace()`)."""
    ops: dict[int, list[str]] = {r: [] for r in range(lab.world_size)}
    for rec in lab.trace():
        if getattr(rec, "kind", "") == "comm":
            ops.setdefault(rec.rank, []).append(OP_FAMILY.get(rec.op, rec.op))
    return ops


# ops that move no data: a barrier added "to be safe" neither answers an exercise nor spoils one
SYNC_ONLY = {"barrier", "monitored_barrier"}

# ops after which a rank holds something the others sent it
_DELIVERING = {
    "broadcast",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "scatter",
    "recv",
    "batch_isend_irecv",
}


def reduce_leftovers(lab: Any) -> Verdict | None:
    """A wrong verdict when a rank called `reduce` as a non-destination and received nothing
    after it, in the last cell (kernel side). After reduce only the destination's tensor is
    defined; gloo leaves partial results on the other ranks (rank r holds the reduction of
    ranks r..n-1 on 4 CPU ranks), which for MAX can even be the right number."""
    pending: dict[int, bool] = {}
    for rec in lab.trace():  # sorted by start time
        if getattr(rec, "kind", "") != "comm":
            continue
        op = OP_FAMILY.get(rec.op, rec.op)
        if op == "reduce" and rec.peer != rec.rank:
            pending[rec.rank] = True
        elif op in _DELIVERING:
            pending[rec.rank] = False
    ranks = sorted(r for r, left in pending.items() if left)
    if not ranks:
        return None
    return wrong(
        f"rank(s) {ranks} kept the tensor they passed to dist.reduce as non-destinations: "
        "after reduce only the destination holds the result (gloo happens to leave partial "
        "results elsewhere, NCCL does not); all_reduce, or reduce then broadcast"
    )


def watching_factory() -> Any:
    """A function `watch(fn)` made here so that cloudpickle sends it by value (a rank does not
    import this kernel-side module). `watch(fn)` is fn wrapped to run on a rank (it takes fn's
    arguments, and lab.run reads fn's signature to pass namespace names) and return {"value":
    fn's value, "calls": the collective and point-to-point calls fn made, in order, "groups":
    its new_group calls}. Requests fn left unwaited are finished after it returns (within
    LEFT_WAIT s for all of them), so they write into nothing that is sent back or used by the
    next cell; their records still say fn never waited, so `unwaited` still rejects them.
    What an irecv (alone or in a batch) or an async all_reduce / broadcast delivers reaches
    fn's tensor only when fn waits for it (the transfer works on a copy): a tensor read before
    its wait() holds its old values every time, not only when timing is unlucky, and one
    never waited for keeps them.

    Each call is {"op", "group": its global ranks, "peer": src/dst/peer as a global rank or
    None, "start", "done"}: times are this rank's time.time(); "done" is when a blocking call
    returned or when wait() on its request returned, None when fn never waited for it (then
    a received tensor may still be empty and a sent one may not be reused: a race the right
    numbers can hide). Nested calls (all_gather_object's all_gather, a batch's isend) are not
    counted twice. Each new_group call is [its global ranks, or None for every rank,
    use_local_synchronization]."""
    import inspect

    LEFT_WAIT = 10.0  # seconds the requests fn never waited for get to finish after it returns
    names = (
        "all_reduce broadcast all_gather all_gather_single all_gather_into_tensor reduce_scatter "
        "reduce_scatter_single reduce_scatter_tensor all_to_all all_to_all_single reduce gather "
        "scatter barrier monitored_barrier send recv isend irecv batch_isend_irecv"
    ).split()
    peer_args = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}
    peer_args.update(send="dst", isend="dst", recv="src", irecv="src")
    IN_PLACE = {"all_reduce", "broadcast"}  # async ops whose result lands in their `tensor`

    def watch(fn: Any) -> Any:
        def task(*args: Any, **kwargs: Any) -> dict[str, Any]:
            import datetime
            import time

            import torch
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d

            calls: list[dict[str, Any]] = []
            groups: list[list[Any]] = []
            depth = [0]  # > 0 inside a watched call: its inner calls are not counted again
            requests: list[Any] = []

            class Request:  # a Work whose wait() is noted and hands over what it received
                def __init__(self, work: Any, recs: list[dict[str, Any]], pairs: Any) -> None:
                    self._work, self._recs, self._pairs = work, recs, pairs
                    requests.append(self)

                def _done(self) -> None:
                    for rec in self._recs:
                        rec["done"] = rec["done"] or time.time()
                    with torch.no_grad():
                        while self._pairs:  # (where the transfer wrote, the learner's tensor)
                            private, theirs = self._pairs.pop()
                            theirs.copy_(private)

                def wait(self, *args: Any, **kw: Any) -> Any:
                    out = self._work.wait(*args, **kw)
                    self._done()
                    return out

                def is_completed(self) -> bool:  # polled until True: as good as wait()
                    done = self._work.is_completed()
                    if done:
                        self._done()
                    return done

                def get_future(self) -> Any:
                    return Request(self._work.get_future(), self._recs, self._pairs)

                def then(self, callback: Any) -> Any:  # a future's: its chain's wait() counts
                    return Request(self._work.then(callback), self._recs, self._pairs)

                def value(self) -> Any:  # a future's
                    out = self._work.value()
                    self._done()
                    return out

                def __getattr__(self, name: str) -> Any:
                    return getattr(self._work, name)

            def ranks_of(group: Any) -> tuple[int, ...]:
                if group is None or group is dist.GroupMember.WORLD:
                    return tuple(range(dist.get_world_size()))
                try:
                    return tuple(dist.get_process_group_ranks(group))
                except Exception:  # noqa: BLE001 - not a member: no ranks known here
                    return ()

            def private(t: Any, pairs: list[Any]) -> Any:
                """A copy of t for a request to work on; t gets its values at wait()."""
                if not isinstance(t, torch.Tensor):
                    return t
                mine = t.detach().clone()
                pairs.append((mine, t))
                return mine

            def wrap(op: str, real: Any) -> Any:
                params = list(inspect.signature(real).parameters)

                def watched(*args: Any, **kw: Any) -> Any:
                    if depth[0]:
                        return real(*args, **kw)
                    bound = dict(zip(params, args), **kw)
                    # what a request receives reaches the learner's tensor only at its wait(): a
                    # tensor read before wait() holds its old values every time, not by timing
                    pairs: list[list[Any]] = []
                    if op == "batch_isend_irecv":
                        batch = []
                        for p in bound.get("p2p_op_list", []):
                            pairs.append([])
                            if p.op is not c10d.isend:  # an irecv, as torch tells them apart
                                t = private(p.tensor, pairs[-1])
                                p = dist.P2POp(p.op, t, peer=p.peer, group=p.group, tag=p.tag)
                            batch.append(p)
                        args, kw = (batch,), {k: v for k, v in kw.items() if k != "p2p_op_list"}
                    elif op == "irecv" or (bound.get("async_op") and op in IN_PLACE):
                        pairs.append([])
                        name = "tensor"
                        theirs = bound.get(name)
                        if name in kw:
                            kw[name] = private(theirs, pairs[0])
                        elif params.index(name) < len(args):
                            i = params.index(name)
                            args = (*args[:i], private(theirs, pairs[0]), *args[i + 1 :])
                    if op == "batch_isend_irecv":
                        recs = [
                            {
                                "op": "isend" if p.op is c10d.isend else "irecv",
                                "group": ranks_of(p.group),
                                "peer": p.peer,
                                "start": time.time(),
                                "done": None,
                            }
                            for p in bound.get("p2p_op_list", [])
                        ]
                    else:
                        group = bound.get("group")
                        peer = bound.get(peer_args.get(op, ""))
                        group_peer = bound.get("group_" + peer_args.get(op, "-"))
                        if peer is None and group_peer is not None:  # torch >= 2.6's group_src
                            members = ranks_of(group)  # and group_dst: a rank of the group
                            peer = members[group_peer] if group_peer < len(members) else None
                        recs = [
                            {
                                "op": op,
                                "group": ranks_of(group),
                                "peer": peer,
                                "start": time.time(),
                                "done": None,
                            }
                        ]
                    calls.extend(recs)
                    depth[0] += 1
                    try:
                        out = real(*args, **kw)
                    finally:
                        depth[0] -= 1
                    asynchronous = op in ("batch_isend_irecv", "isend", "irecv")
                    if out is not None and (asynchronous or bound.get("async_op")):
                        if isinstance(out, list):  # one work per op, or one for all
                            if len(out) == len(recs):
                                return [Request(w, [r], q) for w, r, q in zip(out, recs, pairs)]
                            every = [pair for q in pairs for pair in q]
                            return [Request(w, recs, every) for w in out]
                        return Request(out, recs, [pair for q in pairs for pair in q])
                    for rec in recs:  # returned: done (or nothing to do: not a member)
                        rec["done"] = time.time()
                    return out

                return watched

            def new_group(*args: Any, **kw: Any) -> Any:
                bound = dict(zip(inspect.signature(real_new_group).parameters, args), **kw)
                ranks = bound.get("ranks")
                local = bool(bound.get("use_local_synchronization", False))
                if not depth[0]:
                    groups.append([None if ranks is None else sorted(ranks), local])
                depth[0] += 1
                try:
                    return real_new_group(*args, **kw)
                finally:
                    depth[0] -= 1

            real_new_group = c10d.new_group
            saved = {n: (getattr(dist, n, None), getattr(c10d, n, None)) for n in names}
            try:
                for n, (in_dist, in_c10d) in saved.items():
                    if in_c10d is not None:
                        w = wrap(n, in_c10d)
                        setattr(c10d, n, w)
                        if in_dist is not None:
                            setattr(dist, n, w)
                c10d.new_group = dist.new_group = new_group
                value = fn(*args, **kwargs)
            finally:
                # what fn left running would write into tensors being sent back, or into the
                # next cell: finish it here (its records keep done=None: fn did not wait)
                deadline = time.time() + LEFT_WAIT  # for all of them: many never matched
                for req in requests:  # must not outlast the checker's own timeout
                    if any(rec["done"] is None for rec in req._recs):
                        left = max(deadline - time.time(), 0.01)  # 0 would wait forever
                        try:
                            req._work.wait(datetime.timedelta(seconds=left))
                        except Exception:  # noqa: BLE001 - a partner that never came
                            pass
                for n, (in_dist, in_c10d) in saved.items():
                    if in_c10d is not None:
                        setattr(c10d, n, in_c10d)
                    if in_dist is not None:
                        setattr(dist, n, in_dist)
                c10d.new_group = dist.new_group = real_new_group
            return {"value": value, "calls": calls, "groups": groups}

        task.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        return task

    return watch


def unwaited(calls_by_rank: dict[int, list[dict[str, Any]]]) -> Verdict | None:
    """A wrong verdict when a rank returned without waiting for one of its requests (isend,
    irecv, a batch's, async_op=True): until wait() returns the received tensor may be empty
    and the sent one must not change. Right numbers do not clear it: they were timing."""
    for r, calls in sorted(calls_by_rank.items()):
        left = [c["op"] for c in calls if c["done"] is None]
        if left:
            kinds = {op: left.count(op) for op in left}
            what = " and ".join(f"{n} {op}" if n > 1 else op for op, n in kinds.items())
            return wrong(
                f"rank {r} never waited for its {what} request{'s' if len(left) > 1 else ''}: "
                "until wait() returns, a received tensor may still be empty and a sent one "
                "must not change (any right numbers were luck of timing); call .wait() on "
                "every request"
            )
    return None
