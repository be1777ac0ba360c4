//! The split rule for node-wide limits (DESIGN §3 "Fairness across shards and nodes").
//!
//! DRR inside a shard is fair only among that shard's tenants, so a resource several shards share
//! is split among them in proportion to the summed weight of their *backlogged* tenants. A share
//! never drops below what a shard already holds (no pre-emption); what is free goes first to
//! shards below their target, and whatever is left flows to everyone by weight. The shares always
//! sum to at most the capacity, so the node can never exceed it.

/// One shard's input to a split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLoad {
    /// Units the shard holds now.
    pub used: u64,
    /// Summed weight of the shard's backlogged tenants for this resource.
    pub weight: u64,
}

/// Returns each shard's new capacity. Every share is ≥ its `used` (when the total allows), and
/// the shares sum to at most `capacity`.
pub fn split(capacity: u64, loads: &[ShardLoad]) -> Vec<u64> {
    let n = loads.len() as u128;
    if n == 0 {
        return Vec::new();
    }
    let used: u128 = loads.iter().map(|l| u128::from(l.used)).sum();
    let free = u128::from(capacity).saturating_sub(used);
    let total_weight: u128 = loads.iter().map(|l| u128::from(l.weight)).sum();
    // With no backlog anywhere, split what is free evenly so any shard can start.
    let weight = |l: &ShardLoad| {
        if total_weight == 0 {
            1
        } else {
            u128::from(l.weight)
        }
    };
    let weights: u128 = if total_weight == 0 { n } else { total_weight };

    let wants: Vec<u128> = loads
        .iter()
        .map(|l| {
            let target = u128::from(capacity) * weight(l) / weights;
            target.saturating_sub(u128::from(l.used))
        })
        .collect();
    let wanted: u128 = wants.iter().sum();
    let mut headroom: Vec<u128> = if wanted <= free {
        let leftover = free - wanted;
        loads
            .iter()
            .zip(&wants)
            .map(|(l, w)| w + leftover * weight(l) / weights)
            .collect()
    } else {
        wants.iter().map(|w| free * w / wanted).collect()
    };
    // Hand the rounding remainder out one unit at a time, heaviest (then lowest index) first, so
    // small capacities are not lost to integer division.
    let mut remainder = free - headroom.iter().sum::<u128>().min(free);
    let mut order: Vec<usize> = (0..loads.len())
        .filter(|&i| weight(&loads[i]) > 0)
        .collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(weight(&loads[i])), i));
    for &i in order.iter().cycle().take(order.len() * 2) {
        if remainder == 0 {
            break;
        }
        headroom[i] += 1;
        remainder -= 1;
    }
    loads
        .iter()
        .zip(headroom)
        .map(|(l, h)| u64::try_from(u128::from(l.used) + h).expect("share fits in u64"))
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn whale_alone_does_not_get_half() {
        // Shard 0: one whale of weight 1. Shard 1: a hundred tenants of weight 1.
        let shares = split(
            101,
            &[
                ShardLoad { used: 0, weight: 1 },
                ShardLoad {
                    used: 0,
                    weight: 100,
                },
            ],
        );
        assert_eq!(shares, vec![1, 100]);
    }

    #[test]
    fn held_units_are_never_taken_back() {
        let shares = split(
            10,
            &[
                ShardLoad { used: 8, weight: 1 },
                ShardLoad { used: 0, weight: 1 },
            ],
        );
        assert_eq!(shares, vec![8, 2]);
    }

    #[test]
    fn idle_node_splits_evenly() {
        let shares = split(9, &[ShardLoad { used: 0, weight: 0 }; 3]);
        assert_eq!(shares, vec![3, 3, 3]);
    }

    proptest! {
        #[test]
        fn shares_respect_capacity_and_holdings(
            capacity in 0u64..10_000,
            loads in prop::collection::vec((0u64..5_000, 0u64..50), 1..8),
        ) {
            let loads: Vec<ShardLoad> =
                loads.into_iter().map(|(used, weight)| ShardLoad { used, weight }).collect();
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
