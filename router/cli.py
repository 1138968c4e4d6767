"""``kvroute serve --config FILE [--processes N]``: the gateway, on uvicorn with uvloop and
httptools; with N > 1, N gateway processes on one port under a supervisor
(:mod:`router.processes.supervisor`, :mod:`router.processes.group`)."""
from __future__ import annotations

import argparse
import logging
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    p = subparsers.add_parser("serve", help="run the gateway (OpenAI-compatible, KV-cache-aware routing)",
                              description="Run the kvroute gateway from a YAML config (see configs/).")
    p.add_argument("--config", required=True, help="gateway YAML config file; re-read on SIGHUP")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--processes", type=int, default=1,
                   help="gateway processes on the one port (SO_REUSEPORT), each with the whole index and "
                        "all of them seeing each other's in-flight load (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate the config, then serve until SIGINT/SIGTERM: the listening socket closes at once
    (new connections are refused, so a load balancer's readiness check fails), requests in
    flight get ``timeouts.shutdown_grace_s`` to finish, then the gateway stops. With
    ``--processes N`` > 1 this process supervises N gateway processes instead. Returns 2 on a
    bad config or a bad ``--processes``."""
    import uvicorn

    from router.edge.app import create_app
    from router.edge.server import GatewayServer
    from router.config.schema import load_config
    from router.gateway import Gateway
    from router.processes.group import ProcessGroup, reuse_port_socket, socket_path, unix_socket
    from router.route.prompt_blocks import check_sliding_window

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
        for model in cfg.models:
            check_sliding_window(model)
    except (OSError, ValueError) as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    if args.processes < 1:
        print("kvroute serve: --processes must be >= 1", file=sys.stderr)
        return 2
    if args.processes > 1:
        from router.processes.supervisor import Supervisor

        child = [sys.executable, "-m", "kvroute", "serve", "--config", args.config, "--log-level", args.log_level]
        return Supervisor(child, args.processes, cfg.timeouts.shutdown_grace_s).run()
    group = ProcessGroup.from_env()  # set by a supervisor: one of N
    app = create_app(Gateway(cfg, config_path=args.config, group=group))
    config = uvicorn.Config(app, host=cfg.listen.host, port=cfg.listen.port, loop="uvloop", http="httptools",
                            log_level=args.log_level, access_log=False, server_header=False, date_header=False,
                            proxy_headers=False, timeout_keep_alive=75,
                            timeout_graceful_shutdown=cfg.timeouts.shutdown_grace_s)
    if group is None:
        GatewayServer(config).run()
        return 0
    sockets = [reuse_port_socket(cfg.listen.host, cfg.listen.port),
               unix_socket(socket_path(group.run_dir, group.index))]
    GatewayServer(config).run(sockets=sockets)
    return 0
