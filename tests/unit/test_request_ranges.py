"""Every numeric request field is checked against its range before anything uses it: a wire
integer can be anything up to 2^64-1, and a value out of range is INVALID_ARGUMENT naming the
field and the range (never a sandbox half made, a kernel write refused, or a reply that cannot be
encoded)."""

from __future__ import annotations

import pytest

from corral.daemon import rules
from corral.daemon.backends.base import Limits
from corral.daemon.config import ExecConfig, LimitsConfig
from corral.sdk.errors import InvalidArgument

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
EXEC = ExecConfig()
DEFAULTS = LimitsConfig(idle_timeout_s=120.0, disk_bytes=0)  # (disk: test_sandbox_disk_bytes)


@pytest.mark.parametrize(
    ("limits", "field", "allowed"),
    [
        (Limits(memory_bytes=U64_MAX), "limits.memory_bytes", f"{4 << 20}..{1 << 50} bytes"),
        (Limits(memory_bytes=1024), "limits.memory_bytes", f"{4 << 20}..{1 << 50} bytes"),
        (Limits(pids=U32_MAX), "limits.pids", f"1..{4 << 20} processes"),
        (Limits(pids=(4 << 20) + 1), "limits.pids", f"1..{4 << 20} processes"),
        (Limits(cpu_millicores=U32_MAX), "limits.cpu_millicores", "10..1024000 millicores"),
        (Limits(cpu_millicores=5), "limits.cpu_millicores", "10..1024000 millicores"),
    ],
)
def test_sandbox_limits_out_of_range_name_the_field_and_range(limits, field, allowed) -> None:
    with pytest.raises(InvalidArgument) as caught:
        rules.sandbox_limits(limits, DEFAULTS)
    assert str(caught.value).startswith(f"{field} must be {allowed}, or 0 (the default); got ")


def test_sandbox_limits_in_range_and_defaults() -> None:
    top = Limits(memory_bytes=1 << 50, pids=4 << 20, cpu_millicores=1024000)
    assert rules.sandbox_limits(top, DEFAULTS) == top
    low = Limits(memory_bytes=4 << 20, pids=1, cpu_millicores=10)
    assert rules.sandbox_limits(low, DEFAULTS) == low
    assert rules.sandbox_limits(Limits(), DEFAULTS) == Limits(DEFAULTS.memory_bytes, DEFAULTS.pids, 0)


@pytest.mark.parametrize("value", [U64_MAX, 2**63, (1 << 44) + 1, (16 << 20) - 1, 1])
def test_sandbox_disk_bytes_out_of_range(value) -> None:
    with pytest.raises(InvalidArgument, match=rf"^limits\.disk_bytes must be {16 << 20}\.\.{1 << 44} bytes, or 0"):
        rules.sandbox_limits(Limits(disk_bytes=value), DEFAULTS)


def test_sandbox_disk_bytes_in_range_and_default() -> None:
    for value in (16 << 20, 1 << 44):
        assert rules.sandbox_limits(Limits(disk_bytes=value), DEFAULTS).disk_bytes == value
    assert rules.sandbox_limits(Limits(), LimitsConfig()).disk_bytes == 4 << 30


@pytest.mark.parametrize("value", [U64_MAX, 2**63, rules.MAX_IDLE_TIMEOUT_MS + 1])
def test_sandbox_idle_timeout_out_of_range(value) -> None:
    with pytest.raises(InvalidArgument, match=rf"^idle_timeout_ms must be 1\.\.2592000000 ms .*; got {value}$"):
        rules.sandbox_idle_timeout_s(DEFAULTS, value)


def test_sandbox_idle_timeout_in_range() -> None:
    assert rules.sandbox_idle_timeout_s(DEFAULTS, 0) == 120.0
    assert rules.sandbox_idle_timeout_s(DEFAULTS, 1) == 0.001
    assert rules.sandbox_idle_timeout_s(DEFAULTS, rules.MAX_IDLE_TIMEOUT_MS) == 30 * 24 * 3600


@pytest.mark.parametrize(
    ("check", "field"),
    [
        (lambda v: rules.timeout_s(EXEC, v), "timeout_ms"),
        (lambda v: rules.idle_timeout_s(EXEC, v), "idle_timeout_ms"),
        (lambda v: rules.output_limit(EXEC, v), "output_limit_bytes"),
        (rules.keepalive_s, "keepalive_interval_ms"),
    ],
)
@pytest.mark.parametrize("value", [U64_MAX, 2**53 + 1])
def test_command_fields_out_of_range(check, field, value) -> None:
    with pytest.raises(InvalidArgument, match=rf"^{field} must be 1\.\.\d+ \w+, or 0 \(.*\); got {value}$"):
        check(value)


def test_command_fields_at_their_bounds() -> None:
    assert rules.timeout_s(EXEC, 0) == EXEC.default_timeout_s
    assert rules.timeout_s(EXEC, int(EXEC.max_timeout_s * 1000)) == EXEC.max_timeout_s
    assert rules.idle_timeout_s(EXEC, 0) == 0
    assert rules.output_limit(EXEC, 0) == EXEC.default_output_limit_bytes
    assert rules.output_limit(EXEC, EXEC.max_output_limit_bytes) == EXEC.max_output_limit_bytes
    assert rules.keepalive_s(0) == 0 and rules.keepalive_s(rules.MAX_KEEPALIVE_MS) == 3600
