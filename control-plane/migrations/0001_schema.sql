-- spindle schema, version 1: the tables of DESIGN §6. PostgreSQL is the source of truth; every
-- counter here is derived from ACTIVE reservations and can be rebuilt from them.

CREATE TABLE node (
    node_id       text PRIMARY KEY CHECK (length(node_id) BETWEEN 1 AND 128),
    address       text NOT NULL DEFAULT '',
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    state         text NOT NULL DEFAULT 'UP' CHECK (state IN ('UP', 'DRAINING', 'DOWN'))
);

-- Tenants hash to partitions; a partition is owned by one node at a time. The epoch grows on
-- every change of owner so that a node which lost a partition can tell.
CREATE TABLE partition_lease (
    partition    integer PRIMARY KEY CHECK (partition >= 0),
    owner_node   text REFERENCES node (node_id),
    lease_until  timestamptz NOT NULL DEFAULT '-infinity',
    epoch        bigint NOT NULL DEFAULT 0
);

-- Policy: one global version, bumped by every change; each object keeps the version that last
-- wrote it, and every change leaves an audit row.
CREATE TABLE policy_version (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version    bigint NOT NULL CHECK (version >= 1)
);
INSERT INTO policy_version VALUES (true, 1);

CREATE TABLE tenant_policy (
    tenant_id   integer PRIMARY KEY,
    version     bigint NOT NULL,
    body        jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE lane (
    lane        text PRIMARY KEY,
    version     bigint NOT NULL,
    body        jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE provider_account (
    account     text PRIMARY KEY,
    version     bigint NOT NULL,
    body        jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE model_capability (
    model       text PRIMARY KEY,
    version     bigint NOT NULL,
    body        jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE audit_log (
    audit_id        bigserial PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    actor           text NOT NULL CHECK (length(actor) > 0),
    object_kind     text NOT NULL,
    object_key      text NOT NULL,
    old_value       jsonb,
    new_value       jsonb,
    reason          text NOT NULL CHECK (length(reason) > 0),
    policy_version  bigint NOT NULL
);

-- Cost budgets. A tenant without a row has no budget limit. reserved is what admitted, unfinished
-- tasks may still cost; spent is what finished ones did cost.
CREATE TABLE tenant_quota (
    tenant_id       integer PRIMARY KEY,
    budget_milli    bigint NOT NULL CHECK (budget_milli >= 0),
    reserved_milli  bigint NOT NULL DEFAULT 0 CHECK (reserved_milli >= 0),
    spent_milli     bigint NOT NULL DEFAULT 0 CHECK (spent_milli >= 0)
) WITH (fillfactor = 50);

-- One RESERVE per task at submit, then exactly one SETTLE or REFUND: the unique key makes every
-- step idempotent.
CREATE TABLE quota_ledger (
    entry_id      bigserial PRIMARY KEY,
    tenant_id     integer NOT NULL,
    task_id       bigint NOT NULL,
    kind          text NOT NULL CHECK (kind IN ('RESERVE', 'SETTLE', 'REFUND')),
    amount_milli  bigint NOT NULL,
    at            timestamptz NOT NULL DEFAULT now(),
    UNIQUE (task_id, kind)
);

-- The whitelist of DESIGN §5, as data so that the store functions enforce it. A test checks it
-- against spindle-core's TaskState::may_become.
CREATE TABLE task_transition (
    from_state     text NOT NULL,
    to_state       text NOT NULL,
    operator_only  boolean NOT NULL DEFAULT false,
    PRIMARY KEY (from_state, to_state)
);
INSERT INTO task_transition (from_state, to_state) VALUES
    ('CREATED', 'QUEUED'), ('CREATED', 'CANCELED'), ('CREATED', 'EXPIRED'),
    ('QUEUED', 'DISPATCHING'), ('QUEUED', 'CANCELED'), ('QUEUED', 'EXPIRED'),
    ('DISPATCHING', 'RUNNING'), ('DISPATCHING', 'SUBMIT_UNKNOWN'), ('DISPATCHING', 'QUEUED'),
    ('DISPATCHING', 'FAILED'), ('DISPATCHING', 'CANCELED'),
    ('SUBMIT_UNKNOWN', 'RUNNING'), ('SUBMIT_UNKNOWN', 'QUEUED'), ('SUBMIT_UNKNOWN', 'FAILED'),
    ('SUBMIT_UNKNOWN', 'CANCELED'),
    ('RUNNING', 'PROVIDER_SUCCEEDED'), ('RUNNING', 'QUEUED'), ('RUNNING', 'FAILED'),
    ('RUNNING', 'CANCELED'),
    ('PROVIDER_SUCCEEDED', 'MEDIA_PROCESSING'), ('PROVIDER_SUCCEEDED', 'FAILED'),
    ('PROVIDER_SUCCEEDED', 'CANCELED'),
    ('MEDIA_PROCESSING', 'SUCCEEDED'), ('MEDIA_PROCESSING', 'FAILED'),
    ('MEDIA_PROCESSING', 'CANCELED');
INSERT INTO task_transition VALUES ('FAILED', 'QUEUED', true);

-- Task ids are handed to nodes in blocks: the node must know the id before its group commit.
CREATE SEQUENCE task_id_block START 1 INCREMENT BY 4096;
CREATE SEQUENCE attempt_id_seq;
CREATE SEQUENCE fencing_token_seq;

CREATE TABLE task (
    task_id              bigint PRIMARY KEY,
    tenant_id            integer NOT NULL,
    user_id              integer NOT NULL,
    idempotency_key      text NOT NULL,
    payload              bytea NOT NULL,
    partition            integer NOT NULL CHECK (partition >= 0),
    lane                 smallint NOT NULL,
    band                 smallint NOT NULL,
    state                text NOT NULL,
    version              integer NOT NULL DEFAULT 0,
    policy_version       bigint NOT NULL,
    cost_estimate_milli  bigint NOT NULL CHECK (cost_estimate_milli >= 0),
    fairness_milli       bigint NOT NULL CHECK (fairness_milli >= 0),
    cost_actual_milli    bigint,
    -- The estimate was reserved in the tenant's budget at submit (the tenant has one).
    budget_reserved      boolean NOT NULL DEFAULT false,
    attempt_no           integer NOT NULL DEFAULT 0,
    current_attempt      bigint,
    current_fencing      bigint,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    next_eligible_at     timestamptz,
    failure_reason       text,
    UNIQUE (tenant_id, idempotency_key)
);
-- Rebuilding the in-memory queues of owned partitions after a restart or a takeover.
CREATE INDEX task_queued ON task (partition, created_at, task_id) WHERE state = 'QUEUED';

-- Attempts and reservations are written only by the batch functions, in the same statement
-- group as the rows they refer to; they carry no foreign keys because a key check is a trigger
-- per row on the hottest path. Fencing tokens come from a sequence and are unique by
-- construction. The store tests check that no attempt or reservation is orphaned.
--
-- An attempt is live exactly while it is its task's `current_attempt` (ended_at NULL), so at
-- most one attempt per task is live by construction (invariant 3). Nothing mutable is indexed
-- and the tables keep free space per page: ending an attempt, renewing its lease and releasing
-- a reservation are HOT updates that touch no index.
CREATE TABLE task_attempt (
    attempt_id            bigint PRIMARY KEY,
    task_id               bigint NOT NULL,
    attempt_no            integer NOT NULL,
    fencing_token         bigint NOT NULL,
    node_id               text NOT NULL,
    provider              text NOT NULL,
    provider_request_key  text NOT NULL,
    lease_until           timestamptz NOT NULL,
    created_at            timestamptz NOT NULL DEFAULT now(),
    ended_at              timestamptz,
    outcome               text,
    UNIQUE (task_id, attempt_no),
    UNIQUE (provider, provider_request_key)
) WITH (fillfactor = 70);
-- The reconciler finds live attempts through their tasks.
CREATE INDEX task_live ON task (current_attempt) WHERE current_attempt IS NOT NULL;

-- Small, hot tables (budgets, pool shards) keep half of each page free: every batch updates
-- their rows and the updates stay HOT.
-- A limited resource, split into shards so that nodes rarely contend on one row. The sum of the
-- shards' capacities is the resource's capacity; a grant never takes a shard above its own.
CREATE TABLE resource_pool_shard (
    pool_key  text NOT NULL CHECK (length(pool_key) BETWEEN 1 AND 200),
    shard     smallint NOT NULL CHECK (shard >= 0),
    capacity  bigint NOT NULL CHECK (capacity >= 0),
    used      bigint NOT NULL DEFAULT 0 CHECK (used >= 0),
    version   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (pool_key, shard)
) WITH (fillfactor = 50);

-- What an attempt holds. Its lease is the attempt's lease (one row to renew per attempt).
CREATE TABLE resource_reservation (
    attempt_id     bigint NOT NULL,
    pool_key       text NOT NULL,
    shard          smallint NOT NULL,
    task_id        bigint NOT NULL,
    amount         bigint NOT NULL CHECK (amount > 0),
    status         text NOT NULL DEFAULT 'ACTIVE' CHECK (status IN ('ACTIVE', 'RELEASED')),
    fencing_token  bigint NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    released_at    timestamptz,
    PRIMARY KEY (attempt_id, pool_key, shard)
) WITH (fillfactor = 70);
-- No index on (pool_key, shard) or status: the hot paths reach reservations by attempt (the
-- primary key), and a partial index on ACTIVE rows lured the planner into bitmap-ANDing it with
-- the key on every release. Counter rebuild, a rare reconciler job, scans.

-- The transactional outbox: rows written in the same transaction as the change they announce,
-- relayed at least once; consumers remember what they took (consumed_event) to stay idempotent.
CREATE TABLE outbox_event (
    event_id      bigserial PRIMARY KEY,
    task_id       bigint,
    tenant_id     integer,
    kind          text NOT NULL,
    body          jsonb NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    delivered_at  timestamptz
);
CREATE INDEX outbox_event_pending ON outbox_event (event_id) WHERE delivered_at IS NULL;

CREATE TABLE consumed_event (
    consumer     text NOT NULL,
    event_id     bigint NOT NULL,
    consumed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
