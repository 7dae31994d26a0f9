"""Loggers receive the same metric dicts that go to result.json. W&B failures never stop training."""
import warnings


class NullLogger:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def summary(self, metrics: dict) -> None:
        pass

    def table(self, name: str, rows: list, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    def __init__(self, cfg, run_config: dict, run_name: str):
        self.run = None
        try:
            import wandb
            self.run = wandb.init(project=cfg.project, entity=cfg.get("entity"), mode=cfg.mode, dir=cfg.dir,
                                  name=run_name, id=run_name if cfg.get("id_from_run", True) else None,
                                  group=cfg.get("group"), config=run_config, tags=list(cfg.get("tags") or []),
                                  reinit=True, resume="allow")
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

    def table(self, name, rows, step):
        """Rows (dicts with the same keys) as a wandb.Table, e.g. the per-layer memory report."""
        def log():
            import wandb
            columns = list(rows[0]) if rows else []
            data = [[r[c] if isinstance(r[c], (int, float, str)) else str(r[c]) for c in columns] for r in rows]
            self.run.log({name: wandb.Table(columns=columns, data=data)}, step=step)
        self._safe(log)

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
