-- Gives the bench's two tenants budgets in PostgreSQL (large enough never to refuse), so that
-- every submit reserves and every end settles or refunds, as for paying tenants:
--   benches/node/run RATE 64 benches/node/budgets.sql
INSERT INTO tenant_quota (tenant_id, budget_milli) VALUES (1, 1000000000000), (2, 1000000000000);
