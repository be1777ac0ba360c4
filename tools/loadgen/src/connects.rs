//! `connects`: how fast a node takes new connections — TCP connect, the TLS handshake where its
//! port speaks TLS, and the Hello answered — as many clients reconnecting at once do after a
//! failover. Each connection is closed once its Hello is answered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use spindle_client::{Client, ClientError, Tls};
use spindle_core::TenantId;
use spindle_wire::ErrorCode;

/// Connections at most in one run, and at once.
pub const COUNT_MAX: u64 = 1_000_000;
pub const CONCURRENCY_MAX: usize = 4_096;

pub struct Options {
    pub addr: String,
    pub tenant: u32,
    pub credential: String,
    pub count: u64,
    pub concurrency: usize,
    pub tls: Option<Tls>,
}

pub struct Outcome {
    pub made: u64,
    pub failed: u64,
    /// Of those failed, the ones the node told `Overloaded` (past its `connections_max`).
    pub overloaded: u64,
    /// The first failure's error.
    pub first_error: Option<String>,
    pub elapsed: Duration,
    /// Connect to HelloOk, µs.
    pub latency_us: Histogram<u64>,
}

impl Outcome {
    fn empty() -> Outcome {
        Outcome {
            made: 0,
            failed: 0,
            overloaded: 0,
            first_error: None,
            elapsed: Duration::ZERO,
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds"),
        }
    }

    /// Adds a worker's counts (the first failure kept is the earlier worker's).
    fn add(&mut self, other: Outcome) -> anyhow::Result<()> {
        self.latency_us.add(&other.latency_us)?;
        self.made += other.made;
        self.failed += other.failed;
        self.overloaded += other.overloaded;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        Ok(())
    }
}

pub async fn run(opts: Options) -> anyhow::Result<Outcome> {
    anyhow::ensure!(
        (1..=COUNT_MAX).contains(&opts.count),
        "--count must be 1..={COUNT_MAX}"
    );
    anyhow::ensure!(
        (1..=CONCURRENCY_MAX).contains(&opts.concurrency),
        "--concurrency must be 1..={CONCURRENCY_MAX}"
    );
    let opts = Arc::new(opts);
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..opts.concurrency {
        let (opts, next) = (opts.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            // This worker's share; `elapsed` is set once, for the whole run.
            let mut own = Outcome::empty();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < opts.count {
                let t0 = Instant::now();
                let connected = Client::connect_with(
                    &opts.addr,
                    TenantId(opts.tenant),
                    &opts.credential,
                    Duration::from_secs(10),
                    opts.tls.as_ref(),
                )
                .await;
                match connected {
                    Ok(client) => {
                        own.latency_us
                            .saturating_record(t0.elapsed().as_micros() as u64);
                        own.made += 1;
                        drop(client);
                    }
                    Err(e) => {
                        own.failed += 1;
                        if matches!(&e, ClientError::Refused(w) if w.code == ErrorCode::Overloaded)
                        {
                            own.overloaded += 1;
                        }
                        own.first_error.get_or_insert_with(|| e.to_string());
                    }
                }
            }
            own
        }));
    }
    let mut outcome = Outcome::empty();
    for w in workers {
        outcome.add(w.await?)?;
    }
    outcome.elapsed = started.elapsed();
    Ok(outcome)
}

/// One line: connections a second, and connect → HelloOk percentiles.
pub fn line(o: &Outcome) -> String {
    let ms = |q: f64| o.latency_us.value_at_quantile(q) as f64 / 1_000.0;
    let mut text = format!(
        "connections {} in {:.2} s ({:.0}/s), failed {} (told Overloaded {}); connect → HelloOk p50/p90/p99/max {:.2}/{:.2}/{:.2}/{:.2} ms",
        o.made,
        o.elapsed.as_secs_f64(),
        o.made as f64 / o.elapsed.as_secs_f64().max(1e-9),
        o.failed,
        o.overloaded,
        ms(0.5),
        ms(0.9),
        ms(0.99),
        o.latency_us.max() as f64 / 1_000.0,
    );
    if let Some(e) = &o.first_error {
        text.push_str(&format!("; first failure: {e}"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts and concurrencies outside their bounds are refused, naming the bound, before
    /// anything connects.
    #[test]
    fn out_of_bounds_runs_are_refused_naming_the_bound() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let opts = |count, concurrency| Options {
            addr: "127.0.0.1:1".into(),
            tenant: 1,
            credential: "x".into(),
            count,
            concurrency,
            tls: None,
        };
        for (count, concurrency, why) in [
            (0, 1, "--count must be 1..=1000000"),
            (COUNT_MAX + 1, 1, "--count must be 1..=1000000"),
            (1, 0, "--concurrency must be 1..=4096"),
            (1, CONCURRENCY_MAX + 1, "--concurrency must be 1..=4096"),
        ] {
            let e = rt.block_on(run(opts(count, concurrency))).err().unwrap();
            assert_eq!(e.to_string(), why);
        }
    }
}
