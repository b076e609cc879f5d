-- Console sessions ended by logging out. A session cookie is signed, not stored: without this
-- table a copy of the cookie would keep working until it expires. Every server of the console
-- refuses a session found here, so a logout holds behind any number of them. A row names the
-- session by the SHA-256 digest of its id and lasts until the cookie would have expired anyway
-- (rows past it are deleted by later logouts).
CREATE TABLE IF NOT EXISTS console_logout (
    session    bytea       PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
