-- spindle schema, version 20: what a succeeded task produced.
--
-- A client learned that its task SUCCEEDED but not where the result was: the provider's video
-- URL lived in the node's memory, and the media stage's renditions were named after the
-- attempt's token, which no client sees. A task's result (a short JSON document: the
-- renditions' paths, or the provider's output URL where there is no media stage) is now stored
-- with it when its attempt finishes, fenced by that attempt's token, just before the finish
-- itself, and `GetTask` returns it.
--
-- A nullable column with no default is added without rewriting the table; no index holds it,
-- so the update that writes it is HOT.

ALTER TABLE task ADD COLUMN result text;
