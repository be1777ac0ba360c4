//! The split rule for node-wide limits (DESIGN §3 "Fairness across shards and nodes").
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
}

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

    proptest! {
        #[test]
        fn shares_respect_capacity_and_holdings(
            capacity in 0u64..10_000,
            loads in prop::collection::vec((0u64..5_000, 0u64..50, 0u64..5_000), 1..8),
        ) {
            let loads: Vec<ShardLoad> = loads
                .into_iter()
                .map(|(used, weight, extra)| ShardLoad { used, weight, share: used + extra })
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
