//! A cluster's rates — each provider account's RPM, the platform's cost per minute — divided
//! among its nodes by backlogged weight (DESIGN §3, "Fairness across shards and nodes"): a node
//! whose tenants wait gets the part the others do not need, an idle one keeps a standby part,
//! and the parts never add up to more than the whole.
//!
//! Each node, every second (or third of a lease, if shorter), publishes per rate the summed
//! weight of its backlogged tenants that want it and takes its part
//! ([`Db::allot_rate_parts`]), in millionths of the cluster's rate ([`WHOLE`]). One allotment runs at a time across the cluster (a
//! transaction-scoped advisory lock) and reads every node's row of the rates it allots. A node's
//! target is its share of the whole by the split rule the shards use
//! (`spindle_core::share::targets`) over the live nodes' weights; what it takes is its target, at
//! most what the other live nodes leave (the [`allot`] rule). So:
//!
//! - raising is only ever into room nobody holds: the node applies a larger part after the
//!   allotment committed;
//! - a lowered part is applied by its node after the commit too, so for [`LOWERED_GRACE_MS`]
//!   the others still count the part it had (`lowered_from_ppm`): that room frees only once the
//!   node surely runs at the lower rate;
//! - a node not heard from within a lease (its heartbeat) counts nothing: its partitions, and
//!   with them its claims, are another node's by then; a node that comes back takes at most what
//!   is left.
//!
//! The sum of the parts the live nodes may be running at therefore never exceeds the whole
//! (a property test drives the rule through random orders of allotments, weights and deaths).
//! Parts move toward their targets over a round or two: a node that needs more waits for the
//! others' next allotments to give it back. A node's first allotment before its first
//! request (at its start it holds nothing) — so a node that joins a busy cluster starts with
//! what is free, and its part grows as the others shrink theirs.

use crate::db::Db;
use crate::error::{check_batch_len, check_text, StoreError};

/// A whole rate, in parts per million.
pub const WHOLE: u32 = 1_000_000;

/// How long others still count the part a node had before it lowered it: its shards take the
/// lower part within milliseconds of the allotment's answer.
pub const LOWERED_GRACE_MS: i64 = 2_000;

/// The longest name of a rate (a limit's key, e.g. `provider:3:rpm`).
pub const RATE_NAME_BYTES_MAX: usize = 256;

/// The advisory lock key that keeps allotments one at a time ("spindle rates").
const ALLOT_LOCK: i64 = 0x5350_494e_5241_5445;

/// One node's row of one rate, as an allotment reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePart {
    /// The summed weight of its backlogged tenants that want the rate.
    pub weight: u64,
    /// Its part, in millionths.
    pub part: u32,
    /// The part it had before it last lowered it, while others must still count it (within
    /// [`LOWERED_GRACE_MS`] of the lowering).
    pub lowered_from: Option<u32>,
}

impl NodePart {
    /// What others must count for this node: the part it may still be running at.
    pub fn effective(&self) -> u32 {
        self.part.max(self.lowered_from.unwrap_or(0))
    }
}

/// What an allotment gives a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allotted {
    pub part: u32,
    /// Set when the allotment lowered the node's part: the part others count until the grace
    /// has passed.
    pub lowered_from: Option<u32>,
}

/// The allotment rule for the node `me` given the other live nodes' rows (`others`): its target
/// by the split rule over every live node's weight (its own first), at most the room the others'
/// effective parts leave. A lowering keeps the higher of the parts it had for the grace.
pub fn allot(me: NodePart, others: &[NodePart]) -> Allotted {
    let weights = std::iter::once(me.weight).chain(others.iter().map(|o| o.weight));
    let target = spindle_core::share::targets(u128::from(WHOLE), weights)[0];
    let target = u32::try_from(target).expect("a part of the whole");
    let held: u64 = others.iter().map(|o| u64::from(o.effective())).sum();
    let room = u64::from(WHOLE).saturating_sub(held) as u32;
    let part = target.min(room);
    let lowered_from = if part < me.part {
        Some(me.effective())
    } else {
        // Not lowered now: an earlier lowering's grace runs on, while it still says more.
        me.lowered_from.filter(|&from| from > part)
    };
    Allotted { part, lowered_from }
}

impl Db {
    /// Publishes `node`'s backlogged weight per rate (`wants`: the rate's name and the weight)
    /// and takes its part of each (in millionths, in the order of `wants`) by the [`allot`] rule
    /// over the nodes heard from within `live_ms` (see the module docs), and heartbeats `node`.
    /// One transaction, one at a time across the cluster.
    pub async fn allot_rate_parts(
        &mut self,
        node: &str,
        live_ms: u32,
        wants: &[(String, u64)],
    ) -> Result<Vec<u32>, StoreError> {
        check_text(0, "node", node, crate::limits::NAME_BYTES_MAX)?;
        check_batch_len(wants.len())?;
        for (row, (name, _)) in wants.iter().enumerate() {
            check_text(row, "rate", name, RATE_NAME_BYTES_MAX)?;
        }
        if wants.is_empty() {
            return Ok(Vec::new());
        }
        let names: Vec<&str> = wants.iter().map(|(n, _)| n.as_str()).collect();
        let weights: Vec<i64> = wants
            .iter()
            .map(|&(_, w)| i64::try_from(w).unwrap_or(i64::MAX))
            .collect();
        let deadline = self.within(6);
        deadline
            .run(true, async {
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
                    "INSERT INTO node_rate_part (rate, node_id, weight)
                     SELECT u.rate, $1, u.weight FROM unnest($2::text[], $3::bigint[]) AS u (rate, weight)
                     ON CONFLICT (rate, node_id) DO UPDATE SET weight = EXCLUDED.weight",
                    &[&node, &names, &weights],
                )
                .await?;
                // Every live node's row of these rates (this node's among them); a node's
                // lowered part only while its grace runs.
                let rows = tx
                    .query(
                        "SELECT r.rate, r.node_id, r.weight, r.part_ppm,
                                CASE WHEN r.lowered_until > now() THEN r.lowered_from_ppm END
                           FROM node_rate_part r JOIN node n ON n.node_id = r.node_id
                          WHERE r.rate = ANY ($2)
                            AND (r.node_id = $1
                                 OR (n.state <> 'DOWN'
                                     AND n.heartbeat_at > now() - $3::float8 * interval '1 millisecond'))",
                        &[&node, &names, &f64::from(live_ms)],
                    )
                    .await?;
                let mut mine = std::collections::HashMap::new();
                let mut others: std::collections::HashMap<&str, Vec<NodePart>> =
                    std::collections::HashMap::new();
                for r in &rows {
                    let part = NodePart {
                        weight: r.get::<_, i64>(2).max(0) as u64,
                        part: r.get::<_, i32>(3).clamp(0, WHOLE as i32) as u32,
                        lowered_from: r
                            .get::<_, Option<i32>>(4)
                            .map(|p| p.clamp(0, WHOLE as i32) as u32),
                    };
                    let rate: &str = r.get(0);
                    let name = names.iter().find(|n| **n == rate).copied().unwrap_or(rate);
                    if r.get::<_, &str>(1) == node {
                        mine.insert(name, part);
                    } else {
                        others.entry(name).or_default().push(part);
                    }
                }
                let allotted: Vec<Allotted> = names
                    .iter()
                    .map(|n| {
                        let me = mine.get(n).copied().unwrap_or(NodePart {
                            weight: 0,
                            part: 0,
                            lowered_from: None,
                        });
                        allot(me, others.get(n).map_or(&[], Vec::as_slice))
                    })
                    .collect();
                let parts: Vec<i32> = allotted.iter().map(|a| a.part as i32).collect();
                let lowered: Vec<Option<i32>> = allotted
                    .iter()
                    .map(|a| a.lowered_from.map(|p| p as i32))
                    .collect();
                let fresh: Vec<bool> = allotted
                    .iter()
                    .zip(&names)
                    .map(|(a, n)| a.part < mine.get(n).map_or(0, |m| m.part))
                    .collect();
                tx.execute(
                    &format!(
                        "UPDATE node_rate_part r
                            SET part_ppm = u.part, lowered_from_ppm = u.lowered,
                                lowered_until = CASE WHEN u.lowered IS NULL THEN NULL
                                                     WHEN u.fresh
                                                     THEN now() + {LOWERED_GRACE_MS} * interval '1 millisecond'
                                                     ELSE r.lowered_until END
                           FROM unnest($2::text[], $3::integer[], $4::integer[], $5::boolean[])
                                AS u (rate, part, lowered, fresh)
                          WHERE r.node_id = $1 AND r.rate = u.rate"
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

    fn node(weight: u64, part: u32) -> NodePart {
        NodePart {
            weight,
            part,
            lowered_from: None,
        }
    }

    #[test]
    fn a_lone_node_takes_the_whole() {
        assert_eq!(allot(node(0, 0), &[]).part, WHOLE);
        assert_eq!(allot(node(5, 0), &[]).part, WHOLE);
    }

    #[test]
    fn a_waiting_node_takes_what_idle_ones_leave_once_they_lowered() {
        // Two idle nodes hold a third each: the busy one gets only the free third now.
        let idle = node(0, WHOLE / 3);
        let busy = allot(node(10, WHOLE / 3), &[idle, idle]);
        assert_eq!(busy.part, WHOLE - 2 * (WHOLE / 3));
        // Each idle one lowers to its standby part, which others count only after the grace.
        let lowered = allot(idle, &[node(10, busy.part), idle]);
        let standby = WHOLE / 3 / 16;
        assert_eq!(lowered.part, standby);
        assert_eq!(lowered.lowered_from, Some(WHOLE / 3));
        let during = NodePart {
            weight: 0,
            part: lowered.part,
            lowered_from: lowered.lowered_from,
        };
        assert_eq!(
            allot(node(10, busy.part), &[during, during]).part,
            busy.part
        );
        // After the grace: the whole but the two standby parts.
        let after = node(0, standby);
        assert_eq!(
            allot(node(10, busy.part), &[after, after]).part,
            WHOLE - 2 * standby
        );
    }

    #[test]
    fn a_node_that_comes_back_takes_no_more_than_is_left() {
        // Its old part is no longer there for it: the other took the whole while it was gone.
        let back = allot(node(1, WHOLE / 2), &[node(1, WHOLE)]);
        assert_eq!(back.part, 0);
        assert_eq!(back.lowered_from, Some(WHOLE / 2));
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// Node `i` publishes `weight` and takes its part.
        Allot(usize, u64),
        /// The grace of every lowering passes.
        Grace,
        /// Node `i` dies (counts nothing) or comes back.
        Toggle(usize),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let step = prop_oneof![
            6 => (0..4usize, prop_oneof![Just(0u64), 1..1_000u64]).prop_map(|(i, w)| Step::Allot(i, w)),
            1 => Just(Step::Grace),
            1 => (0..4usize).prop_map(Step::Toggle),
        ];
        proptest::collection::vec(step, 1..80)
    }

    proptest! {
        /// Whatever the order of allotments, weights, graces and deaths: an allotment never
        /// takes the parts the live nodes may be running at (their effective parts) above the
        /// whole, and never adds to them when they already are above it — as they can be for a
        /// moment when a node counted dead comes back with its old part, which its next
        /// allotment gives up.
        #[test]
        fn an_allotment_never_takes_the_live_nodes_past_the_whole(steps in steps()) {
            let mut rows = [node(0, 0); 4];
            let mut live = [true; 4];
            let held = |rows: &[NodePart; 4], live: &[bool; 4]| -> u64 {
                (0..4).filter(|&j| live[j]).map(|j| u64::from(rows[j].effective())).sum()
            };
            for step in steps {
                match step {
                    Step::Allot(i, w) => {
                        if !live[i] {
                            continue;
                        }
                        let before = held(&rows, &live);
                        let me = NodePart { weight: w, ..rows[i] };
                        let others: Vec<NodePart> = (0..4)
                            .filter(|&j| j != i && live[j])
                            .map(|j| rows[j])
                            .collect();
                        let a = allot(me, &others);
                        rows[i] = NodePart { weight: w, part: a.part, lowered_from: a.lowered_from };
                        let after = held(&rows, &live);
                        prop_assert!(
                            after <= before.max(u64::from(WHOLE)),
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

        /// Without deaths, the live nodes' effective parts never add up to more than the
        /// whole, and with the weights standing still every node reaches its target within
        /// two rounds and a grace.
        #[test]
        fn parts_stay_within_the_whole_and_reach_their_targets(
            order in proptest::collection::vec(0..3usize, 1..40),
            weights in proptest::collection::vec(prop_oneof![Just(0u64), 1..1_000u64], 3),
        ) {
            let mut rows = [node(0, 0); 3];
            let round = |rows: &mut [NodePart; 3], i: usize| {
                let others: Vec<NodePart> = (0..3).filter(|&j| j != i).map(|j| rows[j]).collect();
                let a = allot(NodePart { weight: weights[i], ..rows[i] }, &others);
                rows[i] = NodePart { weight: weights[i], part: a.part, lowered_from: a.lowered_from };
            };
            for i in order {
                round(&mut rows, i);
                let held: u64 = rows.iter().map(|r| u64::from(r.effective())).sum();
                prop_assert!(held <= u64::from(WHOLE), "{rows:?}");
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
            let targets = spindle_core::share::targets(u128::from(WHOLE), weights.iter().copied());
            for i in 0..3 {
                prop_assert_eq!(u128::from(rows[i].part), targets[i], "{:?}", rows);
            }
        }
    }
}
