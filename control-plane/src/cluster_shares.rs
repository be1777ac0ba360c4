//! What a cluster's nodes share beyond PostgreSQL's own counters — each provider account's RPM
//! and concurrency, the platform's cost per minute — divided among them by backlogged weight
//! (design.md §3, "Fairness across shards and nodes"): a node whose tenants wait gets the part the
//! others do not need, an idle one keeps a standby part, and the parts never add up to more than
//! the whole.
//!
//! Each node, every second (or third of a lease, if shorter), publishes per limit the summed
//! weight of its backlogged tenants that want it (and, for slots, how many it uses) and takes
//! its part ([`Db::allot_shares`]): of a rate in millionths ([`WHOLE`]), of slots in slots. One
//! allotment runs at a time across the cluster (a transaction-scoped advisory lock) and reads
//! every live node's row of the limits it allots. A node's target is its share of the whole by
//! the split rule the shards use (`spindle_core::share::targets`; the remainder of its rounding
//! one unit each to the heaviest nodes) over the live nodes' weights; what it takes is its
//! target, at most what the other live nodes leave (the [`allot`] rule). So:
//!
//! - raising is only ever into room nobody holds: the node applies a larger part after the
//!   allotment committed;
//! - a lowered part is applied by its node after the commit too, so for [`LOWERED_GRACE_MS`]
//!   the others still count the part it had (`lowered_from`): that room frees only once the
//!   node surely runs at the lower part;
//! - a slot in use is never counted free: others count the larger of a node's part and its
//!   used slots, and running work is never preempted — a node whose part fell below what it
//!   runs claims no more (its shards stop at their fair part of it) and comes down as its work
//!   ends;
//! - a node not heard from within a lease (its heartbeat) counts nothing: its partitions, and
//!   with them its claims, are another node's by then; a node that comes back takes at most what
//!   is left.
//!
//! The sum of the parts the live nodes may be running at therefore never exceeds the whole (a
//! property test drives the rule through random orders of allotments, weights, uses and
//! deaths). For slots this is fairness, not safety: an account's pool in PostgreSQL bounds its
//! concurrency exactly whatever the parts say. Parts move toward their targets over a round or
//! two: a node that needs more waits for the others' next allotments to give it back, and for
//! slots, for their work to end. A node's first allotment precedes its first request (at its
//! start it holds nothing) — so a node that joins a busy cluster starts with what is free.

use crate::db::{Call, Db};
use crate::error::{check_batch_len, check_text, StoreError};

/// A whole rate, in parts per million.
pub const WHOLE: u64 = 1_000_000;

/// How long others still count the part a node had before it lowered it: its shards take the
/// lower part within milliseconds of the allotment's answer.
pub const LOWERED_GRACE_MS: i64 = 2_000;

/// The longest name of a shared limit (a limit's key, e.g. `provider:3:rpm`).
pub const LIMIT_NAME_BYTES_MAX: usize = 256;

/// The advisory lock key that keeps allotments one at a time ("spindle shares").
const ALLOT_LOCK: i64 = 0x5350_494e_5348_4152;

/// One node's row of one shared limit, as an allotment reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodePart {
    /// The summed weight of its backlogged tenants that want the limit.
    pub weight: u64,
    /// What it uses of the limit now (slots; 0 for a rate, which nobody holds).
    pub used: u64,
    /// Its part.
    pub part: u64,
    /// The part it had before it last lowered it, while others must still count it (within
    /// [`LOWERED_GRACE_MS`] of the lowering).
    pub lowered_from: Option<u64>,
}

impl NodePart {
    /// What others must count for this node: what it may still be running at or holds.
    pub fn effective(&self) -> u64 {
        self.part.max(self.used).max(self.lowered_from.unwrap_or(0))
    }
}

/// What an allotment gives a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allotted {
    pub part: u64,
    /// Set while a lowering's grace runs: the part others count until it has passed.
    pub lowered_from: Option<u64>,
    /// This allotment lowered the part (its grace starts now).
    pub lowered_now: bool,
}

/// Every live node's target of `whole` by the split rule over their weights, the rounding's
/// remainder one unit each to the heaviest (the earliest among equals).
pub fn targets(whole: u64, weights: &[u64]) -> Vec<u64> {
    if weights.is_empty() {
        return Vec::new();
    }
    let mut t: Vec<u64> = spindle_core::share::targets(u128::from(whole), weights.iter().copied())
        .into_iter()
        .map(|t| u64::try_from(t).expect("a part of the whole"))
        .collect();
    let rest = whole.saturating_sub(t.iter().sum());
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(weights[i]), i));
    for &i in order.iter().cycle().take(rest as usize) {
        t[i] += 1;
    }
    t
}

/// The allotment rule for node `me` of the live nodes `nodes` (in one order every node uses:
/// by name) of a limit of `whole`: its [`targets`] share, at most the room the others'
/// effective parts leave (which count what they use). A rate's lowering (`graced`) keeps the
/// part it had for the grace; slots need none (what a node runs is its `used`, counted as it
/// is, and an account's pool in PostgreSQL bounds them exactly).
pub fn allot(whole: u64, nodes: &[NodePart], me: usize, graced: bool) -> Allotted {
    let weights: Vec<u64> = nodes.iter().map(|n| n.weight).collect();
    let target = targets(whole, &weights)[me];
    let held: u64 = nodes
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != me)
        .map(|(_, n)| n.effective())
        .sum();
    let room = whole.saturating_sub(held);
    let mine = nodes[me];
    // Below what it uses, for slots: it claims no more until its work has come down to it
    // (what it uses the others count anyway, as its effective part).
    let part = target.min(room);
    let lowered_now = graced && part < mine.part;
    let lowered_from = if !graced {
        None
    } else if lowered_now {
        Some(mine.part.max(mine.lowered_from.unwrap_or(0)))
    } else {
        // Not lowered now: an earlier lowering's grace runs on, while it still says more.
        mine.lowered_from.filter(|&from| from > part)
    };
    Allotted {
        part,
        lowered_from,
        lowered_now,
    }
}

/// One limit a node takes its part of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    /// The limit's name across the cluster.
    pub limit: String,
    /// Its whole: [`WHOLE`] for a rate, the slots for slots.
    pub whole: u64,
    /// A rate (a lowering is counted for a grace) rather than slots.
    pub rate: bool,
    /// The node's backlogged weight that wants it.
    pub weight: u64,
    /// What the node uses of it.
    pub used: u64,
}

impl Db {
    /// Publishes `node`'s weight and use per shared limit (`wants`) and takes its part of each
    /// (in the order of `wants`) by the [`allot`] rule over the nodes heard from within
    /// `live_ms` (see the module docs), and heartbeats `node`. One transaction, one at a time
    /// across the cluster.
    pub async fn allot_shares(
        &mut self,
        node: &str,
        live_ms: u32,
        wants: &[Want],
    ) -> Result<Vec<u64>, StoreError> {
        check_text(0, "node", node, crate::limits::NAME_BYTES_MAX)?;
        check_batch_len(wants.len())?;
        for (row, w) in wants.iter().enumerate() {
            check_text(row, "limit", &w.limit, LIMIT_NAME_BYTES_MAX)?;
        }
        if wants.is_empty() {
            return Ok(Vec::new());
        }
        let big = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let names: Vec<&str> = wants.iter().map(|w| w.limit.as_str()).collect();
        let weights: Vec<i64> = wants.iter().map(|w| big(w.weight)).collect();
        let used: Vec<i64> = wants.iter().map(|w| big(w.used)).collect();
        let deadline = self.within(6);
        deadline
            .run(Call::Writes, async {
                let tx = self.client_mut().transaction().await?;
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&ALLOT_LOCK])
                    .await?;
                // A node that allots is live: its heartbeat, so that no other node's allotment
                // counts it dead while it runs at its part.
                tx.execute(
                    "UPDATE node SET heartbeat_at = now() WHERE node_id = $1",
                    &[&node],
                )
                .await?;
                tx.execute(
                    "INSERT INTO node_share (limit_key, node_id, weight, used)
                     SELECT u.k, $1, u.w, u.used
                       FROM unnest($2::text[], $3::bigint[], $4::bigint[]) AS u (k, w, used)
                     ON CONFLICT (limit_key, node_id)
                     DO UPDATE SET weight = EXCLUDED.weight, used = EXCLUDED.used",
                    &[&node, &names, &weights, &used],
                )
                .await?;
                // Every live node's row of these limits (this node's among them), by name; a
                // lowered part only while its grace runs.
                let rows = tx
                    .query(
                        "SELECT s.limit_key, s.node_id, s.weight, s.used, s.part,
                                CASE WHEN s.lowered_until > now() THEN s.lowered_from END
                           FROM node_share s LEFT JOIN node n ON n.node_id = s.node_id
                          WHERE s.limit_key = ANY ($2)
                            AND (s.node_id = $1
                                 OR (n.state <> 'DOWN'
                                     AND n.heartbeat_at > now() - $3::float8 * interval '1 millisecond'))
                          ORDER BY s.limit_key, s.node_id",
                        &[&node, &names, &f64::from(live_ms)],
                    )
                    .await?;
                let mut by_limit: std::collections::HashMap<&str, (Vec<NodePart>, Option<usize>)> =
                    std::collections::HashMap::new();
                for r in &rows {
                    let entry = by_limit.entry(r.get(0)).or_default();
                    if r.get::<_, &str>(1) == node {
                        entry.1 = Some(entry.0.len());
                    }
                    let unsigned = |v: i64| v.max(0) as u64;
                    entry.0.push(NodePart {
                        weight: unsigned(r.get(2)),
                        used: unsigned(r.get(3)),
                        part: unsigned(r.get(4)),
                        lowered_from: r.get::<_, Option<i64>>(5).map(unsigned),
                    });
                }
                let mut allotted: Vec<Allotted> = Vec::with_capacity(wants.len());
                for w in wants {
                    // This node's row was written above, in this transaction.
                    let Some((nodes, Some(me))) = by_limit.get(w.limit.as_str()) else {
                        return Err(StoreError::Unavailable(format!(
                            "the share of {} written for node {node} was not read back",
                            w.limit
                        )));
                    };
                    allotted.push(allot(w.whole, nodes, *me, w.rate));
                }
                let parts: Vec<i64> = allotted.iter().map(|a| big(a.part)).collect();
                let lowered: Vec<Option<i64>> =
                    allotted.iter().map(|a| a.lowered_from.map(big)).collect();
                let fresh: Vec<bool> = allotted.iter().map(|a| a.lowered_now).collect();
                tx.execute(
                    &format!(
                        "UPDATE node_share s
                            SET part = u.part, lowered_from = u.lowered,
                                lowered_until = CASE WHEN u.lowered IS NULL THEN NULL
                                                     WHEN u.fresh
                                                     THEN now() + {LOWERED_GRACE_MS} * interval '1 millisecond'
                                                     ELSE s.lowered_until END
                           FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::boolean[])
                                AS u (k, part, lowered, fresh)
                          WHERE s.node_id = $1 AND s.limit_key = u.k"
                    ),
                    &[&node, &names, &parts, &lowered, &fresh],
                )
                .await?;
                tx.commit().await?;
                Ok(allotted.iter().map(|a| a.part).collect())
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(weight: u64, part: u64) -> NodePart {
        NodePart {
            weight,
            part,
            ..NodePart::default()
        }
    }

    #[test]
    fn a_lone_node_takes_the_whole() {
        assert_eq!(allot(WHOLE, &[node(0, 0)], 0, true).part, WHOLE);
        assert_eq!(allot(3, &[node(5, 0)], 0, false).part, 3);
    }

    #[test]
    fn the_rounding_remainder_goes_to_the_heaviest() {
        assert_eq!(targets(3, &[1, 1]), vec![2, 1]);
        assert_eq!(targets(3, &[1, 2]), vec![1, 2]);
        assert_eq!(targets(4, &[0, 0, 0]), vec![2, 1, 1]);
        assert_eq!(targets(WHOLE, &[1, 1, 1]).iter().sum::<u64>(), WHOLE);
    }

    #[test]
    fn a_waiting_node_takes_what_idle_ones_leave_once_they_lowered() {
        let third = WHOLE / 3;
        // Two idle nodes hold a third each: the busy one gets only the free third now.
        let idle = node(0, third);
        let busy = allot(WHOLE, &[node(10, third), idle, idle], 0, true);
        assert_eq!(busy.part, WHOLE - 2 * third);
        // Each idle one lowers to its standby part, which others count only after the grace.
        let lowered = allot(WHOLE, &[node(10, busy.part), idle, idle], 1, true);
        let standby = WHOLE / 3 / 16;
        assert_eq!(lowered.part, standby);
        assert_eq!(lowered.lowered_from, Some(third));
        let during = NodePart {
            part: lowered.part,
            lowered_from: lowered.lowered_from,
            ..NodePart::default()
        };
        assert_eq!(
            allot(WHOLE, &[node(10, busy.part), during, during], 0, true).part,
            busy.part
        );
        // After the grace: the whole but the two standby parts.
        let after = node(0, standby);
        assert_eq!(
            allot(WHOLE, &[node(10, busy.part), after, after], 0, true).part,
            WHOLE - 2 * standby
        );
    }

    #[test]
    fn a_slot_in_use_is_never_given_away() {
        // 4 slots, all used by a node that now has a peer with equal weight: its part falls to
        // its half at once (it claims no more), but what it runs still counts, so the peer gets
        // nothing yet — and each slot its work frees goes to the peer.
        let first = NodePart {
            weight: 1,
            used: 4,
            part: 4,
            lowered_from: None,
        };
        let peer = node(1, 0);
        let down = allot(4, &[first, peer], 0, false);
        assert_eq!((down.part, down.lowered_from), (2, None));
        let first = NodePart { part: 2, ..first };
        assert_eq!(first.effective(), 4);
        assert_eq!(allot(4, &[first, peer], 1, false).part, 0);
        let freed = NodePart { used: 3, ..first };
        assert_eq!(allot(4, &[freed, peer], 1, false).part, 1);
        let freed = NodePart { used: 2, ..first };
        assert_eq!(allot(4, &[freed, peer], 1, false).part, 2);
    }

    #[test]
    fn a_node_that_comes_back_takes_no_more_than_is_left() {
        // Its old part is no longer there for it: the other took the whole while it was gone.
        let back = allot(WHOLE, &[node(1, WHOLE / 2), node(1, WHOLE)], 0, true);
        assert_eq!(back.part, 0);
        assert_eq!(back.lowered_from, Some(WHOLE / 2));
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// Node `i` publishes `weight`, uses `used` of what it holds, and takes its part.
        Allot(usize, u64, u64),
        /// The grace of every lowering passes.
        Grace,
        /// Node `i` dies (counts nothing) or comes back.
        Toggle(usize),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let weight = prop_oneof![Just(0u64), 1..1_000u64];
        let step = prop_oneof![
            6 => (0..4usize, weight, 0..100u64).prop_map(|(i, w, u)| Step::Allot(i, w, u)),
            1 => Just(Step::Grace),
            1 => (0..4usize).prop_map(Step::Toggle),
        ];
        proptest::collection::vec(step, 1..80)
    }

    proptest! {
        /// Whatever the order of allotments, weights, uses, graces and deaths, of slots (a
        /// small whole) or a rate: an allotment never takes the parts the live nodes may be
        /// running at or hold (their effective parts) above the whole, and never adds to them
        /// when they already are above it — as they can be for a moment when a node counted
        /// dead comes back with its old part, which its next allotment gives up. A node's use
        /// grows only up to its part (its shards claim no further) and may stay above a part
        /// that fell, until its work ends.
        #[test]
        fn an_allotment_never_takes_the_live_nodes_past_the_whole(
            steps in steps(),
            whole in prop_oneof![1..12u64, Just(WHOLE)],
        ) {
            let mut rows = [NodePart::default(); 4];
            let mut live = [true; 4];
            let held = |rows: &[NodePart; 4], live: &[bool; 4]| -> u64 {
                (0..4).filter(|&j| live[j]).map(|j| rows[j].effective()).sum()
            };
            for step in steps {
                match step {
                    Step::Allot(i, w, u) => {
                        if !live[i] {
                            continue;
                        }
                        let before = held(&rows, &live);
                        // A rate has no use; slots grow only up to the part they had.
                        let used = if whole == WHOLE {
                            0
                        } else {
                            u.min(rows[i].part.max(rows[i].used))
                        };
                        rows[i].weight = w;
                        rows[i].used = used;
                        let alive: Vec<usize> = (0..4).filter(|&j| live[j]).collect();
                        let nodes: Vec<NodePart> = alive.iter().map(|&j| rows[j]).collect();
                        let me = alive.iter().position(|&j| j == i).expect("live");
                        let a = allot(whole, &nodes, me, whole == WHOLE);
                        rows[i].part = a.part;
                        rows[i].lowered_from = a.lowered_from;
                        let after = held(&rows, &live);
                        prop_assert!(
                            after <= before.max(whole),
                            "{before} -> {after}: {rows:?} {live:?}"
                        );
                    }
                    Step::Grace => {
                        for r in &mut rows {
                            r.lowered_from = None;
                        }
                    }
                    Step::Toggle(i) => live[i] = !live[i],
                }
            }
        }

        /// Without deaths or use, the live nodes' effective parts never add up to more than
        /// the whole, and with the weights standing still every node reaches its target within
        /// two rounds and a grace.
        #[test]
        fn parts_stay_within_the_whole_and_reach_their_targets(
            order in proptest::collection::vec(0..3usize, 1..40),
            weights in proptest::collection::vec(prop_oneof![Just(0u64), 1..1_000u64], 3),
            whole in prop_oneof![1..12u64, Just(WHOLE)],
        ) {
            let mut rows = [NodePart::default(); 3];
            let round = |rows: &mut [NodePart; 3], i: usize| {
                let mut nodes = *rows;
                nodes[i].weight = weights[i];
                let a = allot(whole, &nodes, i, whole == WHOLE);
                rows[i] = NodePart {
                    weight: weights[i],
                    used: 0,
                    part: a.part,
                    lowered_from: a.lowered_from,
                };
            };
            for i in order {
                round(&mut rows, i);
                let held: u64 = rows.iter().map(NodePart::effective).sum();
                prop_assert!(held <= whole, "{rows:?}");
            }
            for _ in 0..2 {
                for i in 0..3 {
                    round(&mut rows, i);
                }
                for r in &mut rows {
                    r.lowered_from = None;
                }
            }
            for i in 0..3 {
                round(&mut rows, i);
            }
            let targets = targets(whole, &weights);
            for i in 0..3 {
                prop_assert_eq!(rows[i].part, targets[i], "{:?}", rows);
            }
        }
    }
}
