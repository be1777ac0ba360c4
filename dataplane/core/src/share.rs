//! The split rule for node-wide limits (design.md §3 "Fairness across shards and nodes").
//!
//! DRR inside a shard is fair only among that shard's tenants, so a resource several shards share
//! is split among them in proportion to the summed weight of their *backlogged* tenants. A share
//! never drops below what a shard already holds (no pre-emption); what is free goes first to
//! shards below their target, and whatever is left flows to everyone by weight. The shares always
//! sum to at most the capacity, so the node can never exceed it.
//!
//! While some shards wait, a shard with nothing waiting keeps a standby part
//! ([`STANDBY_DIV`]): without one it held nothing between two splits, so its next task waited for
//! the next split even with the limit far from binding — and was then the backlogged shard that
//! took the others' parts at that split, which sent theirs waiting in turn (a see-saw: at 20
//! arrivals/s over two shards, p99 of submit → dispatch 66 ms in the simulator; one shard, 0).

/// One shard's input to a split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLoad {
    /// Units the shard holds now.
    pub used: u64,
    /// Summed weight of the shard's backlogged tenants for this resource.
    pub weight: u64,
    /// The shard's share from the previous split.
    pub share: u64,
    /// The shard's DRR virtual time for the resource: the base quantum times the rounds its
    /// lanes' rings began (a wrapping counter: only differences between two splits mean
    /// anything). A tenant backlogged throughout is served its weight times this, within DRR's
    /// bound. [`Lags`] reads it; the split itself does not.
    pub vtime: u64,
    /// How many of the shard's picks were refused for want of this limit (a wrapping counter):
    /// a shard refused since the last split competes for the capacity even if part of its
    /// share is free (a fragment smaller than its next task).
    pub refused: u64,
}

/// Weights are scaled by this before [`Lags::weigh`] corrects them, so a correction can be a
/// fraction of a tenant's weight.
pub const WEIGHT_SCALE: u64 = 1 << 10;

/// Stored lags stay within this many gains.
pub const LAG_CAP_GAINS: i64 = 2;

/// A node-wide virtual time over shards, kept per split limit by whoever splits it.
///
/// Inside a shard, DRR serves every backlogged tenant its weight times the shard's virtual time
/// ([`ShardLoad::vtime`]: the base quantum per round), within DRR's bound. So the node is as
/// fair as one shard exactly when every backlogged shard's virtual time advances at the same
/// pace, whatever its tenants' task sizes, run times or churn (a tenant served at once out of
/// its burst credit begins no round, so light tenants do not count). Weight alone does not give
/// that pace: a shard whose units turn over slowly (long tasks), whose tasks are large, or whose
/// light tenants take part of its share, serves less per unit of weight.
///
/// Each shard's *lag* is how far its virtual time is behind (+) or ahead of (−) the node's:
/// between two updates the shards that *compete* moved by `ΔV_i`; the node's moved by their
/// mean weighted by backlogged weight, `ΔV̄ = Σ W_i ΔV_i / Σ W_i`, and each competing shard's lag
/// by `ΔV̄ − ΔV_i`; lags are then centred on the competing shards (only differences mean
/// anything). A shard competes while backlogged and held back by the split: a pick of its was
/// refused for want of a node limit in the last [`REFUSED_MEMORY`] updates, or it leaves no part
/// of its share unused ([`SLACK_DIV`]). Otherwise its lag stands (its tenants wait on their own
/// limits, say: the split cannot help it, and more weight would only have it hold capacity it
/// cannot use); a shard that stops being backlogged forgets its lag, as DRR forgets a deficit.
///
/// The split then targets capacity by *corrected* weight ([`Lags::weigh`]):
/// `W'_i = W_i × (1 + lag_i / G)` within `[W_i / 2, 2 W_i]`, the gain `G` two base quanta
/// ([`lag_gain_milli`]). A shard a gain behind gets twice its weight's part of what is free; one
/// a gain ahead half (slowed, never stopped: a shard stopped until others caught up starved
/// tasks when the others were held back by something the split cannot see).
///
/// The bounds, next to DRR's (`L_max + 2Q` per unit of weight between two tenants backlogged in
/// one shard; `drr_bound` in the core's tests): a tenant's service as DRR charges it is its
/// weight times its shard's virtual time within that bound, so two tenants of two shards drift
/// apart by at most twice DRR's bound plus the two shards' lags — the feedback holds a lag near
/// `±G` while the shard competes, past which the correction is at its stop and the lag moves only
/// by what the shard starts out of headroom it already held. Stored lags are clamped to
/// `±LAG_CAP_GAINS × G`, so no shard banks an unbounded claim; [`Lags::peak`] reports the largest
/// lag an update found before clamping, and the simulator checks the node-wide gap against twice
/// DRR's bound plus twice it (plus the fairness debts both bounds carry when runs take other than
/// their estimates: `spindle_sim`'s `debt_allowance_units`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lags {
    /// Per shard: its virtual time at the last update.
    vtime: Vec<u64>,
    /// Per shard: its backlogged weight at the last update.
    weight: Vec<u64>,
    /// Per shard: its refusals at the last update, and the update that last saw them grow.
    refused: Vec<u64>,
    refused_at: Vec<u64>,
    /// Updates so far.
    updates: u64,
    /// Per shard: how far its virtual time is behind the node's (milli units per weight).
    lag: Vec<i64>,
    /// The largest |lag| any update found before clamping it (milli units per weight).
    peak: i64,
}

/// The gain a policy's splits use (milli units per weight): two base quanta, the part of DRR's
/// own bound that does not depend on task sizes.
pub fn lag_gain_milli(policy: &crate::Policy) -> u64 {
    2 * policy.drr.base_quantum.milli()
}

impl Lags {
    /// Each shard's lag now (milli units per weight; empty before the first update).
    pub fn lags(&self) -> &[i64] {
        &self.lag
    }

    /// The largest |lag| an update found so far, before clamping (milli units per weight): two
    /// tenants of two shards drift apart by at most twice DRR's bound plus twice this (see
    /// above).
    pub fn peak(&self) -> i64 {
        self.peak
    }

    /// Folds in the virtual times since the last update and returns the loads with their
    /// weights corrected by the lags and scaled by [`WEIGHT_SCALE`] (the split reads only ratios
    /// of weights, and zero as idle, which stays zero). `gain_milli` zero turns the correction
    /// off.
    pub fn weigh(&mut self, loads: &[ShardLoad], gain_milli: u64) -> Vec<ShardLoad> {
        if self.vtime.len() != loads.len() {
            self.vtime = loads.iter().map(|l| l.vtime).collect();
            self.weight = loads.iter().map(|l| l.weight).collect();
            self.refused = loads.iter().map(|l| l.refused).collect();
            // Nobody was refused before the first update.
            self.refused_at = vec![self.updates.wrapping_sub(REFUSED_MEMORY); loads.len()];
            self.lag = vec![0; loads.len()];
        } else {
            // Who competes for the capacity: backlogged over the interval, and held back by
            // it — a pick refused for want of it since the last update, or no part of its share
            // left unused. A shard whose tenants wait on their own limits leaves its share
            // unused and is refused nothing here: the split cannot help it, and owes it nothing.
            let competes: Vec<bool> = loads
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    let refused = l.refused != self.refused[i]
                        || self.updates.wrapping_sub(self.refused_at[i]) < REFUSED_MEMORY;
                    self.weight[i] > 0 && l.weight > 0 && (refused || !slack(l))
                })
                .collect();
            let delta: Vec<i128> = loads
                .iter()
                .zip(&self.vtime)
                .map(|(l, &last)| i128::from(l.vtime.wrapping_sub(last) as i64))
                .collect();
            let (mut moved, mut weight) = (0i128, 0i128);
            for i in (0..loads.len()).filter(|&i| competes[i]) {
                moved += i128::from(self.weight[i]) * delta[i];
                weight += i128::from(self.weight[i]);
            }
            let mut lags: Vec<i128> = (0..loads.len())
                .map(|i| {
                    let lag = i128::from(self.lag[i]);
                    if competes[i] {
                        lag + moved / weight - delta[i]
                    } else if loads[i].weight > 0 {
                        // Not held back now: its lag stands until it competes again.
                        lag
                    } else {
                        0
                    }
                })
                .collect();
            // Only lags relative to each other mean anything: centred on the competing shards'
            // weighted mean, so a shard that forgets its lag leaves no drift in the others'.
            let (mut sum, mut weight) = (0i128, 0i128);
            for i in (0..loads.len()).filter(|&i| competes[i]) {
                sum += lags[i] * i128::from(loads[i].weight);
                weight += i128::from(loads[i].weight);
            }
            let mean = if weight > 0 { sum / weight } else { 0 };
            self.updates = self.updates.wrapping_add(1);
            let cap = i128::from(LAG_CAP_GAINS) * i128::from(gain_milli);
            for (i, lag) in lags.iter_mut().enumerate() {
                if competes[i] {
                    *lag -= mean;
                }
                self.peak = self.peak.max(i64::try_from(lag.abs()).unwrap_or(i64::MAX));
                self.lag[i] = (*lag).clamp(-cap, cap) as i64;
                self.vtime[i] = loads[i].vtime;
                self.weight[i] = loads[i].weight;
                if loads[i].refused != self.refused[i] {
                    self.refused[i] = loads[i].refused;
                    self.refused_at[i] = self.updates;
                }
            }
        }
        loads
            .iter()
            .zip(&self.lag)
            .map(|(l, &lag)| {
                let w = i128::from(l.weight) * i128::from(WEIGHT_SCALE);
                let weight = if l.weight == 0 || gain_milli == 0 {
                    w
                } else {
                    // Never below half its weight: a shard ahead slows down, it does not stop
                    // (the others may be held back by something the split cannot see).
                    (w + w * i128::from(lag) / i128::from(gain_milli)).clamp(w / 2, 2 * w)
                };
                ShardLoad {
                    weight: u64::try_from(weight).unwrap_or(u64::MAX),
                    ..*l
                }
            })
            .collect()
    }
}

/// Whether a shard leaves part of its share unused ([`SLACK_DIV`]).
fn slack(l: &ShardLoad) -> bool {
    l.share - l.used.min(l.share) >= l.share.div_ceil(SLACK_DIV).max(1)
}

/// A shard leaves part of its share unused when at least `1 / SLACK_DIV` of it is free (less is
/// what a task larger than the rest leaves over).
pub const SLACK_DIV: u64 = 8;

/// Updates after its last refusal for which a shard still counts as held back by the split
/// (about a second of the node's 10 ms splits): refusals come once per time its share fills.
pub const REFUSED_MEMORY: u64 = 100;

/// A shard with nothing waiting, while others wait, keeps `1 / STANDBY_DIV` of an even part of a
/// node limit (slots or a rate): enough for its next arrivals to start at once, and at most
/// `(n − 1) / (n × STANDBY_DIV)` of the capacity kept from the backlogged shards while it is
/// idle. A capacity too small to leave an even part's sixteenth keeps none.
pub const STANDBY_DIV: u64 = 16;

/// How `capacity` is targeted over shards of `weights` (their backlogged weight): in proportion
/// to the weight, each idle shard's standby part first; evenly when nothing waits anywhere.
/// (Also how the limits a cluster shares are targeted over its nodes:
/// `spindle_control::cluster_shares`.)
pub fn targets(capacity: u128, weights: impl Iterator<Item = u64> + Clone) -> Vec<u128> {
    let n = weights.clone().count() as u128;
    let total: u128 = weights.clone().map(u128::from).sum();
    if total == 0 {
        return weights.map(|_| capacity / n).collect();
    }
    let standby = capacity / (n * u128::from(STANDBY_DIV));
    let idle = weights.clone().filter(|&w| w == 0).count() as u128;
    let shared = capacity - standby * idle;
    weights
        .map(|w| match w {
            0 => standby,
            w => shared * u128::from(w) / total,
        })
        .collect()
}

/// Returns each shard's new share. Every share is ≥ its `used`, and the shares sum to at most
/// `capacity` (when the holdings alone exceed it, to exactly the holdings: nothing is taken back).
///
/// A shard keeps its previous share up to its target (`capacity × weight / Σweight`, or the
/// standby part of an idle shard while others wait): headroom it has not used yet is saved, not
/// re-divided, so a shard whose next task is large can accumulate room for it. What remains goes
/// first to shards below their target, in proportion to how far below they are, then to every
/// backlogged shard by weight.
pub fn split(capacity: u64, loads: &[ShardLoad]) -> Vec<u64> {
    let n = loads.len() as u128;
    if n == 0 {
        return Vec::new();
    }
    let capacity = u128::from(capacity);
    let total_weight: u128 = loads.iter().map(|l| u128::from(l.weight)).sum();
    // With no backlog anywhere, split evenly so any shard can start.
    let weight = |l: &ShardLoad| {
        if total_weight == 0 {
            1
        } else {
            u128::from(l.weight)
        }
    };
    let weights: u128 = if total_weight == 0 { n } else { total_weight };
    let target = targets(capacity, loads.iter().map(|l| l.weight));

    let mut shares: Vec<u128> = loads
        .iter()
        .zip(&target)
        .map(|(l, &t)| {
            // Kept up to the target by a backlogged shard, and by an idle one while others wait.
            let kept = if total_weight > 0 {
                t.min(u128::from(l.share))
            } else {
                0
            };
            kept.max(u128::from(l.used))
        })
        .collect();
    if shares.iter().sum::<u128>() > capacity {
        // The previous shares do not fit a smaller capacity: keep only the holdings.
        shares = loads.iter().map(|l| u128::from(l.used)).collect();
    }
    let free = capacity.saturating_sub(shares.iter().sum());
    let wants: Vec<u128> = target
        .iter()
        .zip(&shares)
        .map(|(t, s)| t.saturating_sub(*s))
        .collect();
    let wanted: u128 = wants.iter().sum();
    if wanted >= free {
        for (share, want) in shares.iter_mut().zip(&wants) {
            *share += (free * want).checked_div(wanted).unwrap_or(0);
        }
    } else {
        let leftover = free - wanted;
        for ((share, want), l) in shares.iter_mut().zip(&wants).zip(loads) {
            *share += want + leftover * weight(l) / weights;
        }
    }
    // Hand the rounding remainder out one unit at a time, heaviest (then lowest index) first, so
    // small capacities are not lost to integer division.
    let mut remainder = capacity.saturating_sub(shares.iter().sum());
    let mut order: Vec<usize> = (0..loads.len())
        .filter(|&i| weight(&loads[i]) > 0)
        .collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(weight(&loads[i])), i));
    for &i in order.iter().cycle().take(order.len() * 2) {
        if remainder == 0 {
            break;
        }
        shares[i] += 1;
        remainder -= 1;
    }
    shares
        .into_iter()
        .map(|s| u64::try_from(s).expect("share fits in u64"))
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn load(used: u64, weight: u64, share: u64) -> ShardLoad {
        ShardLoad {
            used,
            weight,
            share,
            vtime: 0,
            refused: 0,
        }
    }

    #[test]
    fn whale_alone_does_not_get_half() {
        // Shard 0: one whale of weight 1. Shard 1: a hundred tenants of weight 1.
        let shares = split(101, &[load(0, 1, 0), load(0, 100, 0)]);
        assert_eq!(shares, vec![1, 100]);
    }

    #[test]
    fn held_units_are_never_taken_back() {
        let shares = split(10, &[load(8, 1, 8), load(0, 1, 0)]);
        assert_eq!(shares, vec![8, 2]);
    }

    #[test]
    fn idle_node_splits_evenly() {
        let shares = split(9, &[load(0, 0, 0); 3]);
        assert_eq!(shares, vec![3, 3, 3]);
    }

    #[test]
    fn unused_headroom_below_target_is_kept_for_a_large_task() {
        // Shard 0 holds 4 of its 6-unit target and waits for 2 more to start a large task; shard 1
        // keeps consuming. Its headroom is not re-divided, and freed units go to it first.
        let shares = split(12, &[load(4, 1, 5), load(6, 1, 7)]);
        assert_eq!(shares, vec![6, 6]);
        let shares = split(12, &[load(4, 1, 6), load(5, 1, 6)]);
        assert_eq!(shares, vec![6, 6]);
    }

    #[test]
    fn an_idle_shard_keeps_a_standby_part_while_others_wait() {
        // Shard 1 waits for nothing: it keeps 1/16 of an even part (320 / 2 / 16), so its next
        // task starts before the next split; the backlogged shard gets the rest.
        let shares = split(320, &[load(0, 1, 320), load(0, 0, 0)]);
        assert_eq!(shares, vec![310, 10]);
        // What it holds beyond the standby part stays held, and nothing more is added.
        let shares = split(320, &[load(0, 1, 300), load(15, 0, 20)]);
        assert_eq!(shares, vec![305, 15]);
        // A capacity too small for a sixteenth of an even part keeps no standby.
        let shares = split(8, &[load(0, 1, 8), load(0, 0, 0)]);
        assert_eq!(shares, vec![8, 0]);
    }

    #[test]
    fn with_nobody_waiting_the_standby_rule_does_not_apply() {
        assert_eq!(targets(320, [0u64, 0].into_iter()), vec![160, 160]);
        // Three shards: 320 / 3 / 16 = 6 for the idle one, the other 314 by weight.
        assert_eq!(targets(320, [3u64, 1, 0].into_iter()), vec![235, 78, 6]);
    }

    fn at(weight: u64, vtime: u64) -> ShardLoad {
        ShardLoad {
            used: 0,
            weight,
            share: 0,
            vtime,
            refused: 0,
        }
    }

    #[test]
    fn a_shard_whose_virtual_time_falls_behind_weighs_more_until_it_catches_up() {
        let gain = 4_000;
        let mut lags = Lags::default();
        // The first update only records where the virtual times stand.
        let w = lags.weigh(&[at(1, 0), at(3, 0)], gain);
        assert_eq!(weights(&w), vec![WEIGHT_SCALE, 3 * WEIGHT_SCALE]);
        // Shard 0 began one round of 2 units, shard 1 two: the node's pace is their weighted
        // mean (0.25 × 2 + 0.75 × 4 = 3.5); shard 0 is 1.5 behind, shard 1 0.5 ahead.
        let w = lags.weigh(&[at(1, 2_000), at(3, 4_000)], gain);
        assert_eq!(lags.lags(), &[1_500, -500]);
        // W' = W × (1 + lag / gain): 1 × 1.375 and 3 × 0.875.
        assert_eq!(weights(&w), vec![1_408, 2_688]);
        // It catches up (3 units against 1; the node's pace 1.5): both are level again, and
        // weigh by weight alone.
        let w = lags.weigh(&[at(1, 5_000), at(3, 5_000)], gain);
        assert_eq!(lags.lags(), &[0, 0]);
        assert_eq!(weights(&w), vec![WEIGHT_SCALE, 3 * WEIGHT_SCALE]);
    }

    #[test]
    fn lags_stop_at_twice_the_gain_and_the_correction_at_double_or_half() {
        let gain = 1_000;
        let mut lags = Lags::default();
        lags.weigh(&[at(1, 0), at(1, 0)], gain);
        let w = lags.weigh(&[at(1, 0), at(1, 100_000)], gain);
        assert_eq!(lags.lags(), &[2_000, -2_000]);
        // The one behind weighs twice its weight; the one ahead half its weight.
        assert_eq!(weights(&w), vec![2 * WEIGHT_SCALE, WEIGHT_SCALE / 2]);
        // Off, the weights are the backlogged weights (scaled), whatever the lags.
        let w = lags.weigh(&[at(1, 0), at(1, 100_000)], 0);
        assert_eq!(weights(&w), vec![WEIGHT_SCALE, WEIGHT_SCALE]);
    }

    #[test]
    fn a_shard_that_goes_idle_forgets_its_lag_and_leaves_no_drift() {
        let gain = 4_000;
        let mut lags = Lags::default();
        lags.weigh(&[at(1, 0), at(1, 0), at(1, 0)], gain);
        // Shard 2 makes no progress (its one tenant waits for capacity): it falls behind, and
        // the two others are ahead of the node's pace by as much between them.
        lags.weigh(&[at(1, 3_000), at(1, 3_000), at(1, 0)], gain);
        assert_eq!(lags.lags(), &[-1_000, -1_000, 2_000]);
        // It goes idle: its lag is forgotten, and the others' are centred again (level).
        let w = lags.weigh(&[at(1, 3_000), at(1, 3_000), at(0, 0)], gain);
        assert_eq!(lags.lags(), &[0, 0, 0]);
        assert_eq!(weights(&w), vec![WEIGHT_SCALE, WEIGHT_SCALE, 0]);
    }

    #[test]
    fn a_shard_its_tenants_own_limits_hold_back_is_owed_nothing() {
        let gain = 4_000;
        let mut lags = Lags::default();
        // Shard 0 leaves most of its share unused and is refused nothing (its tenants wait on
        // their own limits); shard 1 uses all of its share.
        let load = |used, share, refused, vtime| ShardLoad {
            used,
            weight: 1,
            share,
            vtime,
            refused,
        };
        lags.weigh(&[load(2, 10, 0, 0), load(10, 10, 0, 0)], gain);
        let w = lags.weigh(&[load(2, 10, 0, 0), load(10, 10, 0, 6_000)], gain);
        // Its virtual time stood still, but the split cannot help it: no lag, no extra weight
        // (which would only have it hold more capacity it cannot use).
        assert_eq!(lags.lags(), &[0, 0]);
        assert_eq!(weights(&w), vec![WEIGHT_SCALE, WEIGHT_SCALE]);
        // Once a pick of its is refused for want of the share, it competes: it is behind.
        lags.weigh(&[load(2, 10, 1, 0), load(10, 10, 0, 12_000)], gain);
        assert_eq!(lags.lags(), &[3_000, -3_000]);
        // And a shard ahead is slowed, never stopped: half its weight at the least.
        let w = lags.weigh(&[load(2, 10, 1, 0), load(10, 10, 0, 20_000)], gain);
        assert_eq!(weights(&w), vec![2 * WEIGHT_SCALE, WEIGHT_SCALE / 2]);
    }

    fn weights(loads: &[ShardLoad]) -> Vec<u64> {
        loads.iter().map(|l| l.weight).collect()
    }

    proptest! {
        /// Whatever the virtual times do: lags stay centred on the backlogged shards (their
        /// weighted sum is zero but for rounding), within the cap; an idle shard keeps weight
        /// zero and no lag; a backlogged one weighs between half and twice its weight.
        #[test]
        fn lags_stay_centred_capped_and_weights_in_range(
            steps in prop::collection::vec(
                prop::collection::vec((0u64..4, 0u64..20_000), 3), 1..20),
        ) {
            let gain = 4_000u64;
            let mut lags = Lags::default();
            let mut vtime = [0u64; 3];
            for step in steps {
                let loads: Vec<ShardLoad> = step
                    .iter()
                    .enumerate()
                    .map(|(i, &(w, dv))| {
                        vtime[i] = vtime[i].wrapping_add(dv);
                        at(w, vtime[i])
                    })
                    .collect();
                let weighed = lags.weigh(&loads, gain);
                let cap = LAG_CAP_GAINS * gain as i64;
                let mut sum = 0i128;
                for ((l, w), &lag) in loads.iter().zip(&weighed).zip(lags.lags()) {
                    prop_assert!(lag.abs() <= cap);
                    sum += i128::from(lag) * i128::from(l.weight);
                    if l.weight == 0 {
                        prop_assert_eq!(w.weight, 0);
                        prop_assert_eq!(lag, 0);
                    } else {
                        let full = l.weight * WEIGHT_SCALE;
                        prop_assert!(w.weight >= full / 2 && w.weight <= 2 * full);
                    }
                }
                // Clamping can leave them off-centre only when a lag hit the cap.
                if lags.lags().iter().all(|l| l.abs() < cap) {
                    let total: u64 = loads.iter().map(|l| l.weight).sum();
                    prop_assert!(sum.abs() <= i128::from(total), "sum {sum}");
                }
            }
        }

        #[test]
        fn shares_respect_capacity_and_holdings(
            capacity in 0u64..10_000,
            loads in prop::collection::vec((0u64..5_000, 0u64..50, 0u64..5_000), 1..8),
        ) {
            let loads: Vec<ShardLoad> = loads
                .into_iter()
                .map(|(used, weight, extra)| ShardLoad { used, weight, share: used + extra, vtime: 0, refused: 0 })
                .collect();
            let shares = split(capacity, &loads);
            let used: u64 = loads.iter().map(|l| l.used).sum();
            let total: u64 = shares.iter().sum();
            prop_assert!(total <= capacity.max(used));
            for (share, load) in shares.iter().zip(&loads) {
                prop_assert!(*share >= load.used);
            }
            if used <= capacity {
                // Nothing is wasted: everything free is handed out.
                prop_assert_eq!(total, capacity);
            }
        }
    }
}
