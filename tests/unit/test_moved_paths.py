"""What moved in this release keeps working for one more, with a warning: the rollout engine's old
import paths under corral.daemon.rollout, and the old [local] configuration keys."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest

from corral.daemon.config import load_config


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("corral.daemon.rollout.tokenizer", "corral.rollout.tokenizer", "ByteChatTokenizer"),
        ("corral.daemon.rollout.pipeline", "corral.rollout.pipeline", "RolloutPipeline"),
        ("corral.daemon.rollout.llm.sglang", "corral.rollout.llm.sglang", "SGLangClient"),
        ("corral.daemon.rollout.llm.reference_server", "corral.rollout.reference.server", "ReferenceServer"),
        ("corral.daemon.rollout.llm.replay", "corral.rollout.reference.replay", "ReplayPolicy"),
        ("corral.daemon.rollout.llm.pool", "corral.daemon.llm_pool", "LLMPool"),
        ("corral.daemon.rollout.runtime", "corral.daemon.rollout_runtime", "RolloutRuntime"),
    ],
)
def test_old_rollout_paths_forward_with_a_deprecation_warning(old: str, new: str, name: str) -> None:
    sys.modules.pop(old, None)  # a module imported once warns once; import it afresh here
    with pytest.warns(DeprecationWarning) as warned:  # (its parent package may warn too)
        module = importlib.import_module(old)
    assert f"{old} moved to {new}" in [str(w.message).split(";")[0] for w in warned]
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_old_local_keys_move_to_the_sandbox_section_with_a_warning(tmp_path, caplog) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[local]\nworkdir = "/work"\nuid_base = 2000000\nisolation = "unshare"\n')
    with caplog.at_level(logging.WARNING, logger="corral.daemon.config"):
        config = load_config(toml, environ={})
    assert config.sandbox.workdir == "/work" and config.sandbox.uid_base == 2000000
    assert config.backend("local").isolation == "unshare"
    assert "local.workdir is deprecated" in caplog.text and "use sandbox.workdir" in caplog.text
    toml.write_text('[local]\nworkdir = "/old"\n[sandbox]\nworkdir = "/new"\n')
    assert load_config(toml, environ={}).sandbox.workdir == "/new"  # the new key wins


def test_backend_sections_are_checked_by_their_own_settings(tmp_path) -> None:
    from corral.daemon.config import ConfigError

    toml = tmp_path / "c.toml"
    toml.write_text('[local]\nisolation = "chroot"\n')
    with pytest.raises(ConfigError, match="local.isolation must be one of"):
        load_config(toml, environ={})
    toml.write_text("[singularity]\nnonsense = 1\n")
    with pytest.raises(ConfigError, match="unknown configuration key singularity.nonsense"):
        load_config(toml, environ={})
    toml.write_text('token = "from-the-file"\n')
    with pytest.raises(ConfigError, match="unknown configuration key token"):
        load_config(toml, environ={})


def test_old_module_paths_still_run_with_python_dash_m() -> None:
    import subprocess

    run = subprocess.run(
        [
            sys.executable,
            "-W",
            "default::DeprecationWarning",
            "-m",
            "corral.daemon.rollout.llm.reference_server",
            "--help",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and "--policy" in run.stdout
    assert "moved to corral.rollout.reference.server" in run.stderr


def test_names_that_never_existed_are_not_found_and_do_not_warn() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("corral.daemon.rollout.no_such_module")
