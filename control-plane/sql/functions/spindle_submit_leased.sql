-- spindle_submit_leased: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- Submits fenced by partition leases: the batch's partition_lease rows are read FOR SHARE (a
-- takeover waits for the submit, and the submit for a takeover under way); rows whose partition
-- the calling node holds go through spindle_submit, the others are answered PARTITION_NOT_OWNED.
-- Without it a node whose lease lapsed could commit tasks into a partition another node serves,
-- which that node would never load. Lock order: partition_lease (share) -> tenant_quota -> task.
CREATE OR REPLACE FUNCTION spindle_submit_leased(p_node text, p_task bigint[], p_tenant integer[], p_user integer[], in_key text[], in_payload bytea[], p_partition integer[], p_lane smallint[], p_band smallint[], p_cost bigint[], p_fairness bigint[], p_policy_version bigint)
 RETURNS TABLE(o_idx integer, o_outcome text, o_task bigint, o_state text, o_detail text)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    n integer := coalesce(array_length(p_task, 1), 0);
    v_held integer[];
    v_rows integer[];
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    SELECT coalesce(array_agg(l.partition), '{}') INTO v_held FROM (
        SELECT pl.partition FROM partition_lease pl
         WHERE pl.owner_node = p_node AND pl.lease_until > now()
           AND pl.partition = ANY (p_partition)
         ORDER BY pl.partition FOR SHARE) l;
    IF NOT EXISTS (SELECT 1 FROM unnest(p_partition) AS u (p) WHERE NOT u.p = ANY (v_held)) THEN
        RETURN QUERY
        SELECT * FROM spindle_submit(p_task, p_tenant, p_user, in_key, in_payload, p_partition,
                                     p_lane, p_band, p_cost, p_fairness, p_policy_version);
        RETURN;
    END IF;
    -- Some rows' partitions are not this node's: the rest go on, answered in their places.
    v_rows := ARRAY(SELECT k FROM generate_series(1, n) AS k
                     WHERE p_partition[k] = ANY (v_held) ORDER BY k);
    RETURN QUERY
    SELECT * FROM (
        SELECT v_rows[s.o_idx + 1] - 1 AS idx, s.o_outcome, s.o_task, s.o_state, s.o_detail
          FROM spindle_submit(
                   ARRAY(SELECT p_task[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT p_tenant[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT p_user[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT in_key[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT in_payload[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT p_partition[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT p_lane[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT p_band[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT p_cost[k] FROM unnest(v_rows) AS k),
                   ARRAY(SELECT p_fairness[k] FROM unnest(v_rows) AS k),
                   p_policy_version) AS s
        UNION ALL
        SELECT k - 1, 'PARTITION_NOT_OWNED', p_task[k], NULL, p_partition[k]::text
          FROM generate_series(1, n) AS k
         WHERE NOT p_partition[k] = ANY (v_held)) r
     ORDER BY r.idx;
END
$function$;
