"""The DDP lab/torchrun benchmark (labkit.tools.bench_ddp) on a CPU rank: both sides run the
same step and report their own medians, the ratio is theirs, bad input is refused with what is
allowed, and nothing is left behind (the lab's ranks, torchrun's workers, the script's folder)."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

from labkit.tools import bench_ddp


@pytest.mark.timeout(240)
def test_one_round_on_a_cpu_rank_gives_both_medians_and_their_ratio():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "labkit-bench-ddp-*")))
    said = []
    res = bench_ddp.ddp_ratio(1, "cpu", "bench", rounds=1, steps=3, warmup=1, progress=said.append)
    assert res["backend"] == "gloo" and res["width_depth_batch"] == (512, 4, 64)
    (lab_s,), (run_s,) = res["lab_s"], res["torchrun_s"]
    assert 0 < lab_s < 5 and 0 < run_s < 5  # a 4 x Linear(512) step on 64 rows: milliseconds
    assert res["ratio"] == pytest.approx(lab_s / run_s)
    assert said and said[0].startswith("  round 1/1: lab ")
    assert "DDP step, lab / torchrun = " in bench_ddp.line(res)
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "labkit-bench-ddp-*")))
    assert after == before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"model": "huge"}, r"model must be one of \['bench', 'issue'\], got 'huge'"),
        ({"rounds": 0}, r"rounds and steps must be 1 or more.*rounds=0"),
        ({"warmup": -1}, r"warmup 0 or more.*warmup=-1"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench_ddp.ddp_ratio(1, "cpu", **kwargs)
