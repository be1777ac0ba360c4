-- spindle schema, version 21: whether the cluster relays its events, as the nodes say.
--
-- Whether events are relayed was each node's `[events]` alone: a node without it pruned
-- undelivered events after `retention_events_s`, and ended tasks without waiting for their end
-- events, while another node's relay still had them to send — given a cluster whose nodes were
-- configured differently (a rolling change of the configuration is one), events were lost.
-- Each node now records at its start whether it relays; a node's retention acts as a relaying
-- one while any node that relays has been heard from within the events' window.
--
-- A column with a constant default is added without rewriting the table.

ALTER TABLE node ADD COLUMN relays_events boolean NOT NULL DEFAULT false;
