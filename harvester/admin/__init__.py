"""Operator commands of `reaper`: `outbox status`, `dead list|requeue`, `batch show|expire`,
`inbox show|status`.

Each command opens one database connection, checks its arguments before it changes anything,
commits what it did as a whole (a requeue of many rows: chunk by chunk), and exits with the codes
in `harvester.exit_codes`.
"""

from harvester.admin.commands import COMMANDS, Parser, UsageError, add_parsers, json_error, main, usage_error

__all__ = ["COMMANDS", "Parser", "UsageError", "add_parsers", "json_error", "main", "usage_error"]
