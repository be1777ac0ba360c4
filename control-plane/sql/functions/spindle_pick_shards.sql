-- spindle_pick_shards: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- The pool shard each demand is charged to: the preferred one (a node shard's own, so shards and
-- nodes do not meet on one row) when it has room for the demands before it and this one, else the
-- next shard of the same pool that has, wrapping. Reads without locks: the claim functions lock
-- and check the shards given, so a stale pick is a refusal, never an overshoot.
CREATE OR REPLACE FUNCTION spindle_pick_shards(in_pool text[], p_shard smallint[], p_amount bigint[])
 RETURNS smallint[]
 LANGUAGE plpgsql
 STABLE
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    -- Copied for O(1) element access (see version 5).
    p_pool text[] := in_pool;
    m integer := coalesce(array_length(p_shard, 1), 0);
    picked smallint[] := p_shard;
    -- Every shard of the batch's pools, by key and shard, with its room.
    r_key text[];
    r_shard smallint[];
    r_room bigint[];
    j integer;
    i integer;
    k integer;
    lo integer;
    hi integer;
    first integer;
BEGIN
    -- The usual case: each preferred shard has room for everything the batch asks of it.
    IF m = 0 OR NOT EXISTS (
        SELECT 1
          FROM (SELECT u.k, u.s, sum(u.a) AS need
                  FROM unnest(p_pool, p_shard, p_amount) AS u (k, s, a) GROUP BY u.k, u.s) d
          LEFT JOIN resource_pool_shard p ON p.pool_key = d.k AND p.shard = d.s
         WHERE p.pool_key IS NULL OR p.used + d.need > p.capacity) THEN
        RETURN picked;
    END IF;
    SELECT array_agg(p.pool_key ORDER BY p.pool_key, p.shard),
           array_agg(p.shard ORDER BY p.pool_key, p.shard),
           array_agg(greatest(p.capacity - p.used, 0) ORDER BY p.pool_key, p.shard)
      INTO r_key, r_shard, r_room
      FROM resource_pool_shard p WHERE p.pool_key = ANY (p_pool);
    IF r_key IS NULL THEN
        RETURN picked;
    END IF;
    FOR j IN 1 .. m LOOP
        -- The pool's shards are r_key[lo .. hi] (sorted by key); an unknown pool is left to the
        -- claim, which answers it.
        lo := array_position(r_key, p_pool[j]);
        CONTINUE WHEN lo IS NULL;
        hi := lo;
        WHILE hi < cardinality(r_key) AND r_key[hi + 1] = p_pool[j] LOOP
            hi := hi + 1;
        END LOOP;
        -- From the preferred shard on, wrapping around; the first with room takes it.
        first := lo;
        WHILE first <= hi AND r_shard[first] < p_shard[j] LOOP
            first := first + 1;
        END LOOP;
        FOR i IN 0 .. hi - lo LOOP
            k := lo + (first - lo + i) % (hi - lo + 1);
            IF r_room[k] >= p_amount[j] THEN
                picked[j] := r_shard[k];
                r_room[k] := r_room[k] - p_amount[j];
                EXIT;
            END IF;
        END LOOP;
        -- No shard with room: left as asked, and the claim finds it full.
    END LOOP;
    RETURN picked;
END
$function$;
