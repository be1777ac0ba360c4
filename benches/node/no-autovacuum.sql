-- For `benches/node/run RATE BATCH benches/node/no-autovacuum.sql`: the hot tables with
-- autovacuum off, as on a server whose vacuum lags far behind (docs/benchmarks/journal.md, "vacuum").
ALTER TABLE task SET (autovacuum_enabled = off, toast.autovacuum_enabled = off);
ALTER TABLE outbox_batch SET (autovacuum_enabled = off, toast.autovacuum_enabled = off);
ALTER TABLE attempt_history SET (autovacuum_enabled = off);
ALTER TABLE resource_pool_shard SET (autovacuum_enabled = off);
ALTER TABLE partition_lease SET (autovacuum_enabled = off);
ALTER TABLE tenant_quota SET (autovacuum_enabled = off);
ALTER TABLE quota_ledger SET (autovacuum_enabled = off);
ALTER TABLE node SET (autovacuum_enabled = off);
