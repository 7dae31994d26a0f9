"""``train_step`` (the one training step), ``train_one_epoch`` and ``evaluate``, plus the small measurements
taken along the way."""
import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from division import dist
from division.data import skip_batches
from division.memory import MemoryReport
from division.peak import PeakMeter, release_freed_memory, reuse_freed_memory


@dataclass
class StepState:
    """What persists across epochs inside one run."""

    device: torch.device
    amp: str = "none"
    grad_clip: float = 0.0
    label_smoothing: float = 0.0
    max_steps: int = 0
    global_step: int = 0
    live_peak: bool = False  # CPU: glibc returns freed blocks while memory is measured (see memory.py)
    guard: bool = True  # stop on a non-finite loss, or on one above diverge_loss after guard_from_step
    diverge_loss: float = 0.0  # 0 = no loss threshold
    guard_from_step: int = 0
    measured_steps: int = 2  # steps whose peak is the run's peak: the accounted one and the next
    progress: bool = True
    scaler: Optional[object] = None
    dist_info: dist.DistInfo = field(default_factory=dist.DistInfo)
    log_every: int = 0  # steps between per-step log points (0 = none)
    on_log: Optional[Callable[[dict, int], None]] = None  # receives (metrics, global step)
    lookahead: Optional["Lookahead"] = None  # weight averaging after optimizer steps (optim.lookahead_every)

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


class Diverged(RuntimeError):
    """Training went wrong: the loss is not finite, or far above chance level after the warm-up."""


class StepTimer:
    """Wall time of one step without a host synchronisation of its own: CUDA events on a GPU (read once the
    caller has synchronised anyway), the host clock on the CPU (where work is synchronous)."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()
        self.t1 = None

    def stop(self):
        if self.events is not None:
            self.events[1].record()
        self.t1 = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self.events is None:
            return self.t1 - self.t0
        self.events[1].synchronize()  # already complete after the caller's read of the loss
        return self.events[0].elapsed_time(self.events[1]) / 1000.0


@dataclass
class StepOutput:
    loss: torch.Tensor
    logits: torch.Tensor
    timer: StepTimer  # forward, backward and update
    report: Optional[MemoryReport] = None

    @property
    def seconds(self) -> float:
        return self.timer.seconds


def _forward(model, x, y, state: StepState, method=None):
    """The step's forward and loss; the method's forward context (its saved-tensor hooks on a compiled model)
    covers the model's call."""
    def run():
        with autocast(state):
            with method.forward_context() if method is not None else contextlib.nullcontext():
                out = model(x)
            return out, F.cross_entropy(out, y, label_smoothing=state.label_smoothing)
    return run


def train_step(model: nn.Module, method, x, y, optimizer, scheduler, state: StepState,
               account: bool = False) -> StepOutput:
    """The one training step (forward, backward, clip, update, schedule) that the runner, the benchmark and
    the max-batch finder all use. ``account``: the method records what the forward holds for backward.
    It makes no host synchronisation on CUDA: the time is taken with events, and the caller's one read of
    the loss is the step's only synchronisation (on a GPU each one stalls the launch queue)."""
    timer = StepTimer(state.device)
    optimizer.zero_grad(set_to_none=True)
    forward = _forward(model, x, y, state, method)
    report = None
    if account:
        with method.accounting(core_model(model), inputs=(x,)) as acc:  # no hook inside a compiled model
            logits, loss = forward()
            acc.output = loss
    else:
        logits, loss = forward()
    if state.scaler is not None:
        state.scaler.scale(loss).backward()
        state.scaler.unscale_(optimizer)
    else:
        loss.backward()
    if account:
        report = acc.report
    if state.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), state.grad_clip)
    if state.scaler is not None:
        state.scaler.step(optimizer)
        state.scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    timer.stop()
    return StepOutput(loss.detach(), logits.detach(), timer, report)


def core_model(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def fp_reference(model: nn.Module, method, x, y, state: StepState):
    """The full-precision equivalent of the next step's forward, measured with nothing kept alive (see
    ``Method.fp_reference``); run it outside any timed region."""
    return method.fp_reference(core_model(model), _forward(core_model(model), x, y, state), inputs=(x,))


def check_divergence(loss: float, state: StepState, epoch: int):
    """Stop early, with the likely cause, when the loss is not finite or, after the warm-up, exceeds
    ``state.diverge_loss`` (a multiple of ln(classes), the loss of a uniform guess)."""
    if not state.guard:
        return
    where = f"at epoch {epoch}, step {state.global_step}"
    if not math.isfinite(loss):
        raise Diverged(f"training loss is {loss} {where}: the run diverged. Likely causes: a learning rate too "
                       "high for this model and batch (optim.lr), or no warm-up (optim.warmup_epochs)")
    if state.diverge_loss and state.global_step >= state.guard_from_step and loss > state.diverge_loss:
        raise Diverged(f"training loss {loss:.2f} {where} is above {state.diverge_loss:.2f} (several times the "
                       "loss of a uniform guess) after the warm-up: the run is diverging. Likely causes: "
                       "optim.lr too high, optim.warmup_epochs too short; trainer.allow_divergence=true lets it go on")


def _progress(loader, enabled, desc):
    if not enabled:
        return loader
    from tqdm import tqdm
    return tqdm(loader, desc=desc, leave=False, dynamic_ncols=True, mininterval=1.0, file=sys.stderr)


PARTIAL_KEYS = ("steps", "loss_sum", "correct", "seen", "compute_time", "timed_images", "wall")
# What an epoch's metrics line says about the machine rather than the training: two runs that trained
# identically (a resumed run and an uninterrupted one, the same run on two machines) may differ only in these.
MACHINE_KEYS = ("throughput_img_s", "throughput_with_data_img_s", "peak_mem_bytes", "peak_mem_how",
                "peak_rss_epoch_bytes", "codec_backends", "notes")


def train_one_epoch(model: nn.Module, method, loader, optimizer, scheduler, state: StepState, epoch: int,
                    measure: bool = True, resume: Optional[dict] = None, checkpoint_every: int = 0,
                    on_checkpoint=None) -> dict:
    """One pass over ``loader``. With ``measure``, the first step is accounted: before it, untimed, the
    full-precision reference of its forward; the step is left out of the throughput. ``peak_mem_bytes`` is
    the peak of the first ``state.measured_steps`` training steps (reset after the reference; on CPU with
    ``state.live_peak``, measured with glibc returning freed memory, then switched back to the fast
    setting); ``peak_rss_epoch_bytes`` the resident-set peak of the whole epoch's steps as it is.

    Mid-epoch checkpoints: every ``checkpoint_every`` steps (before the last), ``on_checkpoint(partial)``
    gets the epoch's running sums (``PARTIAL_KEYS``, summed over ranks); ``resume`` (such a dict) continues
    the epoch after its steps, the loader skipping the batches already trained on."""
    model.train()
    start_epoch = getattr(core_model(model), "start_epoch", None)
    if start_epoch is not None:  # models with a per-epoch schedule of their own (fast94's whitening bias)
        start_epoch(epoch)
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)
    meter = PeakMeter(state.device)
    live = state.live_peak and state.device.type == "cpu" and measure and release_freed_memory()
    measured_live = live
    meter.reset()
    carried = dict(resume) if resume else dict.fromkeys(PARTIAL_KEYS, 0)
    if not state.dist_info.is_main:  # the saved sums are every rank's: one rank carries them on
        carried = dict.fromkeys(PARTIAL_KEYS, 0) | {"steps": carried["steps"]}
    if carried["steps"] and not skip_batches(loader, carried["steps"]):
        raise ValueError(f"cannot resume epoch {epoch} at step {carried['steps']}: this data loader cannot start "
                         "part-way through an epoch")
    loss_sum, correct, seen = float(carried["loss_sum"]), float(carried["correct"]), float(carried["seen"])
    compute_time, timed_images = float(carried["compute_time"]), float(carried["timed_images"])
    report = fp = None
    step_peak = None
    steps = int(carried["steps"])
    window = [0.0, 0.0, 0.0, 0]  # loss sum, images, compute seconds, steps since the last log point
    start = time.perf_counter() - float(carried["wall"])
    bar = _progress(loader, state.progress and state.dist_info.is_main, f"epoch {epoch}")
    for x, y in bar:
        if state.done:
            break
        x = x.to(state.device, non_blocking=True)
        y = y.to(state.device, non_blocking=True)
        account = measure and report is None
        if live and steps == state.measured_steps:  # measured: the remaining steps run with the fast setting
            reuse_freed_memory()
            live = False
        if account:
            fp = fp_reference(model, method, x, y, state)
            meter.reset()
        out = train_step(model, method, x, y, optimizer, scheduler, state, account=account)
        n = y.shape[0]
        if account:
            report = out.report.use_fp_reference(fp)
        # the one host synchronisation of a step, after its timed region: loss and hits in one read
        loss_value, hits = torch.stack([out.loss.float(), (out.logits.argmax(1) == y).sum().float()]).tolist()
        check_divergence(loss_value, state, epoch)
        loss_sum += loss_value * n
        correct += hits
        seen += n
        steps += 1
        state.global_step += 1
        if state.lookahead is not None:
            state.lookahead.step(state.global_step)
        window[0] += loss_value
        window[3] += 1
        if not account:
            compute_time += out.seconds
            timed_images += n
            window[1] += n
            window[2] += out.seconds
        if state.on_log is not None and state.log_every and state.global_step % state.log_every == 0:
            state.on_log({"step/train_loss": window[0] / window[3], "step/lr": optimizer.param_groups[0]["lr"],
                          "step/img_s": window[1] / window[2] if window[2] else None, "epoch": epoch}, state.global_step)
            window = [0.0, 0.0, 0.0, 0]
        if steps == state.measured_steps:
            step_peak = meter.peak()
        if bar is not loader:
            bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{100 * correct / seen:.1f}",
                            img_s=f"{timed_images / max(compute_time, 1e-9):.0f}")
        if checkpoint_every and on_checkpoint is not None and steps % checkpoint_every == 0 \
                and steps < len(loader) and not state.done:
            sums = dist.all_reduce_sum([loss_sum, correct, seen, compute_time, timed_images,
                                        time.perf_counter() - start], state.device)
            on_checkpoint(dict(zip(PARTIAL_KEYS, [steps, *sums])))
    wall = time.perf_counter() - start
    epoch_peak = meter.peak()
    if step_peak is None:
        step_peak = epoch_peak
    loss_sum, correct, seen, compute_time, timed_images, wall = dist.all_reduce_sum(
        [loss_sum, correct, seen, compute_time, timed_images, wall], state.device)
    world = state.dist_info.world_size
    how = meter.describe() + (f"; first {state.measured_steps} steps, glibc returning freed blocks >= 64 KiB"
                              if measured_live else f"; first {state.measured_steps} steps")
    out = {
        "train_loss": loss_sum / max(seen, 1),
        "train_top1": 100.0 * correct / max(seen, 1),
        "train_images": int(seen),
        "steps": steps,
        # summed over ranks: images of all ranks per second of one rank's time; the accounted step excluded
        "throughput_img_s": timed_images / (compute_time / world) if timed_images else None,
        "throughput_with_data_img_s": seen / max(wall / world, 1e-9),
        "peak_mem_bytes": int(dist.all_reduce_max([step_peak], state.device)[0]),
        "peak_mem_how": how,
        "peak_rss_epoch_bytes": int(dist.all_reduce_max([epoch_peak], state.device)[0]),
    }
    if report is not None:
        out.update(report.summary())
        out["act_mem_by_codec"] = report.by_codec()
        out["_report"] = report
    return out


def _mirror(model, x):
    return 0.5 * (model(x) + model(x.flip(-1)))


def tta_logits(model, x, level: int):
    """Test-time augmentation (airbench): 0 = the image; 1 = the mean of it and its mirror; 2 = half of that
    plus half the mean of the same over two translations by one pixel (reflect-padded)."""
    if level == 0:
        return model(x)
    logits = _mirror(model, x)
    if level == 1:
        return logits
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    h, w = x.shape[-2:]
    shifted = [_mirror(model, padded[..., :h, :w]), _mirror(model, padded[..., 2:h + 2, 2:w + 2])]
    return 0.5 * logits + 0.25 * (shifted[0] + shifted[1])


TTA_LEVELS = (0, 1, 2)


@torch.no_grad()
def evaluate(model: nn.Module, loader, state: StepState, tta: int = 0) -> dict:
    """Test loss, top-1 and top-5; with ``tta`` > 0 also the top-1 and loss under that level of test-time
    augmentation (``top1_tta``, ``test_loss_tta``), both from the same pass over the data."""
    if tta not in TTA_LEVELS:
        raise ValueError(f"trainer.tta={tta!r} is invalid; valid choices: {list(TTA_LEVELS)}")
    model.eval()
    loss_sum = top1 = top5 = seen = loss_tta = top1_tta = 0.0
    for x, y in loader:
        x = x.to(state.device, non_blocking=True)
        y = y.to(state.device, non_blocking=True)
        with autocast(state):
            logits = model(x).float()
            augmented = tta_logits(model, x, tta).float() if tta else None
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        k = min(5, logits.shape[1])
        pred = logits.topk(k, 1).indices
        top1 += (pred[:, 0] == y).sum().item()
        top5 += (pred == y[:, None]).any(1).sum().item()
        seen += y.shape[0]
        if augmented is not None:
            loss_tta += F.cross_entropy(augmented, y, reduction="sum").item()
            top1_tta += (augmented.argmax(1) == y).sum().item()
    loss_sum, top1, top5, seen, loss_tta, top1_tta = dist.all_reduce_sum(
        [loss_sum, top1, top5, seen, loss_tta, top1_tta], state.device)
    out = {"test_loss": loss_sum / max(seen, 1), "top1": 100.0 * top1 / max(seen, 1),
           "top5": 100.0 * top5 / max(seen, 1), "test_images": int(seen)}
    if tta:
        out.update(top1_tta=100.0 * top1_tta / max(seen, 1), test_loss_tta=loss_tta / max(seen, 1), tta_level=tta)
    return out


NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def build_optimizer(model: nn.Module, cfg, global_batch: int):
    if not float(cfg.lr) > 0:
        raise ValueError(f"optim.lr={cfg.lr} is invalid; it must be > 0")
    if not float(cfg.weight_decay) >= 0:
        raise ValueError(f"optim.weight_decay={cfg.weight_decay} is invalid; it must be >= 0")
    if cfg.name == "sgd" and not 0 <= float(cfg.momentum) < 1:
        raise ValueError(f"optim.momentum={cfg.momentum} is invalid; it must be in [0, 1)")
    lr = float(cfg.lr) * (global_batch / float(cfg.base_batch) if cfg.get("scale_lr", False) else 1.0)
    for key in ("bias_lr_scale", "bias_weight_decay_scale"):
        if not float(cfg.get(key, 1.0)) > 0:
            raise ValueError(f"optim.{key}={cfg.get(key)} is invalid; it must be > 0 (1 = as the weights)")
    norm = {id(p) for m in model.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters(recurse=False)}
    decay, no_decay, norms = [], [], []
    for p in model.parameters():
        if p.requires_grad:
            (norms if id(p) in norm else no_decay if p.dim() <= 1 else decay).append(p)
    # normalization layers' parameters: their own learning rate and weight-decay factors (airbench trains BN
    # biases 64x faster, with decay scaled back so that lr x decay stays that of the weights)
    norm_lr, norm_wd = float(cfg.get("bias_lr_scale", 1.0)), float(cfg.get("bias_weight_decay_scale", 1.0))
    flat_decay = 0.0 if cfg.name == "adamw" else float(cfg.weight_decay)
    groups = [{"params": decay, "weight_decay": float(cfg.weight_decay)},
              {"params": no_decay, "weight_decay": flat_decay},
              {"params": norms, "lr": lr * norm_lr, "weight_decay": flat_decay * norm_wd}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=float(cfg.momentum), nesterov=bool(cfg.nesterov)), lr
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas)), lr
    raise ValueError(f"unknown optimizer {cfg.name!r}; valid choices: ['sgd', 'adamw']")


def build_scheduler(optimizer, cfg, steps_per_epoch: int, epochs: int, max_steps: int = 0):
    """Per-step schedule: linear warm-up, then cosine to zero (or constant); ``triangle`` (airbench): from
    ``optim.triangle`` = [start, peak fraction of the steps, end] factors, linear up to 1, then down."""
    total = epochs * steps_per_epoch
    if max_steps:
        total = min(total, max_steps) if total else max_steps
    warmup = int(float(cfg.get("warmup_epochs", 0)) * steps_per_epoch)
    schedule = cfg.get("schedule", "cosine")
    if schedule not in ("cosine", "constant", "triangle"):
        raise ValueError(f"optim.schedule={schedule!r} is invalid; valid choices: ['cosine', 'constant', 'triangle']")
    start, peak, end = (float(v) for v in cfg.get("triangle", (0.2, 0.23, 0.07)))

    def factor(step):
        if schedule == "triangle":
            up = max(1, int(total * peak))
            if step < up:
                return start + (1.0 - start) * step / up
            return 1.0 + (end - 1.0) * min(1.0, (step - up) / max(1, total - up))
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Lookahead:
    """Lookahead-style weight averaging (airbench): every ``every`` steps the running average of the model's
    floating-point state (weights and batch-norm statistics) moves toward the model, and the model is set to it;
    the averaging weight grows over training as ``decay ** every * (step / total) ** 3``. ``finish`` leaves
    the model at the average."""

    def __init__(self, model: nn.Module, every: int, decay: float, total_steps: int):
        if every < 1 or not 0 < decay < 1:
            raise ValueError(f"lookahead every={every}, decay={decay} are invalid; every >= 1, 0 < decay < 1")
        self.model, self.every, self.decay, self.total = model, every, decay, max(1, total_steps)
        self.average = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    def step(self, global_step: int):
        if global_step % self.every == 0:
            self._update(self.decay ** self.every * min(1.0, global_step / self.total) ** 3)

    def finish(self):
        self._update(1.0)

    @torch.no_grad()
    def _update(self, keep: float):
        state = self.model.state_dict()
        for key, avg in self.average.items():
            avg.lerp_(state[key].detach(), 1.0 - keep)
            state[key].copy_(avg)

    def state_dict(self) -> dict:
        return {"average": self.average}

    def load_state_dict(self, state: dict):
        for key, value in state["average"].items():
            self.average[key].copy_(value)
