-- spindle schema, version 2: the batched write paths. Each function is one statement for the
-- caller: one round trip and one transaction for a whole batch, with a result row per input row.
--
-- Shape, the same in all three: lock what the batch touches up front, load it into arrays,
-- decide every row in memory (in order, so row i sees the effect of rows before it), then
-- write with one set-based statement per table. A hot row (a pool shard, a tenant's budget) is
-- therefore updated once per batch, not once per row: repeated updates of one row inside a
-- transaction leave a chain of versions that every later update must walk.
--
-- Lock order, the same in every function, so batches never deadlock each other:
--   partition_lease (share) → task (by id) → tenant_quota (by tenant) → resource_pool_shard
--   (by key). Submit inserts new task rows after its budget locks; inserts wait on no existing
--   row, only on a concurrent insert of the same key (a deadlock there is detected and the batch
--   fails retryable: StoreError::Refused { retryable: true }).
-- Rows are reached by primary key with `= ANY (array)`: every statement's cost follows the
-- batch, never the size of the table. PL/pgSQL caches each statement's plan for the life of the
-- session, and a plan made while a table was small (a fresh node, a fresh database) picks a
-- sequential scan that would then read the whole table on every batch for as long as the
-- connection lives. The functions therefore run with `enable_seqscan = off`: every statement in
-- them has an index path and must take it. And with `jit = off`: the penalty that setting adds to
-- a sequential scan of a tiny table (the transition whitelist) would otherwise cross the JIT
-- threshold and compile the statement, ~40 ms per batch.

-- Group-commit submit. Per row: a replay of (tenant, idempotency key) returns the original task
-- (REPLAY) or, when the payload differs, CONFLICT; otherwise the cost estimate is reserved in the
-- tenant's budget (QUOTA_EXCEEDED when it does not fit; no budget row means no limit) and the
-- task is inserted QUEUED.
CREATE FUNCTION spindle_submit(
    p_task bigint[], p_tenant integer[], p_user integer[], p_key text[], p_payload bytea[],
    p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[],
    p_fairness bigint[], p_policy_version bigint)
RETURNS TABLE (o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
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

-- Batched claims. Per claim, all or nothing: the task must be QUEUED at the expected version and
-- in a partition this node holds; every demanded pool shard must have room (used + amount <=
-- capacity); then the task becomes DISPATCHING, the pools are charged, the attempt is written with
-- a fencing token from the sequence, its reservations ACTIVE, and an outbox event announces it.
-- Demands of claim i are p_pool/p_shard/p_amount[p_dstart[i] .. p_dstart[i] + p_dcount[i] - 1].
CREATE FUNCTION spindle_claim(
    p_node text, p_lease_ms bigint,
    p_task bigint[], p_version integer[], p_provider text[], p_dstart integer[],
    p_dcount integer[], p_pool text[], p_shard smallint[], p_amount bigint[])
RETURNS TABLE (o_idx integer, o_outcome text, o_attempt bigint, o_token bigint,
               o_attempt_no integer, o_detail text)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    n integer := coalesce(array_length(p_task, 1), 0);
    i integer;
    j integer;
    k integer;
    fits boolean;
    v_owned integer[];
    v_lease timestamptz := now() + p_lease_ms * interval '1 millisecond';
    -- the batch's pool shards, locked, in key order; per demand its position (NULL: unknown)
    pk_key text[];
    pk_shard smallint[];
    pk_cap bigint[];
    pk_used bigint[];
    pk_used0 bigint[];
    d_pos integer[];
    -- per claim: the task as stored (NULL state: no such task)
    t_state text[];
    t_version integer[];
    t_partition integer[];
    t_tenant integer[];
    t_attempt_no integer[];
    -- results
    r_outcome text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_attempt bigint[] := array_fill(NULL::bigint, ARRAY[greatest(n, 1)]);
    r_token bigint[] := array_fill(NULL::bigint, ARRAY[greatest(n, 1)]);
    r_no integer[] := array_fill(NULL::integer, ARRAY[greatest(n, 1)]);
    r_detail text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    granted integer[] := '{}';
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    -- Only the partitions this batch's tasks are in: locking every partition the node owns
    -- would have each call share-lock them all (and two shards' calls create multixacts).
    SELECT coalesce(array_agg(l.partition), '{}') INTO v_owned FROM (
        SELECT pl.partition FROM partition_lease pl
         WHERE pl.owner_node = p_node AND pl.lease_until > now()
           AND pl.partition IN (SELECT t.partition FROM task t WHERE t.task_id = ANY (p_task))
         ORDER BY pl.partition FOR SHARE) l;
    WITH locked AS MATERIALIZED (
        SELECT t.task_id, t.state, t.version, t.partition, t.tenant_id, t.attempt_no
          FROM task t WHERE t.task_id = ANY (p_task) ORDER BY t.task_id FOR UPDATE)
    SELECT array_agg(l.state ORDER BY c.ord), array_agg(l.version ORDER BY c.ord),
           array_agg(l.partition ORDER BY c.ord), array_agg(l.tenant_id ORDER BY c.ord),
           array_agg(l.attempt_no ORDER BY c.ord)
      INTO t_state, t_version, t_partition, t_tenant, t_attempt_no
      FROM unnest(p_task) WITH ORDINALITY AS c (task, ord)
      LEFT JOIN locked l ON l.task_id = c.task;
    WITH locked AS MATERIALIZED (
        SELECT p.pool_key, p.shard, p.capacity, p.used FROM resource_pool_shard p
         WHERE (p.pool_key, p.shard) IN (SELECT * FROM unnest(p_pool, p_shard))
         ORDER BY p.pool_key, p.shard FOR UPDATE)
    SELECT coalesce(array_agg(l.pool_key ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.shard ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.capacity ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.used ORDER BY l.pool_key, l.shard), '{}')
      INTO pk_key, pk_shard, pk_cap, pk_used FROM locked l;
    pk_used0 := pk_used;
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
        r_attempt[i] := nextval('attempt_id_seq');
        r_token[i] := nextval('fencing_token_seq');
        r_no[i] := t_attempt_no[i] + 1;
        granted := granted || i;
    END LOOP;

    IF array_length(granted, 1) IS NOT NULL THEN
        UPDATE task t SET state = 'DISPATCHING', version = t.version + 1, attempt_no = r_no[g],
               current_attempt = r_attempt[g], current_fencing = r_token[g],
               updated_at = now(), next_eligible_at = NULL
          FROM unnest(granted) AS u (g)
         WHERE t.task_id = p_task[g];
        INSERT INTO task_attempt (attempt_id, task_id, attempt_no, fencing_token, node_id,
                                  provider, provider_request_key, lease_until)
        SELECT r_attempt[g], p_task[g], r_no[g], r_token[g], p_node, p_provider[g],
               'spindle-' || p_task[g] || '-' || r_no[g], v_lease
          FROM unnest(granted) AS u (g);
        INSERT INTO resource_reservation (attempt_id, pool_key, shard, task_id, amount,
                                          fencing_token)
        SELECT r_attempt[g], p_pool[dj], p_shard[dj], p_task[g], p_amount[dj], r_token[g]
          FROM unnest(granted) AS u (g),
               generate_series(p_dstart[g], p_dstart[g] + p_dcount[g] - 1) AS d (dj);
        UPDATE resource_pool_shard p SET used = x.used, version = p.version + 1
          FROM unnest(pk_key, pk_shard, pk_used, pk_used0) AS x (k, s, used, used0)
         WHERE p.pool_key = x.k AND p.shard = x.s AND x.used <> x.used0;
        INSERT INTO outbox_event (task_id, tenant_id, kind, body)
        SELECT p_task[g], t_tenant[g], 'DISPATCHING',
               jsonb_build_object('attempt', r_attempt[g], 'attempt_no', r_no[g],
                                  'node', p_node, 'provider', p_provider[g])
          FROM unnest(granted) AS u (g);
    END IF;

    RETURN QUERY
    SELECT (u.ord - 1)::integer, u.outcome, u.attempt, u.token, u.no, u.detail
      FROM unnest(r_outcome[1:n], r_attempt[1:n], r_token[1:n], r_no[1:n], r_detail[1:n])
           WITH ORDINALITY AS u (outcome, attempt, token, no, detail, ord);
END
$$;

-- Fenced reports. Per row: the token must be the task's current one (a task with no attempt has
-- none: pass NULL); the transition must be on the whitelist. p_mode says what else happens:
--   'ADVANCE'  state change only (RUNNING, SUBMIT_UNKNOWN, PROVIDER_SUCCEEDED…);
--   'RELEASE'  release the attempt's reservations; p_to NULL keeps the state;
--   'REQUEUE'  release, end the attempt, back to QUEUED eligible after p_delay_ms;
--   'FINISH'   release, end the attempt, terminal state; settle (SUCCEEDED) or refund the budget.
-- A stale token or an illegal transition changes nothing and says so. Releases move ACTIVE →
-- RELEASED once; only that transition gives capacity back.
CREATE FUNCTION spindle_report(
    p_task bigint[], p_token bigint[], p_mode text[], p_to text[], p_cost_actual bigint[],
    p_delay_ms bigint[], p_reason text[])
RETURNS TABLE (o_idx integer, o_outcome text, o_state text, o_version integer,
               o_released integer, o_detail text)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    n integer := coalesce(array_length(p_task, 1), 0);
    i integer;
    v_to text;
    v_ends boolean;
    allowed text[];
    t_state text[];
    t_version integer[];
    t_token bigint[];
    t_attempt bigint[];
    t_tenant integer[];
    t_estimate bigint[];
    t_budget boolean[];
    r_outcome text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_state text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_version integer[] := array_fill(NULL::integer, ARRAY[greatest(n, 1)]);
    r_detail text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_released integer[] := array_fill(0, ARRAY[greatest(n, 1)]);
    applied integer[] := '{}';
    release_attempts bigint[] := '{}';
    end_attempts bigint[] := '{}';
    end_outcomes text[] := '{}';
    finish_rows integer[] := '{}';
    event_rows integer[] := '{}';
    ends boolean[] := array_fill(false, ARRAY[greatest(n, 1)]);
    to_state text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    SELECT array_agg(tt.from_state || '>' || tt.to_state) INTO allowed
      FROM task_transition tt WHERE NOT tt.operator_only;
    WITH locked AS MATERIALIZED (
        SELECT t.task_id, t.state, t.version, t.current_fencing, t.current_attempt, t.tenant_id,
               t.cost_estimate_milli, t.budget_reserved
          FROM task t WHERE t.task_id = ANY (p_task) ORDER BY t.task_id FOR UPDATE)
    SELECT array_agg(l.state ORDER BY c.ord), array_agg(l.version ORDER BY c.ord),
           array_agg(l.current_fencing ORDER BY c.ord), array_agg(l.current_attempt ORDER BY c.ord),
           array_agg(l.tenant_id ORDER BY c.ord), array_agg(l.cost_estimate_milli ORDER BY c.ord),
           array_agg(l.budget_reserved ORDER BY c.ord)
      INTO t_state, t_version, t_token, t_attempt, t_tenant, t_estimate, t_budget
      FROM unnest(p_task) WITH ORDINALITY AS c (task, ord)
      LEFT JOIN locked l ON l.task_id = c.task;
    PERFORM 1 FROM tenant_quota q WHERE q.tenant_id = ANY (t_tenant)
     ORDER BY q.tenant_id FOR UPDATE;
    PERFORM 1 FROM resource_pool_shard p
     WHERE (p.pool_key, p.shard) IN (
            SELECT r.pool_key, r.shard FROM resource_reservation r
             WHERE r.attempt_id = ANY (t_attempt) AND r.status = 'ACTIVE')
     ORDER BY p.pool_key, p.shard FOR UPDATE;

    FOR i IN 1 .. n LOOP
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
        -- Terminal states stay terminal; a requeue or finish is always a transition; an advance
        -- to the state the task is already in repeats a report and is harmless.
        IF t_state[i] IN ('SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED')
           OR ((v_ends OR v_to <> t_state[i])
               AND NOT (t_state[i] || '>' || v_to) = ANY (allowed)) THEN
            r_outcome[i] := 'ILLEGAL_TRANSITION';
            r_detail[i] := t_state[i] || ' -> ' || v_to;
            CONTINUE;
        END IF;
        IF p_mode[i] <> 'ADVANCE' AND t_attempt[i] IS NOT NULL THEN
            release_attempts := release_attempts || t_attempt[i];
        END IF;
        IF v_ends AND t_attempt[i] IS NOT NULL THEN
            end_attempts := end_attempts || t_attempt[i];
            end_outcomes := end_outcomes || v_to;
        END IF;
        IF p_mode[i] = 'FINISH' AND t_budget[i] THEN
            finish_rows := finish_rows || i;
        END IF;
        IF v_ends OR v_to <> t_state[i] THEN
            event_rows := event_rows || i;
        END IF;
        ends[i] := v_ends;
        to_state[i] := v_to;
        applied := applied || i;
        r_outcome[i] := 'APPLIED';
        r_state[i] := v_to;
        r_version[i] := t_version[i] + 1;
    END LOOP;

    IF array_length(release_attempts, 1) IS NOT NULL THEN
        WITH rel AS (
            UPDATE resource_reservation r SET status = 'RELEASED', released_at = now()
             WHERE r.attempt_id = ANY (release_attempts) AND r.status = 'ACTIVE'
            RETURNING r.attempt_id, r.pool_key, r.shard, r.amount
        ), per_pool AS (
            SELECT rel.pool_key, rel.shard, sum(rel.amount) AS amount FROM rel GROUP BY 1, 2
        ), dec AS (
            UPDATE resource_pool_shard p SET used = p.used - per_pool.amount,
                   version = p.version + 1
              FROM per_pool WHERE p.pool_key = per_pool.pool_key AND p.shard = per_pool.shard
            RETURNING 1
        )
        SELECT array_agg(coalesce(x.released, 0) ORDER BY c.ord) INTO r_released
          FROM unnest(t_attempt) WITH ORDINALITY AS c (attempt, ord)
          LEFT JOIN (SELECT rel.attempt_id, count(*)::integer AS released
                       FROM rel GROUP BY rel.attempt_id) x
            ON x.attempt_id = c.attempt AND c.attempt = ANY (release_attempts);
    END IF;
    IF array_length(end_attempts, 1) IS NOT NULL THEN
        UPDATE task_attempt a SET ended_at = now(), outcome = e.outcome
          FROM unnest(end_attempts, end_outcomes) AS e (attempt, outcome)
         WHERE a.attempt_id = e.attempt AND a.ended_at IS NULL;
    END IF;
    IF array_length(applied, 1) IS NOT NULL THEN
        UPDATE task t SET state = to_state[u.g], version = t.version + 1, updated_at = now(),
               cost_actual_milli = coalesce(p_cost_actual[u.g], t.cost_actual_milli),
               failure_reason = coalesce(p_reason[u.g], t.failure_reason),
               next_eligible_at = CASE WHEN p_mode[u.g] = 'REQUEUE'
                                       THEN now() + p_delay_ms[u.g] * interval '1 millisecond'
                                       ELSE t.next_eligible_at END,
               current_attempt = CASE WHEN ends[u.g] THEN NULL ELSE t.current_attempt END,
               current_fencing = CASE WHEN ends[u.g] THEN NULL ELSE t.current_fencing END
          FROM unnest(applied) AS u (g)
         WHERE t.task_id = p_task[u.g];
    END IF;
    IF array_length(finish_rows, 1) IS NOT NULL THEN
        -- Settle (SUCCEEDED: the actual cost, else the estimate) or refund each finished task's
        -- reservation once: the ledger's unique (task, kind) makes a repeat a no-op.
        -- What was reserved is the estimate (submit reserved exactly that).
        WITH fin AS (
            SELECT p_task[u.g] AS task, t_tenant[u.g] AS tenant, t_estimate[u.g] AS reserved,
                   to_state[u.g] = 'SUCCEEDED' AS success,
                   coalesce(p_cost_actual[u.g], t_estimate[u.g]) AS actual
              FROM unnest(finish_rows) AS u (g)
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
    END IF;
    IF array_length(event_rows, 1) IS NOT NULL THEN
        INSERT INTO outbox_event (task_id, tenant_id, kind, body)
        SELECT p_task[u.g], t_tenant[u.g], to_state[u.g],
               jsonb_build_object('reason', p_reason[u.g],
                                  'cost_actual_milli', p_cost_actual[u.g],
                                  'cost_estimate_milli', t_estimate[u.g])
          FROM unnest(event_rows) AS u (g);
    END IF;

    RETURN QUERY
    SELECT (u.ord - 1)::integer, u.outcome, u.state, u.version, u.released, u.detail
      FROM unnest(r_outcome[1:n], r_state[1:n], r_version[1:n], r_released[1:n], r_detail[1:n])
           WITH ORDINALITY AS u (outcome, state, version, released, detail, ord);
END
$$;

-- Batched lease renewal of live attempts: only the current token of a live attempt renews.
CREATE FUNCTION spindle_renew(p_attempt bigint[], p_token bigint[], p_lease_ms bigint)
RETURNS TABLE (o_attempt bigint)
LANGUAGE sql SET enable_seqscan = off SET jit = off AS $$
    UPDATE task_attempt a SET lease_until = now() + p_lease_ms * interval '1 millisecond'
      FROM unnest(p_attempt, p_token) AS r (attempt, token)
     WHERE a.attempt_id = r.attempt AND a.fencing_token = r.token AND a.ended_at IS NULL
    RETURNING a.attempt_id
$$;
