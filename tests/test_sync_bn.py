"""Compressed SyncBatchNorm: two gloo ranks on half batches equal one process on the whole batch."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from division.methods import build

# deterministic rounding and per-sample statistics: a sample's codes do not depend on how the batch is split
DETERMINISTIC = {"name": "division", "hfc_bits": 8, "block_size": 4, "lfc_dtype": "fp32", "stochastic": False}


def _net(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 4, 1))
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 8, 8, generator=g) * 3 + 1, torch.randn(8, 4, 8, 8, generator=g)


def _step(net, method, x, w):
    """One forward/backward of ``net`` prepared by ``method`` (None: plain autograd)."""
    m = build(dict(method)) if method else None
    if m:
        m.prepare(net)
    x = x.clone().requires_grad_(True)
    (net(x) * w).sum().backward()
    return x.grad, m


def _rank(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(_net())
    x, w = _data()
    part = slice(rank * 4, rank * 4 + 4)
    x_grad, m = _step(net, DETERMINISTIC, x[part], w[part])
    held = {r.layer: r.codec for r in m.policy_records()}
    torch.save({"x_grad": x_grad, "grads": {n: p.grad for n, p in net.named_parameters()},
                "buffers": dict(net.named_buffers()), "held": held}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_sync_bn_two_ranks_match_whole_batch(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["held"]["1"] == "division"  # the SyncBatchNorm input was compressed
    ref = _net()
    x, w = _data()
    x_grad, _ = _step(ref, DETERMINISTIC, x, w)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks]), x_grad, rtol=1e-4, atol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(ranks[0]["grads"][name] + ranks[1]["grads"][name], p.grad,
                                   rtol=1e-4, atol=1e-4, msg=name)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(ranks[0]["buffers"][name], b, msg=name)
        torch.testing.assert_close(ranks[1]["buffers"][name], b, msg=name)


def test_sync_bn_one_process_is_batch_norm():
    ref, net = _net(), nn.SyncBatchNorm.convert_sync_batchnorm(_net())
    x, w = _data()
    x_ref, _ = _step(ref, DETERMINISTIC, x, w)
    x_grad, _ = _step(net, DETERMINISTIC, x, w)
    torch.testing.assert_close(x_grad, x_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(net[1].running_var, ref[1].running_var)
