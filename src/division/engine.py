"""``train_one_epoch`` and ``evaluate``, plus the small measurements taken along the way."""
import contextlib
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from division import dist


@dataclass
class StepState:
    """What persists across epochs inside one run."""

    device: torch.device
    amp: str = "none"
    grad_clip: float = 0.0
    label_smoothing: float = 0.0
    max_steps: int = 0
    global_step: int = 0
    progress: bool = True
    scaler: Optional[object] = None
    dist_info: dist.DistInfo = field(default_factory=dist.DistInfo)

    @property
    def done(self) -> bool:
        return bool(self.max_steps) and self.global_step >= self.max_steps


AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(state: StepState):
    if AMP_DTYPES.get(state.amp) is None:
        return contextlib.nullcontext()
    return torch.autocast(state.device.type, dtype=AMP_DTYPES[state.amp])


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """CUDA: max allocated since the last reset. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _progress(loader, enabled, desc):
    if not enabled:
        return loader
    from tqdm import tqdm
    return tqdm(loader, desc=desc, leave=False, dynamic_ncols=True, mininterval=1.0, file=sys.stderr)


def train_one_epoch(model: nn.Module, method, loader, optimizer, scheduler, state: StepState, epoch: int,
                    measure: bool = True) -> dict:
    """One pass over ``loader``. The first step is measured: the method's accounting of bytes held for
    backward and a full-precision reference of the same forward."""
    model.train()
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)
    reset_peak(state.device)
    loss_sum = correct = seen = 0.0
    compute_time = 0.0
    report = None
    fp_bytes = None
    steps = 0
    start = time.perf_counter()
    bar = _progress(loader, state.progress and state.dist_info.is_main, f"epoch {epoch}")
    for x, y in bar:
        if state.done:
            break
        x = x.to(state.device, non_blocking=True)
        y = y.to(state.device, non_blocking=True)
        synchronize(state.device)
        t0 = time.perf_counter()

        def forward():
            with autocast(state):
                out = model(x)
                return out, F.cross_entropy(out, y, label_smoothing=state.label_smoothing)

        optimizer.zero_grad(set_to_none=True)
        if measure and report is None:
            core = model.module if hasattr(model, "module") else model
            fp_bytes = method.fp_reference_bytes(core, forward)
            with method.accounting() as acc:
                logits, loss = forward()
            report = acc.report
            report.fp_bytes = fp_bytes
        else:
            logits, loss = forward()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch}, step {state.global_step}")
        if state.scaler is not None:
            state.scaler.scale(loss).backward()
            state.scaler.unscale_(optimizer)
        else:
            loss.backward()
        if state.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), state.grad_clip)
        if state.scaler is not None:
            state.scaler.step(optimizer)
            state.scaler.update()
        else:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        synchronize(state.device)
        compute_time += time.perf_counter() - t0
        n = y.shape[0]
        loss_sum += loss.item() * n
        correct += (logits.argmax(1) == y).sum().item()
        seen += n
        steps += 1
        state.global_step += 1
        if bar is not loader:
            bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{100 * correct / seen:.1f}",
                            img_s=f"{seen / max(compute_time, 1e-9):.0f}")
    wall = time.perf_counter() - start
    loss_sum, correct, seen, compute_time, wall = dist.all_reduce_sum([loss_sum, correct, seen, compute_time, wall],
                                                                      state.device)
    world = state.dist_info.world_size
    out = {
        "train_loss": loss_sum / max(seen, 1),
        "train_top1": 100.0 * correct / max(seen, 1),
        "train_images": int(seen),
        "steps": steps,
        # summed over ranks: images of all ranks per second of one rank's time
        "throughput_img_s": seen / max(compute_time / world, 1e-9),
        "throughput_with_data_img_s": seen / max(wall / world, 1e-9),
        "peak_mem_bytes": int(dist.all_reduce_max([peak_memory(state.device)], state.device)[0]),
    }
    if report is not None:
        out.update(report.summary())
        out["act_mem_by_codec"] = report.by_codec()
        out["_report"] = report
    return out


@torch.no_grad()
def evaluate(model: nn.Module, loader, state: StepState) -> dict:
    model.eval()
    loss_sum = top1 = top5 = seen = 0.0
    for x, y in loader:
        x = x.to(state.device, non_blocking=True)
        y = y.to(state.device, non_blocking=True)
        with autocast(state):
            logits = model(x)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        k = min(5, logits.shape[1])
        pred = logits.topk(k, 1).indices
        top1 += (pred[:, 0] == y).sum().item()
        top5 += (pred == y[:, None]).any(1).sum().item()
        seen += y.shape[0]
    loss_sum, top1, top5, seen = dist.all_reduce_sum([loss_sum, top1, top5, seen], state.device)
    return {"test_loss": loss_sum / max(seen, 1), "top1": 100.0 * top1 / max(seen, 1),
            "top5": 100.0 * top5 / max(seen, 1), "test_images": int(seen)}


def build_optimizer(model: nn.Module, cfg, global_batch: int):
    lr = float(cfg.lr) * (global_batch / float(cfg.base_batch) if cfg.get("scale_lr", False) else 1.0)
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(cfg.weight_decay)},
              {"params": no_decay, "weight_decay": 0.0 if cfg.name == "adamw" else float(cfg.weight_decay)}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=float(cfg.momentum), nesterov=bool(cfg.nesterov)), lr
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas)), lr
    raise ValueError(f"unknown optimizer {cfg.name!r}; valid choices: ['sgd', 'adamw']")


def build_scheduler(optimizer, cfg, steps_per_epoch: int, epochs: int, max_steps: int = 0):
    """Per-step schedule: linear warm-up, then cosine to zero (or constant)."""
    total = epochs * steps_per_epoch
    if max_steps:
        total = min(total, max_steps) if total else max_steps
    warmup = int(float(cfg.get("warmup_epochs", 0)) * steps_per_epoch)
    schedule = cfg.get("schedule", "cosine")
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"optim.schedule={schedule!r} is invalid; valid choices: ['cosine', 'constant']")

    def factor(step):
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
