"""The README's library example run as a script on the real CIFAR-10 (20 steps of the plain loop), beside the
runner's accounting of the same model and batch size: the loss should fall and the two ratios agree. Writes
results/api/api_example.json (provenance included); a measurement, not a test.

    DATA_DIR=../shared/datasets python scripts/api_example.py --batch 64
"""
import argparse
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from division import CONFIG_DIR, data as data_lib, results  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "results" / "api" / "api_example.json"))
    args = p.parse_args(argv)
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose(config_name="train", overrides=["data=cifar10", f"data.batch_size={args.batch}", "model=resnet20",
                                                      "method=division", "logger=none", "trainer.max_steps=1",
                                                      "trainer.device=cpu", "trainer.progress=false",
                                                      "paths.root_dir=/tmp/division_api_example"])
    train, _, _ = data_lib.build(cfg.data, 0)
    loader = [batch for _, batch in zip(range(args.steps), train)]
    code = re.search(r"<!-- api-example -->\s*```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    code = "\n".join(line for line in code.splitlines() if not line.startswith("loader = "))  # the real data
    losses = []
    namespace = {"loader": loader, "losses": losses}
    torch.manual_seed(0)
    exec(compile(code.replace("opt.step()", "opt.step(); losses.append(loss.item())"), "README.md", "exec"), namespace)
    report = namespace["report"]
    from division.train import run
    runner = run(cfg)  # the runner's first step of the same model, method and batch size
    record = {"status": "ok", "batch": args.batch, "steps": args.steps, "losses": losses,
              "first5_mean_loss": sum(losses[:5]) / 5, "last5_mean_loss": sum(losses[-5:]) / 5,
              "example_held_bytes": report.held_bytes, "example_fp_bytes": report.fp_bytes,
              "example_ratio": report.ratio, "runner_act_mem_bytes": runner["act_mem_bytes"],
              "runner_act_mem_fp_bytes": runner["act_mem_fp_bytes"], "runner_ratio": runner["act_compression"],
              "command": results.command_line("scripts/api_example.py", argv or sys.argv[1:]),
              **results.provenance(torch.device("cpu"))}
    results.write_json(Path(args.out), record)
    print(f"loss first 5 steps {record['first5_mean_loss']:.3f} -> last 5 {record['last5_mean_loss']:.3f}; "
          f"ratio: example {record['example_ratio']:.3f}x, runner {record['runner_ratio']:.3f}x "
          f"({report.held_bytes} vs {runner['act_mem_bytes']} bytes held)")


if __name__ == "__main__":
    main()
