"""Structural checks of docker/Dockerfile (no Docker engine needed).

The image only works if vLLM is installed first (it pins torch) and flash-attn is compiled
afterwards against that torch, so the checks are about order, flags and pins, and each has a
negative test on a mutated copy of the real Dockerfile.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"


@dataclass
class Instruction:
    keyword: str
    args: str


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuations joined and comment lines dropped, as Docker does."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            keyword, _, args = full.partition(" ")
            instructions.append(Instruction(keyword.upper(), args.strip()))
    if pending.strip():
        raise ValueError("Dockerfile ends inside a line continuation")
    return instructions


def render(instructions: list[Instruction]) -> str:
    return "\n".join(f"{i.keyword} {i.args}" for i in instructions) + "\n"


def _arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            defaults[name.strip()] = value.strip().strip("\"'")
    return defaults


def _expand(s: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], m[0]), s)


@dataclass
class Step:
    """One shell command of a RUN, quotes removed; `pos` orders steps across the whole Dockerfile."""

    pos: tuple[int, int]
    cmd: str


def _run_steps(instructions: list[Instruction]) -> list[Step]:
    variables = _arg_defaults(instructions)
    steps = []
    for i, ins in enumerate(instructions):
        if ins.keyword != "RUN":
            continue
        lexer = shlex.shlex(_expand(ins.args, variables), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        cmd: list[str] = []
        j = 0
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "(", ")"):
                if cmd:
                    steps.append(Step((i, j), " ".join(cmd)))
                    j += 1
                cmd = []
            else:
                cmd.append(token)
    return steps


def _pip_installs(steps: list[Step], name_pattern: str) -> list[Step]:
    return [s for s in steps if re.search(r"\bpip3? install\b", s.cmd) and re.search(name_pattern, s.cmd)]


def _one(found: list[Step], what: str) -> Step:
    if len(found) != 1:
        raise DockerfileError(f"expected exactly one step that {what}, found {len(found)}: {found}")
    return found[0]


class DockerfileError(AssertionError):
    pass


def pyproject_pins() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    pins = {}
    for req in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^;,\s]+)", req.strip())
        if m:
            pins[m[1].lower().replace("_", "-")] = m[2]
    return pins


def check_dockerfile(text: str, pins: dict[str, str]) -> None:
    instructions = parse(text)

    froms = [i for i in instructions if i.keyword == "FROM"]
    if not froms:
        raise DockerfileError("no FROM")
    image = _expand(froms[0].args.split()[0], _arg_defaults(instructions))
    name, _, tag = image.rpartition(":")
    if "/" in tag or not name or "@" in image:
        raise DockerfileError(f"base image {image!r} has no tag")
    if tag == "latest" or not re.match(r"\d+\.\d+\.\d+-", tag):
        raise DockerfileError(f"base image tag {tag!r} is not pinned to a full CUDA version")
    if "devel" not in tag:
        # flash-attn is compiled in the image and DeepSpeed JIT-compiles ops: both need nvcc.
        raise DockerfileError(f"base image {image!r} is not a -devel image (no nvcc)")

    steps = _run_steps(instructions)
    vllm = _one(_pip_installs(steps, r"\bvllm=="), "pip-installs vllm==")
    flash = _one(_pip_installs(steps, r"\bflash[-_]attn\b"), "pip-installs flash-attn")
    deepspeed = _one(_pip_installs(steps, r"\bdeepspeed=="), "pip-installs deepspeed==")
    project = _one(_pip_installs(steps, r"-e \S*\.\[gpu\]"), "pip-installs the project with -e .[gpu]")

    for step, pkg, pattern in (
        (vllm, "vllm", r"\bvllm==([\w.]+)"),
        (deepspeed, "deepspeed", r"\bdeepspeed==([\w.]+)"),
        (flash, "flash-attn", r"\bflash[-_]attn(?:==|-)(\d[\w.]*)"),
    ):
        m = re.search(pattern, step.cmd)
        if not m or m[1] != pins[pkg]:
            raise DockerfileError(f"{pkg} in the Dockerfile ({m and m[1]}) != pyproject.toml ({pins[pkg]})")

    if not vllm.pos < flash.pos:
        raise DockerfileError("flash-attn is installed before vllm, so it would build against another torch")
    if not vllm.pos < deepspeed.pos:
        raise DockerfileError("deepspeed is installed before vllm, so it would build against another torch")
    for step, pkg in ((flash, "flash-attn"), (deepspeed, "deepspeed")):
        if "--no-build-isolation" not in step.cmd.split():
            raise DockerfileError(f"{pkg} is installed without --no-build-isolation: {step.cmd}")
    if not flash.pos < project.pos:
        raise DockerfileError("the project is installed before flash-attn")

    cxx20 = [s for s in steps if re.search(r"\bsed\b.*c\+\+20", s.cmd)]
    if not any(s.pos < flash.pos for s in cxx20):
        raise DockerfileError("flash-attn's -std=c++17 is not patched to C++20 before the build (torch 2.14)")

    # After vLLM fixed torch, any pip run without the constraints could swap it out.
    for s in _pip_installs(steps, r"."):
        if vllm.pos < s.pos and not re.search(r"(?:-c|--constraint)\s+\S+", s.cmd):
            raise DockerfileError(f"pip install after vllm without constraints: {s.cmd}")

    for ins in instructions:
        if ins.keyword == "COPY" and not ins.args.startswith("--from"):
            *sources, _dest = ins.args.split()
            for src in sources:
                if not src.startswith("--") and not (REPO / src).exists():
                    raise DockerfileError(f"COPY source {src!r} does not exist in the repository")


@pytest.fixture(scope="module")
def text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def pins() -> dict[str, str]:
    return pyproject_pins()


def test_pyproject_pins_what_the_image_needs(pins: dict[str, str]) -> None:
    assert {"vllm", "flash-attn", "deepspeed"} <= pins.keys()


def test_dockerfile_is_valid(text: str, pins: dict[str, str]) -> None:
    check_dockerfile(text, pins)


def test_dockerfile_checks_survive_render(text: str, pins: dict[str, str]) -> None:
    # The negative tests mutate a re-rendered copy, so the rendering itself must keep it valid.
    check_dockerfile(render(parse(text)), pins)


def _move_after(pattern_a: str, pattern_b: str) -> Callable[[str], str]:
    """Moves the RUN matching pattern_a to just after the RUN matching pattern_b."""

    def mutate(text: str) -> str:
        ins = parse(text)
        a = next(i for i in ins if i.keyword == "RUN" and re.search(pattern_a, i.args))
        ins.remove(a)
        b = next(k for k, i in enumerate(ins) if i.keyword == "RUN" and re.search(pattern_b, i.args))
        ins.insert(b + 1, a)
        return render(ins)

    return mutate


def _sub(pattern: str, repl: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        new = re.sub(pattern, repl, text, count=1, flags=re.M)
        assert new != text, f"mutation {pattern!r} did not apply"
        return new

    return mutate


def _drop_flag_in_flash_attn_install(text: str) -> str:
    ins = parse(text)
    for i in ins:
        if i.keyword == "RUN" and "flash-attn @" in i.args:
            head, _, tail = i.args.rpartition("pip install --no-build-isolation")
            assert head, "flash-attn install not found"
            i.args = head + "pip install" + tail
    return render(ins)


MUTATIONS: dict[str, Callable[[str], str]] = {
    "flash-attn-before-vllm": _move_after(r'"vllm==', r"flash-attn @"),
    "deepspeed-before-vllm": _move_after(r'"vllm==', r"deepspeed=="),
    "project-before-flash-attn": _move_after(r"flash-attn @", r"-e \"\.\[gpu\]\""),
    "flash-attn-build-isolation": _drop_flag_in_flash_attn_install,
    "deepspeed-build-isolation": _sub(
        r"pip install --no-build-isolation (-c \S+ \"deepspeed)", r"pip install \1"
    ),
    "no-cxx20-patch": _sub(r"\s*&& sed -i 's/-std=c\+\+17/-std=c\+\+20/g' \S+ \\\n", "\n"),
    "base-latest": _sub(r"^FROM nvidia/cuda:\S+", "FROM nvidia/cuda:latest"),
    "base-untagged": _sub(r"^FROM nvidia/cuda:\S+", "FROM nvidia/cuda"),
    "base-floating-major": _sub(r"^FROM nvidia/cuda:\S+", "FROM nvidia/cuda:13-devel"),
    "base-runtime": _sub(r"^FROM nvidia/cuda:\S+", "FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04"),
    "vllm-version-drift": _sub(r"^ARG VLLM_VERSION=.*$", "ARG VLLM_VERSION=0.32.0"),
    "flash-attn-version-drift": _sub(r"^ARG FLASH_ATTN_VERSION=.*$", "ARG FLASH_ATTN_VERSION=2.8.3"),
    "no-constraints": _sub(r'pip install -c /opt/constraints.txt -e "\.\[gpu\]"', 'pip install -e ".[gpu]"'),
    "copy-missing-dir": _sub(r"^COPY conf \./conf$", "COPY configs ./configs"),
}


@pytest.mark.parametrize("mutate", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_check_rejects(text: str, pins: dict[str, str], mutate: Callable[[str], str]) -> None:
    with pytest.raises(DockerfileError):
        check_dockerfile(mutate(text), pins)


def test_parse_joins_continuations_and_drops_comments() -> None:
    ins = parse("# c\nFROM a:1.2.3-devel\nRUN a \\\n    # inner comment\n    && b\n")
    assert [(i.keyword, i.args) for i in ins] == [("FROM", "a:1.2.3-devel"), ("RUN", "a && b")]
