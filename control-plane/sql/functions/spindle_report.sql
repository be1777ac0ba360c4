-- spindle_report: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- Reports of one batch: each task's step checked against the transition whitelist and its
-- fencing token, the state written, ended attempts moved to attempt_history, reservations given
-- back to their pool shards, budgets settled or refunded in the quota ledger, one outbox row of
-- events. Rows gone or at another token are answered so, never written.
-- Lock order: task (by id) -> tenant_quota -> resource_pool_shard (by key, at the end).
CREATE OR REPLACE FUNCTION spindle_report(p_task bigint[], p_token bigint[], in_mode text[], in_to text[], p_cost_actual bigint[], p_delay_ms bigint[], in_reason text[], in_via text[])
 RETURNS TABLE(o_idx integer, o_outcome text, o_state text, o_version integer, o_released integer, o_detail text)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    -- Variable-width array arguments are copied into variables: PL/pgSQL keeps a variable's
    -- array expanded, so element i costs O(1); element i of a flat argument walks i elements,
    -- which made every per-row access of a batch O(n) and the batch O(n²).
    p_mode text[] := in_mode;
    p_to text[] := in_to;
    p_reason text[] := in_reason;
    p_via text[] := in_via;
    -- Version 12: the two bigint arrays that carry NULLs too (a flat array with NULLs also
    -- walks to element i).
    a_cost_actual bigint[] := p_cost_actual;
    a_delay_ms bigint[] := p_delay_ms;
    v_due integer[];
    v_settled bigint[];
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
    -- Version 14: what every round released, given back to the pools at the end.
    a_key text[] := '{}';
    a_shard smallint[] := '{}';
    a_amount bigint[] := '{}';
    v_fast boolean;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    -- Version 16: one sort (the subquery's), the arrays built in its order.
    SELECT array_agg(r.state), array_agg(r.version), array_agg(r.current_fencing),
           array_agg(r.current_attempt), array_agg(r.tenant_id), array_agg(r.cost_estimate_milli),
           array_agg(r.budget_reserved), array_agg(r.held)
      INTO t_state, t_version, t_token, t_attempt, t_tenant, t_estimate, t_budget, t_held
      FROM (SELECT t.state, t.version, t.current_fencing, t.current_attempt, t.tenant_id,
                   t.cost_estimate_milli, t.budget_reserved,
                   CASE WHEN t.current_attempt IS NOT NULL AND t.res_released_at IS NULL
                        THEN coalesce(cardinality(t.res_pool), 0) ELSE 0 END AS held
              FROM unnest(p_task) WITH ORDINALITY AS c (task, ord)
              LEFT JOIN task t ON t.task_id = c.task
             ORDER BY c.ord) r;
    -- Version 17: a loop (see the submit above).
    pending := '{}';
    FOR k IN 1 .. n LOOP
        pending := pending || k;
    END LOOP;
    -- Version 8: the whole batch checked at once. Nearly every batch is tasks at their current
    -- tokens going along the whitelist; then the first round takes every row without the
    -- per-row loop below. Any row that is not (gone, stale, illegal) sends the first round
    -- through that loop, with the same answers as before. A row whose check is NULL is refused
    -- here (and decided by the loop).
    -- A batch holds a handful of distinct ways (state, hops, target, mode): each is checked
    -- once, and each row only for its token.
    -- Version 17: one statement for both checks, and the whitelist read where a step is
    -- checked (the per-row loop below reads it whole only when it runs).
    WITH way AS MATERIALIZED (
        SELECT w.f_to, w.f_ends,
               ARRAY[w.f_state] || coalesce(string_to_array(w.f_via, '>'), '{}') AS f_ch
          FROM (SELECT DISTINCT t_state[g] AS f_state, p_via[g] AS f_via,
                       coalesce(p_to[g], t_state[g]) AS f_to,
                       p_mode[g] IN ('REQUEUE', 'FINISH') AS f_ends
                  FROM generate_series(1, n) AS g) w
    ), refused AS (
        -- A final step from a terminal state or off the whitelist.
        SELECT 1 FROM way, LATERAL (SELECT way.f_ch[cardinality(way.f_ch)] AS f_last) l
         WHERE NOT coalesce(
                   NOT l.f_last = ANY (ARRAY['SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED'])
                   AND (NOT (way.f_ends OR way.f_to <> l.f_last)
                        OR EXISTS (SELECT 1 FROM task_transition tt
                                    WHERE tt.from_state = l.f_last AND tt.to_state = way.f_to
                                      AND NOT tt.operator_only)),
                   false)
        UNION ALL
        -- A hop from a terminal state, or off the whitelist (a hop to the same state is none).
        SELECT 1 FROM way, generate_series(2, cardinality(way.f_ch)) AS h (i)
         WHERE way.f_ch[h.i - 1] = ANY (ARRAY['SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED'])
            OR (way.f_ch[h.i] <> way.f_ch[h.i - 1]
                AND NOT EXISTS (SELECT 1 FROM task_transition tt
                                 WHERE tt.from_state = way.f_ch[h.i - 1]
                                   AND tt.to_state = way.f_ch[h.i] AND NOT tt.operator_only))
    )
    SELECT NOT EXISTS (SELECT 1 FROM generate_series(1, n) AS g
                        WHERE t_state[g] IS NULL OR t_token[g] IS DISTINCT FROM p_token[g])
           AND NOT EXISTS (SELECT 1 FROM refused)
      INTO v_fast;

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
        IF v_round = 1 AND v_fast THEN
            -- Version 17: the three arrays in one loop (were three statements).
            FOR k IN 1 .. n LOOP
                to_state[k] := coalesce(p_to[k], t_state[k]);
                ends[k] := p_mode[k] IN ('REQUEUE', 'FINISH') AND t_attempt[k] IS NOT NULL;
                releases[k] := p_mode[k] <> 'ADVANCE' AND t_held[k] > 0;
            END LOOP;
            r_state := t_state;
            r_version := t_version;
            applied := pending;
        ELSE
            IF allowed IS NULL THEN
                SELECT array_agg(tt.from_state || '>' || tt.to_state) INTO allowed
                  FROM task_transition tt WHERE NOT tt.operator_only;
            END IF;
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
        END IF;
        IF cardinality(applied) = 0 THEN
            EXIT;
        END IF;
        WITH upd AS (
            UPDATE task t SET state = to_state[u.g], version = t.version + 1, updated_at = now(),
                   cost_actual_milli = coalesce(a_cost_actual[u.g], t.cost_actual_milli),
                   failure_reason = coalesce(p_reason[u.g], t.failure_reason),
                   next_eligible_at = CASE WHEN p_mode[u.g] = 'REQUEUE'
                                           THEN now() + a_delay_ms[u.g] * interval '1 millisecond'
                                           ELSE t.next_eligible_at END,
                   res_released_at = CASE WHEN releases[u.g] THEN now() ELSE t.res_released_at END,
                   current_attempt = CASE WHEN ends[u.g] THEN NULL ELSE t.current_attempt END,
                   current_fencing = CASE WHEN ends[u.g] THEN NULL ELSE t.current_fencing END,
                   -- Version 12: an attempt that ends its task stays in the row.
                   final_attempt = CASE WHEN ends[u.g] AND p_mode[u.g] = 'FINISH'
                                        THEN t.current_attempt ELSE t.final_attempt END,
                   final_fencing = CASE WHEN ends[u.g] AND p_mode[u.g] = 'FINISH'
                                        THEN t.current_fencing ELSE t.final_fencing END
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
            -- Version 12: only an attempt that does not end its task (a requeue) is copied
            -- out; a finishing one stays in the task row (above).
            INSERT INTO attempt_history (task_id, attempt_no, attempt_id, fencing_token, node_id,
                                         provider, provider_request_key, lease_until, created_at,
                                         outcome, res_pool, res_shard, res_amount, released_at)
            SELECT upd.task_id, upd.attempt_no, t_attempt[upd.g], t_token[upd.g],
                   coalesce(upd.attempt_node, ''), coalesce(upd.attempt_provider, ''),
                   'spindle-' || upd.task_id || '-' || upd.attempt_no,
                   coalesce(upd.attempt_lease_until, now()), coalesce(upd.attempt_started_at, now()),
                   to_state[upd.g], coalesce(upd.res_pool, '{}'), coalesce(upd.res_shard, '{}'),
                   coalesce(upd.res_amount, '{}'), upd.res_released_at
              FROM upd WHERE ends[upd.g] AND p_mode[upd.g] <> 'FINISH'
            RETURNING 1
        )
        SELECT (SELECT coalesce(array_agg(upd.g), '{}') FROM upd),
               (SELECT coalesce(array_agg(given.k ORDER BY given.k, given.s), '{}') FROM given),
               (SELECT coalesce(array_agg(given.s ORDER BY given.k, given.s), '{}') FROM given),
               (SELECT coalesce(array_agg(given.amount ORDER BY given.k, given.s), '{}')
                  FROM given)
          INTO won, g_key, g_shard, g_amount;
        a_key := a_key || g_key;
        a_shard := a_shard || g_shard;
        a_amount := a_amount || g_amount;
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
    -- Version 12: the tenants' totals are summed over the batch's arrays, not by joining the
    -- ledger insert's result back to the rows (two CTE scans joined by a nested loop: O(n²) in
    -- the batch, 73 µs per finished row at 1,024 rows). Only when the insert skipped a row (a
    -- repeat: rare) are the rows narrowed to those inserted first.
    -- Version 17: a loop.
    v_due := '{}';
    FOREACH i IN ARRAY won_all LOOP
        IF p_mode[i] = 'FINISH' AND t_budget[i] THEN
            v_due := v_due || i;
        END IF;
    END LOOP;
    IF cardinality(v_due) > 0 THEN
        WITH ins AS (
            INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
            SELECT t_tenant[g], p_task[g],
                   CASE WHEN to_state[g] = 'SUCCEEDED' THEN 'SETTLE' ELSE 'REFUND' END,
                   CASE WHEN to_state[g] = 'SUCCEEDED'
                        THEN coalesce(a_cost_actual[g], t_estimate[g]) ELSE t_estimate[g] END
              FROM unnest(v_due) AS g
            ON CONFLICT (task_id, kind) DO NOTHING
            RETURNING task_id
        )
        SELECT coalesce(array_agg(ins.task_id), '{}') INTO v_settled FROM ins;
        IF cardinality(v_settled) < cardinality(v_due) THEN
            v_due := ARRAY(SELECT g FROM unnest(v_due) AS g WHERE p_task[g] = ANY (v_settled));
        END IF;
        UPDATE tenant_quota q SET reserved_milli = q.reserved_milli - d.reserved,
               spent_milli = q.spent_milli + d.spent
          FROM (SELECT t_tenant[g] AS tenant, sum(t_estimate[g]) AS reserved,
                       sum(CASE WHEN to_state[g] = 'SUCCEEDED'
                                THEN coalesce(a_cost_actual[g], t_estimate[g]) ELSE 0 END) AS spent
                  FROM unnest(v_due) AS g GROUP BY t_tenant[g]) d
         WHERE q.tenant_id = d.tenant;
    END IF;
    INSERT INTO outbox_batch (kinds, tasks, tenants, details)
    -- Version 16: one sort (the subquery's), the arrays built in its order.
    SELECT array_agg(to_state[g]), array_agg(p_task[g]), array_agg(t_tenant[g]),
           jsonb_build_object('reason', array_agg(p_reason[g]), 'via', array_agg(p_via[g]),
                              'cost_actual_milli', array_agg(a_cost_actual[g]),
                              'cost_estimate_milli', array_agg(t_estimate[g]))
      FROM (SELECT w.g FROM unnest(won_all) AS w (g)
             WHERE p_mode[w.g] IN ('REQUEUE', 'FINISH') OR to_state[w.g] <> t_state[w.g]
             ORDER BY w.g) AS o (g)
    HAVING count(*) > 0;

    -- Version 14: the pools last of all, after the budgets and the outbox, in key order: held
    -- only to the commit, and locked after every tenant_quota row this batch locks, as a submit
    -- that carries claims locks them (the other order could deadlock the two).
    -- Version 17: locked from the released entries as they are (the semi-join takes a shard
    -- once), and summed per shard in the update.
    IF cardinality(a_key) > 0 THEN
        PERFORM 1 FROM resource_pool_shard p
         WHERE (p.pool_key, p.shard) IN (SELECT * FROM unnest(a_key, a_shard))
         ORDER BY p.pool_key, p.shard FOR UPDATE;
        UPDATE resource_pool_shard p SET used = p.used - x.amount, version = p.version + 1
          FROM (SELECT u.k, u.s, sum(u.a)::bigint AS amount
                  FROM unnest(a_key, a_shard, a_amount) AS u (k, s, a) GROUP BY u.k, u.s) x
         WHERE p.pool_key = x.k AND p.shard = x.s;
    END IF;

    RETURN QUERY
    SELECT (u.ord - 1)::integer, u.outcome, u.state, u.version, u.released, u.detail
      FROM unnest(r_outcome[1:n], r_state[1:n], r_version[1:n], r_released[1:n], r_detail[1:n])
           WITH ORDINALITY AS u (outcome, state, version, released, detail, ord);
END
$function$;
