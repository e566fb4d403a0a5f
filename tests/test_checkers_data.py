"""The checkers of the data-parallel notebooks 20-27 on 4 gloo ranks: right answers written
several ways (async, flattened, in place or not) are accepted; plausible wrong ones are rejected
with a message that says what is wrong."""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.exercises import (
    async_sgd_checks,
    checkpoint_checks,
    data_parallel_checks,
    multi_node_checks,
    zero_checks,
)

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module


def _verdict(checker, lab, fn, ok: bool, says: str) -> None:
    verdict = checker(lab, fn) if lab is not None else checker(fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


# ---------------------------------------------------------------- 20: average_gradients


def avg_loop(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def avg_op(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def avg_flat_async(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, async_op=True).wait()
    flat /= dist.get_world_size()
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def avg_divide_first(model):
    works = []
    for p in model.parameters():
        p.grad.div_(dist.get_world_size())
        works.append(dist.all_reduce(p.grad, async_op=True))
    for work in works:
        work.wait()


def avg_twice(model):  # AVG already divides
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        p.grad /= dist.get_world_size()


def avg_rebinds(model):  # the notebook's stub filled in: g = g / n changes no p.grad
    grads = [p.grad for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g = g / dist.get_world_size()
    return grads


def avg_float_copy(model):  # .float() is p.grad itself in float32, a copy in float64
    for p in model.parameters():
        dist.all_reduce(p.grad.float(), op=dist.ReduceOp.AVG)


def avg_no_wait(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, async_op=True)


def avg_bf16_wire(model):  # reduced in bfloat16 and copied back: 3 significant digits
    for p in model.parameters():
        half = p.grad.to(torch.bfloat16)
        dist.all_reduce(half, op=dist.ReduceOp.AVG)
        p.grad.copy_(half)


def avg_sum_only(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def avg_divide_only(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def avg_weights_not_grads(model):
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p, op=dist.ReduceOp.AVG)


def avg_first_layer_only(model):
    for p in list(model.parameters())[:2]:
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (avg_loop, True, "whole-batch gradient"),
        (avg_op, True, "whole-batch gradient"),
        (avg_flat_async, True, "whole-batch gradient"),
        (avg_divide_first, True, "whole-batch gradient"),
        (avg_sum_only, False, "summed, not divided by world_size"),
        (lambda model: None, False, "still this rank's own gradient"),
        (avg_divide_only, False, "divided, never summed"),
        (avg_weights_not_grads, False, "still this rank's own gradient"),
        (avg_first_layer_only, False, "differs from the whole batch's by"),
        (avg_twice, False, "it is the mean / 4 (divided twice)"),
        (avg_rebinds, False, "`g = g / n` only rebinds a name"),
        (avg_float_copy, False, "right for float32 gradients, but for float64 rank 0's"),
        (avg_no_wait, False, "rank 0 never waited for its 4 all_reduce requests"),
        (avg_bf16_wire, False, "differs from the whole batch's by"),
    ],
)
def test_average_gradients(lab, fn, ok: bool, says: str) -> None:
    _verdict(data_parallel_checks.check_average_gradients, lab, fn, ok, says)


# ---------------------------------------------------------------- 21: max_replica_diff


def spread_min_max(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).max()


def spread_all_gather(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = torch.empty(dist.get_world_size() * flat.numel())
    dist.all_gather_single(every, flat)
    every = every.view(dist.get_world_size(), -1)
    return float((every.amax(0) - every.amin(0)).max())


def spread_max_minus_own(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hi = flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - flat).max().item()


def spread_on_rank0(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(4)] if dist.get_rank() == 0 else None
    dist.gather(flat, parts, dst=0)
    if parts is None:
        return 0.0
    every = torch.stack(parts)
    return (every.amax(0) - every.amin(0)).max().item()


def spread_largest_weight(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).abs().max()
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return flat


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (spread_min_max, True, "same spread as replica_report"),
        (spread_all_gather, True, "same spread as replica_report"),
        (lambda model: 0.0, False, "one rank's bias moved by 0.5: rank 0 returned 0"),
        (spread_max_minus_own, False, "rank 3 returned 0, expected 0.5"),
        (spread_on_rank0, False, "rank 1 returned 0, expected 0.5"),
        (spread_largest_weight, False, "identical replicas: rank 0 returned"),
    ],
)
def test_max_replica_diff(lab, fn, ok: bool, says: str) -> None:
    _verdict(data_parallel_checks.check_max_replica_diff, lab, fn, ok, says)


# ---------------------------------------------------------------- 22: broadcast_parameters


def bcast_no_grad(model):
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=0)


def bcast_parameters_only(model):  # the classic: BatchNorm's running statistics stay
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)


def bcast_no_wait(model):
    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src=0, async_op=True)


def bcast_float_buffers(model):  # every tensor as float32 in one flat buffer, copied back
    tensors = [*model.parameters(), *model.buffers()]
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    dist.broadcast(flat, src=0)
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))


def bcast_ddp(model):  # DDP's constructor broadcasts rank 0's parameters and buffers itself
    torch.nn.parallel.DistributedDataParallel(model)


def bcast_data_async(model):
    tensors = [*model.parameters(), *model.buffers()]
    works = [dist.broadcast(t.data, src=0, async_op=True) for t in tensors]
    for work in works:
        work.wait()


def bcast_flat(model):
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    with torch.no_grad():
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(piece.view_as(p))
    for b in model.buffers():
        dist.broadcast(b, src=0)


def bcast_object(model):
    box = [model.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model.load_state_dict(box[0])


def bcast_average(model):
    with torch.no_grad():
        for p in [*model.parameters(), *model.buffers()][:-1]:
            dist.all_reduce(p)
            p /= dist.get_world_size()


def bcast_from_1(model):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=1)


def bcast_copies(model):
    for p in model.parameters():
        dist.broadcast(p.detach().clone(), src=0)


def bcast_weights_only(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                dist.broadcast(p, src=0)


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (bcast_no_grad, True, "rank 0's parameters and buffers, bit for bit"),
        (bcast_data_async, True, "rank 0's parameters and buffers, bit for bit"),
        (bcast_flat, True, "rank 0's parameters and buffers, bit for bit"),
        (bcast_object, True, "rank 0's parameters and buffers, bit for bit"),
        (bcast_float_buffers, True, "rank 0's parameters and buffers, bit for bit"),
        (bcast_ddp, True, "rank 0's parameters and buffers, bit for bit"),
        (bcast_parameters_only, False, "rank 1 holds rank 0's parameters, but not its buffers"),
        (bcast_no_wait, False, "rank 0 never waited for its 9 broadcast requests"),
        (lambda model: None, False, "rank 1 still holds its own initial weights"),
        (bcast_average, False, "rank 0's parameters are not rank 0's initial ones"),
        (bcast_from_1, False, "rank 0 holds rank 1's initial weights: broadcast from rank 0"),
        (bcast_copies, False, "rank 1 still holds its own initial weights"),
        (bcast_weights_only, False, "rank 1's parameters are not rank 0's initial ones"),
    ],
)
def test_broadcast_parameters(lab, fn, ok: bool, says: str) -> None:
    _verdict(data_parallel_checks.check_broadcast_parameters, lab, fn, ok, says)


# ---------------------------------------------------------------- 23: clip by the global norm


def clip_reference(params, max_norm):
    grads = [p.grad for p in params]
    sq = sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(sq)
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.float())


def clip_torch_helpers(params, max_norm):  # torch >= 2.6: get_total_norm, clip_grads_with_norm_
    local = torch.nn.utils.get_total_norm([p.grad for p in params])
    sq = local.pow(2)
    dist.all_reduce(sq, async_op=True).wait()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt())


def clip_local(params, max_norm):
    torch.nn.utils.clip_grad_norm_(params, max_norm)


def clip_no_clamp(params, max_norm):
    sq = sum(p.grad.pow(2).sum() for p in params)
    dist.all_reduce(sq)
    for p in params:
        p.grad.mul_(max_norm / sq.sqrt())


def clip_sum_of_norms(params, max_norm):
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    dist.all_reduce(norm)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def clip_mean_square(params, max_norm):
    sq = sum(p.grad.pow(2).sum() for p in params)
    dist.all_reduce(sq, op=dist.ReduceOp.AVG)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt())


def clip_no_sqrt(params, max_norm):
    sq = sum(p.grad.pow(2).sum() for p in params)
    dist.all_reduce(sq)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq)


def clip_no_wait(params, max_norm):
    sq = sum(p.grad.double().pow(2).sum() for p in params)
    dist.all_reduce(sq, async_op=True)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt())


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (clip_reference, True, "with and without clipping"),
        (clip_no_sqrt, False, "max_norm=0.05"),
        (clip_no_wait, False, "rank 0 never waited for its 2 all_reduce requests"),
        (clip_torch_helpers, True, "with and without clipping"),
        (clip_local, False, "max_norm=0.05 (the gradient's norm is 0.297)"),
        (lambda params, max_norm: None, False, "(not clipped, or by a local norm?)"),
        (clip_no_clamp, False, "max_norm=1000 (the gradient's norm is 0.297)"),
        (clip_sum_of_norms, False, "max_norm=0.05"),
        (clip_mean_square, False, "max_norm=0.05"),
    ],
)
def test_clip_global(lab, fn, ok: bool, says: str) -> None:
    _verdict(data_parallel_checks.check_clip_global, lab, fn, ok, says)


def test_clip_cases_clip_once_and_not_once() -> None:
    """The checker's two max_norms lie on both sides of the gradient's norm (one process)."""
    from labkit.parallel.data_parallel import make_mlp
    from labkit.parallel.datasets import load_digits

    X, y = load_digits()
    model = make_mlp(seed=1)
    torch.nn.functional.cross_entropy(model(X[:128]), y[:128]).backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    low, high = data_parallel_checks.MAX_NORMS
    assert low < norm < high


# ---------------------------------------------------------------- 24: save once, load everywhere


def save_reference(path, model):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location=next(model.parameters()).device))


def save_cpu_rank0_keeps(path, model):  # rank 0 keeps what it saved; "cpu" is its device here
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.all_reduce(torch.zeros(1))  # any collective orders the ranks as a barrier does
    if dist.get_rank() != 0:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_storage_lambda(path, model):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location=lambda storage, loc: storage))


def save_no_barrier(path, model):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    model.load_state_dict(torch.load(path, map_location="cpu"))


def save_barrier_first(path, model):
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    model.load_state_dict(torch.load(path, map_location="cpu"))


def save_sleep(path, model):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    else:
        time.sleep(0.2)
    model.load_state_dict(torch.load(path, map_location="cpu"))


def save_long_sleep(path, model):  # longer than the slow disk: right numbers, by timing only
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    else:
        time.sleep(3.0)
    model.load_state_dict(torch.load(path, map_location="cpu"))


def save_async_barrier(path, model):  # a barrier never waited for orders nothing
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.barrier(async_op=True)
    time.sleep(3.0)
    model.load_state_dict(torch.load(path, map_location="cpu"))


def save_broadcast_flag(path, model):  # any call that hears from rank 0 after it saved
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.broadcast(torch.zeros(1), src=0)
    model.load_state_dict(torch.load(path, map_location=next(model.parameters()).device))


def save_send_to_each(path, model):  # point to point: rank 0 tells each rank when it is done
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
        for r in range(1, dist.get_world_size()):
            dist.send(torch.ones(1), dst=r)
    else:
        dist.recv(torch.empty(1), src=0)
        model.load_state_dict(torch.load(path, map_location="cpu"))


def save_object_list(path, model):  # broadcast_object_list passes group_src, not src
    box = [None]
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
        box = [path]
    dist.broadcast_object_list(box, src=0)
    model.load_state_dict(torch.load(box[0], map_location=lambda storage, loc: storage))


def save_group_dst(path, model):  # send/recv named by group_dst/group_src (torch >= 2.6)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
        for r in range(1, dist.get_world_size()):
            dist.send(torch.ones(1), group_dst=r)
    else:
        dist.recv(torch.empty(1), group_src=0)
        model.load_state_dict(torch.load(path, map_location="cpu"))


def save_empty_read(path, model):  # reads a file created but not written yet
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    else:
        open(path + f".{dist.get_rank()}", "wb").close()
        model.load_state_dict(torch.load(path + f".{dist.get_rank()}", map_location="cpu"))


def save_no_map_location(path, model):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path))


def save_everyone(path, model):
    torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location="cpu"))


def save_load_ignored(path, model):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    torch.load(path, map_location="cpu")


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (save_reference, True, "rank 0 wrote once"),
        (save_cpu_rank0_keeps, True, "rank 0 wrote once"),
        (save_storage_lambda, True, "rank 0 wrote once"),
        (save_no_barrier, False, "a barrier is missing"),
        (save_barrier_first, False, "a barrier is missing"),
        (save_sleep, False, "a barrier is missing"),
        (save_long_sleep, False, "nothing ordering it after rank 0's torch.save"),
        (save_async_barrier, False, "nothing ordering it after rank 0's torch.save"),
        (save_broadcast_flag, True, "rank 0 wrote once"),
        (save_send_to_each, True, "rank 0 wrote once"),
        (save_object_list, True, "rank 0 wrote once"),
        (save_group_dst, True, "rank 0 wrote once"),
        (save_empty_read, False, "(in torch.load: if it read while rank 0 was still writing"),
        (save_no_map_location, False, "without map_location"),
        (save_everyone, False, "ranks [1, 2, 3] called torch.save too"),
        (lambda path, model: None, False, "rank 0 never called torch.save"),
        (save_load_ignored, False, "rank 1 does not hold rank 0's weights"),
    ],
)
def test_save_and_load(lab, fn, ok: bool, says: str) -> None:
    _verdict(checkpoint_checks.check_save_and_load, lab, fn, ok, says)


# ---------------------------------------------------------------- 25: the server's rule


def server_in_place(w, grad, version, pulled, lr):
    w -= lr * grad
    return w, version + 1, version - pulled


def server_clone_sub(w, grad, version, pulled, lr):
    return w.clone().sub_(grad, alpha=lr), version + 1, version - pulled


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (lambda w, g, v, p, lr: (w - lr * g, v + 1, v - p), True, "all 6 pushes"),
        (lambda w, g, v, p, lr: [torch.add(w, g, alpha=-lr), v + 1, v - p], True, "all 6"),
        (server_clone_sub, True, "all 6 pushes"),
        (server_in_place, False, "fn changed w in place"),
        (lambda w, g, v, p, lr: (w + lr * g, v + 1, v - p), False, "weights differ"),
        (lambda w, g, v, p, lr: (w - lr * g, v, v - p), False, "push 0: version 0, expected 1"),
        (lambda w, g, v, p, lr: (w - lr * g, v + 1, p - v), False, "staleness -1, expected 1"),
        (lambda w, g, v, p, lr: (w - lr * g, v + 1, v - p + 1), False, "staleness 1, expected 0"),
    ],
)
def test_server_update(lab, fn, ok: bool, says: str) -> None:
    _verdict(async_sgd_checks.check_server_update, lab, fn, ok, says)


# ---------------------------------------------------------------- 27: where am I?


def where_reference():
    rank, local_world = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), rank // local_world


def where_group_rank():  # torchrun's own name for the node's index
    env = os.environ
    return [env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["GROUP_RANK"]]


def where_from_dist():
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), 0


def where_local_as_global():
    local = int(os.environ["LOCAL_RANK"])
    return local, int(os.environ["WORLD_SIZE"]), local, 0


def where_node_by_world():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ["LOCAL_RANK"]), rank // world


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (where_reference, True, "agree with torchrun's variables"),
        (where_group_rank, True, "agree with torchrun's variables"),
        (where_from_dist, False, "the same as in the lab: read the values from os.environ"),
        (where_local_as_global, False, "as rank 4 on node 1 of 2: got (0, 8, 0, 0)"),
        (where_node_by_world, False, "got (4, 8, 0, 0), expected (4, 8, 0, 1)"),
    ],
)
def test_where_am_i(lab, fn, ok: bool, says: str) -> None:
    _verdict(multi_node_checks.check_where_am_i, lab, fn, ok, says)


# ---------------------------------------------------------------- 26: bytes per rank (pure)


def zero_reference(num_params, world_size, stage):
    shard = -(-num_params // world_size)
    sizes = {"params": 2, "grads": 2, "optimizer": 12}
    sharded_from = {"optimizer": 1, "grads": 2, "params": 3}
    return sum(b * (shard if stage >= sharded_from[k] else num_params) for k, b in sizes.items())


def zero_floor(num_params, world_size, stage):
    shard = num_params // world_size
    return (
        2 * (shard if stage >= 3 else num_params)
        + 2 * (shard if stage >= 2 else num_params)
        + 12 * (shard if stage >= 1 else num_params)
    )


def zero_no_master_copy(num_params, world_size, stage):
    shard = -(-num_params // world_size)
    return (
        2 * (shard if stage >= 3 else num_params)
        + 2 * (shard if stage >= 2 else num_params)
        + 8 * (shard if stage >= 1 else num_params)
    )


def zero_stage1_shards_grads(num_params, world_size, stage):
    shard = -(-num_params // world_size)
    return 2 * (shard if stage >= 3 else num_params) + 14 * (shard if stage >= 1 else num_params)


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (zero_reference, True, "stages 0-3"),
        (lambda n, w, s: float(zero_reference(n, w, s)), True, "stages 0-3"),
        (zero_floor, False, "1,001 parameters on 8 ranks"),
        (zero_no_master_copy, False, "stage 0, 7,500,000,000 parameters on 64 ranks: got 9"),
        (zero_stage1_shards_grads, False, "stage 1, 7,500,000,000 parameters"),
        (lambda n, w, s: 16 * n / w / 1e9, False, "stage 0, 7,500,000,000 parameters"),
    ],
)
def test_zero_bytes(fn, ok: bool, says: str) -> None:
    _verdict(zero_checks.check_zero_bytes, None, fn, ok, says)


# ---------------------------------------------------------------- 26: a ZeRO-2 step (ranks)


def z2_reference(param, grad, lr):
    n, r = dist.get_world_size(), dist.get_rank()
    c = -(-param.numel() // n)
    padded = torch.zeros(n * c)
    padded[: grad.numel()] = grad
    shard = torch.empty(c)
    dist.reduce_scatter_single(shard, padded)
    shard /= n
    whole = torch.zeros(n * c)
    whole[: param.numel()] = param
    dist.all_gather_single(whole, whole[r * c : (r + 1) * c] - lr * shard)
    param.copy_(whole[: param.numel()])
    return shard


def z2_lists(param, grad, lr):  # the list forms, dividing first, an unpadded last shard
    n, r = dist.get_world_size(), dist.get_rank()
    c = -(-param.numel() // n)
    pieces = list(torch.cat([grad / n, grad.new_zeros(n * c - grad.numel())]).split(c))
    shard = torch.empty(c)
    dist.reduce_scatter(shard, pieces)
    whole = list(torch.cat([param, param.new_zeros(n * c - param.numel())]).split(c))
    mine = whole[r] - lr * shard
    dist.all_gather(whole, mine)
    param.copy_(torch.cat(whole)[: param.numel()])
    return shard[: max(0, min(c, param.numel() - r * c))]


def z2_all_reduce(param, grad, lr):  # "ZeRO-2" that all-reduces the whole gradient
    n, r = dist.get_world_size(), dist.get_rank()
    c = -(-param.numel() // n)
    g = grad.clone()
    dist.all_reduce(g)
    g /= n
    padded = torch.zeros(n * c)
    padded[: g.numel()] = g
    shard = padded[r * c : (r + 1) * c].clone()
    whole = torch.zeros(n * c)
    whole[: param.numel()] = param
    dist.all_gather_single(whole, whole[r * c : (r + 1) * c] - lr * shard)
    param.copy_(whole[: param.numel()])
    return shard


def z2_no_gather(param, grad, lr):  # steps its shard, never all-gathers
    n, r = dist.get_world_size(), dist.get_rank()
    c = -(-param.numel() // n)
    padded = torch.zeros(n * c)
    padded[: grad.numel()] = grad
    shard = torch.empty(c)
    dist.reduce_scatter_single(shard, padded)
    shard /= n
    lo, hi = min(param.numel(), r * c), min(param.numel(), (r + 1) * c)
    param[lo:hi] -= lr * shard[: hi - lo]
    return shard


def z2_gather_kept_apart(param, grad, lr):  # all-gathers, but never writes back into param
    n = dist.get_world_size()
    shard = z2_no_gather(param, grad, lr)
    c = shard.numel()
    whole = torch.zeros(n * c)
    dist.all_gather_single(whole, shard)
    return shard


def z2_floor(param, grad, lr):  # shards of floor(numel / N): the tail never stepped
    n, r = dist.get_world_size(), dist.get_rank()
    c = param.numel() // n
    shard = torch.empty(c)
    dist.reduce_scatter_single(shard, grad[: n * c].contiguous())
    shard /= n
    whole = param[: n * c].clone()
    dist.all_gather_single(whole, whole[r * c : (r + 1) * c] - lr * shard)
    param[: n * c] = whole
    return shard


def z2_sum(param, grad, lr):  # reduce-scatters, forgets to divide by world_size
    n, r = dist.get_world_size(), dist.get_rank()
    c = -(-param.numel() // n)
    padded = torch.zeros(n * c)
    padded[: grad.numel()] = grad
    shard = torch.empty(c)
    dist.reduce_scatter_single(shard, padded)
    whole = torch.zeros(n * c)
    whole[: param.numel()] = param
    dist.all_gather_single(whole, whole[r * c : (r + 1) * c] - lr * shard)
    param.copy_(whole[: param.numel()])
    return shard


def z2_tensor_split(param, grad, lr):  # tensor_split's uneven pieces (3, 3, 2, 2 of 10)
    n, r = dist.get_world_size(), dist.get_rank()
    pieces = list(grad.tensor_split(n))
    shard = torch.empty_like(pieces[r])
    dist.reduce_scatter(shard, pieces)
    shard /= n
    whole = list(param.tensor_split(n))
    dist.all_gather(whole, whole[r] - lr * shard)
    param.copy_(torch.cat(whole))
    return shard


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (z2_reference, True, "with reduce_scatter and all_gather"),
        (z2_lists, True, "with reduce_scatter and all_gather"),
        (z2_all_reduce, False, "ZeRO-1's memory, not ZeRO-2's"),
        (z2_no_gather, False, "never called all_gather"),
        (z2_gather_kept_apart, False, "the other ranks' shards were not all-gathered"),
        (z2_floor, False, "shards of ceil(10 / 4) = 3"),
        (z2_sum, False, "summed, not divided by world_size"),
        (z2_tensor_split, False, "raised RuntimeError"),
    ],
)
def test_zero2_step(lab, fn, ok: bool, says: str) -> None:
    _verdict(zero_checks.check_zero2_step, lab, fn, ok, says)


def test_solutions_are_accepted(lab) -> None:
    """Each revealed solution, run as a learner would paste it, passes its own checker."""
    names = {"torch": torch, "dist": dist, "os": os}
    for module, solution, check in (
        (data_parallel_checks, "average_gradients", "check_average_gradients"),
        (data_parallel_checks, "max_replica_diff", "check_max_replica_diff"),
        (data_parallel_checks, "broadcast_parameters", "check_broadcast_parameters"),
        (data_parallel_checks, "clip_global", "check_clip_global"),
        (checkpoint_checks, "save_and_load", "check_save_and_load"),
        (async_sgd_checks, "server_update", "check_server_update"),
        (multi_node_checks, "where_am_i", "check_where_am_i"),
    ):
        ns = dict(names)
        exec(getattr(module, f"solution_{solution}")().code, ns)
        assert getattr(module, check)(lab, ns[solution]), solution
    ns = {}
    exec(zero_checks.solution_zero_bytes().code, ns)
    assert zero_checks.check_zero_bytes(ns["zero_bytes"])
    ns = dict(names)
    exec(zero_checks.solution_zero2_step().code, ns)
    assert zero_checks.check_zero2_step(lab, ns["zero2_step"])
