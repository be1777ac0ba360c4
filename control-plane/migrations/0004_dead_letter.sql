-- The dead-letter view: tasks that ended FAILED, with why, how many attempts they had and where
-- the last one ran. Operators read it; nothing writes through it.
CREATE VIEW dead_letter AS
SELECT t.task_id, t.tenant_id, t.lane, t.attempt_no AS attempts, t.failure_reason,
       t.cost_estimate_milli, t.created_at, t.updated_at AS failed_at,
       a.provider AS last_provider, a.provider_request_key AS last_request_key
  FROM task t
  LEFT JOIN LATERAL (
        SELECT ta.provider, ta.provider_request_key FROM task_attempt ta
         WHERE ta.task_id = t.task_id ORDER BY ta.attempt_no DESC LIMIT 1) a ON true
 WHERE t.state = 'FAILED';
