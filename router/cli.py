"""``kvroute serve --config FILE``: the gateway, on uvicorn with uvloop and httptools."""
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate the config, then serve until SIGINT/SIGTERM: the listening socket closes at once
    (new connections are refused, so a load balancer's readiness check fails), requests in
    flight get ``timeouts.shutdown_grace_s`` to finish, then the gateway stops. Returns 2 on a
    bad config."""
    import uvicorn

    from router.app import create_app
    from router.config import load_config
    from router.gateway import Gateway

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
    except (OSError, ValueError) as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(Gateway(cfg, config_path=args.config))
    uvicorn.run(app, host=cfg.listen.host, port=cfg.listen.port, loop="uvloop", http="httptools",
                log_level=args.log_level, access_log=False, server_header=False, date_header=False,
                proxy_headers=False, timeout_keep_alive=75, timeout_graceful_shutdown=cfg.timeouts.shutdown_grace_s)
    return 0
