"""Shared fixtures and the orphan check (test process).

- `lab`: a 4-rank CPU lab reused by a module's tests.
- `load` (module scope, params "idle" and "loaded") and `cpu_load`: run tests with every CPU
  busy (tests/load.py). A test that gets `load` runs twice; its loaded run is marked `loaded`.
- The orphan check: no process a test (or labkit, for it) started may outlive the test. After
  each test, the test process's descendants that were not there before it are waited for (up
  to ORPHAN_WAIT s), then named with their command lines, ended, and the test errors. Processes
  started while a module- or session-scoped fixture was set up (a module's lab: its fork
  server and ranks, including ranks a test restarts) belong to that fixture: they are checked
  when it is torn down instead. labkit's spare fork server (a stopped lab's, kept for the next
  Lab) lives as long as the test process by design; it is closed at the end of the session,
  and then any descendant still running fails the run. The test process is a child subreaper
  (tests/processes.py), so an orphan whose parent died is still seen here rather than adopted
  by init.
- Stop: the tests press it as a notebook does, with `_thread.interrupt_main()` (SIGINT to the
  kernel, which ipykernel handles). That does nothing while SIGINT is ignored, as it is in a
  test run started in the background by a non-interactive shell (`cmd &`, nohup), so the suite
  handles SIGINT as Python does by default.
"""

from __future__ import annotations

import json
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can import the harness modules

if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # see "Stop" above

import processes  # noqa: E402
from distributed import forkserver_pid, stop_forkserver  # noqa: E402
from load import busy_cpus  # noqa: E402
from processes import (  # noqa: E402
    Key,
    become_subreaper,
    descendants,
    describe,
    end,
    key,
    pid_alive,
    subtree,
    table,
    wait_gone,
)

from labkit.kernel.inspection import log_dirs  # noqa: E402
from labkit.kernel.launch import spawn  # noqa: E402

__all__ = ["pid_alive"]

ORPHAN_WAIT = 5.0  # seconds a test's processes get to exit after it ends
_held: dict[object, set[Key]] = {}  # a longer-lived fixture's processes, by its FixtureDef
_reported: set[Key] = set()  # named once already (and ended)


def pytest_configure(config: pytest.Config) -> None:
    become_subreaper()
    # Temporary files of this run (labkit's socket directories, torchrun's torchelastic_*
    # directories, the labs' logs) go to a directory of this run's: the session's end checks
    # what is left there, then removes it.
    os.environ["TMPDIR"] = _TMP.name
    tempfile.tempdir = None  # read TMPDIR again
    if not os.environ.get(log_dirs.ENV):
        os.environ[log_dirs.ENV] = os.path.join(_TMP.name, "logs")


_TMP = tempfile.TemporaryDirectory(prefix="labkit-test-tmp-")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("load") == "loaded":
            item.add_marker(pytest.mark.loaded)
    # the notebooks run beside the other tests (`notebook_batch`): their results are read last
    notebooks = [i for i in items if i.originalname == "test_notebook_runs"]
    if notebooks:
        items[:] = [i for i in items if i.originalname != "test_notebook_runs"] + notebooks


NOTEBOOK_JOBS = max(1, int(os.environ.get("LABKIT_NOTEBOOK_JOBS", "2")))
_batch: list[NotebookBatch] = []  # this session's, for the terminal summary


class NotebookBatch:
    """The notebooks of this run, executing in tests/notebook_runner.py's process."""

    def __init__(self, paths: list[str], tmp: str):
        self.paths = paths
        self.out = os.path.join(tmp, "notebooks.json")
        runner = os.path.join(os.path.dirname(__file__), "notebook_runner.py")
        cmd = [sys.executable, runner, self.out, str(NOTEBOOK_JOBS), *paths]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd) if paths else None
        self.got: dict | None = None  # the runner's OUT.json, once read
        self.others_ended: float | None = None  # when the tests beside them had all ended

    def results(self) -> dict:
        """Wait for every notebook; {"wall", "jobs", "runs": {path: (ok, s, error, whole
        error)}, "left"}."""
        if self.proc is None:
            return {"wall": 0.0, "jobs": NOTEBOOK_JOBS, "runs": {}, "left": ""}
        if self.others_ended is None:
            self.others_ended = time.monotonic() - self.started
        self.proc.wait()
        if self.got is None:
            with open(self.out) as f:
                self.got = json.load(f)
        return self.got

    def summary(self) -> list[str]:
        """The notebooks' part of the run, for the terminal: wall and CPU time, when the tests
        beside them ended, and the longest notebooks with when each started and ended."""
        got = self.got
        if not got or not got.get("runs"):
            return []
        runs, spans = got["runs"], got.get("spans", {})
        busy = sum(r[1] for r in runs.values())
        lines = [
            f"notebooks: {len(runs)} in {got['wall']:.0f} s wall, {got['jobs']} at a time at "
            f"nice {got.get('nice')}, {busy:.0f} s of notebook time, "
            f"{got.get('cpu', 0):.0f} CPU-s; "
            f"the other tests ended {self.others_ended or 0:.0f} s after they started"
        ]
        longest = sorted(runs, key=lambda p: -runs[p][1])[:12]
        for path in longest:
            span = spans.get(path, [0.0, 0.0])
            lines.append(
                f"  {runs[path][1]:6.1f} s  {os.path.basename(path)}  "
                f"(ran {span[0]:.0f}-{span[-1]:.0f} s)"
            )
        return lines

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            end(subtree({k for k in [key(self.proc.pid)] if k}))
            self.proc.wait()


@pytest.fixture(scope="session", autouse=True)
def notebook_batch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts the selected notebooks (tests/test_notebooks.py) when the run's first test starts,
    JOBS (LABKIT_NOTEBOOK_JOBS, default 2) at a time, longest first, so that they run while the
    other tests do. Their processes belong to this fixture (the orphan check skips them until
    its teardown; the runner itself names any it had to end)."""
    paths = [
        item.callspec.params["path"]
        for item in request.session.items
        if item.originalname == "test_notebook_runs" and hasattr(item, "callspec")
    ]
    paths.sort(key=lambda p: -os.path.getsize(p))  # the last one to start is a short one
    batch = NotebookBatch(paths, str(tmp_path_factory.mktemp("notebooks")))
    _batch.append(batch)
    # held by hand: the hook that does it for other fixtures never sees a session-scoped one
    # (conftest.py is below the rootdir, the session's node is not)
    runner = key(batch.proc.pid) if batch.proc is not None else None
    if runner is not None:
        _held[NotebookBatch] = {runner}
        processes.BESIDE.add(runner)  # a test's own count of what it started skips them
    try:
        yield batch
    finally:
        batch.stop()
        processes.BESIDE.clear()
        keys = _held.pop(NotebookBatch, set())
        if keys:
            _fail_if_left((keys | subtree(keys)) - _reported, "the notebooks' runner")


def _helpers() -> set[int]:
    """Pids of helpers that live as long as the test process by design."""
    pids = {
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
        forkserver_pid(),  # run_ranks' ranks are forked from it
        _spare_pid(),  # labkit's spare fork server: kept for the next Lab by design
    }
    return {p for p in pids if p}


def _spare_pid() -> int | None:
    server = spawn._spare
    return server.proc.pid if server is not None else None


def _others(procs: dict) -> set[Key]:
    """Descendants that are neither a longer-lived fixture's, nor a helper, nor reported."""
    for fixturedef, keys in _held.items():
        _held[fixturedef] = keys | subtree(keys, procs)  # ranks a restart forked, too
    held = set().union(*_held.values())
    helpers = _helpers()
    return {k for k in descendants(procs=procs) - held - _reported if k[0] not in helpers}


def _fail_if_left(keys: set[Key], what: str) -> None:
    helpers = _helpers()
    left = wait_gone({k for k in keys if k[0] not in helpers}, ORPHAN_WAIT)
    if left:
        names = describe(left)
        _reported.update(left)
        end(left)
        pytest.fail(f"{what} left {len(left)} process(es) running (now ended):\n{names}")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    if fixturedef.scope == "function":
        return (yield)
    before = descendants()
    try:
        return (yield)
    finally:
        procs = table()
        others = set().union(*(keys for f, keys in _held.items() if f is not fixturedef))
        # not what an earlier fixture's processes started meanwhile (the notebooks' kernels)
        new = descendants(procs=procs) - before - subtree(others, procs)
        if new:
            _held[fixturedef] = _held.get(fixturedef, set()) | new


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    keys = _held.pop(fixturedef, None)
    if keys:
        keys = (keys | subtree(keys)) - _reported
        _fail_if_left(keys, f"the {fixturedef.scope}-scoped fixture {fixturedef.argname!r}")


@pytest.fixture(autouse=True)
def no_orphans(request: pytest.FixtureRequest):
    """After the test, every process it started has ended (within ORPHAN_WAIT s)."""
    before = _others(table())
    yield
    _fail_if_left(_others(table()) - before, request.node.nodeid)


def _left_files() -> list[str]:
    """What labkit left in this run's temporary directory: its labs' socket directories,
    shared-memory folders and the fork server logs of dead kernels. The logs' root itself is
    allowed (labkit keeps logs there by design, pruned); so is what other programs make
    (torchrun, pytest)."""
    left = []
    for name in sorted(os.listdir(_TMP.name)):
        if name.startswith("labkit"):
            left.append(os.path.join(_TMP.name, name))
    logs = os.environ.get(log_dirs.ENV, "")
    if os.path.isdir(logs):
        left += [  # a dead kernel's (this process's spare fork server still runs)
            os.path.join(logs, n)
            for n in os.listdir(logs)
            if n.startswith(log_dirs.FORK_SERVER_LOG)
            and not pid_alive(log_dirs._kernel_pid(n) or 0)
        ]
    return left


def _report(session: pytest.Session, title: str, msg: str, fail: bool = True) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", title, red=True)
        reporter.write_line(msg)
    else:
        print(msg, file=sys.stderr)
    if fail:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    """Per part of the run: the notebooks' times beside the other tests' (CI's log shows them)."""
    lines = _batch[0].summary() if _batch else []
    if lines:
        terminalreporter.write_sep("=", "notebooks beside the other tests")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """After every fixture's teardown: a descendant still running fails the run; a temporary
    file of labkit's still there is named and fails the run (LABKIT_STRICT_FILES=0 only names
    it: for a run that is meant to leave them, e.g. one stopped half-way)."""
    stop_forkserver()
    spawn.close_spare()
    helpers = _helpers()
    left = wait_gone({k for k in descendants() if k[0] not in helpers}, ORPHAN_WAIT)
    if left:
        names = describe(left)
        end(left)
        msg = f"{len(left)} process(es) outlived the test session (now ended):\n{names}"
        _report(session, "orphans", msg)
    files = _left_files()
    if files:
        _report(
            session,
            "files left",
            f"labkit left {len(files)} temporary file(s):\n" + "\n".join(files),
            fail=os.environ.get("LABKIT_STRICT_FILES", "1") != "0",
        )
    _TMP.cleanup()


@pytest.fixture(scope="module")
def lab():
    import labkit

    lab = labkit.Lab(4, device="cpu")
    yield lab
    lab.stop()


@pytest.fixture(scope="module", params=["idle", "loaded"])
def load(request: pytest.FixtureRequest):
    """Each test of a module that uses this runs twice: on a quiet CPU, then a saturated one."""
    if request.param == "idle":
        yield []
    else:
        with busy_cpus() as pids:
            yield pids


@pytest.fixture
def cpu_load():
    """Every CPU busy while the test runs; yields the busy loops' pids."""
    with busy_cpus() as pids:
        yield pids
