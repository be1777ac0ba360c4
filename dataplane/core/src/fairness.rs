//! Measuring what DRR promises: the service gap between backlogged tenants. Used by the DRR
//! bound tests and by the simulator's report; pure arithmetic over a stream of service events.

/// Tracks, for `k` tenants, the largest |ΔS_i − ΔS_j| over any interval in which both `i` and
/// `j` were backlogged throughout, where S is the service a tenant received normalized by its
/// weight: the quantity Shreedhar & Varghese bound by the largest task plus two quanta. A
/// tenant is backlogged from [`GapTracker::new`] on until [`GapTracker::set_backlogged`] says
/// otherwise; service is counted when the tenant receives it (a dispatch that empties its
/// queue is served before it stops being backlogged).
#[derive(Debug, Clone)]
pub struct GapTracker {
    served: Vec<f64>,
    backlogged: Vec<bool>,
    /// Per ordered pair, the highest and lowest `S_i − S_j` since their joint interval began.
    hi: Vec<f64>,
    lo: Vec<f64>,
    /// The largest drift of any joint interval so far.
    worst: f64,
}

impl GapTracker {
    pub fn new(tenants: usize) -> GapTracker {
        GapTracker {
            served: vec![0.0; tenants],
            backlogged: vec![true; tenants],
            hi: vec![0.0; tenants * tenants],
            lo: vec![0.0; tenants * tenants],
            worst: 0.0,
        }
    }

    /// Tenant `i` received `units / weight` more normalized service. O(k).
    pub fn serve(&mut self, i: usize, normalized_units: f64) {
        self.served[i] += normalized_units;
        if !self.backlogged[i] {
            return;
        }
        let k = self.served.len();
        for j in (0..k).filter(|&j| j != i && self.backlogged[j]) {
            let d = self.served[i] - self.served[j];
            let (ij, ji) = (i * k + j, j * k + i);
            self.hi[ij] = self.hi[ij].max(d);
            self.lo[ij] = self.lo[ij].min(d);
            self.hi[ji] = self.hi[ji].max(-d);
            self.lo[ji] = self.lo[ji].min(-d);
            self.worst = self.worst.max(self.hi[ij] - self.lo[ij]);
        }
    }

    /// Tenant `i` has work waiting (`true`) or no longer (`false`). A joint interval of `i`
    /// and each other backlogged tenant starts, or ends, here. O(k).
    pub fn set_backlogged(&mut self, i: usize, backlogged: bool) {
        if self.backlogged[i] == backlogged {
            return;
        }
        self.backlogged[i] = backlogged;
        if backlogged {
            let k = self.served.len();
            for j in (0..k).filter(|&j| j != i && self.backlogged[j]) {
                let d = self.served[i] - self.served[j];
                let (ij, ji) = (i * k + j, j * k + i);
                (self.hi[ij], self.lo[ij]) = (d, d);
                (self.hi[ji], self.lo[ji]) = (-d, -d);
            }
        }
    }

    /// The largest pairwise drift over any joint interval so far.
    pub fn max_gap(&self) -> f64 {
        self.worst
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

    #[test]
    fn only_intervals_in_which_both_were_backlogged_count() {
        let mut g = GapTracker::new(2);
        // B idles while A is served 10: no joint interval, no gap.
        g.set_backlogged(1, false);
        g.serve(0, 10.0);
        assert_eq!(g.max_gap(), 0.0);
        // Both backlogged: A 3 ahead, then B 1 ahead — a drift of 4 within the interval.
        g.set_backlogged(1, true);
        g.serve(0, 3.0);
        g.serve(1, 4.0);
        assert_eq!(g.max_gap(), 4.0);
        // A idles: B served alone does not widen it; a new joint interval starts from there.
        g.set_backlogged(0, false);
        g.serve(1, 50.0);
        g.set_backlogged(0, true);
        g.serve(0, 2.0);
        assert_eq!(g.max_gap(), 4.0);
        g.serve(0, 3.0);
        assert_eq!(g.max_gap(), 5.0);
    }
}
