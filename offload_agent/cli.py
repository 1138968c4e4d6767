"""``kvroute agent``: one offload agent beside one vLLM server: its KV events into a Redis index,
and the owner of its tiers (with the gateway's embedded index: only the owner of its tiers)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``agent`` subcommand to the ``kvroute`` parser."""
    p = subparsers.add_parser(
        "agent", help="run one offload agent (a vLLM server's KV events -> the Redis index; its tiers)",
        description="With a Redis --index: subscribes to one vLLM server's KV events (ZMQ), turns them into "
                    "block keys and writes them to a shared Redis index with a heartbeat; repairs lost "
                    "messages over the replay socket and resyncs after a vLLM restart. With --tier-socket "
                    "it also owns the worker's tiers (below). With --index http://GATEWAY (a gateway with the "
                    "embedded index, which subscribes to the events itself) it only owns the tiers: it asks "
                    "the gateway which peer holds a prompt's blocks and publishes its peer state there "
                    "(admin token from --admin-token-env). Start order does not matter.")
    p.add_argument("--worker-id", required=True, metavar="ID", help="the worker's id, as in the gateway config")
    p.add_argument("--events", default=None, metavar="tcp://H:P",
                   help="vLLM's KV event PUB endpoint (its --kv-events-config endpoint, as seen from here); "
                        "required with a Redis index, left out with a gateway's")
    p.add_argument("--replay", default=None, metavar="tcp://H:P",
                   help="vLLM's replay endpoint (replay_endpoint); without it, a lost message resyncs")
    p.add_argument("--index", required=True, metavar="URL",
                   help="the index: redis://host:port/db (the agent writes the events there), or the gateway "
                        "holding the embedded index, http://host:port (the agent locates peers through it and "
                        "publishes its peer state there; needs --tier-socket)")
    p.add_argument("--index-cluster", action="store_true",
                   help="with a redis:// --index: the URL is a node of a Redis Cluster; shard the index over "
                        "the cluster (the gateways' index config: cluster: true)")
    p.add_argument("--admin-token-env", default="KVROUTE_ADMIN_TOKEN", metavar="VAR",
                   help="with a gateway --index: the variable holding the gateway's admin token "
                        "(default KVROUTE_ADMIN_TOKEN)")
    p.add_argument("--model", required=True, metavar="NAME", help="served model name (mixed into block keys)")
    p.add_argument("--block-size", required=True, type=int, metavar="N", help="vLLM's --block-size in tokens")
    p.add_argument("--heartbeat-ttl-s", type=float, default=10.0, metavar="S",
                   help="the worker stops counting this long after the agent's last heartbeat; with a gateway "
                        "--index, how long the gateway keeps the agent's peer state after each publish (default 10)")
    p.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to (default: all)")
    t = p.add_argument_group(
        "tiers (the agent owns them)",
        "With --tier-socket the agent owns the worker's CPU tier (a shared memory file) and SSD tier (a "
        "folder): the worker's KV connector (kv_connector_extra_config agent_socket) maps them through "
        "this socket, and the agent serves their blocks to peers and pulls peers' blocks for it.")
    t.add_argument("--tier-socket", metavar="PATH", help="Unix socket for the worker's KV connector")
    t.add_argument("--cpu-tier-bytes", type=int, default=0, metavar="N", help="RAM for the CPU tier (required with --tier-socket)")
    t.add_argument("--tier-shm", metavar="PATH", help="the CPU tier file (default /dev/shm/kvroute-tier-<worker id>)")
    t.add_argument("--ssd-tier-dir", metavar="DIR", help="folder of the SSD tier")
    t.add_argument("--ssd-tier-bytes", type=int, default=0, metavar="N", help="bytes of block files allowed there")
    t.add_argument("--serve-peers", metavar="HOST:PORT", help="serve this worker's blocks to peers here (port 0: any)")
    t.add_argument("--advertise", metavar="HOST:PORT", help="the address peers use (default: the bound one)")
    t.add_argument("--no-peer-pull", dest="peer_pull", action="store_false",
                   help="never pull blocks from peers for this worker")
    t.add_argument("--peer-pull-max-bytes", type=int, default=None, metavar="N",
                   help="shared memory each worker shard's pulls land in (default 256 MiB, at most its CPU tier); "
                        "a longer pull goes in several")
    t.add_argument("--peer-secret-env", metavar="VAR",
                   help="environment variable holding the peer protocol's shared secret (both sides need it)")
    t.add_argument("--remove-tiers-on-exit", action="store_true",
                   help="remove the CPU tier file at a clean stop (default: keep it for the next agent)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from offload_agent.agent import run_from_args

    return run_from_args(args)
