"""daemon/users.py: the user a sandbox's programs run as, named by the caller and resolved against
the image's /etc/passwd."""

from __future__ import annotations

import pytest

from corral.daemon.users import INSIDE_ID_COUNT, ROOT, SandboxUser, check_user_spec, resolve_user
from corral.sdk.errors import FailedPrecondition, InvalidArgument

PASSWD = """root:x:0:0:root:/root:/bin/bash
# a comment
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
alice:x:1000:1001:Alice:/home/alice:/bin/bash
nohome:x:1002:1002:::/bin/sh
huge:x:70000:70000::/:/bin/sh
"""


def test_names_and_ids_resolve_against_the_images_passwd() -> None:
    assert resolve_user("root", PASSWD) == ROOT
    assert resolve_user("alice", PASSWD) == SandboxUser(1000, 1001, "alice", "/home/alice")
    assert resolve_user("1000", PASSWD) == SandboxUser(1000, 1001, "alice", "/home/alice")
    assert resolve_user("1000:5", PASSWD) == SandboxUser(1000, 5, "alice", "/home/alice")
    assert resolve_user("4242", PASSWD) == SandboxUser(4242, 4242, "", "/")  # no entry needed for a uid
    assert resolve_user("nohome", PASSWD).home == "/"
    assert resolve_user("root", "") == ROOT  # an image without /etc/passwd still has root


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("bob", FailedPrecondition),
        ("huge", FailedPrecondition),  # ids outside the range every sandbox has mapped
        (str(INSIDE_ID_COUNT), InvalidArgument),
        ("1:99999", InvalidArgument),
        ("a b", InvalidArgument),
        ("-rf", InvalidArgument),
        ("x" * 65, InvalidArgument),
        ("root\0", InvalidArgument),
    ],
)
def test_bad_users_are_refused_with_a_definite_error(spec: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        resolve_user(spec, PASSWD)


def test_the_default_user_is_the_empty_spec() -> None:
    assert check_user_spec("") == ""
