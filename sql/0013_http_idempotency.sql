-- Idempotency-Key for the HTTP service's POSTs (the IETF httpapi draft's semantics): the first
-- request with a key records its answer in the same transaction as its effect; a retry with the
-- same key and the same request gets that answer back and changes nothing; the same key with
-- another request is refused. Keys belong to a token (never shared between callers) and expire
-- after http.idempotency_window; `reaper serve` deletes expired ones in bounded chunks.
-- Runs with search_path set to the configured schema.

CREATE TABLE http_idempotency (
    token       text        NOT NULL,
    key         text        NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    fingerprint bytea       NOT NULL,
    reply       json        NOT NULL,  -- json, not jsonb: replayed byte for byte, keys in their order
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (token, key)
);
CREATE INDEX http_idempotency_expiry ON http_idempotency (expires_at);
