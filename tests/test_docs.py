"""The docs stay true: results pages equal what `make tables` writes now from the committed result files, and
every training command in the README and docs composes with Hydra (the library example runs in test_api.py)."""
import re
import shlex
import sys

import pytest
from hydra import compose, initialize_config_dir

from conftest import CONFIG_DIR, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import results_pages  # noqa: E402

GUIDES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "results.md")]


def test_results_page_is_current():
    """docs/results.md is exactly what make tables renders from results/ now (run `make tables` if not)."""
    committed = (ROOT / "docs" / "results.md").read_text()
    assert committed == results_pages.results_page(ROOT / "results", ROOT), "docs/results.md is stale: make tables"


def test_readme_table_is_current():
    readme = (ROOT / "README.md").read_text()
    assert readme == results_pages.readme_with_glance(readme, ROOT / "results"), "README's table is stale: make tables"


def test_readme_is_a_guide():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


COMMAND = re.compile(r"^(\w+=\S+\s+)*(python3? train\.py|torchrun .*train\.py|division-train)\b")


def shell_blocks(text: str):
    """The contents of the fenced code blocks opened by ``` or ```bash (not python, not output)."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = [] if line.strip() in ("```", "```bash") else False
            else:
                if current is not False:
                    blocks.append("\n".join(current))
                current = None
        elif current:
            current.append(line)
        elif current == []:
            current.append(line)
    return blocks


def training_commands():
    """(file, overrides) of every `python train.py ...`, `torchrun ... train.py ...` and `division-train ...`
    line inside the guides' code blocks."""
    found = []
    for path in GUIDES:
        for block in shell_blocks(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                words = shlex.split(line) if COMMAND.match(line) else []
                if not words:
                    continue
                starts = [i for i, w in enumerate(words) if w.endswith("train.py") or w == "division-train"]
                if not starts or line.startswith("#"):
                    continue
                start = starts[0]
                found.append((path.name, line, words[start + 1:]))
    return found


def _expand(args):
    """One override list per value of each multirun sweep (key=a,b,c), the other sweeps at their first value."""
    args = [a for a in args if a != "-m"]
    sweeps = {i: a.split("=", 1) for i, a in enumerate(args) if "=" in a and "," in a.split("=", 1)[1] and "[" not in a}
    first = [f"{sweeps[i][0]}={sweeps[i][1].split(',')[0]}" if i in sweeps else a for i, a in enumerate(args)]
    variants = [first]
    for i, (key, values) in sweeps.items():
        for v in values.split(",")[1:]:
            variants.append(first[:i] + [f"{key}={v}"] + first[i + 1:])
    return variants


COMMANDS = training_commands()


def test_guides_have_training_commands():
    assert len(COMMANDS) >= 10, COMMANDS


@pytest.mark.parametrize("doc,line,args", COMMANDS, ids=[f"{d}:{l[:60]}" for d, l, _ in COMMANDS])
def test_training_command_composes(doc, line, args):
    if "--config-dir" in args:  # names the user's own folder; the shipped groups compose below without it
        i = args.index("--config-dir")
        args = args[:i] + args[i + 2:]
        args = [a for a in args if not a.startswith("experiment=mine")]
    for overrides in _expand(args):
        with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR):
            compose(config_name="train", overrides=overrides, return_hydra_config=True)


def test_user_config_folder_adds_to_the_shipped_groups(tmp_path):
    """README: `--config-dir my_configs experiment=mine` finds my_configs/experiment/mine.yaml beside the
    shipped groups."""
    import subprocess
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nseed: 7\ndefaults:\n  - override /model: resnet32\n")
    out = subprocess.run([sys.executable, "train.py", "--config-dir", str(tmp_path), "experiment=mine", "--cfg", "job"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "seed: 7" in out.stdout and "name: resnet32" in out.stdout


@pytest.mark.parametrize("lo,hi,says", [
    (-0.97, -0.08, "below fp here"),
    (-0.9, -0.3, "by more than the paper's 0.2 points"),
    (0.1, 0.5, "above fp here"),
    (-0.15, 0.3, "a loss of more than the paper's 0.2 points is ruled out"),
    (-1.85, 1.22, "a loss of up to 1.85 points is not ruled out"),
])
def test_readme_reading_of_an_interval(lo, hi, says):
    """The sentence under the README's table says what DIVISION's paired interval excludes and what it cannot."""
    text = results_pages._reading((lo + hi) / 2, lo, hi, 3)
    assert says in text and f"[{lo:+.2f}, {hi:+.2f}]" in text and "3 paired seeds" in text
