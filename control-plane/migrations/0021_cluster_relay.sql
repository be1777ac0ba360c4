-- spindle schema, version 21: whether the cluster relays its events, as the nodes say.
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
