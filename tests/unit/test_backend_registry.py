"""The backend registry, the contract's Backend enum and the SDK's names agree: a backend added to
one and not the others fails here, not as an INTERNAL error on the wire. And a backend is one
folder, daemon/backends/NAME/, that imports no other backend's."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from corral.daemon.backends import registry
from corral.daemon.backends.registry import BACKENDS
from corral.daemon.config import load_config
from corral.sdk.enums import BACKEND_NUMBERS
from corral.sdk.types import BackendName

BACKENDS_DIR = Path(registry.__file__).parent


def test_every_registered_backend_is_in_the_contract_and_the_sdk() -> None:
    assert set(BACKENDS) == set(BACKEND_NUMBERS) == set(get_args(BackendName))


def test_every_backend_has_a_configuration_section_of_its_own_settings() -> None:
    config = load_config(environ={})
    for name, backend in BACKENDS.items():
        assert backend.name == name
        assert isinstance(config.backend(name), backend.Settings)
        config.backend(name).validate()  # the defaults are valid


def imported(source: Path, package: str) -> set[str]:
    """The modules `source`, a module of `package`, imports (relative imports resolved), and for
    `from X import y` also X.y, which may be a module."""
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


def test_each_backend_is_one_folder_that_imports_no_other_backend() -> None:
    folders = {path.name for path in BACKENDS_DIR.iterdir() if (path / "__init__.py").is_file()}
    assert folders == set(BACKENDS)
    for name, backend in BACKENDS.items():
        package = f"corral.daemon.backends.{name}"
        assert backend.__module__ == f"{package}.backend"
        others = [f"corral.daemon.backends.{other}" for other in BACKENDS if other != name]
        for source in sorted((BACKENDS_DIR / name).rglob("*.py")):
            for module in imported(source, package):
                assert not any(module == other or module.startswith(f"{other}.") for other in others), (
                    f"{source.relative_to(BACKENDS_DIR)} imports {module}: what two backends share lives in "
                    "daemon/backends/ itself"
                )


def test_the_conformance_suite_has_a_case_for_every_backend() -> None:
    from tests.conftest import BACKEND_CASES

    assert {backend for _, backend, _ in BACKEND_CASES.values()} == set(BACKENDS)
