"""The Kubernetes manifests in deploy/ parse, and every workload is production-shaped:
probes on /healthz at its service's port, resource requests, GPU-node placement for the
per-node services, and a disruption budget for the policy.

Pure YAML checks, so they run everywhere; ``kubectl kustomize`` (offline, no cluster)
additionally builds the kustomization where kubectl is installed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
NAMESPACE = "fleetpilot"

SERVICE_PORTS = {
    "collector": 9101,
    "topology": 9102,
    "fingerprinter": 9103,
    "sla": 9104,
    "policy": 9105,
    "executor": 9106,
    "feedback": 9107,
    "learner": 9108,
}
PER_NODE = {"collector", "executor"}
PARTITIONED = {"fingerprinter"}
STATEFUL = {"learner"}
WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet"}
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _kubernetes_docs() -> list[dict[str, Any]]:
    # The Helm values file is chart input, not a Kubernetes object.
    return [doc for path in YAML_FILES for doc in _load(path) if "apiVersion" in doc and "kind" in doc]


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in _kubernetes_docs() if doc["kind"] == kind}


def _workloads() -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in _kubernetes_docs() if doc["kind"] in WORKLOAD_KINDS}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_there_are_manifests():
    assert (K8S / "kustomization.yaml").is_file()
    assert len(YAML_FILES) >= 10


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_file_parses(path):
    docs = _load(path)
    assert docs, f"{path} has no documents"
    for doc in docs:
        assert isinstance(doc, dict)


def test_every_object_is_namespaced_or_the_namespace():
    # Not vacuous: the objects checked below include the namespace and every workload.
    assert list(_by_kind("Namespace")) == [NAMESPACE]
    assert set(_workloads()) >= set(SERVICE_PORTS)
    for doc in _kubernetes_docs():
        if doc["kind"] == "Kustomization":
            continue
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            assert meta["name"] == NAMESPACE
        else:
            assert meta.get("namespace") == NAMESPACE, f"{doc['kind']}/{meta['name']}"


def test_kustomization_lists_every_manifest_that_exists():
    kustomization = _load(K8S / "kustomization.yaml")[0]
    listed = set(kustomization["resources"])
    assert all((K8S / name).is_file() for name in listed)
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "nats-helm-values.yaml"}
    assert listed == manifests


def test_every_service_has_a_workload():
    workloads = _workloads()
    assert set(SERVICE_PORTS) | {"nats"} == set(workloads)
    for name in SERVICE_PORTS:
        expected = "DaemonSet" if name in PER_NODE else "StatefulSet" if name in PARTITIONED | STATEFUL else "Deployment"
        assert workloads[name]["kind"] == expected, name


@pytest.mark.parametrize("name", sorted(SERVICE_PORTS) + ["nats"])
def test_every_container_has_probes_and_resource_requests(name):
    workload = _workloads()[name]
    template = workload["spec"]["template"]
    assert _matches(workload["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
    for container in template["spec"]["containers"]:
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in container, f"{name}: {container['name']} lacks {probe}"
            assert "httpGet" in container[probe]
        requests = container["resources"]["requests"]
        assert requests.get("cpu") and requests.get("memory"), f"{name}: requests {requests}"


@pytest.mark.parametrize(("name", "port"), sorted(SERVICE_PORTS.items()))
def test_service_probes_hit_healthz_on_its_port(name, port):
    spec = _workloads()[name]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["python", "-m", f"fleetpilot_services.{name}"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        # Liveness is on /metrics (test_a_service_cut_off_from_nats_is_not_restarted).
        path = "/metrics" if probe == "livenessProbe" else "/healthz"
        assert get["path"] == path and ports[get["port"]] == port
    env = {e["name"]: e.get("value") for e in container["env"]}
    prefix = f"FLEETPILOT_{name.upper()}_"
    assert env[prefix + "METRICS_PORT"] == str(port)
    assert env[prefix + "METRICS_HOST"] == "0.0.0.0"
    assert {"configMapRef": {"name": "fleetpilot-env"}} in container["envFrom"]


@pytest.mark.parametrize("name", sorted(PER_NODE))
def test_per_node_services_run_on_gpu_nodes_with_nvml_access(name):
    spec = _workloads()[name]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["runtimeClassName"] == "nvidia"
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    # Requesting nvidia.com/gpu would take a GPU away from the tasks being scheduled.
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container["resources"].get(section, {})


def test_only_the_collector_sees_the_hosts_processes():
    # The collector maps the host PIDs NVML reports to tasks (FLEETPILOT_TASK_ID in
    # /proc/<pid>/environ): it needs the host's PID namespace. The executor calls no NVML and
    # only watches its own children; there its tasks (user code, under UID 10001 like every
    # service) could see every process of the node and read the environment of any
    # Fleetpilot pod scheduled there (the feedback service's DSN). Its own pod namespace,
    # shared with the pause container, gives it an init that reaps what killed tasks leave.
    collector = _workloads()["collector"]["spec"]["template"]["spec"]
    executor = _workloads()["executor"]["spec"]["template"]["spec"]
    assert collector["hostPID"] is True
    assert not executor.get("hostPID") and executor["shareProcessNamespace"] is True


def test_the_executor_runs_tasks_on_its_node_with_room_for_them():
    # The manifest left the default `sim` backend beside NVML collectors: every placement
    # failed (nothing answers sim.control), and the tasks, had they run in this container,
    # would have had one CPU and 512 MiB between them.
    from fleetpilot_services.executor.service import ExecutorSettings

    (container,) = _workloads()["executor"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    config = next(doc for doc in _by_kind("ConfigMap").values() if doc["metadata"]["name"] == "fleetpilot-env")
    assert "FLEETPILOT_EXECUTOR_BACKEND" not in config.get("data", {})  # one place says it
    assert env["FLEETPILOT_EXECUTOR_BACKEND"] == "process"
    assert ExecutorSettings(backend=env["FLEETPILOT_EXECUTOR_BACKEND"]).backend == "process"
    limits = container["resources"]["limits"]
    assert "cpu" not in limits
    assert int(limits["memory"].removesuffix("Gi")) >= 16


def test_an_upgrade_restarts_the_tasks_of_no_node_unasked():
    # The executor's tasks run in its pod and end when it stops (evicted, placed again,
    # restarted from their command). Rolled out by the DaemonSet, a new image (`kustomize edit
    # set image`, then apply) restarted every task of the fleet, node after node; on OnDelete,
    # a node's executor is updated when its pod is deleted, at a time chosen for that node.
    # The collector holds no tasks and is rolled out as usual.
    workloads = _workloads()
    assert workloads["executor"]["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert workloads["collector"]["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert "OnDelete" in (DEPLOY / "README.md").read_text()  # and says how to update a node


@pytest.mark.parametrize(("name", "variable", "field", "named"), [
    ("collector", "FLEETPILOT_COLLECTOR_NODE_NAME", "node_name", "gpu-node-7.ec2.internal"),  # its reader maps it
    ("executor", "FLEETPILOT_EXECUTOR_NODE", "node", "gpu-node-7_ec2_internal"),
])
def test_per_node_services_go_by_the_kubernetes_node_name(name, variable, field, named, monkeypatch):
    # The collector names its node in every report and the topology; the executor carries
    # out the decisions for the node of that name. Both must be the Kubernetes node: a
    # pod's hostname is the pod's own name, and a different one on every restart.
    from fleetpilot_services.collector.service import CollectorSettings
    from fleetpilot_services.executor.service import ExecutorSettings

    container = _workloads()[name]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env[variable]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    monkeypatch.setenv(variable, "gpu-node-7.ec2.internal")  # the variable is the service's setting
    settings = {"collector": CollectorSettings, "executor": ExecutorSettings}[name]()
    assert getattr(settings, field) == named


# What the kubelet puts in a variable taken from the downward API, for the checks below.
DOWNWARD = {"spec.nodeName": "gpu-node-7.ec2.internal", "metadata.name": "{name}-0",
            "metadata.labels['apps.kubernetes.io/pod-index']": "0"}
# Read by the NVIDIA container runtime (runtimeClassName nvidia), not by a service.
NVIDIA_RUNTIME = {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}


def settings_class(name: str) -> type:
    """The service's settings class: the one under its ``FLEETPILOT_<NAME>_`` prefix."""
    import importlib

    from fleetpilot.runtime.config import ServiceSettings

    module = importlib.import_module(f"fleetpilot_services.{name}.service")
    (found,) = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, ServiceSettings)
                and v.model_config.get("env_prefix") == f"FLEETPILOT_{name.upper()}_"]
    return found


def shared_variables(monkeypatch) -> set[str]:
    """The unprefixed variables every service reads (``runtime/config.py``'s ``_shared``),
    recorded as the base settings read them rather than copied here."""
    from fleetpilot.runtime import config
    from fleetpilot.runtime.config import ServiceSettings

    read: set[str] = set()
    shared = config._shared  # noqa: SLF001 - the one place the shared names are read

    def recording(variable: str, default: str | None) -> str | None:
        read.add(variable)
        return shared(variable, default)

    monkeypatch.setattr(config, "_shared", recording)
    ServiceSettings()
    monkeypatch.setattr(config, "_shared", shared)
    return read


def container_environment(name: str, container: dict[str, Any]) -> dict[str, str]:
    """The environment the container gets: its ConfigMaps, then its own variables (which win),
    a downward-API or Secret reference resolved as Kubernetes would."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_by_kind("ConfigMap")[source["configMapRef"]["name"]].get("data", {}))
    for item in container.get("env", []):
        ref = item.get("valueFrom", {})
        if "fieldRef" in ref:
            env[item["name"]] = DOWNWARD[ref["fieldRef"]["fieldPath"]].format(name=name)
        elif "secretKeyRef" in ref:
            env[item["name"]] = _by_kind("Secret")[ref["secretKeyRef"]["name"]]["stringData"][ref["secretKeyRef"]["key"]]
        else:
            env[item["name"]] = str(item["value"])
    return env


@pytest.mark.parametrize("name", sorted(SERVICE_PORTS))
def test_every_variable_a_manifest_sets_is_read_and_accepted(name, monkeypatch):
    # A misspelt FLEETPILOT_<SERVICE>_* stops the service at start (exit 2, a crash loop on
    # every node of a DaemonSet), a misspelt shared one is silently ignored, and a variable
    # nothing reads (NODE_NAME, POD_NAME) passes for configuration that is not there.
    (container,) = _workloads()[name]["spec"]["template"]["spec"]["containers"]
    env = container_environment(name, container)
    shared = shared_variables(monkeypatch)
    prefix = f"FLEETPILOT_{name.upper()}_"
    unread = sorted(v for v in env if not v.startswith(prefix) and v not in shared and v not in NVIDIA_RUNTIME)
    assert not unread, f"{name}: {unread} are read by nothing"
    for variable in [v for v in os.environ if v.startswith("FLEETPILOT_") or v in shared]:
        monkeypatch.delenv(variable)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    settings_class(name).from_environment()  # BadSettings names each variable it refuses


def test_every_service_port_is_exposed_by_a_service_that_selects_its_pods():
    services = _by_kind("Service")
    workloads = _workloads()
    for name, port in SERVICE_PORTS.items():
        service = services[name]
        assert [p["port"] for p in service["spec"]["ports"]] == [port]
        labels = workloads[name]["spec"]["template"]["metadata"]["labels"]
        assert _matches(service["spec"]["selector"], labels)
    assert services["nats"]["spec"]["ports"][0]["port"] == 4222



def test_each_pod_is_scraped_once():
    # Prometheus's stock Kubernetes configuration (the prometheus-community chart) has two
    # jobs: annotated pods, and the endpoints of annotated Services. With both annotated,
    # every pod was scraped twice (two series per metric, one per job): each fingerprinter
    # partition counted two replicas, so FleetpilotFingerprinterPartitionDoubled fired for
    # every partition and FleetpilotFingerprinterPartitionMissing could not fire.
    services = _by_kind("Service")
    for name, port in SERVICE_PORTS.items():
        pod = _workloads()[name]["spec"]["template"]["metadata"].get("annotations", {})
        assert pod.get("prometheus.io/scrape") == "true" and pod.get("prometheus.io/port") == str(port), name
        annotations = services[name]["metadata"].get("annotations") or {}
        assert annotations.get("prometheus.io/scrape") != "true", f"Service {name} would scrape its pods again"


async def _status(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
    status = int((await reader.readline()).split()[1])
    writer.close()
    return status


@pytest.mark.parametrize("name", sorted(SERVICE_PORTS))
def test_a_service_cut_off_from_nats_is_not_restarted(name):
    # The process backend runs a node's tasks inside the executor's container. A node cut
    # off from NATS takes no new work after 90 s and has its tasks given up after 5 minutes
    # (services/topology/README.md); until then they run on, and when it hears again its
    # executor carries on. A liveness probe on /healthz (503 without the bus) had the kubelet
    # restart the executor after a minute, killing every task on the node; and every other
    # service, losing what it held in memory (the fingerprinter a running task's series).
    # Asked of the services' own ops server with the bus away: liveness passes, readiness not.
    from fleetpilot.runtime.http import OpsServer
    from prometheus_client import CollectorRegistry

    (container,) = _workloads()[name]["spec"]["template"]["spec"]["containers"]

    async def probe() -> tuple[int, int]:
        server = OpsServer(CollectorRegistry(), lambda: {"ok": False, "service": name})
        port = await server.start("127.0.0.1", 0)
        try:
            return (await _status(port, container["livenessProbe"]["httpGet"]["path"]),
                    await _status(port, container["readinessProbe"]["httpGet"]["path"]))
        finally:
            await server.stop()

    assert asyncio.run(probe()) == (200, 503)


def test_policy_has_a_disruption_budget_and_two_replicas():
    policy = _workloads()["policy"]
    assert policy["spec"]["replicas"] >= 2
    budget = _by_kind("PodDisruptionBudget")["policy"]
    assert budget["spec"]["minAvailable"] == 1
    assert _matches(
        budget["spec"]["selector"]["matchLabels"], policy["spec"]["template"]["metadata"]["labels"]
    )


def test_every_deployment_run_in_several_replicas_keeps_one_through_a_drain():
    # Replicas of a Deployment share its consumer, so one left is enough; without a budget a
    # drain (or a cluster upgrade) may evict them all at once, both SLA replicas on one node
    # (their spread is ScheduleAnyway) and no task is admitted until they are back.
    budgets = _by_kind("PodDisruptionBudget").values()
    several = {name: w for name, w in _workloads().items() if w["kind"] == "Deployment" and w["spec"]["replicas"] >= 2}
    assert {"policy", "sla"} <= set(several)
    for name, workload in several.items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        keeping = [b for b in budgets if _matches(b["spec"]["selector"]["matchLabels"], labels)
                   and (b["spec"].get("minAvailable", 0) >= 1 or b["spec"].get("maxUnavailable", 1) == 1)]
        assert keeping, f"{name}: {workload['spec']['replicas']} replicas and no disruption budget keeps one"


def test_the_sla_is_told_whose_tokens_to_take():
    # deploy/README.md has the key set exported from the cluster's identity provider; the
    # issuer and audience a token must carry were left at their defaults, Fleetpilot's own
    # issuer's, unseen in the manifest: every token of that provider was refused
    # (wrong_issuer). Set where the key set is, they default to what `fleetpilot token` mints.
    from fleetpilot.cli.local import AUDIENCE, ISSUER

    (container,) = _workloads()["sla"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env.get("FLEETPILOT_SLA_ISSUER"), env.get("FLEETPILOT_SLA_AUDIENCE")) == (ISSUER, AUDIENCE)
    assert "FLEETPILOT_SLA_ISSUER" in (DEPLOY / "README.md").read_text()


def test_the_fingerprinter_runs_one_replica_per_partition():
    # Each replica owns the tasks of its partition, its pod index: with more replicas than
    # partitions, two would fingerprint the same tasks; with fewer, some tasks none
    # (services/fingerprinter/README.md, "Partitions").
    fingerprinter = _workloads()["fingerprinter"]
    (container,) = fingerprinter["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert int(env["FLEETPILOT_FINGERPRINTER_PARTITIONS"]["value"]) == fingerprinter["spec"]["replicas"] > 1
    index = env["FLEETPILOT_FINGERPRINTER_PARTITION"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.labels['apps.kubernetes.io/pod-index']"


def test_the_learner_keeps_its_name_and_its_outcomes_across_restarts():
    # Its consumers are named after its instance, and what it learnt from is in learner.db
    # under the state dir: a restarted pod must come back as the same instance, on the same disk.
    learner = _workloads()["learner"]
    spec = learner["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["FLEETPILOT_LEARNER_INSTANCE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (claim,) = spec["volumeClaimTemplates"]
    state = _by_kind("ConfigMap")["fleetpilot-env"]["data"]["FLEETPILOT_STATE_DIR"]
    assert {"name": claim["metadata"]["name"], "mountPath": state} in container["volumeMounts"]
    assert spec["template"]["spec"]["securityContext"]["fsGroup"] == container["securityContext"]["runAsGroup"]


def test_nats_runs_jetstream_with_persistent_storage():
    config = _by_kind("ConfigMap")["nats-config"]["data"]["nats.conf"]
    assert "jetstream" in config and "store_dir: /data" in config
    nats = _workloads()["nats"]
    assert nats["kind"] == "StatefulSet" and nats["spec"]["replicas"] == 3
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert _by_kind("ConfigMap")["fleetpilot-env"]["data"]["FLEETPILOT_NATS_URL"] == "nats://nats:4222"


def test_feedback_reads_its_dsn_from_a_secret_that_exists():
    (container,) = _workloads()["feedback"]["spec"]["template"]["spec"]["containers"]
    dsn = next(e for e in container["env"] if e["name"] == "FLEETPILOT_FEEDBACK_STORE_DSN")
    ref = dsn["valueFrom"]["secretKeyRef"]
    secret = _by_kind("Secret")[ref["name"]]
    assert secret["stringData"][ref["key"]].startswith("postgresql://")


def test_kustomize_builds():
    if shutil.which("kubectl") is None:
        # Only kustomize itself shows the kustomization builds: CI must have kubectl.
        if os.environ.get("CI"):
            pytest.fail("kubectl is not installed in CI")
        pytest.skip("kubectl is not installed")
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc]
    assert kinds.count("Deployment") == 4 and kinds.count("DaemonSet") == 2 and kinds.count("StatefulSet") == 3


def test_the_nats_users_are_the_ones_the_catalog_generates():
    # Regenerate with: python -m fleetpilot.contracts.permissions --nats-conf > deploy/k8s/nats-auth.conf
    from fleetpilot.contracts.permissions import nats_conf

    assert (K8S / "nats-auth.conf").read_text() == nats_conf(), "deploy/k8s/nats-auth.conf drifted from the catalog"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert {"name": "nats-auth", "files": ["nats-auth.conf"]} in kustomization["configMapGenerator"]


def test_nats_includes_the_users_and_takes_each_password_from_its_secret():
    from fleetpilot.contracts.permissions import ROLES, password_variable

    conf = _by_kind("ConfigMap")["nats-config"]["data"]["nats.conf"]
    (include,) = [line.split()[1] for line in conf.splitlines() if line.strip().startswith("include ")]
    (container,) = _by_kind("StatefulSet")["nats"]["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in _by_kind("StatefulSet")["nats"]["spec"]["template"]["spec"]["volumes"]}
    # nats-server joins an include to the including file's folder (an absolute path too).
    assert os.path.normpath(os.path.join(mounts["config"], include)) == f"{mounts['auth']}/nats-auth.conf"
    assert volumes["auth"]["configMap"]["name"] == "nats-auth"
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert env == {password_variable(r): {"name": f"fleetpilot-nats-{r}", "key": "password"} for r in ROLES}


@pytest.mark.parametrize("name", sorted(SERVICE_PORTS))
def test_each_service_connects_as_its_own_user(name):
    from urllib.parse import urlsplit

    (container,) = _workloads()[name]["spec"]["template"]["spec"]["containers"]
    (url,) = [e for e in container["env"] if e["name"] == "FLEETPILOT_NATS_URL"]
    assert url["valueFrom"]["secretKeyRef"] == {"name": f"fleetpilot-nats-{name}", "key": "url"}
    secret = _by_kind("Secret")[f"fleetpilot-nats-{name}"]["stringData"]
    parts = urlsplit(secret["url"])
    assert (parts.username, parts.password, parts.hostname, parts.port) == (name, secret["password"], "nats", 4222)
