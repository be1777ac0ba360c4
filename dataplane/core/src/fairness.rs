//! Measuring what DRR promises: the service gap between backlogged tenants. Used by the DRR
//! bound tests and by the simulator's report; pure arithmetic over a stream of service events.

/// Tracks, for `k` tenants, the largest |ΔS_i − ΔS_j| over any interval, where S is the service a
/// tenant received normalized by its weight. Shreedhar & Varghese bound it by the largest task
/// plus two quanta.
#[derive(Debug, Clone)]
pub struct GapTracker {
    served: Vec<f64>,
    hi: Vec<f64>,
    lo: Vec<f64>,
}

impl GapTracker {
    pub fn new(tenants: usize) -> GapTracker {
        GapTracker {
            served: vec![0.0; tenants],
            hi: vec![0.0; tenants * tenants],
            lo: vec![0.0; tenants * tenants],
        }
    }

    /// Tenant `i` received `units / weight` more normalized service. O(k).
    pub fn serve(&mut self, i: usize, normalized_units: f64) {
        let k = self.served.len();
        self.served[i] += normalized_units;
        for j in 0..k {
            let d = self.served[i] - self.served[j];
            self.hi[i * k + j] = self.hi[i * k + j].max(d);
            self.lo[i * k + j] = self.lo[i * k + j].min(d);
            self.hi[j * k + i] = self.hi[j * k + i].max(-d);
            self.lo[j * k + i] = self.lo[j * k + i].min(-d);
        }
    }

    /// The largest pairwise drift over any interval so far.
    pub fn max_gap(&self) -> f64 {
        self.hi
            .iter()
            .zip(&self.lo)
            .map(|(h, l)| h - l)
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gap_is_the_largest_drift_over_any_interval() {
        let mut g = GapTracker::new(2);
        // A runs 3 ahead, then B catches up and runs 2 ahead: the worst interval saw 5.
        g.serve(0, 3.0);
        g.serve(1, 5.0);
        assert_eq!(g.max_gap(), 5.0);
        g.serve(0, 2.0);
        assert_eq!(g.max_gap(), 5.0);
    }
}
