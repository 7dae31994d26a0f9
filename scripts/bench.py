"""Memory/throughput benchmark (see division.bench): `python scripts/bench.py --help`."""
from division.bench import main

if __name__ == "__main__":
    main()
