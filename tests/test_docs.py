"""The docs: the site builds with no dead link or anchor, and what the pages name exists.

A renamed config key, config group option, file or Python name fails here, naming the page
and the name; the config key reference is regenerated from the schema, never edited by hand.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.config import reference

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SECTIONS = "model|data|rollout|reward|env|algorithm|train|eval|cluster|sft|dpo"
_KEY = re.compile(rf"(?<![\w./<-])(?:{SECTIONS})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*(?![\w(-])")
_GROUP = re.compile(r"(?<![\w.])(experiment|algorithm|cluster|rollout|model)=((?:[a-z0-9_]+(?:\\?\|)?)+)")
_PATH = re.compile(r"(?<![\w./-])((?:rlhf|conf|bench|scripts|launch|docker|tests|docs)/[\w./-]*)")
_PYNAME = re.compile(r"(?<![\w./-])rlhf(?:\.\w+)+")
_FILE_SUFFIXES = {"py", "jsonl", "json", "parquet", "yaml", "yml", "md", "txt", "png", "log"}
# Names that read like config keys but are not: an environment's methods.
_NOT_KEYS = {"env.step", "env.reset"}


def named_keys(text: str) -> set[str]:
    found = set()
    for m in _KEY.finditer(text):
        key = m.group(0).rstrip(".")
        if key.rsplit(".", 1)[-1] not in _FILE_SUFFIXES and key not in _NOT_KEYS:
            found.add(key)
    return found


def named_group_options(text: str) -> set[tuple[str, str]]:
    return {
        (m.group(1), name) for m in _GROUP.finditer(text) for name in re.split(r"\\?\|", m.group(2)) if name
    }


def _python_name_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            if n == len(parts):
                return True
            name = re.escape(parts[n])
            defined = rf"^(?:def|class) {name}\b|^{name}\s*[:=]|^from \S+ import .*\b{name}\b|^\s+{name},?$"
            return re.search(defined, source.read_text(), re.M) is not None
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_config_keys_exist(page: Path) -> None:
    unknown = sorted(named_keys(page.read_text()) - reference.keys())
    assert not unknown, f"{page.relative_to(ROOT)} names config keys no schema has: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_group_options_exist(page: Path) -> None:
    missing = sorted(
        f"{group}={name}"
        for group, name in named_group_options(page.read_text())
        if not (ROOT / "conf" / group / f"{name}.yaml").is_file()
    )
    assert not missing, f"{page.relative_to(ROOT)} names config group options with no conf/ file: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_and_python_names_exist(page: Path) -> None:
    text = page.read_text()
    paths = {m.group(1).rstrip(".,") for m in _PATH.finditer(text)}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    names = {m.group(0).rstrip(".") for m in _PYNAME.finditer(text)}
    missing += sorted(n for n in names if not _python_name_exists(n))
    assert not missing, f"{page.relative_to(ROOT)} names files or Python names that do not exist: {missing}"


def test_the_scanners_catch_a_rename() -> None:
    """The checks above can fail: a renamed key, option, file and name are each found."""
    text = (
        "set `train.num_stepz=5` or `model.lora.rank=8` with `algorithm=grpo\\|nope` and "
        "`experiment=rlvr_math`; see `rlhf/trainer/nothing.py`, `rlhf.trainer.ppo_trainer.Nope` "
        "and `rlhf.trainer.ppo_trainer.PPOTrainer`; a file train.parquet is no key."
    )
    assert named_keys(text) - reference.keys() == {"train.num_stepz"}
    assert "model.lora.rank" in named_keys(text)
    options = named_group_options(text)
    assert ("algorithm", "nope") in options and ("experiment", "rlvr_math") in options
    assert not (ROOT / "rlhf/trainer/nothing.py").exists()
    assert not _python_name_exists("rlhf.trainer.ppo_trainer.Nope")
    assert _python_name_exists("rlhf.trainer.ppo_trainer.PPOTrainer")


def test_config_reference_is_current() -> None:
    assert reference.PAGE.read_text() == reference.render(), (
        "docs/reference/config.md is out of date: run python -m rlhf.config.reference"
    )


def test_every_config_key_is_documented_on_its_field() -> None:
    undocumented = reference.undocumented()
    assert not undocumented, f"add a comment on these fields in rlhf/config/: {undocumented}"


def _build(site_root: Path, out: Path) -> subprocess.CompletedProcess:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    return subprocess.run(
        [str(mkdocs), "build", "--strict", "-f", str(site_root / "mkdocs.yml"), "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(out.parent)},
    )


def test_site_builds_with_no_dead_link(tmp_path: Path) -> None:
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Two commands" in home and 'href="recipes/"' in home  # the README, its links rewritten


def test_a_dead_link_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "docs", copy / "docs")
    (copy / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mkdocs_hooks.py", copy / "scripts")
    with (copy / "docs" / "lora.md").open("a") as f:
        f.write("\nSee [the old page](gpus.md#nothing).\n")
    done = _build(copy, tmp_path / "site")
    assert done.returncode != 0 and "gpus.md" in done.stdout + done.stderr
