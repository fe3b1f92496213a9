"""Unit tests of small daemon pieces: config precedence, output capping, command validation."""

from __future__ import annotations

import pytest

from corral.daemon import rules
from corral.daemon.backends.docker.backend import parse_ulimit
from corral.daemon.config import ConfigError, ExecConfig, load_config
from corral.daemon.output import HeadTailBuffer
from corral.sdk.errors import InvalidArgument


def test_config_precedence(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[daemon]\nsocket = "/from/file.sock"\nstate_dir = "/file/state"\n[limits]\npids = 77\n')
    c = load_config(toml, environ={"CORRAL_SOCKET": "/from/env.sock"})
    assert c.daemon.socket == "/from/env.sock" and c.daemon.state_dir == "/file/state" and c.limits.pids == 77
    c = load_config(toml, socket="/from/flag.sock", environ={"CORRAL_SOCKET": "/from/env.sock"})
    assert c.daemon.socket == "/from/flag.sock"


def test_config_rejects_unknown_keys_and_bad_types(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[daemon]\nsokcet = 1\n")
    with pytest.raises(ConfigError, match="daemon.sokcet"):
        load_config(toml, environ={})
    toml.write_text('[limits]\npids = "many"\n')
    with pytest.raises(ConfigError, match="limits.pids"):
        load_config(toml, environ={})


def test_docker_ulimits_parse_and_bad_entries_are_named(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[docker]\nulimits = ["nofile=1024:4096", "nproc=512"]\n')
    assert load_config(toml, environ={}).backend("docker").ulimits == ["nofile=1024:4096", "nproc=512"]
    assert [parse_ulimit(e) for e in ("nofile=1024:4096", "nproc=512")] == [("nofile", 1024, 4096), ("nproc", 512, 512)]
    for bad in ("nofile", "nofile=", "=5", "nofile=many", "nofile=10:5"):
        toml.write_text(f'[docker]\nulimits = ["{bad}"]\n')
        with pytest.raises(ConfigError, match="docker.ulimits"):
            load_config(toml, environ={})
    toml.write_text('[docker]\nulimits = "nofile=5"\n')
    with pytest.raises(ConfigError, match="docker.ulimits must be list"):
        load_config(toml, environ={})


def test_tcp_requires_token():
    with pytest.raises(ConfigError, match="token"):
        load_config(tcp_listen="127.0.0.1:7700", environ={})
    assert load_config(tcp_listen="127.0.0.1:7700", environ={"CORRAL_TOKEN": "t"}).token == "t"


def test_example_config_parses():
    from pathlib import Path

    load_config(Path(__file__).parents[2] / "deploy" / "corral.toml", environ={})


def test_head_tail_buffer():
    buf = HeadTailBuffer(10)
    for chunk in (b"0123", b"4567", b"89ab", b"cdef"):
        buf.write(chunk)
    assert buf.getvalue() == b"01234bcdef" and buf.truncated and buf.total == 16
    small = HeadTailBuffer(10)
    small.write(b"abc")
    assert small.getvalue() == b"abc" and not small.truncated


def _spec(**kw):
    base = dict(argv=["true"], shell=None, stdin=None, env={}, cwd="", timeout_ms=0, output_limit_bytes=0)
    base.update(kw)
    return rules.command(ExecConfig(), rules.CommandRequest(**base))


def test_command_validation():
    assert _spec().timeout_s == ExecConfig().default_timeout_s
    assert _spec(cwd="rel/dir").cwd == "rel/dir"  # resolved against the workdir by the manager
    for bad in (
        dict(argv=[]),
        dict(argv=None),
        dict(cwd="a\0b"),
        dict(env={"A=B": "x"}),
        dict(timeout_ms=10**12),
        dict(output_limit_bytes=1 << 40),
        dict(argv=["a\0b"]),
    ):
        with pytest.raises(InvalidArgument):
            _spec(**bad)


def test_named_tcp_tokens_are_read_from_their_file_and_checked(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# who token\nalice s1\n\n  bob   s2  \n")
    config_file = tmp_path / "c.toml"
    config_file.write_text(f'[daemon.tcp]\nlisten = "127.0.0.1:7700"\ntokens_file = "{tokens}"\nadmins = ["bob"]\n')
    config = load_config(config_file, environ={})
    assert config.tcp_tokens == {"s1": "alice", "s2": "bob"} and config.token == ""
    for text, complaint in [
        ("alice\n", "expected `NAME TOKEN`"),
        ("alice s1 extra\n", "expected `NAME TOKEN`"),
        ("al/ice s1\n", "expected `NAME TOKEN`"),
        ("alice s1\nbob s1\n", "used twice"),
        ("alice s1\nalice s2\n", "used twice"),
        ("carol s3\n", "admins names no token of daemon.tcp.tokens_file: bob"),
    ]:
        tokens.write_text(text)
        with pytest.raises(ConfigError, match=complaint):
            load_config(config_file, environ={})
    tokens.write_text("bob s2\n")
    with pytest.raises(ConfigError, match="also one of"):
        load_config(config_file, environ={"CORRAL_TOKEN": "s2"})
    config_file.write_text('[daemon.tcp]\ntokens_file = "/no/such/file"\n')
    with pytest.raises(ConfigError, match="cannot read tokens file /no/such/file"):
        load_config(config_file, environ={})
