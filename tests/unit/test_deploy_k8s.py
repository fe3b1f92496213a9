"""deploy/k8s against the Kubernetes schemas (kubernetes-validate, offline: it ships them) and
against the daemon it deploys: the ConfigMap's corral.toml loads with the daemon's own loader and
says what deploy/corral.toml says but for the keys this deployment sets; the probes are `corral
health` commands the CLI runs, on the socket that configuration names; the ports, mounts and the
Service match the configuration and the pod."""

from __future__ import annotations

import copy
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from corral.cli.daemon_commands import health_command, serve_command
from corral.cli.main import build_parser
from corral.daemon.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ["base", "with-engines", "rootless"]
# The oldest Kubernetes the manifests are for (appArmorProfile: 1.30) and the newest schemas shipped.
VERSIONS = ["1.30", kubernetes_validate.latest_version()]
TOKEN_PATH = "/var/run/secrets/corral/token"
# The keys whose values the Kubernetes configuration sets apart from deploy/corral.toml.
K8S_SETTINGS = {
    ("daemon", "tcp", "listen"): "0.0.0.0:7700",
    ("daemon", "tcp", "token_file"): TOKEN_PATH,
    ("metrics", "listen"): "0.0.0.0:9464",
    ("metrics", "token_file"): TOKEN_PATH,
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def base_resources() -> list[dict[str, Any]]:
    kustomization = documents(K8S / "base" / "kustomization.yaml")[0]
    return [doc for name in kustomization["resources"] for doc in documents(K8S / "base" / name)]


def one(resources: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [r for r in resources if r["kind"] == kind]
    return found


def merge_map(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A map merged as a strategic-merge patch merges it: maps recursively, a null deletes the
    key, anything else replaces it."""
    merged = dict(base)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = merge_map(base[key], value)
        else:
            merged[key] = value
    return merged


def merge_by(base: list[dict[str, Any]], patch: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """A list merged as a strategic-merge patch merges it, in kustomize's order: the patch's
    entries first (each over the base's entry of the same `key`), then the base's others; an
    entry with `$patch: delete` removes the base's."""
    patched = {entry[key] for entry in patch}
    merged = [
        merge_map(next((b for b in base if b[key] == entry[key]), {}), entry)
        for entry in patch
        if entry.get("$patch") != "delete"
    ]
    return merged + [entry for entry in base if entry[key] not in patched]


def with_patch(daemonset: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """The DaemonSet with a strategic-merge patch of the kind the overlays hold applied: fields
    of the pod's spec merged, volumes merged by name, each container's fields merged and its
    volumeMounts by mountPath."""
    merged = copy.deepcopy(daemonset)
    spec, patch_spec = merged["spec"]["template"]["spec"], patch["spec"]["template"]["spec"]
    others = {key: value for key, value in patch_spec.items() if key not in ("containers", "volumes")}
    spec.update(merge_map(spec, others))
    for patch_container in patch_spec.get("containers", []):
        (container,) = [c for c in spec["containers"] if c["name"] == patch_container["name"]]
        mounts = merge_by(container["volumeMounts"], patch_container.get("volumeMounts", []), "mountPath")
        fields = {key: value for key, value in patch_container.items() if key not in ("name", "volumeMounts")}
        container.update(merge_map(container, fields))
        container["volumeMounts"] = mounts
    spec["volumes"] = merge_by(spec["volumes"], patch_spec.get("volumes", []), "name")
    return merged


def overlay_resources(overlay: str) -> list[dict[str, Any]]:
    resources = base_resources()
    if overlay == "base":
        return resources
    kustomization = documents(K8S / overlay / "kustomization.yaml")[0]
    assert kustomization["resources"] == ["../base"]
    for entry in kustomization["patches"]:
        (patch,) = documents(K8S / overlay / entry["path"])
        index = resources.index(one(resources, patch["kind"]))
        resources[index] = with_patch(resources[index], patch)
    return resources


def container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (found,) = daemonset["spec"]["template"]["spec"]["containers"]
    return found


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_is_valid_kubernetes(overlay: str, version: str) -> None:
    resources = overlay_resources(overlay)
    assert {r["kind"] for r in resources} == {"Namespace", "ConfigMap", "DaemonSet", "Service"}
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_builds_what_the_schemas_accept(overlay: str) -> None:
    built = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    resources = [doc for doc in yaml.safe_load_all(built.stdout) if doc]
    for resource in resources:
        kubernetes_validate.validate(resource, VERSIONS[-1], strict=True)
        assert resource["kind"] == "Namespace" or resource["metadata"]["namespace"] == "corral"
    # The patch applied here as kustomize applies it.
    assert one(resources, "DaemonSet")["spec"] == one(overlay_resources(overlay), "DaemonSet")["spec"]


def test_the_validator_refuses_a_broken_daemonset() -> None:
    broken = copy.deepcopy(one(base_resources(), "DaemonSet"))
    pod = broken["spec"]["template"]["spec"]
    pod["container"] = pod.pop("containers")  # a typo'd field: the strict schemas know no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)
    broken = copy.deepcopy(one(base_resources(), "DaemonSet"))
    container(broken)["livenessProbe"]["periodSeconds"] = "20s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def configmap_toml() -> str:
    return one(base_resources(), "ConfigMap")["data"]["corral.toml"]


def flatten(table: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat: dict[tuple[str, ...], Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def test_the_configmap_is_deploy_corral_toml_with_the_kubernetes_settings() -> None:
    ours = flatten(tomllib.loads(configmap_toml()))
    reference = flatten(tomllib.loads((DEPLOY / "corral.toml").read_text()))
    for key, value in ours.items():
        assert key in reference, f"{'.'.join(key)} is not a key of deploy/corral.toml"
        assert value == K8S_SETTINGS.get(key, reference[key]), ".".join(key)
    assert set(K8S_SETTINGS) <= set(ours)


def test_the_daemon_loads_the_configmap(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token\n")
    path = tmp_path / "corral.toml"
    path.write_text(configmap_toml().replace(TOKEN_PATH, str(token)))
    config = load_config(path, environ={})
    assert config.token == config.metrics_token == "a-token"
    assert config.daemon.tcp.listen == "0.0.0.0:7700" and config.metrics.listen == "0.0.0.0:9464"


def test_the_pod_runs_the_daemon_it_is_configured_for() -> None:
    resources = base_resources()
    daemonset, service = one(resources, "DaemonSet"), one(resources, "Service")
    pod = daemonset["spec"]["template"]
    main = container(daemonset)
    config = tomllib.loads(configmap_toml())
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}

    serve = build_parser().parse_args(main["command"][1:])
    assert main["command"][0] == "corral" and serve.func is serve_command
    assert Path(serve.config) == Path(mounts["config"]) / "corral.toml"
    assert volumes["config"]["configMap"]["name"] == one(resources, "ConfigMap")["metadata"]["name"]
    assert Path(TOKEN_PATH) == Path(mounts["token"]) / "token"

    # The socket and state directory are the node's, at the same paths.
    socket_dir = str(Path(config["daemon"]["socket"]).parent)
    for name, path in (("run", socket_dir), ("state", config["daemon"]["state_dir"])):
        assert mounts[name] == path and volumes[name]["hostPath"]["path"] == path
    # Loop devices and /tmp (the local backend's idmapped-overlay probe) are on the node, not the
    # container's overlayfs root.
    assert mounts["dev"] == volumes["dev"]["hostPath"]["path"] == "/dev"
    assert mounts["tmp"] == "/tmp" and "emptyDir" in volumes["tmp"]

    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = main[kind]["exec"]["command"]
        probe = build_parser().parse_args(command[1:])
        assert command[0] == "corral" and probe.func is health_command, kind
        assert probe.address == f"unix://{config['daemon']['socket']}", kind
        assert probe.timeout < main[kind]["timeoutSeconds"], kind

    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports["grpc"] == int(config["daemon"]["tcp"]["listen"].rsplit(":", 1)[1])
    assert ports["metrics"] == int(config["metrics"]["listen"].rsplit(":", 1)[1])
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert service["spec"]["clusterIP"] == "None"
    labels = pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert main["securityContext"]["privileged"] and pod["spec"]["hostUsers"]
    assert "limits" not in main["resources"]  # sandboxes live in the pod's cgroup: a limit would cap them all


def test_the_image_holds_every_package_of_the_project() -> None:
    """deploy/k8s/Dockerfile copies the source folders one by one: each folder pyproject.toml
    installs a package from must be among them, and the files the install reads."""
    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    folders = {path.split("/")[0] for path in project["tool"]["setuptools"]["package-dir"].values()}
    lines = (K8S / "Dockerfile").read_text().splitlines()
    sources = {name for line in lines if line.startswith("COPY ") for name in line.split()[1:-1]}
    missing = (folders | {"pyproject.toml", "constraints.txt", "README.md"}) - sources
    assert not missing, f"not copied into the image: {sorted(missing)}"


def test_with_engines_the_daemon_sees_the_engines_containers_and_they_its_mounts() -> None:
    daemonset = one(overlay_resources("with-engines"), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in container(daemonset)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert pod["hostPID"]  # /proc/<pid> of a container's init, as the engine names it
    assert mounts["/var/lib/corral"]["mountPropagation"] == "Bidirectional"  # staged bind mounts
    assert mounts["/var/lib/corral"]["name"] == "state" and "hostPath" in volumes["state"]
    for path in ("/var/run/docker.sock", "/run/podman/podman.sock"):
        assert volumes[mounts[path]["name"]]["hostPath"] == {"path": path, "type": "Socket"}
    assert len(mounts) == len(container(daemonset)["volumeMounts"])  # merged, not doubled


def test_the_rootless_pod_asks_for_no_privilege() -> None:
    """deploy/k8s/rootless: not privileged, no capability, no privilege escalation, not root, a
    user namespace of its own, nothing of the node's mounted but what base shares with every pod
    (the config and token), and the daemon it runs is the base's (same command, probes, ports)."""
    daemonset = one(overlay_resources("rootless"), "DaemonSet")
    pod, main = daemonset["spec"]["template"]["spec"], container(daemonset)
    security = main["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and security["procMount"] == "Unmasked"
    assert pod["hostUsers"] is False and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert [v["name"] for v in pod["volumes"] if "hostPath" in v] == []
    assert "/dev" not in {m["mountPath"] for m in main["volumeMounts"]}
    assert {v["name"] for v in pod["volumes"]} == {m["name"] for m in main["volumeMounts"]}
    base = container(one(base_resources(), "DaemonSet"))
    for field in ("command", "ports", "startupProbe", "readinessProbe", "livenessProbe"):
        assert main[field] == base[field], field
