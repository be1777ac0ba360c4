-- spindle_submit_checked: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- New tasks of one batch, decided row by row: replay of a known key, conflict of a key reused
-- with another payload, budget reserved or refused, then the insert (ON CONFLICT DO NOTHING for a
-- concurrent submit of the same key). The fallback of spindle_submit; answers the same.
CREATE OR REPLACE FUNCTION spindle_submit_checked(p_task bigint[], p_tenant integer[], p_user integer[], in_key text[], in_payload bytea[], p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[], p_fairness bigint[], p_policy_version bigint)
 RETURNS TABLE(o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
AS $function$
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
$function$;
