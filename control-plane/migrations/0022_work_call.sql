-- spindle schema, version 22: a node's reports and claims in one call.
--
-- A node's work pipeline sent the reports of ended attempts and the claims of the tasks picked
-- into the slots they freed as separate calls, each with its own statements and commit: with
-- short provider jobs, a slot sat idle for a report call and then a claim call between two
-- jobs, and at a few concurrent slots nearly every call carried one row. `spindle_work` runs a
-- batch of reports and then a batch of claims in one statement and one transaction: the claims
-- see the slots the reports released. Its rows are the reports' (o_kind 0), then the claims'
-- (o_kind 1), each in its batch's order, with the columns of `spindle_report` and
-- `spindle_claim` side by side.

CREATE FUNCTION spindle_work(
    -- The reports, as spindle_report takes them.
    r_task bigint[], r_token bigint[], r_mode text[], r_to text[], r_cost_actual bigint[],
    r_delay_ms bigint[], r_reason text[], r_via text[],
    -- The claims, as spindle_claim takes them.
    c_node text, c_lease_ms bigint, c_task bigint[], c_version integer[], c_provider text[],
    c_dstart integer[], c_dcount integer[], c_pool text[], c_shard smallint[], c_amount bigint[],
    c_pools_joined text[])
RETURNS TABLE (o_kind smallint, o_idx integer, o_outcome text, o_state text, o_version integer,
               o_released integer, o_attempt bigint, o_token bigint, o_attempt_no integer,
               o_detail text)
LANGUAGE plpgsql
SET jit TO 'off'
AS $$
BEGIN
    RETURN QUERY
        SELECT 0::smallint, r.o_idx, r.o_outcome, r.o_state, r.o_version, r.o_released,
               NULL::bigint, NULL::bigint, NULL::integer, r.o_detail
          FROM spindle_report(r_task, r_token, r_mode, r_to, r_cost_actual, r_delay_ms, r_reason,
                              r_via) AS r
         ORDER BY r.o_idx;
    RETURN QUERY
        SELECT 1::smallint, c.o_idx, c.o_outcome, NULL::text, NULL::integer, NULL::integer,
               c.o_attempt, c.o_token, c.o_attempt_no, c.o_detail
          FROM spindle_claim(c_node, c_lease_ms, c_task, c_version, c_provider, c_dstart,
                             c_dcount, c_pool, spindle_pick_shards(c_pool, c_shard, c_amount),
                             c_amount, c_pools_joined) AS c
         ORDER BY c.o_idx;
END;
$$;
