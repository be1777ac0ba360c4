-- spindle_submit: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- New tasks of one batch, fast path: when every row is new work and every budgeted tenant's
-- total for the batch fits what it has left, the rows go in as they are in a subtransaction, the
-- unique (tenant_id, idempotency_key) index being the whole check. A key seen before (a replay, a
-- conflict, a duplicate in the batch, a concurrent submit) raises unique_violation and the batch is
-- decided row by row by spindle_submit_checked, with the same answers. A batch over a budget goes
-- there directly. Lock order: tenant_quota (by tenant) -> task.
CREATE OR REPLACE FUNCTION spindle_submit(p_task bigint[], p_tenant integer[], p_user integer[], in_key text[], in_payload bytea[], p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[], p_fairness bigint[], p_policy_version bigint)
 RETURNS TABLE(o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
$function$;
