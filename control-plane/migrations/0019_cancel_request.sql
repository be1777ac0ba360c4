-- spindle schema, version 19: a cancel is stored before it is answered.
--
-- A node answered a cancel from its memory and stored it only when the task's step ended (at
-- once for a queued task, with the provider's end for one at the provider stage). A node that
-- died in between lost it: the next owner put the task back and ran it on, though its client
-- had been told "canceled". Now the node marks the task first and answers once that commit
-- returns; a node putting tasks back (at start or at a takeover) cancels the marked ones: a
-- queued one ends CANCELED at once, a live attempt's job is canceled at the provider when it
-- is found and the task ends CANCELED with the job's end.
--
-- A column with a constant default is added without rewriting the table. It is written once per
-- canceled task and read only when tasks are put back, and no index holds it, so updates of the
-- task row stay HOT.

ALTER TABLE task ADD COLUMN cancel_requested boolean NOT NULL DEFAULT false;
