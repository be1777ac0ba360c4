//! Spreading periodic work (polls, reconciler passes) so that nodes and tasks do not move in
//! step.

/// A jitter factor in 0.7..=1.3 (milli), from a cheap per-call hash: spreading polls needs no
/// more randomness than that.
pub fn jitter_milli(seed: u64) -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    700 + x % 601
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_in_its_band_and_varies() {
        let all: Vec<u64> = (0..10_000).map(jitter_milli).collect();
        assert!(all.iter().all(|j| (700..=1300).contains(j)));
        assert!(all.iter().any(|&j| j < 800) && all.iter().any(|&j| j > 1200));
    }
}
