-- Version 1, the baseline: every table, sequence, view and index of spindle's store, and the
-- rows it starts with. The project grew its schema through 23 migrations before any
-- deployment existed; they were squashed into this one on 2026-12-07 (git history before that
-- date has them, each with its reason).
--
-- Migrations hold DDL and data only. The functions the node calls in its batches live in
-- control-plane/sql/functions/, one file per function; they are created after the migrations,
-- under the same lock, and created again whenever a file's text changes. A migration never
-- calls one: a later function file may change what it does.
--
-- The tables, in brief (docs/storage.md has the model):
--   task                  one row per task; its live attempt, its reservation (res_* arrays)
--                         and its final attempt are columns of the row, so the hot path
--                         touches one row per task
--   attempt_history       attempts that ended before the task did
--   task_attempt, resource_reservation, dead_letter
--                         views over those two, with the names operators and tests read
--   outbox_batch          events, one row per batch of tasks a call moved (arrays, one entry
--                         per event); outbox_event is the view with one row per event
--   consumed_event        what each event consumer has acknowledged
--   resource_pool_shard   capacity and use of each pool shard (provider slots, GPU, budgets)
--   partition_lease       which node serves which tenant partition, until when, at which epoch
--   node, node_share      live nodes; each node's part of a cluster-wide limit
--   policy_version, tenant_policy, lane, provider_account, model_capability, audit_log
--                         the policy store: versioned objects and who changed what, and why
--   tenant_quota, quota_ledger, quota_ledger_closed, quota_reset
--                         cost budgets: reserve / settle / refund entries, closed periods
--   task_transition       the state machine's allowed transitions

CREATE TABLE attempt_history (
    task_id bigint NOT NULL,
    attempt_no integer NOT NULL,
    attempt_id bigint NOT NULL,
    fencing_token bigint NOT NULL,
    node_id text NOT NULL,
    provider text NOT NULL,
    provider_request_key text NOT NULL,
    lease_until timestamp with time zone NOT NULL,
    created_at timestamp with time zone NOT NULL,
    ended_at timestamp with time zone DEFAULT now() NOT NULL,
    outcome text NOT NULL,
    res_pool text[] DEFAULT '{}'::text[] NOT NULL,
    res_shard smallint[] DEFAULT '{}'::smallint[] NOT NULL,
    res_amount bigint[] DEFAULT '{}'::bigint[] NOT NULL,
    released_at timestamp with time zone
);

CREATE SEQUENCE attempt_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

CREATE TABLE audit_log (
    audit_id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    actor text NOT NULL,
    object_kind text NOT NULL,
    object_key text NOT NULL,
    old_value jsonb,
    new_value jsonb,
    reason text NOT NULL,
    policy_version bigint NOT NULL,
    CONSTRAINT audit_log_actor_check CHECK ((length(actor) > 0)),
    CONSTRAINT audit_log_reason_check CHECK ((length(reason) > 0))
);

CREATE SEQUENCE audit_log_audit_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE audit_log_audit_id_seq OWNED BY audit_log.audit_id;

CREATE TABLE consumed_event (
    consumer text NOT NULL,
    event_id bigint NOT NULL,
    consumed_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE task (
    task_id bigint NOT NULL,
    tenant_id integer NOT NULL,
    user_id integer NOT NULL,
    idempotency_key text NOT NULL COLLATE pg_catalog."C",
    payload bytea NOT NULL,
    partition integer NOT NULL,
    lane smallint NOT NULL,
    band smallint NOT NULL,
    state text NOT NULL,
    version integer DEFAULT 0 NOT NULL,
    policy_version bigint NOT NULL,
    cost_estimate_milli bigint NOT NULL,
    fairness_milli bigint NOT NULL,
    cost_actual_milli bigint,
    budget_reserved boolean DEFAULT false NOT NULL,
    attempt_no integer DEFAULT 0 NOT NULL,
    current_attempt bigint,
    current_fencing bigint,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    next_eligible_at timestamp with time zone,
    failure_reason text,
    attempt_node text,
    attempt_provider text,
    attempt_lease_until timestamp with time zone,
    attempt_started_at timestamp with time zone,
    res_pool text[],
    res_shard smallint[],
    res_amount bigint[],
    res_released_at timestamp with time zone,
    final_attempt bigint,
    final_fencing bigint,
    cancel_requested boolean DEFAULT false NOT NULL,
    result text,
    CONSTRAINT task_cost_estimate_milli_check CHECK ((cost_estimate_milli >= 0)),
    CONSTRAINT task_fairness_milli_check CHECK ((fairness_milli >= 0)),
    CONSTRAINT task_partition_check CHECK ((partition >= 0))
)
WITH (fillfactor='50');

CREATE VIEW task_attempt AS
 SELECT h.attempt_id,
    h.task_id,
    h.attempt_no,
    h.fencing_token,
    h.node_id,
    h.provider,
    h.provider_request_key,
    h.lease_until,
    h.created_at,
    h.ended_at,
    h.outcome
   FROM attempt_history h
UNION ALL
 SELECT t.current_attempt AS attempt_id,
    t.task_id,
    t.attempt_no,
    t.current_fencing AS fencing_token,
    t.attempt_node AS node_id,
    t.attempt_provider AS provider,
    ((('spindle-'::text || t.task_id) || '-'::text) || t.attempt_no) AS provider_request_key,
    t.attempt_lease_until AS lease_until,
    t.attempt_started_at AS created_at,
    NULL::timestamp with time zone AS ended_at,
    NULL::text AS outcome
   FROM task t
  WHERE (t.current_attempt IS NOT NULL)
UNION ALL
 SELECT t.final_attempt AS attempt_id,
    t.task_id,
    t.attempt_no,
    t.final_fencing AS fencing_token,
    COALESCE(t.attempt_node, ''::text) AS node_id,
    COALESCE(t.attempt_provider, ''::text) AS provider,
    ((('spindle-'::text || t.task_id) || '-'::text) || t.attempt_no) AS provider_request_key,
    COALESCE(t.attempt_lease_until, t.updated_at) AS lease_until,
    COALESCE(t.attempt_started_at, t.updated_at) AS created_at,
    t.updated_at AS ended_at,
    t.state AS outcome
   FROM task t
  WHERE (t.final_attempt IS NOT NULL);

CREATE VIEW dead_letter AS
 SELECT t.task_id,
    t.tenant_id,
    t.lane,
    t.attempt_no AS attempts,
    t.failure_reason,
    t.cost_estimate_milli,
    t.created_at,
    t.updated_at AS failed_at,
    a.provider AS last_provider,
    a.provider_request_key AS last_request_key
   FROM (task t
     LEFT JOIN LATERAL ( SELECT ta.provider,
            ta.provider_request_key
           FROM task_attempt ta
          WHERE (ta.task_id = t.task_id)
          ORDER BY ta.attempt_no DESC
         LIMIT 1) a ON (true))
  WHERE (t.state = 'FAILED'::text);

CREATE SEQUENCE fencing_token_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

CREATE TABLE lane (
    lane text NOT NULL,
    version bigint NOT NULL,
    body jsonb NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE model_capability (
    model text NOT NULL,
    version bigint NOT NULL,
    body jsonb NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE node (
    node_id text NOT NULL,
    address text DEFAULT ''::text NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    state text DEFAULT 'UP'::text NOT NULL,
    relay_pending_max bigint,
    CONSTRAINT node_node_id_check CHECK (((length(node_id) >= 1) AND (length(node_id) <= 128))),
    CONSTRAINT node_relay_pending_max_check CHECK (((relay_pending_max IS NULL) OR (relay_pending_max > 0))),
    CONSTRAINT node_state_check CHECK ((state = ANY (ARRAY['UP'::text, 'DRAINING'::text, 'DOWN'::text])))
);

COMMENT ON COLUMN node.relay_pending_max IS 'The events this node''s relay lets wait before it refuses new work; NULL: it runs no relay';

CREATE TABLE node_share (
    limit_key text NOT NULL,
    node_id text NOT NULL,
    weight bigint DEFAULT 0 NOT NULL,
    used bigint DEFAULT 0 NOT NULL,
    part bigint DEFAULT 0 NOT NULL,
    lowered_from bigint,
    lowered_until timestamp with time zone,
    CONSTRAINT node_share_limit_key_check CHECK (((length(limit_key) >= 1) AND (length(limit_key) <= 256))),
    CONSTRAINT node_share_lowered_from_check CHECK ((lowered_from >= 0)),
    CONSTRAINT node_share_part_check CHECK ((part >= 0)),
    CONSTRAINT node_share_used_check CHECK ((used >= 0)),
    CONSTRAINT node_share_weight_check CHECK ((weight >= 0))
);

CREATE TABLE outbox_batch (
    batch_id bigint NOT NULL,
    kinds text[] NOT NULL,
    tasks bigint[] NOT NULL,
    tenants integer[] NOT NULL,
    details jsonb DEFAULT '{}'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    delivered integer DEFAULT 0 NOT NULL,
    delivered_at timestamp with time zone,
    CONSTRAINT outbox_batch_tasks_check CHECK (((cardinality(tasks) >= 1) AND (cardinality(tasks) <= 4096)))
);
ALTER TABLE ONLY outbox_batch ALTER COLUMN details SET STORAGE EXTERNAL;

CREATE SEQUENCE outbox_batch_batch_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE outbox_batch_batch_id_seq OWNED BY outbox_batch.batch_id;

CREATE VIEW outbox_event AS
 SELECT ((b.batch_id * 4096) + (e.i - 1)) AS event_id,
    b.tasks[e.i] AS task_id,
    b.tenants[e.i] AS tenant_id,
    b.kinds[e.i] AS kind,
    ( SELECT COALESCE(jsonb_object_agg(d.key,
                CASE
                    WHEN (jsonb_typeof(d.value) = 'array'::text) THEN (d.value -> (e.i - 1))
                    ELSE d.value
                END), '{}'::jsonb) AS body
           FROM jsonb_each(b.details) d(key, value)) AS body,
    b.created_at,
        CASE
            WHEN (e.i <= b.delivered) THEN COALESCE(b.delivered_at, b.created_at)
            ELSE NULL::timestamp with time zone
        END AS delivered_at
   FROM outbox_batch b,
    LATERAL generate_subscripts(b.tasks, 1) e(i);

CREATE TABLE partition_lease (
    partition integer NOT NULL,
    owner_node text,
    lease_until timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    epoch bigint DEFAULT 0 NOT NULL,
    CONSTRAINT partition_lease_partition_check CHECK ((partition >= 0))
);

CREATE TABLE policy_version (
    singleton boolean DEFAULT true NOT NULL,
    version bigint NOT NULL,
    CONSTRAINT policy_version_singleton_check CHECK (singleton),
    CONSTRAINT policy_version_version_check CHECK ((version >= 1))
);

CREATE TABLE provider_account (
    account text NOT NULL,
    version bigint NOT NULL,
    body jsonb NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE quota_ledger (
    entry_id bigint NOT NULL,
    tenant_id integer NOT NULL,
    task_id bigint NOT NULL,
    kind text NOT NULL,
    amount_milli bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT quota_ledger_kind_check CHECK ((kind = ANY (ARRAY['RESERVE'::text, 'SETTLE'::text, 'REFUND'::text])))
);

CREATE TABLE quota_ledger_closed (
    entry_id bigint NOT NULL,
    tenant_id integer NOT NULL,
    task_id bigint NOT NULL,
    kind text NOT NULL,
    amount_milli bigint NOT NULL,
    at timestamp with time zone NOT NULL,
    closed_at timestamp with time zone DEFAULT now() NOT NULL,
    closed_by text NOT NULL
);

CREATE SEQUENCE quota_ledger_entry_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE quota_ledger_entry_id_seq OWNED BY quota_ledger.entry_id;

CREATE TABLE quota_reset (
    tenant_id integer NOT NULL,
    reset_at timestamp with time zone NOT NULL
);

CREATE TABLE resource_pool_shard (
    pool_key text NOT NULL,
    shard smallint NOT NULL,
    capacity bigint NOT NULL,
    used bigint DEFAULT 0 NOT NULL,
    version bigint DEFAULT 0 NOT NULL,
    CONSTRAINT resource_pool_shard_capacity_check CHECK ((capacity >= 0)),
    CONSTRAINT resource_pool_shard_pool_key_check CHECK (((length(pool_key) >= 1) AND (length(pool_key) <= 200))),
    CONSTRAINT resource_pool_shard_shard_check CHECK ((shard >= 0)),
    CONSTRAINT resource_pool_shard_used_check CHECK ((used >= 0))
)
WITH (fillfactor='50');

CREATE VIEW resource_reservation AS
 SELECT t.current_attempt AS attempt_id,
    r.pool_key,
    r.shard,
    t.task_id,
    r.amount,
        CASE
            WHEN (t.res_released_at IS NULL) THEN 'ACTIVE'::text
            ELSE 'RELEASED'::text
        END AS status,
    t.current_fencing AS fencing_token,
    t.attempt_started_at AS created_at,
    t.res_released_at AS released_at
   FROM task t,
    LATERAL UNNEST(t.res_pool, t.res_shard, t.res_amount) r(pool_key, shard, amount)
  WHERE (t.current_attempt IS NOT NULL)
UNION ALL
 SELECT h.attempt_id,
    r.pool_key,
    r.shard,
    h.task_id,
    r.amount,
    'RELEASED'::text AS status,
    h.fencing_token,
    h.created_at,
    COALESCE(h.released_at, h.ended_at) AS released_at
   FROM attempt_history h,
    LATERAL UNNEST(h.res_pool, h.res_shard, h.res_amount) r(pool_key, shard, amount)
UNION ALL
 SELECT t.final_attempt AS attempt_id,
    r.pool_key,
    r.shard,
    t.task_id,
    r.amount,
    'RELEASED'::text AS status,
    t.final_fencing AS fencing_token,
    t.attempt_started_at AS created_at,
    COALESCE(t.res_released_at, t.updated_at) AS released_at
   FROM task t,
    LATERAL UNNEST(t.res_pool, t.res_shard, t.res_amount) r(pool_key, shard, amount)
  WHERE (t.final_attempt IS NOT NULL);

CREATE SEQUENCE task_id_block
    START WITH 1
    INCREMENT BY 4096
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

CREATE TABLE task_transition (
    from_state text NOT NULL,
    to_state text NOT NULL,
    operator_only boolean DEFAULT false NOT NULL
);

CREATE TABLE tenant_policy (
    tenant_id integer NOT NULL,
    version bigint NOT NULL,
    body jsonb NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE tenant_quota (
    tenant_id integer NOT NULL,
    budget_milli bigint NOT NULL,
    reserved_milli bigint DEFAULT 0 NOT NULL,
    spent_milli bigint DEFAULT 0 NOT NULL,
    CONSTRAINT tenant_quota_budget_milli_check CHECK ((budget_milli >= 0)),
    CONSTRAINT tenant_quota_reserved_milli_check CHECK ((reserved_milli >= 0)),
    CONSTRAINT tenant_quota_spent_milli_check CHECK ((spent_milli >= 0))
)
WITH (fillfactor='50');

ALTER TABLE ONLY audit_log ALTER COLUMN audit_id SET DEFAULT nextval('audit_log_audit_id_seq'::regclass);

ALTER TABLE ONLY outbox_batch ALTER COLUMN batch_id SET DEFAULT nextval('outbox_batch_batch_id_seq'::regclass);

ALTER TABLE ONLY quota_ledger ALTER COLUMN entry_id SET DEFAULT nextval('quota_ledger_entry_id_seq'::regclass);

ALTER TABLE ONLY attempt_history
    ADD CONSTRAINT attempt_history_pkey PRIMARY KEY (task_id, attempt_no);

ALTER TABLE ONLY audit_log
    ADD CONSTRAINT audit_log_pkey PRIMARY KEY (audit_id);

ALTER TABLE ONLY consumed_event
    ADD CONSTRAINT consumed_event_pkey PRIMARY KEY (consumer, event_id);

ALTER TABLE ONLY lane
    ADD CONSTRAINT lane_pkey PRIMARY KEY (lane);

ALTER TABLE ONLY model_capability
    ADD CONSTRAINT model_capability_pkey PRIMARY KEY (model);

ALTER TABLE ONLY node
    ADD CONSTRAINT node_pkey PRIMARY KEY (node_id);

ALTER TABLE ONLY node_share
    ADD CONSTRAINT node_share_pkey PRIMARY KEY (limit_key, node_id);

ALTER TABLE ONLY outbox_batch
    ADD CONSTRAINT outbox_batch_pkey PRIMARY KEY (batch_id);

ALTER TABLE ONLY partition_lease
    ADD CONSTRAINT partition_lease_pkey PRIMARY KEY (partition);

ALTER TABLE ONLY policy_version
    ADD CONSTRAINT policy_version_pkey PRIMARY KEY (singleton);

ALTER TABLE ONLY provider_account
    ADD CONSTRAINT provider_account_pkey PRIMARY KEY (account);

ALTER TABLE ONLY quota_ledger
    ADD CONSTRAINT quota_ledger_pkey PRIMARY KEY (entry_id);

ALTER TABLE ONLY quota_ledger
    ADD CONSTRAINT quota_ledger_task_id_kind_key UNIQUE (task_id, kind);

ALTER TABLE ONLY quota_reset
    ADD CONSTRAINT quota_reset_pkey PRIMARY KEY (tenant_id);

ALTER TABLE ONLY resource_pool_shard
    ADD CONSTRAINT resource_pool_shard_pkey PRIMARY KEY (pool_key, shard);

ALTER TABLE ONLY task
    ADD CONSTRAINT task_pkey PRIMARY KEY (task_id);

ALTER TABLE ONLY task
    ADD CONSTRAINT task_tenant_id_idempotency_key_key UNIQUE (tenant_id, idempotency_key);

ALTER TABLE ONLY task_transition
    ADD CONSTRAINT task_transition_pkey PRIMARY KEY (from_state, to_state);

ALTER TABLE ONLY tenant_policy
    ADD CONSTRAINT tenant_policy_pkey PRIMARY KEY (tenant_id);

ALTER TABLE ONLY tenant_quota
    ADD CONSTRAINT tenant_quota_pkey PRIMARY KEY (tenant_id);

CREATE INDEX outbox_batch_pending ON outbox_batch USING btree (batch_id) WHERE (delivered_at IS NULL);

CREATE INDEX quota_ledger_closed_task ON quota_ledger_closed USING btree (task_id);

ALTER TABLE ONLY partition_lease
    ADD CONSTRAINT partition_lease_owner_node_fkey FOREIGN KEY (owner_node) REFERENCES node(node_id);


-- The rows every store starts with: the policy's version counter and the task state machine's
-- allowed transitions (the core's, checked by `the_stored_transition_whitelist_is_the_cores`).
INSERT INTO policy_version VALUES (true, 1);

INSERT INTO task_transition (from_state, to_state, operator_only) VALUES
    ('CREATED', 'QUEUED', false),
    ('CREATED', 'CANCELED', false),
    ('CREATED', 'EXPIRED', false),
    ('QUEUED', 'DISPATCHING', false),
    ('QUEUED', 'CANCELED', false),
    ('QUEUED', 'EXPIRED', false),
    ('QUEUED', 'FAILED', false),
    ('DISPATCHING', 'RUNNING', false),
    ('DISPATCHING', 'SUBMIT_UNKNOWN', false),
    ('DISPATCHING', 'QUEUED', false),
    ('DISPATCHING', 'FAILED', false),
    ('DISPATCHING', 'CANCELED', false),
    ('SUBMIT_UNKNOWN', 'RUNNING', false),
    ('SUBMIT_UNKNOWN', 'QUEUED', false),
    ('SUBMIT_UNKNOWN', 'FAILED', false),
    ('SUBMIT_UNKNOWN', 'CANCELED', false),
    ('RUNNING', 'PROVIDER_SUCCEEDED', false),
    ('RUNNING', 'QUEUED', false),
    ('RUNNING', 'FAILED', false),
    ('RUNNING', 'CANCELED', false),
    ('PROVIDER_SUCCEEDED', 'MEDIA_PROCESSING', false),
    ('PROVIDER_SUCCEEDED', 'FAILED', false),
    ('PROVIDER_SUCCEEDED', 'CANCELED', false),
    ('MEDIA_PROCESSING', 'SUCCEEDED', false),
    ('MEDIA_PROCESSING', 'FAILED', false),
    ('MEDIA_PROCESSING', 'CANCELED', false),
    ('FAILED', 'QUEUED', true);
