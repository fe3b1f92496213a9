"""deploy/corral.toml says it lists every key with its default, and the README's configuration
table is where users look a key up: both are checked against the settings the code declares."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from corral.daemon.config import Config

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "deploy" / "corral.toml"
README = ROOT / "README.md"
# Not keys of the file: secrets come from files or the environment, [[pool]] entries are examples.
NOT_IN_THE_FILE = {"token", "tcp_tokens", "metrics_token", "pool"}


def declared_keys(settings: Any, prefix: str = "") -> dict[str, Any]:
    """Every key the settings declare (dotted, nested sections flattened), with its default."""
    keys: dict[str, Any] = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if dataclasses.is_dataclass(value):
            keys.update(declared_keys(value, f"{prefix}{field.name}."))
        else:
            keys[prefix + field.name] = value
    return keys


def code_keys() -> dict[str, Any]:
    config = Config()
    keys = {
        key: value
        for key, value in declared_keys(config).items()
        if key.split(".")[0] not in NOT_IN_THE_FILE and not key.startswith("backends")
    }
    for name, settings in config.backends.items():
        keys.update(declared_keys(settings, f"{name}."))
    return keys


def file_keys(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    keys: dict[str, Any] = {}
    for key, value in values.items():
        if key in NOT_IN_THE_FILE and not prefix:
            continue
        if isinstance(value, dict):
            keys.update(file_keys(value, f"{prefix}{key}."))
        else:
            keys[prefix + key] = value
    return keys


def test_the_sample_configuration_lists_every_key_with_its_default() -> None:
    declared = code_keys()
    listed = file_keys(tomllib.loads(SAMPLE.read_text()))
    assert sorted(set(declared) - set(listed)) == [], "keys missing from deploy/corral.toml"
    assert sorted(set(listed) - set(declared)) == [], "keys in deploy/corral.toml that the code does not read"
    differ = {key: (listed[key], declared[key]) for key in declared if listed[key] != declared[key]}
    assert differ == {}, "(file, code) defaults that differ"


def named_in_a_row(key: str, rows: list[str]) -> bool:
    """A row of the README's table names the key: whole (`local.seccomp`), or as one of the keys
    of its section a row lists together (`local.image_cache_dir` / `image_cache_bytes`)."""
    section, name = key.rsplit(".", 1)
    for row in rows:
        names = row.split("|")[1]
        if f"`{key}`" in names or (f"`{section}." in names and re.search(rf"/ `{re.escape(name)}`", names)):
            return True
    return False


def test_the_readmes_configuration_table_names_every_key() -> None:
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `")]
    assert sorted(key for key in code_keys() if not named_in_a_row(key, rows)) == []
