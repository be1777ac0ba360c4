-- spindle schema, version 21: what a cluster's nodes share beyond partitions — whether the
-- cluster relays its events, and its rates divided by backlogged weight.
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

-- A cluster's rates (a provider account's RPM, the platform's cost per minute) were divided
-- evenly among the live nodes: a node whose tenants waited could use no more than 1/N of an
-- account's RPM while the others' parts went unused. Each node now publishes per rate the
-- backlogged weight that wants it and takes its part, in millionths of the rate, by the split
-- rule the shards use, within what the other live nodes leave (`rate_parts.rs`); a lowered part
-- still counts for the others until `lowered_until`.
CREATE TABLE node_rate_part (
    rate text NOT NULL CHECK (length(rate) BETWEEN 1 AND 256),
    node_id text NOT NULL,
    weight bigint NOT NULL DEFAULT 0 CHECK (weight >= 0),
    part_ppm integer NOT NULL DEFAULT 0 CHECK (part_ppm BETWEEN 0 AND 1000000),
    lowered_from_ppm integer CHECK (lowered_from_ppm BETWEEN 0 AND 1000000),
    lowered_until timestamptz,
    PRIMARY KEY (rate, node_id)
);
