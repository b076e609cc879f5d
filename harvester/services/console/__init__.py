"""The operator's console: server-rendered pages of the outbox, its leaders, dead rows and batches.

Served by `reaper serve` under /console/ (and by `reaper run` with console.run), behind the HTTP
API's tokens: routes.py (pages and actions, put together from login_routes.py, batch_routes.py and
dead_routes.py; checks.py holds what they share), session.py (login, roles, CSRF), overview.py and
queries.py (bounded reads), actions.py (the admin commands, audited), templates/ and static/.
"""

from harvester.services.console.checks import Console
from harvester.services.console.routes import add_console
from harvester.services.console.session import Sessions, load_viewer_tokens

__all__ = ["Console", "Sessions", "add_console", "load_viewer_tokens"]
