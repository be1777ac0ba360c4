//! The board of node-wide limits every shard of a node shares (`spindle_sync::ShareBoard`),
//! built from the policy before the shards start; the control plane keeps the cluster's
//! shares of it ([`spindle_node_base::ownership::Ownership::share`]).

use spindle_core::shard::{NodeCapacity, Shard};
use spindle_core::{Policy, Time};
use spindle_sync::ShareBoard;

/// The board every shard of a node shares: one entry per node limit (any may become binding by
/// a policy change), in the order
/// the core lists them (every shard's core lists the same limits under the same ids), with the
/// limits' names in that order (for `/metrics`) — and, after them, room for the limits of
/// provider accounts and models added while the node runs (`live_policy::ROOM_LIMITS`, empty
/// until then).
pub fn split_board(policy: &Policy, shards: u32) -> SplitBoard {
    let probe = Shard::new(policy.clone(), shards, Time::ZERO);
    let limits = probe.node_limits();
    let capacities: Vec<u64> = limits
        .iter()
        .map(|(_, c)| c.units())
        .chain(std::iter::repeat_n(0, crate::live_policy::ROOM_LIMITS))
        .collect();
    let names: Vec<String> = limits
        .iter()
        .map(|&(id, _)| probe.ledger().key(id).to_string())
        .collect();
    let shared = limits
        .iter()
        .enumerate()
        .filter_map(|(k, &(id, capacity))| shared_limit(k, probe.ledger().key(id), capacity))
        .collect();
    SplitBoard {
        board: ShareBoard::new(&capacities, shards as usize),
        names,
        shared,
    }
}

/// [`split_board`]'s answer.
pub struct SplitBoard {
    pub board: ShareBoard,
    /// Every node limit's name, in board order.
    pub names: Vec<String>,
    /// The limits among them the node shares with the cluster's other nodes, of which it runs
    /// its part ([`spindle_node_base::ownership::Ownership::share`]).
    pub shared: Vec<spindle_node_base::ownership::SharedLimit>,
}

/// Node limit `key` at board place `k` as the cluster shares it: a provider account's RPM and
/// concurrency, the platform's cost per minute (design.md §3: divided among nodes by backlogged
/// weight); `None` for a limit each node has to itself.
pub fn shared_limit(
    k: usize,
    key: spindle_core::ledger::LimitKey,
    capacity: NodeCapacity,
) -> Option<spindle_node_base::ownership::SharedLimit> {
    use spindle_core::ledger::LimitKey;
    matches!(
        key,
        LimitKey::ProviderRpm(_)
            | LimitKey::ProviderConcurrency(_)
            | LimitKey::PlatformCostPerMinute
    )
    .then(|| spindle_node_base::ownership::SharedLimit {
        place: k,
        name: key.to_string(),
        rate: matches!(capacity, NodeCapacity::Rate(_)),
    })
}
