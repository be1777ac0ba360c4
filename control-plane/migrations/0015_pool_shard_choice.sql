-- spindle schema, version 15: a claim names the pool shard it prefers; the database charges
-- another shard of the same pool when that one has no room.
--
-- A provider account's pool was one row, and every transaction that charged or released it —
-- each shard's claimed submits, claims and finishing reports, on every node — locked that row
-- to its commit, so they queued behind each other's commit flush. `pg_stat_statements` at
-- 12,000 tasks/s: ~1 ms of a submit's ~3 ms, and of a report's ~4, waiting for the pool row
-- (docs/benchmarks.md, "Twelfth round"). A pool is now several rows (a node sizes a provider's
-- pool by its concurrency: `provider_pool_shards`) and each node shard prefers its own, so
-- transactions of different shards and nodes no longer meet on one row.
--
-- Preferring a shard does not narrow what a claim may take: when the preferred shard lacks
-- room for what the batch asks of it, `spindle_pick_shards` moves the demands, one by one, to
-- the first shard of their pool, from the preferred one on (wrapping), that still has room for
-- them as the demands before them left it. A claim is refused for a full pool only when no
-- shard of it has room — what one row did. The pick reads the pools without locks; the claim
-- functions lock and check the shards they were given as before, so the pick may be stale,
-- never an overshoot: a shard filled meanwhile fails the fast path, and the claim-by-claim
-- path answers POOL_FULL for what no longer fits (the node offers it again).
--
-- The node's statements pass the picked shards to `spindle_claim` and `spindle_submit_claim`
-- (`spindle_claim(…, spindle_pick_shards(pools, shards, amounts), …)`): one statement, no
-- wrapper function between (a SQL wrapper of a volatile function is not inlined and cost
-- ~3 µs a task). The task rows record the shards charged in `res_shard`; reports give back to
-- the shard a task holds, as before. Lock order is unchanged: the pick locks nothing.

CREATE FUNCTION spindle_pick_shards(in_pool text[], p_shard smallint[], p_amount bigint[])
RETURNS smallint[]
LANGUAGE plpgsql STABLE SET enable_seqscan = off SET jit = off
    SET plan_cache_mode = force_generic_plan AS $$
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
$$;
