"""Collective size sweeps: the least-squares fit on exact lines, the view's state and
bandwidths from nccl-tests' factors, and a tiny real sweep on 4 ranks (counts, not speed)."""

from __future__ import annotations

import pytest

from labkit.views.sweep_view import fit_alpha_beta, show_sweep, sweep_table

pytestmark = pytest.mark.timeout(120)


def test_fit_recovers_an_exact_line_and_rejects_bad_input() -> None:
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    alpha, beta = fit_alpha_beta(sizes, [1e-4 + 2e-9 * n for n in sizes])
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(2e-9)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_alpha_beta([8, 8], [1.0, 2.0])
    with pytest.raises(ValueError, match="differ in length"):
        fit_alpha_beta([8, 16], [1.0])


def test_table_uses_nccl_tests_factors_and_view_warns_when_oversubscribed() -> None:
    rows = [
        {"op": op, "bytes": n, "seconds": 1e-4 + n * 1e-9, "world_size": 4}
        for op in ("all_reduce", "all_gather")
        for n in (4096, 1 << 20)
    ]
    table = sweep_table(rows)
    ar, ag = table[1], table[3]
    assert ar["algbw"] == pytest.approx((1 << 20) / ar["seconds"])
    assert ar["busbw"] == pytest.approx(ar["algbw"] * 2 * 3 / 4)
    assert ag["busbw"] == pytest.approx(ag["algbw"] * 3 / 4)
    view = show_sweep(rows, num_cpus=2)
    assert "4 ranks on 2 CPU cores" in view.warning
    assert set(view.fits) == {"all_reduce", "all_gather"}
    assert view.fits["all_reduce"][1] == pytest.approx(1e-9)
    assert len(view.figures) == 1 and len(view.figures[0].data) == 4  # points + fit per op
    assert show_sweep(rows, num_cpus=8).warning is None
    with pytest.raises(ValueError, match="no sweep rows"):
        show_sweep([])


def test_real_sweep_on_four_ranks(lab) -> None:
    rows = lab.run(
        "from labkit.parallel.collective_sweep import sweep\n"
        "sweep(['all_reduce', 'broadcast'], [4096, 1 << 16], repeats=2, warmup=1)"
    ).values_by_rank
    assert all(r == rows[0] for r in rows.values())  # the slowest rank's time, everywhere
    assert [(r["op"], r["bytes"]) for r in rows[0]] == [
        ("all_reduce", 4096),
        ("all_reduce", 1 << 16),
        ("broadcast", 4096),
        ("broadcast", 1 << 16),
    ]
    assert all(r["seconds"] > 0 and r["world_size"] == 4 for r in rows[0])
    mine = [r for r in lab.trace() if r.rank == 0]
    timed = [(r.op, r.bytes) for r in mine if r.op in ("all_reduce", "broadcast") and r.bytes > 64]
    assert timed.count(("all_reduce", 4096)) == 3 and timed.count(("broadcast", 1 << 16)) == 3
    with pytest.raises(Exception, match="op must be one of"):
        lab.run("sweep(['gather'], [4096])").raise_for_errors()
