-- spindle schema, version 14: a submit batch may carry the claims of the tasks it submits.
--
-- A node's core usually picks a new task before its submit has committed; until now the claim
-- waited for that commit and then went as a second transaction, which read the rows just
-- inserted and rewrote each one (QUEUED → DISPATCHING, the attempt, what it holds). Measured
-- on an idle server, batches of 64 on one backend (docs/benchmarks.md, "Eleventh round"): the
-- submit and the claim cost 32 µs of backend CPU per task together; inserting the rows already
-- claimed, 13–16 µs.
--
-- `spindle_submit_claim` takes the submit's arrays and, per row, an optional claim (provider,
-- demands as in `spindle_claim`: a slice of the flat demand arrays and the pool keys joined by
-- chr(31)). When every partition is held, every budget fits and every demanded pool shard has
-- room for the batch's total demand on it, the rows are inserted in a subtransaction: a row
-- with a claim as DISPATCHING at version 1 with attempt 1 (one number its attempt id and its
-- fencing token, from the sequence), its lease and what it holds; a row without one QUEUED at
-- version 0; the budgets reserved; the pools locked in key order, checked again and charged;
-- one outbox row for the claimed ones. Anything short of that — a key seen before
-- (unique_violation), a pool filled under the lock — undoes the subtransaction, and so does a
-- partition not held or a budget that does not fit, before it starts: the batch then goes to
-- `spindle_submit_leased` unclaimed, with the same answers a submit had before, and the node
-- claims its tasks after the commit as it did.
--
-- Lock order: partition_lease (share) → tenant_quota → task (insert) → resource_pool_shard (by
-- key, at the end), the order of a submit followed by a claim. A claimed row is what a claim
-- would have left: the invariants of the pools (used = what live attempts hold, unreleased),
-- of the attempts (one live per task, its request key `spindle-<task>-1`) and of the outbox
-- hold as they do for `spindle_claim`.

CREATE FUNCTION spindle_submit_claim(
    p_node text, p_lease_ms bigint,
    p_task bigint[], p_tenant integer[], p_user integer[], in_key text[], in_payload bytea[],
    p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[],
    p_fairness bigint[], p_policy_version bigint,
    in_provider text[], p_dstart integer[], p_dcount integer[], in_pool text[],
    p_shard smallint[], p_amount bigint[], in_pools_joined text[])
RETURNS TABLE (o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text,
               o_token bigint)
LANGUAGE plpgsql SET enable_seqscan = off SET enable_mergejoin = off SET enable_hashjoin = off
    SET jit = off SET plan_cache_mode = force_generic_plan AS $$
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
    v_held integer[];
    -- The batch's budgeted tenants (locked), what each has left and what the batch needs.
    q_tenant integer[];
    q_remaining bigint[];
    q_need bigint[];
    -- Row i's token, NULL for a row without a claim.
    r_token bigint[];
    claimed integer[];
    -- The claimed rows' demand per pool shard, in key order.
    pk_key text[];
    pk_shard smallint[];
    pk_need bigint[];
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    claimed := ARRAY(SELECT k FROM generate_series(1, n) AS k
                      WHERE p_provider[k] IS NOT NULL ORDER BY k);
    SELECT coalesce(array_agg(l.partition), '{}') INTO v_held FROM (
        SELECT pl.partition FROM partition_lease pl
         WHERE pl.owner_node = p_node AND pl.lease_until > now()
           AND pl.partition = ANY (p_partition)
         ORDER BY pl.partition FOR SHARE) l;
    v_whole := NOT EXISTS (SELECT 1 FROM unnest(p_partition) AS u (p) WHERE NOT u.p = ANY (v_held));
    IF v_whole THEN
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
        v_whole := NOT EXISTS (SELECT 1 FROM unnest(q_remaining, q_need) AS b (remaining, need)
                                WHERE b.need > b.remaining);
    END IF;
    IF v_whole AND cardinality(claimed) > 0 THEN
        SELECT coalesce(array_agg(d.k ORDER BY d.k, d.s), '{}'),
               coalesce(array_agg(d.s ORDER BY d.k, d.s), '{}'),
               coalesce(array_agg(d.need ORDER BY d.k, d.s), '{}')
          INTO pk_key, pk_shard, pk_need
          FROM (SELECT u.k, u.s, sum(u.a)::bigint AS need
                  FROM unnest(p_pool, p_shard, p_amount) AS u (k, s, a) GROUP BY u.k, u.s) d;
        -- A first look at the pools, unlocked.
        SELECT count(*) = cardinality(pk_key)
                   AND coalesce(bool_and(p.used + x.need <= p.capacity), true)
          INTO v_whole
          FROM unnest(pk_key, pk_shard, pk_need) AS x (k, s, need)
          JOIN resource_pool_shard p ON p.pool_key = x.k AND p.shard = x.s;
    END IF;
    IF v_whole THEN
        BEGIN
            r_token := array_fill(NULL::bigint, ARRAY[n]);
            IF cardinality(claimed) > 0 THEN
                -- One number is the attempt's id and its fencing token (see version 5).
                SELECT array_agg(t.token ORDER BY t.k) INTO r_token
                  FROM (SELECT g.k, CASE WHEN p_provider[g.k] IS NOT NULL
                                         THEN nextval('fencing_token_seq') END AS token
                          FROM generate_series(1, n) AS g (k)) t;
            END IF;
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
            UPDATE tenant_quota qt SET reserved_milli = qt.reserved_milli + b.need
              FROM unnest(q_tenant, q_need) AS b (tenant, need)
             WHERE qt.tenant_id = b.tenant AND b.need <> 0;
            INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
            SELECT p_tenant[k], p_task[k], 'RESERVE', p_cost[k]
              FROM generate_series(1, n) AS k
             WHERE p_tenant[k] = ANY (q_tenant);
            IF cardinality(claimed) > 0 THEN
                -- The pools last, in key order, checked again under their locks.
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
                VALUES (array_fill('DISPATCHING'::text, ARRAY[cardinality(claimed)]),
                        ARRAY(SELECT p_task[k] FROM unnest(claimed) AS k),
                        ARRAY(SELECT p_tenant[k] FROM unnest(claimed) AS k),
                        jsonb_build_object(
                            'attempt', ARRAY(SELECT r_token[k] FROM unnest(claimed) AS k),
                            'attempt_no', array_fill(1, ARRAY[cardinality(claimed)]),
                            'provider', ARRAY(SELECT p_provider[k] FROM unnest(claimed) AS k),
                            'node', p_node));
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
$$;
