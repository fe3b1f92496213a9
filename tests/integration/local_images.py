"""Small root filesystem directories for local-backend tests, made from the host's own programs
(each with the shared libraries it needs, at the same paths), so that no download is needed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

PROGRAMS = (
    *("sh", "env", "cat", "id", "ls", "touch", "rm", "chmod", "chown", "mkdir", "echo", "stat", "tail", "grep"),
    *("setpriv", "mount", "umount", "mknod", "dd"),
)


def _libraries(program: str) -> list[str]:
    out = subprocess.run(["ldd", program], capture_output=True, text=True).stdout
    return re.findall(r"(/\S+) \(0x", out)


def _copy(src: str, image: Path) -> None:
    dst = image / src.lstrip("/")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(src), dst)


def make_rootfs(image: Path, programs: tuple[str, ...] = PROGRAMS) -> Path:
    """A root filesystem at `image` (made, mode 0755, owned by root as an unpacked image is) with
    `programs` in /bin, their libraries, /etc/passwd and /etc/group naming root and nobody, and
    the usual top-level directories."""
    image.mkdir(mode=0o755)
    for sub in ("bin", "etc", "root", "tmp", "proc", "dev", "run", "usr"):
        (image / sub).mkdir(mode=0o755)
    (image / "root").chmod(0o700)
    (image / "tmp").chmod(0o1777)
    for name in programs:
        path = shutil.which(name)
        assert path, f"the host has no {name} to build a test image from"
        shutil.copy2(os.path.realpath(path), image / "bin" / name)
        for lib in _libraries(path):
            _copy(lib, image)
    (image / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n")
    (image / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    return image
