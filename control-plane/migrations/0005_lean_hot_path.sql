-- spindle schema, version 5: a task's hot path in one row.
--
-- Before this version a task cost about fifteen row writes on its way through submit, claim and
-- finish: its own row (never a HOT update: `state` was in the predicate of the QUEUED index and
-- `current_attempt` was indexed, so every change went into every index), an attempt row with
-- three indexes, three reservation rows written twice, two outbox rows with two indexes each, and
-- a FOR UPDATE pass that wrote a lock into every row before the row was changed.
--
-- Now:
--   * The live attempt — its id, fencing token, node, provider, lease — and what it holds (pool
--     keys, shards and amounts, and when they were released) live in the task row. At most one
--     live attempt per task holds by construction; its request key is `spindle-<task>-<n>`,
--     unique by construction beside (task_id, attempt_no).
--   * An attempt that ends is copied into `attempt_history` (one insert, primary key only).
--   * `task` has no index on anything that changes: submit inserts into two indexes, and every
--     later change of the row is a HOT update (fillfactor 50 leaves room on the page).
--   * Outbox events are written one row per batch (`outbox_batch`, arrays of events).
--   * Claims and reports read their rows without locking them and write with a compare-and-set
--     on (state, version): a row another writer moved in between changes nothing and is decided
--     again under a lock (reports) or answered VERSION_MOVED (claims).
--
-- What was a table stays readable under its name as a view: `task_attempt` (history and live
-- attempts), `resource_reservation` (ACTIVE for what a live attempt holds, RELEASED for the
-- rest), `outbox_event` (one row per event; event id = batch id × 4096 + position).
--
-- The price: nothing indexes QUEUED tasks or live attempts any more. The queries that need
-- them — rebuilding queues after a restart or a takeover, resolving live attempts, the
-- reconciler's scans — walk the task table in key order. They run at start, at takeover and in
-- the reconciler's rare jobs, never on the hot path.

DROP VIEW dead_letter;
DROP INDEX task_queued;
DROP INDEX task_live;
ALTER TABLE task SET (fillfactor = 50);
ALTER TABLE task
    ADD COLUMN attempt_node        text,
    ADD COLUMN attempt_provider    text,
    ADD COLUMN attempt_lease_until timestamptz,
    ADD COLUMN attempt_started_at  timestamptz,
    -- What the live attempt holds: parallel arrays, one entry per pool shard.
    ADD COLUMN res_pool            text[],
    ADD COLUMN res_shard           smallint[],
    ADD COLUMN res_amount          bigint[],
    -- NULL while the live attempt holds its reservations; set once when they are released.
    ADD COLUMN res_released_at     timestamptz;

CREATE TABLE attempt_history (
    task_id               bigint NOT NULL,
    attempt_no            integer NOT NULL,
    attempt_id            bigint NOT NULL,
    fencing_token         bigint NOT NULL,
    node_id               text NOT NULL,
    provider              text NOT NULL,
    provider_request_key  text NOT NULL,
    lease_until           timestamptz NOT NULL,
    created_at            timestamptz NOT NULL,
    ended_at              timestamptz NOT NULL DEFAULT now(),
    outcome               text NOT NULL,
    res_pool              text[] NOT NULL DEFAULT '{}',
    res_shard             smallint[] NOT NULL DEFAULT '{}',
    res_amount            bigint[] NOT NULL DEFAULT '{}',
    released_at           timestamptz,
    PRIMARY KEY (task_id, attempt_no)
);

-- Move what the old tables hold: live attempts and their reservations into their task rows,
-- ended attempts into the history.
UPDATE task t SET attempt_node = a.node_id, attempt_provider = a.provider,
       attempt_lease_until = a.lease_until, attempt_started_at = a.created_at,
       res_pool = coalesce(r.pools, '{}'), res_shard = coalesce(r.shards, '{}'),
       res_amount = coalesce(r.amounts, '{}'),
       res_released_at = CASE WHEN r.active > 0 THEN NULL ELSE coalesce(r.released, now()) END
  FROM task_attempt a
  LEFT JOIN (SELECT attempt_id, array_agg(pool_key ORDER BY pool_key, shard) AS pools,
                    array_agg(shard ORDER BY pool_key, shard) AS shards,
                    array_agg(amount ORDER BY pool_key, shard) AS amounts,
                    count(*) FILTER (WHERE status = 'ACTIVE') AS active,
                    max(released_at) AS released
               FROM resource_reservation GROUP BY attempt_id) r ON r.attempt_id = a.attempt_id
 WHERE a.attempt_id = t.current_attempt;
INSERT INTO attempt_history (task_id, attempt_no, attempt_id, fencing_token, node_id, provider,
                             provider_request_key, lease_until, created_at, ended_at, outcome,
                             res_pool, res_shard, res_amount, released_at)
SELECT a.task_id, a.attempt_no, a.attempt_id, a.fencing_token, a.node_id, a.provider,
       a.provider_request_key, a.lease_until, a.created_at, coalesce(a.ended_at, now()),
       coalesce(a.outcome, 'UNKNOWN'), coalesce(r.pools, '{}'), coalesce(r.shards, '{}'),
       coalesce(r.amounts, '{}'), r.released
  FROM task_attempt a
  LEFT JOIN (SELECT attempt_id, array_agg(pool_key ORDER BY pool_key, shard) AS pools,
                    array_agg(shard ORDER BY pool_key, shard) AS shards,
                    array_agg(amount ORDER BY pool_key, shard) AS amounts,
                    max(released_at) AS released
               FROM resource_reservation GROUP BY attempt_id) r ON r.attempt_id = a.attempt_id
 WHERE NOT EXISTS (SELECT 1 FROM task t WHERE t.current_attempt = a.attempt_id);
DROP TABLE resource_reservation;
DROP TABLE task_attempt;

CREATE VIEW task_attempt AS
SELECT h.attempt_id, h.task_id, h.attempt_no, h.fencing_token, h.node_id, h.provider,
       h.provider_request_key, h.lease_until, h.created_at, h.ended_at, h.outcome
  FROM attempt_history h
UNION ALL
SELECT t.current_attempt, t.task_id, t.attempt_no, t.current_fencing, t.attempt_node,
       t.attempt_provider, 'spindle-' || t.task_id || '-' || t.attempt_no,
       t.attempt_lease_until, t.attempt_started_at, NULL::timestamptz, NULL::text
  FROM task t WHERE t.current_attempt IS NOT NULL;

CREATE VIEW resource_reservation AS
SELECT t.current_attempt AS attempt_id, r.pool_key, r.shard, t.task_id, r.amount,
       CASE WHEN t.res_released_at IS NULL THEN 'ACTIVE' ELSE 'RELEASED' END AS status,
       t.current_fencing AS fencing_token, t.attempt_started_at AS created_at,
       t.res_released_at AS released_at
  FROM task t, unnest(t.res_pool, t.res_shard, t.res_amount) AS r (pool_key, shard, amount)
 WHERE t.current_attempt IS NOT NULL
UNION ALL
SELECT h.attempt_id, r.pool_key, r.shard, h.task_id, r.amount, 'RELEASED', h.fencing_token,
       h.created_at, coalesce(h.released_at, h.ended_at)
  FROM attempt_history h, unnest(h.res_pool, h.res_shard, h.res_amount) AS r (pool_key, shard, amount);

CREATE VIEW dead_letter AS
SELECT t.task_id, t.tenant_id, t.lane, t.attempt_no AS attempts, t.failure_reason,
       t.cost_estimate_milli, t.created_at, t.updated_at AS failed_at,
       a.provider AS last_provider, a.provider_request_key AS last_request_key
  FROM task t
  LEFT JOIN LATERAL (
        SELECT h.provider, h.provider_request_key FROM attempt_history h
         WHERE h.task_id = t.task_id ORDER BY h.attempt_no DESC LIMIT 1) a ON true
 WHERE t.state = 'FAILED';

-- The outbox, one row per batch: event i of a row is (kinds[i], tasks[i], tenants[i]) with a
-- body taken from `details`, where each key holds either an array with one entry per event or
-- a value every event of the row shares (`spindle_event_body`). Building one object of arrays
-- per batch costs a fraction of one object per event. `delivered` counts the row's events the
-- relay has handed out, in order.
CREATE TABLE outbox_batch (
    batch_id      bigserial PRIMARY KEY,
    kinds         text[] NOT NULL,
    tasks         bigint[] NOT NULL,
    tenants       integer[] NOT NULL,
    details       jsonb NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    delivered     integer NOT NULL DEFAULT 0,
    delivered_at  timestamptz,
    CHECK (cardinality(tasks) BETWEEN 1 AND 4096)
);
CREATE INDEX outbox_batch_pending ON outbox_batch (batch_id) WHERE delivered_at IS NULL;
-- A batch's details are a few kilobytes: compressing them costs more CPU than it saves in I/O.
ALTER TABLE outbox_batch ALTER COLUMN details SET STORAGE EXTERNAL;

-- The body of event `p_i` (from 1) of a row's details.
CREATE FUNCTION spindle_event_body(p_details jsonb, p_i integer) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(jsonb_object_agg(d.key, CASE WHEN jsonb_typeof(d.value) = 'array'
                                                 THEN d.value -> (p_i - 1) ELSE d.value END),
                    '{}')
      FROM jsonb_each(p_details) AS d
$$;

INSERT INTO outbox_batch (kinds, tasks, tenants, details, created_at, delivered, delivered_at)
SELECT ARRAY[e.kind], ARRAY[coalesce(e.task_id, 0)], ARRAY[coalesce(e.tenant_id, 0)],
       (SELECT coalesce(jsonb_object_agg(b.key, jsonb_build_array(b.value)), '{}')
          FROM jsonb_each(e.body) AS b),
       e.created_at, CASE WHEN e.delivered_at IS NULL THEN 0 ELSE 1 END, e.delivered_at
  FROM outbox_event e ORDER BY e.event_id;
DROP TABLE outbox_event;

CREATE VIEW outbox_event AS
SELECT b.batch_id * 4096 + (e.i - 1) AS event_id, b.tasks[e.i] AS task_id,
       b.tenants[e.i] AS tenant_id, b.kinds[e.i] AS kind,
       spindle_event_body(b.details, e.i) AS body, b.created_at,
       CASE WHEN e.i <= b.delivered THEN coalesce(b.delivered_at, b.created_at) END
           AS delivered_at
  FROM outbox_batch b, generate_subscripts(b.tasks, 1) AS e (i);

-- Batched claims. Per claim, all or nothing: the task must be QUEUED at the expected version and
-- in a partition this node holds; every demanded pool shard must have room (used + amount <=
-- capacity); then the task becomes DISPATCHING with a new attempt (a fencing token from the
-- sequence) holding its demands, the pools are charged and an event announces it.
-- Demands of claim i are p_pool/p_shard/p_amount[p_dstart[i] .. p_dstart[i] + p_dcount[i] - 1].
--
-- Lock order: partition_lease (share) → task (by the compare-and-set update) →
-- resource_pool_shard (by key, at the end). Tasks and pools are first read without a lock: a
-- task another writer moved after the read is answered VERSION_MOVED; a claim that no longer
-- fits once the pools are locked is put back exactly as it was and answered POOL_FULL (a claim
-- refused POOL_FULL in the first decision may have fitted in room a lost claim left: its shard
-- offers it again).
DROP FUNCTION spindle_claim(text, bigint, bigint[], integer[], text[], integer[], integer[], text[], smallint[], bigint[]);
CREATE FUNCTION spindle_claim(
    p_node text, p_lease_ms bigint,
    p_task bigint[], p_version integer[], in_provider text[], p_dstart integer[],
    p_dcount integer[], in_pool text[], p_shard smallint[], p_amount bigint[])
RETURNS TABLE (o_idx integer, o_outcome text, o_attempt bigint, o_token bigint,
               o_attempt_no integer, o_detail text)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    -- Variable-width array arguments are copied into variables: PL/pgSQL keeps a variable's
    -- array expanded, so element i costs O(1); element i of a flat argument walks i elements,
    -- which made every per-row access of a batch O(n) and the batch O(n²).
    p_provider text[] := in_provider;
    p_pool text[] := in_pool;
    n integer := coalesce(array_length(p_task, 1), 0);
    i integer;
    j integer;
    k integer;
    fits boolean;
    v_owned integer[];
    v_lease timestamptz := now() + p_lease_ms * interval '1 millisecond';
    pk_key text[];
    pk_shard smallint[];
    pk_cap bigint[];
    pk_used bigint[];
    pk_used0 bigint[];
    d_pos integer[];
    t_state text[];
    t_version integer[];
    t_partition integer[];
    t_tenant integer[];
    t_attempt_no integer[];
    r_outcome text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_attempt bigint[] := array_fill(NULL::bigint, ARRAY[greatest(n, 1)]);
    r_token bigint[] := array_fill(NULL::bigint, ARRAY[greatest(n, 1)]);
    r_no integer[] := array_fill(NULL::integer, ARRAY[greatest(n, 1)]);
    r_detail text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    granted integer[] := '{}';
    won integer[];
    lost integer[];
    reverted integer[];
    v_state text;
    v_version integer;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    SELECT array_agg(t.state ORDER BY c.ord), array_agg(t.version ORDER BY c.ord),
           array_agg(t.partition ORDER BY c.ord), array_agg(t.tenant_id ORDER BY c.ord),
           array_agg(t.attempt_no ORDER BY c.ord)
      INTO t_state, t_version, t_partition, t_tenant, t_attempt_no
      FROM unnest(p_task) WITH ORDINALITY AS c (task, ord)
      LEFT JOIN task t ON t.task_id = c.task;
    -- Only the partitions this batch's tasks are in: locking every partition the node owns
    -- would have each call share-lock them all (and two shards' calls create multixacts).
    SELECT coalesce(array_agg(l.partition), '{}') INTO v_owned FROM (
        SELECT pl.partition FROM partition_lease pl
         WHERE pl.owner_node = p_node AND pl.lease_until > now()
           AND pl.partition = ANY (t_partition)
         ORDER BY pl.partition FOR SHARE) l;
    -- The pool shards as they are now, unlocked: a first decision. They are locked only at the
    -- end, for as short a time as the batch allows (every batch of every shard and node that
    -- draws on a pool waits for that lock), and the decision is checked again under it.
    WITH seen AS MATERIALIZED (
        SELECT p.pool_key, p.shard, p.capacity, p.used FROM resource_pool_shard p
         WHERE (p.pool_key, p.shard) IN (SELECT * FROM unnest(p_pool, p_shard)))
    SELECT coalesce(array_agg(l.pool_key ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.shard ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.capacity ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.used ORDER BY l.pool_key, l.shard), '{}')
      INTO pk_key, pk_shard, pk_cap, pk_used FROM seen l;
    SELECT array_agg(x.pos ORDER BY d.ord) INTO d_pos
      FROM unnest(p_pool, p_shard) WITH ORDINALITY AS d (k, s, ord)
      LEFT JOIN unnest(pk_key, pk_shard) WITH ORDINALITY AS x (k, s, pos)
        ON x.k = d.k AND x.s = d.s;

    FOR i IN 1 .. n LOOP
        IF t_state[i] IS NULL THEN
            r_outcome[i] := 'TASK_GONE';
            CONTINUE;
        END IF;
        IF t_state[i] <> 'QUEUED' OR t_version[i] <> p_version[i] THEN
            r_outcome[i] := 'VERSION_MOVED';
            r_detail[i] := t_state[i] || '@' || t_version[i];
            CONTINUE;
        END IF;
        IF NOT t_partition[i] = ANY (v_owned) THEN
            r_outcome[i] := 'PARTITION_NOT_OWNED';
            r_detail[i] := t_partition[i]::text;
            CONTINUE;
        END IF;
        fits := true;
        FOR j IN p_dstart[i] .. p_dstart[i] + p_dcount[i] - 1 LOOP
            k := d_pos[j];
            IF k IS NULL THEN
                r_outcome[i] := 'UNKNOWN_POOL';
                r_detail[i] := p_pool[j] || '/' || p_shard[j];
                fits := false;
                EXIT;
            END IF;
            IF pk_used[k] + p_amount[j] > pk_cap[k] THEN
                r_outcome[i] := 'POOL_FULL';
                r_detail[i] := p_pool[j] || '/' || p_shard[j];
                fits := false;
                EXIT;
            END IF;
        END LOOP;
        IF NOT fits THEN
            CONTINUE;
        END IF;
        FOR j IN p_dstart[i] .. p_dstart[i] + p_dcount[i] - 1 LOOP
            pk_used[d_pos[j]] := pk_used[d_pos[j]] + p_amount[j];
        END LOOP;
        r_outcome[i] := 'GRANTED';
        -- One number serves as the attempt's id and its fencing token: both need only be
        -- unique and growing, and one sequence call per claim is half the cost of two.
        r_attempt[i] := nextval('fencing_token_seq');
        r_token[i] := r_attempt[i];
        r_no[i] := t_attempt_no[i] + 1;
        granted := granted || i;
    END LOOP;

    IF array_length(granted, 1) IS NOT NULL THEN
        WITH dem AS MATERIALIZED (
            -- One row per granted claim with its demands as arrays, built element by element
            -- (a slice of a variable-width array copies the whole array for every claim).
            SELECT u.g,
                   coalesce(array_agg(p_pool[d.dj] ORDER BY d.dj) FILTER (WHERE d.dj IS NOT NULL),
                            '{}') AS pools,
                   coalesce(array_agg(p_shard[d.dj] ORDER BY d.dj) FILTER (WHERE d.dj IS NOT NULL),
                            '{}') AS shards,
                   coalesce(array_agg(p_amount[d.dj] ORDER BY d.dj) FILTER (WHERE d.dj IS NOT NULL),
                            '{}') AS amounts
              FROM unnest(granted) AS u (g)
              LEFT JOIN LATERAL generate_series(p_dstart[u.g], p_dstart[u.g] + p_dcount[u.g] - 1)
                        AS d (dj) ON true
             GROUP BY u.g
        ), upd AS (
            UPDATE task t SET state = 'DISPATCHING', version = t.version + 1,
                   attempt_no = r_no[dem.g], current_attempt = r_attempt[dem.g],
                   current_fencing = r_token[dem.g], attempt_node = p_node,
                   attempt_provider = p_provider[dem.g], attempt_lease_until = v_lease,
                   attempt_started_at = now(), res_pool = dem.pools, res_shard = dem.shards,
                   res_amount = dem.amounts, res_released_at = NULL, updated_at = now(),
                   next_eligible_at = NULL
              FROM dem
             WHERE t.task_id = p_task[dem.g] AND t.state = 'QUEUED'
               AND t.version = p_version[dem.g]
            RETURNING dem.g)
        SELECT coalesce(array_agg(upd.g), '{}') INTO won FROM upd;
        IF cardinality(won) < cardinality(granted) THEN
            -- Moved by another writer after the read: not granted (nor charged below).
            SELECT array_agg(g) INTO lost FROM unnest(granted) AS g WHERE NOT g = ANY (won);
            FOREACH i IN ARRAY lost LOOP
                SELECT t.state, t.version INTO v_state, v_version
                  FROM task t WHERE t.task_id = p_task[i];
                r_outcome[i] := CASE WHEN v_state IS NULL THEN 'TASK_GONE' ELSE 'VERSION_MOVED' END;
                r_detail[i] := v_state || '@' || v_version;
                r_attempt[i] := NULL;
                r_token[i] := NULL;
                r_no[i] := NULL;
            END LOOP;
        END IF;
        IF cardinality(won) > 0 THEN
            -- Now the pools, locked in key order, and every won claim checked again against
            -- what they hold (another batch may have charged them since the first read).
            WITH locked AS MATERIALIZED (
                SELECT p.pool_key, p.shard, p.capacity, p.used FROM resource_pool_shard p
                 WHERE (p.pool_key, p.shard) IN (SELECT * FROM unnest(pk_key, pk_shard))
                 ORDER BY p.pool_key, p.shard FOR UPDATE)
            SELECT coalesce(array_agg(l.capacity ORDER BY l.pool_key, l.shard), '{}'),
                   coalesce(array_agg(l.used ORDER BY l.pool_key, l.shard), '{}')
              INTO pk_cap, pk_used FROM locked l;
            pk_used0 := pk_used;
            reverted := '{}';
            FOREACH i IN ARRAY won LOOP
                fits := true;
                FOR j IN p_dstart[i] .. p_dstart[i] + p_dcount[i] - 1 LOOP
                    IF pk_used[d_pos[j]] + p_amount[j] > pk_cap[d_pos[j]] THEN
                        r_outcome[i] := 'POOL_FULL';
                        r_detail[i] := p_pool[j] || '/' || p_shard[j];
                        fits := false;
                        EXIT;
                    END IF;
                END LOOP;
                IF fits THEN
                    FOR j IN p_dstart[i] .. p_dstart[i] + p_dcount[i] - 1 LOOP
                        pk_used[d_pos[j]] := pk_used[d_pos[j]] + p_amount[j];
                    END LOOP;
                ELSE
                    reverted := reverted || i;
                    r_attempt[i] := NULL;
                    r_token[i] := NULL;
                    r_no[i] := NULL;
                END IF;
            END LOOP;
            IF cardinality(reverted) > 0 THEN
                -- Back to exactly what they were (nobody outside this transaction saw the
                -- change): the caller's version stays right.
                UPDATE task t SET state = 'QUEUED', version = t.version - 1,
                       attempt_no = t.attempt_no - 1, current_attempt = NULL,
                       current_fencing = NULL
                  FROM unnest(reverted) AS u (g) WHERE t.task_id = p_task[u.g];
                SELECT coalesce(array_agg(g), '{}') INTO won
                  FROM unnest(won) AS g WHERE NOT g = ANY (reverted);
            END IF;
            UPDATE resource_pool_shard p SET used = x.used, version = p.version + 1
              FROM unnest(pk_key, pk_shard, pk_used, pk_used0) AS x (k, s, used, used0)
             WHERE p.pool_key = x.k AND p.shard = x.s AND x.used <> x.used0;
        END IF;
        IF cardinality(won) > 0 THEN
            INSERT INTO outbox_batch (kinds, tasks, tenants, details)
            SELECT array_agg('DISPATCHING'::text ORDER BY g), array_agg(p_task[g] ORDER BY g),
                   array_agg(t_tenant[g] ORDER BY g),
                   jsonb_build_object('attempt', array_agg(r_attempt[g] ORDER BY g),
                                      'attempt_no', array_agg(r_no[g] ORDER BY g),
                                      'provider', array_agg(p_provider[g] ORDER BY g),
                                      'node', p_node)
              FROM unnest(won) AS g;
        END IF;
    END IF;

    RETURN QUERY
    SELECT (u.ord - 1)::integer, u.outcome, u.attempt, u.token, u.no, u.detail
      FROM unnest(r_outcome[1:n], r_attempt[1:n], r_token[1:n], r_no[1:n], r_detail[1:n])
           WITH ORDINALITY AS u (outcome, attempt, token, no, detail, ord);
END
$$;

-- Fenced reports (modes as in version 3: ADVANCE, RELEASE, REQUEUE, FINISH; p_via the states on
-- the way). Per row: the token must be the task's current one, every hop on the whitelist,
-- terminal states refuse everything. A release gives back what the live attempt holds, once
-- (res_released_at goes from NULL to the time); an attempt that ends is copied into the
-- history and the task holds none.
--
-- Lock order: task (by the compare-and-set update, or FOR UPDATE in a second round) →
-- resource_pool_shard (by key) → tenant_quota. Rows are first read without a lock and written
-- with a compare-and-set on their version; a row another writer moved in between is read again
-- under a lock and decided again (a second round that cannot lose).
DROP FUNCTION spindle_report(bigint[], bigint[], text[], text[], bigint[], bigint[], text[], text[]);
CREATE FUNCTION spindle_report(
    p_task bigint[], p_token bigint[], in_mode text[], in_to text[], p_cost_actual bigint[],
    p_delay_ms bigint[], in_reason text[], in_via text[])
RETURNS TABLE (o_idx integer, o_outcome text, o_state text, o_version integer,
               o_released integer, o_detail text)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    -- Variable-width array arguments are copied into variables: PL/pgSQL keeps a variable's
    -- array expanded, so element i costs O(1); element i of a flat argument walks i elements,
    -- which made every per-row access of a batch O(n) and the batch O(n²).
    p_mode text[] := in_mode;
    p_to text[] := in_to;
    p_reason text[] := in_reason;
    p_via text[] := in_via;
    n integer := coalesce(array_length(p_task, 1), 0);
    i integer;
    v_round integer;
    v_to text;
    v_ends boolean;
    v_cur text;
    v_hop text;
    v_bad boolean;
    v_row record;
    allowed text[];
    t_state text[];
    t_version integer[];
    t_token bigint[];
    t_attempt bigint[];
    t_tenant integer[];
    t_estimate bigint[];
    t_budget boolean[];
    t_held integer[];
    r_outcome text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_state text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_version integer[] := array_fill(NULL::integer, ARRAY[greatest(n, 1)]);
    r_detail text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_released integer[] := array_fill(0, ARRAY[greatest(n, 1)]);
    ends boolean[] := array_fill(false, ARRAY[greatest(n, 1)]);
    releases boolean[] := array_fill(false, ARRAY[greatest(n, 1)]);
    to_state text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    pending integer[];
    applied integer[];
    won integer[];
    won_all integer[] := '{}';
    lost integer[];
    g_key text[];
    g_shard smallint[];
    g_amount bigint[];
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    SELECT array_agg(tt.from_state || '>' || tt.to_state) INTO allowed
      FROM task_transition tt WHERE NOT tt.operator_only;
    SELECT array_agg(t.state ORDER BY c.ord), array_agg(t.version ORDER BY c.ord),
           array_agg(t.current_fencing ORDER BY c.ord), array_agg(t.current_attempt ORDER BY c.ord),
           array_agg(t.tenant_id ORDER BY c.ord), array_agg(t.cost_estimate_milli ORDER BY c.ord),
           array_agg(t.budget_reserved ORDER BY c.ord),
           array_agg(CASE WHEN t.current_attempt IS NOT NULL AND t.res_released_at IS NULL
                          THEN coalesce(cardinality(t.res_pool), 0) ELSE 0 END ORDER BY c.ord)
      INTO t_state, t_version, t_token, t_attempt, t_tenant, t_estimate, t_budget, t_held
      FROM unnest(p_task) WITH ORDINALITY AS c (task, ord)
      LEFT JOIN task t ON t.task_id = c.task;
    pending := ARRAY(SELECT generate_series(1, n));

    FOR v_round IN 1 .. 2 LOOP
        IF v_round = 2 THEN
            -- The rows that moved under the first round, read again under their locks.
            PERFORM 1 FROM task t WHERE t.task_id = ANY (ARRAY(SELECT p_task[g] FROM unnest(pending) g))
             ORDER BY t.task_id FOR UPDATE;
            FOREACH i IN ARRAY pending LOOP
                SELECT t.state, t.version, t.current_fencing, t.current_attempt, t.tenant_id,
                       t.cost_estimate_milli, t.budget_reserved,
                       CASE WHEN t.current_attempt IS NOT NULL AND t.res_released_at IS NULL
                            THEN coalesce(cardinality(t.res_pool), 0) ELSE 0 END AS held
                  INTO v_row FROM task t WHERE t.task_id = p_task[i];
                t_state[i] := v_row.state;
                t_version[i] := v_row.version;
                t_token[i] := v_row.current_fencing;
                t_attempt[i] := v_row.current_attempt;
                t_tenant[i] := v_row.tenant_id;
                t_estimate[i] := v_row.cost_estimate_milli;
                t_budget[i] := v_row.budget_reserved;
                t_held[i] := coalesce(v_row.held, 0);
            END LOOP;
        END IF;
        applied := '{}';
        FOREACH i IN ARRAY pending LOOP
            r_outcome[i] := NULL;
            r_detail[i] := NULL;
            IF t_state[i] IS NULL THEN
                r_outcome[i] := 'TASK_GONE';
                CONTINUE;
            END IF;
            r_state[i] := t_state[i];
            r_version[i] := t_version[i];
            IF t_token[i] IS DISTINCT FROM p_token[i] THEN
                r_outcome[i] := 'STALE_TOKEN';
                r_detail[i] := coalesce(t_token[i]::text, 'none');
                CONTINUE;
            END IF;
            v_to := coalesce(p_to[i], t_state[i]);
            v_ends := p_mode[i] IN ('REQUEUE', 'FINISH');
            -- The states passed on the way, each hop on the whitelist: a hop to the state the
            -- task is already in repeats a report and is harmless.
            v_cur := t_state[i];
            v_bad := false;
            IF p_via[i] IS NOT NULL THEN
                FOREACH v_hop IN ARRAY string_to_array(p_via[i], '>') LOOP
                    IF v_cur IN ('SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED')
                       OR (v_hop <> v_cur AND NOT (v_cur || '>' || v_hop) = ANY (allowed)) THEN
                        r_outcome[i] := 'ILLEGAL_TRANSITION';
                        r_detail[i] := v_cur || ' -> ' || v_hop;
                        v_bad := true;
                        EXIT;
                    END IF;
                    v_cur := v_hop;
                END LOOP;
            END IF;
            IF v_bad THEN
                CONTINUE;
            END IF;
            -- Terminal states stay terminal; a requeue or finish is always a transition; an
            -- advance to the state the task is already in repeats a report and is harmless.
            IF v_cur IN ('SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED')
               OR ((v_ends OR v_to <> v_cur)
                   AND NOT (v_cur || '>' || v_to) = ANY (allowed)) THEN
                r_outcome[i] := 'ILLEGAL_TRANSITION';
                r_detail[i] := v_cur || ' -> ' || v_to;
                CONTINUE;
            END IF;
            ends[i] := v_ends AND t_attempt[i] IS NOT NULL;
            releases[i] := p_mode[i] <> 'ADVANCE' AND t_held[i] > 0;
            to_state[i] := v_to;
            applied := applied || i;
        END LOOP;
        IF cardinality(applied) = 0 THEN
            EXIT;
        END IF;
        WITH upd AS (
            UPDATE task t SET state = to_state[u.g], version = t.version + 1, updated_at = now(),
                   cost_actual_milli = coalesce(p_cost_actual[u.g], t.cost_actual_milli),
                   failure_reason = coalesce(p_reason[u.g], t.failure_reason),
                   next_eligible_at = CASE WHEN p_mode[u.g] = 'REQUEUE'
                                           THEN now() + p_delay_ms[u.g] * interval '1 millisecond'
                                           ELSE t.next_eligible_at END,
                   res_released_at = CASE WHEN releases[u.g] THEN now() ELSE t.res_released_at END,
                   current_attempt = CASE WHEN ends[u.g] THEN NULL ELSE t.current_attempt END,
                   current_fencing = CASE WHEN ends[u.g] THEN NULL ELSE t.current_fencing END
              FROM unnest(applied) AS u (g)
             WHERE t.task_id = p_task[u.g] AND t.version = t_version[u.g]
            RETURNING u.g, t.task_id, t.attempt_no, t.attempt_node, t.attempt_provider,
                      t.attempt_lease_until, t.attempt_started_at, t.res_pool, t.res_shard,
                      t.res_amount, t.res_released_at
        ), given AS (
            SELECT r.k, r.s, sum(r.a)::bigint AS amount
              FROM upd, unnest(upd.res_pool, upd.res_shard, upd.res_amount) AS r (k, s, a)
             WHERE releases[upd.g] GROUP BY r.k, r.s
        ), hist AS (
            INSERT INTO attempt_history (task_id, attempt_no, attempt_id, fencing_token, node_id,
                                         provider, provider_request_key, lease_until, created_at,
                                         outcome, res_pool, res_shard, res_amount, released_at)
            SELECT upd.task_id, upd.attempt_no, t_attempt[upd.g], t_token[upd.g],
                   coalesce(upd.attempt_node, ''), coalesce(upd.attempt_provider, ''),
                   'spindle-' || upd.task_id || '-' || upd.attempt_no,
                   coalesce(upd.attempt_lease_until, now()), coalesce(upd.attempt_started_at, now()),
                   to_state[upd.g], coalesce(upd.res_pool, '{}'), coalesce(upd.res_shard, '{}'),
                   coalesce(upd.res_amount, '{}'), upd.res_released_at
              FROM upd WHERE ends[upd.g]
            ON CONFLICT (task_id, attempt_no) DO NOTHING
            RETURNING 1
        )
        SELECT (SELECT coalesce(array_agg(upd.g), '{}') FROM upd),
               (SELECT coalesce(array_agg(given.k ORDER BY given.k, given.s), '{}') FROM given),
               (SELECT coalesce(array_agg(given.s ORDER BY given.k, given.s), '{}') FROM given),
               (SELECT coalesce(array_agg(given.amount ORDER BY given.k, given.s), '{}')
                  FROM given)
          INTO won, g_key, g_shard, g_amount;
        IF cardinality(g_key) > 0 THEN
            -- The pools last, in key order, held only for the rest of the batch.
            PERFORM 1 FROM resource_pool_shard p
             WHERE (p.pool_key, p.shard) IN (SELECT * FROM unnest(g_key, g_shard))
             ORDER BY p.pool_key, p.shard FOR UPDATE;
            UPDATE resource_pool_shard p SET used = p.used - x.amount, version = p.version + 1
              FROM unnest(g_key, g_shard, g_amount) AS x (k, s, amount)
             WHERE p.pool_key = x.k AND p.shard = x.s;
        END IF;
        FOREACH i IN ARRAY won LOOP
            r_outcome[i] := 'APPLIED';
            r_state[i] := to_state[i];
            r_version[i] := t_version[i] + 1;
            r_released[i] := CASE WHEN releases[i] THEN t_held[i] ELSE 0 END;
        END LOOP;
        won_all := won_all || won;
        IF cardinality(won) = cardinality(applied) THEN
            EXIT;
        END IF;
        IF v_round = 2 THEN
            RAISE EXCEPTION 'spindle_report: % rows moved while locked', cardinality(applied) - cardinality(won);
        END IF;
        SELECT array_agg(g) INTO lost FROM unnest(applied) AS g WHERE NOT g = ANY (won);
        pending := lost;
    END LOOP;

    -- Settle (SUCCEEDED: the actual cost, else the estimate) or refund each finished task's
    -- budget once: the ledger's unique (task, kind) makes a repeat a no-op. What was reserved is
    -- the estimate (submit reserved exactly that).
    WITH fin AS (
        SELECT p_task[g] AS task, t_tenant[g] AS tenant, t_estimate[g] AS reserved,
               to_state[g] = 'SUCCEEDED' AS success,
               coalesce(p_cost_actual[g], t_estimate[g]) AS actual
          FROM unnest(won_all) AS g WHERE p_mode[g] = 'FINISH' AND t_budget[g]
    ), ins AS (
        INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
        SELECT fin.tenant, fin.task,
               CASE WHEN fin.success THEN 'SETTLE' ELSE 'REFUND' END,
               CASE WHEN fin.success THEN fin.actual ELSE fin.reserved END
          FROM fin
        ON CONFLICT (task_id, kind) DO NOTHING
        RETURNING task_id
    ), per_tenant AS (
        SELECT fin.tenant, sum(fin.reserved) AS reserved,
               sum(CASE WHEN fin.success THEN fin.actual ELSE 0 END) AS spent
          FROM fin JOIN ins ON ins.task_id = fin.task GROUP BY fin.tenant
    )
    UPDATE tenant_quota q SET reserved_milli = q.reserved_milli - per_tenant.reserved,
           spent_milli = q.spent_milli + per_tenant.spent
      FROM per_tenant WHERE q.tenant_id = per_tenant.tenant;
    INSERT INTO outbox_batch (kinds, tasks, tenants, details)
    SELECT array_agg(to_state[g] ORDER BY g), array_agg(p_task[g] ORDER BY g),
           array_agg(t_tenant[g] ORDER BY g),
           jsonb_build_object('reason', array_agg(p_reason[g] ORDER BY g),
                              'via', array_agg(p_via[g] ORDER BY g),
                              'cost_actual_milli', array_agg(p_cost_actual[g] ORDER BY g),
                              'cost_estimate_milli', array_agg(t_estimate[g] ORDER BY g))
      FROM unnest(won_all) AS g
     WHERE p_mode[g] IN ('REQUEUE', 'FINISH') OR to_state[g] <> t_state[g]
    HAVING count(*) > 0;

    RETURN QUERY
    SELECT (u.ord - 1)::integer, u.outcome, u.state, u.version, u.released, u.detail
      FROM unnest(r_outcome[1:n], r_state[1:n], r_version[1:n], r_released[1:n], r_detail[1:n])
           WITH ORDINALITY AS u (outcome, state, version, released, detail, ord);
END
$$;

-- Lease renewal of live attempts, by task: only the task's current token renews.
DROP FUNCTION spindle_renew(bigint[], bigint[], bigint);
CREATE FUNCTION spindle_renew(p_task bigint[], p_token bigint[], p_lease_ms bigint)
RETURNS TABLE (o_attempt bigint)
LANGUAGE sql SET enable_seqscan = off SET jit = off AS $$
    UPDATE task t SET attempt_lease_until = now() + p_lease_ms * interval '1 millisecond'
      FROM unnest(p_task, p_token) AS r (task, token)
     WHERE t.task_id = r.task AND t.current_fencing = r.token AND t.current_attempt IS NOT NULL
    RETURNING t.current_attempt
$$;

-- Group-commit submit, as in version 2 but with its variable-width arguments in variables
-- (see spindle_claim).
DROP FUNCTION spindle_submit(bigint[], integer[], integer[], text[], bytea[], integer[], smallint[], smallint[], bigint[], bigint[], bigint);
CREATE FUNCTION spindle_submit(
    p_task bigint[], p_tenant integer[], p_user integer[], in_key text[], in_payload bytea[],
    p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[],
    p_fairness bigint[], p_policy_version bigint)
RETURNS TABLE (o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    -- Variable-width array arguments are copied into variables: PL/pgSQL keeps a variable's
    -- array expanded, so element i costs O(1); element i of a flat argument walks i elements,
    -- which made every per-row access of a batch O(n) and the batch O(n²).
    p_key text[] := in_key;
    p_payload bytea[] := in_payload;
    n integer := coalesce(array_length(p_task, 1), 0);
    i integer;
    f integer;
    q integer;
    -- per row: an existing task with the same key, the first row of the batch with the same key,
    -- the row's tenant's position in the budget arrays (NULL: no budget)
    e_task bigint[];
    e_payload bytea[];
    e_state text[];
    first_row integer[];
    quota_pos integer[];
    -- per first row of a key: the row of this batch that created the task
    created_by integer[] := array_fill(NULL::integer, ARRAY[greatest(n, 1)]);
    -- budgets of the batch's tenants
    q_tenant integer[];
    q_remaining bigint[];
    q_delta bigint[];
    -- results
    r_outcome text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_task bigint[] := array_fill(NULL::bigint, ARRAY[greatest(n, 1)]);
    r_state text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_detail text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    ins integer[] := '{}';
    lost bigint[];
    v_task bigint;
    v_payload bytea;
    v_state text;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    WITH locked AS (
        SELECT q.tenant_id, q.budget_milli - q.reserved_milli - q.spent_milli AS remaining
          FROM tenant_quota q WHERE q.tenant_id = ANY (p_tenant)
         ORDER BY q.tenant_id FOR UPDATE)
    SELECT coalesce(array_agg(l.tenant_id ORDER BY l.tenant_id), '{}'),
           coalesce(array_agg(l.remaining ORDER BY l.tenant_id), '{}')
      INTO q_tenant, q_remaining FROM locked l;
    q_delta := array_fill(0::bigint, ARRAY[greatest(coalesce(array_length(q_tenant, 1), 0), 1)]);
    SELECT array_agg(t.task_id ORDER BY d.ord), array_agg(t.payload ORDER BY d.ord),
           array_agg(t.state ORDER BY d.ord), array_agg(d.first ORDER BY d.ord),
           array_agg(qp.pos ORDER BY d.ord)
      INTO e_task, e_payload, e_state, first_row, quota_pos
      FROM (SELECT u.tenant, u.key, u.ord,
                   min(u.ord) OVER (PARTITION BY u.tenant, u.key) AS first
              FROM unnest(p_tenant, p_key) WITH ORDINALITY AS u (tenant, key, ord)) d
      LEFT JOIN task t ON t.tenant_id = d.tenant AND t.idempotency_key = d.key
      LEFT JOIN unnest(q_tenant) WITH ORDINALITY AS qp (tenant, pos) ON qp.tenant = d.tenant;
    FOR i IN 1 .. n LOOP
        f := first_row[i];
        IF e_task[i] IS NOT NULL THEN
            r_outcome[i] := CASE WHEN e_payload[i] = p_payload[i] THEN 'REPLAY' ELSE 'CONFLICT' END;
            r_task[i] := e_task[i];
            r_state[i] := e_state[i];
            CONTINUE;
        END IF;
        IF created_by[f] IS NOT NULL THEN
            r_outcome[i] := CASE WHEN p_payload[created_by[f]] = p_payload[i]
                                 THEN 'REPLAY' ELSE 'CONFLICT' END;
            r_task[i] := p_task[created_by[f]];
            r_state[i] := 'QUEUED';
            CONTINUE;
        END IF;
        q := quota_pos[i];
        IF q IS NOT NULL THEN
            IF q_remaining[q] < p_cost[i] THEN
                r_outcome[i] := 'QUOTA_EXCEEDED';
                r_detail[i] := q_remaining[q]::text;
                CONTINUE;
            END IF;
            q_remaining[q] := q_remaining[q] - p_cost[i];
            q_delta[q] := q_delta[q] + p_cost[i];
        END IF;
        created_by[f] := i;
        ins := ins || i;
        r_outcome[i] := 'CREATED';
        r_task[i] := p_task[i];
        r_state[i] := 'QUEUED';
    END LOOP;

    WITH new AS (
        INSERT INTO task (task_id, tenant_id, user_id, idempotency_key, payload, partition, lane,
                          band, state, policy_version, cost_estimate_milli, fairness_milli,
                          budget_reserved)
        SELECT p_task[k], p_tenant[k], p_user[k], p_key[k], p_payload[k], p_partition[k],
               p_lane[k], p_band[k], 'QUEUED', p_policy_version, p_cost[k], p_fairness[k],
               quota_pos[k] IS NOT NULL
          FROM unnest(ins) AS k
        ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
        RETURNING task_id)
    SELECT array_agg(p_task[k]) INTO lost
      FROM unnest(ins) AS k WHERE p_task[k] NOT IN (SELECT task_id FROM new);
    -- A concurrent submit of the same key committed between our read and our insert: answer
    -- with its task and give the budget back.
    IF lost IS NOT NULL THEN
        FOR i IN 1 .. n LOOP
            IF r_outcome[i] = 'CREATED' AND p_task[i] = ANY (lost) THEN
                SELECT t.task_id, t.payload, t.state INTO v_task, v_payload, v_state
                  FROM task t WHERE t.tenant_id = p_tenant[i] AND t.idempotency_key = p_key[i];
                r_outcome[i] := CASE WHEN v_payload = p_payload[i] THEN 'REPLAY' ELSE 'CONFLICT' END;
                r_task[i] := v_task;
                r_state[i] := v_state;
                q := quota_pos[i];
                IF q IS NOT NULL THEN
                    q_delta[q] := q_delta[q] - p_cost[i];
                END IF;
            END IF;
        END LOOP;
    END IF;

    UPDATE tenant_quota qt SET reserved_milli = qt.reserved_milli + d.delta
      FROM unnest(q_tenant, q_delta[1:coalesce(array_length(q_tenant, 1), 0)]) AS d (tenant, delta)
     WHERE qt.tenant_id = d.tenant AND d.delta <> 0;
    INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
    SELECT p_tenant[k], p_task[k], 'RESERVE', p_cost[k]
      FROM unnest(ins) AS k
     WHERE r_outcome[k] = 'CREATED' AND quota_pos[k] IS NOT NULL;

    RETURN QUERY
    SELECT (u.ord - 1)::integer, u.outcome, u.task, u.state, u.detail
      FROM unnest(r_outcome[1:n], r_task[1:n], r_state[1:n], r_detail[1:n])
           WITH ORDINALITY AS u (outcome, task, state, detail, ord);
END
$$;
