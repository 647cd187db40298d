"""The `flexlb` command: worker, gateway, local stack, bench and simulator entry points."""

from __future__ import annotations

import json
import logging
from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="FlexLB: KV-cache-aware LLM gateway",
    # Plain click help for every subcommand: rich panels cut option names in a narrow terminal,
    # and `bench`/`simulate` render theirs through the same click formatter (app/clihelp.py).
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def setup_logging(level: str = "INFO") -> None:
    from app.logging_setup import setup_logging as setup

    setup(level)


@app.callback()
def _root() -> None:
    """FlexLB: KV-cache-aware gateway for disaggregated prefill/decode LLM serving."""


@app.command()
def worker(
    role: Annotated[str, typer.Option(help="prefill or decode")],
    grpc_port: Annotated[int, typer.Option(help="0 picks a free port")] = 0,
    kv_port: Annotated[int, typer.Option(help="prefill: KV side channel port; 0 picks a free one")] = 0,
    http_port: Annotated[int, typer.Option(help="0 picks a free port")] = 0,
    metrics_port: Annotated[int, typer.Option(help="0 picks a free port")] = 0,
    host: Annotated[str, typer.Option(help="address advertised to the gateway")] = "127.0.0.1",
    bind: Annotated[str, typer.Option(help="address Triton listens on")] = "127.0.0.1",
    engine: Annotated[str, typer.Option(help="sim (modelled GPU) or hf (a real model, --model)")] = "sim",
    model: Annotated[str | None, typer.Option(help="hf: local model directory (save_pretrained)")] = None,
    device: Annotated[str, typer.Option(help="hf: cpu or cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="hf: float32 or bfloat16")] = "float32",
    threads: Annotated[int, typer.Option(help="hf: torch CPU threads; 0 = torch's default")] = 1,
    profile: Annotated[str, typer.Option(help="llama3.1-8b-h100 or formula")] = "llama3.1-8b-h100",
    formula: Annotated[str | None, typer.Option(help="prefill time formula (profile=formula)")] = None,
    time_scale: Annotated[float, typer.Option(help="multiplies every modelled duration")] = 1.0,
    block_size: Annotated[int, typer.Option(help="KV block size in tokens")] = 64,
    kv_capacity_tokens: Annotated[int | None, typer.Option(help="override the profile's KV capacity")] = None,
    decode_admission: Annotated[
        str, typer.Option(help="decode KV: reserve (prompt + max_new_tokens) or expected (on use; preempts)")
    ] = "reserve",
    seed: Annotated[int, typer.Option(help="output token seed")] = 0,
    chunk_interval_ms: Annotated[
        float, typer.Option(help="decode chunk coalescing interval (wall ms)")
    ] = 20.0,
    kv_handle_ttl_ms: Annotated[
        float, typer.Option(help="modelled ms a prefilled KV waits for decode")
    ] = 30000.0,
    transport: Annotated[
        str,
        typer.Option(envvar="FLEXLB_WORKER_TRANSPORT", help="PyTriton tensor transport: base64 or shm"),
    ] = "base64",
    fault_error_rate: Annotated[float, typer.Option(help="fault: per-request error probability")] = 0.0,
    fault_extra_latency_ms: Annotated[float, typer.Option(help="fault: extra modelled ms per batch")] = 0.0,
    fault_hang: Annotated[bool, typer.Option(help="fault: stop making progress and answering")] = False,
    fault_exit_after_batches: Annotated[int, typer.Option(help="fault: crash after N batches")] = 0,
    secret: Annotated[
        str | None,
        typer.Option(
            envvar="FLEXLB_WORKER_SECRET",
            help="shared secret the control model and the KV side channel require (the gateways' too)",
        ),
    ] = None,
    allow_faults: Annotated[
        bool,
        typer.Option(envvar="FLEXLB_WORKER_ALLOW_FAULTS", help="allow fault injection (tests, chaos runs)"),
    ] = False,
    log_level: str = "INFO",
) -> None:
    """Start one simulated GPU worker inside a real Triton server."""
    setup_logging(log_level)
    if engine not in ("sim", "hf"):
        raise typer.BadParameter("sim or hf", param_hint="--engine")
    if engine == "hf" and not model:
        raise typer.BadParameter("--engine hf needs --model DIR", param_hint="--model")
    if device not in ("cpu", "cuda") or dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter("--device cpu|cuda, --dtype float32|bfloat16", param_hint="--device/--dtype")
    if role not in ("prefill", "decode"):
        raise typer.BadParameter("prefill or decode", param_hint="--role")
    if decode_admission not in ("reserve", "expected"):
        raise typer.BadParameter("reserve or expected", param_hint="--decode-admission")
    faulty = fault_error_rate or fault_extra_latency_ms or fault_hang or fault_exit_after_batches
    if faulty and not allow_faults:
        raise typer.BadParameter("fault options need --allow-faults", param_hint="--fault-*")
    from workers.engine.faults import Faults
    from workers.server.main import run_worker
    from workers.server.service import WorkerConfig

    cfg = WorkerConfig(
        role=role,
        host=host,
        grpc_port=grpc_port,
        kv_port=kv_port,
        profile=profile,
        formula=formula,
        time_scale=time_scale,
        block_size=block_size,
        kv_capacity_tokens=kv_capacity_tokens,
        decode_admission=decode_admission,
        seed=seed,
        chunk_interval_ms=chunk_interval_ms,
        kv_handle_ttl_ms=kv_handle_ttl_ms,
        engine=engine,
        model_path=model or "",
        device=device,
        dtype=dtype,
        threads=threads,
        secret=secret or "",
        allow_faults=allow_faults,
        faults=Faults.from_dict(
            {
                "error_rate": fault_error_rate,
                "extra_latency_ms": fault_extra_latency_ms,
                "hang": fault_hang,
                "exit_after_batches": fault_exit_after_batches,
            }
        ),
    )
    if transport not in ("base64", "shm"):
        raise typer.BadParameter("base64 or shm", param_hint="--transport")
    raise typer.Exit(
        run_worker(
            cfg, http_port=http_port, metrics_port=metrics_port, bind_address=bind, shm=transport == "shm"
        )
    )


@app.command()
def gateway(
    port: Annotated[int | None, typer.Option(help="HTTP port (FLEXLB_PORT, default 8000)")] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Redis URL (FLEXLB_REDIS_URL); unset → embedded")
    ] = None,
    workers: Annotated[
        str | None, typer.Option(envvar="FLEXLB_WORKERS", help="seed the registry: role@host:port,...")
    ] = None,
    replica_id: Annotated[str | None, typer.Option(help="stable replica id (FLEXLB_REPLICA_ID)")] = None,
    host: Annotated[str | None, typer.Option(help="listen address (FLEXLB_HOST)")] = None,
    log_level: str = "INFO",
    procs: Annotated[
        int | None,
        typer.Option(help="serving processes on the port, each a replica (FLEXLB_GATEWAY_PROCS, default 1)"),
    ] = None,
    reuseport: Annotated[bool, typer.Option(hidden=True, help="one of --procs: SO_REUSEPORT")] = False,
) -> None:
    """Run one gateway replica (or --procs N serving processes on one port)."""
    setup_logging(log_level)
    import uvicorn

    from app.cluster.registry import BadWorkerSpec, parse_workers
    from app.config import Settings
    from app.gateway.app import create_app

    overrides = {
        k: v
        for k, v in {
            "port": port,
            "redis_url": redis_url,
            "replica_id": replica_id,
            "host": host,
            "gateway_procs": procs,
        }.items()
        if v is not None
    }
    settings = Settings(**overrides)  # type: ignore[arg-type]
    from app.logging_setup import set_lifecycle_sample

    set_lifecycle_sample(settings.log_lifecycle_sample)
    try:
        seed = parse_workers(workers) if workers else []
    except BadWorkerSpec as exc:
        raise typer.BadParameter(str(exc), param_hint="--workers") from exc
    log = logging.getLogger("flexlb.gateway")
    url = settings.redis_url
    if not url:
        from app.state.embedded_redis import start_embedded_redis

        emb = start_embedded_redis(settings.cluster, settings.embedded_redis_idle_s)
        url = emb.url
    log.info("redis_url=%s", url)
    log.info("config %s", json.dumps(_redacted(settings)))
    from app.gateway.procs import ServingProcs, reuseport_socket
    from app.gateway.server import SHUTDOWN_GRACE_S, DrainingServer

    many = settings.gateway_procs > 1 or reuseport
    sockets = [reuseport_socket(settings.host, settings.port)] if many else None
    others = None
    if settings.gateway_procs > 1:
        argv = ["--port", str(settings.port), "--host", settings.host, "--log-level", log_level]
        argv.append("--reuseport")
        others = ServingProcs(settings.gateway_procs, argv, settings.replica_id, url)
        others.start()
    app_ = create_app(settings, url, seed)
    config = uvicorn.Config(
        app_,
        host=settings.host,
        port=settings.port,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=10,
        access_log=settings.access_log,
        timeout_keep_alive=settings.http_keepalive_s,
    )
    try:
        DrainingServer(config, app_.state.replica, settings.drain_timeout_s, others).run(sockets=sockets)
    finally:
        if others is not None:
            others.wait(settings.drain_timeout_s + SHUTDOWN_GRACE_S)


def _redacted(settings: object) -> dict[str, object]:
    d = settings.model_dump()  # type: ignore[attr-defined]
    for k in ("admin_token",):
        if d.get(k):
            d[k] = "***"
    if d.get("redis_url") and "@" in str(d["redis_url"]):
        d["redis_url"] = "redis://***@" + str(d["redis_url"]).split("@", 1)[1]
    return d


@app.command()
def up(
    prefill: Annotated[int, typer.Option(help="prefill workers")] = 2,
    decode: Annotated[int, typer.Option(help="decode workers")] = 2,
    gateways: Annotated[int, typer.Option(help="gateway replicas")] = 2,
    port: Annotated[int, typer.Option(help="first gateway port; replicas use the next ones")] = 8000,
    profile: Annotated[str, typer.Option(help="engine profile of the workers")] = "llama3.1-8b-h100",
    time_scale: Annotated[float, typer.Option(help="multiplies every modelled duration")] = 1.0,
    log_dir: Annotated[str, typer.Option(help="folder for every process's log")] = "logs",
    redis_url: Annotated[str | None, typer.Option(envvar="FLEXLB_REDIS_URL", help="unset → embedded")] = None,
    engine: Annotated[str, typer.Option(help="sim (modelled GPUs) or hf (a real model, --model)")] = "sim",
    model: Annotated[str | None, typer.Option(help="hf: local model directory")] = None,
    device: Annotated[str, typer.Option(help="hf: cpu or cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="hf: float32 or bfloat16")] = "float32",
    redis_ha: Annotated[
        bool, typer.Option("--redis-ha", help="Redis master + replica + 3 sentinels on loopback")
    ] = False,
    gateway_procs: Annotated[
        int, typer.Option(min=1, help="serving processes per gateway replica, on its one port (SO_REUSEPORT)")
    ] = 1,
) -> None:
    """Run the local stack in the foreground: Redis, workers, gateways (Ctrl-C stops everything)."""
    from pathlib import Path

    from app.stack import run_stack

    if engine not in ("sim", "hf") or (engine == "hf" and not model):
        raise typer.BadParameter("sim, or hf with --model DIR", param_hint="--engine")
    if redis_ha and redis_url:
        msg = "--redis-ha starts its own Redis: unset FLEXLB_REDIS_URL"
        raise typer.BadParameter(msg, param_hint="--redis-ha")
    engine_args = (
        ["--engine", "hf", "--model", str(Path(model).resolve()), "--device", device, "--dtype", dtype]
        if engine == "hf" and model
        else []
    )

    raise typer.Exit(
        run_stack(
            prefill=prefill,
            decode=decode,
            gateways=gateways,
            port=port,
            profile=profile,
            time_scale=time_scale,
            log_dir=Path(log_dir),
            redis_url=redis_url,
            worker_args=engine_args,
            redis_ha=redis_ha,
            gateway_procs=gateway_procs,
        )
    )


@app.command("make-tiny-model")
def make_tiny_model(
    path: Annotated[str, typer.Argument(help="directory to write (created if missing)")],
    seed: Annotated[int, typer.Option(help="weight seed")] = 0,
    layers: Annotated[int, typer.Option(help="transformer layers")] = 2,
    hidden: Annotated[int, typer.Option(help="hidden size")] = 128,
    heads: Annotated[int, typer.Option(help="attention heads")] = 4,
    kv_heads: Annotated[int, typer.Option(help="key/value heads")] = 2,
) -> None:
    """Write a small random-weight Llama with a byte vocabulary, for `--engine hf` without a download."""
    try:
        from workers.engine.hf_model import make_tiny_model as make
    except ImportError as exc:  # torch/transformers are the optional `engine` extra
        raise typer.BadParameter(f"needs pip install -e '.[engine]' ({exc})") from None
    out = make(path, seed=seed, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads)
    typer.echo(str(out))


@app.command()
def status(
    url: Annotated[
        list[str] | None,
        typer.Option(metavar="<url>", help="a gateway replica's URL (repeat for each; default: local stack)"),
    ] = None,
    admin_token: Annotated[
        str | None,
        typer.Option(envvar="FLEXLB_ADMIN_TOKEN", help="for the workers' queue, owed ms and KV"),
    ] = None,
    stack: Annotated[
        str, typer.Option(help="`flexlb up` manifest read when no --url is given")
    ] = "logs/latest/stack.json",
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit")] = False,
    interval: Annotated[float, typer.Option(help="seconds between frames")] = 1.0,
) -> None:
    """One-screen live view of a running cluster: replicas, owners, workers, request rates."""
    from pathlib import Path

    from app.status import resolve_targets, run_status

    if interval <= 0:
        raise typer.BadParameter("must be > 0", param_hint="--interval")
    urls, token = resolve_targets(url or [], Path(stack), admin_token)
    raise typer.Exit(run_status(urls, token, once=once, interval_s=interval))


_FORWARD = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command(context_settings=_FORWARD)
def bench(ctx: typer.Context) -> None:
    """Replay a trace (or synthetic load) against a running gateway; `flexlb bench --help` for options."""
    from app.loadgen.cli import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))


@app.command(context_settings=_FORWARD)
def simulate(ctx: typer.Context) -> None:
    """Discrete-event cluster simulation on a virtual clock; `flexlb simulate --help` for options."""
    from app.sim.cli import main as sim_main

    raise typer.Exit(sim_main(list(ctx.args)))


@app.command()
def policies(as_json: bool = typer.Option(False, "--json", help="the full registry as JSON")) -> None:
    """List the scheduling policies (built-in and FLEXLB_POLICIES) and the plugins they compose."""
    import json

    from app.config import Settings
    from app.scheduling.policy import PolicyBook

    reg = PolicyBook(Settings().policies).describe()
    if as_json:
        typer.echo(json.dumps(reg, indent=2))
        return
    for role, defs in reg["policies"].items():
        typer.echo(f"{role} policies:")
        for name, d in defs.items():
            scorers = ", ".join(f"{s['name']}*{s['weight']:g}" for s in d["scorers"]) or "-"
            filters = ", ".join(f["name"] for f in d["filters"]) or "-"
            typer.echo(
                f"  {name:<14} filters: {filters:<26} scorers: {scorers:<28} picker: {d['picker']['name']}"
            )
    for kind, specs in reg["plugins"].items():
        typer.echo(f"{kind}s: {', '.join(specs)}")


def _add_subcommands() -> None:
    from app.security.cli import keys_app

    app.add_typer(keys_app, name="keys")


_add_subcommands()


def main() -> None:
    from app.supervise import die_with_parent

    die_with_parent()  # started by `flexlb up`: do not outlive it, even if it is SIGKILLed
    app()


if __name__ == "__main__":
    main()
