"""torch.distributed.checkpoint at scale (labkit/parallel/checkpoint_scale.py, notebook 44):
a checkpoint saved by FSDP2 on 4 ranks (Shard(0)) loads bit for bit on 2 ranks (Shard(1));
an interrupted run resumed with the data position and per-rank RNG equals the run that never
stopped, and each thing forgotten makes it drift; async_save writes what a sync save writes.

Everything runs on the module's 4-rank lab (one start of the ranks, whose imports the
exercise's checker then reuses); the 2-rank job is ranks 0 and 1 in a group of their own
(notebook 44 restarts a real 2-rank lab)."""

from __future__ import annotations

import os
import sys
import threading

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from labkit.exercises.checkpoint_scale_checks import check_resume_state, solution_resume_state
from labkit.parallel import checkpoint_scale as cs
from labkit.parallel.datasets import load_digits

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module
N_ROWS, BATCH = 512, 32  # 128 rows a rank on 4 ranks: 4 steps an epoch


def _setup(rank, world_size, seed, dim=0, p=0.3, mesh=None):
    import torch.distributed.tensor  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world_size,))
    model = cs.shard_mlp(cs.make_dropout_mlp(seed=seed, p=p), mesh, dim=dim)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sampler = DistributedSampler(range(N_ROWS), world_size, rank, shuffle=True, seed=0)
    return model, opt, sampler


def _full(model):
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _save4(rank, world_size, path):
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    X, y = load_digits()
    model, opt, sampler = _setup(rank, world_size, seed=0, p=0.0)
    cs.train(model, opt, X, y, sampler, BATCH, (0, 0), (0, 3))
    msd, osd = get_state_dict(model, opt)
    save({"model": msd, "optim": osd}, checkpoint_id=path)
    exp_avg = {k: v["exp_avg"].full_tensor() for k, v in osd["state"].items()}
    # the one-process reference: the same 3 steps on the 4 ranks' batches together
    one = cs.make_dropout_mlp(seed=0, p=0.0)
    one_opt = torch.optim.Adam(one.parameters(), lr=1e-2)
    for i in range(3):
        idx = torch.cat([cs.batches(_Sampler(r, world_size), BATCH, 0)[i] for r in range(4)])
        one_opt.zero_grad()
        torch.nn.functional.cross_entropy(one(X[idx]), y[idx]).backward()
        one_opt.step()
    return _full(model), exp_avg, dict(one.named_parameters())


class _Sampler(DistributedSampler):
    def __init__(self, rank, world_size):
        super().__init__(range(N_ROWS), world_size, rank, shuffle=True, seed=0)


def _load2(rank, path):
    """On ranks 0 and 1 only, in a group of their own: the 2-rank job, columns cut 2 ways."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group([0, 1], use_local_synchronization=True)  # ranks 2, 3 stay out
    mesh = DeviceMesh.from_group(group, "cpu")
    model, opt, _ = _setup(rank, 2, seed=5, dim=1, p=0.0, mesh=mesh)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    reader = cs.RecordingReader(path)
    load(state, storage_reader=reader, process_group=group)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    _, osd = get_state_dict(model, opt)
    exp_avg = {k: v["exp_avg"].full_tensor() for k, v in osd["state"].items()}
    reads = sorted(r for r in reader.reads if r[0] in ("model.0.weight", "model.0.bias"))
    return _full(model), exp_avg, shapes, reads


def _four(rank, world_size, root):
    """Everything that runs on 4 ranks, in one spawn (starting ranks is the slow part)."""
    return {
        "save": _save4(rank, world_size, f"{root}/ckpt"),
        "resume": _resume_all(rank, world_size, root),
        "async": _async(rank, world_size, root),
    }


def _on(lab, fn, ranks=None):
    results = lab.run(fn, ranks=ranks, timeout=240, display=False)
    results.raise_for_errors()
    return [value for _, value in sorted(results.values_by_rank.items())]


@pytest.fixture(scope="module")
def four(lab, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    return root, _on(lab, lambda rank, world_size: _four(rank, world_size, root))


@pytest.mark.timeout(240)
def test_reshard_4_to_2_bitwise(lab, four):
    root, results = four
    path = f"{root}/ckpt"
    files = sorted(os.listdir(path))
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    full4, exp4, one = results[0]["save"]
    # FSDP2 on 4 ranks = one process on the whole batch, up to rounding that Adam enlarges
    # where a gradient element nearly cancels: 1.9e-6 at most on an AVX-512 Xeon (under 1e-6
    # on others); a rank's own batch alone is 0.06 off, a summed loss 0.004 (2026-11-27)
    for name, p in one.items():
        assert (full4[name] - p.detach()).abs().max() < 2e-5, name
    loaded = _on(lab, lambda rank: _load2(rank, path), ranks="0,1")
    assert len(loaded) == 2
    for rank, (full2, exp2, shapes, reads) in enumerate(loaded):
        # (key, saved chunk, piece's offset in it, in this rank's tensor, lengths), by hand:
        # the rank's 32 columns cross all four saved row chunks of 0.weight, its 64 rows of
        # 0.bias only two of the four saved chunks
        weight = [("model.0.weight", (32 * k, 0), (0, 32 * rank), (32 * k, 0), (32, 32))
                  for k in range(4)]  # fmt: skip
        bias = [("model.0.bias", (32 * k,), (0,), (32 * (k - 2 * rank),), (32,))
                for k in (2 * rank, 2 * rank + 1)]  # fmt: skip
        assert reads == sorted(weight + bias), reads
        assert full2.keys() == full4.keys()
        assert all(torch.equal(full2[k], full4[k]) for k in full4)
        assert all(torch.equal(exp2[k], exp4[k]) for k in exp4)
        assert shapes == {"0.weight": (128, 32), "0.bias": (64,), "3.weight": (10, 64),
                          "3.bias": (5,)}  # fmt: skip


def _resume(rank, world_size, path, forget, straight):
    """A run stopped at (1, 2) and resumed from DCP forgetting `forget` (None: nothing);
    returns whether its final weights equal `straight`'s (the run that never stopped) bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    X, y = load_digits()
    device = torch.device("cpu")  # the test lab's ranks are CPU ones (gloo)
    torch.manual_seed(100 + rank)
    model, opt, sampler = _setup(rank, world_size, seed=0)
    pos = cs.train(model, opt, X, y, sampler, BATCH, (0, 0), (1, 2))
    extra = cs.resume_extra(pos, device)
    if forget == "shared rng key":
        extra["rng"] = extra.pop(cs.rng_key(rank))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=f"{path}/{forget}")

    torch.manual_seed(999)  # a new process: another RNG state, fresh model and optimizer
    model, opt, sampler = _setup(rank, world_size, seed=7)
    msd, osd = get_state_dict(model, opt)
    template = cs.resume_extra((0, 0), device)
    if forget == "shared rng key":
        template["rng"] = template.pop(cs.rng_key(rank))
    state = {"model": msd, "optim": osd, "extra": template}
    dcp.load(state, checkpoint_id=f"{path}/{forget}")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = state["extra"]
    if forget == "shared rng key":
        cs.set_rng_state(extra["rng"], device)
        pos = extra["epoch"], extra["index"]
    elif forget != "rng":
        pos = cs.restore_extra(extra, device)
    else:
        pos = extra["epoch"], extra["index"]
    if forget == "epoch":
        pos = (0, pos[1])
    if forget == "index":
        pos = (pos[0], 0)
    cs.train(model, opt, X, y, sampler, BATCH, pos, (2, 2))
    resumed = _full(model)
    return all(torch.equal(straight[k], resumed[k]) for k in straight)


# the notebook shows all five drifting; here the exact resume, the shared key (what rng_key is
# for) and the epoch (that batches() calls set_epoch); the checker's tests reject the rest
FORGETS = (None, "shared rng key", "epoch")


def _resume_all(rank, world_size, path):
    X, y = load_digits()
    torch.manual_seed(100 + rank)
    model, opt, sampler = _setup(rank, world_size, seed=0)
    cs.train(model, opt, X, y, sampler, BATCH, (0, 0), (2, 2))
    straight = _full(model)
    return {f: _resume(rank, world_size, path, f, straight) for f in FORGETS}


@pytest.mark.timeout(240)
def test_exact_resume_and_what_drifts(four):
    for result in four[1]:
        assert result["resume"] == {f: f is None for f in FORGETS}, result["resume"]


def _global_batches(world_size, batch, epoch):
    per_rank = [
        cs.batches(DistributedSampler(range(N_ROWS), world_size, r, shuffle=True, seed=0), batch,
                   epoch)
        for r in range(world_size)
    ]  # fmt: skip
    return [sorted(torch.cat([b[k] for b in per_rank]).tolist()) for k in range(len(per_rank[0]))]


def test_the_data_position_carries_over_to_another_world_size():
    """What notebook 44 says of a 4 -> 2 rank restart: with the global batch kept (32 a rank on
    4, 64 on 2), step k of an epoch takes the same samples, so (epoch, step) still holds; the
    epoch changes them, and so does a global batch that is not kept."""
    for epoch in (0, 1):
        four_ranks = _global_batches(4, BATCH, epoch)
        assert len(four_ranks) == 4 and four_ranks == _global_batches(2, 2 * BATCH, epoch)
        assert four_ranks != _global_batches(2, BATCH, epoch)[:4]
    assert _global_batches(4, BATCH, 0) != _global_batches(4, BATCH, 1)


def _async(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    X, y = load_digits()
    model, opt, sampler = _setup(rank, world_size, seed=0)
    cs.train(model, opt, X, y, sampler, BATCH, (0, 0), (0, 1))
    group = dist.new_group(backend="gloo")
    before = {k: v.full_tensor() for k, v in get_state_dict(model, opt)[0].items()}
    gate = threading.Event()
    msd, osd = get_state_dict(model, opt)
    future = dcp.async_save(
        {"model": msd}, storage_writer=cs.GatedWriter(f"{path}/async", gate), process_group=group
    )
    written_early = os.path.exists(f"{path}/async/.metadata")
    cs.train(model, opt, X, y, sampler, BATCH, (0, 1), (0, 2))  # changes the weights
    gate.set()
    future.result()
    dist.barrier()
    template = get_state_dict(model, opt)[0]
    dcp.load({"model": template}, checkpoint_id=f"{path}/async")
    loaded = {k: v.full_tensor() for k, v in template.items()}
    equal = all(torch.equal(before[k], loaded[k]) for k in before)
    return written_early, equal, _async_staged(model, opt, X, y, sampler, group, path)


def _async_staged(model, opt, X, y, sampler, group, path):
    """What notebook 44 says of async staging: with a DefaultStager that stages in its own
    thread, async_save returns an AsyncSaveResponse; once staging_completion is done the weights
    may change, and upload_completion ends the save (CPU ranks: no pinned memory, no
    non-blocking copies, which need a GPU)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    before = {k: v.full_tensor() for k, v in get_state_dict(model, opt)[0].items()}
    stager = DefaultStager(StagingOptions(False, False, True, False))  # pin, share, async, nb
    response = dcp.async_save(
        {"model": get_state_dict(model, opt)[0]},
        checkpoint_id=f"{path}/staged",
        process_group=group,
        async_stager=stager,
    )
    response.staging_completion.result()  # the copy is done: the weights may change
    cs.train(model, opt, X, y, sampler, BATCH, (0, 2), (0, 3))
    response.upload_completion.result()
    stager.close()
    template = get_state_dict(model, opt)[0]
    dcp.load({"model": template}, checkpoint_id=f"{path}/staged")
    loaded = {k: v.full_tensor() for k, v in template.items()}
    return isinstance(response, AsyncSaveResponse) and all(
        torch.equal(before[k], loaded[k]) for k in before
    )


@pytest.mark.timeout(240)
def test_async_save_writes_the_state_at_the_call(four):
    for result in four[1]:
        written_early, equal, staged = result["async"]
        assert not written_early and equal and staged


# ---------------------------------------------------------------- the exercise's checker


def _rng():
    return torch.get_rng_state()


def save_own_key(position, device):
    return {"epoch": position[0], "index": position[1], f"rng{dist.get_rank()}": _rng()}


def load_own_key(extra, device):
    torch.set_rng_state(extra[f"rng{dist.get_rank()}"])
    return extra["epoch"], extra["index"]


def save_gathered(position, device):  # every rank's state in one tensor: one copy is right
    states = [torch.empty_like(_rng()) for _ in range(dist.get_world_size())]
    dist.all_gather(states, _rng())
    return {"position": torch.tensor(position), "rng_all": torch.stack(states)}


def load_gathered(extra, device):
    torch.set_rng_state(extra["rng_all"][dist.get_rank()].clone())
    return tuple(extra["position"].tolist())


# the notebook's stub (one "rng" key on every rank: DCP keeps one rank's copy) is rejected in
# tests/test_checkers_stubs.py, as the notebook ships it


def load_shared_key(extra, device):
    torch.set_rng_state(extra["rng"])
    return extra["epoch"], extra["index"]


def save_rank0(position, device):  # rank 0's state for everyone
    state = _rng().clone()
    dist.broadcast(state, src=0)
    return {"epoch": position[0], "index": position[1], "rng": state}


def save_no_rng(position, device):
    return {"epoch": position[0], "index": position[1]}


def load_no_rng(extra, device):
    return extra["epoch"], extra["index"]


def load_reseed(extra, device):  # seed again at the restart (torchtitan's way): not the state
    torch.manual_seed(100 + dist.get_rank())  # the run had drawn from it since
    return extra["epoch"], extra["index"]


def load_no_epoch(extra, device):  # the loop counter starts again at 0: set_epoch(0)
    load_own_key(extra, device)
    return 0, extra["index"]


def load_no_index(extra, device):  # the epoch starts again from its first batch
    load_own_key(extra, device)
    return extra["epoch"], 0


def _solution():
    namespace = {"torch": torch, "dist": dist}
    exec(solution_resume_state().code, namespace)
    return namespace["save_extra"], namespace["load_extra"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "save, load, ok, says",
    [
        ("solution", None, True, "bit for bit"),
        (save_gathered, load_gathered, True, "bit for bit"),
        (save_rank0, load_shared_key, False, "rank 0's RNG state"),
        (save_no_rng, load_no_rng, False, "not the one it had"),
        (save_no_rng, load_reseed, False, "not the one it had"),
        (save_own_key, load_no_epoch, False, "epoch"),
        (save_own_key, load_no_index, False, "position in the epoch"),
    ],
)
def test_check_resume_state(lab, save, load, ok, says):
    if save == "solution":
        save, load = _solution()
    verdict = check_resume_state(lab, save, load)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict
