"""Loggers receive the same metric dicts that go to result.json. W&B failures never stop training."""
import warnings


class NullLogger:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def summary(self, metrics: dict) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    def __init__(self, cfg, run_config: dict, run_name: str):
        self.run = None
        try:
            import wandb
            self.run = wandb.init(project=cfg.project, entity=cfg.get("entity"), mode=cfg.mode, dir=cfg.dir,
                                  name=run_name, config=run_config, tags=list(cfg.get("tags") or []),
                                  reinit=True)
        except Exception as err:  # W&B problems of any kind become a warning
            warnings.warn(f"W&B disabled: {type(err).__name__}: {err}")

    def _safe(self, fn, *args):
        if self.run is None:
            return
        try:
            fn(*args)
        except Exception as err:
            warnings.warn(f"W&B call failed, continuing: {type(err).__name__}: {err}")

    def log(self, metrics, step):
        self._safe(lambda: self.run.log(metrics, step=step))

    def summary(self, metrics):
        self._safe(lambda: self.run.summary.update(metrics))

    def finish(self):
        self._safe(lambda: self.run.finish())
        self.run = None


def build(cfg, run_config: dict, run_name: str, is_main: bool):
    if not is_main or cfg.name == "none":
        return NullLogger()
    if cfg.name == "wandb":
        import os
        os.makedirs(cfg.dir, exist_ok=True)
        return WandbLogger(cfg, run_config, run_name)
    raise ValueError(f"unknown logger {cfg.name!r}; valid choices: ['none', 'wandb']")
