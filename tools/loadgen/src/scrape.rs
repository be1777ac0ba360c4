//! Reading the node's `/metrics`: its committed-success counter and its bucketed histograms
//! (for the latencies only the node sees, such as a task's submit to its dispatch).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A node's HTTP port: plain, or HTTPS where the node's `[tls]` is set.
#[derive(Clone)]
pub struct Endpoint {
    pub addr: SocketAddr,
    /// The roots its certificate chains to, and the name it must carry.
    pub tls: Option<(
        Arc<rustls::ClientConfig>,
        rustls::pki_types::ServerName<'static>,
    )>,
}

async fn get_metrics(mut stream: impl AsyncRead + AsyncWrite + Unpin) -> anyhow::Result<String> {
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: loadgen\r\nconnection: close\r\n\r\n")
        .await?;
    stream.flush().await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    Ok(text)
}

/// The node's whole `/metrics` text.
pub async fn metrics_text(at: &Endpoint) -> anyhow::Result<String> {
    let tcp = tokio::net::TcpStream::connect(at.addr).await?;
    match &at.tls {
        None => get_metrics(tcp).await,
        Some((config, name)) => {
            let tls = tokio_rustls::TlsConnector::from(config.clone())
                .connect(name.clone(), tcp)
                .await?;
            get_metrics(tls).await
        }
    }
}

/// `spindle_tasks_succeeded_total` from the node's `/metrics`.
pub async fn succeeded_total(at: &Endpoint) -> anyhow::Result<u64> {
    metrics_text(at)
        .await?
        .lines()
        .find_map(|l| l.strip_prefix("spindle_tasks_succeeded_total "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("{}/metrics has no spindle_tasks_succeeded_total", at.addr))
}

/// A Prometheus histogram's cumulative buckets: (upper bound in seconds, count), the last
/// bound infinite.
#[derive(Debug, Clone, PartialEq)]
pub struct Buckets(pub Vec<(f64, u64)>);

impl Buckets {
    /// The `name` histogram's buckets in `text` (every label set of it summed), if any.
    pub fn parse(text: &str, name: &str) -> Option<Buckets> {
        let prefix = format!("{name}_bucket{{");
        let mut out: Vec<(f64, u64)> = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(&prefix) else {
                continue;
            };
            let (labels, value) = rest.rsplit_once("} ")?;
            let le = labels.split(',').find_map(|l| l.strip_prefix("le=\""))?;
            let le = le.trim_end_matches('"');
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let count: u64 = value.trim().parse().ok()?;
            match out.iter_mut().find(|(b, _)| *b == bound) {
                Some((_, c)) => *c += count,
                None => out.push((bound, count)),
            }
        }
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        (!out.is_empty()).then_some(Buckets(out))
    }

    /// What was recorded between `before` and `self` (same bounds).
    pub fn since(&self, before: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|&(b, c)| {
                    let was = before.0.iter().find(|(bb, _)| *bb == b).map_or(0, |x| x.1);
                    (b, c.saturating_sub(was))
                })
                .collect(),
        )
    }

    pub fn count(&self) -> u64 {
        self.0.last().map_or(0, |x| x.1)
    }

    /// The `q` quantile in µs, interpolated linearly inside its bucket (as Prometheus'
    /// `histogram_quantile`); a quantile in the infinite bucket answers the last finite bound.
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = q * total as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for &(bound, count) in &self.0 {
            if count as f64 >= rank && count > below {
                if bound.is_infinite() {
                    return Some(lower * 1e6);
                }
                let share = (rank - below as f64) / (count - below) as f64;
                return Some((lower + (bound - lower) * share) * 1e6);
            }
            (lower, below) = (bound, count);
        }
        Some(lower * 1e6)
    }

    /// Whether the `q` quantile lies past the last finite bound (in the infinite bucket), where
    /// [`Buckets::quantile_us`] can only say "at least that bound".
    pub fn beyond_last_bound(&self, q: f64) -> bool {
        let total = self.count();
        let finite = self
            .0
            .iter()
            .rev()
            .find(|(b, _)| b.is_finite())
            .map_or(0, |x| x.1);
        total > 0 && (finite as f64) < q * total as f64
    }

    /// The share of samples at or below `bound_s` (a bucket bound).
    pub fn share_within(&self, bound_s: f64) -> Option<f64> {
        let total = self.count();
        let at = self.0.iter().find(|(b, _)| (*b - bound_s).abs() < 1e-12)?.1;
        (total > 0).then(|| at as f64 / total as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE h histogram
h_bucket{a=\"x\",le=\"0.001\"} 10
h_bucket{a=\"x\",le=\"0.005\"} 90
h_bucket{a=\"x\",le=\"+Inf\"} 100
h_bucket{a=\"y\",le=\"0.001\"} 0
h_bucket{a=\"y\",le=\"0.005\"} 0
h_bucket{a=\"y\",le=\"+Inf\"} 0
h_sum{a=\"x\"} 1.0
other_bucket{le=\"1\"} 7
";

    #[test]
    fn buckets_are_summed_over_labels_and_interpolated() {
        let b = Buckets::parse(TEXT, "h").unwrap();
        assert_eq!(b.0, vec![(0.001, 10), (0.005, 90), (f64::INFINITY, 100)]);
        assert_eq!(b.count(), 100);
        // Rank 50 lies half way through the (1 ms, 5 ms] bucket's 80 samples.
        assert!((b.quantile_us(0.5).unwrap() - 3_000.0).abs() < 1e-6);
        // Rank 5 is half way through the first bucket, from 0.
        assert!((b.quantile_us(0.05).unwrap() - 500.0).abs() < 1e-6);
        // In the infinite bucket: the last finite bound, said to be a floor.
        assert_eq!(b.quantile_us(0.99), Some(5_000.0));
        assert!(b.beyond_last_bound(0.99) && b.beyond_last_bound(0.91));
        assert!(!b.beyond_last_bound(0.9) && !b.beyond_last_bound(0.5));
        assert_eq!(b.share_within(0.005), Some(0.9));
        assert_eq!(Buckets::parse(TEXT, "missing"), None);
    }

    #[test]
    fn a_run_is_the_difference_of_two_scrapes() {
        let before = Buckets(vec![(0.001, 4), (0.005, 6), (f64::INFINITY, 6)]);
        let after = Buckets(vec![(0.001, 14), (0.005, 96), (f64::INFINITY, 106)]);
        let run = after.since(&before);
        assert_eq!(run.0, vec![(0.001, 10), (0.005, 90), (f64::INFINITY, 100)]);
        assert_eq!(Buckets(vec![(f64::INFINITY, 0)]).quantile_us(0.5), None);
    }
}
