"""Console scripts of an installed package: ``division-train`` is ``python train.py`` of the checkout."""
import importlib.util
import sys

RUNNER_NEEDS = ("hydra", "omegaconf", "torchvision", "timm", "tqdm")


def train():
    """``division-train [group=option ...] [key=value ...]``: the Hydra runner; configs ship in the package, and
    ``--config-dir DIR`` adds a folder of the user's own (``experiment=mine`` then finds DIR/experiment/mine.yaml)."""
    missing = [m for m in RUNNER_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"division-train needs the runner's dependencies, missing here: {missing}. "
                 "Install them with: pip install 'division[train]'")
    from division.train import main
    main()
