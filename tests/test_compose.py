"""docker-compose.yml starts the whole system: NATS with JetStream, PostgreSQL 16 and the
eight services, each healthy-checked on its own metrics port; with ``--profile monitoring``,
Prometheus scraping all of them and Grafana with the dashboard.

The structure is checked with PyYAML on every run; ``docker compose config`` (or the older
``docker-compose``) additionally validates the file against the Compose schema where a
compose client is installed. No Docker engine is needed for either.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"

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
FEEDBACK_DSN = "postgresql://postgres:postgres@postgres:5432/fleetpilot"
MONITORING = {"prometheus", "grafana"}
"""Started only with ``--profile monitoring``."""


def compose_command() -> list[str] | None:
    """The compose CLI on this machine: the v2 plugin, else the v1 binary, else None."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # safe_load resolves the `<<: *anchor` merge keys the file uses for shared settings.
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _depends(service: dict[str, Any]) -> dict[str, str]:
    return {name: spec["condition"] for name, spec in service.get("depends_on", {}).items()}


def test_all_services_and_infrastructure_are_declared(compose):
    # `keys` is the one-shot that creates the token issuer's key set for the SLA service.
    assert set(compose["services"]) == set(SERVICE_PORTS) | {"nats", "postgres", "keys"} | MONITORING


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's bind mounts of this repository's files: container path → host path."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = str(volume).split(":")
        if source.startswith("./"):
            out[target] = source
    return out


def test_monitoring_starts_only_with_its_profile_and_scrapes_every_service(compose):
    for name, service in compose["services"].items():
        assert (service.get("profiles") == ["monitoring"]) == (name in MONITORING), name
    prometheus = compose["services"]["prometheus"]
    mounts = _mounts(prometheus)
    [config_flag] = [arg for arg in prometheus["command"] if arg.startswith("--config.file=")]
    config_path = config_flag.split("=", 1)[1]
    folder = str(Path(config_path).parent)
    config = yaml.safe_load((ROOT / mounts[folder] / Path(config_path).name).read_text())
    targets = {name: sd["port"] for job in config["scrape_configs"] for sd in job["dns_sd_configs"]
               for name in sd["names"]}
    # Found by name through Docker's DNS, one address per replica: both policy replicas.
    assert all(sd["type"] == "A" for job in config["scrape_configs"] for sd in job["dns_sd_configs"])
    assert targets == SERVICE_PORTS
    for rules in config["rule_files"]:
        assert (ROOT / mounts[folder] / rules).is_file(), rules


def test_grafana_is_given_the_compose_prometheus_and_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].split(":")[-1]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{prometheus_port}"
    assert source["isDefault"] is True  # the dashboard's data-source variable takes the default
    [provider] = yaml.safe_load((provisioning / "dashboards" / "fleetpilot.yaml").read_text())["providers"]
    dashboards = [target for target in mounts if target.startswith(provider["options"]["path"] + "/")]
    assert dashboards and all((ROOT / mounts[t]).is_file() for t in dashboards)
    home = _env(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in dashboards


def test_nats_runs_jetstream_with_a_data_dir_and_healthcheck(compose):
    nats = compose["services"]["nats"]
    assert nats["image"].startswith("nats:2.10")
    command = nats["command"]
    assert "-js" in command and command[command.index("-sd") + 1] == "/data"
    assert any("/data" in volume for volume in nats["volumes"])
    assert "healthz" in " ".join(nats["healthcheck"]["test"])


def test_postgres_16_with_healthcheck(compose):
    postgres = compose["services"]["postgres"]
    assert postgres["image"].split(":")[1].startswith("16")
    assert postgres["environment"]["POSTGRES_DB"] == "fleetpilot"
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])


@pytest.mark.parametrize(("name", "port"), sorted(SERVICE_PORTS.items()))
def test_each_service_runs_its_module_on_its_port(compose, name, port):
    service = compose["services"][name]
    assert service["command"] == ["python", "-m", f"fleetpilot_services.{name}"]
    assert service["image"] == "fleetpilot:dev"
    env = _env(service)
    assert env["FLEETPILOT_NATS_URL"] == "nats://nats:4222"
    prefix = f"FLEETPILOT_{name.upper()}_"
    assert env[prefix + "METRICS_PORT"] == str(port)
    # The runtime binds 127.0.0.1 by default, unreachable from outside the container.
    assert env[prefix + "METRICS_HOST"] == "0.0.0.0"
    published = [str(p) for p in service["ports"]]
    assert any(p == str(port) or p.endswith(f":{port}") for p in published), published
    assert f":{port}/healthz" in " ".join(service["healthcheck"]["test"])
    assert _depends(service)["nats"] == "service_healthy"


def test_feedback_uses_postgres(compose):
    feedback = compose["services"]["feedback"]
    assert _env(feedback)["FLEETPILOT_FEEDBACK_STORE_DSN"] == FEEDBACK_DSN
    assert _depends(feedback) == {"nats": "service_healthy", "postgres": "service_healthy"}


def test_policy_runs_two_replicas_without_a_fixed_host_port(compose):
    policy = compose["services"]["policy"]
    assert policy["deploy"]["replicas"] == 2
    assert "container_name" not in policy
    # A fixed "9105:9105" would make the second replica fail to start.
    assert all(":" not in str(p) for p in policy["ports"])


def test_dockerfile_builds_one_image_for_every_service():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "FROM python:3.11-slim" in dockerfile
    assert "download.pytorch.org/whl/cpu" in dockerfile
    assert "pip install ." in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def _dockerfile_steps() -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order, each as (keyword, arguments), continuation
    lines joined and comments left out."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in joined.splitlines() if line.strip()]


def test_the_dependencies_are_installed_in_a_layer_before_the_code():
    # Installed by `pip install .` after the code was copied, every dependency (numpy,
    # matplotlib, asyncpg, OpenTelemetry...) was downloaded and installed again at every
    # change of a line of code: a layer is rebuilt when anything copied before it changed.
    # A layer built from pyproject.toml alone is rebuilt only when the dependencies change.
    steps = _dockerfile_steps()
    code = next(i for i, (keyword, args) in enumerate(steps)
                if keyword == "COPY" and {"libs", "services"} & {Path(a).parts[0] for a in args.split()[:-1]})
    copied_before = {a for keyword, args in steps[:code] if keyword == "COPY" for a in args.split()[:-1]}
    assert copied_before <= {"pyproject.toml", "README.m[d]"}, copied_before
    installs = [args for keyword, args in steps[:code] if keyword == "RUN" and "pyproject.toml" in args]
    assert installs, "no layer before the code installs the dependencies pyproject.toml lists"
    # The step's own Python, run here on the real pyproject.toml: it must list every dependency.
    words = shlex.split(installs[0])
    script = words[words.index("-c") + 1]
    listed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert listed.stdout.split() == wanted
    assert "pip install -r" in installs[0]


def test_the_image_installs_the_cpu_torch_that_pyproject_pins():
    # The CPU wheel is installed first, from its own index, so that the dependencies' step
    # finds torch there. Were pyproject's pin moved alone, that step would install the pinned
    # version from PyPI beside it: the CUDA build, gigabytes of libraries nothing here uses.
    pinned = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                  if re.match(r"torch\b", d))
    cpu = [args for keyword, args in _dockerfile_steps() if keyword == "RUN" and "download.pytorch.org/whl/cpu" in args]
    assert cpu and pinned.replace(" ", "") in cpu[0].split(), (pinned, cpu)


def test_a_gpu_host_keeps_its_node_name_across_new_containers(compose):
    # On NVML the collector reports its GPUs under FLEETPILOT_COLLECTOR_NODE_NAME, else the
    # host name, which in a container is the container's id: every `up --build` (a new
    # container) brought the machine back as a new node, and left the old one in the fleet to
    # go unreachable (FleetpilotNodeUnreachable, critical) with its learnt history under a
    # name nothing reports again.
    env = _env(compose["services"]["collector"])
    assert env.get("FLEETPILOT_COLLECTOR_NODE_NAME"), "the collector's node name is its container's id"
    assert "hostname" not in compose["services"]["collector"]  # one place says it


def test_compose_config_validates():
    command = compose_command()
    if command is None:
        pytest.skip("no compose client (neither `docker compose` nor `docker-compose`) installed")
    result = subprocess.run(
        [*command, "-f", str(COMPOSE_FILE), "-p", "fleetpilot", "config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(SERVICE_PORTS) | {"nats", "postgres"} <= set(resolved["services"])
    assert resolved["services"]["policy"]["deploy"]["replicas"] == 2
    assert _env(resolved["services"]["feedback"])["FLEETPILOT_FEEDBACK_STORE_DSN"] == FEEDBACK_DSN


def test_sla_waits_for_the_key_set_it_verifies_tokens_with():
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    sla, keys = compose["services"]["sla"], compose["services"]["keys"]
    assert sla["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert sla["environment"]["FLEETPILOT_SLA_JWKS_PATH"].startswith("/keys/")
    assert "keys:/keys:ro" in sla["volumes"]
    # The key set is written where the one-shot's --state-dir points, on the shared volume.
    state = keys["command"][keys["command"].index("--state-dir") + 1]
    assert f"keys:{state}" in keys["volumes"]
    assert compose["services"]["collector"]["environment"]["FLEETPILOT_COLLECTOR_SOURCE"] == "sim"


def _dirs_the_image_user_owns() -> set[str]:
    """The directories the Dockerfile creates and hands to the user its services run as."""
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    user = re.search(r"^USER\s+(\S+)", dockerfile, re.MULTILINE).group(1)
    name = re.search(rf"useradd\s[^&\n]*--uid\s+{user}\s[^&\n]*?(\w+)\s*(?:&&|$)", dockerfile, re.MULTILINE)
    owners = {user, name.group(1) if name else user}
    owned: set[str] = set()
    for match in re.finditer(r"chown\s+(?:-R\s+)?([\w]+)(?::\w+)?\s+([^&\n]+)", dockerfile):
        if match.group(1) in owners:
            owned |= set(match.group(2).split())
    return owned


def test_the_image_user_can_write_its_named_volumes(compose):
    # The image runs as UID 10001. Docker gives a new named volume the owner of the image's
    # directory it is mounted on, and a path the image lacks is created for root: the `keys`
    # one-shot wrote its key ring to a volume on /keys, failed with a permission error, and
    # the SLA service, which waits for it to complete, never started.
    owned = _dirs_the_image_user_owns()
    assert "/var/lib/fleetpilot" in owned
    named = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        if service.get("image") != "fleetpilot:dev":
            continue
        for volume in service.get("volumes", []):
            source, target, *mode = str(volume).split(":")
            if source in named and "ro" not in mode:
                assert target in owned, f"{name}: volume {source} on {target}, which the image's user cannot write"


def test_the_executor_runs_under_an_init_that_reaps_its_tasks_leftovers(compose):
    # As PID 1 the executor inherited every orphan of the tasks its process backend killed,
    # and never reaped them: zombies piled up for the container's life.
    assert compose["services"]["executor"].get("init") is True


@pytest.mark.parametrize("name", sorted(SERVICE_PORTS))
def test_every_variable_a_service_is_given_is_one_of_its_settings(compose, name, monkeypatch):
    # A misspelt FLEETPILOT_<SERVICE>_* stops the container at start (exit 2, restarted for
    # ever by `restart: unless-stopped`); a misspelt shared one is silently ignored.
    import importlib

    from fleetpilot.runtime import config
    from fleetpilot.runtime.config import ServiceSettings

    shared_names: set[str] = set()
    shared = config._shared  # noqa: SLF001 - the one place the shared names are read
    monkeypatch.setattr(config, "_shared", lambda var, default: shared_names.add(var) or shared(var, default))
    ServiceSettings()
    monkeypatch.setattr(config, "_shared", shared)
    env = _env(compose["services"][name])
    prefix = f"FLEETPILOT_{name.upper()}_"
    assert sorted(v for v in env if not v.startswith(prefix) and v not in shared_names) == []
    module = importlib.import_module(f"fleetpilot_services.{name}.service")
    (settings,) = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, ServiceSettings)
                   and v.model_config.get("env_prefix") == prefix]
    for variable in [v for v in os.environ if v.startswith("FLEETPILOT_") or v in shared_names]:
        monkeypatch.delenv(variable)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    settings.from_environment()  # BadSettings names each variable it refuses
