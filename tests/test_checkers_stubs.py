"""Every exercise stub of notebooks 00, 10-34 and 44, as the notebook gives it, is rejected by its
checker (on 4 gloo ranks where it needs ranks): an exercise must not pass before the learner
has written anything. The stub cells are read from the notebooks, so an edited stub is tested
as it ships. Notebook 26's (owned with the ZeRO checker) and 28's (it needs RPC up: its stub
is tests/test_rpc.py's `_copy_then_add`) are left out."""

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


def _verdict_of(source: str, lab) -> object:
    """Run the cell as the notebook would (its last line is the checker call) and return the
    value of that last line."""
    tree = ast.parse(source)
    last = tree.body.pop()
    assert isinstance(last, ast.Expr), "the exercise cell must end with the checker call"
    names = {"torch": torch, "dist": dist, "F": F, "os": os, "lab": lab}
    exec(compile(tree, "<exercise>", "exec"), names)
    return eval(compile(ast.Expression(last.value), "<exercise>", "eval"), names)


@pytest.mark.parametrize("notebook", sorted(STUBS))
def test_stub_is_rejected(lab, notebook: str) -> None:
    nb = nbformat.read(NOTEBOOKS / f"{notebook}.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.get("id") == STUBS[notebook])
    verdict = _verdict_of(cell.source, lab)
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
