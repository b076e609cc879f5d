-- Fan-out tracking: a batch owns groups; a group owns one bit per item (set = pending).
CREATE TABLE batch (
    id               bigserial   PRIMARY KEY,
    user_key         text,
    state            text        NOT NULL DEFAULT 'open'
                                 CHECK (state IN ('open', 'closed', 'complete', 'expired')),
    total            bigint      NOT NULL DEFAULT 0 CHECK (total >= 0),
    pending          bigint      NOT NULL DEFAULT 0 CHECK (pending >= 0 AND pending <= total),
    next_group       bigint      NOT NULL DEFAULT 0,   -- group ids handed out by add/enqueue
    completion_topic text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    closed_at        timestamptz,
    completed_at     timestamptz,
    last_activity_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE batch_group (
    batch_id bigint  NOT NULL REFERENCES batch (id) ON DELETE CASCADE,
    id       bigint  NOT NULL CHECK (id >= 0),
    size     integer NOT NULL CHECK (size BETWEEN 1 AND 8192),
    pending  integer NOT NULL CHECK (pending BETWEEN 0 AND size),
    bits     varbit(8192) NOT NULL CHECK (bit_length(bits) = size),
    PRIMARY KEY (batch_id, id)
);
