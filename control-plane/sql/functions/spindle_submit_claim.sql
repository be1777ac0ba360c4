-- spindle_submit_claim: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- New tasks and, for those a shard picked at once, their first claim, in one call: the submit
-- of spindle_submit_leased and the claim of spindle_claim, with the statements per call kept few
-- (most of a small call's cost is per statement, not per row). Lock order: partition_lease
-- (share) -> tenant_quota -> task -> resource_pool_shard (by key).
CREATE OR REPLACE FUNCTION spindle_submit_claim(p_node text, p_lease_ms bigint, p_task bigint[], p_tenant integer[], p_user integer[], in_key text[], in_payload bytea[], p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[], p_fairness bigint[], p_policy_version bigint, in_provider text[], p_dstart integer[], p_dcount integer[], in_pool text[], p_shard smallint[], p_amount bigint[], in_pools_joined text[])
 RETURNS TABLE(o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text, o_token bigint)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET enable_mergejoin TO 'off'
 SET enable_hashjoin TO 'off'
 SET jit TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    -- Variable-width arrays copied into variables for O(1) element access (see version 5).
    p_key text[] := in_key;
    p_payload bytea[] := in_payload;
    p_provider text[] := in_provider;
    p_pool text[] := in_pool;
    p_pools_joined text[] := in_pools_joined;
    n integer := coalesce(array_length(p_task, 1), 0);
    v_lease timestamptz := now() + p_lease_ms * interval '1 millisecond';
    v_whole boolean;
    -- The batch's budgeted tenants (locked), what each has left and what the batch needs.
    q_tenant integer[];
    q_need bigint[];
    -- Row i's token, NULL for a row without a claim.
    r_token bigint[];
    claimed integer[];
    c integer;
    -- The claimed rows' demand per pool shard, in key order.
    pk_key text[];
    pk_shard smallint[];
    pk_need bigint[];
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    -- Version 17: per-element work on arrays as loops (an element costs well under a
    -- microsecond; a statement's start, ~25 µs on this project's machine).
    claimed := '{}';
    FOR k IN 1 .. n LOOP
        IF p_provider[k] IS NOT NULL THEN
            claimed := claimed || k;
        END IF;
    END LOOP;
    -- Version 17: the held partitions counted as they are locked (the count reads every row
    -- of the subquery, so each is locked), against the batch's distinct partitions.
    SELECT count(*) = (SELECT count(DISTINCT u.p) FROM unnest(p_partition) AS u (p))
      INTO v_whole
      FROM (SELECT pl.partition FROM partition_lease pl
             WHERE pl.owner_node = p_node AND pl.lease_until > now()
               AND pl.partition = ANY (p_partition)
             ORDER BY pl.partition FOR SHARE) l;
    IF v_whole THEN
        WITH locked AS (
            SELECT q.tenant_id, q.budget_milli - q.reserved_milli - q.spent_milli AS remaining
              FROM tenant_quota q WHERE q.tenant_id = ANY (p_tenant)
             ORDER BY q.tenant_id FOR UPDATE),
        need AS (
            SELECT u.tenant, sum(u.cost)::bigint AS need
              FROM unnest(p_tenant, p_cost) AS u (tenant, cost) GROUP BY u.tenant)
        -- Version 17: whether every budget fits, in the same statement.
        SELECT coalesce(array_agg(l.tenant_id ORDER BY l.tenant_id), '{}'),
               coalesce(array_agg(d.need ORDER BY l.tenant_id), '{}'),
               coalesce(bool_and(d.need <= l.remaining), true)
          INTO q_tenant, q_need, v_whole
          FROM locked l JOIN need d ON d.tenant = l.tenant_id;
    END IF;
    IF v_whole AND cardinality(claimed) > 0 THEN
        -- Version 17: the demand per pool shard and a first look at the pools (unlocked) in
        -- one statement: every demanded shard exists and has room.
        SELECT coalesce(array_agg(d.k ORDER BY d.k, d.s), '{}'),
               coalesce(array_agg(d.s ORDER BY d.k, d.s), '{}'),
               coalesce(array_agg(d.need ORDER BY d.k, d.s), '{}'),
               coalesce(bool_and(p.pool_key IS NOT NULL AND p.used + d.need <= p.capacity), true)
          INTO pk_key, pk_shard, pk_need, v_whole
          FROM (SELECT u.k, u.s, sum(u.a)::bigint AS need
                  FROM unnest(p_pool, p_shard, p_amount) AS u (k, s, a) GROUP BY u.k, u.s) d
          LEFT JOIN resource_pool_shard p ON p.pool_key = d.k AND p.shard = d.s;
    END IF;
    IF v_whole THEN
        BEGIN
            r_token := array_fill(NULL::bigint, ARRAY[n]);
            -- One number is the attempt's id and its fencing token (see version 5), taken in
            -- row order.
            FOREACH c IN ARRAY claimed LOOP
                r_token[c] := nextval('fencing_token_seq');
            END LOOP;
            INSERT INTO task (task_id, tenant_id, user_id, idempotency_key, payload, partition,
                              lane, band, state, version, policy_version, cost_estimate_milli,
                              fairness_milli, budget_reserved, attempt_no, current_attempt,
                              current_fencing, attempt_node, attempt_provider,
                              attempt_lease_until, attempt_started_at, res_pool, res_shard,
                              res_amount)
            SELECT p_task[k], p_tenant[k], p_user[k], p_key[k], p_payload[k], p_partition[k],
                   p_lane[k], p_band[k], c.state, c.version, p_policy_version, p_cost[k],
                   p_fairness[k], p_tenant[k] = ANY (q_tenant), c.attempt_no, r_token[k],
                   r_token[k], c.node, p_provider[k], c.lease, c.started,
                   CASE WHEN c.claim THEN string_to_array(p_pools_joined[k], chr(31)) END,
                   CASE WHEN c.claim
                        THEN p_shard[p_dstart[k] : p_dstart[k] + p_dcount[k] - 1] END,
                   CASE WHEN c.claim
                        THEN p_amount[p_dstart[k] : p_dstart[k] + p_dcount[k] - 1] END
              FROM generate_series(1, n) AS k,
                   LATERAL (SELECT r_token[k] IS NOT NULL AS claim) x,
                   LATERAL (SELECT x.claim,
                                   CASE WHEN x.claim THEN 'DISPATCHING' ELSE 'QUEUED' END AS state,
                                   CASE WHEN x.claim THEN 1 ELSE 0 END AS version,
                                   CASE WHEN x.claim THEN 1 ELSE 0 END AS attempt_no,
                                   CASE WHEN x.claim THEN p_node END AS node,
                                   CASE WHEN x.claim THEN v_lease END AS lease,
                                   CASE WHEN x.claim THEN now() END AS started) c;
            -- Version 17: only a batch with a budgeted tenant has budgets to reserve.
            IF cardinality(q_tenant) > 0 THEN
                UPDATE tenant_quota qt SET reserved_milli = qt.reserved_milli + b.need
                  FROM unnest(q_tenant, q_need) AS b (tenant, need)
                 WHERE qt.tenant_id = b.tenant AND b.need <> 0;
                INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
                SELECT p_tenant[k], p_task[k], 'RESERVE', p_cost[k]
                  FROM generate_series(1, n) AS k
                 WHERE p_tenant[k] = ANY (q_tenant);
            END IF;
            IF cardinality(claimed) > 0 THEN
                INSERT INTO outbox_batch (kinds, tasks, tenants, details)
                VALUES (array_fill('DISPATCHING'::text, ARRAY[cardinality(claimed)]),
                        ARRAY(SELECT p_task[k] FROM unnest(claimed) AS k),
                        ARRAY(SELECT p_tenant[k] FROM unnest(claimed) AS k),
                        jsonb_build_object(
                            'attempt', ARRAY(SELECT r_token[k] FROM unnest(claimed) AS k),
                            'attempt_no', array_fill(1, ARRAY[cardinality(claimed)]),
                            'provider', ARRAY(SELECT p_provider[k] FROM unnest(claimed) AS k),
                            'node', p_node));
                -- The pools last, in key order, checked again under their locks: held only to
                -- the commit.
                WITH locked AS MATERIALIZED (
                    SELECT p.pool_key, p.shard, p.capacity, p.used FROM resource_pool_shard p
                     WHERE (p.pool_key, p.shard) IN (SELECT * FROM unnest(pk_key, pk_shard))
                     ORDER BY p.pool_key, p.shard FOR UPDATE)
                SELECT count(*) = cardinality(pk_key)
                           AND coalesce(bool_and(l.used + x.need <= l.capacity), true)
                  INTO v_whole
                  FROM locked l
                  JOIN unnest(pk_key, pk_shard, pk_need) AS x (k, s, need)
                    ON x.k = l.pool_key AND x.s = l.shard;
                IF NOT v_whole THEN
                    RAISE EXCEPTION USING ERRCODE = 'SP001', MESSAGE = 'a pool filled';
                END IF;
                UPDATE resource_pool_shard p SET used = p.used + x.need, version = p.version + 1
                  FROM unnest(pk_key, pk_shard, pk_need) AS x (k, s, need)
                 WHERE p.pool_key = x.k AND p.shard = x.s;
            END IF;
            RETURN QUERY
            SELECT (k - 1)::integer, 'CREATED'::text, p_task[k],
                   CASE WHEN r_token[k] IS NOT NULL THEN 'DISPATCHING' ELSE 'QUEUED' END,
                   NULL::text, r_token[k]
              FROM generate_series(1, n) AS k;
            RETURN;
        EXCEPTION WHEN unique_violation OR SQLSTATE 'SP001' THEN
            -- Not the whole batch: nothing of the above stays; submitted unclaimed below.
            NULL;
        END;
    END IF;
    RETURN QUERY
    SELECT s.o_idx, s.o_outcome, s.o_task, s.o_state, s.o_detail, NULL::bigint
      FROM spindle_submit_leased(p_node, p_task, p_tenant, p_user, in_key, in_payload,
                                 p_partition, p_lane, p_band, p_cost, p_fairness,
                                 p_policy_version) AS s;
END
$function$;
