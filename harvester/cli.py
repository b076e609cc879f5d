"""`reaper`: the sidecar's command line (migrate, run, serve)."""

from __future__ import annotations

import argparse
import sys

from harvester import admin, product_version
from harvester import config as config_mod
from harvester.exit_codes import ExitCode
from tracker import schema


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="reaper", description="Transactional-outbox harvester and fan-out tracker sidecar"
    )
    ap.add_argument("--version", action="version", version=f"reaper (outbox-reaper) {product_version()}")
    ap.add_argument("-c", "--config", help="YAML configuration file (REAPER_<SECTION>__<KEY> variables override it)")
    sub = ap.add_subparsers(dest="command", required=True)
    mig = sub.add_parser("migrate", help="apply pending schema migrations (safe to run concurrently)")
    mig.add_argument("--dry-run", action="store_true", help="print the SQL that would run and change nothing")
    mig.add_argument(
        "--roles",
        choices=["print", "create"],
        help="after migrating, print (for a DBA) or run the least-privilege roles' grants: "
        "<schema>_producer, _consumer, _operator, _app, _reaper (create needs CREATEROLE)",
    )
    sub.add_parser("run", help="run the harvester, acker, sweeper and metrics server until SIGTERM")
    sub.add_parser("serve", help="serve the tracker over HTTP (http section of the configuration) until SIGTERM")
    tok = sub.add_parser("token", help="make a bearer token for a tenant of http.tenants_file")
    tok.add_argument("action", choices=["new"])
    tok.add_argument("--tenant", required=True, help="the tenant it speaks for")
    admin.add_parsers(sub)  # outbox status, dead list|requeue, acks requeue, batch show|expire, inbox show|status
    return ap


def cmd_serve(cfg: config_mod.Config) -> int:
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

    from tracker import roles

    dsn, name = cfg.database.dsn, cfg.database.schema
    try:  # never prepared: migrate also runs through PgBouncer in transaction mode
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10, prepare_threshold=None)
    except psycopg.OperationalError as exc:
        print(f"reaper migrate: database unreachable: {config_mod.redact_dsn(str(exc)).strip()}", file=sys.stderr)
        return ExitCode.UNAVAILABLE
    with conn:
        if dry_run:
            pending = schema.pending_sql(conn, name)
            if not pending:
                print(f"-- schema {name!r} is up to date")
            # as migrate() runs them: each migration in a transaction of its own, then every
            # changed definition together in one
            migrations = [(m, text) for m, text in pending if isinstance(m, schema.Migration)]
            definitions = [(d, text) for d, text in pending if not isinstance(d, schema.Migration)]
            for m, text in migrations:
                print(f"-- {m.name}\nBEGIN;\n{text.rstrip()}\nCOMMIT;\n")
            if definitions:
                print("-- the changed definitions, in one transaction\nBEGIN;")
                for d, text in definitions:
                    print(f"-- {d.name}\n{text.rstrip()}\n")
                print("COMMIT;\n")
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
    from harvester import run as run_mod

    run_mod.configure_logging(cfg)
    try:
        return run_mod.run(cfg)
    except Exception as exc:  # logging is configured: a JSON line, like every other
        run_mod.logs.get("reaper").error(
            "reaper run failed", error=f"{type(exc).__name__}: {config_mod.redact_dsn(str(exc))}"
        )
        return ExitCode.FAILURE


def cmd_token(tenant: str) -> int:
    from harvester.services.http.tenants import new_token

    token, digest = new_token()
    print(f"token (give it to the client; it is not stored anywhere): {token}")
    print(f"add to http.tenants_file under tenants.{tenant}.tokens: {digest}")
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "token":  # needs no configuration
        return cmd_token(args.tenant)
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as exc:
        print(f"reaper: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if args.command == "run":
        return cmd_run(cfg)
    if args.command == "serve":
        return cmd_serve(cfg)
    if args.command in admin.COMMANDS:
        return admin.main(cfg, args)
    try:
        if args.command == "migrate":
            return cmd_migrate(cfg, args.dry_run, args.roles)
    except Exception as exc:  # a clear one-line error, secrets redacted
        print(f"reaper {args.command}: {type(exc).__name__}: {config_mod.redact_dsn(str(exc))}", file=sys.stderr)
        return ExitCode.FAILURE
    return ExitCode.FAILURE


if __name__ == "__main__":
    sys.exit(main())
