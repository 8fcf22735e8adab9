"""``kvdiag serve``: the exporter beside a serving cluster (FastAPI on uvicorn).

The config file (``--config``) holds everything; the flags cover the common case without one
and override the file. A config that cannot run is refused before anything listens, and the
listening socket is bound before the scrape loop starts or anything says "started": a busy
port is one error line and exit 3. Listening beyond loopback without an API token is allowed
(Prometheus must reach /metrics) but said loudly, since /api/v1 then answers anyone.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from dataclasses import replace

from kvdiag.config import ConfigError, with_overrides
from kvdiag.quantity import INTERVAL
from kvdiag.server import settings as serve_settings
from kvdiag.server.settings import DEFAULT_HOST, DEFAULT_PORT, Settings, check_timing, check_window, is_loopback, parse_listen
from kvdiag.server.targets import Shard, TargetsError, make_target

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve")
    p.add_argument("--config", metavar="YAML", help="exporter config (targets, scrape, probe allowlist, checks)")
    p.add_argument("--target", action="append", default=[], metavar="URL", help="an engine to scrape (repeatable; added to the config's)")
    p.add_argument("--interval", metavar="DURATION", help="seconds between scrapes of each target (default 5s)")
    p.add_argument("--window", metavar="DURATION", help="the checks' window, also what each instance keeps (default 5m)")
    p.add_argument("--listen", metavar="HOST:PORT", help=f"listen address (default {DEFAULT_HOST}:{DEFAULT_PORT})")
    p.add_argument("--shard", metavar="I/N", help="scrape only the targets whose URL hash falls in shard I of N")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a check threshold (see `kvdiag explain`)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level (default info)")
    return p


def resolve(args: argparse.Namespace) -> Settings:
    """The settings in force: defaults, then the config file, then the flags."""
    settings = serve_settings.load(args.config) if args.config else Settings()
    try:
        extra = tuple(make_target(url, None, f"--target {url}") for url in args.target)
        scrape = settings.scrape
        if args.interval:
            scrape = replace(scrape, interval=INTERVAL.parse(args.interval, "--interval"))
        check_timing(scrape)
        host, port = parse_listen(args.listen) if args.listen else (settings.host, settings.port)
        shard = Shard.parse(args.shard) if args.shard else settings.shard
    except (ValueError, TargetsError) as exc:
        raise ConfigError(str(exc)) from None
    overrides = list(args.set) + ([f"window={args.window}"] if args.window else [])
    resolved = replace(
        settings,
        targets=settings.targets + extra,
        scrape=scrape,
        host=host,
        port=port,
        shard=shard,
        checks=with_overrides(settings.checks, overrides),
    )
    try:
        check_window(resolved)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return resolved


def run(args: argparse.Namespace) -> int:
    try:
        settings = resolve(args)
    except (ConfigError, OSError) as exc:
        print(f"kvdiag serve: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        sock = bind(settings.host, settings.port)
    except OSError as exc:
        print(f"kvdiag serve: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    import uvicorn  # the exporter's own dependencies load only when it runs

    from kvdiag.server.app import create_app
    from kvdiag.server.loop import ScrapeLoop

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvdiag.serve")
    warning = exposure_warning(settings)
    if warning:
        log.warning(warning)
    if not settings.targets and not settings.file_sd and settings.probe.allowlist.empty:
        log.warning("no targets, no file_sd and no probe allowlist: nothing to scrape")
    loop = ScrapeLoop(settings).start()
    try:
        config = uvicorn.Config(create_app(loop), log_level=args.log_level, access_log=False)
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a clean stop
        pass
    finally:
        loop.stop()
        sock.close()
    return 0


def exposure_warning(settings: Settings) -> str | None:
    """What to say loudly when the API answers beyond this machine to anyone."""
    if is_loopback(settings.host) or settings.api_token is not None:
        return None
    return (
        f"listening on {settings.host}, beyond loopback, WITHOUT an API token: anyone who can reach port "
        f"{settings.port} reads /api/v1 (targets, errors, evidence); set api_bearer_token_file in the config"
    )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (OSError when the port is taken or the address is not
    this machine's), so that nothing is announced before it is certain to work."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
