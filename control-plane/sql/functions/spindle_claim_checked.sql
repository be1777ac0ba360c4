-- spindle_claim_checked: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- Claims of one batch, decided claim by claim: state, version, partition, then each demand
-- against the pools as the earlier claims left them; every grant checked again under the pool
-- locks. The fallback of spindle_claim; answers the same.
CREATE OR REPLACE FUNCTION spindle_claim_checked(p_node text, p_lease_ms bigint, p_task bigint[], p_version integer[], in_provider text[], p_dstart integer[], p_dcount integer[], in_pool text[], p_shard smallint[], p_amount bigint[])
 RETURNS TABLE(o_idx integer, o_outcome text, o_attempt bigint, o_token bigint, o_attempt_no integer, o_detail text)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
AS $function$
DECLARE
    -- Variable-width array arguments are copied into variables: PL/pgSQL keeps a variable's
    -- array expanded, so element i costs O(1); element i of a flat argument walks i elements,
    -- which made every per-row access of a batch O(n) and the batch O(n²).
    p_provider text[] := in_provider;
    p_pool text[] := in_pool;
    n integer := coalesce(array_length(p_task, 1), 0);
    i integer;
    j integer;
    k integer;
    fits boolean;
    v_owned integer[];
    v_lease timestamptz := now() + p_lease_ms * interval '1 millisecond';
    pk_key text[];
    pk_shard smallint[];
    pk_cap bigint[];
    pk_used bigint[];
    pk_used0 bigint[];
    d_pos integer[];
    t_state text[];
    t_version integer[];
    t_partition integer[];
    t_tenant integer[];
    t_attempt_no integer[];
    r_outcome text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    r_attempt bigint[] := array_fill(NULL::bigint, ARRAY[greatest(n, 1)]);
    r_token bigint[] := array_fill(NULL::bigint, ARRAY[greatest(n, 1)]);
    r_no integer[] := array_fill(NULL::integer, ARRAY[greatest(n, 1)]);
    r_detail text[] := array_fill(NULL::text, ARRAY[greatest(n, 1)]);
    granted integer[] := '{}';
    won integer[];
    lost integer[];
    reverted integer[];
    v_state text;
    v_version integer;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    SELECT array_agg(t.state ORDER BY c.ord), array_agg(t.version ORDER BY c.ord),
           array_agg(t.partition ORDER BY c.ord), array_agg(t.tenant_id ORDER BY c.ord),
           array_agg(t.attempt_no ORDER BY c.ord)
      INTO t_state, t_version, t_partition, t_tenant, t_attempt_no
      FROM unnest(p_task) WITH ORDINALITY AS c (task, ord)
      LEFT JOIN task t ON t.task_id = c.task;
    -- Only the partitions this batch's tasks are in: locking every partition the node owns
    -- would have each call share-lock them all (and two shards' calls create multixacts).
    SELECT coalesce(array_agg(l.partition), '{}') INTO v_owned FROM (
        SELECT pl.partition FROM partition_lease pl
         WHERE pl.owner_node = p_node AND pl.lease_until > now()
           AND pl.partition = ANY (t_partition)
         ORDER BY pl.partition FOR SHARE) l;
    -- The pool shards as they are now, unlocked: a first decision. They are locked only at the
    -- end, for as short a time as the batch allows (every batch of every shard and node that
    -- draws on a pool waits for that lock), and the decision is checked again under it.
    WITH seen AS MATERIALIZED (
        SELECT p.pool_key, p.shard, p.capacity, p.used FROM resource_pool_shard p
         WHERE (p.pool_key, p.shard) IN (SELECT * FROM unnest(p_pool, p_shard)))
    SELECT coalesce(array_agg(l.pool_key ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.shard ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.capacity ORDER BY l.pool_key, l.shard), '{}'),
           coalesce(array_agg(l.used ORDER BY l.pool_key, l.shard), '{}')
      INTO pk_key, pk_shard, pk_cap, pk_used FROM seen l;
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
        -- One number serves as the attempt's id and its fencing token: both need only be
        -- unique and growing, and one sequence call per claim is half the cost of two.
        r_attempt[i] := nextval('fencing_token_seq');
        r_token[i] := r_attempt[i];
        r_no[i] := t_attempt_no[i] + 1;
        granted := granted || i;
    END LOOP;

    IF array_length(granted, 1) IS NOT NULL THEN
        WITH dem AS MATERIALIZED (
            -- One row per granted claim with its demands as arrays, built element by element
            -- (a slice of a variable-width array copies the whole array for every claim).
            SELECT u.g,
                   coalesce(array_agg(p_pool[d.dj] ORDER BY d.dj) FILTER (WHERE d.dj IS NOT NULL),
                            '{}') AS pools,
                   coalesce(array_agg(p_shard[d.dj] ORDER BY d.dj) FILTER (WHERE d.dj IS NOT NULL),
                            '{}') AS shards,
                   coalesce(array_agg(p_amount[d.dj] ORDER BY d.dj) FILTER (WHERE d.dj IS NOT NULL),
                            '{}') AS amounts
              FROM unnest(granted) AS u (g)
              LEFT JOIN LATERAL generate_series(p_dstart[u.g], p_dstart[u.g] + p_dcount[u.g] - 1)
                        AS d (dj) ON true
             GROUP BY u.g
        ), upd AS (
            UPDATE task t SET state = 'DISPATCHING', version = t.version + 1,
                   attempt_no = r_no[dem.g], current_attempt = r_attempt[dem.g],
                   current_fencing = r_token[dem.g], attempt_node = p_node,
                   attempt_provider = p_provider[dem.g], attempt_lease_until = v_lease,
                   attempt_started_at = now(), res_pool = dem.pools, res_shard = dem.shards,
                   res_amount = dem.amounts, res_released_at = NULL, updated_at = now(),
                   next_eligible_at = NULL
              FROM dem
             WHERE t.task_id = p_task[dem.g] AND t.state = 'QUEUED'
               AND t.version = p_version[dem.g]
            RETURNING dem.g)
        SELECT coalesce(array_agg(upd.g), '{}') INTO won FROM upd;
        IF cardinality(won) < cardinality(granted) THEN
            -- Moved by another writer after the read: not granted (nor charged below).
            SELECT array_agg(g) INTO lost FROM unnest(granted) AS g WHERE NOT g = ANY (won);
            FOREACH i IN ARRAY lost LOOP
                SELECT t.state, t.version INTO v_state, v_version
                  FROM task t WHERE t.task_id = p_task[i];
                r_outcome[i] := CASE WHEN v_state IS NULL THEN 'TASK_GONE' ELSE 'VERSION_MOVED' END;
                r_detail[i] := v_state || '@' || v_version;
                r_attempt[i] := NULL;
                r_token[i] := NULL;
                r_no[i] := NULL;
            END LOOP;
        END IF;
        IF cardinality(won) > 0 THEN
            -- Now the pools, locked in key order, and every won claim checked again against
            -- what they hold (another batch may have charged them since the first read).
            WITH locked AS MATERIALIZED (
                SELECT p.pool_key, p.shard, p.capacity, p.used FROM resource_pool_shard p
                 WHERE (p.pool_key, p.shard) IN (SELECT * FROM unnest(pk_key, pk_shard))
                 ORDER BY p.pool_key, p.shard FOR UPDATE)
            SELECT coalesce(array_agg(l.capacity ORDER BY l.pool_key, l.shard), '{}'),
                   coalesce(array_agg(l.used ORDER BY l.pool_key, l.shard), '{}')
              INTO pk_cap, pk_used FROM locked l;
            pk_used0 := pk_used;
            reverted := '{}';
            FOREACH i IN ARRAY won LOOP
                fits := true;
                FOR j IN p_dstart[i] .. p_dstart[i] + p_dcount[i] - 1 LOOP
                    IF pk_used[d_pos[j]] + p_amount[j] > pk_cap[d_pos[j]] THEN
                        r_outcome[i] := 'POOL_FULL';
                        r_detail[i] := p_pool[j] || '/' || p_shard[j];
                        fits := false;
                        EXIT;
                    END IF;
                END LOOP;
                IF fits THEN
                    FOR j IN p_dstart[i] .. p_dstart[i] + p_dcount[i] - 1 LOOP
                        pk_used[d_pos[j]] := pk_used[d_pos[j]] + p_amount[j];
                    END LOOP;
                ELSE
                    reverted := reverted || i;
                    r_attempt[i] := NULL;
                    r_token[i] := NULL;
                    r_no[i] := NULL;
                END IF;
            END LOOP;
            IF cardinality(reverted) > 0 THEN
                -- Back to exactly what they were (nobody outside this transaction saw the
                -- change): the caller's version stays right.
                UPDATE task t SET state = 'QUEUED', version = t.version - 1,
                       attempt_no = t.attempt_no - 1, current_attempt = NULL,
                       current_fencing = NULL
                  FROM unnest(reverted) AS u (g) WHERE t.task_id = p_task[u.g];
                SELECT coalesce(array_agg(g), '{}') INTO won
                  FROM unnest(won) AS g WHERE NOT g = ANY (reverted);
            END IF;
            UPDATE resource_pool_shard p SET used = x.used, version = p.version + 1
              FROM unnest(pk_key, pk_shard, pk_used, pk_used0) AS x (k, s, used, used0)
             WHERE p.pool_key = x.k AND p.shard = x.s AND x.used <> x.used0;
        END IF;
        IF cardinality(won) > 0 THEN
            INSERT INTO outbox_batch (kinds, tasks, tenants, details)
            SELECT array_agg('DISPATCHING'::text ORDER BY g), array_agg(p_task[g] ORDER BY g),
                   array_agg(t_tenant[g] ORDER BY g),
                   jsonb_build_object('attempt', array_agg(r_attempt[g] ORDER BY g),
                                      'attempt_no', array_agg(r_no[g] ORDER BY g),
                                      'provider', array_agg(p_provider[g] ORDER BY g),
                                      'node', p_node)
              FROM unnest(won) AS g;
        END IF;
    END IF;

    RETURN QUERY
    SELECT (u.ord - 1)::integer, u.outcome, u.attempt, u.token, u.no, u.detail
      FROM unnest(r_outcome[1:n], r_attempt[1:n], r_token[1:n], r_no[1:n], r_detail[1:n])
           WITH ORDINALITY AS u (outcome, attempt, token, no, detail, ord);
END
$function$;
