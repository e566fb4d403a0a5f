"""A torchrun script, run unchanged on a rank (built in the kernel, called on every rank).

`Script` holds what the kernel read: the script's absolute path, its source and its arguments.
It travels to the ranks as the function of an `exec` request, and each rank calls it. It runs
the source as `torchrun script.py ARGS` would run it in each process:

- as the module `__main__` (in `sys.modules` while it runs, so its classes pickle), in a fresh
  namespace (none of the rank's cell names), with `__file__` set to the path;
- with `sys.argv = [path, *argv]` and the script's folder first on `sys.path`, both restored
  afterwards;
- in the rank's environment, which has the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR, MASTER_PORT, ...); its `init_process_group` and `destroy_process_group` calls
  are taken as `labkit.rank.process_group.accept_script_calls` says, so the lab's group is
  still there for the next cell.

`sys.exit(0)` or `sys.exit()` (also `raise SystemExit(main())` with a `main` that returns 0 or
None) is success, as for a process; any other exit code is this rank's error (`ScriptExit`).
The source goes into `linecache` under the path, so tracebacks show its lines even on a rank
whose machine does not have the file.

This module never imports IPython, ipywidgets or plotly; the kernel imports it to build the
`Script` (it imports nothing heavy).
"""

from __future__ import annotations

import builtins
import linecache
import os
import sys
import types
from dataclasses import dataclass


class ScriptExit(Exception):
    """A script ended with `sys.exit(code)` where code is not 0 or None."""


@dataclass(frozen=True)
class Script:
    """A script to run on every rank: `path` is absolute, `source` what the kernel read."""

    path: str
    source: str
    argv: tuple[str, ...] = ()

    def __call__(self) -> None:
        code = compile(self.source, self.path, "exec")
        lines = self.source.splitlines(True)
        linecache.cache[self.path] = (len(self.source), None, lines, self.path)
        module = types.ModuleType("__main__")
        module.__dict__.update(__file__=self.path, __builtins__=builtins, __cached__=None)
        saved = sys.argv, sys.path[:], sys.modules.get("__main__")
        sys.argv = [self.path, *self.argv]
        sys.path.insert(0, os.path.dirname(self.path))  # as `python script.py` does
        sys.modules["__main__"] = module
        try:
            exec(code, module.__dict__)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise ScriptExit(exit_message(self.path, exc.code)).with_traceback(
                    exc.__traceback__
                ) from None
        finally:
            sys.argv, sys.path[:] = saved[0], saved[1]
            if saved[2] is None:
                sys.modules.pop("__main__", None)
            else:
                sys.modules["__main__"] = saved[2]


def exit_message(path: str, code: object) -> str:
    """What a script's non-zero `sys.exit(code)` means, for this rank's error."""
    rank = os.environ.get("RANK", "?")
    name = os.path.basename(path)
    if isinstance(code, int):
        return f"{name} exited with code {code} on rank {rank} (0 or None is success)"
    # sys.exit("message"): Python prints the message and the process exits with 1
    return f"{name} exited on rank {rank}: {code} (exit status 1)"
