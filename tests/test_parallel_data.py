"""Data-parallel teaching code checked against a single-process reference on 2-3 gloo CPU ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.parallel import data_parallel, grad_accumulation, grad_clipping
from labkit.parallel.datasets import batches, load_digits, partition, shard_sizes

try:
    from tests.distributed import run_ranks
except ImportError:  # tests/ itself on sys.path (pytest's default rootdir-less import)
    from distributed import run_ranks


# ---------------------------------------------------------------- datasets (no ranks)


def test_load_digits_offline_scaled():
    X, y = load_digits()
    assert X.shape == (1797, 64) and X.dtype == torch.float32
    assert y.shape == (1797,) and y.dtype == torch.int64
    assert X.min() == 0.0 and X.max() == 1.0
    assert set(y.tolist()) == set(range(10))


def test_partition_equal_shards_disjoint_and_seeded():
    n, w = 103, 4
    shards = [partition(n, w, r, seed=7) for r in range(w)]
    assert [len(s) for s in shards] == [25] * 4  # remainder of 3 dropped
    union = torch.cat(shards)
    assert len(set(union.tolist())) == 100 and union.max() < n
    assert torch.equal(shards[2], partition(n, w, 2, seed=7))
    assert not torch.equal(shards[2], partition(n, w, 2, seed=8))


def test_partition_unequal_split_is_lopsided_but_covers_everything():
    sizes = shard_sizes(100, 4, equal=False)
    assert sizes == [10, 20, 30, 40]
    shards = [partition(100, 4, r, seed=0, equal=False) for r in range(4)]
    assert sorted(torch.cat(shards).tolist()) == list(range(100))


def test_partition_and_batches_reject_bad_arguments():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        partition(100, 4, 4, seed=0)
    with pytest.raises(ValueError, match="world_size"):
        partition(100, 0, 0, seed=0)
    with pytest.raises(ValueError, match="n must be >= 10 for equal=False"):
        partition(9, 4, 0, seed=0, equal=False)
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, 10\]"):
        batches(torch.arange(10), 11, seed=0, epoch=0)


def test_batches_reshuffle_per_epoch_and_drop_last():
    idx = torch.arange(10, 20)
    b0 = batches(idx, 3, seed=1, epoch=0)
    assert [len(b) for b in b0] == [3, 3, 3]
    assert all(torch.equal(a, b) for a, b in zip(b0, batches(idx, 3, seed=1, epoch=0)))
    assert not all(torch.equal(a, b) for a, b in zip(b0, batches(idx, 3, seed=1, epoch=1)))
    assert set(torch.cat(b0).tolist()) <= set(idx.tolist())


def test_global_batch_must_divide_by_world_size():
    with pytest.raises(ValueError, match="multiple of world_size"):
        data_parallel.step_batches(100, 3, 0, global_batch=16, seed=0, epoch=0)


# ---------------------------------------------------------------- gradient averaging


def _avg_grads(rank: int, world_size: int) -> dict:
    X, y = load_digits()
    idx = torch.arange(96)  # global batch; rank r takes rows r::world_size
    model = data_parallel.make_mlp(seed=rank)  # deliberately different, then fixed by the broadcast
    data_parallel.broadcast_parameters(model, src=0)
    F.cross_entropy(model(X[idx[rank::world_size]]), y[idx[rank::world_size]]).backward()
    data_parallel.average_gradients(model)
    ref = data_parallel.make_mlp(seed=0)
    F.cross_entropy(ref(X[idx]), y[idx]).backward()
    diff = max(
        (p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
    )
    same_weights = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    return {
        "diff": diff,
        "same_weights": same_weights,
        "checksums": data_parallel.param_checksums(model),
    }


MAX_NORM = 0.05


def _gradient_rank(rank: int, world_size: int) -> dict:
    # One spawn for all gradient checks: starting ranks costs more than the checks themselves.
    torch.set_num_threads(1)  # ranks outnumber the 2 shared cores: no intra-op threads
    return {
        "avg": _avg_grads(rank, world_size),
        "clip": _clip(rank, world_size, MAX_NORM),
        "accumulate": _accumulate(rank, world_size),
    }


@pytest.fixture(scope="module")
def gradient_results() -> list[dict]:
    return run_ranks(_gradient_rank, 3)


@pytest.mark.timeout(120)
def test_averaged_gradients_equal_one_process_on_whole_batch(gradient_results):
    results = [r["avg"] for r in gradient_results]
    for r in results:
        assert r["same_weights"]  # broadcast_parameters copied rank 0's init
        assert r["diff"] < 1e-6
    assert results[0]["checksums"] == results[1]["checksums"] == results[2]["checksums"]


# ---------------------------------------------------------------- training and mistakes


def _train_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)  # ranks outnumber the 2 shared cores: no intra-op threads
    X, y = load_digits()
    kw = {"epochs": 1, "global_batch": 64, "lr": 0.5, "seed": 3}
    out: dict = {}
    seen: list[dict] = []
    for mistake in data_parallel.MISTAKES:
        for opt in ("sgd", "adam") if mistake in (None, "average_params_after_step") else ("sgd",):
            model = data_parallel.make_mlp(seed=3)
            lr = kw["lr"] if opt == "sgd" else 0.01
            history = data_parallel.train_sync_sgd(
                model,
                X,
                y,
                kw["epochs"],
                kw["global_batch"],
                lr,
                kw["seed"],
                mistake=mistake,
                on_step=seen.append if mistake is None and opt == "sgd" else None,
                optimizer=opt,
            )
            ref = data_parallel.make_mlp(seed=3)
            ref_history = data_parallel.train_reference(
                ref,
                X,
                y,
                kw["epochs"],
                kw["global_batch"],
                lr,
                kw["seed"],
                world_size,
                opt,
            )
            report = data_parallel.replica_report(model)
            out[(mistake, opt)] = {
                "drift": report["max_abs_diff"],
                "identical": report["identical"],
                "vs_ref": max(
                    (p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
                ),
                "loss": [h["loss"] for h in history],
                "ref_loss": [h["loss"] for h in ref_history],
                "acc": history[-1]["accuracy"],
            }
    out["on_step_calls"] = len(seen)
    return out


@pytest.mark.timeout(120)
def test_sync_sgd_matches_reference_and_mistakes_show():
    results = run_ranks(_train_rank, 2)
    r = results[0]
    good = r[(None, "sgd")]
    assert good["identical"] and good["drift"] == 0.0  # replicas bit-identical
    assert good["vs_ref"] < 1e-5  # equals one process on the whole global batch
    assert good["loss"] == pytest.approx(good["ref_loss"], abs=1e-5)
    assert sum(good["loss"][-3:]) / 3 < 0.6 * good["loss"][0]  # it learns
    assert r["on_step_calls"] == len(good["loss"]) == 1797 // 2 // 32
    assert r[(None, "adam")]["identical"] and r[(None, "adam")]["vs_ref"] < 1e-4
    # Replicas drift apart.
    assert r[("no_average", "sgd")]["drift"] > 1e-3
    assert r[("different_seeds", "sgd")]["drift"] > 1e-2
    # Replicas agree, yet training is not the single-process run.
    for m in ("sum_not_average", "unequal_shards"):
        assert r[(m, "sgd")]["identical"], m
        assert r[(m, "sgd")]["vs_ref"] > 1e-3, m
    # Averaging weights after a local step equals averaging gradients for SGD (a linear
    # update commutes with the mean) but not for Adam (it is not linear in the gradient).
    assert r[("average_params_after_step", "sgd")]["identical"]
    assert r[("average_params_after_step", "sgd")]["vs_ref"] < 1e-5
    assert r[("average_params_after_step", "adam")]["vs_ref"] > 1e-3
    assert results[1][(None, "sgd")]["loss"] == good["loss"]  # every rank reports the same


def test_train_sync_sgd_rejects_unknown_mistake():
    with pytest.raises(ValueError, match="mistake must be one of"):
        data_parallel.train_sync_sgd(
            data_parallel.make_mlp(0), *load_digits(), 1, 64, 0.1, 0, mistake="oops"
        )


# ---------------------------------------------------------------- clipping, accumulation


def _clip(rank: int, world_size: int, max_norm: float) -> dict:
    X, y = load_digits()
    idx = torch.arange(120)  # divisible by 2 and 3: equal shards
    mine = idx[rank::world_size]
    # Reference: one process, whole batch, torch's own clip.
    ref = data_parallel.make_mlp(seed=1)
    F.cross_entropy(ref(X[idx]), y[idx]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    ref_grads = [p.grad for p in ref.parameters()]

    # Data parallel, sharded afterwards: average, then each rank keeps every W-th tensor.
    out = {}
    for how in ("global", "local"):
        model = data_parallel.make_mlp(seed=1)
        F.cross_entropy(model(X[mine]), y[mine]).backward()
        data_parallel.average_gradients(model)
        params = list(model.parameters())
        own = [p for i, p in enumerate(params) if i % world_size == rank]
        if how == "global":
            norm = grad_clipping.clip_grad_norm_global(own, max_norm)
        else:
            norm = grad_clipping.clip_grad_norm_local(own, max_norm)
        diffs = [
            (p.grad - g).abs().max().item()
            for i, (p, g) in enumerate(zip(params, ref_grads))
            if i % world_size == rank
        ]
        out[how] = {"norm": norm.item(), "diff": max(diffs)}
    # Data parallel, clipping each rank's gradient before averaging: also wrong.
    model = data_parallel.make_mlp(seed=1)
    F.cross_entropy(model(X[mine]), y[mine]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    data_parallel.average_gradients(model)
    out["before_avg"] = max(
        (p.grad - g).abs().max().item() for p, g in zip(model.parameters(), ref_grads)
    )
    out["ref_norm"] = ref_norm.item()
    return out


@pytest.mark.timeout(120)
def test_global_clipping_equals_single_process_and_local_does_not(gradient_results):
    for r in (r["clip"] for r in gradient_results):
        assert r["ref_norm"] > MAX_NORM  # the clip is active
        assert r["global"]["norm"] == pytest.approx(r["ref_norm"], rel=1e-5)
        assert r["global"]["diff"] < 1e-6
        assert r["local"]["norm"] < r["ref_norm"] - 1e-4
        assert r["local"]["diff"] > 1e-4
        assert r["before_avg"] > 1e-4


def _accumulate(rank: int, world_size: int) -> dict:
    X, y = load_digits()
    k, micro = 3, 8
    model = data_parallel.make_mlp(seed=5)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    calls: list[int] = []

    def counting_allreduce(state, bucket):  # no annotations: DDP checks them at runtime
        # DDP's default behaviour (sum, then / W), counted: one call per bucket all-reduce.
        calls.append(1)
        buf = bucket.buffer().div_(world_size)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_allreduce)
    # Global batch: 3 micro-steps x W ranks x 8 samples; rank r's micro-step j is one slice.
    starts = [(j * world_size + rank) * micro for j in range(k)]
    mbs = [(X[s : s + micro], y[s : s + micro]) for s in starts]
    grad_accumulation.accumulate_gradients(ddp, mbs)
    ref = data_parallel.make_mlp(seed=5)
    n = k * world_size * micro
    F.cross_entropy(ref(X[:n]), y[:n]).backward()
    diff = max(
        (p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
    )
    return {"diff": diff, "calls": len(calls)}


@pytest.mark.timeout(120)
def test_no_sync_accumulation_equals_large_batch(gradient_results):
    for r in (r["accumulate"] for r in gradient_results):
        assert r["diff"] < 1e-6
        assert r["calls"] == 1  # 3 micro-batches, one all_reduce (the model fits one bucket)


def test_accumulate_rejects_plain_module_and_empty_list():
    with pytest.raises(ValueError, match="at least 1"):
        grad_accumulation.accumulate_gradients(data_parallel.make_mlp(0), [])
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        grad_accumulation.accumulate_gradients(
            data_parallel.make_mlp(0), [(torch.zeros(1, 64), torch.zeros(1).long())]
        )
