-- spindle schema, version 13: a queued task that cannot be served any more fails.
--
-- A node rebuilding its queues (at start, or taking over a partition) puts every QUEUED task
-- back into its shard's core. Some cannot go back: the stored request is unreadable, its
-- tenant or model left the policy, its spec no longer passes the model's bounds, its
-- attempts are used up. Until now such a task stopped the node at start (every other tenant
-- of the node with it), and at a takeover it stayed QUEUED, unserved and unanswered, while
-- its client kept waiting. Now the node fails it with the reason ("not restorable: …"): the
-- client sees FAILED and why, its budget reservation is refunded like any failure's, it shows
-- in `dead_letter`, and an operator who fixed the cause takes it back with the operator
-- retry (FAILED → QUEUED). The whitelist gains the one transition this needs.

INSERT INTO task_transition (from_state, to_state) VALUES ('QUEUED', 'FAILED');
