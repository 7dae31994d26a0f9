"""Max-batch finder (see division.maxbatch): `python scripts/max_batch.py --help`."""
from division.maxbatch import main

if __name__ == "__main__":
    main()
