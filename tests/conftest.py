"""Shared fixtures and the orphan check (test process).

- `lab`: a 4-rank CPU lab reused by a module's tests.
- `load` (module scope, params "idle" and "loaded") and `cpu_load`: run tests with every CPU
  busy (tests/load.py). A test that gets `load` runs twice; its loaded run is marked `loaded`.
- The orphan check: no process a test (or labkit, for it) started may outlive the test. After
  each test, the test process's descendants that were not there before it are waited for (up
  to ORPHAN_WAIT s), then named with their command lines, ended, and the test errors. Processes
  started while a module- or session-scoped fixture was set up (a module's lab: its fork
  server and ranks, including ranks a test restarts) belong to that fixture: they are checked
  when it is torn down instead. At the end of the session, any descendant still running fails
  the run. The test process is a child subreaper (tests/processes.py), so an orphan whose
  parent died is still seen here rather than adopted by init.
- Stop: the tests press it as a notebook does, with `_thread.interrupt_main()` (SIGINT to the
  kernel, which ipykernel handles). That does nothing while SIGINT is ignored, as it is in a
  test run started in the background by a non-interactive shell (`cmd &`, nohup), so the suite
  handles SIGINT as Python does by default.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import signal
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can import the harness modules

if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # see "Stop" above

from load import busy_cpus  # noqa: E402
from processes import (  # noqa: E402
    Key,
    become_subreaper,
    descendants,
    describe,
    end,
    pid_alive,
    subtree,
    table,
    wait_gone,
)

from labkit.kernel.inspection import log_dirs  # noqa: E402

__all__ = ["pid_alive"]

ORPHAN_WAIT = 5.0  # seconds a test's processes get to exit after it ends
_held: dict[pytest.FixtureDef, set[Key]] = {}  # a longer-lived fixture's processes
_reported: set[Key] = set()  # named once already (and ended)


def pytest_configure(config: pytest.Config) -> None:
    become_subreaper()
    # the labs' logs go to a directory of this run's, removed at its end
    # (labkit.kernel.inspection.log_dirs)
    if not os.environ.get(log_dirs.ENV):
        os.environ[log_dirs.ENV] = _LOGS.name


_LOGS = tempfile.TemporaryDirectory(prefix="labkit-test-logs-")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("load") == "loaded":
            item.add_marker(pytest.mark.loaded)


def _helpers() -> set[int]:
    """Pids of helpers that live as long as the test process by design."""
    pid = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


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
        new = descendants() - before
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


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """After every fixture's teardown: a descendant still running fails the run."""
    helpers = _helpers()
    left = wait_gone({k for k in descendants() if k[0] not in helpers}, ORPHAN_WAIT)
    if left:
        names = describe(left)
        end(left)
        msg = f"{len(left)} process(es) outlived the test session (now ended):\n{names}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", "orphans", red=True)
            reporter.write_line(msg)
        else:
            print(msg, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
