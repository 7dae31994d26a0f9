"""Loggers receive the same metric dicts that go to result.json. W&B failures never stop training."""
import json
import warnings
from pathlib import Path


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
                                  reinit="finish_previous", resume="allow")
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


def _leveldb_log_records(path: Path):
    """The records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB log format: 32 KiB
    blocks of records (crc32c 4 bytes, length 2, type 1: full/first/middle/last; a block tail shorter
    than a record header is padding)."""
    raw, block = path.read_bytes(), 32768
    if raw[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    records, pending, i = [], b"", 7
    while i + 7 <= len(raw):
        left = block - i % block
        if left < 7:
            i += left
            continue
        length, kind = int.from_bytes(raw[i + 4:i + 6], "little"), raw[i + 6]
        chunk = raw[i + 7:i + 7 + length]
        i += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    return records


def read_offline_run(run_dir):
    """``(history rows, config, run)`` of an offline W&B run, read from its .wandb file (no network, no sync);
    ``run`` holds its id, name and group."""
    from wandb.proto import wandb_internal_pb2
    history, config, run = [], {}, {}
    for data in _leveldb_log_records(next(Path(run_dir).glob("*.wandb"))):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.HasField("history"):
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif record.HasField("run"):
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            run.update(id=record.run.run_id, name=record.run.display_name, group=record.run.run_group)
    return history, config, run


def build(cfg, run_config: dict, run_name: str, is_main: bool):
    if not is_main or cfg.name == "none":
        return NullLogger()
    if cfg.name == "wandb":
        import os
        os.makedirs(cfg.dir, exist_ok=True)
        return WandbLogger(cfg, run_config, run_name)
    raise ValueError(f"unknown logger {cfg.name!r}; valid choices: ['none', 'wandb']")
