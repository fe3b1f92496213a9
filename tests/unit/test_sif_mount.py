"""Finding a SIF file's root partition (daemon/backends/sif_mount.py), and moving a fork's files to
a child's block of host ids (singularity.shift_ids)."""

from __future__ import annotations

import os
import stat
import struct

import pytest

from corral.daemon.backends.singularity.backend import shift_ids
from corral.daemon.backends.singularity.sif_mount import (
    DATA_PARTITION,
    DESCRIPTOR,
    DESCRIPTOR_SIZE,
    HEADER,
    SIF_MAGIC,
    squashfs_partition,
)
from corral.sdk.errors import FailedPrecondition


def _sif(path, partitions: list[tuple[int, int, int, int]]) -> None:
    """A SIF file with one descriptor per (datatype, fstype, parttype, offset) (size 4096 each)."""
    table = HEADER.size
    header = HEADER.pack(
        b"#!/usr/bin/env run-singularity\n\0",
        SIF_MAGIC,
        b"01\0",
        b"02\0",
        bytes(16),
        0,
        0,
        0,
        len(partitions),
        table,
        len(partitions) * DESCRIPTOR_SIZE,
        0,
        0,
    )
    descriptors = b""
    for n, (kind, fstype, parttype, offset) in enumerate(partitions):
        entry = DESCRIPTOR.pack(kind, True, n + 1, 1, 0, offset, 4096, 4096, 0, 0, 0, 0)
        extra = struct.pack("<ii3s", fstype, parttype, b"02\0")
        descriptors += entry + bytes(128) + extra + bytes(384 - len(extra))
    path.write_bytes(header + descriptors)


def test_the_primary_squashfs_partition_is_found(tmp_path):
    sif = tmp_path / "image.sif"
    _sif(sif, [(0x4001, 0, 0, 4000), (DATA_PARTITION, 1, 2, 36864)])
    assert squashfs_partition(str(sif)) == (36864, 4096)


@pytest.mark.parametrize(
    ("partitions", "message"),
    [([(0x4001, 0, 0, 4000)], "no root filesystem partition"), ([(DATA_PARTITION, 2, 2, 8192)], "only a squashfs")],
)
def test_a_sif_without_a_squashfs_root_is_refused(tmp_path, partitions, message):
    sif = tmp_path / "image.sif"
    _sif(sif, partitions)
    with pytest.raises(FailedPrecondition, match=message):
        squashfs_partition(str(sif))


def test_a_file_that_is_no_sif_is_refused(tmp_path):
    (tmp_path / "x").write_bytes(b"not a sif" * 100)
    with pytest.raises(FailedPrecondition, match="not a SIF file"):
        squashfs_partition(str(tmp_path / "x"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_shift_ids_moves_owners_between_blocks_and_keeps_setuid_bits(tmp_path):
    old, new = 7_000_000, 7_065_536
    top = tmp_path / "upper"
    (top / "d").mkdir(parents=True)
    (top / "d" / "f").write_text("x")
    (top / "suid").write_text("x")
    (top / "link").symlink_to("d/f")
    (top / "foreign").write_text("x")
    for path, ids in ((top, 0), (top / "d", 1000), (top / "d" / "f", 1000), (top / "suid", 0), (top / "link", 5)):
        os.lchown(path, old + ids, old + ids)
    (top / "suid").chmod(0o4755)
    os.chown(top / "foreign", 12, 12)
    shift_ids(top, old, new)
    owners = {
        p.name: (os.lstat(p).st_uid, os.lstat(p).st_gid)
        for p in (top, top / "d", top / "d" / "f", top / "suid", top / "link")
    }
    assert owners == {
        "upper": (new, new),
        "d": (new + 1000,) * 2,
        "f": (new + 1000,) * 2,
        "suid": (new, new),
        "link": (new + 5,) * 2,
    }
    assert stat.S_IMODE((top / "suid").stat().st_mode) == 0o4755
    assert (os.stat(top / "foreign").st_uid, os.stat(top / "foreign").st_gid) == (12, 12)
