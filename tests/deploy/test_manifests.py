"""The deployment files under deploy/, each checked by a tool rather than by eye: HAProxy's own
check (`haproxy -c`) on every configuration, kubernetes-validate (strict, against its newest
schema) on the Kubernetes manifests, and the compose file's shape; and each HAProxy configuration
is exactly what linstream.cluster.haproxy_config renders, so the shipped files and `serve
--replicas` route alike."""
from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from linstream.cluster import _which, haproxy_config
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
COMPOSE_SERVERS = [(f"linstream-{i}", f"linstream-{i}:8000") for i in range(3)]
K8S_SERVERS = [(f"linstream-{i}", f"linstream-{i}.linstream-replicas:8000") for i in range(8)]


def _needs(what: str, present: bool):
    if not present:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide {what}")
        pytest.skip(f"needs {what}")


def _k8s(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()))


def _haproxy_configs(tmp_path) -> dict[str, str]:
    k8s = next(d for d in _k8s("haproxy.yaml") if d["kind"] == "ConfigMap")["data"]["haproxy.cfg"]
    return {"compose": (DEPLOY / "haproxy" / "linstream.cfg").read_text(), "k8s": k8s,
            "local": haproxy_config([("r0", "127.0.0.1:8001"), ("r1", "127.0.0.1:8002")], "127.0.0.1:8000")}


def test_the_shipped_haproxy_configurations_are_the_rendered_ones(tmp_path):
    got = _haproxy_configs(tmp_path)
    assert got["compose"] == haproxy_config(COMPOSE_SERVERS, ":8080", dns=True)
    assert got["k8s"] == haproxy_config(K8S_SERVERS, ":8080", dns=True)


def test_haproxy_accepts_every_configuration(tmp_path):
    exe = _which("haproxy")
    _needs("haproxy", exe is not None)
    for name, cfg in _haproxy_configs(tmp_path).items():
        path = tmp_path / f"{name}.cfg"
        path.write_text(cfg)
        r = subprocess.run([exe, "-c", "-f", str(path)], capture_output=True, text=True)
        assert r.returncode == 0 and "Configuration file is valid" in r.stdout + r.stderr, (name, r.stderr)


def test_the_kubernetes_manifests_validate_against_the_schema():
    try:
        import kubernetes_validate
    except ImportError:
        kubernetes_validate = None
    _needs("kubernetes-validate", kubernetes_validate is not None)
    kinds = set()
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
            kinds.add((doc["kind"], doc["metadata"]["name"]))
    assert {("StatefulSet", "linstream"), ("Service", "linstream-replicas"), ("StatefulSet", "linstream-redis"),
            ("Service", "linstream-redis"), ("ConfigMap", "linstream-haproxy"), ("Deployment", "linstream-haproxy"),
            ("Service", "linstream")} <= kinds


def test_the_replicas_probe_readiness_and_liveness_on_the_health_routes():
    pod = next(d for d in _k8s("linstream.yaml") if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 while draining
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"  # 200 while draining
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["LINSTREAM_STORE"].startswith("redis://linstream-redis:")
    assert float(env["LINSTREAM_DRAIN_NOTICE_S"]) > 0
    assert set(c["resources"]["requests"]) == {"cpu", "memory"}
    # every pod the StatefulSet may run has a slot in HAProxy's configuration
    spec = next(d for d in _k8s("linstream.yaml") if d["kind"] == "StatefulSet")["spec"]
    assert spec["replicas"] <= len(K8S_SERVERS)


def test_the_compose_file_wires_three_replicas_redis_and_haproxy():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "haproxy", *(n for n, _ in COMPOSE_SERVERS)} <= set(services)
    for name, addr in COMPOSE_SERVERS:  # HAProxy's servers are these services, on the port they serve
        s = services[name]
        assert s["environment"]["LINSTREAM_STORE"] == "redis://redis:6379/0"
        assert s["environment"]["LINSTREAM_REPLICA_URL"] == f"http://{addr}"
        assert s["command"][-1] == addr.split(":")[1]
    mount = services["haproxy"]["volumes"][0].split(":")
    assert (DEPLOY / mount[0]).resolve() == (DEPLOY / "haproxy" / "linstream.cfg").resolve()
    assert mount[1] == "/usr/local/etc/haproxy/haproxy.cfg"
