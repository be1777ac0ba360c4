-- spindle_renew: one of the store's functions (control-plane/sql/functions/, created again whenever
-- this file changes; see migrate.rs).
--
-- Lease renewal of running attempts: each (task, token) whose token is still current gets its
-- attempt lease moved to now + p_lease_ms; returns the attempts renewed (a missing one was fenced
-- off or ended).
CREATE OR REPLACE FUNCTION spindle_renew(p_task bigint[], p_token bigint[], p_lease_ms bigint)
 RETURNS TABLE(o_attempt bigint)
 LANGUAGE sql
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
AS $function$
    UPDATE task t SET attempt_lease_until = now() + p_lease_ms * interval '1 millisecond'
      FROM unnest(p_task, p_token) AS r (task, token)
     WHERE t.task_id = r.task AND t.current_fencing = r.token AND t.current_attempt IS NOT NULL
    RETURNING t.current_attempt
$function$;
