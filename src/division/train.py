"""The Hydra entry point: compose config -> data, model, method -> epochs -> result.json."""
import math
import os
import time
from pathlib import Path

import hydra

import division
import torch
from omegaconf import DictConfig, OmegaConf

from division import data as data_lib
from division import api, dist, engine, loggers, models, results

CONFIG_DIR = str(division.CONFIG_DIR)


def calibrate(method, model, loader, state, info, plan_state=None):
    """``method.budget``: the method plans each layer's precision from one observed step on the first training
    batch (no update), before training and before the first accounted step; a resumed run takes back its
    checkpoint's plan (``plan_state``) instead of planning afresh from the weights it resumes with."""
    if getattr(method, "budget", None) is None:
        return
    x, y = next(iter(loader))
    x, y = x.to(state.device), y.to(state.device)
    plan = method.calibrate(model, engine._forward(model, x, y, state), plan_state)
    if info.is_main:
        print(f"budget: {plan.planned_bytes / 2**20:.2f} MiB planned of {plan.budget_bytes / 2**20:.2f} MiB "
              f"({plan.fixed_bytes / 2**20:.2f} MiB outside the plan); estimated in {plan.observe_seconds:.1f} s",
              flush=True)


def init_from_data(model, loader, count: int):
    """Models that initialise from data (the fast CIFAR network's whitening filters) get ``count`` training
    images drawn at random, normalized and unaugmented, before training and before any method is installed."""
    init = getattr(model, "init_from_data", None)
    if init is None:
        return
    sample = getattr(loader, "sample_images", None)
    if sample is None:
        raise ValueError(f"model {type(model).__name__} initialises from training images, which this data loader "
                         "cannot give; use data=cifar10, cifar100 or synthetic")
    device = next(model.parameters()).device
    init(sample(count).to(device))


def run_id_for(cfg: DictConfig, cfg_hash: str) -> str:
    if cfg.get("run_id"):
        return str(cfg.run_id)
    return f"{cfg.data.name}-{cfg.model.name}-{cfg.method.name}-s{cfg.seed}-{cfg_hash}"


def pick_device(name: str, info: dist.DistInfo) -> torch.device:
    valid = ("auto", "cpu", "cuda")
    if name not in valid:
        raise ValueError(f"trainer.device={name!r} is invalid; valid choices: {list(valid)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")
        torch.cuda.set_device(info.local_rank)
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


def set_tf32(device: torch.device, tf32):
    """CUDA's fp32 convolutions and matmuls in TF32 (true), in IEEE fp32 (false, what the CPU computes), or
    PyTorch's defaults (None: convolutions in TF32, matmuls not). Set on every run, so one job of a multirun
    does not inherit another's choice; the result's device line says what ran."""
    if tf32 is not None and not isinstance(tf32, bool):
        raise ValueError(f"trainer.tf32={tf32!r} is invalid; valid choices: [null, true, false] "
                         "(null: PyTorch's default, TF32 convolutions and fp32 matmuls)")
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = True if tf32 is None else tf32
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32)


def seed_everything(seed: int):
    import random
    import numpy as np
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _save_checkpoint(path: Path, payload: dict):
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _interrupt_on_sigterm():
    """SIGTERM (kill, SLURM pre-emption) ends the run like Ctrl-C: result.json says interrupted."""
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        def handler(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        signal.signal(signal.SIGTERM, handler)


def run(cfg: DictConfig) -> dict:
    """Train one configuration; returns the result dict that was written."""
    _interrupt_on_sigterm()
    info = dist.from_env()
    device = pick_device(cfg.trainer.device, info)
    dist.init(info, device)
    set_tf32(device, cfg.trainer.get("tf32"))
    if int(cfg.trainer.get("threads", 0)) > 0:
        torch.set_num_threads(int(cfg.trainer.threads))
    amp = cfg.trainer.amp
    if amp not in engine.AMP_DTYPES:
        raise ValueError(f"trainer.amp={amp!r} is invalid; valid choices: {list(engine.AMP_DTYPES)}")
    for key, least, zero in (("epochs", 1, ""), ("max_steps", 0, " (0 = no limit)"),
                             ("checkpoint_every_steps", 0, " (0 = at epoch ends only)")):
        if int(cfg.trainer.get(key, 0)) < least:
            raise ValueError(f"trainer.{key}={cfg.trainer[key]} is invalid; it must be >= {least}{zero}")
    if amp == "fp16" and device.type != "cuda":
        raise ValueError("trainer.amp=fp16 needs CUDA; on CPU use trainer.amp=bf16")
    if cfg.trainer.get("sync_bn") and info.enabled and device.type != "cuda":
        raise ValueError(f"trainer.sync_bn=true needs CUDA (DistributedDataParallel refuses SyncBatchNorm on "
                         f"{device.type}); set trainer.sync_bn=false")

    resolved = results.portable(OmegaConf.to_container(cfg, resolve=True))
    cfg_hash = results.config_hash(resolved)
    code = results.code_version()
    run_dir = Path(cfg.paths.runs_dir) / str(cfg.exp_name) / run_id_for(cfg, cfg_hash)
    result_path, ckpt_path = run_dir / "result.json", run_dir / "checkpoint.pt"
    if cfg.get("skip_done") and result_path.exists():
        previous = results.read_json(result_path)
        if previous.get("status") == "ok":
            check_same_code(previous.get("code_version"), code, result_path, cfg)
            if info.is_main:
                print(f"skip: {result_path} already ok (top1 {previous.get('top1')})")
            return previous

    seed_everything(int(cfg.seed))
    train_loader, test_loader, data_info = data_lib.build(cfg.data, int(cfg.seed), info.rank, info.world_size,
                                                          device)
    every = int(cfg.trainer.get("checkpoint_every_steps", 0) or 0) if cfg.trainer.get("checkpoint", True) else 0
    if every and not data_lib.skip_batches(train_loader, 0):
        raise ValueError(f"trainer.checkpoint_every_steps={every} needs a training loader that can resume part-way "
                         f"through an epoch, which data={cfg.data.name} does not have; set it to 0")
    stem = str(cfg.model.get("stem", "auto"))
    model, zeroed = models.from_config(cfg.model, data_info.image_size)
    if cfg.trainer.get("sync_bn") and info.enabled:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    init_from_data(model, train_loader, int(cfg.model.get("init_images", 5000)))
    if cfg.trainer.get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    method = api.prepare_config(model, cfg.method).method
    compiled = bool(cfg.trainer.get("compile", False))
    if compiled:
        api.compile_model(model, method)
    train_model = model
    if info.enabled:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    global_batch = int(cfg.data.batch_size) * info.world_size
    optimizer, lr = engine.build_optimizer(model, cfg.optim, global_batch)
    epochs, max_steps = int(cfg.trainer.epochs), int(cfg.trainer.max_steps)
    scheduler = engine.build_scheduler(optimizer, cfg.optim, len(train_loader), epochs, max_steps)
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
    lookahead_every = int(cfg.optim.get("lookahead_every", 0) or 0)
    lookahead = engine.Lookahead(model, lookahead_every, float(cfg.optim.get("lookahead_decay", 0.95)),
                                 epochs * len(train_loader) if not max_steps else max_steps) if lookahead_every else None
    tta = int(cfg.trainer.get("tta", 0) or 0)
    if tta not in engine.TTA_LEVELS:
        raise ValueError(f"trainer.tta={tta!r} is invalid; valid choices: {list(engine.TTA_LEVELS)}")
    state = engine.StepState(device, amp, float(cfg.optim.get("grad_clip", 0.0)),
                             float(cfg.optim.get("label_smoothing", 0.0)), max_steps,
                             progress=bool(cfg.trainer.progress), scaler=scaler, dist_info=info,
                             live_peak=bool(cfg.trainer.get("release_freed_memory", True)))
    state.lookahead = lookahead
    state.guard = not cfg.trainer.get("allow_divergence", False)
    if state.guard:
        state.diverge_loss = float(cfg.trainer.get("diverge_factor", 3.0)) * math.log(int(cfg.model.num_classes))
        state.guard_from_step = int(float(cfg.optim.get("warmup_epochs", 0)) * len(train_loader))

    result = {
        "status": "running", "experiment": str(cfg.exp_name), "run_id": run_dir.name,
        "data": cfg.data.name, "model": cfg.model.name, "method": cfg.method.name, "seed": int(cfg.seed),
        "config_hash": cfg_hash, "config": resolved, "epochs": [], "top1": None, "best_top1": None,
        "throughput_img_s": None, "peak_mem_bytes": None, "act_mem_bytes": None, "act_mem_fp_bytes": None,
        "act_compression": None, "lr": lr, "global_batch": global_batch, "world_size": info.world_size,
        "train_size": data_info.train_size, "test_size": data_info.test_size,
        **results.provenance(device, code), "method_info": method.describe(),
        "input_size": data_info.image_size, "zero_init_residual_blocks": zeroed, "stem": models.stem_of(cfg.model.name, stem, data_info.image_size),
        "codec_backends": None,
        "peak_mem_how": None, "wall_time_s": 0.0,
    }
    start_epoch, partial, ckpt = 0, None, None
    requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0  # SLURM requeue: always continue
    if (cfg.get("resume") or requeued) and ckpt_path.exists():
        ckpt = load_checkpoint(ckpt_path, device)
        check_same_code(ckpt.get("code_version"), code, ckpt_path, cfg)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        if lookahead is not None:
            lookahead.load_state_dict(ckpt["lookahead"])
        torch.set_rng_state(ckpt["rng_cpu"])
        if device.type == "cuda" and ckpt.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng_cuda"], device)
        start_epoch, state.global_step = int(ckpt["epoch"]), int(ckpt["global_step"])
        partial = ckpt.get("partial")  # saved within epoch start_epoch: its running sums
        result["epochs"] = ckpt["epochs"]
        result["wall_time_s"] = float(ckpt.get("wall_time_s", 0.0))
        if result["epochs"]:
            result["best_top1"] = max(e["top1"] for e in result["epochs"] if e.get("top1") is not None)
        if info.is_main:
            print(f"resume: {ckpt_path} at epoch {start_epoch}, step {state.global_step}"
                  + (f" ({partial['steps']} steps into it)" if partial else ""))

    calibrate(method, model, train_loader, state, info, ckpt.get("budget_plan") if ckpt else None)
    logger = loggers.build(cfg.logger, resolved, run_dir.name, info.is_main)
    state.log_every = int(cfg.logger.get("log_every", 0) or 0)
    state.on_log = lambda metrics, step: logger.log({k: v for k, v in metrics.items() if v is not None}, step=step)
    t_start = time.perf_counter() - result["wall_time_s"]

    def write(status):
        result["status"] = status
        result["method_info"] = method.describe()  # a budget's plan, as it stands
        result["wall_time_s"] = round(time.perf_counter() - t_start, 3)
        if info.is_main:
            results.write_json(result_path, result)
            results.write_jsonl(run_dir / "metrics.jsonl", result["epochs"])

    def save_checkpoint(epoch: int, partial_sums=None):
        """``epoch``: the next epoch to run, or the one in progress when ``partial_sums`` are given."""
        if not (info.is_main and cfg.trainer.get("checkpoint", True)):
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        _save_checkpoint(ckpt_path, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None,
            "lookahead": lookahead.state_dict() if lookahead is not None else None,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "epoch": epoch, "global_step": state.global_step, "epochs": result["epochs"], "partial": partial_sums,
            "code_version": code, "wall_time_s": time.perf_counter() - t_start,
            "budget_plan": method.plan_state() if hasattr(method, "plan_state") else None})

    try:
        for epoch in range(start_epoch, epochs):
            if state.done:
                break
            metrics = engine.train_one_epoch(
                train_model, method, train_loader, optimizer, scheduler, state, epoch,
                resume=partial if epoch == start_epoch else None, checkpoint_every=every,
                on_checkpoint=lambda sums, e=epoch: save_checkpoint(e, sums))
            report = metrics.pop("_report", None)
            if report is not None and info.is_main and epoch == start_epoch:
                results.write_json(run_dir / "memory_layers.json", {"summary": report.summary(), "layers": report.layers})
                logger.table("memory_layers", report.layers, state.global_step)
            last = epoch == epochs - 1 or state.done
            if lookahead is not None and last:
                lookahead.finish()  # the model ends at the running average
            if (epoch + 1) % int(cfg.trainer.get("eval_every", 1)) == 0 or last:
                metrics.update(engine.evaluate(train_model, test_loader, state, tta if last else 0))
            metrics = {"epoch": epoch + 1, "global_step": state.global_step, **metrics,
                       "lr": optimizer.param_groups[0]["lr"]}
            result["epochs"].append(metrics)
            for key in ("top1", "top1_tta", "tta_level", "throughput_img_s", "peak_mem_bytes", "act_mem_bytes", "act_mem_fp_bytes",
                        "act_compression", "act_mem_input_bytes", "act_mem_input_fp_bytes",
                        "act_compression_without_input", "amp_weight_cast_bytes", "codec_backends", "peak_mem_how"):
                if metrics.get(key) is not None:
                    result[key] = metrics[key]
            tops = [e["top1"] for e in result["epochs"] if e.get("top1") is not None]
            result["best_top1"] = max(tops) if tops else None
            logger.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=state.global_step)
            if info.is_main:
                print(engine_line(metrics), flush=True)
            save_checkpoint(epoch + 1)
            write("running")
        if compiled:
            result["compile"] = {"graph_breaks": api.graph_breaks()}
        if info.enabled:
            result["ddp_param_spread"] = dist.parameter_spread(model)
        write("ok")
    except torch.cuda.OutOfMemoryError:
        write("oom")
        raise
    except KeyboardInterrupt:
        write("interrupted")
        raise
    except engine.Diverged as err:
        result["error"] = str(err)
        write("diverged")
        raise
    except BaseException:
        write("error")
        raise
    finally:
        logger.summary({k: result[k] for k in ("top1", "best_top1", "throughput_img_s", "peak_mem_bytes",
                                               "act_mem_bytes", "act_compression")})
        logger.finish()
        dist.barrier()
    if info.is_main:
        print(done_line(result_path, result))
    return result


def done_line(path, r: dict) -> str:
    def mib(v):
        return "n/a" if v is None else f"{v / 2**20:.2f} MiB"
    speed = "n/a (only the accounted step ran)" if r["throughput_img_s"] is None else f"{r['throughput_img_s']:.1f} img/s"
    act = (f"activations {mib(r['act_mem_bytes'])} held vs {mib(r['act_mem_fp_bytes'])} full precision "
           f"({r['act_compression']:.2f}x)" if r.get("act_compression") else "activations not measured")
    casts = f", autocast weight copies {mib(r['amp_weight_cast_bytes'])}" if r.get("amp_weight_cast_bytes") else ""
    top1 = "n/a" if r["top1"] is None else f"{r['top1']:.2f}%"
    best = "n/a" if r["best_top1"] is None else f"{r['best_top1']:.2f}%"
    return (f"done: {results.relative_to_root(path)}\n  top1 {top1}  best {best}  throughput {speed}  "
            f"peak memory {mib(r['peak_mem_bytes'])} ({r.get('peak_mem_how')})\n  {act}{casts}")


def load_checkpoint(path: Path, device) -> dict:
    """torch.load with a clear error for a truncated or corrupt file."""
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as err:  # pickle, zip and EOF errors all mean the same thing here
        raise RuntimeError(
            f"checkpoint {results.relative_to_root(path)} cannot be read ({type(err).__name__}: {err}). Either delete "
            f"it to restart this run from scratch, or run with resume=false (which also starts over and "
            f"overwrites it).") from None


def check_same_code(previous, current: str, path: Path, cfg: DictConfig):
    """A finished or checkpointed run made by other code is not silently reused."""
    if previous == current or cfg.get("accept_stale"):
        return
    raise RuntimeError(
        f"{results.relative_to_root(path)} was made by code version {previous} but the code is now {current} "
        f"(sources or configs changed). Rerun it with skip_done=false resume=false, or keep it with "
        f"accept_stale=true.")


def engine_line(m: dict) -> str:
    import json
    return json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()
                       if not isinstance(v, (dict, list))})


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig):
    try:
        run(cfg)
    except (data_lib.DataNotFoundError, engine.Diverged) as err:
        raise SystemExit(f"error: {err}") from None
    finally:
        dist.cleanup()


if __name__ == "__main__":
    main()
