"""The deployment recipes of ``examples/``, as far as each can be tried here.

Docker, Kubernetes and systemd do not run here, so their files are read and held to
what anarchon does: each ``anarchon ...`` command line parses with anarchon's own
parser, probes ask the paths and ports the options open, grace periods outlast the
app's ``stop_grace_ms``, no secret is on a command line, and the app module each one
names loads. Then the three command lines themselves run the app (``anarchon run``
subprocesses against a real server) as one fleet: its job runs once per slot, the
probes answer, the metrics are served, and SIGTERM stops each with exit code 0.

The Python examples (Sentinel, cluster, TLS, an ACL user, OpenTelemetry) run as their
users run them, against the suite's harnesses (one server of each kind, not the
matrix), until their job (or timer) has run; the Grafana dashboard and the alerts
query only metrics anarchon exports.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
import redis
import redis.asyncio
import yaml  # type: ignore[import-untyped]  # no stubs in the test extra

from anarchon import Inspector, RedisBackend, RunResult, Scheduler
from anarchon._cli.main import build_parser
from anarchon._ops.embedded import free_port
from anarchon.prometheus import SchedulerMetrics
from tests.servers import MATRIX_FIRST, cluster_matrix, running_cluster, running_server

# The suite's harnesses whose modules are not clean under mypy --strict (ignores and
# untyped calls of their own): imported by name, so that checking this file does not
# check them too.
_sentinels: Any = importlib.import_module("tests.sentinels")
#: The module-scoped TLS server of tests/test_clients.py (Debian's TLS-enabled
#: redis-server and a throwaway CA): (port, CA file, a CA the server does not know).
tls_server: Any = importlib.import_module("tests.test_clients").tls_server

pytestmark = [pytest.mark.engine_tier]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
#: The app of the Docker Compose, Kubernetes and systemd recipes, and its image's files.
APP_DIR = EXAMPLES / "docker-compose"
T = TypeVar("T")


# ------------------------------------------------------------------ reading the files


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert all(isinstance(d, dict) for d in documents), path
    return documents


def run_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` (``anarchon ...``, the program by name or path) as anarchon's own parser
    reads it; a line it refuses fails the test."""
    assert Path(argv[0]).name == "anarchon", argv
    try:
        return build_parser().parse_args(list(argv[1:]))
    except SystemExit as exc:
        raise AssertionError(f"anarchon's parser refuses {list(argv)}") from exc


def seconds(text: object) -> float:
    """A duration as compose (``30s``, ``1m30s``) or systemd (``30``, ``30s``) writes it."""
    value = str(text).strip()
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def app_scheduler() -> Scheduler[Any]:
    """The ``scheduler`` of the recipes' app.py, loaded from its file."""
    spec = importlib.util.spec_from_file_location("recipes_app", APP_DIR / "app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scheduler = module.scheduler
    assert isinstance(scheduler, Scheduler)
    return scheduler


def check_target(args: argparse.Namespace) -> None:
    """``anarchon run MODULE:ATTRIBUTE`` names the recipes' app: ``app.py`` of the
    directory it runs in (the image's WORKDIR, the unit's WorkingDirectory)."""
    assert args.command == "run"
    module, _, attribute = args.target.partition(":")
    assert (APP_DIR / f"{module}.py").is_file(), args.target
    assert attribute == "scheduler"


def no_secret(words: Sequence[str]) -> None:
    """No server URL, and so no password, among ``words`` (a command line)."""
    for word in words:
        assert not re.search(r"(redis|rediss|valkey|valkeys|unix)(\+sentinel)?://", word), words
        assert "password" not in word.lower(), words


def compose() -> dict[str, Any]:
    (document,) = yaml_documents(APP_DIR / "compose.yaml")
    return document


def kubernetes(kind: str) -> dict[str, Any]:
    (found,) = [
        d for d in yaml_documents(EXAMPLES / "kubernetes" / "deployment.yaml") if d["kind"] == kind
    ]
    return found


def systemd_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections, each key with its values in order (a key may repeat);
    lines ending with a backslash continue on the next."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def dockerfile() -> dict[str, list[str]]:
    """The Dockerfile's instructions, by name, each with its arguments (joined lines)."""
    found: dict[str, list[str]] = {}
    text = re.sub(r"\\\n\s*", " ", (APP_DIR / "Dockerfile").read_text())
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, rest = line.strip().partition(" ")
            found.setdefault(name.upper(), []).append(rest.strip())
    return found


def compose_command() -> list[str]:
    command = compose()["services"]["app"]["command"]
    assert isinstance(command, list)
    return [str(word) for word in command]


def kubernetes_container() -> dict[str, Any]:
    (container,) = kubernetes("Deployment")["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def systemd_command() -> list[str]:
    unit = systemd_unit(EXAMPLES / "systemd" / "anarchon.service")
    (exec_start,) = unit["Service"]["ExecStart"]
    return shlex.split(exec_start)


# ------------------------------------------------------------------ Docker Compose


def test_the_compose_file_runs_three_copies_of_the_app_with_a_health_check() -> None:
    services = compose()["services"]
    app = services["app"]
    assert app["deploy"]["replicas"] == 3
    args = run_args(compose_command())
    check_target(args)
    no_secret(compose_command())
    # The health check reads the file the command keeps, with anarchon's own parser.
    check = app["healthcheck"]["test"]
    assert check[0] == "CMD"
    health = run_args(check[1:])
    assert health.command == "health" and health.path == args.health_file
    # It counts only once anarchon has had its time to wait for the server.
    assert seconds(app["healthcheck"]["start_period"]) >= args.wait_for_server
    # SIGKILL comes after the grace period: after the running jobs' stop_grace_ms.
    assert seconds(app["stop_grace_period"]) > app_scheduler().stop_grace_ms / 1000
    # The app reads REDIS_URL; no password in the file itself.
    assert "REDIS_URL" in app["environment"]
    for value in app["environment"].values():
        assert urllib.parse.urlsplit(str(value)).password is None, value
    assert app["depends_on"]["valkey"]["condition"] == "service_healthy"
    assert "healthcheck" in services["valkey"]
    # Prometheus (the monitoring profile) scrapes each copy on the port it serves.
    assert args.metrics_port is not None and args.metrics_host == "0.0.0.0"
    prometheus = yaml_documents(EXAMPLES / "prometheus" / "prometheus.yml")[0]
    (scrape,) = prometheus["scrape_configs"]
    (dns,) = scrape["dns_sd_configs"]
    assert dns["names"] == ["app"] and dns["port"] == args.metrics_port
    for name in prometheus["rule_files"]:
        assert (EXAMPLES / "prometheus" / name).is_file()
    # Every file a service mounts is in the examples.
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (APP_DIR / source).is_file(), volume


def test_the_image_holds_the_app_and_runs_anarchon_as_its_own_user() -> None:
    instructions = dockerfile()
    assert instructions["FROM"][0].startswith("python:")
    (workdir,) = instructions["WORKDIR"]
    assert any(copy.split()[0] == "app.py" for copy in instructions["COPY"])
    assert any("anarchon[prometheus]" in run for run in instructions["RUN"])  # --metrics-port
    (cmd,) = instructions["CMD"]
    argv = json.loads(cmd)  # the exec form: anarchon gets the SIGTERM itself
    check_target(run_args(argv))
    (user,) = instructions["USER"]
    # Kubernetes runs it as the same user, and in the same directory.
    pod = kubernetes("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(user)
    assert workdir == "/app"
    assert compose()["services"]["app"]["build"] == "."


# ------------------------------------------------------------------ Kubernetes


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's port, given by number or by the container's name for it."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    assert isinstance(number, int)
    return number


def test_the_kubernetes_deployment_probes_what_anarchon_run_serves() -> None:
    deployment = kubernetes("Deployment")
    assert deployment["spec"]["replicas"] == 3
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = kubernetes_container()
    argv = container["command"] + container.get("args", [])
    args = run_args(argv)
    check_target(args)
    no_secret(argv)
    # The kubelet probes the pod's address: the port must not be loopback only.
    assert args.health_port is not None and args.health_host == "0.0.0.0"
    probes = {name: container[name] for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    for name, probe in probes.items():
        assert port_number(container, probe["httpGet"]["port"]) == args.health_port, name
    assert probes["startupProbe"]["httpGet"]["path"] == "/live"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/live"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    # The probes answer once the scheduler has started, which may take the whole wait
    # for the server: the startup probe waits longer than that.
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > args.wait_for_server
    # SIGKILL comes after the grace period: after the running jobs' stop_grace_ms.
    grace = template["spec"]["terminationGracePeriodSeconds"]
    assert grace > app_scheduler().stop_grace_ms / 1000
    # The server's URL from a Secret, not from the manifest.
    env = {e["name"]: e for e in container["env"]}
    assert "value" not in env["REDIS_URL"] and env["REDIS_URL"]["valueFrom"]["secretKeyRef"]
    no_secret([str(e.get("value", "")) for e in container["env"]])
    # Metrics: served on the pod's address, on the port the annotations and the
    # Service name.
    assert args.metrics_port is not None and args.metrics_host == "0.0.0.0"
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == args.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"
    service = kubernetes("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port_number(container, port["targetPort"]) == args.metrics_port
    budget = kubernetes("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (monitor,) = yaml_documents(EXAMPLES / "kubernetes" / "servicemonitor.yaml")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [port["name"]]


# ------------------------------------------------------------------ systemd


def test_the_systemd_unit_stops_after_the_grace_and_keeps_the_url_in_its_environment_file() -> None:
    unit = systemd_unit(EXAMPLES / "systemd" / "anarchon.service")
    service = unit["Service"]
    argv = systemd_command()
    args = run_args(argv)
    check_target(args)
    no_secret(argv)
    for line in service.get("Environment", []):
        no_secret(shlex.split(line))
    assert service["KillSignal"] == ["SIGTERM"]
    (timeout,) = service["TimeoutStopSec"]
    assert seconds(timeout) > app_scheduler().stop_grace_ms / 1000
    assert service["Restart"] == ["on-failure"]
    assert service["RestartPreventExitStatus"] == ["2"]  # anarchon run's usage errors
    # The health file is in the runtime directory the unit makes for its user.
    (runtime,) = service["RuntimeDirectory"]
    assert args.health_file.startswith(f"%t/{runtime}/")
    # The URL, with its password, comes from the environment file.
    (env_file,) = service["EnvironmentFile"]
    assert env_file.endswith("/anarchon.env")
    env = dict(
        line.split("=", 1)
        for line in (EXAMPLES / "systemd" / "anarchon.env").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert env["REDIS_URL"].startswith("redis://")
    for option, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert service[option] == [value], option
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_analyze_finds_nothing_wrong_with_the_unit(tmp_path: Path) -> None:
    """``systemd-analyze verify`` reads unit files without a running systemd; it warns of
    unknown keys and bad values (on stderr). The program is pointed at this venv's
    anarchon, since /opt/myapp does not exist here."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze on this machine")
    program = Path(sys.executable).parent / "anarchon"  # the console script, if installed
    if not program.exists():
        program = Path(sys.executable)
    text = (EXAMPLES / "systemd" / "anarchon.service").read_text()
    copy = tmp_path / "anarchon.service"
    copy.write_text(text.replace("/opt/myapp/venv/bin/anarchon", str(program)))
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr


# ------------------------------------------------------------------ Prometheus and Grafana


def exported_names() -> set[str]:
    """The sample names anarchon's collector exposes: counters add ``_total``,
    histograms ``_bucket``, ``_sum`` and ``_count``."""
    names = set()
    for family in SchedulerMetrics().describe():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}_{part}" for part in ("bucket", "sum", "count")}
        else:
            names.add(family.name)
    return names


def metric_names(expression: str) -> set[str]:
    return set(re.findall(r"\banarchon_\w+", expression))


def test_the_grafana_dashboard_queries_only_metrics_anarchon_exports() -> None:
    dashboard = json.loads((EXAMPLES / "prometheus" / "grafana-dashboard.json").read_text())
    exported = exported_names()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used: set[str] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert names <= exported, (panel["title"], names - exported)
            used |= names
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert metric_names(variables["job"]["definition"]) <= exported
    # Every family anarchon exports has a panel.
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert families == {family.name for family in SchedulerMetrics().describe()}


def test_the_alerts_query_only_metrics_anarchon_exports() -> None:
    (rules,) = yaml_documents(EXAMPLES / "prometheus" / "alerts.yml")
    exported = exported_names()
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert alerts
    for rule in alerts:
        names = metric_names(rule["expr"])
        assert names and names <= exported, (rule["alert"], names - exported)
        assert rule["labels"]["severity"] in ("warning", "critical")


# ------------------------------------------------------------------ running them


def wait_for(
    condition: Callable[[], T | None],
    timeout_sec: float,
    what: str,
    *running: Process,
) -> T:
    """``condition``'s first true value, asked until the deadline; a process of
    ``running`` that ends meanwhile fails at once, with its output."""
    deadline = time.monotonic() + timeout_sec
    while True:
        value = condition()
        if value:
            return value
        for process in running:
            if process.popen.poll() is not None:
                raise AssertionError(f"{process.name} ended while waiting for {what}:\n{process}")
        if time.monotonic() > deadline:
            output = "\n".join(str(p) for p in running)
            raise AssertionError(f"timed out after {timeout_sec} s waiting for {what}\n{output}")
        time.sleep(0.1)


class Process:
    """A recipe's program, its standard output and error in files."""

    def __init__(
        self, name: str, argv: Sequence[str], env: dict[str, str], cwd: Path, logs: Path
    ) -> None:
        self.name = name
        self.stdout = logs / f"{name}.out"
        self.stderr = logs / f"{name}.err"
        full_env = dict(os.environ)
        paths = [str(ROOT / "src"), full_env.get("PYTHONPATH", "")]
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env["PATH"]])
        full_env.update(env)
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.popen = subprocess.Popen(
                list(argv), cwd=cwd, env=full_env, stdout=out, stderr=err,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def stop(self, timeout_sec: float = 25) -> int:
        """SIGTERM, as docker stop, the kubelet and systemd send; the exit code."""
        self.popen.send_signal(signal.SIGTERM)
        return self.wait(timeout_sec)

    def wait(self, timeout_sec: float = 25) -> int:
        try:
            return self.popen.wait(timeout_sec)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still runs after SIGTERM:\n{self}") from None

    def end(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def __str__(self) -> str:
        return f"--- {self.name} ---\n{self.output()[-4000:]}"


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in started:
        process.end()


def store_read(
    spec: object, prefix: str, read: Callable[[Inspector], Awaitable[T]], cluster: bool = False
) -> T:
    """``read`` with an Inspector of the store (a URL, or a cluster node's URL)."""

    async def go() -> T:
        client: Any = spec
        if cluster:
            client = redis.asyncio.RedisCluster.from_url(str(spec))
        try:
            async with Inspector(RedisBackend(redis=client, prefix=prefix)) as inspector:
                return await read(inspector)
        finally:
            if cluster:
                await client.aclose()

    return anyio.run(go)


def ran_ok(
    spec: object, prefix: str, job: str, cluster: bool = False
) -> Callable[[], list[RunResult]]:
    """A condition: the attempts of ``job`` the store recorded as ok (once it knows the
    job: an instance that runs it has started)."""

    async def read(inspector: Inspector) -> list[RunResult]:
        found = (await inspector.recent(names=[job])).get(job, [])
        return [result for result in found if result.status == "ok"]

    return lambda: store_read(spec, prefix, read, cluster)


def run_example(
    processes: list[Process], file: str, env: dict[str, str], tmp_path: Path
) -> Process:
    process = Process(file, [sys.executable, str(EXAMPLES / file)], env, EXAMPLES, tmp_path)
    processes.append(process)
    return process


def runnable(argv: Sequence[str], name: str, tmp_path: Path) -> tuple[list[str], dict[str, int]]:
    """``argv`` to run here: this checkout's anarchon, a free port for each port it
    names, its health file in ``tmp_path``. Returns it and the ports, by option."""
    args = list(argv[1:])
    ports: dict[str, int] = {}
    for index, word in enumerate(args[:-1]):
        if word in ("--health-port", "--metrics-port"):
            ports[word] = free_port()
            args[index + 1] = str(ports[word])
        elif word == "--health-file":
            args[index + 1] = str(tmp_path / f"{name}.health")
    return [sys.executable, "-m", "anarchon", *args], ports


def get(port: int, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return int(response.status), response.read().decode()


def test_the_compose_kubernetes_and_systemd_command_lines_run_the_app_as_one_fleet(
    prefix: str, tmp_path: Path, processes: list[Process]
) -> None:
    """The three command lines, as written but for ports and paths, each one copy of the
    app: each slot of its job runs once in the fleet, the probes and the health check
    answer, each copy serves its metrics, and SIGTERM stops each one with exit code 0."""
    url = running_server(MATRIX_FIRST)
    env = {"REDIS_URL": url, "ANARCHON_PREFIX": prefix}
    ports: dict[str, dict[str, int]] = {}
    fleet: dict[str, Process] = {}
    container = kubernetes_container()
    lines = {
        "compose": compose_command(),
        "kubernetes": container["command"] + container.get("args", []),
        "systemd": systemd_command(),
    }
    for name, argv in lines.items():
        command, ports[name] = runnable(argv, name, tmp_path)
        fleet[name] = Process(name, command, env, APP_DIR, tmp_path)
        processes.append(fleet[name])
    copies = list(fleet.values())

    async def instances(inspector: Inspector) -> int:
        return len(await inspector.instances())

    wait_for(lambda: store_read(url, prefix, instances) == 3, 30, "three instances", *copies)
    ok = wait_for(ran_ok(url, prefix, "heartbeat"), 30, "a heartbeat", *copies)
    # Each slot once: one attempt, run by one copy, logged by that copy alone.
    assert [result.attempt for result in ok] == [1] * len(ok)
    for result in ok:
        said = f"heartbeat {result.slot:%H:%M:%S} on {result.runner},"
        assert sum(p.output().count(said) for p in copies) == 1, said
    # Kubernetes' probes, on the port and paths of the manifest.
    health_port = ports["kubernetes"]["--health-port"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        status, body = get(health_port, container[probe]["httpGet"]["path"])
        assert status == 200 and json.loads(body)["state"] == "running", (probe, body)
    # Compose's health check, on the health file the command keeps.
    check = compose()["services"]["app"]["healthcheck"]["test"][1:]
    health_file = str(tmp_path / "compose.health")
    done = subprocess.run(
        [sys.executable, "-m", "anarchon", *check[1:-1], health_file],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # Each copy serves anarchon's metrics; the copies that ran a heartbeat counted it.
    exported = exported_names()
    runs = 0.0
    for name in fleet:
        status, text = get(ports[name]["--metrics-port"], "/metrics")
        assert status == 200
        samples = re.findall(r"^(anarchon_\w+)(?:\{([^}]*)\})? (\S+)$", text, re.M)
        assert {sample for sample, _, _ in samples} <= exported
        runs += sum(
            float(value)
            for sample, labels, value in samples
            if sample == "anarchon_runs_total" and 'job="heartbeat"' in labels
        )
    assert runs >= len(ok)
    # SIGTERM, as docker stop, the kubelet and systemd send it: a graceful stop, exit 0.
    for process in copies:
        process.popen.send_signal(signal.SIGTERM)
    for process in copies:
        assert process.wait() == 0, str(process)
        assert "stopped" in process.output()
    assert not (tmp_path / "compose.health").exists()  # removed on stop


# ------------------------------------------------------------------ the Python examples


def stop_cleanly(process: Process) -> None:
    assert process.stop() == 0, str(process)
    assert "Traceback" not in process.output(), str(process)


@pytest.mark.slow("starts a primary, a replica and two Sentinels, then waits for a slot")
def test_the_sentinel_example_runs_its_job_through_the_sentinels(
    prefix: str, tmp_path: Path, processes: list[Process]
) -> None:
    binary = MATRIX_FIRST.binary
    if binary is None:
        pytest.skip(f"{MATRIX_FIRST.id} is a running server (a URL): no Sentinels to start")
    with _sentinels.SentinelGroup(binary, tmp_path) as group:
        url = str(group.url)
        example = run_example(
            processes, "sentinel.py", {"REDIS_URL": url, "ANARCHON_PREFIX": prefix}, tmp_path
        )
        ok = wait_for(ran_ok(url, prefix, "sync"), 30, "a run of sync", example)
        assert f"sync {ok[0].slot:%H:%M:%S} attempt 1 fence {ok[0].fence}" in example.output()
        assert "sentinel" in example.output()  # the start says where the server was found
        stop_cleanly(example)


def test_the_cluster_example_runs_its_jobs_through_its_own_cluster_client(
    prefix: str, tmp_path: Path, processes: list[Process]
) -> None:
    clusters = cluster_matrix()
    if not clusters:
        pytest.skip("no server binary of this run's matrix to start a cluster with")
    url = f"redis://127.0.0.1:{running_cluster(clusters[0])[0]}"
    env = {"REDIS_URL": url, "ANARCHON_PREFIX": prefix}
    example = run_example(processes, "cluster.py", env, tmp_path)
    for job in ("orders", "invoices"):
        ok = wait_for(ran_ok(url, prefix, job, cluster=True), 30, f"a run of {job}", example)
        assert f"{job} {ok[0].slot:%H:%M:%S} attempt 1 fence {ok[0].fence}" in example.output()
    stop_cleanly(example)


def test_the_tls_example_runs_its_job_over_tls(
    tls_server: tuple[int, Path, Path], prefix: str, tmp_path: Path, processes: list[Process]
) -> None:
    port, ca, _ = tls_server
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    example = run_example(
        processes, "tls.py", {"REDIS_URL": url, "ANARCHON_PREFIX": prefix}, tmp_path
    )
    ok = wait_for(ran_ok(url, prefix, "rotate"), 30, "a run of rotate", example)
    assert f"rotate {ok[0].slot:%H:%M:%S} attempt 1 fence {ok[0].fence}" in example.output()
    stop_cleanly(example)


def acl_refusals(admin: redis.Redis, user: str) -> list[str]:
    """What the server refused ``user``, from its ACL log."""
    found = []
    for entry in admin.acl_log():
        if str(entry.get("username")) == user:
            found.append(f"{entry.get('reason')} {entry.get('object')}")
    return found


def test_the_acl_example_runs_its_job_and_timer_as_the_user_the_acl_script_makes(
    prefix: str, tmp_path: Path, processes: list[Process]
) -> None:
    """``examples/acl-apply.sh`` makes the user from what ``anarchon acl`` prints (the
    page's recipe); the example, connected as that user, runs its job and fires its
    timer, and the server refused it nothing."""
    spec = MATRIX_FIRST
    if spec.family == "redis" and spec.version < (6, 2):
        pytest.skip("channel ACLs need Redis 6.2+")
    cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if cli is None:
        pytest.skip("no redis-cli or valkey-cli on PATH: the ACL script sends the rules with it")
    url = running_server(spec)
    user, password = f"u{prefix.strip(':')}", "s3cret/&with|sed+chars"
    admin = redis.Redis.from_url(url, decode_responses=True, protocol=2)
    try:
        done = subprocess.run(
            ["sh", str(EXAMPLES / "acl-apply.sh")],
            env=dict(
                os.environ,
                PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
                PYTHONPATH=str(ROOT / "src"),
                ANARCHON_PREFIX=prefix, ACL_USER=user, ACL_PASSWORD=password,
                ADMIN_URL=url, REDIS_CLI=cli,
            ),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (done.returncode, done.stdout.strip()) == (0, "OK"), done.stdout + done.stderr
        # The server holds the password's hash, which the script sent in its place.
        rules = admin.acl_getuser(user)
        assert rules is not None and rules["passwords"] == [
            hashlib.sha256(password.encode()).hexdigest()
        ]
        host_port = url.removeprefix("redis://").removesuffix("/0")
        user_url = f"redis://{user}:{urllib.parse.quote(password, safe='')}@{host_port}/0"
        example = run_example(
            processes, "acl.py", {"REDIS_URL": user_url, "ANARCHON_PREFIX": prefix}, tmp_path
        )
        ok = wait_for(ran_ok(url, prefix, "audit"), 30, "a run of audit", example)
        key = f"audit-{ok[-1].slot_ms}"
        wait_for(lambda: f"follow-up {key} fired" in example.output(), 15, "the timer", example)
        stop_cleanly(example)
        assert acl_refusals(admin, user) == []
    finally:
        admin.acl_deluser(user)
        admin.close()


def console_spans(text: str) -> list[dict[str, Any]]:
    """The spans the console exporter printed: JSON objects one after another."""
    decoder = json.JSONDecoder()
    spans, index = [], 0
    while index < len(text):
        if text[index].isspace():
            index += 1
            continue
        span, index = decoder.raw_decode(text, index)
        spans.append(span)
    return spans


def test_the_opentelemetry_example_prints_each_attempt_with_the_handlers_span_inside(
    prefix: str, tmp_path: Path, processes: list[Process]
) -> None:
    """The attempt's span (with the store's own slot, fence and runner) and the handler's
    span inside it, flushed by the example's shutdown after SIGTERM."""
    url = running_server(MATRIX_FIRST)
    example = run_example(
        processes, "otel_tracing.py", {"REDIS_URL": url, "ANARCHON_PREFIX": prefix}, tmp_path
    )
    ok = wait_for(ran_ok(url, prefix, "invoice"), 30, "a run of invoice", example)
    stop_cleanly(example)
    spans = console_spans(example.stdout.read_text())
    runs = {
        span["attributes"]["anarchon.slot_ms"]: span
        for span in spans
        if span["name"] == "anarchon run invoice"
    }
    run = runs[ok[0].slot_ms]
    assert run["attributes"]["anarchon.fence"] == ok[0].fence
    assert run["attributes"]["anarchon.runner"] == ok[0].runner
    assert run["attributes"]["anarchon.outcome"] == "ok"
    assert run["parent_id"] is None
    assert run["resource"]["attributes"]["service.name"] == "billing"
    (inner,) = [
        span
        for span in spans
        if span["name"] == "send invoices" and span["parent_id"] == run["context"]["span_id"]
    ]
    assert inner["context"]["trace_id"] == run["context"]["trace_id"]
    assert any(span["name"] == "anarchon claim" for span in spans)
