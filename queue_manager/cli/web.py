"""``qm web``: the web dashboard over every shard (docs/dashboard.md; needs the ``web`` extra)."""

from __future__ import annotations

import argparse
import os

from queue_manager.cli.common import Subparsers, command, topology
from queue_manager.errors import ConfigurationError


def register(sub: Subparsers) -> None:
    p = command(sub, "web", cmd_web, topology=True)
    p.add_argument("--tokens", metavar="FILE", help="token file with [[web_token]] tables (default: $QM_TOKENS)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument("--root-path", default="", help="serve under this sub-path, e.g. /qm (behind a reverse proxy)")
    p.add_argument("--secure-cookie", action="store_true", help="send the session cookie over HTTPS only")
    p.add_argument(
        "--manager",
        action="append",
        metavar="SHARD=URL",
        help="a manager of a shard, e.g. s0=ws://mgr-a:8765/ (repeat for each; the overview shows their roles, "
        "standbys and connected receivers)",
    )


def cmd_web(args: argparse.Namespace) -> int:
    """serve the web dashboard over every shard (docs/dashboard.md)

    Serve the web dashboard until Ctrl-C: every shard's queues live, the events with payload filters, bulk actions, the
    managers and their receivers. Log in with a secret of the token file's [[web_token]] tables (read-only or admin).
    Needs the web extra: pip install 'queue-manager[web]'.

    example:
      qm web --tokens tokens.toml --port 8080 --manager s0=ws://127.0.0.1:8765/
    """
    try:
        from queue_manager.web.access import WebTokens
        from queue_manager.web.app import WebConfig
        from queue_manager.web.managers import parse_managers
        from queue_manager.web.server import serve
    except ImportError as exc:
        raise ConfigurationError(f"qm web needs the web extra: pip install 'queue-manager[web]' ({exc})") from None

    tokens_path = args.tokens or os.environ.get("QM_TOKENS")
    if not tokens_path:
        raise ConfigurationError("no tokens: pass --tokens FILE or set QM_TOKENS, with [[web_token]] tables")
    shards = topology(args)
    config = WebConfig(
        topology=shards,
        tokens=WebTokens.load(tokens_path),
        managers=parse_managers(args.manager or [], tuple(s.name for s in shards.shards)),
        session_secret=os.environ.get("QM_WEB_SESSION_SECRET") or None,
        root_path=args.root_path.rstrip("/"),
        secure_cookie=args.secure_cookie,
    )
    serve(config, args.host, args.port)
    return 0
