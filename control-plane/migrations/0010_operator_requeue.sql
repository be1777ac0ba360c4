-- spindle schema, version 10: an operator can put FAILED tasks back in their queue (DESIGN §5:
-- FAILED → QUEUED is the operator's move only).
--
-- A task's budget runs one cycle in `quota_ledger`: a RESERVE at submit, then one SETTLE or
-- REFUND when it ends, unique per (task, kind) so that a repeated report settles nothing twice.
-- A FAILED task's cycle is closed (reserved, then refunded). Requeueing it opens a new one: the
-- closed cycle's rows move to `quota_ledger_closed` (nothing is lost: the two tables are the
-- whole ledger), a new RESERVE is written and the tenant's reservation taken again — or the
-- requeue is refused when the budget no longer covers the estimate. The batch functions are
-- unchanged: the task's new end settles its new cycle as any end does.

CREATE TABLE quota_ledger_closed (
    entry_id      bigint NOT NULL,
    tenant_id     integer NOT NULL,
    task_id       bigint NOT NULL,
    kind          text NOT NULL,
    amount_milli  bigint NOT NULL,
    at            timestamptz NOT NULL,
    -- When the cycle was closed by a requeue, and by whom.
    closed_at     timestamptz NOT NULL DEFAULT now(),
    closed_by     text NOT NULL
);
CREATE INDEX quota_ledger_closed_task ON quota_ledger_closed (task_id);
