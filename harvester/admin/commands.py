"""The admin subcommands of `reaper`: argument parsing, dispatch, human or `--json` output.

Output goes to stdout (a table or, with --json, one JSON document); errors go to stderr as one
line (and, with --json, also as {"error": ..., "exit_code": ...} on stdout), with the exit codes
of harvester.exit_codes. Every argument is checked before anything touches the database; an
argument argparse refuses is a usage error (exit 2) that `reaper` reports the same way (Parser,
UsageError, usage_error).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import psycopg

from harvester import logs
from harvester.admin import acks as acks_mod
from harvester.admin import batch as batch_mod
from harvester.admin import dead as dead_mod
from harvester.admin import inbox as inbox_mod
from harvester.admin import status as status_mod
from harvester.admin.common import AdminError, connect, to_json
from harvester.config import Config, redact_dsn
from harvester.exit_codes import ExitCode
from tracker.errors import InvalidValue, MalformedItemId, TrackerError
from tracker.ids import ID_MAX, ItemId, parse_item_id
from tracker.inbox.core import check_text

COMMANDS = ("outbox", "dead", "acks", "batch", "inbox")
INTERRUPTED = "interrupted (SIGINT) before it finished; what it had not committed was rolled back"
MAX_LIMIT = 10_000  # rows or runs one page may show
MAX_IDS = 10_000  # ids one `dead requeue --id` may name


JSON_HELP = 'print one JSON document instead of text (an error: {"error": MESSAGE, "exit_code": N})'


class UsageError(SystemExit):
    """argparse refused the command line: its usage and message are on stderr already; exits 2
    like argparse's own, and keeps the message for the JSON error document."""

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.USAGE)
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse's parser (its subparsers are of the same class), whose usage error is a UsageError."""

    def error(self, message: str) -> NoReturn:
        try:
            super().error(message)  # the usage line and "prog: error: message" on stderr, then SystemExit(2)
        except SystemExit:
            raise UsageError(message) from None
        raise UsageError(message)  # not reached: argparse's error() always exits


def usage_error(exc: UsageError, argv: Sequence[str]) -> int:
    """`reaper`'s answer to a UsageError (the message is on stderr already): with --json on an admin
    command line, also the JSON error document on stdout, as every other error of these commands."""
    words = list(argv[: list(argv).index("--")] if "--" in argv else argv)
    # argparse takes an unambiguous prefix of an option (--js) for the option
    if any(w in COMMANDS for w in words) and any(len(w) > 2 and "--json".startswith(w) for w in words):
        json_error(exc.message, ExitCode.USAGE)
    return ExitCode.USAGE


def json_error(message: str, code: int) -> None:
    """The error document --json promises, on stdout."""
    print(to_json({"error": message, "exit_code": code}))


def _int_in(what: str, low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        t = text.strip()
        if not t.isascii() or not t.isdigit() or len(t) > 19 or not low <= int(t) <= high:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number from {low} to {high}, got {text!r}")
        return int(t)

    return parse


def _ids(text: str) -> list[int]:
    one = _int_in("a dead row id", 1, ID_MAX)
    parts = [p for p in text.split(",") if p.strip()]
    if not parts or len(parts) > MAX_IDS:
        raise argparse.ArgumentTypeError(f"--id takes 1 to {MAX_IDS} comma-separated ids, got {text[:40]!r}")
    return [one(p) for p in parts]


def _at(text: str) -> tuple[int, int]:
    """PARTITION:OFFSET of a dead-lettered ack (as the console and the result list them)."""
    p, sep, o = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--at takes PARTITION:OFFSET, got {text[:40]!r}")
    return _int_in("a partition", 0, 1_000_000)(p), _int_in("an offset", 0, ID_MAX)(o)


def _item_id(text: str) -> ItemId:
    try:
        return parse_item_id(text)
    except (MalformedItemId, TrackerError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _text(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text or "\x00" in text or len(text) > 1000:
            raise argparse.ArgumentTypeError(f"{what} must be 1-1000 characters without NUL, got {text[:40]!r}")
        try:
            text.encode("utf-8")  # at most 1000 characters: a bounded copy
        except UnicodeEncodeError:  # bytes that are not UTF-8 on the command line (decoded with surrogateescape)
            raise argparse.ArgumentTypeError(f"{what} must be UTF-8 text, got {text[:40]!r}") from None
        return text

    return parse


def _inbox_text(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            return check_text(what, text)
        except InvalidValue as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 300:
        raise argparse.ArgumentTypeError(f"timeout must be a number of seconds in (0, 300], got {text!r}")
    return value


def add_parsers(sub: Any) -> None:
    """Add `outbox`, `dead`, `batch` and `inbox` to the `reaper` subcommand parser."""
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", action="store_true", help=JSON_HELP)

    outbox = sub.add_parser("outbox", help="look at the outbox").add_subparsers(dest="admin_command", required=True)
    st = outbox.add_parser(
        "status", parents=[out], help="backlog, oldest age, rows in flight and dead, leader per unit"
    )
    st.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for Kafka (default 10)")

    dead = sub.add_parser("dead", help="rows Kafka refused for good (the outbox's dead table)").add_subparsers(
        dest="admin_command", required=True
    )
    of = argparse.ArgumentParser(add_help=False)
    of.add_argument(
        "--outbox",
        metavar="NAME",
        type=_text("--outbox"),
        help="the dead rows of this harvester.outboxes entry's table (its database and schema; `reaper outbox "
        "status` names the command for each unit); default: the database section's outbox table",
    )
    dl = dead.add_parser("list", parents=[out, of], help="list dead rows, oldest id first, a page at a time")
    dl.add_argument("--reason", type=_text("--reason"), help="only rows whose reason contains this text")
    dl.add_argument("--limit", type=_int_in("--limit", 1, MAX_LIMIT), default=50, help="rows per page (default 50)")
    dl.add_argument(
        "--after", type=_int_in("--after", 0, ID_MAX), default=0, help="show rows with a higher id (paging)"
    )
    rq = dead.add_parser(
        "requeue",
        parents=[out, of],
        help="move dead rows back into the outbox (each exactly once)",
        epilog="--all and --reason move every row dead when they start (a row another transaction holds "
        "is waited for, unless a racing requeue moves it). --json prints "
        '{"moved": N, "dead_ids": [...], "new_ids": [...], "dry_run": false, "ids_complete": true}: '
        "dead_ids are the rows' ids in the dead table and new_ids their new outbox ids, in the order moved; "
        f"--id names every row, --all and --reason the first {dead_mod.ID_SAMPLE} (ids_complete is false "
        "when more moved; moved counts them all).",
    )
    which = rq.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--id",
        dest="ids",
        type=_ids,
        action="append",
        help="dead row id(s), repeatable or comma-separated: all move in one transaction, or none",
    )
    which.add_argument("--all", action="store_true", help="every row dead now, in chunks")
    which.add_argument("--reason", type=_text("--reason"), help="every row dead now whose reason contains this text")
    rq.add_argument(
        "--chunk",
        type=_int_in("--chunk", 1, 100_000),
        default=1000,
        help="rows per transaction for --all/--reason (default 1000)",
    )
    rq.add_argument("--dry-run", action="store_true", help="say how many rows would move; change nothing")

    acks = sub.add_parser("acks", help="acks the acker set aside (its dead-letter topic)").add_subparsers(
        dest="admin_command", required=True
    )
    aq = acks.add_parser("requeue", parents=[out], help="send dead-lettered acks to the ack topic again")
    pick = aq.add_mutually_exclusive_group(required=True)
    pick.add_argument("--at", type=_at, help="the one at PARTITION:OFFSET of the dead-letter topic")
    pick.add_argument("--reason", type=_text("--reason"), help="every one whose reason contains this text")
    pick.add_argument("--all", action="store_true", help="every one")
    aq.add_argument(
        "--scan",
        type=_int_in("--scan", 1, 1_000_000),
        default=acks_mod.SCAN,
        help=f"--reason/--all: newest dead letters of each partition to look at (default {acks_mod.SCAN}); "
        f"refused, sending nothing, when those chosen hold more than {acks_mod.HELD_BYTES_MAX // 2**20} MiB",
    )
    aq.add_argument("--dry-run", action="store_true", help="say which would be sent; send nothing")

    batch = sub.add_parser("batch", help="look at or expire one batch").add_subparsers(
        dest="admin_command", required=True
    )
    bs = batch.add_parser("show", parents=[out], help="state, counts, groups, activity and pending items (runs)")
    bs.add_argument("batch_id", type=_int_in("batch id", 0, ID_MAX))
    bs.add_argument("--after", type=_item_id, help="continue after this item id (paging)")
    bs.add_argument("--limit", type=_int_in("--limit", 1, MAX_LIMIT), default=100, help="runs per page (default 100)")
    bs.add_argument("--failures-after", type=_item_id, help="failed items: continue after this item id (paging)")
    bs.add_argument(
        "--failures-limit",
        type=_int_in("--failures-limit", 1, 1000),
        default=20,
        help="failed items (with their reasons) per page (default 20)",
    )
    be = batch.add_parser("expire", parents=[out], help="expire an open or closed batch now and send its expiry event")
    be.add_argument("batch_id", type=_int_in("batch id", 0, ID_MAX))
    be.add_argument("--note", type=_text("--note"), help="why: carried in the expiry event and the admin log")

    inbox = sub.add_parser("inbox", help="look at consumers' inbox (message ids processed)").add_subparsers(
        dest="admin_command", required=True
    )
    ins = inbox.add_parser("show", parents=[out], help="which consumers processed a message id, and when")
    ins.add_argument("message_id", type=_inbox_text("message id"))
    ins.add_argument("--consumer", type=_inbox_text("--consumer"), help="only this consumer")
    inbox.add_parser("status", parents=[out], help="the inbox's partitions, ids, size, oldest ids kept")


def _progress(enabled: bool):
    """A rich progress bar on stderr when it is a terminal; otherwise nothing is drawn."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    return Progress(
        TextColumn("requeue"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not (enabled and console.is_terminal),
    )


def _run(cfg: Config, args: argparse.Namespace) -> tuple[Any, str, int]:
    """(result for --json, text for people, exit code)"""
    db = cfg.database
    cmd = (args.command, args.admin_command)
    if cmd == ("batch", "show") and args.after is not None and args.after.batch_id != args.batch_id:
        raise AdminError(f"--after {args.after} names batch {args.after.batch_id}, not {args.batch_id}", ExitCode.USAGE)
    fa = getattr(args, "failures_after", None)
    if cmd == ("batch", "show") and fa is not None and fa.batch_id != args.batch_id:
        raise AdminError(f"--failures-after {fa} names batch {fa.batch_id}, not {args.batch_id}", ExitCode.USAGE)
    # the dead commands' outbox, named before anything touches a database
    dead = dead_mod.target(cfg, args.outbox) if args.command == "dead" else None
    with connect(cfg, dead.dsn if dead is not None else None) as conn:
        if cmd == ("outbox", "status"):
            st = status_mod.outbox_status(cfg, conn, args.timeout)
            return st.as_dict(), status_mod.render(st), status_mod.exit_code(st)
        if cmd == ("dead", "list") and dead is not None:
            page = dead_mod.list_dead(
                conn, dead.schema, dead.table, reason=args.reason, after=args.after, limit=args.limit
            )
            return page, dead_mod.render_page(page), ExitCode.OK
        if cmd == ("dead", "requeue") and dead is not None:
            if args.ids:
                ids = [i for group in args.ids for i in group]
                if len(ids) > MAX_IDS:
                    raise AdminError(f"--id names {len(ids)} ids; at most {MAX_IDS} at once", ExitCode.USAGE)
                done = dead_mod.requeue_ids(conn, dead.schema, dead.table, ids, dry_run=args.dry_run)
            else:
                with _progress(not args.json) as bar:
                    task = bar.add_task("requeue", total=None)
                    done = dead_mod.requeue_matching(
                        conn,
                        dead.schema,
                        dead.table,
                        reason=None if args.all else args.reason,
                        chunk=args.chunk,
                        dry_run=args.dry_run,
                        progress=lambda n, total: bar.update(task, completed=n, total=total),
                    )
            return done, dead_mod.render_requeued(done), ExitCode.OK
        if cmd == ("acks", "requeue"):
            sent = acks_mod.requeue(cfg, conn, at=args.at, reason=args.reason, scan=args.scan, dry_run=args.dry_run)
            return sent, acks_mod.render(sent), ExitCode.OK
        if cmd == ("batch", "show"):
            try:
                view = batch_mod.show(
                    conn,
                    db.schema,
                    args.batch_id,
                    after=args.after,
                    limit=args.limit,
                    failures_after=args.failures_after,
                    failures_limit=args.failures_limit,
                )
            except InvalidValue as exc:  # a cursor past any group (an index of 8192 or more): the caller's input
                raise AdminError(str(exc), ExitCode.USAGE) from None
            return view, batch_mod.render(view), ExitCode.OK
        if cmd == ("batch", "expire"):
            got = batch_mod.expire(cfg, conn, args.batch_id, args.note)
            result = {
                "batch_id": args.batch_id,
                "expired": got is not None,
                "event": dataclasses.asdict(got) if got else None,
            }
            return result, batch_mod.render_expired(args.batch_id, got), ExitCode.OK
        if cmd == ("inbox", "show"):
            found = inbox_mod.show(conn, db.schema, args.message_id, args.consumer)
            return found, inbox_mod.render_show(found), ExitCode.OK if found.recorded else ExitCode.NOT_FOUND
        if cmd == ("inbox", "status"):
            kept = inbox_mod.status(conn, db.schema)
            return kept, inbox_mod.render_status(kept), ExitCode.OK
    raise AdminError(f"unknown command {' '.join(cmd)}", ExitCode.USAGE)


def main(cfg: Config, args: argparse.Namespace) -> int:
    # Kafka clients (outbox status) log through structlog on stderr, like `reaper run`; quiet by default.
    level = cfg.logging.level if cfg.logging.level.lower() in ("debug", "error") else "warning"
    logs.configure(
        "console"
        if cfg.logging.format == "console" or (cfg.logging.format == "auto" and sys.stderr.isatty())
        else "json",
        level,
    )
    name = f"reaper {args.command} {args.admin_command}"
    try:
        result, text, code = _run(cfg, args)
    except KeyboardInterrupt:  # Ctrl-C while it waits for the database or Kafka: its transaction rolled back
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one must not interrupt the report
        return _fail(args, name, INTERRUPTED, ExitCode.INTERRUPTED)
    except AdminError as exc:
        return _fail(args, name, str(exc), exc.code)
    except psycopg.OperationalError as exc:
        return _fail(args, name, f"database unavailable: {redact_dsn(str(exc)).strip()}", ExitCode.UNAVAILABLE)
    except Exception as exc:  # a database or Kafka error mid-command: its transaction was rolled back
        return _fail(args, name, f"{type(exc).__name__}: {redact_dsn(str(exc)).strip()}", ExitCode.FAILURE)
    if args.json:
        is_record = dataclasses.is_dataclass(result) and not isinstance(result, type)
        print(to_json(dataclasses.asdict(result) if is_record else result))
    else:
        print(text)
    return code


def _fail(args: argparse.Namespace, name: str, message: str, code: int) -> int:
    print(f"{name}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        json_error(message, code)
    return code
