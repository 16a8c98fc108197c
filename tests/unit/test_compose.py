"""docker-compose.yml, the Dockerfile and deploy/ against the code they run (CI has no Docker engine).

Every ``qm`` command of the compose file goes through the real CLI parser; the mounted topology and
token files through their real loaders; the managers' health checks through the real HTTP front
(queue_manager/manager/http.py); the receivers' handler through the receivers' own loader. A
renamed option, a changed route, a host that is not a service or a clashing port fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import io
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from queue_manager.cli.main import _managers, build_parser
from queue_manager.domain.topology import Topology
from queue_manager.manager.auth import TokenStore
from queue_manager.manager.http import HttpFront
from receivers import Event, load_handler

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

# ---------------------------------------------------------------- reading the files


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key written twice in one mapping is an error (safe_load keeps the last).

    Keys brought in by a merge (``<<: *anchor``) may be overridden: that is what merges are for."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} written twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_compose(text: str) -> dict[str, Any]:
    data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: safe
    assert isinstance(data, dict)
    return data


def interpolate(value: str) -> str:
    """What compose makes of a string: ``$$`` becomes ``$``; a lone ``$NAME`` or ``${NAME}`` would be
    replaced by compose's environment, which this project's file never means (it is refused)."""
    out = []
    i = 0
    while i < len(value):
        c = value[i]
        if c == "$":
            nxt = value[i + 1 : i + 2]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "{" or re.match(r"[A-Za-z_(]", nxt):
                raise ValueError(
                    f"unescaped $ in {value!r} at {i}: compose interpolates it; write $$ for the container's shell"
                )
        out.append(c)
        i += 1
    return "".join(out)


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = compose["services"]
    assert isinstance(services, dict) and services
    return services


def qm_image(services: dict[str, dict[str, Any]]) -> str:
    """The image tag the compose file builds from the Dockerfile (one for every qm service)."""
    tags = {s["image"] for s in services.values() if "build" in s}
    assert len(tags) == 1, f"the services that build the project image must share one tag, got {tags}"
    return tags.pop()


def qm_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    tag = qm_image(services)
    return {name: s for name, s in services.items() if s.get("image") == tag}


def _shell_qm_lines(script: str) -> list[list[str]]:
    """The ``qm`` commands of a shell script, one a line; ``$((...))`` and ``$x`` stand for ``1``."""
    out = []
    for raw in script.splitlines():
        line = raw.strip().removeprefix("exec ")
        if not line.startswith("qm "):
            continue
        line = re.sub(r"\$\(\([^)]*\)\)", "1", line)
        line = re.sub(r"\$\{[A-Za-z_]\w*\}|\$[A-Za-z_]\w*", "1", line)
        out.append(shlex.split(line)[1:])
    return out


def qm_invocations(service: dict[str, Any]) -> list[list[str]]:
    """The argument lists (after ``qm``) a project-image service runs."""
    entrypoint = service.get("entrypoint")
    command = service.get("command", [])
    if isinstance(command, str):
        command = shlex.split(command)
    command = [interpolate(c) for c in command]
    if entrypoint is None:  # the image's: qm
        return [command]
    assert entrypoint[0] == "sh" and entrypoint[1] in ("-c", "-ec", "-euc"), f"unexpected entrypoint {entrypoint}"
    assert len(command) == 1, "a shell entrypoint takes the script as its one argument"
    lines = _shell_qm_lines(command[0])
    assert lines, f"the script runs no qm command: {command[0]!r}"
    return lines


def parse(argv: list[str]) -> Any:
    """The real parser's namespace; an AssertionError with argparse's message if it refuses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"qm {shlex.join(argv)}: refused by the parser: {err.getvalue().strip()}") from None


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host source of the service's bind mounts (short syntax)."""
    out = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        out[parts[1]] = parts[0]
    return out


def published_ports(service: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(host address, host port, protocol) of each port the service publishes."""
    out = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            if p.get("published") is not None:
                out.append((p.get("host_ip", "0.0.0.0"), int(p["published"]), p.get("protocol", "tcp")))
            continue
        spec, _, proto = str(p).partition("/")
        parts = spec.rsplit(":", 2)
        if len(parts) == 1:
            continue  # a container port only: docker picks a free host port
        host_ip, host_port = (parts[0], parts[1]) if len(parts) == 3 else ("0.0.0.0", parts[0])
        assert "-" not in host_port, f"port ranges are not used here: {p}"
        out.append((host_ip, int(host_port), proto or "tcp"))
    return out


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def env(service: dict[str, Any]) -> dict[str, str]:
    e = service.get("environment", {})
    if isinstance(e, list):
        return dict(item.split("=", 1) for item in e)
    return {k: str(v) for k, v in e.items()}


def topology_path(service: dict[str, Any], args: Any) -> str:
    path = getattr(args, "topology", None) or env(service).get("QM_TOPOLOGY")
    assert path, "the command names no topology (--topology or $QM_TOPOLOGY)"
    return str(path)


def host_file(service: dict[str, Any], container_path: str) -> Path:
    m = mounts(service)
    assert container_path in m, f"{container_path} is not mounted into the service (mounts: {m})"
    return (ROOT / m[container_path]).resolve()


def all_invocations(services: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any], Any]]:
    return [(name, s, parse(argv)) for name, s in qm_services(services).items() for argv in qm_invocations(s)]


def by_command(services: dict[str, dict[str, Any]], *command: str) -> list[tuple[str, dict[str, Any], Any]]:
    def matches(args: Any) -> bool:
        path = [args.command, getattr(args, "spark_command", None), getattr(args, "queue_command", None)]
        return [c for c in path if c][: len(command)] == list(command)

    return [(n, s, a) for n, s, a in all_invocations(services) if matches(a)]


@pytest.fixture(scope="module")
def topology() -> Topology:
    return Topology.load(ROOT / "deploy" / "topology.toml")


# ---------------------------------------------------------------- the helpers fail when they should


def test_the_loader_refuses_a_key_written_twice() -> None:
    with pytest.raises(yaml.constructor.ConstructorError, match="written twice"):
        load_compose("services:\n  a: {image: x}\n  a: {image: y}\n")
    # overriding a merged key is fine
    merged = load_compose("x: &x {image: a, restart: always}\nservices:\n  s:\n    <<: *x\n    restart: 'no'\n")
    assert merged["services"]["s"] == {"image": "a", "restart": "no"}


def test_a_lone_dollar_is_refused_and_a_doubled_one_is_the_shells() -> None:
    assert interpolate("i=$$((i + 1)); echo $$i") == "i=$((i + 1)); echo $i"
    for bad in ("echo $i", "echo ${HOME}", "i=$((i + 1))"):
        with pytest.raises(ValueError, match="unescaped"):
            interpolate(bad)


def test_broken_copies_of_the_commands_are_refused(services: dict[str, dict[str, Any]]) -> None:
    """The parser check has teeth: a typo, a bad value or a missing option of a real command fails."""
    manager = qm_invocations(services["manager-s0"])[0]
    parse(manager)
    with pytest.raises(AssertionError, match="unrecognized arguments"):
        parse([*manager, "--prot", "8765"])
    with pytest.raises(AssertionError, match="invalid int value"):
        parse([a if a != "8765" else "eighty" for a in manager])
    without_shard = [a for i, a in enumerate(manager) if a != "--shard" and manager[i - 1] != "--shard"]
    with pytest.raises(AssertionError, match="--shard"):
        parse(without_shard)
    receive = qm_invocations(services["receiver"])[0]
    with pytest.raises(AssertionError, match="invalid choice"):
        parse([*receive, "--log-level", "CHATTY"])
    spark = qm_invocations(services["spark-enqueue"])[0]
    with pytest.raises(AssertionError, match="invalid choice"):
        parse([a if a != "json" else "avro" for a in spark])


# ---------------------------------------------------------------- the compose file


def test_every_qm_command_is_accepted_by_the_real_parser(services: dict[str, dict[str, Any]]) -> None:
    seen = set()
    for name, service in qm_services(services).items():
        for argv in qm_invocations(service):
            args = parse(argv)
            seen.add((args.command, getattr(args, "queue_command", None), getattr(args, "spark_command", None)))
            assert args.func is not None, name
    # the compose file runs what it says it runs
    assert {
        ("migrate", None, None),
        ("queue", "create", None),
        ("manager", None, None),
        ("receive", None, None),
        ("enqueue", None, None),
        ("spark", None, "enqueue"),
    } <= seen


def test_no_string_is_mangled_by_compose_interpolation(compose: dict[str, Any]) -> None:
    for s in _strings(compose):
        interpolate(s)


def test_service_names_unique_and_every_dependency_exists(compose: dict[str, Any]) -> None:
    services = compose["services"]  # unique keys: the loader refuses a name written twice
    names = set(services)
    container_names = [s["container_name"] for s in services.values() if "container_name" in s]
    assert len(container_names) == len(set(container_names)), container_names
    for name, service in services.items():
        for dep, condition in depends_on(service).items():
            assert dep in names, f"{name} depends on {dep!r}, which is no service"
            assert dep != name
            assert condition in ("service_started", "service_healthy", "service_completed_successfully")
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no health check"
            if not service.get("profiles"):
                assert not services[dep].get("profiles"), f"{name} runs by default but needs {dep}, a profile's"
    for vol in (v for s in services.values() for v in s.get("volumes", [])):
        source = vol.split(":")[0]
        if source.startswith((".", "/")):
            assert (ROOT / source).exists(), f"bind mount source {source} does not exist"
        else:
            assert source in (compose.get("volumes") or {}), f"named volume {source} is not declared"


def test_the_migration_runs_first_and_once(services: dict[str, dict[str, Any]]) -> None:
    (migrator,) = [name for name, _, args in by_command(services, "migrate")]
    assert services[migrator].get("restart", "no") == "no", "a one-shot service must not be restarted"
    assert [n for n, _, _ in by_command(services, "queue", "create")] == [migrator], "queues are created there too"
    (migrate_args,) = [a for _, _, a in by_command(services, "migrate")]
    (create_args,) = [a for _, _, a in by_command(services, "queue", "create")]
    assert create_args.if_not_exists, "a restarted stack must not fail on the queue it created before"
    assert migrate_args.topology == create_args.topology

    def needs(name: str, seen: frozenset[str] = frozenset()) -> dict[str, str]:
        out = {}
        for dep, cond in depends_on(services[name]).items():
            assert dep not in seen, f"dependency cycle through {dep}"
            out[dep] = cond
            out.update({k: v for k, v in needs(dep, seen | {name}).items() if k not in out})
        return out

    for name in qm_services(services):
        if name != migrator:
            assert needs(name).get(migrator) == "service_completed_successfully", f"{name} must wait for {migrator}"
    for dep, cond in depends_on(services[migrator]).items():
        assert services[dep]["image"].startswith("postgres:") and cond == "service_healthy"


def test_published_ports_do_not_clash(services: dict[str, dict[str, Any]]) -> None:
    taken: dict[tuple[int, str], str] = {}
    for name, service in services.items():
        ports = published_ports(service)
        replicas = service.get("deploy", {}).get("replicas", 1)
        assert not (ports and replicas > 1), f"{name}: {replicas} replicas cannot publish the same host port"
        for _, port, proto in ports:
            assert (port, proto) not in taken, f"host port {port}/{proto}: {name} and {taken[(port, proto)]}"
            taken[(port, proto)] = name
    assert published_ports({"ports": ["127.0.0.1:1:2", "3:4/udp", "5", {"published": 6, "target": 7}]}) == [
        ("127.0.0.1", 1, "tcp"),
        ("0.0.0.0", 3, "udp"),
        ("0.0.0.0", 6, "tcp"),
    ]


def test_postgres_shards_are_healthchecked_and_allow_prepared_transactions(
    services: dict[str, dict[str, Any]],
) -> None:
    pgs = {n: s for n, s in services.items() if str(s.get("image", "")).startswith("postgres:")}
    assert len(pgs) >= 2
    atomic = any(a.atomic for _, _, a in by_command(services, "spark", "enqueue"))
    for name, s in pgs.items():
        assert s["image"] == "postgres:17", name
        assert s["healthcheck"]["test"][:2] == ["CMD", "pg_isready"], name
        settings = dict(a.split("=", 1) for a in s.get("command", []) if "=" in a)
        if atomic:
            assert int(settings.get("max_prepared_transactions", 0)) > 0, f"{name}: --atomic needs prepared xacts"


def test_the_topology_is_mounted_and_its_dsns_point_at_the_compose_databases(
    services: dict[str, dict[str, Any]], topology: Topology
) -> None:
    for name, service, args in all_invocations(services):
        assert host_file(service, topology_path(service, args)) == ROOT / "deploy" / "topology.toml", name
    hosts = []
    for shard in topology.shards:
        info = conninfo_to_dict(shard.dsn)
        host = info.get("host")
        assert host in services, f"shard {shard.name}: host {host!r} is not a compose service"
        pg = services[str(host)]
        assert str(pg["image"]).startswith("postgres:"), f"shard {shard.name}: {host} is not a PostgreSQL service"
        assert int(info.get("port", 5432)) == 5432, "services talk to each other on the container port"
        pg_env = env(pg)
        assert info.get("user") == pg_env.get("POSTGRES_USER", "postgres"), shard.name
        assert info.get("password") == pg_env.get("POSTGRES_PASSWORD"), shard.name
        assert info.get("dbname") == pg_env.get("POSTGRES_DB", info.get("user")), shard.name
        hosts.append(host)
    assert len(set(hosts)) == len(hosts), "each shard needs a database of its own"


def test_each_shard_has_an_active_manager_and_a_standby(
    services: dict[str, dict[str, Any]], topology: Topology
) -> None:
    per_shard: dict[str, list[str]] = {}
    for name, service, args in by_command(services, "manager"):
        topology.by_name(args.shard)
        assert args.host == "0.0.0.0", f"{name}: other containers cannot reach a manager on {args.host}"
        tokens = args.tokens or env(service).get("QM_TOKENS")
        assert tokens, name
        assert host_file(service, tokens) == ROOT / "deploy" / "tokens.toml", name
        per_shard.setdefault(args.shard, []).append(name)
    assert {s.name for s in topology.shards} == set(per_shard)
    assert all(len(m) >= 2 for m in per_shard.values()), per_shard


def test_the_token_file_loads_as_the_manager_loads_it_and_admits_the_receivers(
    services: dict[str, dict[str, Any]],
) -> None:
    store = TokenStore.load(ROOT / "deploy" / "tokens.toml")
    receivers = by_command(services, "receive")
    assert receivers
    for name, service, args in receivers:
        secret = args.token or env(service).get("QM_TOKEN")
        assert secret, f"{name}: no token (--token or $QM_TOKEN)"
        grant = store.lookup(secret)
        assert grant is not None, f"{name}: its token is not in deploy/tokens.toml (the managers would answer 401)"
        assert grant.allows_queue(args.queue), f"{name}: token {grant.name!r} does not cover queue {args.queue}"


def test_receivers_name_every_manager_of_every_shard(services: dict[str, dict[str, Any]], topology: Topology) -> None:
    managers = {name: args for name, _, args in by_command(services, "manager")}
    for name, service, args in by_command(services, "receive"):
        urls = _managers(args.manager or [], Topology.load(host_file(service, topology_path(service, args))))
        for shard, addresses in urls.items():
            listed = set()
            for address in addresses:
                u = urlsplit(address)
                assert u.scheme == "ws" and u.hostname in managers, f"{name}: {address} is no manager service"
                margs = managers[u.hostname]
                assert margs.shard == shard, f"{name}: {address} is a manager of {margs.shard}, not {shard}"
                assert u.port == margs.port, f"{name}: {address}: that manager listens on {margs.port}"
                listed.add(u.hostname)
            expected = {m for m, a in managers.items() if a.shard == shard}
            assert listed == expected, f"{name}: shard {shard}: lists {sorted(listed)}, managers {sorted(expected)}"


def test_queues_used_are_the_queues_created(services: dict[str, dict[str, Any]]) -> None:
    created = {a.name for _, _, a in by_command(services, "queue", "create")}
    used = {a.queue for c in (("receive",), ("enqueue",), ("spark", "enqueue")) for _, _, a in by_command(services, *c)}
    assert used and used <= created, (used, created)
    for _, _, args in by_command(services, "enqueue"):
        json.loads(args.payload)  # the producer's payload is JSON once its shell variables are filled in


class _FakeConnection:
    """What HttpFront needs of a websockets ServerConnection: ``respond``."""

    def respond(self, status: http.HTTPStatus, text: str) -> Response:
        return Response(status.value, status.phrase, Headers({"Content-Type": "text/plain"}), text.encode())


def _answer(path: str, role: str) -> int:
    front = HttpFront(
        TokenStore.load(ROOT / "deploy" / "tokens.toml"),
        None,
        role=lambda: role,
        health=lambda: {"role": role},
        metrics=lambda: "",
    )
    response = front.process_request(_FakeConnection(), Request(path, Headers()))  # type: ignore[arg-type]
    assert response is not None, f"{path} was taken for a websocket session"
    return response.status_code


def test_manager_health_checks_hit_a_real_endpoint_that_a_standby_passes(
    services: dict[str, dict[str, Any]],
) -> None:
    # the real front, so that a renamed route fails here: /health/leader tells the active manager
    assert _answer("/health/leader", "leader") == 200
    assert _answer("/health/leader", "standby") == 503
    assert _answer("/healthz", "leader") == 404
    for name, service, args in by_command(services, "manager"):
        test = " ".join(service["healthcheck"]["test"])
        (url,) = re.findall(r"https?://[^\s'\"]+", test)
        u = urlsplit(url)
        assert u.hostname in ("127.0.0.1", "localhost") and u.port == args.port, f"{name}: {url}"
        assert u.path in ("/health", "/health/leader"), f"{name}: {url}"
        # every manager of a shard runs the same command, so any of them may be the standby: a check
        # that only the leader passes would keep the standby unhealthy and the receivers from starting
        assert _answer(u.path, "standby") == 200, f"{name}: a live standby fails {u.path}"
        assert _answer(u.path, "leader") == 200, f"{name}: a live leader fails {u.path}"


def test_the_receivers_handler_imports_and_runs(services: dict[str, dict[str, Any]]) -> None:
    for name, _, args in by_command(services, "receive"):
        assert not args.handler.startswith("tests."), f"{name}: the image does not ship the tests"
        handler = load_handler(args.handler, search_cwd=False)
        event = Event("orders", "s0", 1, 1, "acme", 0, 0.0, {"n": 1})
        result = handler(event)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        assert result is None, f"{name}: the handler should ack (return None)"


def test_the_spark_job_runs_only_under_its_profile_with_its_input_mounted(
    services: dict[str, dict[str, Any]],
) -> None:
    jobs = by_command(services, "spark", "enqueue")
    assert jobs
    for name, service, args in jobs:
        assert service.get("profiles"), f"{name} must not run on a plain `docker compose up`"
        source = host_file(service, str(Path(args.input).parent)) / Path(args.input).name
        assert source.is_file(), f"{name}: {args.input} is {source}, which does not exist"
        lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        assert lines and all(args.tenant_col in r and args.payload_col in r for r in lines)
        assert args.work_dir and any(args.work_dir.startswith(p) for p in mounts(service)), (
            f"{name}: the work directory must be on a volume, so a re-run finds the run's rows"
        )
    for name, service in services.items():
        if not service.get("profiles"):
            assert name not in {n for n, _, _ in jobs}


# ---------------------------------------------------------------- the Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_the_dockerfile_builds_the_qm_image(services: dict[str, dict[str, Any]]) -> None:
    ins = dockerfile_instructions()
    get = lambda op: [rest for o, rest in ins if o == op]  # noqa: E731
    (base,) = get("FROM")
    assert re.fullmatch(r"python:3\.1[12]-slim(-\w+)?", base), base
    assert json.loads(get("ENTRYPOINT")[-1]) == ["qm"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "qm" in scripts, "the image's entrypoint is the qm console script"
    users = get("USER")
    assert users and users[-1] not in ("root", "0"), "the image must run as an unprivileged user"
    runs = " ".join(get("RUN"))
    for package in ("openjdk-17-jre-headless", "libpostgresql-jdbc-java"):
        assert package in runs, f"the Spark runner needs {package}"
    assert re.search(r"pip install (-e|--editable) \"?\.\[spark(,\w+)*\]", runs), (
        "install editable: qm migrate reads alembic.ini beside the packages (queue_manager/db/migrate.py)"
    )
    copied = {Path(src).name for rest in get("COPY") for src in rest.split()[:-1]}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = packages | {"pyproject.toml", pyproject["project"]["readme"], "alembic.ini", "alembic"}
    assert needed <= copied, f"not copied into the image: {sorted(needed - copied)}"
    for name in qm_services(services):
        assert services[name].get("build") in (".", {"context": "."}), f"{name} is not built from ./Dockerfile"
