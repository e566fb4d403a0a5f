"""IPython magics: `%lab ...` and `%%ranks` (kernel side; thin: parse, call the API, display).

%lab start 4 [--backend gloo|nccl|auto] [--device cpu|cuda|auto] [--timeout S]
%lab attach N [--host H] [--port P] [--key-file F] [--nnodes K]   ranks started by torchrun
%lab status | %lab restart [N] | %lab stop | %lab logs RANK [--lines N]
%%ranks [RANKS] [--timeout S]     run the cell on every rank, or on RANKS such as 0,2 or 1-3
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.display import HTML, display

from labkit.kernel import lab as lab_module
from labkit.kernel.results import values_html


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # never SystemExit inside a kernel
        raise UsageError(f"{message}\n{self.format_usage()}")


@functools.cache
def _lab_parser() -> _Parser:
    p = _Parser(prog="%lab", add_help=False)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    start = sub.add_parser("start", add_help=False)
    start.add_argument("n", type=int, nargs="?")
    start.add_argument("--backend", default="auto")
    start.add_argument("--device", default="auto")
    start.add_argument("--timeout", type=float)
    attach = sub.add_parser("attach", add_help=False)
    attach.add_argument("n", type=int)
    attach.add_argument("--host", default="127.0.0.1")
    attach.add_argument("--port", type=int, default=0)
    attach.add_argument("--key-file")
    attach.add_argument("--nnodes", type=int, default=1)
    attach.add_argument("--timeout", type=float)
    sub.add_parser("status", add_help=False)
    restart = sub.add_parser("restart", add_help=False)
    restart.add_argument("n", type=int, nargs="?")
    sub.add_parser("stop", add_help=False)
    logs = sub.add_parser("logs", add_help=False)
    logs.add_argument("rank", type=int)
    logs.add_argument("--lines", type=int, default=200)
    return p


@functools.cache
def _ranks_parser() -> _Parser:
    p = _Parser(prog="%%ranks", add_help=False)
    p.add_argument("ranks", nargs="?")
    p.add_argument("--timeout", type=float)
    return p


@magics_class
class LabMagics(Magics):
    @line_magic
    def lab(self, line: str) -> Any:
        args = _lab_parser().parse_args(shlex.split(line))
        if args.cmd == "start":
            lab = lab_module.Lab(
                args.n, backend=args.backend, device=args.device, timeout=args.timeout
            )
            self.shell.user_ns["lab"] = lab
            print(f"lab ready: {lab.choice.reason}; bound to `lab`")
            return None
        if args.cmd == "attach":
            lab = lab_module.Lab.attach(
                args.n,
                args.host,
                args.port,
                args.key_file,
                nnodes=args.nnodes,
                timeout=args.timeout,
            )
            self.shell.user_ns["lab"] = lab
            print(f"lab ready: {lab.choice.reason}; bound to `lab`")
            return None
        lab = lab_module.current()
        if args.cmd == "status":
            return show_status(lab.status_report())
        if args.cmd == "restart":
            lab.restart(args.n)
            print(f"ranks restarted: {lab.choice.reason}")
        elif args.cmd == "stop":
            lab.stop()
            print("lab stopped")
        elif args.cmd == "logs":
            print(read_log(lab.log_dir, args.rank, lab.world_size, args.lines), end="")
        return None

    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        args = _ranks_parser().parse_args(shlex.split(line))
        results = lab_module.current().run(cell, ranks=args.ranks, timeout=args.timeout)
        if not cell.rstrip().endswith(";"):
            page = values_html({r: res for r, res in results.items() if res.error is None})
            if page:
                display(HTML(page), metadata={"labkit": "values"})
        results.raise_for_errors()


def read_log(log_dir: str, rank: int, world_size: int, lines: int) -> str:
    """The last `lines` lines of a rank's complete output (kept on disk, survives crashes)."""
    if not 0 <= rank < max(world_size, 1):
        raise UsageError(f"rank {rank} out of range: ranks are 0-{world_size - 1}")
    path = os.path.join(log_dir, f"rank-{rank}.log")
    if not os.path.exists(path):
        return f"(no output from rank {rank} yet: {path})\n"
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - (8 << 20)))  # a flood's log can be huge
        text = f.read().decode(errors="replace")
    return "".join(text.splitlines(True)[-lines:]) + f"--- {path}\n"


def show_status(report: dict[str, Any]) -> None:
    rows = "".join(
        f"<tr><td>{r['rank']}</td><td>{r['pid']}</td><td>{r['device']}</td>"
        f"<td>{'busy' if r['busy'] else ('alive' if r['alive'] else 'DEAD')}</td></tr>"
        for r in report["ranks"]
    )
    text = "\n".join(
        f"rank {r['rank']}: pid {r['pid']} {r['device']} {'alive' if r['alive'] else 'DEAD'}"
        for r in report["ranks"]
    )
    head = f"{report['choice']} · logs in {report['log_dir']}"
    display(
        {
            "text/plain": f"{head}\n{text}",
            "text/html": f"<b>{head}</b><table><tr><th>rank</th><th>pid</th><th>device</th>"
            f"<th>state</th></tr>{rows}</table>",
        },
        raw=True,
    )


def load(ipython: Any) -> None:
    ipython.register_magics(LabMagics)
