"""The local backend's image references, recorded configurations, pruning order and tool errors
(daemon/backends/local_images.py), without root or tools: the integration tests unpack real
images (tests/integration/test_local_images.py)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from corral.daemon import doctor
from corral.daemon.backends.local import images as local_images
from corral.daemon.backends.local.images import ImageCache, ImageSource, image_config, parse_reference
from corral.daemon.config import load_config
from corral.sdk.errors import FailedPrecondition, InvalidArgument


@pytest.mark.parametrize(
    ("image", "source", "skopeo"),
    [
        ("host", None, ""),
        ("/srv/images/debian", None, ""),
        (
            "docker-archive:/srv/a.tar",
            ImageSource("docker-archive:/srv/a.tar", "docker-archive", "/srv/a.tar", ""),
            "docker-archive:/srv/a.tar",
        ),
        (
            "docker-archive:/srv//a.tar:repo/name:tag",
            ImageSource("docker-archive:/srv//a.tar:repo/name:tag", "docker-archive", "/srv/a.tar", "repo/name:tag"),
            "docker-archive:/srv/a.tar:repo/name:tag",
        ),
        ("oci:/srv/layout:v1", ImageSource("oci:/srv/layout:v1", "oci", "/srv/layout", "v1"), "oci:/srv/layout:v1"),
        ("oci-archive:/a.tar", ImageSource("oci-archive:/a.tar", "oci-archive", "/a.tar", ""), "oci-archive:/a.tar"),
        ("docker:python:3.12", ImageSource("docker:python:3.12", "docker-daemon", "", "python:3.12"), ""),
        ("docker://debian", ImageSource("docker://debian", "docker-daemon", "", "debian"), ""),
    ],
)
def test_references_parse_as_skopeo_names_them(image, source, skopeo):
    assert parse_reference(image) == source
    if source and skopeo:
        assert source.skopeo_name() == skopeo
    if source and source.transport == "docker-daemon":
        # An engine's image is exported by the ID that was inspected.
        assert source.skopeo_name("sha256:ab") == "docker-daemon:sha256:ab"


@pytest.mark.parametrize("image", ["docker-archive:relative.tar", "oci:", "docker:", "docker://", "docker:a b"])
def test_malformed_references_are_invalid_arguments(image):
    with pytest.raises(InvalidArgument):
        parse_reference(image)


def test_image_config_is_read_from_beside_the_rootfs(tmp_path: Path):
    (tmp_path / "rootfs").mkdir()
    assert image_config(str(tmp_path / "rootfs")) is None
    config = {"config": {"User": "root", "Env": ["PATH=/usr/bin", "X=a=b", "junk"], "WorkingDir": "/testbed"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = image_config(str(tmp_path / "rootfs"))
    assert got is not None
    assert (got.user, got.env, got.workdir, got.entrypoint, got.cmd) == (
        "root",
        {"PATH": "/usr/bin", "X": "a=b"},
        "/testbed",
        (),
        (),
    )


def _image(cache: Path, name: str, size: int, used_at: int) -> None:
    (cache / name / "rootfs").mkdir(parents=True)
    (cache / name / "image.json").write_text(json.dumps({"size_bytes": size}))
    os.utime(cache / name, (used_at, used_at))


def test_pruning_removes_least_recently_used_images_no_sandbox_holds(tmp_path: Path):
    cache = tmp_path / "images"
    images = ImageCache(cache, limit_bytes=250, engine_address="")
    images._make_root()
    for name, used_at in (("sha256-old", 1000), ("sha256-held", 500), ("sha256-mid", 2000), ("sha256-new", 3000)):
        _image(cache, name, 100, used_at)
    hold = images.hold(str(cache / "sha256-held" / "rootfs"))
    assert hold is not None and images.hold(str(tmp_path / "elsewhere" / "rootfs")) is None
    asyncio.run(images.prune(keep=("sha256-new",)))
    # 400 bytes over a 250 limit: the oldest unheld images go until it fits (old, then mid).
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["sha256-held", "sha256-new"]
    # Released, the held image is the most recently used one: with room for one, it stays.
    hold.release()
    images.limit_bytes = 100
    asyncio.run(images.prune())
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["sha256-held"]
    # A hold on an image that pruning took is refused, saying why.
    with pytest.raises(FailedPrecondition, match="removed from the local image cache"):
        images.hold(str(cache / "sha256-new" / "rootfs"))


def test_a_missing_tool_names_its_package(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(local_images.shutil, "which", lambda *_a, **_k: None)
    with pytest.raises(FailedPrecondition, match=r"umoci is not installed.*apt-get install umoci"):
        asyncio.run(local_images._run_tool(["umoci", "raw", "unpack"], "cannot unpack", tmp_path))


def test_docker_references_without_an_engine_say_where_none_answers(tmp_path: Path):
    images = ImageCache(tmp_path / "images", 0, f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(FailedPrecondition, match=r"none answers at unix://.*no-engine\.sock \(local\.engine_socket\)"):
        asyncio.run(images.prepare(ImageSource("docker:debian", "docker-daemon", "", "debian")))


def test_doctor_says_whether_container_images_can_be_unpacked(tmp_path: Path, monkeypatch):
    assert local_images.image_tools(str(tmp_path)) == (False, "skopeo and umoci not installed")
    for tool in ("skopeo", "umoci"):
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    assert local_images.image_tools(str(tmp_path)) == (True, "skopeo and umoci installed")
    monkeypatch.setattr(doctor, "image_tools", lambda: (False, "umoci not installed"))
    host = doctor.host_section(load_config(environ={}), "default settings")
    i = host.index("  container images in local sandboxes: unavailable - umoci not installed")
    assert host[i + 1] == "    fix: apt-get install skopeo umoci"
