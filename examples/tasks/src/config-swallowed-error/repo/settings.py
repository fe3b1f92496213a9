"""Service settings from a JSON file."""

import json

DEFAULTS = {"host": "127.0.0.1", "port": 8080, "debug": False}


class ConfigError(Exception):
    """The settings file exists but cannot be used."""


def load(path):
    """The settings in the JSON file at `path` over DEFAULTS. A missing file gives the defaults;
    a file that is not valid JSON, or not a JSON object, raises ConfigError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except Exception:
        return dict(DEFAULTS)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return {**DEFAULTS, **data}
