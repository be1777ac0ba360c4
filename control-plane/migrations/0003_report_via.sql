-- Multi-step reports: a report may carry the states its task passed through on the way to its
-- target (p_via, '>'-separated), each hop checked against the whitelist. Work that moved through
-- several states between two flushes (RUNNING, PROVIDER_SUCCEEDED, MEDIA_PROCESSING, SUCCEEDED)
-- costs one row update and one event instead of one per state.

DROP FUNCTION spindle_report(bigint[], bigint[], text[], text[], bigint[], bigint[], text[]);

CREATE FUNCTION spindle_report(
    p_task bigint[], p_token bigint[], p_mode text[], p_to text[], p_cost_actual bigint[],
    p_delay_ms bigint[], p_reason text[], p_via text[])
RETURNS TABLE (o_idx integer, o_outcome text, o_state text, o_version integer,
               o_released integer, o_detail text)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    n integer := coalesce(array_length(p_task, 1), 0);
    i integer;
    v_to text;
    v_ends boolean;
    v_cur text;
    v_hop text;
    v_bad boolean;
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
        -- The states passed on the way, each hop on the whitelist: a hop to the state the task
        -- is already in repeats a report and is harmless.
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
        -- Terminal states stay terminal; a requeue or finish is always a transition; an advance
        -- to the state the task is already in repeats a report and is harmless.
        IF v_cur IN ('SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED')
           OR ((v_ends OR v_to <> v_cur)
               AND NOT (v_cur || '>' || v_to) = ANY (allowed)) THEN
            r_outcome[i] := 'ILLEGAL_TRANSITION';
            r_detail[i] := v_cur || ' -> ' || v_to;
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
               jsonb_build_object('reason', p_reason[u.g], 'via', p_via[u.g],
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
