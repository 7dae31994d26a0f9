"""Whether two runs trained identically: their metrics.jsonl lines compared epoch by epoch, field by field,
leaving out what describes the machine (timings, process memory, codec backends, notes; ``MACHINE_KEYS``).
Checks that a resumed or restarted run repeats an earlier one. Exit status 0 when every epoch both runs
hold agrees, 1 when one differs, 2 when an input cannot be read as a run's metrics.

    python scripts/compare_runs.py results/runs/EXP/RUN_ID results/partial/EXP/RUN_ID
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from division.engine import MACHINE_KEYS  # noqa: E402


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_epochs(path: Path) -> dict:
    """Epoch number -> metrics line, from a run folder or its metrics.jsonl."""
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        fail(f"{file} does not exist; pass a run folder holding metrics.jsonl, or the file")
    epochs = {}
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                fail(f"{file} line {number} is not JSON ({err.msg}); is it a run's metrics.jsonl?")
            if not isinstance(row, dict) or "epoch" not in row:
                fail(f"{file} line {number} has no 'epoch' field; is it a run's metrics.jsonl?")
            epochs[row["epoch"]] = row
    return epochs


def compare(a: dict, b: dict, ignore=MACHINE_KEYS) -> dict:
    """Epoch -> {field: (a's value, b's value)} for every field outside ``ignore`` that differs, over the
    epochs both runs hold; a field one line lacks counts as differing."""
    out = {}
    for epoch in sorted(a.keys() & b.keys()):
        row_a, row_b = a[epoch], b[epoch]
        keys = sorted((row_a.keys() | row_b.keys()) - set(ignore))
        out[epoch] = {k: (row_a.get(k), row_b.get(k)) for k in keys if k not in row_a or k not in row_b
                      or row_a[k] != row_b[k]}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--also-ignore", nargs="*", default=[], metavar="FIELD",
                        help=f"fields to leave out besides {', '.join(MACHINE_KEYS)}")
    args = parser.parse_args()
    ignored = MACHINE_KEYS + tuple(args.also_ignore)
    a, b = read_epochs(args.run_a), read_epochs(args.run_b)
    diffs = compare(a, b, ignored)
    if not diffs:
        fail(f"no epoch in common ({args.run_a}: {sorted(a) or 'none'}; {args.run_b}: {sorted(b) or 'none'})")
    for epoch, fields in diffs.items():
        said = ", ".join(f"{k}: {va!r} vs {vb!r}" for k, (va, vb) in fields.items())
        print(f"epoch {epoch}: " + (f"differs in {said}" if fields else "equal"))
    differing = [e for e, f in diffs.items() if f]
    print(f"{len(diffs)} epochs in common ({min(diffs)}-{max(diffs)}; {args.run_a} holds {len(a)}, {args.run_b} "
          f"{len(b)}): " + (f"{len(differing)} differ, first at epoch {differing[0]}" if differing else
                           "every field equal outside " + ", ".join(ignored)))
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
