"""`lab.run_script(path, argv)`: a torchrun script, unchanged, on every rank (kernel side).

The kernel reads the file, so the path is one on the kernel's machine (relative to its working
directory) and ranks on other machines need not have it. A path that is not a readable Python
file, arguments that are not a list of strings, or a syntax error are raised here, before
anything is sent. Each rank then runs the script as `torchrun script.py ARGS` would
(`labkit.rank.script.Script`): as `__main__`, with `sys.argv` and the torchrun environment;
its `init_process_group` and `destroy_process_group` leave the lab's group for the next cell.
`Lab.run_script` runs the `Script` that `load_script` makes; this module knows nothing of the
lab, so the two never import each other.
"""

from __future__ import annotations

import os
import tokenize
from collections.abc import Sequence

from labkit.rank.script import Script

EXAMPLE = "lab.run_script('examples/ddp_digits.py', ['--epochs', '1'])"


def load_script(path: str | os.PathLike[str], argv: Sequence[str] = ()) -> Script:
    """The `Script` for `path` and its arguments; a mistake raises here and says what to give."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"run_script takes the path of a Python file, got {type(path).__name__}: {EXAMPLE}"
        )
    if isinstance(argv, (str, bytes)) or not all(isinstance(a, str) for a in argv):
        raise TypeError(
            f"run_script's argv is a list of strings, one per word of the command line "
            f"(sys.argv[1:]), got {argv!r}: {EXAMPLE}"
        )
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(full):
        raise FileNotFoundError(
            f"no script at {os.fspath(path)!r} (looked for {full}); run_script takes the path "
            f"of a Python file on the notebook's machine, absolute or relative to the kernel's "
            f"working directory {os.getcwd()}: {EXAMPLE}"
        )
    if not os.path.isfile(full):
        raise IsADirectoryError(
            f"{full} is not a file; run_script takes the path of a Python file, such as "
            f"{os.path.join(os.fspath(path), 'train.py')!r}"
        )
    with tokenize.open(full) as f:  # honours a coding: line, as Python does
        source = f.read()
    compile(source, full, "exec")  # a SyntaxError surfaces here, once, not once per rank
    return Script(full, source, tuple(argv))
