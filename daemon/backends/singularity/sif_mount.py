"""The root filesystem of a SIF file, as a directory: its primary squashfs partition, loop-mounted
read-only by the daemon (the kernel's squashfs, no FUSE process), for the Apptainer backend to
show through a sandbox's ids (backend.py).

A SIF file (sylabs/sif, format version 01) is a 128-byte global header, a table of fixed-size
descriptors, then the data objects they point at. The header and descriptors are little-endian and
packed; the partition descriptor's "extra" field starts with its filesystem type and partition
type. Only what finding the partition needs is read here.
"""

from __future__ import annotations

import struct
from pathlib import Path

from corral.sdk.errors import FailedPrecondition

from ...diskcap import run_step

SIF_MAGIC = b"SIF_MAGIC\0"
HEADER = struct.Struct("<32s10s3s3s16sqqqqqqqq")  # launch, magic, version, arch, uuid, then 8 int64
# datatype, used, id, group id, linked id, offset, size, size with padding, ctime, mtime, uid, gid.
DESCRIPTOR = struct.Struct("<i?IIIqqqqqqq")
DESCRIPTOR_SIZE = DESCRIPTOR.size + 128 + 384  # + name, + extra
DATA_PARTITION = 0x4004
FS_SQUASHFS, PART_PRIMARY_SYSTEM = 1, 2
MAX_DESCRIPTORS = 4096  # far more than any SIF holds; bounds what a damaged file makes us read


def squashfs_partition(path: str) -> tuple[int, int]:
    """The offset and size of the SIF file's primary system partition (squashfs).
    FAILED_PRECONDITION when the file is not a SIF or has none."""
    with open(path, "rb") as sif:
        header = sif.read(HEADER.size)
        if len(header) < HEADER.size or HEADER.unpack(header)[1] != SIF_MAGIC:
            raise FailedPrecondition(f"image {path} is not a SIF file nor a directory")
        fields = HEADER.unpack(header)
        total, table = fields[8], fields[9]
        if not 0 < total <= MAX_DESCRIPTORS:
            raise FailedPrecondition(f"SIF file {path} has a damaged descriptor table")
        sif.seek(table)
        data = sif.read(total * DESCRIPTOR_SIZE)
    for n in range(len(data) // DESCRIPTOR_SIZE):
        entry = data[n * DESCRIPTOR_SIZE : (n + 1) * DESCRIPTOR_SIZE]
        kind, used, _, _, _, offset, size, *_ = DESCRIPTOR.unpack_from(entry)
        fstype, parttype = struct.unpack_from("<ii", entry, DESCRIPTOR.size + 128)
        if used and kind == DATA_PARTITION and parttype == PART_PRIMARY_SYSTEM:
            if fstype != FS_SQUASHFS:
                raise FailedPrecondition(f"SIF file {path}: only a squashfs root partition can be run here")
            return offset, size
    raise FailedPrecondition(f"SIF file {path} has no root filesystem partition")


def mount_sif(path: str, target: Path) -> None:
    """Loop-mounts the SIF file's root partition read-only (nosuid, nodev) at the empty directory
    `target` on a loop device of its own (mount's `-o loop` refuses a file another loop device
    shows at an overlapping offset, as Apptainer's own may), which goes with the last reference
    to the mount (detached while mounted: autoclear)."""
    offset, size = squashfs_partition(path)
    what = f"SIF file {path}"
    found = ["losetup", "--find", "--show", "--read-only", f"--offset={offset}", f"--sizelimit={size}", path]
    device = run_step(found, "attach a loop device to", what)
    try:
        run_step(["mount", "-t", "squashfs", "-o", "ro,nosuid,nodev", device, str(target)], "mount", what)
    finally:
        run_step(["losetup", "--detach", device], "detach the loop device of", what)
