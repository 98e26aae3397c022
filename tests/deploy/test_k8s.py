"""deploy/k8s: every rendered manifest validates against the Kubernetes schemas (offline, with
kubernetes-validate), and the overlays wire what a deployment needs: Secrets, NetworkPolicies,
probes, resources, and no engine or Redis reachable from outside the cluster.

The overlays are rendered by the kustomize subset in kustomize.py, and, where kubectl exists, by
``kubectl kustomize`` too, which must agree.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kustomize import MERGE_KEYS, render

from engine.__main__ import build_parser as engine_parser
from gateway.config import load_config
from gateway.ratelimit import read_key_file

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests claim (autoscaling/v2, policy/v1)
SECRETS = {"engine-token": "token-for-tests", "redis-password": "password-for-tests", "api-keys": "sk-test\n"}


@pytest.fixture(scope="module")
def k8s_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with throwaway secret files (the repository holds none)."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns(*SECRETS))
    for name, value in SECRETS.items():
        (tree / "base" / "secrets" / name).write_text(value)
    return tree


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest, k8s_tree: Path) -> tuple[str, list[dict[str, Any]]]:
    overlay = request.param
    resources = render(k8s_tree / "overlays" / overlay)
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        out = subprocess.run([kubectl, "kustomize", str(k8s_tree / "overlays" / overlay)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert _normal([d for d in yaml.safe_load_all(out) if d]) == _normal(resources)
    return overlay, resources


def _normal(resources: list[dict[str, Any]]) -> list[Any]:
    """Order-free form: resources by kind and name, keyed lists by their key."""
    def norm(value: Any, field: str = "") -> Any:
        if isinstance(value, dict):
            return {k: norm(v, k) for k, v in value.items()}
        if isinstance(value, list):
            items = [norm(v) for v in value]
            if field not in MERGE_KEYS:
                return items
            return sorted(items, key=lambda item: str(item.get(MERGE_KEYS[field], item)))
        return value

    return sorted((norm(r) for r in resources), key=lambda r: (r["kind"], r["metadata"]["name"]))


def one(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def container(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (c,) = one(resources, kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def test_every_manifest_validates(rendered):
    _, resources = rendered
    assert len(resources) >= 15
    for resource in resources:
        try:
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{resource['kind']}/{resource['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_secrets_hold_the_credentials_and_workloads_take_them_from_there(rendered):
    _, resources = rendered
    secrets = {r["metadata"]["name"]: set(r["data"]) for r in resources if r["kind"] == "Secret"}
    assert secrets == {"kvgate-api-keys": {"api-keys"}, "kvgate-engine-token": {"token"},
                       "kvgate-redis": {"password"}}
    used = set()
    for workload in (r for r in resources if r["kind"] in ("Deployment", "StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["key"] in secrets[ref["name"]]
                    used.add(ref["name"])
                else:  # literal values carry no secret, only references to secret-fed variables
                    assert "password-for-tests" not in str(env) and "token-for-tests" not in str(env)
        used.update(v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v)
    assert used == set(secrets)


def test_network_policies_let_engines_hear_gateways_and_redis_hear_both(rendered):
    _, resources = rendered
    policies = {r["metadata"]["name"]: r["spec"] for r in resources if r["kind"] == "NetworkPolicy"}

    def component(selector: dict) -> str:
        return selector["matchLabels"].get("app.kubernetes.io/component", "*")

    deny = policies["kvgate-default-deny"]
    assert component(deny["podSelector"]) == "*" and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    allowed = {component(p["podSelector"]): p for p in policies.values() if "ingress" in p}
    sources = {name: {component(peer["podSelector"]) for rule in p["ingress"] for peer in rule["from"]}
               for name, p in allowed.items() if name != "gateway"}
    assert sources == {"engine": {"gateway"}, "redis": {"gateway", "engine"}}
    for name, port in (("engine", 8100), ("redis", 6379), ("gateway", 8000)):
        assert [p["port"] for rule in allowed[name]["ingress"] for p in rule["ports"]] == [port]


def test_probes_and_resources_on_every_container(rendered):
    overlay, resources = rendered
    for workload in (r for r in resources if r["kind"] in ("Deployment", "StatefulSet")):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            what = f"{workload['metadata']['name']}/{c['name']}"
            assert {"readinessProbe", "livenessProbe"} <= set(c), what
            assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"], what
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, what
    engine = container(resources, "Deployment", "kvgate-engine")
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    startup = engine["startupProbe"]
    assert startup["httpGet"]["path"] == "/health" and startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    gpus = engine["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if overlay == "gpu" else None)  # one pod per GPU
    pdb = one(resources, "PodDisruptionBudget", "kvgate-engine")["spec"]
    assert pdb["selector"]["matchLabels"]["app.kubernetes.io/component"] == "engine" and pdb["maxUnavailable"] == 1


def test_no_engine_or_redis_service_reaches_outside_the_cluster(rendered):
    _, resources = rendered
    services = {r["metadata"]["name"]: r["spec"] for r in resources if r["kind"] == "Service"}
    for name in ("kvgate-engine", "kvgate-redis"):
        assert services[name]["clusterIP"] == "None" and services[name].get("type", "ClusterIP") == "ClusterIP"
        assert "externalIPs" not in services[name]
    assert services["kvgate-gateway"]["type"] == "ClusterIP"  # clients come through the Ingress
    backends = [path["backend"]["service"]["name"] for r in resources if r["kind"] == "Ingress"
                for rule in r["spec"]["rules"] for path in rule["http"]["paths"]]
    assert backends == ["kvgate-gateway"]


def test_the_ingress_is_sse_safe_and_the_hpa_scales_gateways(rendered):
    _, resources = rendered
    annotations = one(resources, "Ingress", "kvgate")["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert annotations[prefix + "proxy-buffering"] == "off"
    assert int(annotations[prefix + "proxy-read-timeout"]) >= 600
    assert int(annotations[prefix + "proxy-send-timeout"]) >= 600
    hpa = one(resources, "HorizontalPodAutoscaler", "kvgate-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvgate-gateway"}
    assert hpa["minReplicas"] >= 2 and hpa["metrics"][0]["resource"]["name"] == "cpu"


def _expanded(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a command."""
    out = []
    for arg in argv:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        out.append(arg)
    return out


def test_the_commands_parse_and_point_at_the_services(rendered, tmp_path):
    """The gateway's and the engines' commands are accepted by their own parsers, and name the
    headless Service and Redis as the manifests define them."""
    _, resources = rendered
    env = {"POD_NAME": "kvgate-engine-7d9c-x2x4z", "REDIS_PASSWORD": "pw"}
    engine = container(resources, "Deployment", "kvgate-engine")
    argv = _expanded(engine["command"] + engine.get("args", []), env)
    assert argv[:4] == ["python", "-m", "engine", "serve"]
    args = engine_parser().parse_args(argv[3:])
    assert (args.replica_id, args.index_url, args.port) == (env["POD_NAME"], "redis://:pw@kvgate-redis:6379/0", 8100)

    gateway = container(resources, "Deployment", "kvgate-gateway")
    keys = tmp_path / "api-keys"
    keys.write_text(SECRETS["api-keys"])
    argv = [a.replace("/etc/kvgate/api-keys/api-keys", str(keys)) for a in gateway["command"]]
    literal = {e["name"]: e["value"] for e in gateway["env"] if "value" in e}
    config = load_config(argv[4:], environ={k: _expanded([v], env)[0] for k, v in literal.items()})
    assert config.api_key_file == str(keys) and config.index_url == "redis://:pw@kvgate-redis:6379/0"
    assert list(read_key_file(config.api_key_file, config.key_limits)) == ["sk-test"]
    service = one(resources, "Service", "kvgate-engine")["spec"]
    assert config.engine_dns == ("kvgate-engine", service["ports"][0]["port"])
    redis = one(resources, "Service", "kvgate-redis")
    assert redis["spec"]["ports"][0]["port"] == 6379
    assert shlex.join(argv[:4]) == "python -m gateway serve"
