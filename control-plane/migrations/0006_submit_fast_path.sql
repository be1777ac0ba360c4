-- spindle schema, version 6: submits take a fast path when nothing in the batch needs deciding.
--
-- Version 5's `spindle_submit` decides every row before it writes: it looks each idempotency
-- key up in `task` (one index probe per row), reserves budgets row by row, then inserts with
-- ON CONFLICT DO NOTHING (a speculative insertion per row) in case a concurrent submit of the
-- same key committed in between. Measured at 20,000 submits/s (pg_stat_statements), the lookup
-- cost ~10 µs and the insert ~39 µs per row; the plain insert of the same rows costs ~15.
--
-- Nearly every batch is new work that fits its tenants' budgets. For such a batch the unique
-- index on (tenant_id, idempotency_key) is the whole check: the new `spindle_submit` compares
-- each budgeted tenant's total for the batch with what it has left and, when all fit, inserts
-- the rows as they are in a subtransaction. A key seen before — a replay, a conflict, the same
-- key twice in the batch, a concurrent submit of it — raises unique_violation; the
-- subtransaction's writes are undone and the batch is decided row by row by the version-5
-- function, renamed `spindle_submit_checked`, with the same answers as before. A batch whose
-- total does not fit a budget goes there directly (it may fit in part).
--
-- Lock order is unchanged: tenant_quota (FOR UPDATE, by tenant) → task (insert).

ALTER FUNCTION spindle_submit(bigint[], integer[], integer[], text[], bytea[], integer[],
                              smallint[], smallint[], bigint[], bigint[], bigint)
    RENAME TO spindle_submit_checked;

CREATE FUNCTION spindle_submit(
    p_task bigint[], p_tenant integer[], p_user integer[], in_key text[], in_payload bytea[],
    p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[],
    p_fairness bigint[], p_policy_version bigint)
RETURNS TABLE (o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    -- Copied into variables for O(1) element access (see version 5).
    p_key text[] := in_key;
    p_payload bytea[] := in_payload;
    n integer := coalesce(array_length(p_task, 1), 0);
    -- The batch's budgeted tenants (locked), what each has left and what the batch needs.
    q_tenant integer[];
    q_remaining bigint[];
    q_need bigint[];
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    WITH locked AS (
        SELECT q.tenant_id, q.budget_milli - q.reserved_milli - q.spent_milli AS remaining
          FROM tenant_quota q WHERE q.tenant_id = ANY (p_tenant)
         ORDER BY q.tenant_id FOR UPDATE),
    need AS (
        SELECT u.tenant, sum(u.cost)::bigint AS need
          FROM unnest(p_tenant, p_cost) AS u (tenant, cost) GROUP BY u.tenant)
    SELECT coalesce(array_agg(l.tenant_id ORDER BY l.tenant_id), '{}'),
           coalesce(array_agg(l.remaining ORDER BY l.tenant_id), '{}'),
           coalesce(array_agg(d.need ORDER BY l.tenant_id), '{}')
      INTO q_tenant, q_remaining, q_need
      FROM locked l JOIN need d ON d.tenant = l.tenant_id;
    IF NOT EXISTS (SELECT 1 FROM unnest(q_remaining, q_need) AS b (remaining, need)
                    WHERE b.need > b.remaining) THEN
        BEGIN
            INSERT INTO task (task_id, tenant_id, user_id, idempotency_key, payload, partition,
                              lane, band, state, policy_version, cost_estimate_milli,
                              fairness_milli, budget_reserved)
            SELECT p_task[k], p_tenant[k], p_user[k], p_key[k], p_payload[k], p_partition[k],
                   p_lane[k], p_band[k], 'QUEUED', p_policy_version, p_cost[k], p_fairness[k],
                   p_tenant[k] = ANY (q_tenant)
              FROM generate_series(1, n) AS k;
            UPDATE tenant_quota qt SET reserved_milli = qt.reserved_milli + b.need
              FROM unnest(q_tenant, q_need) AS b (tenant, need)
             WHERE qt.tenant_id = b.tenant AND b.need <> 0;
            INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
            SELECT p_tenant[k], p_task[k], 'RESERVE', p_cost[k]
              FROM generate_series(1, n) AS k
             WHERE p_tenant[k] = ANY (q_tenant);
            RETURN QUERY
            SELECT (k - 1)::integer, 'CREATED'::text, p_task[k], 'QUEUED'::text, NULL::text
              FROM generate_series(1, n) AS k;
            RETURN;
        EXCEPTION WHEN unique_violation THEN
            -- A key seen before: nothing of the above stays; decided row by row below.
            NULL;
        END;
    END IF;
    RETURN QUERY
    SELECT * FROM spindle_submit_checked(p_task, p_tenant, p_user, in_key, in_payload,
                                         p_partition, p_lane, p_band, p_cost, p_fairness,
                                         p_policy_version);
END
$$;
