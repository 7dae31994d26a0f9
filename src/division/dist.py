"""Rank and world size from the environment (torchrun, or SLURM with one task per GPU)."""
import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def from_env() -> DistInfo:
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:
        return DistInfo(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return DistInfo(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"]))
    return DistInfo()


def init(info: DistInfo, device: torch.device) -> None:
    """Join the process group (nccl on CUDA, gloo on CPU). SLURM jobs need MASTER_ADDR/MASTER_PORT set."""
    if not info.enabled or torch_dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch_dist.init_process_group(backend, rank=info.rank, world_size=info.world_size)


def all_reduce_sum(values, device) -> list:
    if not torch_dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values, device) -> list:
    if not torch_dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return t.tolist()


def barrier():
    if torch_dist.is_initialized():
        torch_dist.barrier()


def cleanup():
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def parameter_spread(model) -> float:
    """Largest difference of any parameter between ranks (0.0 when replicas agree, as DDP promises)."""
    if not torch_dist.is_initialized():
        return 0.0
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    torch_dist.all_reduce(hi, op=torch_dist.ReduceOp.MAX)
    torch_dist.all_reduce(lo, op=torch_dist.ReduceOp.MIN)
    return float((hi - lo).abs().max())
