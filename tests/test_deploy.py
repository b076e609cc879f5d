"""deploy/: what can be checked without a container engine.

The compose file, Dockerfile and Kubernetes manifest parse; images are pinned; ports agree from
one file to the next; every REAPER_* variable names a real configuration key (checked against
harvester/config_keys.py's dataclasses and by loading it); the example configuration and the documentation's
reference are generated from the code and up to date. Prometheus' own `promtool` checks the
compose Prometheus configuration.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import yaml
from support.scripts import load_script

from harvester import config

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "docker-compose.yml"
K8S_FILE = DEPLOY / "k8s" / "reaper-sidecar.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
IMAGE = re.compile(
    r"^(?:[a-z0-9.-]+(?::\d+)?/)?[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r":[A-Za-z0-9][A-Za-z0-9._-]*$"
)


def load_prometheus_helper():
    """deploy/prometheus/local.py: installs Debian's prometheus (promtool) when it is missing."""
    return load_script(DEPLOY / "prometheus" / "local.py", "deploy_prometheus_local")


def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def k8s_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(K8S_FILE.read_text()) if d]


def config_keys() -> dict[str, set[str]]:
    defaults = config.Config()
    return {
        s.name: {f.name for f in dataclasses.fields(getattr(defaults, s.name))} for s in dataclasses.fields(defaults)
    }


def assert_env_names_are_config_keys(env: dict[str, str], where: str) -> None:
    keys = config_keys()
    for name in env:
        if not name.startswith("REAPER_"):
            continue
        parts = name[len("REAPER_") :].split("__")
        assert name == name.upper(), f"{where}: {name} must be upper case"
        section, key = parts[0].lower(), parts[1].lower()
        assert section in keys, f"{where}: {name} names no section (known: {sorted(keys)})"
        assert key in keys[section], f"{where}: {name} names no key of {section} (known: {sorted(keys[section])})"
        if len(parts) == 3:  # librdkafka pass-through
            assert isinstance(getattr(getattr(config.Config(), section), key), dict), f"{where}: {name}"
        else:
            assert len(parts) == 2, f"{where}: {name} is not REAPER_<SECTION>__<KEY>"
    # And the real loader accepts them (types, ranges, cross-checks).
    config.load(environ={k: str(v) for k, v in env.items() if k.startswith("REAPER_")})


def reaper_services(doc: dict) -> dict[str, dict]:
    return {name: svc for name, svc in doc["services"].items() if svc.get("image", "").startswith("outbox-reaper:")}


def container_port(mapping: str) -> tuple[int, int]:
    host, container = mapping.rsplit(":", 1)[-2:] if mapping.count(":") == 1 else mapping.split(":")[-2:]
    return int(host), int(container)


# ------------------------------------------------------------------ docker compose


def test_compose_has_the_whole_stack_with_pinned_images():
    doc = compose()
    services = doc["services"]
    assert {"postgres", "kafka", "topics", "migrate", "reaper-1", "reaper-2", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        image = svc.get("image")
        assert image, f"service {name} has no image"
        assert IMAGE.match(image), f"service {name}: {image!r} is not a plausible image reference"
        assert not image.endswith(":latest"), f"service {name}: pin a version, not latest"
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    assert services["prometheus"]["image"].startswith("prom/prometheus:v2.")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    assert set(reaper_services(doc)) == {"migrate", "reaper-1", "reaper-2"}


def test_compose_builds_the_reaper_from_this_repository():
    for name, svc in reaper_services(compose()).items():
        build = svc["build"]
        context = (COMPOSE_FILE.parent / build["context"]).resolve()
        assert context == REPO, name
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
    assert reaper_services(compose())["migrate"]["command"] == ["migrate"]
    assert "command" not in reaper_services(compose())["reaper-1"]  # the image's CMD: run


def test_compose_reaper_environment_names_real_config_keys():
    for name, svc in reaper_services(compose()).items():
        assert_env_names_are_config_keys(svc["environment"], f"compose service {name}")


def test_compose_addresses_and_ports_agree():
    doc = compose()
    services = doc["services"]
    pg_env = services["postgres"]["environment"]
    kafka_env = services["kafka"]["environment"]
    host_ports = []
    for svc in services.values():
        host_ports += [container_port(p)[0] for p in svc.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), f"two services publish one host port: {host_ports}"

    internal = dict(item.split("://") for item in kafka_env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    listeners = dict(item.split("://") for item in kafka_env["KAFKA_LISTENERS"].split(","))
    assert kafka_env["KAFKA_INTER_BROKER_LISTENER_NAME"] in internal
    protocol_map = dict(item.split(":") for item in kafka_env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners) == set(protocol_map)
    assert kafka_env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split("@")[1] == f"kafka:{listeners['CONTROLLER'].lstrip(':')}"
    assert f"{container_port(services['kafka']['ports'][0])[1]}" == listeners["EXTERNAL"].lstrip(":")

    for name, svc in reaper_services(doc).items():
        env = svc["environment"]
        cfg = config.load(environ={k: str(v) for k, v in env.items()})
        dsn = urlparse(cfg.database.dsn)
        assert dsn.hostname == "postgres" and (dsn.port or 5432) == 5432, name
        assert dsn.password == pg_env["POSTGRES_PASSWORD"] and dsn.path == f"/{pg_env['POSTGRES_DB']}", name
        assert cfg.kafka.bootstrap_servers == internal["INTERNAL"], name
        if name != "migrate":
            assert [container_port(p)[1] for p in svc["ports"]] == [cfg.metrics.port], name

    prom_conf = yaml.safe_load((DEPLOY / "prometheus" / "compose.yml").read_text())
    targets = prom_conf["scrape_configs"][0]["static_configs"][0]["targets"]
    port = int(reaper_services(doc)["reaper-1"]["environment"]["REAPER_METRICS__PORT"])
    assert sorted(targets) == sorted(f"{n}:{port}" for n in reaper_services(doc) if n != "migrate")

    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    url = urlparse(datasource["datasources"][0]["url"])
    assert url.hostname == "prometheus" and url.port == container_port(services["prometheus"]["ports"][0])[1] == 9090


def test_compose_topics_match_the_reaper_configuration():
    doc = compose()
    script = doc["services"]["topics"]["command"][0]
    created = dict(re.findall(r"--topic (\S+) --partitions (\d+)", script))
    cfg = config.load(environ={k: str(v) for k, v in reaper_services(doc)["reaper-1"]["environment"].items()})
    assert created[cfg.harvester.leader_topic] == "1", "the leader topic must have exactly one partition"
    for topic in (cfg.acker.topic, cfg.acker.dead_letter_topic, cfg.harvester.default_completion_topic):
        assert topic in created
    assert doc["services"]["kafka"]["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_compose_mounts_exist_and_grafana_provisions_the_dashboard():
    doc = compose()
    for name, svc in doc["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_FILE.parent / source).resolve().exists(), f"{name}: {source} does not exist"
    grafana = doc["services"]["grafana"]
    mounts = {v.split(":")[1]: (COMPOSE_FILE.parent / v.split(":")[0]).resolve() for v in grafana["volumes"]}
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "reaper.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts[path] == DEPLOY / "grafana" / "dashboards"
    assert mounts["/etc/grafana/provisioning"] == DEPLOY / "grafana" / "provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(path) and (mounts[path] / Path(home).name).exists()
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "reaper.json").read_text())
    uid = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert uid["datasources"][0]["type"] == "prometheus"
    assert board["templating"]["list"][0]["query"] == "prometheus"
    prom = doc["services"]["prometheus"]
    prom_mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"] if v.startswith(".")}
    config_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    assert config_path in prom_mounts
    rules = yaml.safe_load((COMPOSE_FILE.parent / prom_mounts[config_path]).read_text())["rule_files"]
    assert [str(Path(config_path).parent / r) for r in rules] == ["/etc/prometheus/rules.yml"]
    assert "/etc/prometheus/rules.yml" in prom_mounts


def test_promtool_accepts_the_compose_prometheus_configuration():
    promtool = load_prometheus_helper().ensure_installed()[1]
    r = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus" / "compose.yml")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rules found" in r.stdout


# ------------------------------------------------------------------ Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_is_plausible_and_agrees_with_the_project():
    ins = dockerfile_instructions()
    froms = [rest.split()[0] for op, rest in ins if op == "FROM"]
    assert froms and all(IMAGE.match(f) for f in froms), froms
    required = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text())
    for image in froms:
        version = re.match(r"python:(\d+)\.(\d+)", image)
        assert version and tuple(map(int, version.groups())) >= tuple(map(int, required.groups())), image
    for op, rest in ins:
        if op == "COPY" and not rest.startswith("--from"):
            *sources, _ = rest.split()
            for s in sources:
                assert (REPO / s).exists(), f"COPY {s}: not in the repository"
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(rest for op, rest in ins if op == "ENV")))
    assert_env_names_are_config_keys(env, "Dockerfile ENV")
    port = env["REAPER_METRICS__PORT"]
    assert ("EXPOSE", port) in ins
    # the probe follows the command: `reaper healthcheck` asks where the container's configuration says
    health = next(rest for op, rest in ins if op == "HEALTHCHECK")
    assert json.loads(health.split("CMD", 1)[1]) == ["python", "-m", "harvester.cli", "healthcheck"], health
    entry = json.loads(next(rest for op, rest in ins if op == "ENTRYPOINT"))
    pyproject = (REPO / "pyproject.toml").read_text()
    assert entry == ["reaper"] and 'reaper = "harvester.cli:main"' in pyproject
    assert json.loads(next(rest for op, rest in ins if op == "CMD")) == ["run"]
    user = next(rest for op, rest in ins if op == "USER")
    assert user != "root" and user != "0"


# ------------------------------------------------------------------ Kubernetes


def test_k8s_sidecar_manifest_is_consistent(tmp_path):
    docs = k8s_docs()
    kinds = {d["kind"]: d for d in docs}
    assert {"Secret", "ConfigMap", "Deployment"} <= set(kinds)
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]
    deployment = kinds["Deployment"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    init = {c["name"]: c for c in spec["initContainers"]}
    app = spec["containers"]
    assert [c["name"] for c in spec["initContainers"]] == ["reaper-migrate", "reaper"]
    assert "restartPolicy" not in init["reaper-migrate"] and init["reaper"]["restartPolicy"] == "Always"
    assert init["reaper-migrate"]["args"][-1] == "migrate" and init["reaper"]["args"][-1] == "run"
    assert app and all(c["name"] != "reaper" for c in app)

    configmap = kinds["ConfigMap"]
    cfg_file = tmp_path / "reaper.yaml"
    cfg_file.write_text(configmap["data"]["reaper.yaml"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    secrets = {kinds["Secret"]["metadata"]["name"]: kinds["Secret"]["stringData"]}
    for c in init.values():
        assert IMAGE.match(c["image"]) and not c["image"].endswith(":latest")
        mount = c["volumeMounts"][0]
        assert volumes[mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
        assert c["args"][:2] == ["-c", f"{mount['mountPath']}/reaper.yaml"]
        env = {}
        for e in c["env"]:
            if "valueFrom" in e:
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = secrets[ref["name"]][ref["key"]]
            else:
                env[e["name"]] = e["value"]
        assert_env_names_are_config_keys(env, f"k8s container {c['name']}")
        cfg = config.load(cfg_file, environ=env)
        assert cfg.database.dsn == secrets["orders-db"]["dsn"]

    reaper = init["reaper"]
    cfg = config.load(cfg_file, environ={})
    ports = {p["name"]: p["containerPort"] for p in reaper["ports"]}
    assert ports["reaper-metrics"] == cfg.metrics.port
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == cfg.metrics.port
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert reaper["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "reaper-metrics"}
    # A native sidecar's readiness probe is the Pod's readiness, and its startup probe holds back the
    # app container: neither may depend on Kafka or Postgres (/readyz; /healthz before the start-up
    # checks pass), or a Kafka outage takes the application down. /healthz is served only after the
    # start-up checks, which last up to database.startup_timeout: liveness starts after it.
    assert "readinessProbe" not in reaper and "startupProbe" not in reaper
    assert reaper["livenessProbe"]["initialDelaySeconds"] > cfg.database.startup_timeout
    assert reaper["securityContext"]["runAsNonRoot"] is True
    assert spec["terminationGracePeriodSeconds"] > cfg.harvester.drain_timeout
    # Each replica's app container sees the schema its reaper harvests.
    app_env = {e["name"]: e.get("value") for e in app[0]["env"]}
    assert app_env["OUTBOX_SCHEMA"] == cfg.database.schema


# ------------------------------------------------------------------ configuration reference


def test_example_configuration_names_every_key_and_loads_to_the_defaults():
    example = yaml.safe_load((DEPLOY / "reaper.example.yaml").read_text())
    assert {s: set(v) for s, v in example.items()} == config_keys()
    assert config.load(DEPLOY / "reaper.example.yaml", environ={}) == config.Config()


def test_the_example_configuration_is_generated_from_the_code():
    r = subprocess.run([sys.executable, str(DEPLOY / "config_reference.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_configuration_page_documents_every_key_env_variable_and_default():
    page = (REPO / "docs" / "reference" / "configuration.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in page.splitlines() if line.startswith("| `")}
    defaults = config.Config()
    for section_name, names in config_keys().items():
        for name in names:
            key = f"{section_name}.{name}"
            assert key in rows, f"the configuration page lacks {key}"
            env = f"REAPER_{section_name.upper()}__{name.upper()}"
            assert f"`{env}" in rows[key], f"the row of {key} lacks {env}"
            default = getattr(getattr(defaults, section_name), name)
            if not isinstance(default, dict):
                values = re.findall(r"`([^`]*)`", rows[key])
                assert yaml.safe_load(values[2]) == default, f"the default of {key}: {values[2]!r} != {default!r}"


def test_readme_starts_with_the_two_setup_commands():
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.strip()]
    fence = lines.index("```sh")
    commands = [shlex.split(line.split("#")[0])[:2] for line in lines[fence + 1 : fence + 3]]
    assert commands == [["make", "demo"], ["make", "test"]]
    assert fence <= 2, "the set-up commands come first"
