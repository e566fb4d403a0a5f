"""`%lab` and `%%ranks`: help, and a clear error for a mistake (parsing needs no ranks), and
the log reader behind `%lab logs` and a dead rank's report (kernel side)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from test_kernel import Kernel

from labkit.kernel.inspection.logs import read_tail
from labkit.kernel.magics import COMMANDS, LabMagics, _parse, _split, read_log
from labkit.wire.logfile import LOG_HEADER, log_path

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def magics() -> LabMagics:
    return LabMagics(shell=None)  # parsing and its errors need no shell and no lab


def test_lab_help_shows_every_command():
    doc = LabMagics.lab.__doc__
    for name in COMMANDS:
        assert f"%lab {name}" in doc, name
    for text in ("--backend", "--key-file", "--nnodes", "--lines", "make it current", "torchrun"):
        assert text in doc, text
    assert "%%ranks [--timeout S] [--profile] [RANKS]" in LabMagics.ranks.__doc__
    assert "0,2 or 1-3" in LabMagics.ranks.__doc__ and "torch.profiler" in LabMagics.ranks.__doc__


@pytest.mark.parametrize(
    "line,match",
    [
        ("", r"needs a command, one of: start, attach, status, restart, stop, logs"),
        ("strat 4", r"invalid choice: 'strat' \(choose from 'start', 'attach'"),
        ("start two", r"%lab start: argument N: invalid int value: 'two'\nusage: %lab start"),
        ("start 2 --backend mpi", r"--backend: invalid choice: 'mpi' \(choose from 'auto'"),
        ("start 2 --device tpu", r"--device: invalid choice: 'tpu'"),
        ("start 2 --timeout -1", r"--timeout: must be a number of seconds above 0, got '-1'"),
        ("start 2 --devcie cpu", r"unrecognized arguments: --devcie cpu"),
        ("start 0", r"world_size must be in \[1, "),  # checked by Lab, before it starts anything
        ("stop now", r"%lab stop: unrecognized arguments: now\nusage: %lab stop"),
        ("logs", r"%lab logs needs a RANK \(or --fr\)\nusage: %lab logs \[--lines N\] \[--fr\]"),
        ("logs 1 --lines 0", r"--lines: must be a whole number of at least 1, got '0'"),
        ("attach 2 --port 70000", r"--port: must be a port in \[0, 65535\], got '70000'"),
        ("attach 2 --nnodes 0", r"--nnodes: must be a whole number of at least 1"),
        ("attach 2 --allow no-such-host.invalid", r"allow: 'no-such-host.invalid' is neither"),
        ("attach 2 --wait 0", r"--wait: must be a number of seconds above 0, got '0'"),
        ("start 'x", r"cannot read .*No closing quotation"),
    ],
)
def test_lab_mistakes_say_what_is_wrong(magics, line, match):
    with pytest.raises(UsageError, match=match):
        magics.lab(line)


@pytest.mark.parametrize(
    "line,match",
    [
        (
            "0 2",
            r"%%ranks: unrecognized arguments: 2\nusage: %%ranks \[--timeout S\] \[--profile\]",
        ),
        ("--timeout 0", r"--timeout: must be a number of seconds above 0, got '0'"),
    ],
)
def test_ranks_mistakes_say_what_is_wrong(magics, line, match):
    with pytest.raises(UsageError, match=match):
        magics.ranks(line, "1")


def test_a_bare_ranks_line_reads_as_its_defaults_every_time():
    # a bare `%%ranks` skips argparse after its first time (labkit.kernel.magics._BARE)
    ranks = LabMagics.ranks
    first = _parse(ranks, _split("%%ranks", "  "))
    assert vars(first) == {"ranks": None, "timeout": None, "profile": False}
    first.ranks = "0"  # what one call does with its arguments never reaches the next
    assert vars(_parse(ranks, _split("%%ranks", "1-2 --timeout 5 --profile"))) == {
        "ranks": "1-2",
        "timeout": 5.0,
        "profile": True,
    }
    assert vars(_parse(ranks, _split("%%ranks", ""))) == {
        "ranks": None,
        "timeout": None,
        "profile": False,
    }


def _write_log(log_dir, rank: int, parts: list[list[str]]) -> None:
    with open(log_path(str(log_dir), rank), "w") as f:
        for pid, lines in enumerate(parts):
            f.write(f"{LOG_HEADER}rank {rank} pid {pid} -----\n")
            f.writelines(line + "\n" for line in lines)


def test_read_tail_keeps_the_latest_process_and_drops_labkit_frames(tmp_path):
    frame = '  File "/x/labkit/rank/worker.py", line 9, in serve'
    user = '  File "/x/labkit/rank/user_code.py", line 4, in run_cell'
    _write_log(tmp_path, 1, [["old 1", "old 2"], ["new 1", frame, "new 2", user, ""]])
    assert read_tail(str(tmp_path), 1, 10) == f"new 1\n{frame}\nnew 2\n{user}"
    assert read_tail(str(tmp_path), 1, 10, drop_noise=True) == "new 1\nnew 2"
    assert read_tail(str(tmp_path), 1, 1, drop_noise=True) == "new 2"
    every = read_tail(str(tmp_path), 1, 10, every_process=True)
    assert every.startswith(f"{LOG_HEADER}rank 1 pid 0") and "old 2" in every
    assert every.endswith(user) and every.count(LOG_HEADER) == 2
    assert read_tail(str(tmp_path), 1, 0) == ""
    assert read_tail(str(tmp_path), 7, 10) == ""  # no log yet


def test_read_tail_reads_only_the_end_of_a_big_log(tmp_path):
    flood = [f"line {i:06d}" for i in range(100_000)]  # 1.2 MB, no header in its last 64 KiB
    _write_log(tmp_path, 0, [flood])
    tail = read_tail(str(tmp_path), 0, 100_000, max_bytes=64 << 10).splitlines()
    assert tail[-1] == "line 099999"
    assert len(tail) == (64 << 10) // len("line 000000\n")  # whole lines only, the first one cut
    assert all(line.startswith("line ") and len(line) == 11 for line in tail)


def test_lab_logs_text(tmp_path):
    _write_log(tmp_path, 1, [["before restart"], ["after restart"]])
    text = read_log(str(tmp_path), 1, 2, 50)
    assert "before restart" in text and "after restart" in text  # every process's output
    assert text.endswith(f"--- {log_path(str(tmp_path), 1)}\n")
    assert read_log(str(tmp_path), 0, 2, 50).startswith("(no output from rank 0 yet")
    with pytest.raises(UsageError, match=r"rank 2 out of range: ranks are 0-1"):
        read_log(str(tmp_path), 2, 2, 50)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    yield k
    k.close()


def test_help_and_errors_in_a_notebook(kernel):
    assert kernel.run("%load_ext labkit")["error"] is None
    page = kernel.run("%lab?")["page"]
    assert "%lab start" in page and "%lab logs" in page and "--nnodes" in page, page
    assert "%%ranks [--timeout S] [--profile] [RANKS]" in kernel.run("%%ranks?")["page"]

    bad = kernel.run("%lab strat 2")
    assert bad["error"]["ename"] == "UsageError", bad
    assert bad["error"]["traceback"] == []  # a message on stderr, with no traceback
    assert "UsageError: %lab: argument COMMAND: invalid choice: 'strat'" in bad["stderr"]
    bad = kernel.run("%lab start 2 --backend nccl")  # no GPU here: the lab's own check
    assert bad["error"]["ename"] == "UsageError" and "one GPU per rank" in bad["error"]["evalue"]
    assert "no lab is running" in kernel.run("%lab status")["error"]["evalue"]


def test_ranks_line_expands_variables_as_ipython_does(monkeypatch):
    """`%%ranks` opts out of IPython's expansion (it copies the whole namespace each cell) and
    expands `$name` and `{expression}` itself when the line has them: the same words as a
    cell magic that IPython expands, called from a cell and from a function (IPython reads the
    locals two frames above its run_cell_magic; a wrong frame fails the last case)."""
    from IPython.core.interactiveshell import InteractiveShell

    import labkit.kernel.magics as magics_module

    shell = InteractiveShell.instance()  # the process's one shell (other tests share it)
    shell.register_magics(LabMagics)
    seen: list[list[str]] = []
    expanded: list[str] = []

    def parse(func, argv):
        seen.append(argv)
        raise UsageError("parsed")  # nothing further: no lab is needed

    monkeypatch.setattr(magics_module, "_parse", parse)
    shell.register_magic_function(
        lambda line, cell: expanded.append(line), "cell", "labkit_test_echo"
    )
    monkeypatch.setitem(shell.user_ns, "sel", "0,2")
    monkeypatch.setitem(shell.user_ns, "t", 5)
    monkeypatch.setitem(shell.user_ns, "from_a_function", None)  # removed again afterwards
    lines = ["$sel --timeout {t*2}", "{sel}", "", "--timeout 3", "$nope {", "1-3 }"]
    for line in lines:
        shell.run_cell(f"%%ranks {line}\n1")
        shell.run_cell(f"%%labkit_test_echo {line}\n1")
    shell.run_cell(
        "def from_a_function():\n"
        "    sel = '1-3'\n"
        "    for name in ('ranks', 'labkit_test_echo'):\n"
        "        try:\n"
        "            get_ipython().run_cell_magic(name, '$sel {sel}', '1')\n"
        "        except Exception:\n"
        "            pass\n"
        "from_a_function()\n"
    )
    assert [" ".join(argv) for argv in seen] == [e.strip() for e in expanded], (seen, expanded)
    assert seen[0] == ["0,2", "--timeout", "10"] and seen[1] == ["0,2"], seen
