"""IPython magics: `%lab ...` and `%%ranks` (kernel side; thin: parse, call the API, display).

%lab start 4 [--backend gloo|nccl|auto] [--device cpu|cuda|auto] [--timeout S]
%lab attach N [--host H] [--port P] [--key-file F] [--nnodes K] [--rdzv HOST:PORT]
    [--allow NET ...] [--wait S]                                   ranks started by torchrun
%lab status | %lab restart [N] | %lab stop | %lab logs RANK [--lines N]
%lab logs --fr [RANK] [--lines N]   torch's Flight Recorder: the last collectives of each rank
%lab stacks [RANKS] [--timeout S]   every rank's Python stacks now, idle or busy
%lab debug RANK   pdb on the last exception a cell raised on RANK (breakpoint() in a cell, too)
%lab run SCRIPT [ARGS...] [--timeout S before SCRIPT]   a torchrun script, unchanged, on every rank
%%ranks [RANKS] [--timeout S] [--profile]   run the cell on every rank, or on RANKS (0,2 or 1-3)

Arguments are parsed by IPython's `magic_arguments`, so `%lab?` and `%%ranks?` show the help.
A mistake in the arguments is a `UsageError`: IPython prints what was wrong and the usage,
without a traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, kwds, magic_arguments
from IPython.display import display

from labkit.kernel import lab as lab_module
from labkit.kernel.inspection.flight_recorder import LAST, flight_recorder
from labkit.kernel.inspection.logs import read_tail
from labkit.kernel.inspection.profiling import profile
from labkit.kernel.launch.policy import BACKENDS, DEVICES
from labkit.kernel.results import RankValues
from labkit.wire.logfile import log_path

COMMANDS = ("start", "attach", "status", "restart", "stop", "logs", "stacks", "debug", "run")


def _count(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 for any free one."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {text!r}")
    return value


def _usage(func: Callable[..., Any]) -> str:
    # magic_arguments writes the usage as reStructuredText ("::\n\n  %lab ..."): plain here
    return "usage: %" + func.parser.format_usage().split("%", 1)[1].rstrip()


_BARE: dict[Any, dict[str, Any]] = {}  # each magic's arguments when its line is empty


def _split(name: str, line: str) -> list[str]:
    # shell-like words with their quotes removed, as labkit always read them (parse_argstring's
    # own split would keep the quotes of --key-file "a b")
    if not line or line.isspace():  # the common bare `%%ranks`
        return []
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{name}: cannot read {line!r}: {exc}") from None


def _expand(shell: Any, line: str) -> str:
    """`$name` and `{expression}` in a magic's line expanded as IPython expands them: against
    the user's namespace and the locals of the frame its own expansion reads. IPython's own
    expansion copies the whole namespace (every `_iN` of the session) for every cell, with or
    without anything to expand; `%%ranks` asks for it only when its line has `$` or `{`."""
    frame, depth = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_name != "run_cell_magic":
        frame, depth = frame.f_back, depth + 1
    if frame is None:  # not called through IPython's run_cell_magic: the user's namespace
        return str(shell.var_expand(line, 10**6))
    # IPython's run_cell_magic expands with depth 2 from its own frame; from here it is `depth`
    # frames further down
    return str(shell.var_expand(line, depth + 2))


def _parse(func: Callable[..., Any], argv: list[str]) -> argparse.Namespace:
    """Parse a magic's (or a `%lab` command's) arguments; a mistake says what, and the usage."""
    if not argv and func in _BARE:  # a bare `%%ranks`: its defaults, without argparse's turn
        return argparse.Namespace(**_BARE[func])
    try:
        parsed = func.parser.parse_args(argv)
        if not argv:
            _BARE[func] = dict(vars(parsed))
        return parsed
    except UsageError as exc:
        name = "%" + func.parser.prog
        raise UsageError(
            f"{name}: {exc}\n{_usage(func)}\n(see {name.split()[0]}? for help)"
        ) from None


@magics_class
class LabMagics(Magics):
    """`%lab` (start, inspect and stop the notebook's lab) and `%%ranks` (run a cell on it)."""

    @magic_arguments()
    @argument("command", choices=COMMANDS, metavar="COMMAND", help=", ".join(COMMANDS))
    @argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="the command's arguments (below)"
    )
    @line_magic
    def lab(self, line: str) -> Any:
        """Start, inspect and stop the notebook's lab of ranks (runs in the kernel).

        For example `%lab start 4`, then `%%ranks` cells, `%lab status`, `%lab stop`. Each
        command and its arguments are below; the Python API behind them is `labkit.Lab`.
        """
        argv = _split("%lab", line)
        if not argv:
            raise UsageError(f"%lab needs a command, one of: {', '.join(COMMANDS)} (see %lab?)")
        args = _parse(self.lab, argv)
        command = getattr(self, f"_lab_{args.command}")
        return command(_parse(command, args.args))

    @magic_arguments("lab start")
    @argument("n", type=int, nargs="?", metavar="N", help="ranks (default: one per GPU, else 4)")
    @argument("--backend", default="auto", choices=BACKENDS, help="default: auto")
    @argument("--device", default="auto", choices=DEVICES, help="default: auto")
    @argument(
        "--timeout", type=_seconds, metavar="S", help="seconds a cell may run (default: no limit)"
    )
    def _lab_start(self, args: argparse.Namespace) -> None:
        """Start a lab of N ranks, make it current and bind it to `lab`."""
        try:
            lab = lab_module.Lab(
                args.n, backend=args.backend, device=args.device, timeout=args.timeout
            )
        except ValueError as exc:  # the lab checks its arguments before it starts anything
            raise UsageError(str(exc)) from None
        self.shell.user_ns["lab"] = lab
        print(f"lab ready: {lab.choice.reason}; bound to `lab`")

    @magic_arguments("lab attach")
    @argument("n", type=int, metavar="N", help="ranks in all, across every node")
    @argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    @argument("--port", type=_port, default=0, help="port to listen on (default: any free one)")
    @argument("--key-file", metavar="F", help="where to write the lab's key (mode 600)")
    @argument("--nnodes", type=_count, default=1, metavar="K", help="nodes (default: 1)")
    @argument("--rdzv", metavar="HOST:PORT", help="torchrun's rendezvous, on the first node")
    @argument(
        "--allow",
        nargs="+",
        metavar="NET",
        help="addresses, networks (10.0.0.0/24) or host names ranks may connect from",
    )
    @argument(
        "--wait", type=_seconds, default=600, metavar="S", help="seconds to wait for the ranks"
    )
    @argument(
        "--timeout", type=_seconds, metavar="S", help="seconds a cell may run (default: no limit)"
    )
    def _lab_attach(self, args: argparse.Namespace) -> None:
        """Make a lab of N ranks started by torchrun: print its torchrun command and wait."""
        try:
            lab = lab_module.Lab.attach(
                args.n,
                args.host,
                args.port,
                args.key_file,
                nnodes=args.nnodes,
                rdzv=args.rdzv,
                allow=args.allow,
                attach_timeout=args.wait,
                timeout=args.timeout,
            )
        except ValueError as exc:  # the lab checks its arguments before it starts anything
            raise UsageError(str(exc)) from None
        self.shell.user_ns["lab"] = lab
        print(f"lab ready: {lab.choice.reason}; bound to `lab`")

    @magic_arguments("lab status")
    def _lab_status(self, args: argparse.Namespace) -> None:
        """Show the backend and device, and per rank its pid, device and whether it is alive."""
        show_status(lab_module.current().status_report())

    @magic_arguments("lab restart")
    @argument("n", type=int, nargs="?", metavar="N", help="new number of ranks (default: same)")
    def _lab_restart(self, args: argparse.Namespace) -> None:
        """Kill the ranks and start new ones; variables on the ranks are lost."""
        lab = lab_module.current()
        try:
            lab.restart(args.n)
        except ValueError as exc:  # the lab checks its arguments before it starts anything
            raise UsageError(str(exc)) from None
        print(f"ranks restarted: {lab.choice.reason}")

    @magic_arguments("lab stop")
    def _lab_stop(self, args: argparse.Namespace) -> None:
        """End the ranks; their fork server is kept for the next lab when it is clean."""
        lab_module.current().stop()
        print("lab stopped")

    @magic_arguments("lab logs")
    @argument("rank", type=int, nargs="?", metavar="RANK", help="whose output (--fr: all ranks)")
    @argument("--lines", type=_count, metavar="N", help="how many (default: 200; --fr: 20)")
    @argument("--fr", action="store_true", help="torch's Flight Recorder: the last collectives")
    def _lab_logs(self, args: argparse.Namespace) -> None:
        """Show the end of a rank's complete output, kept on disk (it survives a crash); with
        `--fr`, the last collectives torch's Flight Recorder saw each rank enter."""
        if args.rank is None and not args.fr:
            raise UsageError(f"%lab logs needs a RANK (or --fr)\n{_usage(self._lab_logs)}")
        lab = lab_module.current()
        if args.fr:
            ranks = None if args.rank is None else [args.rank]
            try:
                lab.ranks(ranks)
            except ValueError as exc:
                raise UsageError(f"%lab logs: {exc}\n{_usage(self._lab_logs)}") from None
            print(flight_recorder(lab, ranks, args.lines or LAST))
            return
        print(read_log(lab.log_dir, args.rank, lab.world_size, args.lines or 200), end="")

    @magic_arguments("lab stacks")
    @argument("ranks", nargs="?", metavar="RANKS", help="all (default), or such as 0,2 or 1-3")
    @argument(
        "--timeout", type=_seconds, default=5.0, metavar="S", help="seconds to wait (default: 5)"
    )
    def _lab_stacks(self, args: argparse.Namespace) -> None:
        """Show where each rank is: its threads' Python stacks, innermost frame first."""
        lab = lab_module.current()
        try:
            lab.ranks(args.ranks)
        except ValueError as exc:
            raise UsageError(f"%lab stacks: {exc}\n{_usage(self._lab_stacks)}") from None
        print(lab.stacks(args.ranks, timeout=args.timeout))

    @magic_arguments("lab debug")
    @argument("rank", type=int, metavar="RANK", help="the rank whose last exception to debug")
    def _lab_debug(self, args: argparse.Namespace) -> None:
        """Open pdb on the last exception a cell raised on RANK: type commands in the input
        box (p NAME, up, down, l); q or c returns the rank to serving cells. `breakpoint()` in
        a %%ranks cell opens the same kind of session on that rank; c continues the cell."""
        try:
            lab_module.current().debug(args.rank)
        except ValueError as exc:
            raise UsageError(f"%lab debug: {exc}\n{_usage(self._lab_debug)}") from None

    @magic_arguments("lab run")
    @kwds(usage="%(prog)s [--timeout S] SCRIPT [ARGS ...]")  # argparse would call ARGS required
    @argument(
        "--timeout", type=_seconds, metavar="S", help="seconds the script may run (before SCRIPT)"
    )
    @argument("script", nargs="?", metavar="SCRIPT", help="a Python file on the notebook's machine")
    @argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its sys.argv[1:]")
    def _lab_run(self, args: argparse.Namespace) -> None:
        """Run a torchrun script unchanged on every rank: as `__main__`, with `sys.argv`."""
        if args.script is None:
            raise UsageError(
                "%lab run needs a SCRIPT, the path of a Python file, such as "
                f"%lab run examples/ddp_digits.py --epochs 1\n{_usage(self._lab_run)}"
            )
        try:
            results = lab_module.current().run_script(args.script, args.args, args.timeout)
        except (OSError, TypeError) as exc:  # checked in the kernel before anything is sent
            raise UsageError(f"%lab run: {exc}\n{_usage(self._lab_run)}") from None
        results.raise_for_errors()

    @magic_arguments("%ranks")  # so that the usage reads %%ranks
    @argument("ranks", nargs="?", metavar="RANKS", help="all (default), or such as 0,2 or 1-3")
    @argument("--timeout", type=_seconds, metavar="S", help="seconds the cell may run")
    @argument(
        "--profile",
        action="store_true",
        help="run the cell under torch.profiler; labkit.save_trace(lab, path) then has its ops",
    )
    @no_var_expand  # expanded below, only when the line has a `$` or `{`
    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """Run the cell on every rank of the current lab at the same time, or on RANKS.

        The magic runs in the kernel; the cell's code runs on the ranks (`lab.run`). Each
        rank's output is tagged with its rank; the value of the last expression is shown
        per rank (end the cell with `;` to hide it). A rank's error names the rank. With
        `--profile` the cell runs under torch.profiler (labkit.profile). For example a cell
        `%%ranks 0,2 --timeout 30` whose body is `x = torch.ones(1) * rank; x`.
        """
        if "$" in line or "{" in line:
            line = _expand(self.shell, line)
        args = _parse(self.ranks, _split("%%ranks", line))
        lab = lab_module.current()
        try:
            lab.ranks(args.ranks)
        except ValueError as exc:
            raise UsageError(f"%%ranks: {exc}\n{_usage(self.ranks)}") from None
        if args.profile:
            results = profile(lab, cell, ranks=args.ranks, timeout=args.timeout)
        else:
            results = lab.run(cell, ranks=args.ranks, timeout=args.timeout)
        if not cell.rstrip().endswith(";"):
            shown = RankValues({r: res for r, res in results.items() if res.error is None})
            if shown:  # HTML in a notebook, `rank r: value` lines as text
                display(shown, metadata={"labkit": "values"})
        results.raise_for_errors()


# `%lab?` shows every command's help after the magic's own
LabMagics.lab.__doc__ += "\ncommands:\n\n" + "\n".join(
    getattr(LabMagics, f"_lab_{name}").__doc__ for name in COMMANDS
)


def read_log(log_dir: str, rank: int, world_size: int, lines: int) -> str:
    """What `%lab logs RANK` prints: the end of the rank's log file, then where the file is."""
    if not 0 <= rank < max(world_size, 1):
        raise UsageError(f"rank {rank} out of range: ranks are 0-{world_size - 1}")
    path = log_path(log_dir, rank)
    text = read_tail(log_dir, rank, lines, every_process=True)
    if not text:
        return f"(no output from rank {rank} yet: {path})\n"
    return f"{text}\n--- {path}\n"


def _state(row: dict[str, Any]) -> str:
    if not row["alive"]:
        return "DEAD"
    if row.get("debugging"):
        return "in pdb, waiting for you"
    return "busy" if row["busy"] else "alive"


def show_status(report: dict[str, Any]) -> None:
    from labkit.views.gpu_memory import rank_text, shared_gpu_notes

    gpu = {r["rank"]: rank_text(r.get("cuda_memory")) for r in report["ranks"]}
    memory = {r["rank"]: r.get("cuda_memory") for r in report["ranks"]}
    notes = shared_gpu_notes(memory, {r["rank"]: r.get("host", "") for r in report["ranks"]})
    rows = "".join(
        f"<tr><td>{r['rank']}</td><td>{r['pid']}</td><td>{r['device']}</td>"
        f"<td>{r.get('threads') or '-'}</td>"
        f"<td>{_state(r)}</td><td>{gpu[r['rank']]}</td></tr>"
        for r in report["ranks"]
    )
    text = "\n".join(
        f"rank {r['rank']}: pid {r['pid']} {r['device']} {r.get('threads') or '-'} threads "
        f"{_state(r)} · {gpu[r['rank']]}"
        for r in report["ranks"]
    )
    head = f"{report['choice']} · logs in {report['log_dir']}"
    display(
        {
            "text/plain": "\n".join([head, text, *notes]),
            "text/html": f"<b>{head}</b><table><tr><th>rank</th><th>pid</th><th>device</th>"
            f"<th>threads</th><th>state</th><th>GPU memory</th></tr>{rows}</table>"
            + "".join(f"<p>{n}</p>" for n in notes),
        },
        raw=True,
    )


def load(ipython: Any) -> None:
    ipython.register_magics(LabMagics)
