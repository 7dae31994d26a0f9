import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_train
from division.loggers import read_offline_run

SYN = ["data=synthetic", "model=resnet20", "data.batch_size=8", "data.train_size=32", "data.test_size=16"]


def test_two_step_run_writes_result(tmp_path):
    result = run_train(SYN + ["method=division", "trainer.max_steps=2"], tmp_path)
    path = next(Path(tmp_path, "outputs", "runs", "default").glob("*/result.json"))
    saved = json.loads(path.read_text())
    assert saved["status"] == "ok" and result["status"] == "ok"
    for key in ("config", "config_hash", "seed", "epochs", "top1", "best_top1", "throughput_img_s",
                "peak_mem_bytes", "act_mem_bytes", "act_mem_fp_bytes", "act_compression", "git_sha",
                "git_dirty", "versions", "device", "wall_time_s"):
        assert key in saved, key
    assert saved["epochs"][0]["global_step"] == 2
    assert saved["act_compression"] > 5
    assert (path.parent / "metrics.jsonl").read_text().count("\n") == 1
    assert str(tmp_path) not in json.dumps(saved["config"]["data"])


@pytest.mark.parametrize("method", ["fp", "division", "division_nolfc", "actnn", "blpa", "checkpoint", "swap"])
def test_every_method_runs(tmp_path, method):
    result = run_train(SYN + [f"method={method}", "trainer.max_steps=2"], tmp_path)
    assert result["status"] == "ok" and result["act_mem_bytes"] > 0


def test_resume_continues_epochs(tmp_path):
    first = run_train(SYN + ["method=fp", "trainer.epochs=1"], tmp_path)
    assert [e["epoch"] for e in first["epochs"]] == [1]
    second = run_train(SYN + ["method=fp", "trainer.epochs=3", "resume=true"], tmp_path)
    assert [e["epoch"] for e in second["epochs"]] == [1, 2, 3]
    assert second["epochs"][1]["global_step"] == 2 * first["epochs"][0]["global_step"]


def test_skip_done(tmp_path, capsys):
    run_train(SYN + ["method=fp", "trainer.max_steps=1"], tmp_path)
    again = run_train(SYN + ["method=fp", "trainer.max_steps=1", "skip_done=true"], tmp_path)
    assert again["status"] == "ok"
    assert "skip:" in capsys.readouterr().out


def test_wandb_offline_run_holds_steps_epochs_and_memory_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = run_train(SYN + ["method=division", "trainer.epochs=1", "logger=wandb", "logger.log_every=2"], tmp_path)
    assert result["status"] == "ok"
    runs = list(Path(tmp_path, "outputs", "wandb").glob("offline-run-*"))
    assert runs, "no offline W&B run directory"
    for _ in range(40):  # W&B's service may still be flushing the offline log when the run returns
        history, config, run = read_offline_run(runs[0])
        steps = [h for h in history if "step/train_loss" in h]
        if len(steps) >= 2 and any("memory_layers/_type" in h for h in history):
            break
        time.sleep(0.5)
    assert [h["_step"] for h in steps] == [2, 4]
    assert all(h["step/lr"] > 0 and h["step/img_s"] > 0 for h in steps)
    assert any("train_loss" in h and "top1" in h for h in history)  # the per-epoch metrics
    assert any(h.get("memory_layers/_type") == "table-file" for h in history)  # the memory report as a wandb.Table
    assert config["method"]["name"] == "division" and config["model"]["name"] == "resnet20"
    assert run["group"] == "default" and run["id"] == run["name"] == result["run_id"]
    out = subprocess.run([sys.executable, "scripts/wandb_summary.py", str(runs[0])], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    summary = json.loads(out)
    assert summary["per_step_points"] == 2 and summary["tables"] == ["memory_layers"]
    assert summary["config"]["method"] == "division" and len(summary["per_epoch_rows"]) == 1


@pytest.mark.parametrize("override, match", [
    ("trainer.amp=fp8", r"trainer.amp='fp8' is invalid; valid choices"),
    ("trainer.epochs=0", r"trainer.epochs=0 is invalid; it must be >= 1"),
    ("trainer.max_steps=-1", r"trainer.max_steps=-1 is invalid"),
    ("optim.lr=-1", r"optim.lr=-1 is invalid; it must be > 0"),
    ("optim.momentum=1.5", r"optim.momentum=1.5 is invalid"),
    ("optim.weight_decay=-0.1", r"optim.weight_decay=-0.1 is invalid"),
    ("data.subset=-5", r"data.subset=-5 is invalid"),
    ("trainer.tf32=sometimes", r"trainer.tf32='sometimes' is invalid; valid choices: \[null, true, false\]"),
    ("trainer.tf32=1", r"trainer.tf32=1 is invalid; valid choices: \[null, true, false\]"),
])
def test_bad_training_values_name_the_value(tmp_path, override, match):
    """Each bad value stops the run before it trains, with a message naming the key, the value and what is valid."""
    with pytest.raises(ValueError, match=match):
        run_train(SYN + [override], tmp_path)
    assert not list(Path(tmp_path).rglob("result.json"))


def test_result_records_provenance_and_backend(tmp_path):
    result = run_train(SYN + ["method=division", "trainer.max_steps=2"], tmp_path)
    for key in ("code_version", "git_sha", "git_dirty", "versions", "device", "method_info", "peak_mem_how"):
        assert result[key] is not None, key
    assert set(result["codec_backends"]) <= {"compiled", "reference"} and result["codec_backends"]
    assert result["method_info"]["backend"] == "auto"


def test_stale_run_is_refused_unless_accepted(tmp_path):
    run_train(SYN + ["method=fp", "trainer.max_steps=1"], tmp_path)
    path = next(Path(tmp_path, "outputs", "runs").rglob("result.json"))
    saved = json.loads(path.read_text())
    saved["code_version"] = "0123456789ab"
    path.write_text(json.dumps(saved))
    with pytest.raises(RuntimeError, match="accept_stale=true"):
        run_train(SYN + ["method=fp", "trainer.max_steps=1", "skip_done=true"], tmp_path)
    kept = run_train(SYN + ["method=fp", "trainer.max_steps=1", "skip_done=true", "accept_stale=true"], tmp_path)
    assert kept["code_version"] == "0123456789ab"


def test_corrupt_checkpoint_names_file_and_ways_out(tmp_path):
    run_train(SYN + ["method=fp", "trainer.epochs=1"], tmp_path)
    ckpt = next(Path(tmp_path, "outputs", "runs").rglob("checkpoint.pt"))
    ckpt.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError) as err:
        run_train(SYN + ["method=fp", "trainer.epochs=1", "resume=true"], tmp_path)
    text = str(err.value)
    assert "checkpoint.pt" in text and "delete" in text and "resume=false" in text


def test_synthetic_data_uses_the_model_input_size(tmp_path):
    from conftest import compose
    assert compose(["data=synthetic", "model=resnet50"]).data.image_size == 224
    assert compose(["data=synthetic", "model=resnet20"]).data.image_size == 32
    assert compose(["data=synthetic", "model=resnet50", "data.image_size=64"]).data.image_size == 64


def test_adhoc_runs_stay_out_of_results(tmp_path):
    from conftest import compose
    assert compose([]).paths.runs_dir.endswith("outputs/runs")
    assert compose(["experiment=cifar10_resnet20_cpu"]).paths.runs_dir.endswith("results/runs")


def test_seeds_are_paired_across_methods():
    """A seed fixes the initial weights and the data order (augmentation included) whatever the method,
    and whatever a method's stochastic rounding draws from the global generator."""
    import torch
    from conftest import compose
    from division import data as data_lib, methods, models
    from division.train import seed_everything
    states, batches = [], []
    for name in ("fp", "division"):
        cfg = compose(["data=synthetic", "model=resnet20", f"method={name}", "seed=3"])
        seed_everything(int(cfg.seed))
        train, _, _ = data_lib.build(cfg.data, int(cfg.seed))
        model = models.create_model("resnet20", num_classes=10)
        methods.build(cfg.method).prepare(model)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        torch.rand(1000)  # a method's stochastic rounding consumes the global generator
        train.set_epoch(1)
        batches.append(next(iter(train)))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert torch.equal(batches[0][0], batches[1][0]) and torch.equal(batches[0][1], batches[1][1])


def test_imagenet_cnns_get_a_cifar_stem_on_small_inputs(tmp_path):
    import torch
    import torch.nn as nn
    from division.models import create_model, resolve_stem
    small = create_model("resnet50", num_classes=10, stem="auto", image_size=32)
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1) and isinstance(small.maxpool, nn.Identity)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    big = create_model("resnet50", num_classes=10, stem="auto", image_size=224)
    assert big.conv1.kernel_size == (7, 7) and isinstance(big.maxpool, nn.MaxPool2d)
    dense = create_model("densenet161", num_classes=10, stem="cifar", image_size=32)
    assert dense.features.conv0.kernel_size == (3, 3) and isinstance(dense.features.pool0, nn.Identity)
    with pytest.raises(ValueError, match="valid choices"):
        resolve_stem("tiny")
    with pytest.raises(ValueError, match="model=vit_cifar"):
        create_model("vit_small_patch16_224", stem="auto", image_size=32)
    result = run_train(["data=synthetic", "model=resnet50", "data.image_size=32", "data.batch_size=4",
                        "data.train_size=8", "data.test_size=4", "trainer.max_steps=1"], tmp_path)
    assert result["stem"] == "cifar" and result["input_size"] == 32


def test_divergence_stops_the_run_with_its_cause(tmp_path):
    from division import engine
    bad = SYN + ["method=fp", "optim.lr=1e4", "optim.warmup_epochs=0", "trainer.max_steps=8"]
    with pytest.raises(engine.Diverged, match="optim.lr"):
        run_train(bad, tmp_path)
    saved = json.loads(next(Path(tmp_path, "outputs", "runs").rglob("result.json")).read_text())
    assert saved["status"] == "diverged" and "optim.lr" in saved["error"]
    allowed = run_train(bad + ["trainer.allow_divergence=true"], tmp_path / "allowed")
    assert allowed["status"] == "ok"


def test_guard_waits_for_the_warmup():
    from division import engine
    state = engine.StepState(device=None, diverge_loss=5.0, guard_from_step=10, global_step=3)
    engine.check_divergence(50.0, state, 0)  # still warming up
    state.global_step = 10
    with pytest.raises(engine.Diverged, match="warmup_epochs"):
        engine.check_divergence(50.0, state, 0)


def test_zero_init_residual_makes_blocks_start_as_identity(tmp_path):
    import torch
    from division.models import create_model, zero_init_residual_
    for name, last in (("resnet20", "bn2"), ("resnet50", "bn3")):
        model = create_model(name)
        assert zero_init_residual_(model) > 0
        blocks = [m for m in model.modules() if hasattr(m, last) and hasattr(m, "conv1")]
        assert blocks and all(torch.all(getattr(b, last).weight == 0) for b in blocks)
    assert zero_init_residual_(create_model("resnet164")) == 0  # pre-activation blocks have no last norm
    result = run_train(SYN + ["method=fp", "trainer.max_steps=1"], tmp_path)
    assert result["zero_init_residual_blocks"] == 9
    from conftest import compose
    assert compose(["experiment=cifar10_resnet20_full"]).model.zero_init_residual is False


def test_imagenet_vit_on_cifar_takes_the_fix_its_error_names(tmp_path):
    """The ViT-S/16 refuses 32x32 CIFAR images naming data.image_size; with it, the CIFAR loader resizes each
    batch and one training step runs (112 here: the smallest grid the model accepts, to stay fast)."""
    from test_data import _make_tree
    _make_tree(tmp_path / "data" / "cifar10", per_class=2, size=32)
    common = [f"data.root={tmp_path / 'data'}", "data.num_classes=3", "data.download=false", "data.batch_size=2",
              "model=vit_small_patch16_224", "trainer.max_steps=1", "trainer.checkpoint=false"]
    with pytest.raises(ValueError, match="data.image_size=224"):
        run_train(common, tmp_path / "small")
    result = run_train([*common, "data.image_size=112"], tmp_path / "resized")
    assert result["status"] == "ok" and result["input_size"] == 112 and result["config"]["optim"]["name"] == "adamw"


def _run_killed_at_step(args, path, monkeypatch, step: int):
    """Run training into ``path`` and interrupt it as the training step at global step ``step`` begins."""
    from division import engine
    real_step = engine.train_step

    def killed(*a, **k):
        if a[6].global_step == step:
            raise KeyboardInterrupt
        return real_step(*a, **k)
    monkeypatch.setattr(engine, "train_step", killed)
    with pytest.raises(KeyboardInterrupt):
        run_train(args, path)
    monkeypatch.setattr(engine, "train_step", real_step)


def test_run_resumed_mid_epoch_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """Checkpoints every 3 steps; killed in the middle of epoch 2, resumed: same weights (DIVISION's stochastic
    rounding included), same epoch metrics as a run that was never stopped."""
    import torch
    args = SYN + ["method=division", "data.train_size=64", "trainer.epochs=2", "trainer.checkpoint_every_steps=3"]
    straight = run_train(args, tmp_path / "straight")
    _run_killed_at_step(args, tmp_path / "resumed", monkeypatch, 12)  # epoch 2, its 5th step; checkpoint after 3rd
    ckpt_path = next(Path(tmp_path, "resumed").rglob("checkpoint.pt"))
    saved = torch.load(ckpt_path, weights_only=False)
    assert (saved["epoch"], saved["global_step"], saved["partial"]["steps"]) == (1, 11, 3)
    resumed = run_train(args + ["resume=true"], tmp_path / "resumed")
    weights = [torch.load(next(Path(tmp_path, d).rglob("checkpoint.pt")), weights_only=False)["model"]
               for d in ("straight", "resumed")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    for key in ("train_loss", "train_top1", "train_images", "steps", "global_step", "top1"):
        assert [e[key] for e in resumed["epochs"]] == [e[key] for e in straight["epochs"]], key
    assert resumed["epochs"][1]["steps"] == 8
    runs = [next(Path(tmp_path, d).rglob("metrics.jsonl")).parent for d in ("straight", "resumed")]
    compare = [sys.executable, str(ROOT / "scripts" / "compare_runs.py")]
    same = subprocess.run([*compare, *map(str, runs)], capture_output=True, text=True)
    assert same.returncode == 0 and "2 epochs in common (1-2" in same.stdout, same.stdout + same.stderr
    lines = (runs[1] / "metrics.jsonl").read_text().splitlines()
    tampered = json.loads(lines[1]) | {"train_loss": 0.0}
    (tmp_path / "tampered.jsonl").write_text(lines[0] + "\n" + json.dumps(tampered) + "\n")
    differs = subprocess.run([*compare, str(runs[0]), str(tmp_path / "tampered.jsonl")], capture_output=True, text=True)
    assert differs.returncode == 1 and "epoch 1: equal" in differs.stdout, differs.stdout + differs.stderr
    assert "epoch 2: differs in train_loss: " in differs.stdout and "first at epoch 2" in differs.stdout
    missing = subprocess.run([*compare, str(runs[0]), str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert missing.returncode == 2 and "nowhere does not exist" in missing.stderr
    (tmp_path / "cut.jsonl").write_text(lines[0] + "\n" + lines[1][:40] + "\n")
    cut = subprocess.run([*compare, str(runs[0]), str(tmp_path / "cut.jsonl")], capture_output=True, text=True)
    assert cut.returncode == 2 and "cut.jsonl line 2 is not JSON" in cut.stderr, cut.stderr


def test_mid_epoch_checkpoints_need_a_resumable_loader(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.checkpoint_every_steps=-1 is invalid; it must be >= 0"):
        run_train(SYN + ["method=fp", "trainer.checkpoint_every_steps=-1"], tmp_path)


def test_dirty_flag_ignores_results_but_not_code(tmp_path):
    """A suite rerun rewrites committed result files as it goes: that must not mark its later rows dirty,
    while any change to code or configs must."""
    from division.results import git_state

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "row.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (tmp_path / "results" / "row.json").write_text('{"rerun": true}')
    sha, dirty = git_state(tmp_path)
    assert sha and dirty is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_state(tmp_path)[1] is True


def test_carried_provenance_wins_over_a_stale_git_and_is_checked_against_the_code(tmp_path, monkeypatch):
    """On the GPU machine the tree arrives with the commit prepare.sh recorded, and possibly a .git of an older
    commit: the recorded commit is reported, and marked dirty when the code that runs is not that commit's."""
    import subprocess as sp
    from division import results
    sp.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    monkeypatch.setenv("DIVISION_GIT_SHA", "a" * 40)
    monkeypatch.setenv("DIVISION_GIT_DIRTY", "false")
    assert results.git_state(tmp_path) == ("a" * 40, False)
    monkeypatch.setenv("DIVISION_CODE_VERSION", results.code_version())
    assert results.provenance(torch.device("cpu"))["git_dirty"] is False
    monkeypatch.setenv("DIVISION_CODE_VERSION", "0" * 12)
    assert results.provenance(torch.device("cpu"))["git_dirty"] is True


@pytest.mark.parametrize("tf32, convolutions, matmuls", [(None, True, False), (True, True, True), (False, False, False)])
def test_tf32_choice_is_set_on_every_cuda_run(tf32, convolutions, matmuls):
    """A CUDA run sets both flags whatever an earlier job of the same process chose (the flags can be set
    without a GPU); a CPU run leaves them alone."""
    from division.train import set_tf32
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = (not convolutions), (not matmuls)
        set_tf32(torch.device("cpu"), tf32)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (not convolutions,
                                                                                           not matmuls)
        set_tf32(torch.device("cuda"), tf32)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (convolutions, matmuls)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_run_id_ignores_where_the_data_is_read_from():
    """The same run reached through another data folder (a worktree one level deeper sees ../../data for ../data)
    or another cache keeps its id, so its seeds group and skip_done finds it; what the data is still counts."""
    from division.results import config_hash
    cfg = {"seed": 0, "data": {"name": "cifar10", "root": "../shared/datasets", "cache_dir": "./data/cache",
                               "download": True, "batch_size": 1024}, "method": {"name": "division"}}
    moved = {**cfg, "data": {**cfg["data"], "root": "../../shared/datasets", "cache_dir": "/tmp/c", "download": False}}
    assert config_hash(moved) == config_hash(cfg)
    assert config_hash({**cfg, "data": {**cfg["data"], "batch_size": 512}}) != config_hash(cfg)
    assert config_hash({**cfg, "data": {**cfg["data"], "name": "cifar100"}}) != config_hash(cfg)


def test_resumed_budget_run_keeps_its_plan(tmp_path, monkeypatch):
    """A budgeted run resumed from a checkpoint goes on with the plan it was making, not one made afresh from
    the weights it resumes with: it ends as the run that was never stopped (weights equal, stochastic rounding
    included)."""
    import torch
    args = SYN + ["method=division_plus", "method.budget=12x", "data.train_size=64", "trainer.epochs=2",
                  "trainer.checkpoint_every_steps=3", "optim.lr=0.5"]
    straight = run_train(args, tmp_path / "straight")
    _run_killed_at_step(args, tmp_path / "resumed", monkeypatch, 12)
    resumed = run_train(args + ["resume=true"], tmp_path / "resumed")
    plans = [r["method_info"]["budget_plan"]["layers"] for r in (straight, resumed)]
    assert [p["choice"] for p in plans[0]] == [p["choice"] for p in plans[1]]
    weights = [torch.load(next(Path(tmp_path, d).rglob("checkpoint.pt")), weights_only=False)["model"]
               for d in ("straight", "resumed")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
