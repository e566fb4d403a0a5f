"""Code written for torchrun runs unchanged on a lab (2 CPU ranks, gloo).

A cell that calls `init_process_group` and `destroy_process_group` as a script does gives the
right values and leaves the lab's group (and the variables) for the next cell; a call that
asks for another group says which rank and what differs. `lab.run_script` and `%lab run` run
a whole script as `__main__` with `sys.argv`, `examples/ddp_digits.py` among them.
"""

from __future__ import annotations

import os
import re

import pytest
from IPython.core.error import UsageError

import labkit
from labkit.kernel.magics import LabMagics
from labkit.rank.process_group import init_disagreement

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join(ROOT, "examples", "ddp_digits.py")
NOTE = "already up; the call uses it"


@pytest.fixture(scope="module")
def lab():
    lab = labkit.Lab(2, device="cpu")
    yield lab
    lab.stop()


def _ok(res):
    res.raise_for_errors()
    return res


def _write(tmp_path, text: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- init_process_group / destroy_process_group in a cell ------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        'dist.init_process_group("gloo")',
        'dist.init_process_group(init_method="env://")',
        'dist.init_process_group(backend="gloo")',
        "dist.init_process_group()",
        'dist.init_process_group("gloo", rank=rank, world_size=2)',
        'dist.init_process_group("cpu:gloo,cuda:nccl")',
    ],
)
def test_a_torchrun_cell_runs_and_the_next_cell_still_has_the_group(lab, call):
    cell = (
        "kept = 41 + rank\n"
        f"{call}\n"
        "t = torch.ones(1) * (rank + 1)\n"
        "dist.all_reduce(t)\n"
        "dist.destroy_process_group()\n"
        "(t.item(), dist.get_world_size(), dist.is_initialized())"
    )
    res = _ok(lab.run(cell, timeout=60))
    assert res.values_by_rank == {0: (3.0, 2, True), 1: (3.0, 2, True)}
    res = _ok(lab.run("t = torch.ones(1) * 5\ndist.all_reduce(t)\n(t.item(), kept)", timeout=60))
    assert res.values_by_rank == {0: (10.0, 41), 1: (10.0, 42)}  # the group, and the names
    ops = [(rec.rank, rec.op, rec.group) for rec in lab.trace()]  # the tracer still sees it
    assert sorted(ops) == [(0, "all_reduce", (0, 1)), (1, "all_reduce", (0, 1))]


def test_a_note_on_rank_0_the_first_time_only(lab):
    lab.restart()  # a fresh process: the notes have not been printed yet
    cell = 'dist.init_process_group("gloo")\ndist.destroy_process_group()'
    first = _ok(lab.run(cell, timeout=60))
    assert NOTE in first[0].output and "keeps its default group" in first[0].output
    assert first[1].output == ""
    again = _ok(lab.run(cell, timeout=60))
    assert again[0].output == ""


def test_destroy_process_group_destroys_the_other_groups(lab):
    res = lab.run(
        "from torch.distributed.distributed_c10d import _world\n"
        "a, b = dist.new_group([0, 1]), dist.new_group([0, 1])\n"
        "dist.destroy_process_group(a)  # a subgroup: really destroyed\n"
        "after_a = (a in _world.pg_map, b in _world.pg_map)\n"
        "dist.destroy_process_group()  # every group but the lab's default one\n"
        "(after_a, b in _world.pg_map, dist.group.WORLD in _world.pg_map)",
        timeout=60,
    )
    assert _ok(res).values_by_rank == {r: ((False, True), False, True) for r in (0, 1)}


@pytest.mark.parametrize(
    "call,differs",
    [
        ('"gloo", world_size=3', r"world_size 3 here, 2 in the lab"),
        ('"gloo", rank=1 - rank, world_size=2', r"rank (1 here, 0|0 here, 1) in the lab"),
        ('"nccl"', r"backend 'nccl' here, 'gloo' in the lab"),
        ('init_method="tcp://127.0.0.1:1?rank=0&world_size=4"', r"world_size 4 here"),
    ],
)
def test_an_init_that_asks_for_another_group_says_which_rank_and_what_differs(lab, call, differs):
    res = lab.run(f"dist.init_process_group({call})", timeout=60)
    for r in (0, 1):
        error = res[r].error
        assert error["type"] == "ValueError"
        assert error["message"].startswith(f"rank {r}: init_process_group(")
        assert re.search(differs, error["message"]), error
        assert "process_group.py" not in error["traceback"]  # the user's frames only
    assert _ok(lab.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")).values_by_rank == {
        0: 2.0,
        1: 2.0,
    }


def test_init_disagreement_reads_what_torch_would_read():
    have = {"backend": "gloo", "world_size": 2, "rank": 1}
    env = {"RANK": "1", "WORLD_SIZE": "2"}
    assert init_disagreement({}, have, "cpu", env) == []
    assert init_disagreement({"backend": "GLOO"}, have, "cpu", env) == []
    assert init_disagreement({"backend": "cuda:nccl,cpu:gloo"}, have, "cpu", env) == []
    assert init_disagreement({"backend": "cuda:nccl"}, have, "cpu", env) == [
        "backend 'cuda:nccl' here, 'gloo' in the lab"
    ]
    moved = {"RANK": "0", "WORLD_SIZE": "3"}  # env:// reads RANK and WORLD_SIZE
    assert init_disagreement({"init_method": "env://"}, have, "cpu", moved) == [
        "world_size 3 here, 2 in the lab",
        "rank 0 here, 1 in the lab",
    ]
    # a store or another init_method does not read the environment; its URL query counts
    assert init_disagreement({"store": object()}, have, "cpu", moved) == []
    url = {"init_method": "tcp://h:1?rank=1&world_size=2"}
    assert init_disagreement(url, have, "cpu", moved) == []
    assert init_disagreement({"world_size": 2, "rank": -1}, have, "cpu", env) == []


def test_ranks_have_the_variables_torchrun_sets(lab):
    names = (
        "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK "
        "GROUP_WORLD_SIZE ROLE_NAME ROLE_RANK ROLE_WORLD_SIZE TORCHELASTIC_RUN_ID "
        "TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS"
    ).split()
    cell = (
        f"import os\n([n for n in {names} if n not in os.environ], dist.is_torchelastic_launched())"
    )
    assert _ok(lab.run(cell)).values_by_rank == {0: ([], True), 1: ([], True)}


# -- lab.run_script and %lab run -------------------------------------------------------------
SCRIPT = """\
import os
import sys

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    t = torch.tensor([float(sys.argv[1]) * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    name = os.path.basename(sys.argv[0])
    env = os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"] != ""
    print(__name__, name, sys.argv[2:], __file__ == sys.argv[0], env, t.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def test_run_script_runs_it_as_main_with_its_argv(lab, tmp_path):
    path = _write(tmp_path, SCRIPT)
    before = _ok(lab.run("import sys\n(sys.argv, sys.path[0])")).values_by_rank
    res = _ok(lab.run_script(path, ["2.5", "--flag", "a b"], timeout=60))
    for r in (0, 1):
        expected = f"__main__ script.py ['--flag', 'a b'] True ('{r}', '2', True) 7.5\n"
        # rank 0 adds labkit's notes the first time its process takes such a call: whether an
        # earlier test in this module's lab did depends on the order (test_a_note_on_rank_0...)
        lines = res[r].output.splitlines(keepends=True)
        assert "".join(ln for ln in lines if not ln.startswith("labkit: ")) == expected
        assert res[r].value is None
    after = lab.run("import sys\n(sys.argv, sys.path[0], 'main' in globals())")
    assert _ok(after).values_by_rank == {r: (*before[r], False) for r in (0, 1)}
    t = _ok(lab.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")).values_by_rank
    assert t == {0: 2.0, 1: 2.0}


def test_run_script_error_shows_the_script_lines(lab, tmp_path):
    path = _write(tmp_path, "import torch\n\nx = 1\nraise RuntimeError(f'broken {x}')\n")
    res = lab.run_script(path, timeout=60)
    for r in (0, 1):
        error = res[r].error
        assert error["type"] == "RuntimeError" and error["message"] == "broken 1"
        assert f'File "{path}", line 4' in error["traceback"]
        assert "raise RuntimeError(f'broken {x}')" in error["traceback"]
        assert os.path.join("labkit", "rank") not in error["traceback"]  # labkit's frames


@pytest.mark.parametrize(
    "code,errors",
    [
        ("sys.exit(0)", {}),
        ("sys.exit()", {}),
        ("raise SystemExit(None)", {}),
        ("sys.exit(0 if rank == 0 else 3)", {1: r"^script.py exited with code 3 on rank 1 \("}),
        ("sys.exit('bad input')", {0: r"exited on rank 0: bad input", 1: r"on rank 1: bad"}),
    ],
)
def test_sys_exit_zero_is_success_and_another_code_an_error(lab, tmp_path, code, errors):
    path = _write(tmp_path, f"import os, sys\nrank = int(os.environ['RANK'])\n{code}\n")
    res = lab.run_script(path, timeout=60)
    assert {r for r in (0, 1) if res[r].error} == set(errors)
    for r, pattern in errors.items():
        assert res[r].error["type"] == "ScriptExit"
        assert re.search(pattern, res[r].error["message"]), res[r].error
        assert f'File "{path}", line 3' in res[r].error["traceback"]  # where it exited


def test_run_script_checks_its_input_before_sending_anything(lab, tmp_path):
    cell = lab.last_cell
    missing = str(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError, match=r"no script at '.*nope.py' \(looked for /"):
        lab.run_script(missing)
    with pytest.raises(FileNotFoundError, match="relative to the kernel's working directory"):
        lab.run_script("no/such/train.py")
    with pytest.raises(IsADirectoryError, match=r"is not a file; .* such as '.*train.py'"):
        lab.run_script(str(tmp_path))
    path = _write(tmp_path, "print('hi')\n")
    with pytest.raises(TypeError, match=r"argv is a list of strings, .* got '--epochs 1'"):
        lab.run_script(path, "--epochs 1")
    with pytest.raises(TypeError, match=r"got \['--epochs', 1\]"):
        lab.run_script(path, ["--epochs", 1])
    with pytest.raises(SyntaxError):
        lab.run_script(_write(tmp_path, "def broken(:\n", "bad.py"))
    assert lab.last_cell == cell  # nothing was sent


def test_lab_run_magic(lab, tmp_path, capsys, monkeypatch):
    # %lab run uses the current lab: the module's, whatever lab another test made current last
    monkeypatch.setattr(labkit.kernel.lab, "_current", lab)
    magics = LabMagics(shell=None)
    with pytest.raises(UsageError, match=r"%lab run needs a SCRIPT.*\nusage: %lab run \[--"):
        magics.lab("run")
    with pytest.raises(UsageError, match=r"%lab run: no script at 'missing.py'.*\nusage:"):
        magics.lab("run missing.py --epochs 1")
    path = _write(tmp_path, SCRIPT, "with space.py")
    magics.lab(f"run --timeout 60 '{path}' 4 --timeout 3")
    out = capsys.readouterr().out
    assert "[rank 1] __main__ with space.py ['--timeout', '3'] True ('1', '2', True) 12.0" in out
    fail = _write(tmp_path, "import sys\nsys.exit(2)\n", "fail.py")
    with pytest.raises(labkit.RemoteError, match="fail.py exited with code 2"):
        magics.lab(f"run {fail}")


@pytest.mark.timeout(180)
def test_ddp_digits_example_runs_unchanged_on_the_lab(lab):
    res = _ok(lab.run_script(DIGITS, ["--epochs", "1", "--check"], timeout=150))
    out = res[0].output
    assert "world_size 2 steps 14 identical True" in out  # 898 // 64 = 14 steps per epoch
    final = float(re.search(r"final loss (\d+\.\d+)", out).group(1))
    ref = float(re.search(r"reference loss (\d+\.\d+) ok", out).group(1))
    assert abs(final - ref) < 1e-5
    assert res[1].output == ""  # rank 0 reports
    t = _ok(lab.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")).values_by_rank
    assert t == {0: 2.0, 1: 2.0}


@pytest.mark.timeout(240)
def test_a_script_on_ranks_started_by_torchrun(tmp_path):
    from test_attach import end, start_torchrun

    with labkit.Lab.attach(2, wait=False) as attached:
        procs = start_torchrun(attached.endpoint, attached.key_file)
        try:
            attached.wait_attached(180)
            res = _ok(attached.run_script(_write(tmp_path, SCRIPT), ["1"], timeout=60))
            for r in (0, 1):
                assert f"__main__ script.py [] True ('{r}', '2', True) 3.0\n" in res[r].output
            t = _ok(attached.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()", timeout=60))
            assert t.values_by_rank == {0: 2.0, 1: 2.0}
        finally:
            attached.stop()
            end(procs)
