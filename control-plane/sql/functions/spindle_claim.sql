-- spindle_claim: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- Claims of one batch, fast path: set-based checks that every task is QUEUED at the expected
-- version, every partition held (share lock) and every demanded pool shard has room for the
-- batch's total; then, in a subtransaction, one fencing token per claim, the compare-and-set of
-- each task, the pools locked in key order and charged. Anything short of the whole batch undoes
-- the subtransaction and goes to spindle_claim_checked. Every join is a batch against a key:
-- nested loops over index probes (a generic plan once chose a merge over the whole index).
-- Lock order: partition_lease (share) -> task -> resource_pool_shard (by key).
CREATE OR REPLACE FUNCTION spindle_claim(p_node text, p_lease_ms bigint, p_task bigint[], p_version integer[], in_provider text[], p_dstart integer[], p_dcount integer[], in_pool text[], p_shard smallint[], p_amount bigint[], in_pools_joined text[])
 RETURNS TABLE(o_idx integer, o_outcome text, o_attempt bigint, o_token bigint, o_attempt_no integer, o_detail text)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET enable_mergejoin TO 'off'
 SET enable_hashjoin TO 'off'
 SET jit TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    -- Copied into variables for O(1) element access (see version 5).
    p_provider text[] := in_provider;
    p_pool text[] := in_pool;
    -- Claim i's pool keys joined by chr(31) (keys hold no control characters): its
    -- `res_pool` is split from it, and its shards and amounts are slices of the fixed-width
    -- arrays — per-claim aggregation of the demands cost ~20 µs per claim.
    p_pools_joined text[] := in_pools_joined;
    n integer := coalesce(array_length(p_task, 1), 0);
    v_lease timestamptz := now() + p_lease_ms * interval '1 millisecond';
    v_whole boolean;
    v_won integer;
    t_tenant integer[];
    t_no integer[];
    t_parts integer[];
    r_token bigint[];
    -- The batch's demand per pool shard, in key order.
    pk_key text[];
    pk_shard smallint[];
    pk_need bigint[];
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    SELECT coalesce(bool_and(t.state = 'QUEUED' AND t.version = c.version), false)
               AND count(t.task_id) = n,
           array_agg(t.tenant_id ORDER BY c.ord), array_agg(t.attempt_no + 1 ORDER BY c.ord),
           array_agg(DISTINCT t.partition)
      INTO v_whole, t_tenant, t_no, t_parts
      FROM unnest(p_task, p_version) WITH ORDINALITY AS c (task, version, ord)
      LEFT JOIN task t ON t.task_id = c.task;
    IF v_whole THEN
        SELECT count(*) = cardinality(t_parts) INTO v_whole FROM (
            SELECT pl.partition FROM partition_lease pl
             WHERE pl.owner_node = p_node AND pl.lease_until > now()
               AND pl.partition = ANY (t_parts)
             ORDER BY pl.partition FOR SHARE) l;
    END IF;
    IF v_whole THEN
        SELECT coalesce(array_agg(d.k ORDER BY d.k, d.s), '{}'),
               coalesce(array_agg(d.s ORDER BY d.k, d.s), '{}'),
               coalesce(array_agg(d.need ORDER BY d.k, d.s), '{}')
          INTO pk_key, pk_shard, pk_need
          FROM (SELECT u.k, u.s, sum(u.a)::bigint AS need
                  FROM unnest(p_pool, p_shard, p_amount) AS u (k, s, a) GROUP BY u.k, u.s) d;
        -- A first look at the pools, unlocked.
        SELECT count(*) = cardinality(pk_key) AND coalesce(bool_and(p.used + x.need <= p.capacity), true)
          INTO v_whole
          FROM unnest(pk_key, pk_shard, pk_need) AS x (k, s, need)
          JOIN resource_pool_shard p ON p.pool_key = x.k AND p.shard = x.s;
    END IF;
    IF v_whole THEN
        BEGIN
            -- One number is the attempt's id and its fencing token (see version 5).
            r_token := ARRAY(SELECT nextval('fencing_token_seq') FROM generate_series(1, n));
            WITH upd AS (
                UPDATE task t SET state = 'DISPATCHING', version = t.version + 1,
                       attempt_no = t_no[u.g], current_attempt = r_token[u.g],
                       current_fencing = r_token[u.g], attempt_node = p_node,
                       attempt_provider = p_provider[u.g], attempt_lease_until = v_lease,
                       attempt_started_at = now(),
                       res_pool = string_to_array(p_pools_joined[u.g], chr(31)),
                       res_shard = p_shard[p_dstart[u.g] : p_dstart[u.g] + p_dcount[u.g] - 1],
                       res_amount = p_amount[p_dstart[u.g] : p_dstart[u.g] + p_dcount[u.g] - 1],
                       res_released_at = NULL, updated_at = now(), next_eligible_at = NULL
                  FROM unnest(p_task, p_version) WITH ORDINALITY AS u (task, version, g)
                 WHERE t.task_id = u.task AND t.state = 'QUEUED' AND t.version = u.version
                RETURNING 1)
            SELECT count(*) INTO v_won FROM upd;
            IF v_won < n THEN
                RAISE EXCEPTION USING ERRCODE = 'SP001', MESSAGE = 'a task moved';
            END IF;
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
            INSERT INTO outbox_batch (kinds, tasks, tenants, details)
            VALUES (array_fill('DISPATCHING'::text, ARRAY[n]), p_task, t_tenant,
                    jsonb_build_object('attempt', r_token, 'attempt_no', t_no,
                                       'provider', p_provider, 'node', p_node));
            RETURN QUERY
            SELECT (g - 1)::integer, 'GRANTED'::text, r_token[g], r_token[g], t_no[g], NULL::text
              FROM generate_series(1, n) AS g;
            RETURN;
        EXCEPTION WHEN SQLSTATE 'SP001' THEN
            -- Not the whole batch: nothing of the above stays; decided claim by claim below.
            NULL;
        END;
    END IF;
    RETURN QUERY
    SELECT * FROM spindle_claim_checked(p_node, p_lease_ms, p_task, p_version, in_provider,
                                        p_dstart, p_dcount, in_pool, p_shard, p_amount);
END
$function$;
