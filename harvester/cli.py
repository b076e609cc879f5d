"""`reaper`: the sidecar's command line (migrate, run, serve, healthcheck, token, the admin commands).

Ctrl-C (SIGINT) ends any command with one line in its usual form (a JSON log line once logging is
set up, else a line on stderr) and ExitCode.INTERRUPTED, never a traceback. The heavier imports
happen inside main(), so an interrupt while they load is handled too.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from harvester import product_version
from harvester.exit_codes import ExitCode

if TYPE_CHECKING:
    from harvester import config as config_mod


def _parser() -> argparse.ArgumentParser:
    from harvester import admin

    ap = admin.Parser(prog="reaper", description="Transactional-outbox harvester and fan-out tracker sidecar")
    ap.add_argument("--version", action="version", version=f"reaper (outbox-reaper) {product_version()}")
    ap.add_argument("-c", "--config", help="YAML configuration file (REAPER_<SECTION>__<KEY> variables override it)")
    sub = ap.add_subparsers(dest="command", required=True)
    mig = sub.add_parser("migrate", help="apply pending schema migrations (safe to run concurrently)")
    mig.add_argument(
        "--dry-run",
        action="store_true",
        help="print the SQL script migrate would run (whole: a DBA may run it with psql instead) and change nothing",
    )
    mig.add_argument(
        "--roles",
        choices=["print", "create"],
        help="after migrating, print (for a DBA) or run the least-privilege roles' grants: "
        "<schema>_producer, _consumer, _operator, _app, _reaper (create needs CREATEROLE)",
    )
    sub.add_parser("run", help="run the harvester, acker, sweeper and metrics server until SIGTERM")
    sub.add_parser("serve", help="serve the tracker over HTTP (http section of the configuration) until SIGTERM")
    sub.add_parser(
        "healthcheck",
        help="ask /healthz where this container's `reaper run` (metrics.port) or `reaper serve` (http.port) "
        "answers; exit 0 if healthy (the image's HEALTHCHECK; without -c, reads the main process's -c)",
    )
    tok = sub.add_parser("token", help="make a bearer token for a tenant of http.tenants_file")
    tok.add_argument("action", choices=["new"])
    tok.add_argument("--tenant", required=True, help="the tenant it speaks for")
    admin.add_parsers(sub)  # outbox status, dead list|requeue, acks requeue, batch show|expire, inbox show|status
    return ap


def cmd_serve(cfg: config_mod.Config) -> int:
    from harvester import config as config_mod
    from harvester import run as run_mod

    try:
        from harvester.services.http import server
    except ImportError as exc:
        print(f"reaper serve: {exc.name or exc} is not installed: pip install 'outbox-reaper[http]'", file=sys.stderr)
        return ExitCode.FAILURE
    run_mod.configure_logging(cfg)
    try:
        return server.serve(cfg)
    except config_mod.ConfigError as exc:
        print(f"reaper serve: {exc}", file=sys.stderr)
        return ExitCode.USAGE


def cmd_migrate(cfg: config_mod.Config, dry_run: bool, roles_action: str | None = None) -> int:
    import psycopg

    from harvester import config as config_mod
    from harvester.dsn_options import dsn_refusal
    from tracker import roles, schema

    dsn, name = cfg.database.dsn, cfg.database.schema
    try:  # never prepared: migrate also runs through PgBouncer in transaction mode
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10, prepare_threshold=None)
    except psycopg.Error as exc:
        refused = dsn_refusal(dsn)  # a mistake in the DSN itself: retrying cannot help
        if refused is not None:
            print(f"reaper migrate: {refused}", file=sys.stderr)
            return ExitCode.USAGE
        print(f"reaper migrate: database unreachable: {config_mod.redact_dsn(str(exc)).strip()}", file=sys.stderr)
        return ExitCode.UNAVAILABLE
    with conn:
        if dry_run:  # the transactions migrate() would run, whole: a DBA may run them with psql instead
            pending = schema.pending_sql(conn, name)
            print("\n".join(pending) if pending else f"-- schema {name!r} is up to date")
            return ExitCode.OK
        applied = schema.migrate(conn, name)
        note = "-- " if roles_action == "print" else ""  # the output is then an SQL script
        for n in applied:
            print(f"{note}applied {n}")
        print(f"{note}schema {name!r} is up to date ({len(applied)} applied)")
        if roles_action == "print":
            print(roles.script(conn, name), end="")
        elif roles_action == "create":
            roles.create(conn, name)
            print(f"roles {', '.join(roles.role_name(name, r) for r in roles.ROLES)} granted")
    return ExitCode.OK


def cmd_run(cfg: config_mod.Config) -> int:
    from harvester import config as config_mod
    from harvester import run as run_mod

    run_mod.configure_logging(cfg)
    try:
        return run_mod.run(cfg)
    except Exception as exc:  # logging is configured: a JSON line, like every other
        run_mod.logs.get("reaper").error(
            "reaper run failed", error=f"{type(exc).__name__}: {config_mod.redact_dsn(str(exc))}"
        )
        return ExitCode.FAILURE


def cmd_healthcheck(cfg: config_mod.Config) -> int:
    from harvester.healthcheck import probe

    healthy, said = probe(cfg)
    print(f"reaper healthcheck: {said}", file=sys.stdout if healthy else sys.stderr)
    return ExitCode.OK if healthy else ExitCode.FAILURE


def cmd_token(tenant: str) -> int:
    from harvester.services.http.tenants import new_token

    token, digest = new_token()
    print(f"token (give it to the client; it is not stored anywhere): {token}")
    print(f"add to http.tenants_file under tenants.{tenant}.tokens: {digest}")
    return ExitCode.OK


# Ctrl-C's line (the admin commands say the same: harvester.admin.commands)
INTERRUPTED = "interrupted (SIGINT) before it finished; what it had not committed was rolled back"


class _CtrlC:
    """SIGINT's handler while a command runs as the process (Python's own, and a note of it): the
    notes psycopg logs while the interrupt unwinds (a rollback that could not run on a connection
    whose query was cancelled) are dropped, the one line of `_interrupted` says what happened."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.seen


def main(argv: list[str] | None = None) -> int:
    """`reaper` with `argv` (None: the process's own arguments, and the process ends with it)."""
    command = None
    if argv is None:
        ctrl_c = _CtrlC()
        signal.signal(signal.SIGINT, ctrl_c)
        for name in ("psycopg", "psycopg.transaction"):  # a logger's filter holds for its own records only
            logging.getLogger(name).addFilter(ctrl_c.filter)
    try:
        try:
            from harvester import admin

            try:
                args = _parser().parse_args(argv)
            except admin.UsageError as exc:  # argparse refused it (and said why on stderr)
                return admin.usage_error(exc, sys.argv[1:] if argv is None else argv)
            command = args.command
            code = _main(args)
        finally:
            if argv is None:  # what is left is the interpreter's exit: a Ctrl-C now would kill it by the signal
                signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        return _interrupted(command)
    except BrokenPipeError:
        return _pipe_closed()
    return code


def _pipe_closed() -> int:
    """The output's reader went away (`reaper migrate --dry-run | head`): no traceback or error line,
    and the interpreter's last flush of stdout goes nowhere instead of failing again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return ExitCode.PIPE_CLOSED


def _interrupted(command: str | None) -> int:
    """Ctrl-C: one line in the command's usual form, and ExitCode.INTERRUPTED (`reaper run` and
    `reaper serve` handle SIGINT themselves once started: this is an interrupt while they start)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the report
    if command in ("run", "serve"):
        import structlog

        if structlog.is_configured():  # their log lines: JSON (or console text) on stderr
            structlog.get_logger("reaper").error("interrupted (SIGINT) while starting", command=f"reaper {command}")
            return ExitCode.INTERRUPTED
    name = "reaper" if command is None else f"reaper {command}"
    print(f"{name}: {INTERRUPTED}", file=sys.stderr)
    return ExitCode.INTERRUPTED


def _main(args: argparse.Namespace) -> int:
    from harvester import admin
    from harvester import config as config_mod

    if args.command == "token":  # needs no configuration
        return cmd_token(args.tenant)
    if args.command == "healthcheck" and args.config is None:  # the configuration the container's reaper reads
        from harvester.healthcheck import config_file_of_main_process

        args.config = config_file_of_main_process()
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as exc:
        print(f"reaper: {exc}", file=sys.stderr)
        if args.command in admin.COMMANDS and args.json:  # their errors are a JSON document too
            admin.json_error(str(exc), ExitCode.USAGE)
        if args.command == "healthcheck":  # Docker reads 1 as unhealthy, and reserves 2
            return ExitCode.FAILURE
        return ExitCode.USAGE
    if args.command == "healthcheck":
        return cmd_healthcheck(cfg)
    if args.command == "run":
        return cmd_run(cfg)
    if args.command == "serve":
        return cmd_serve(cfg)
    if args.command in admin.COMMANDS:
        return admin.main(cfg, args)
    try:
        if args.command == "migrate":
            return cmd_migrate(cfg, args.dry_run, args.roles)
    except BrokenPipeError:
        raise  # the reader went away: see _pipe_closed
    except Exception as exc:  # a clear one-line error, secrets redacted
        print(f"reaper {args.command}: {type(exc).__name__}: {config_mod.redact_dsn(str(exc))}", file=sys.stderr)
        return ExitCode.FAILURE
    return ExitCode.FAILURE


if __name__ == "__main__":
    sys.exit(main())
