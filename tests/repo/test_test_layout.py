"""The tests' own layout: a folder per layer, helpers in support/, no test module importing another.

Test folders have no __init__.py (pytest's default rootdir import mode), so a test file's name must be
unique across folders, and the folders must never shadow the packages of the same name.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def all_test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_test_file_sits_in_a_layer_folder_under_a_unique_name():
    files = all_test_files()
    assert files and all(path.parent.parent == TESTS and path.parent.name != "support" for path in files), \
        [str(path.relative_to(TESTS)) for path in files if path.parent.parent != TESTS]
    names = [path.name for path in files]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not list(TESTS.rglob("__init__.py"))


def test_no_test_module_imports_another():
    modules = {path.stem for path in all_test_files()}
    offenders = {str(path.relative_to(TESTS)): sorted(imported_names(path) & modules) for path in all_test_files()}
    assert not {path: names for path, names in offenders.items() if names}


def test_support_modules_import_no_test_module_and_shadow_no_package():
    modules = {path.stem for path in all_test_files()}
    support = sorted((TESTS / "support").glob("*.py"))
    assert support and not [p.name for p in support if p.name.startswith("test_") or imported_names(p) & modules]
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert not {p.stem for p in support} & packages


def test_the_layer_folders_leave_the_packages_of_their_names_importable():
    for folder in (p for p in TESTS.iterdir() if p.is_dir() and (ROOT / p.name / "__init__.py").exists()):
        spec = importlib.util.find_spec(folder.name)
        assert spec is not None and spec.origin == str(ROOT / folder.name / "__init__.py"), (folder.name, spec)


def test_the_slow_files_listed_first_exist_and_keep_their_place(pytestconfig):
    from conftest import FIRST

    assert all((TESTS / name).is_file() for name in FIRST), FIRST
    # pytest-xdist's own reordering (by number of tests per file) would undo the list.
    assert not getattr(pytestconfig.option, "loadscopereorder", False)
