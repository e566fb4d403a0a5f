"""Every exercise stub of notebooks 00 and 10-50, as the notebook gives it, is rejected by its
checker, every checker of a cell that has several (on 4 gloo ranks where it needs ranks): an
exercise must not pass before the learner has written anything. The stub cells are read from
the notebooks, so an edited stub is tested as it ships. Notebook 26's (owned with the ZeRO
checker) and 28's (it needs RPC up: its stub is tests/test_rpc.py's `_copy_then_add`) are left
out."""

from __future__ import annotations

import ast
import os
import pathlib

import nbformat
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytestmark = pytest.mark.timeout(180)

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
STUBS = {  # notebook: the id of its exercise cell (the stub and the checker call)
    "00_start": "4961ec92",
    "10_process_groups": "55ca934e",
    "11_point_to_point": "42884f28",
    "12_collectives": "e265f56c",
    "13_ring_allreduce": "d961e10e",
    "14_measuring_collectives": "f97ecbd0",
    "15_when_things_go_wrong": "7d474619",
    "20_distributed_sgd": "30196ea7",
    "21_classic_mistakes": "11460d08",
    "22_dp_vs_ddp": "41a5c43e",
    "23_accumulation_clipping_syncbn": "5a16b634",
    "24_checkpoints": "93b189a3",
    "25_sync_vs_async": "d0655a2c",
    "27_beyond_one_machine": "1fe9fe7c",
    "29_uneven_inputs_elastic": "c16",
    "30_model_parallel_by_hand": "3351e6da",
    "31_pipeline_parallel": "d856aa86",
    "32_tensor_parallel": "e75f2457",
    "33_auto_split": "fc366a39",
    "34_what_is_not_model_parallelism": "190b9b16",
    "44_checkpoints_at_scale": "eea4327b",
}
MORE_STUBS = [  # notebooks with two exercises, and those after 34
    ("35_expert_parallel", "0a92228f"),
    ("35_expert_parallel", "49eb0973"),
    ("36_context_parallel", "1e29efb6"),
    ("36_context_parallel", "63891a11"),
    ("37_memory_of_a_step", "8c78fbd5"),
    ("37_memory_of_a_step", "a1f0c011"),
    ("38_sequence_parallel", "c25"),
    ("38_sequence_parallel", "c26c"),
    ("39_two_d_parallelism", "c21"),
    ("40_pipeline_schedules", "c17"),
    ("40_pipeline_schedules", "c18c"),
    ("41_fsdp2_in_depth", "c30"),
    ("42_finding_a_configuration", "bb26c44d"),
    ("43_the_data_side", "a136055c"),
    ("45_experts_continued", "9ffc21f1"),
    ("46_where_the_time_goes", "c24"),
    ("47_ulysses_and_cp_backward", "071cbb6b"),
    ("48_vocab_parallel_and_gqa", "4799d2c9"),
    ("49_compile_with_ddp_and_fsdp2", "c49-26"),
    ("50_nccl_and_hardware", "c33"),
]


def _checker_calls(statement: ast.stmt) -> list[ast.Call]:
    """The calls of a checker (`check_...`, `ex.check_...`) in a statement, wrapped or not
    (`display(ex.check_x(f))`, `print(ex.check_x(f).message)`)."""

    def name(call: ast.Call) -> str:
        func = call.func
        return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")

    return [
        n for n in ast.walk(statement) if isinstance(n, ast.Call) and name(n).startswith("check_")
    ]


def _verdicts_of(source: str, lab, earlier: tuple[str, ...] = ()) -> list[object]:
    """Run the cell as the notebook would and return what each of its checker calls gave; the
    `earlier` exercise cells of its notebook run first, without their checker calls (a second
    exercise uses the first's imports)."""
    names = {"torch": torch, "dist": dist, "F": F, "os": os, "lab": lab}
    verdicts = []
    for text in (*earlier, source):
        verdicts = []
        for statement in ast.parse(text).body:
            calls = _checker_calls(statement)
            if not calls:
                code = compile(ast.Module([statement], type_ignores=[]), "<exercise>", "exec")
                exec(code, names)
            elif text is source:
                for call in calls:
                    code = compile(ast.Expression(call), "<exercise>", "eval")
                    verdicts.append(eval(code, names))
    assert verdicts, "the exercise cell must call its checker"
    return verdicts


@pytest.mark.parametrize(
    "notebook, cell_id",
    sorted(STUBS.items()) + MORE_STUBS,
    ids=[f"{n}-{c}" for n, c in sorted(STUBS.items()) + MORE_STUBS],
)
def test_stub_is_rejected(lab, notebook: str, cell_id: str) -> None:
    nb = nbformat.read(NOTEBOOKS / f"{notebook}.ipynb", as_version=4)
    ids = [c for n, c in sorted(STUBS.items()) + MORE_STUBS if n == notebook]
    earlier = ids[: ids.index(cell_id)]
    cells = {c.get("id"): c.source for c in nb.cells}
    for verdict in _verdicts_of(cells[cell_id], lab, tuple(cells[c] for c in earlier)):
        assert not verdict, f"{notebook}: the stub passes as given: {verdict!r}"
        assert verdict.message, verdict


def test_what_is_it_stub_names_no_category() -> None:
    """Notebook 34's stub once came with four of six names already right (two edits passed):
    now it answers none, so every name must be placed."""
    from labkit.exercises.model_parallel_checks import CATEGORIES

    nb = nbformat.read(NOTEBOOKS / "34_what_is_not_model_parallelism.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.get("id") == STUBS["34_what_is_not_model_parallelism"])
    names: dict = {}
    exec(cell.source.rsplit("\ncheck_what_is_it(", 1)[0], names)
    assert not set(map(str.lower, names["answers"].values())) & set(CATEGORIES)
