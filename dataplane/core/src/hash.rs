//! A fast, deterministic hasher for the core's integer ids (Fx-style multiply). Ids are not
//! attacker-chosen inside the core (the shell maps external names to dense ids), so DoS-resistant
//! hashing buys nothing here and costs a third of a pick.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(SEED);
        }
    }

    // Derived `Hash` impls write small integers one at a time; without these they would go
    // through `write` byte by byte.
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_u16(&mut self, n: u16) {
        self.write_u64(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(SEED);
    }
}

pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// The hasher of the task index. Task ids come in increasing runs (the control plane hands out
/// blocks), and a table of 100k tasks does not fit in L2, so a hash that scatters consecutive
/// ids makes every insert miss twice (a control byte and a bucket line). This one keeps runs of
/// 16 consecutive ids in 16 consecutive buckets — hashbrown takes the bucket from the low bits
/// and the 7-bit tag from the top ones — and scatters the runs themselves, so a stride in the
/// ids (every 16th, every 1024th) spreads over the table instead of piling into a few buckets.
/// Only the speed depends on that layout, never a lookup's answer. The shard's tenant and user
/// maps use it too: ids handed out in sequence are looked up in sequence.
#[derive(Debug, Default, Clone, Copy)]
pub struct RunHasher(u64);

impl Hasher for RunHasher {
    fn finish(&self) -> u64 {
        let run = (self.0 >> 4).wrapping_mul(SEED);
        let place = self.0 & 15;
        // The mixed run from bit 4 up, the id's place within its run in bits 0–3 — and in the
        // tag as well: the 16 ids of a run share a group of buckets, and with one tag between
        // them every probe in that group compared the key of each (16 candidates, not 1).
        (run.rotate_left(32) << 4) ^ (run & (0x7F << 57)) ^ place ^ (place << 57)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    // Narrower ids (tenants, users) are the same number: without these they would go through
    // `write` in native byte order, which on a little-endian machine reverses them.
    fn write_u16(&mut self, n: u16) {
        self.0 = u64::from(n);
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub type RunMap<K, V> = HashMap<K, V, BuildHasherDefault<RunHasher>>;
pub type RunSet<K> = std::collections::HashSet<K, BuildHasherDefault<RunHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    fn hash(id: u64) -> u64 {
        BuildHasherDefault::<RunHasher>::default().hash_one(id)
    }

    #[test]
    fn consecutive_ids_share_a_run_and_strides_spread() {
        let mask = (1u64 << 17) - 1;
        // A run of 16 lands in 16 consecutive buckets.
        let base = hash(4096) & mask;
        for i in 0..16 {
            assert_eq!(hash(4096 + i) & mask, (base ^ i) & mask);
        }
        // Ids 1,024 apart fill distinct buckets (no pile-up) and carry varied tags.
        let mut buckets: Vec<u64> = (0..4096).map(|i| (hash(i * 1024) & mask) >> 4).collect();
        buckets.sort_unstable();
        buckets.dedup();
        assert!(
            buckets.len() > 4096 * 9 / 10,
            "{} distinct runs",
            buckets.len()
        );
        let mut tags: Vec<u64> = (0..4096).map(|i| hash(i) >> 57).collect();
        tags.sort_unstable();
        tags.dedup();
        assert!(tags.len() > 100, "{} distinct tags", tags.len());
        // The ids of one run carry 16 distinct tags: a probe in their group matches one key.
        for start in [0, 4096, 1 << 40] {
            let mut run: Vec<u64> = (start..start + 16).map(|i| hash(i) >> 57).collect();
            run.sort_unstable();
            run.dedup();
            assert_eq!(run.len(), 16, "tags of the run from {start}");
        }
    }

    #[test]
    fn narrow_ids_hash_as_their_value() {
        let build = BuildHasherDefault::<RunHasher>::default();
        for id in [0u32, 1, 17, 4096, u32::MAX] {
            assert_eq!(build.hash_one(id), hash(u64::from(id)));
            assert_eq!(build.hash_one(crate::TenantId(id)), hash(u64::from(id)));
        }
        assert_eq!(build.hash_one(300u16), hash(300));
    }
}
