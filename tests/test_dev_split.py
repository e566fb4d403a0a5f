"""scripts/dev.py test's split (the default; LABKIT_TEST_BESIDE=0 turns it off): the tests that
mostly wait in a pytest of their own.

pytest is replaced by a script that prints its arguments and exits with the code an argument
asks for, so the test sees exactly which two commands dev.py runs and how it joins their results.
"""

from __future__ import annotations

import importlib.util
import os
import stat

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE = """#!/bin/sh
echo "ran: $*"
case "$*" in *beside-fails*) case "$*" in *test_browser.py*) exit 1;; esac;; esac
case "$*" in *others-select-none*) case "$*" in *--ignore=*) exit 5;; esac;; esac
exit 0
"""


@pytest.fixture
def dev(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("labkit_dev_split", f"{ROOT}/scripts/dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(module, "PY", str(fake))
    monkeypatch.setattr(module, "ROOT", str(tmp_path))
    monkeypatch.delenv("LABKIT_TEST_BESIDE", raising=False)  # the default: split
    return module


@pytest.mark.parametrize(
    "args, selects",
    [
        ([], False),
        (["-q", "--durations=25", "--deselect", "tests/test_site.py"], False),
        (["--ignore", "tests/test_browser.py", "-k", "stop"], False),
        (["tests/test_core.py"], True),
        (["-q", "tests/test_core.py::test_run"], True),
        (["tests"], True),
    ],
)
def test_a_run_that_names_tests_is_not_split(dev, args, selects, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert dev.selects_tests(args) is selects


def test_a_whole_run_is_two_pytests_and_prints_both_reports(dev, capfd, tmp_path):
    assert dev.run_tests(["-q", "--deselect", "tests/test_site.py"]) == 0
    out = capfd.readouterr().out
    others = [line for line in out.splitlines() if line.startswith("ran:") and "--ignore=" in line]
    assert len(others) == 1
    for path in dev.BESIDE_TESTS:
        assert f"--ignore={path}" in others[0]
    report = (tmp_path / "build" / "test-beside.log").read_text()
    assert report.startswith("ran: -m pytest " + " ".join(dev.BESIDE_TESTS) + " -q --deselect")
    assert report in out, "the beside part's report is printed after the others'"
    assert "== parts: the others" in out and "(exit 0)" in out


def test_either_part_failing_fails_the_run(dev, capfd):
    assert dev.run_tests(["-k", "beside-fails"]) == 1
    assert "beside" in capfd.readouterr().out


def test_a_part_that_selects_nothing_does_not_fail_the_other(dev):
    assert dev.run_tests(["-k", "others-select-none"]) == 0


def test_selecting_tests_or_opting_out_runs_one_pytest(dev, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert dev.run_tests(["tests/test_core.py"]) == 0
    monkeypatch.setenv("LABKIT_TEST_BESIDE", "0")  # one pytest
    assert dev.run_tests(["-q"]) == 0
    ran = [line for line in capfd.readouterr().out.splitlines() if line.startswith("ran:")]
    assert ran == ["ran: -m pytest tests/test_core.py", "ran: -m pytest -q"]
