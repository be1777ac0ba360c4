-- spindle schema, version 21: what a cluster's nodes share beyond partitions — whether the
-- cluster relays its events, and its limits divided by backlogged weight.
--
-- Whether events are relayed was each node's `[events]` alone: a node without it pruned
-- undelivered events after `retention_events_s`, and ended tasks without waiting for their end
-- events, while another node's relay still had them to send — given a cluster whose nodes were
-- configured differently (a rolling change of the configuration is one), events were lost.
-- Each node now records at its start whether it relays, and the backlog its relay allows
-- (`[events] pending_max`); while any node that relays has been heard from within the events'
-- window, every node's retention acts as a relaying one's, and a node without a relay refuses
-- new work past the smallest of those bounds as a relaying node does.
--
-- A nullable column without a default is added without rewriting the table.

ALTER TABLE node ADD COLUMN relay_pending_max bigint
    CHECK (relay_pending_max IS NULL OR relay_pending_max > 0);

COMMENT ON COLUMN node.relay_pending_max IS
    'The events this node''s relay lets wait before it refuses new work; NULL: it runs no relay';

-- What the nodes share of a provider account (its RPM and concurrency) and of the platform's
-- cost per minute was divided evenly (rates: 1/N each) or went to whichever node claimed first
-- (slots): a node whose tenants waited could use no more than 1/N of an account's RPM while
-- the others' parts went unused, and a node with a backlog took every slot that freed. Each
-- node now publishes per limit the backlogged weight that wants it and what it uses, and takes
-- its part (of a rate in millionths, of slots in slots) by the split rule the shards use,
-- within what the other live nodes leave (`cluster_shares.rs`); a lowered part still counts
-- for the others until `lowered_until`.
CREATE TABLE node_share (
    limit_key text NOT NULL CHECK (length(limit_key) BETWEEN 1 AND 256),
    node_id text NOT NULL,
    weight bigint NOT NULL DEFAULT 0 CHECK (weight >= 0),
    used bigint NOT NULL DEFAULT 0 CHECK (used >= 0),
    part bigint NOT NULL DEFAULT 0 CHECK (part >= 0),
    lowered_from bigint CHECK (lowered_from >= 0),
    lowered_until timestamptz,
    PRIMARY KEY (limit_key, node_id)
);
