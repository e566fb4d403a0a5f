"""Running the user's code on a rank: a cell, a function, its value and its errors (rank side).

A cell runs in the rank's persistent namespace and returns its last expression, as a notebook
cell does; its source goes into `linecache` so tracebacks show the lines. An error is reported
as `RankErrorInfo` without labkit's own frames. `input()` raises a clear error: a rank has no
keyboard (`breakpoint()` opens pdb in the notebook instead: labkit.rank.debugger).

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import time
import traceback
from types import CodeType
from typing import Any

from labkit.wire.messages import DisplayInfo, RankErrorInfo, TensorInfo

# frames of labkit's own that a user's traceback leaves out
_OWN_FILES = tuple(
    os.path.join("labkit", "rank", f)
    for f in (
        "worker.py",
        "side.py",
        "debugger.py",
        "user_code.py",
        "script.py",
        "process_group.py",
        "profiling.py",
    )
)

KEEP_COMPILED = 256  # how many texts a rank keeps the code of, the last it compiled (`run_code`)
_COMPILED: dict[str, tuple[CodeType, CodeType | None]] = {}


def call_function(fn_bytes: bytes, ns: dict[str, Any]) -> Any:
    """Call a function pickled in the kernel with the namespace names it takes as parameters.

    Any pickled callable will do (`labkit.rank.script.Script` is one); only a function gets
    the rank's names as globals.
    """
    import inspect

    import cloudpickle

    fn = cloudpickle.loads(fn_bytes)
    # a function from the notebook sees the rank's names (dist, torch, device, ...) where
    # the kernel had none of its own
    fn_globals = getattr(fn, "__globals__", {})
    for name, value in ns.items():
        if not name.startswith("__"):
            fn_globals.setdefault(name, value)
    params = inspect.signature(fn).parameters
    kwargs = {k: ns[k] for k in params if k in ns}
    return fn(**kwargs)


def run_code(code: str, filename: str, ns: dict[str, Any]) -> Any:
    """Run a cell's code in `ns`; return its last expression's value, as a notebook does.

    A text run before is not compiled again (a loop of `lab.run(...)`, a cell run twice): its
    code keeps the `filename` it was first compiled under, whose lines stay in `linecache`.
    """
    compiled = _COMPILED.get(code)
    if compiled is None:
        compiled = _COMPILED[code] = _compile(code, filename)
        if len(_COMPILED) > KEEP_COMPILED:
            del _COMPILED[next(iter(_COMPILED))]  # the oldest
    body, last = compiled
    name = body.co_filename
    if name not in linecache.cache:  # compiled now, or cleared since: tracebacks need the lines
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    exec(body, ns)
    return None if last is None else eval(last, ns)


def _compile(code: str, filename: str) -> tuple[CodeType, CodeType | None]:
    """The cell's statements, and its last expression apart (None if it ends otherwise)."""
    tree = ast.parse(code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    body = compile(tree, filename, "exec")
    if last is None:
        return body, None
    return body, compile(ast.Expression(last.value), filename, "eval")


def describe(value: Any) -> DisplayInfo:
    """What the kernel needs to show a cell's last value richly (computed on the rank)."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<repr failed: {type(exc).__name__}: {exc}>"
    info = DisplayInfo(
        type=type(value).__name__,
        text=text if len(text) <= 20_000 else text[:20_000] + " ...",
    )
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        info["tensor"] = TensorInfo(
            shape=tuple(value.shape),
            dtype=str(value.dtype),
            device=str(value.device),
            requires_grad=value.requires_grad,
        )
    return info


def no_input(prompt: Any = "") -> str:
    rank = os.environ.get("RANK", "?")
    raise EOFError(
        f"input() cannot read on rank {rank}: ranks have no keyboard (stdin is /dev/null). "
        "Set the value in the cell, or send it with lab.push(name=value)"
    )


def format_error(exc: BaseException) -> RankErrorInfo:
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.endswith(_OWN_FILES)
    ]
    text = "".join(traceback.format_list(frames)) if frames else ""
    text += "".join(traceback.format_exception_only(type(exc), exc))
    return RankErrorInfo(
        type=type(exc).__name__, message=str(exc), traceback=text, time=time.time()
    )
