-- spindle schema, version 2: the batched write paths. Each function is one statement for the
-- caller: one round trip and one transaction for a whole batch, with a result row per input row.
--
-- Lock order, the same in every function, so batches never deadlock each other:
--   partition_lease (share) → tenant_quota → resource_pool_shard (by key) → task (by id).
-- Every function takes the pool and task locks of its whole batch up front in that order.

-- Group-commit submit. Per row: a replay of (tenant, idempotency key) returns the original task
-- (REPLAY) or, when the payload differs, CONFLICT; otherwise the cost estimate is reserved in the
-- tenant's budget (QUOTA_EXCEEDED when it does not fit) and the task is inserted QUEUED.
CREATE FUNCTION spindle_submit(
    p_task bigint[], p_tenant integer[], p_user integer[], p_key text[], p_payload bytea[],
    p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[],
    p_fairness bigint[], p_policy_version bigint)
RETURNS TABLE (o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer;
    v_task bigint;
    v_payload bytea;
    v_state text;
    v_has_quota boolean;
    v_remaining bigint;
BEGIN
    PERFORM 1 FROM tenant_quota q WHERE q.tenant_id = ANY (p_tenant)
        ORDER BY q.tenant_id FOR UPDATE;
    FOR i IN 1 .. coalesce(array_length(p_task, 1), 0) LOOP
        o_idx := i - 1;
        o_detail := NULL;
        SELECT t.task_id, t.payload, t.state INTO v_task, v_payload, v_state
          FROM task t WHERE t.tenant_id = p_tenant[i] AND t.idempotency_key = p_key[i];
        IF FOUND THEN
            o_outcome := CASE WHEN v_payload = p_payload[i] THEN 'REPLAY' ELSE 'CONFLICT' END;
            o_task := v_task;
            o_state := v_state;
            RETURN NEXT;
            CONTINUE;
        END IF;
        UPDATE tenant_quota q SET reserved_milli = q.reserved_milli + p_cost[i]
         WHERE q.tenant_id = p_tenant[i]
           AND q.reserved_milli + q.spent_milli + p_cost[i] <= q.budget_milli;
        v_has_quota := FOUND;
        IF NOT v_has_quota THEN
            SELECT q.budget_milli - q.reserved_milli - q.spent_milli INTO v_remaining
              FROM tenant_quota q WHERE q.tenant_id = p_tenant[i];
            IF FOUND THEN
                o_outcome := 'QUOTA_EXCEEDED';
                o_task := NULL;
                o_state := NULL;
                o_detail := v_remaining::text;
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;
        INSERT INTO task (task_id, tenant_id, user_id, idempotency_key, payload, partition, lane,
                          band, state, policy_version, cost_estimate_milli, fairness_milli)
        VALUES (p_task[i], p_tenant[i], p_user[i], p_key[i], p_payload[i], p_partition[i],
                p_lane[i], p_band[i], 'QUEUED', p_policy_version, p_cost[i], p_fairness[i])
        ON CONFLICT (tenant_id, idempotency_key) DO NOTHING;
        IF NOT FOUND THEN
            -- A concurrent submit of the same key committed first: undo our reservation.
            IF v_has_quota THEN
                UPDATE tenant_quota q SET reserved_milli = q.reserved_milli - p_cost[i]
                 WHERE q.tenant_id = p_tenant[i];
            END IF;
            SELECT t.task_id, t.payload, t.state INTO v_task, v_payload, v_state
              FROM task t WHERE t.tenant_id = p_tenant[i] AND t.idempotency_key = p_key[i];
            o_outcome := CASE WHEN v_payload = p_payload[i] THEN 'REPLAY' ELSE 'CONFLICT' END;
            o_task := v_task;
            o_state := v_state;
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF v_has_quota THEN
            INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
            VALUES (p_tenant[i], p_task[i], 'RESERVE', p_cost[i]);
        END IF;
        o_outcome := 'CREATED';
        o_task := p_task[i];
        o_state := 'QUEUED';
        RETURN NEXT;
    END LOOP;
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
LANGUAGE plpgsql AS $$
DECLARE
    i integer;
    lo integer;
    hi integer;
    v_owned integer[];
    v_state text;
    v_version integer;
    v_partition integer;
    v_tenant integer;
    v_attempt_no integer;
    v_full text;
    v_lease timestamptz := now() + p_lease_ms * interval '1 millisecond';
BEGIN
    SELECT coalesce(array_agg(l.partition), '{}') INTO v_owned FROM (
        SELECT pl.partition FROM partition_lease pl
         WHERE pl.owner_node = p_node AND pl.lease_until > now()
         ORDER BY pl.partition FOR SHARE) l;
    PERFORM 1 FROM resource_pool_shard p
      JOIN (SELECT DISTINCT k, s FROM unnest(p_pool, p_shard) AS d (k, s)) d
        ON p.pool_key = d.k AND p.shard = d.s
     ORDER BY p.pool_key, p.shard FOR UPDATE OF p;
    PERFORM 1 FROM task t WHERE t.task_id = ANY (p_task) ORDER BY t.task_id FOR UPDATE;
    FOR i IN 1 .. coalesce(array_length(p_task, 1), 0) LOOP
        o_idx := i - 1;
        o_attempt := NULL;
        o_token := NULL;
        o_attempt_no := NULL;
        o_detail := NULL;
        SELECT t.state, t.version, t.partition, t.tenant_id, t.attempt_no
          INTO v_state, v_version, v_partition, v_tenant, v_attempt_no
          FROM task t WHERE t.task_id = p_task[i];
        IF NOT FOUND THEN
            o_outcome := 'TASK_GONE';
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF v_state <> 'QUEUED' OR v_version <> p_version[i] THEN
            o_outcome := 'VERSION_MOVED';
            o_detail := v_state || '@' || v_version;
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF NOT v_partition = ANY (v_owned) THEN
            o_outcome := 'PARTITION_NOT_OWNED';
            o_detail := v_partition::text;
            RETURN NEXT;
            CONTINUE;
        END IF;
        lo := p_dstart[i];
        hi := p_dstart[i] + p_dcount[i] - 1;
        v_full := NULL;
        IF p_dcount[i] > 0 THEN
            SELECT d.k || '/' || d.s || CASE WHEN p.pool_key IS NULL THEN ' (unknown)' ELSE '' END
              INTO v_full
              FROM unnest(p_pool[lo:hi], p_shard[lo:hi], p_amount[lo:hi]) AS d (k, s, a)
              LEFT JOIN resource_pool_shard p ON p.pool_key = d.k AND p.shard = d.s
             WHERE p.pool_key IS NULL OR p.used + d.a > p.capacity
             LIMIT 1;
        END IF;
        IF v_full IS NOT NULL THEN
            o_outcome := 'POOL_FULL';
            o_detail := v_full;
            RETURN NEXT;
            CONTINUE;
        END IF;
        v_attempt_no := v_attempt_no + 1;
        o_attempt := nextval('attempt_id_seq');
        o_token := nextval('fencing_token_seq');
        o_attempt_no := v_attempt_no;
        UPDATE task t SET state = 'DISPATCHING', version = t.version + 1,
               attempt_no = v_attempt_no, current_attempt = o_attempt,
               current_fencing = o_token, updated_at = now(), next_eligible_at = NULL
         WHERE t.task_id = p_task[i];
        INSERT INTO task_attempt (attempt_id, task_id, attempt_no, fencing_token, node_id,
                                  provider, provider_request_key, lease_until)
        VALUES (o_attempt, p_task[i], v_attempt_no, o_token, p_node, p_provider[i],
                'spindle-' || p_task[i] || '-' || v_attempt_no, v_lease);
        IF p_dcount[i] > 0 THEN
            UPDATE resource_pool_shard p SET used = p.used + d.a, version = p.version + 1
              FROM unnest(p_pool[lo:hi], p_shard[lo:hi], p_amount[lo:hi]) AS d (k, s, a)
             WHERE p.pool_key = d.k AND p.shard = d.s;
            INSERT INTO resource_reservation (attempt_id, pool_key, shard, task_id, amount,
                                              fencing_token)
            SELECT o_attempt, d.k, d.s, p_task[i], d.a, o_token
              FROM unnest(p_pool[lo:hi], p_shard[lo:hi], p_amount[lo:hi]) AS d (k, s, a);
        END IF;
        INSERT INTO outbox_event (task_id, tenant_id, kind, body)
        VALUES (p_task[i], v_tenant, 'DISPATCHING',
                jsonb_build_object('attempt', o_attempt, 'attempt_no', v_attempt_no,
                                   'node', p_node, 'provider', p_provider[i]));
        o_outcome := 'GRANTED';
        RETURN NEXT;
    END LOOP;
END
$$;

-- Releases every ACTIVE reservation of an attempt; only the ACTIVE → RELEASED transition
-- decrements a pool, so a second release changes nothing. Returns the number released.
CREATE FUNCTION spindle_release_attempt(p_attempt bigint) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_count integer;
BEGIN
    WITH r AS (
        UPDATE resource_reservation r SET status = 'RELEASED', released_at = now()
         WHERE r.attempt_id = p_attempt AND r.status = 'ACTIVE'
        RETURNING r.pool_key, r.shard, r.amount
    ), p AS (
        UPDATE resource_pool_shard p SET used = p.used - r.amount, version = p.version + 1
          FROM r WHERE p.pool_key = r.pool_key AND p.shard = r.shard
        RETURNING 1
    )
    SELECT count(*) INTO v_count FROM p;
    RETURN v_count;
END
$$;

-- Fenced reports. Per row: the token must be the task's current one (a task with no attempt has
-- none: pass NULL); the transition must be on the whitelist. p_mode says what else happens:
--   'ADVANCE'  state change only (RUNNING, SUBMIT_UNKNOWN, PROVIDER_SUCCEEDED, MEDIA_PROCESSING…);
--   'RELEASE'  release the attempt's reservations; p_to NULL keeps the state;
--   'REQUEUE'  release, end the attempt, back to QUEUED eligible after p_delay_ms;
--   'FINISH'   release, end the attempt, terminal state; settle (SUCCEEDED) or refund the budget.
-- A stale token or an illegal transition changes nothing and says so.
CREATE FUNCTION spindle_report(
    p_task bigint[], p_token bigint[], p_mode text[], p_to text[], p_cost_actual bigint[],
    p_delay_ms bigint[], p_reason text[])
RETURNS TABLE (o_idx integer, o_outcome text, o_state text, o_version integer,
               o_released integer, o_detail text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer;
    v_state text;
    v_version integer;
    v_token bigint;
    v_attempt bigint;
    v_tenant integer;
    v_estimate bigint;
    v_reserved bigint;
    v_ends boolean;
    v_to text;
BEGIN
    PERFORM 1 FROM tenant_quota q
     WHERE q.tenant_id IN (SELECT t.tenant_id FROM task t WHERE t.task_id = ANY (p_task))
     ORDER BY q.tenant_id FOR UPDATE;
    PERFORM 1 FROM resource_pool_shard p
      JOIN (SELECT DISTINCT r.pool_key, r.shard FROM task t
              JOIN resource_reservation r ON r.attempt_id = t.current_attempt
             WHERE t.task_id = ANY (p_task) AND r.status = 'ACTIVE') d
        ON p.pool_key = d.pool_key AND p.shard = d.shard
     ORDER BY p.pool_key, p.shard FOR UPDATE OF p;
    PERFORM 1 FROM task t WHERE t.task_id = ANY (p_task) ORDER BY t.task_id FOR UPDATE;
    FOR i IN 1 .. coalesce(array_length(p_task, 1), 0) LOOP
        o_idx := i - 1;
        o_released := 0;
        o_detail := NULL;
        SELECT t.state, t.version, t.current_fencing, t.current_attempt, t.tenant_id,
               t.cost_estimate_milli
          INTO v_state, v_version, v_token, v_attempt, v_tenant, v_estimate
          FROM task t WHERE t.task_id = p_task[i];
        IF NOT FOUND THEN
            o_outcome := 'TASK_GONE';
            o_state := NULL;
            o_version := NULL;
            RETURN NEXT;
            CONTINUE;
        END IF;
        o_state := v_state;
        o_version := v_version;
        v_to := coalesce(p_to[i], v_state);
        IF v_token IS DISTINCT FROM p_token[i] THEN
            o_outcome := 'STALE_TOKEN';
            o_detail := coalesce(v_token::text, 'none');
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF v_to <> v_state AND NOT EXISTS (
               SELECT 1 FROM task_transition tt
                WHERE tt.from_state = v_state AND tt.to_state = v_to
                  AND NOT tt.operator_only) THEN
            o_outcome := 'ILLEGAL_TRANSITION';
            o_detail := v_state || ' -> ' || v_to;
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF p_mode[i] <> 'ADVANCE' AND v_attempt IS NOT NULL THEN
            o_released := spindle_release_attempt(v_attempt);
        END IF;
        v_ends := p_mode[i] IN ('REQUEUE', 'FINISH');
        IF v_ends AND v_attempt IS NOT NULL THEN
            UPDATE task_attempt a SET live = false, ended_at = now(), outcome = v_to
             WHERE a.attempt_id = v_attempt AND a.live;
        END IF;
        UPDATE task t SET state = v_to, version = t.version + 1, updated_at = now(),
               cost_actual_milli = coalesce(p_cost_actual[i], t.cost_actual_milli),
               failure_reason = coalesce(p_reason[i], t.failure_reason),
               next_eligible_at = CASE WHEN p_mode[i] = 'REQUEUE'
                                       THEN now() + p_delay_ms[i] * interval '1 millisecond'
                                       ELSE t.next_eligible_at END,
               current_attempt = CASE WHEN v_ends THEN NULL ELSE t.current_attempt END,
               current_fencing = CASE WHEN v_ends THEN NULL ELSE t.current_fencing END
         WHERE t.task_id = p_task[i]
        RETURNING t.state, t.version INTO o_state, o_version;
        IF p_mode[i] = 'FINISH' THEN
            SELECT l.amount_milli INTO v_reserved FROM quota_ledger l
             WHERE l.task_id = p_task[i] AND l.kind = 'RESERVE';
            IF FOUND THEN
                IF v_to = 'SUCCEEDED' THEN
                    INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
                    VALUES (v_tenant, p_task[i], 'SETTLE', coalesce(p_cost_actual[i], v_estimate))
                    ON CONFLICT DO NOTHING;
                    IF FOUND THEN
                        UPDATE tenant_quota q
                           SET reserved_milli = q.reserved_milli - v_reserved,
                               spent_milli = q.spent_milli + coalesce(p_cost_actual[i], v_estimate)
                         WHERE q.tenant_id = v_tenant;
                    END IF;
                ELSE
                    INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
                    VALUES (v_tenant, p_task[i], 'REFUND', v_reserved)
                    ON CONFLICT DO NOTHING;
                    IF FOUND THEN
                        UPDATE tenant_quota q SET reserved_milli = q.reserved_milli - v_reserved
                         WHERE q.tenant_id = v_tenant;
                    END IF;
                END IF;
            END IF;
        END IF;
        IF v_ends OR v_to <> v_state THEN
            INSERT INTO outbox_event (task_id, tenant_id, kind, body)
            VALUES (p_task[i], v_tenant, v_to,
                    jsonb_build_object('from', v_state, 'reason', p_reason[i],
                                       'cost_actual_milli', p_cost_actual[i],
                                       'cost_estimate_milli', v_estimate));
        END IF;
        o_outcome := 'APPLIED';
        RETURN NEXT;
    END LOOP;
END
$$;
