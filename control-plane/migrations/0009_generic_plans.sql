-- spindle schema, version 9: the batch functions plan their statements once per session.
--
-- PL/pgSQL caches a plan for each statement of a function, but under the default
-- `plan_cache_mode = auto` it builds a custom plan for the parameters of every call until a
-- generic plan looks no more expensive; for statements over the batch's array arguments it
-- kept planning anew. `perf` on the backends at 5,000 tasks/s: 12.7 % of PostgreSQL's CPU in
-- GetCachedPlan, 9.5 % of it in the planner itself. With a generic plan the planner is gone from
-- the profile (GetCachedPlan 1.2 %) and the plans are the ones the custom planning chose: every
-- join of a batch against a table stays a nested loop over index probes (the functions run
-- with seq scans off; `spindle_claim` also with merge and hash joins off, see version 7), and
-- each statement's time per call is unchanged (docs/benchmarks.md, sixth round).
--
-- Only the functions every batch runs: the row-by-row fallbacks (`spindle_submit_checked`,
-- `spindle_claim_checked`) run rarely and keep planning per call.

ALTER FUNCTION spindle_submit(bigint[], integer[], integer[], text[], bytea[], integer[],
                              smallint[], smallint[], bigint[], bigint[], bigint)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION spindle_claim(text, bigint, bigint[], integer[], text[], integer[], integer[],
                             text[], smallint[], bigint[], text[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION spindle_report(bigint[], bigint[], text[], text[], bigint[], bigint[], text[],
                              text[])
    SET plan_cache_mode = force_generic_plan;
