"""Thin entry point: `python train.py method=division model=resnet50` (see configs/train.yaml)."""
from division.train import main

if __name__ == "__main__":
    main()
