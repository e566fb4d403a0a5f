"""How a torchrun script that used gloo ends: `exit_with(main)` (runs in the script's process).

With torch 2.13 such a script can abort (SIGABRT, "terminate called without an active
exception") after a run that succeeded, and torchrun then reports a failed worker. gloo runs
each collective on a worker thread, which drops its reference to the work item only after the
op completed, and a work item can hold Python objects: its tensors, or, for one launched
during a backward pass (DDP's all-reduces), the context that backward stashes. On a busy
machine the thread can be switched out in between; if the interpreter has begun to shut down
when it drops the last reference, taking the interpreter lock stops the thread inside a C++
destructor, and the process aborts. `destroy_process_group` does not prevent it: gloo's
threads stop only when the last reference to the group goes, and a DDP model keeps one.

`exit_with(main)` runs `main()` and leaves with `os._exit(code)` once the output is flushed,
so there is no interpreter shutdown for those threads to trip on (nothing of it is needed
once `main` destroyed its group). An exception prints its traceback and exits 1;
`sys.exit(code)` inside `main` exits with that code. On a lab (`%lab run script.py`) the
script runs inside a rank that must go on: there it raises `SystemExit(main())`, which the
rank takes as the script's exit code (`labkit.rank.script`).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_with(main: Callable[[], int | None]) -> NoReturn:
    """Run `main` and end the process with its return code (None: 0), without interpreter
    shutdown; on a lab's rank, `raise SystemExit(main())` instead."""
    if "labkit.rank.worker" in sys.modules:  # a lab's rank runs this script
        raise SystemExit(main())
    code: object = 1
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
        traceback.print_exc()
    finally:
        os._exit(_status(code))


def _status(code: object) -> int:
    """The exit status `sys.exit(code)` gives, with the output flushed first."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:  # a message: printed, and status 1, as the interpreter does
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can be said
            pass
    return status
