"""docker-compose.yml without a Docker engine: the compose-spec schema, then every cross-reference a
typo would break at `docker compose up` — env names against the app's settings and CLI, commands
against the CLI's options, mounts against the tree, Prometheus targets, proxy upstreams and
provisioning paths against the services and the ports they really listen on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml

from app.cli import app as cli_app
from app.cluster.registry import parse_workers
from app.config import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]  # type: ignore[no-any-return]


def _cli() -> click.Group:
    return typer.main.get_command(cli_app)  # type: ignore[return-value]


def _interpolate(s: str) -> str:
    """Compose's `${VAR:-default}` → default and `${VAR:?msg}` → a placeholder, as `up` would see them
    with nothing set (the `:?` ones must be set by the operator)."""
    s = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", s)
    return re.sub(r"\$\{[A-Z0-9_]+:\?[^}]*\}", "set-by-operator", s)


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: _interpolate(str(v)) for k, v in env.items()}


def _args(svc: dict[str, Any]) -> list[str]:
    return [_interpolate(str(a)) for a in svc.get("command") or []]


def _opt(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _by_cmd(services: dict[str, dict[str, Any]], cmd: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if _args(s)[:1] == [cmd]}


def test_compose_file_matches_the_compose_spec_schema() -> None:
    exe = Path(sys.executable).with_name("check-jsonschema")
    res = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_stack_has_every_component(services: dict[str, dict[str, Any]]) -> None:
    roles = [_opt(_args(s), "--role") for s in _by_cmd(services, "worker").values()]
    assert sorted(roles) == ["decode", "decode", "prefill", "prefill"]
    assert len(_by_cmd(services, "gateway")) == 2
    for name in ("redis", "proxy", "prometheus", "grafana"):
        assert name in services, name
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd, "Redis must persist (AOF)"
    assert any(str(v).endswith(":/data") for v in services["redis"]["volumes"])


def test_flexlb_env_names_are_real_settings_or_cli_envvars(services: dict[str, dict[str, Any]]) -> None:
    known = {f"FLEXLB_{name.upper()}" for name in Settings.model_fields}
    for cmd in _cli().commands.values():
        for p in cmd.params:
            envs = p.envvar if isinstance(p.envvar, list | tuple) else [p.envvar]
            known |= {e for e in envs if e}
    used = {k for s in services.values() for k in _env(s) if k.startswith("FLEXLB_")}
    assert used, "compose sets no FLEXLB_ variable at all"
    assert used <= known, f"not a setting or CLI envvar: {sorted(used - known)}"
    # and each value is one the settings accept
    for name, svc in _by_cmd(services, "gateway").items():
        env = {k[len("FLEXLB_") :].lower(): v for k, v in _env(svc).items() if k.startswith("FLEXLB_")}
        Settings(**{k: v for k, v in env.items() if k in Settings.model_fields})
        assert env.get("host") == "0.0.0.0", f"{name} must listen beyond loopback"


def test_commands_parse_with_the_cli(services: dict[str, dict[str, Any]]) -> None:
    group = _cli()
    for name, svc in services.items():
        args = _args(svc)
        if not args or args[0] not in group.commands:
            assert svc.get("image", "").startswith(("redis", "caddy", "prom/", "grafana/")), name
            continue
        cmd = group.commands[args[0]]
        cmd.make_context(args[0], args[1:])  # raises on an unknown option or a bad value
        if args[0] == "worker":
            assert _opt(args, "--host") == name, f"{name} must advertise its own service name"
            assert _opt(args, "--bind") == "0.0.0.0"


def test_workers_seeded_on_gateways_are_the_worker_services(services: dict[str, dict[str, Any]]) -> None:
    workers = _by_cmd(services, "worker")
    for name, svc in _by_cmd(services, "gateway").items():
        specs = parse_workers(_env(svc)["FLEXLB_WORKERS"])
        assert {s.host for s in specs} == set(workers), name
        for s in specs:
            wargs = _args(workers[s.host])
            assert s.role == _opt(wargs, "--role")
            assert s.port == int(_opt(wargs, "--grpc-port"))
        assert _env(svc)["FLEXLB_REDIS_URL"].startswith("redis://redis:")
        assert _env(svc)["FLEXLB_ADVERTISE_ADDRESS"] == f"{name}:{_env(svc)['FLEXLB_PORT']}"
    ids = [_env(s)["FLEXLB_REPLICA_ID"] for s in _by_cmd(services, "gateway").values()]
    assert len(set(ids)) == len(ids), "replica ids must differ"


def test_health_checks_and_depends_on(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no health check"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep} to be healthy; it has no check"
                )
    for name, svc in _by_cmd(services, "worker").items():
        test = " ".join(svc["healthcheck"]["test"])
        assert f":{_opt(_args(svc), '--http-port')}/v2/health/ready" in test, name
    for name, svc in _by_cmd(services, "gateway").items():
        assert f":{_env(svc)['FLEXLB_PORT']}/readyz" in " ".join(svc["healthcheck"]["test"]), name
        deps = svc["depends_on"]
        for w in [*_by_cmd(services, "worker"), "redis"]:
            assert deps[w]["condition"] == "service_healthy", f"{name} must wait for {w}"
    for g in _by_cmd(services, "gateway"):
        assert services["proxy"]["depends_on"][g]["condition"] == "service_healthy"


def test_mounts_exist_and_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for v in svc.get("volumes") or []:
            src = v.split(":")[0]
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in declared, f"{name} uses undeclared volume {src}"
        if "build" in svc:
            assert (ROOT / svc["build"] / "Dockerfile").is_file()


def test_dockerfile_copies_what_exists_and_runs_flexlb() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    assert 'ENTRYPOINT ["flexlb"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def _container_path(svc: dict[str, Any], host_path: str) -> str:
    for v in svc["volumes"]:
        src, dst = v.split(":")[:2]
        if src.rstrip("/") == host_path:
            return str(dst)
    raise AssertionError(f"{host_path} is not mounted")


def test_prometheus_targets_name_real_services_and_ports(services: dict[str, dict[str, Any]]) -> None:
    prom = services["prometheus"]
    cfg_in = _container_path(prom, "./deploy/prometheus.yml")
    assert any(a == f"--config.file={cfg_in}" for a in prom["command"])
    cfg = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    scraped: dict[str, dict[str, str]] = {}
    for job in cfg["scrape_configs"]:
        for sc in job["static_configs"]:
            for t in sc["targets"]:
                scraped[t] = {"job": job["job_name"], **sc.get("labels", {})}
    gateways = _by_cmd(services, "gateway")
    workers = _by_cmd(services, "worker")
    for name, svc in gateways.items():
        assert scraped.get(f"{name}:{_env(svc)['FLEXLB_PORT']}", {}).get("job") == "flexlb-gateway", name
    for name, svc in workers.items():
        args = _args(svc)
        labels = scraped.get(f"{name}:{_opt(args, '--metrics-port')}")
        assert labels is not None, f"{name}'s Triton metrics port is not scraped"
        assert labels["role"] == _opt(args, "--role")
        assert labels["worker"] == f"{_opt(args, '--role')}@{name}:{_opt(args, '--grpc-port')}"
    for t in scraped:
        host = t.split(":")[0]
        assert host in services or host == "localhost", f"target {t} names no service"


def test_proxy_spreads_over_every_gateway(services: dict[str, dict[str, Any]]) -> None:
    proxy = services["proxy"]
    assert _container_path(proxy, "./deploy/Caddyfile") == "/etc/caddy/Caddyfile"
    text = (ROOT / "deploy/Caddyfile").read_text()
    upstream_line = next(ln for ln in text.splitlines() if ln.strip().startswith("reverse_proxy "))
    upstreams = set(upstream_line.split()[1:-1])
    want = {f"{n}:{_env(s)['FLEXLB_PORT']}" for n, s in _by_cmd(services, "gateway").items()}
    assert upstreams == want
    assert "health_uri /readyz" in text and "flush_interval -1" in text
    listen = re.search(r"^:(\d+) \{", text, re.M)
    assert listen is not None
    assert any(str(p).endswith(f":{listen.group(1)}") for p in proxy["ports"])
    assert "/proxy-health" in " ".join(proxy["healthcheck"]["test"])


def test_grafana_provisioning_paths_and_datasource(services: dict[str, dict[str, Any]]) -> None:
    graf = services["grafana"]
    assert _container_path(graf, "./grafana/provisioning") == "/etc/grafana/provisioning"
    dash_dir = _container_path(graf, "./grafana/dashboards")
    providers = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/flexlb.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [dash_dir]
    home = _env(graf)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dash_dir + "/") and (ROOT / "grafana/dashboards" / Path(home).name).is_file()
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    url = ds[0]["url"]
    host, port = url.split("//")[1].split(":")
    assert host == "prometheus"
    assert port in [str(p) for p in services["prometheus"]["expose"]]


# ---- the security posture (issue 16): what is reachable from outside, and how ----------------
def _caddy_blocks(text: str) -> list[tuple[str, str]]:
    """The site's top-level directives in order, as (head line, body): enough to check routing."""
    site = text[text.index(":8000 {") :]
    out, depth, head, body = [], 0, "", []
    for line in site.splitlines()[1:]:
        st = line.strip()
        if depth == 0 and st == "}":
            break
        if depth == 0 and st and not st.startswith("#"):
            head, body = st, []
        elif depth > 0:
            body.append(st)
        depth += st.count("{") - st.count("}")
        if depth == 0 and head:
            out.append((head, "\n".join(body)))
            head = ""
    return out


def test_proxy_refuses_admin_and_metrics_and_large_bodies() -> None:
    text = (ROOT / "deploy/Caddyfile").read_text()
    blocks = _caddy_blocks(text)
    matcher = next(h for h, _ in blocks if h.startswith("@control path "))
    paths = matcher.split()[2:]
    for p in ("/admin", "/admin/*", "/metrics"):
        assert p in paths, f"{p} is routed to the replicas"
    heads = [h for h, _ in blocks]
    control = heads.index("handle @control {")
    catch_all = heads.index("handle {")
    assert control < catch_all, "the 404 for /admin must come before the catch-all"
    assert 'respond "not found" 404' in blocks[control][1]
    assert "reverse_proxy" not in blocks[control][1]
    body = blocks[catch_all][1]
    m = re.search(r"max_size (\d+)MiB", body)
    assert m is not None and "request_body" in body, "the proxy must limit request bodies"
    assert int(m.group(1)) * 1024 * 1024 == Settings().max_body_bytes


def test_only_the_proxy_and_grafana_are_published(compose: dict[str, Any]) -> None:
    services = compose["services"]
    published = {n for n, s in services.items() if s.get("ports")}
    assert published == {"proxy", "grafana"}
    nets = compose["networks"]
    assert nets["backend"]["internal"] is True
    for name in [*_by_cmd(services, "worker"), *_by_cmd(services, "gateway"), "redis", "prometheus"]:
        assert services[name]["networks"] == ["backend"], f"{name} must be on the internal network only"
    graf = _env(services["grafana"])
    assert graf["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GRAFANA_ADMIN_PASSWORD:?" in str(services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"])
    for name, svc in _by_cmd(services, "gateway").items():
        assert _env(svc)["FLEXLB_AUTH"] == "keys", name
    for name in [*_by_cmd(services, "worker"), *_by_cmd(services, "gateway")]:
        assert "FLEXLB_WORKER_SECRET:?" in str(services[name]["environment"]["FLEXLB_WORKER_SECRET"]), name
