-- spindle_work: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- A node's reports and claims in one call and one transaction: the reports first (as
-- spindle_report), then the claims (as spindle_claim), which see the slots the reports released.
-- Rows come back reports first (o_kind 0), then claims (o_kind 1), each in its batch's order.
CREATE OR REPLACE FUNCTION spindle_work(r_task bigint[], r_token bigint[], r_mode text[], r_to text[], r_cost_actual bigint[], r_delay_ms bigint[], r_reason text[], r_via text[], c_node text, c_lease_ms bigint, c_task bigint[], c_version integer[], c_provider text[], c_dstart integer[], c_dcount integer[], c_pool text[], c_shard smallint[], c_amount bigint[], c_pools_joined text[])
 RETURNS TABLE(o_kind smallint, o_idx integer, o_outcome text, o_state text, o_version integer, o_released integer, o_attempt bigint, o_token bigint, o_attempt_no integer, o_detail text)
 LANGUAGE plpgsql
 SET jit TO 'off'
AS $function$
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
$function$;
