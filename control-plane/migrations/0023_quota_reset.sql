-- Periodic quotas are counted by the node that serves a tenant, from the rows (the tasks it puts
-- back, and what ended ones consumed in the periods still running). An operator's reset of a
-- tenant's counts is a floor: nothing submitted before it counts again, on this node or on the
-- next one to serve the tenant.
CREATE TABLE quota_reset (
    tenant_id  integer PRIMARY KEY,
    reset_at   timestamptz NOT NULL
);
