//! The open-loop driver. Each tenant sends on its own schedule whatever the node answers: a
//! request's latency is measured from the time it was *meant* to be sent, so a slow node shows
//! as latency instead of silently lowering the offered load (no coordinated omission).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use spindle_client::Client;
use spindle_core::{TaskId, TaskState, TenantId};

use crate::pacer::Pacer;
use crate::scrape::{metrics_text, succeeded_total, Buckets};
use crate::workload::{gap, task, Arrival, Rng, TenantLoad};

/// Requests one tenant may have in flight before the generator records it as a backlog drop
/// (bounded memory even against a stalled node).
const INFLIGHT_MAX: usize = 100_000;

pub struct Options {
    pub addr: SocketAddr,
    pub tenants: Vec<TenantLoad>,
    pub duration: Duration,
    pub batch: usize,
    /// Sent with every task as its input (`--input-bytes`).
    pub input: Option<String>,
    pub arrival: Arrival,
    pub seed: u64,
    pub progress: bool,
    /// How long to wait for accepted tasks after the send window (bounded).
    pub drain: Duration,
    /// The node's HTTP port: count completions from its committed-success counter instead of by
    /// polling every task (see `--metrics`).
    pub metrics: Option<crate::scrape::Endpoint>,
    /// Where the node's port speaks TLS: what its certificate is checked against.
    pub tls: Option<spindle_client::Tls>,
    /// Send a task the node refused for its load again after the refusal's hint
    /// (`--retry-refused`), at most this many times; 0: never.
    pub retries: u32,
}

/// The most a task refused for the node's load is sent again (`--retry-refused`).
pub const RETRIES_MAX: u32 = 100;
/// A retry budget, as well-behaved clients keep one (Finagle's and gRPC's retry throttling):
/// each task sent the first time earns a fifth of a retry, and a retry spends one, so retries
/// add at most a fifth to what a tenant sends however overloaded the node is — retries that
/// each came back after their hint would otherwise multiply the load they meet (at five times
/// the maximum, four of five sends are refused: up to ten tries each is a storm of refusals).
const RETRY_RATIO: f64 = 0.2;
/// The most retries a tenant saves up.
const RETRY_TOKENS_MAX: f64 = 10_000.0;

/// How often the committed-success counter is sampled.
const METRICS_SAMPLE: Duration = Duration::from_millis(100);
/// Status reads in flight at once when accepted tasks are checked after the measurement.
const CHECKS_IN_FLIGHT_MAX: usize = 512;

/// What happened, per tenant and over time.
pub struct Outcome {
    pub elapsed_send: Duration,
    pub ack_us: Histogram<u64>,
    pub reject_us: Histogram<u64>,
    /// The refusals for the node's load alone (`REJECT_PLATFORM_OVERLOADED`), from the
    /// intended send time.
    pub overload_us: Histogram<u64>,
    /// How late each frame left against its intended send time (the generator's own timer
    /// error; included in the acknowledgement latency).
    pub send_late_us: Histogram<u64>,
    pub per_tenant: Vec<TenantOutcome>,
    /// Per second since start.
    pub timeline: Vec<Second>,
    pub completed_within: Duration,
    /// Accepted tasks still unfinished when the drain window closed.
    pub unfinished: u64,
    /// The node's submit → dispatch histogram over the run (with `--metrics`).
    pub dispatch: Option<Buckets>,
}

/// The node's histogram of a first attempt's admission to its dispatch.
const DISPATCH_HISTOGRAM: &str = "spindle_submit_dispatch_seconds";

async fn dispatch_buckets(at: &crate::scrape::Endpoint) -> Option<Buckets> {
    let text = metrics_text(at).await.ok()?;
    Buckets::parse(&text, DISPATCH_HISTOGRAM)
}

#[derive(Debug, Clone)]
pub struct TenantOutcome {
    pub tenant: u32,
    pub offered: u64,
    pub accepted: u64,
    /// Tasks by rejection (a task sent again counts each time it is refused).
    pub rejected: HashMap<String, u64>,
    /// This tenant's acknowledgements, from the intended send time of the frame answered.
    pub ack_us: Histogram<u64>,
    /// Tasks sent again after a refusal for the node's load, those accepted on a later
    /// try, and those still refused at their last (`--retry-refused`).
    pub retried: u64,
    pub accepted_on_retry: u64,
    pub gave_up: u64,
    /// Retries the tenant may still send ([`RETRY_RATIO`] of its first sends, bounded).
    retry_tokens: f64,
    pub errors: u64,
    /// What the first request that failed (not a rejection: no answer, or an error) met.
    pub first_error: Option<String>,
    pub backlog_drops: u64,
    pub completed: u64,
}

impl TenantOutcome {
    fn new(tenant: u32) -> TenantOutcome {
        TenantOutcome {
            tenant,
            offered: 0,
            accepted: 0,
            rejected: HashMap::new(),
            ack_us: histogram(),
            retried: 0,
            accepted_on_retry: 0,
            gave_up: 0,
            retry_tokens: 0.0,
            errors: 0,
            first_error: None,
            backlog_drops: 0,
            completed: 0,
        }
    }
}

/// One second of the run, counted from its start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Second {
    /// Tasks acknowledged whose frame was due in this second.
    pub acked: u64,
    /// Tasks refused (for any reason but a replay) whose frame was due in this second.
    pub refused: u64,
    /// Tasks that completed in this second.
    pub completed: u64,
    pub ack_p50_us: u64,
    pub ack_p99_us: u64,
}

#[derive(Default)]
struct Shared {
    ack_us: Option<Histogram<u64>>,
    reject_us: Option<Histogram<u64>>,
    overload_us: Option<Histogram<u64>>,
    /// Refusals, by the second their frame was due.
    refused_seconds: Vec<u64>,
    send_late_us: Option<Histogram<u64>>,
    /// The acknowledgement latencies of each second's frames (by their intended send time),
    /// for the timeline: one small histogram a second, not a row per answer.
    ack_seconds: Vec<Histogram<u64>>,
    accepted: Vec<(u32, TaskId)>,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 3).expect("valid bounds")
}

/// A second's latencies: two significant figures (1 %) are plenty for a plotted line, and
/// keep each second's histogram ~21 kB however many answers it holds.
fn second_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 2).expect("valid bounds")
}

/// Adds `n` at index `second` of a per-second count, growing it to reach there.
fn count_at(counts: &mut Vec<u64>, second: u64, n: u64) {
    let i = second as usize;
    if counts.len() <= i {
        counts.resize(i + 1, 0);
    }
    counts[i] += n;
}

/// The timeline: each second's acknowledgements (their count and latencies) and completions,
/// from the start to the last second either has.
fn timeline(acks: &[Histogram<u64>], refused: &[u64], completions: &[u64]) -> Vec<Second> {
    let seconds = acks.len().max(completions.len()).max(refused.len());
    (0..seconds)
        .map(|i| {
            let h = acks.get(i).filter(|h| !h.is_empty());
            Second {
                acked: h.map_or(0, |h| h.len()),
                refused: refused.get(i).copied().unwrap_or(0),
                completed: completions.get(i).copied().unwrap_or(0),
                ack_p50_us: h.map_or(0, |h| h.value_at_quantile(0.50)),
                ack_p99_us: h.map_or(0, |h| h.value_at_quantile(0.99)),
            }
        })
        .collect()
}

pub async fn run(opts: Options) -> anyhow::Result<Outcome> {
    let shared = Arc::new(Mutex::new(Shared {
        ack_us: Some(histogram()),
        reject_us: Some(histogram()),
        overload_us: Some(histogram()),
        send_late_us: Some(histogram()),
        ..Shared::default()
    }));
    let counted = match &opts.metrics {
        Some(at) => Some(Counter::start(at.clone()).await?),
        None => None,
    };
    let dispatch_before = match &opts.metrics {
        Some(at) => dispatch_buckets(at).await,
        None => None,
    };
    let start = Instant::now();
    let bar = progress_bar(opts.progress, opts.duration);
    let mut handles = Vec::new();
    for (i, load) in opts.tenants.iter().enumerate() {
        let client = Arc::new(
            // Through any node of a cluster: one that does not serve the tenant names the
            // node that does.
            Client::connect_cluster_with(
                &opts.addr.to_string(),
                TenantId(load.tenant),
                &load.credential,
                opts.tls.as_ref(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("tenant {}: {e}", load.tenant))?,
        );
        let load = load.clone();
        let shared = shared.clone();
        let pacer = Pacer::new()?;
        let (arrival, batch, duration) = (opts.arrival, opts.batch, opts.duration);
        let seed = opts.seed ^ (i as u64).wrapping_mul(0x9e37_79b9);
        let input = opts.input.clone();
        let first = start + phase(arrival, i, opts.tenants.len(), batch, load.rate);
        let sending = Sending {
            arrival,
            batch,
            input,
            duration,
            seed,
            start,
            retries: opts.retries,
        };
        handles.push(tokio::spawn(async move {
            tenant_loop(client, load, sending, first, shared, pacer).await
        }));
    }
    if let Some(bar) = &bar {
        while start.elapsed() < opts.duration {
            bar.set_position(start.elapsed().as_secs());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bar.finish();
    }
    let mut per_tenant = Vec::new();
    let mut clients = Vec::new();
    for h in handles {
        let (outcome, client) = h.await??;
        per_tenant.push(outcome);
        clients.push(client);
    }
    let elapsed_send = start.elapsed();

    let accepted = std::mem::take(&mut shared.lock().expect("shared").accepted);
    let client_of: HashMap<u32, Arc<Client>> = opts
        .tenants
        .iter()
        .zip(clients)
        .map(|(l, c)| (l.tenant, c))
        .collect();
    let drain_start = Instant::now();
    let (completions, by_tenant, pending) = match counted {
        // Drain: the node's counter until it has every accepted task, then one check of each.
        Some(counter) => {
            let target = accepted.len() as u64;
            while counter.done() < target && drain_start.elapsed() < opts.drain {
                tokio::time::sleep(METRICS_SAMPLE).await;
            }
            let completions = counter.stop(start).await;
            let (by_tenant, pending) = check_all(&client_of, accepted).await?;
            (completions, by_tenant, pending)
        }
        // Drain: every accepted task polled until it ends (bounded).
        None => poll_until_done(&client_of, accepted, start, drain_start, opts.drain).await?,
    };
    let completed_within = drain_start.elapsed();
    let dispatch = match (&opts.metrics, dispatch_before) {
        (Some(at), Some(before)) => dispatch_buckets(at).await.map(|b| b.since(&before)),
        _ => None,
    };
    for t in &mut per_tenant {
        t.completed = by_tenant.get(&t.tenant).copied().unwrap_or(0);
    }
    let unfinished = pending.len() as u64;
    let mut s = shared.lock().expect("shared");
    let timeline = timeline(&s.ack_seconds, &s.refused_seconds, &completions);
    Ok(Outcome {
        elapsed_send,
        ack_us: s.ack_us.take().expect("histogram"),
        reject_us: s.reject_us.take().expect("histogram"),
        overload_us: s.overload_us.take().expect("histogram"),
        send_late_us: s.send_late_us.take().expect("histogram"),
        per_tenant,
        timeline,
        completed_within,
        unfinished,
        dispatch,
    })
}

/// Completions in each second since start, completions per tenant, and what had not ended.
type Drained = (Vec<u64>, HashMap<u32, u64>, Vec<(u32, TaskId)>);

/// Asks for every pending task, every 50 ms, until each has ended or the window closes.
async fn poll_until_done(
    client_of: &HashMap<u32, Arc<Client>>,
    mut pending: Vec<(u32, TaskId)>,
    start: Instant,
    drain_start: Instant,
    drain: Duration,
) -> anyhow::Result<Drained> {
    let mut completions: Vec<u64> = Vec::new();
    let mut by_tenant: HashMap<u32, u64> = HashMap::new();
    while !pending.is_empty() && drain_start.elapsed() < drain {
        let mut still = Vec::new();
        let mut gets = Vec::new();
        for (tenant, task) in pending {
            let c = client_of[&tenant].clone();
            gets.push(tokio::spawn(
                async move { (tenant, task, c.get(task).await) },
            ));
        }
        for g in gets {
            let (tenant, task, status) = g.await?;
            match status {
                Ok(s) if s.state == TaskState::Succeeded => {
                    count_at(&mut completions, start.elapsed().as_secs(), 1);
                    *by_tenant.entry(tenant).or_default() += 1;
                }
                Ok(s) if s.state.is_terminal() => {}
                _ => still.push((tenant, task)),
            }
        }
        pending = still;
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok((completions, by_tenant, pending))
}

/// One status read of every accepted task, after the measurement: completions per tenant, and
/// the tasks that had not ended.
async fn check_all(
    client_of: &HashMap<u32, Arc<Client>>,
    accepted: Vec<(u32, TaskId)>,
) -> anyhow::Result<(HashMap<u32, u64>, Vec<(u32, TaskId)>)> {
    let mut by_tenant: HashMap<u32, u64> = HashMap::new();
    let mut pending = Vec::new();
    for chunk in accepted.chunks(CHECKS_IN_FLIGHT_MAX) {
        let gets: Vec<_> = chunk
            .iter()
            .map(|&(tenant, task)| {
                let c = client_of[&tenant].clone();
                tokio::spawn(async move { (tenant, task, c.get(task).await) })
            })
            .collect();
        for g in gets {
            let (tenant, task, status) = g.await?;
            match status {
                Ok(s) if s.state == TaskState::Succeeded => {
                    *by_tenant.entry(tenant).or_default() += 1
                }
                Ok(s) if s.state.is_terminal() => {}
                _ => pending.push((tenant, task)),
            }
        }
    }
    Ok((by_tenant, pending))
}

/// The node's committed-success counter, sampled in the background from the start of the run.
struct Counter {
    base: u64,
    last: Arc<std::sync::atomic::AtomicU64>,
    stop: tokio::sync::oneshot::Sender<()>,
    sampler: tokio::task::JoinHandle<Vec<(Instant, u64)>>,
}

impl Counter {
    async fn start(at: crate::scrape::Endpoint) -> anyhow::Result<Counter> {
        let base = succeeded_total(&at).await?;
        let last = Arc::new(std::sync::atomic::AtomicU64::new(base));
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let seen = last.clone();
        let sampler = tokio::spawn(async move {
            let mut samples = Vec::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => return samples,
                    _ = tokio::time::sleep(METRICS_SAMPLE) => {}
                }
                // A failed scrape is a missing sample, not a failed run.
                if let Ok(v) = succeeded_total(&at).await {
                    seen.store(v, std::sync::atomic::Ordering::Relaxed);
                    samples.push((Instant::now(), v));
                }
            }
        });
        Ok(Counter {
            base,
            last,
            stop,
            sampler,
        })
    }

    /// Committed successes since the run started.
    fn done(&self) -> u64 {
        self.last.load(std::sync::atomic::Ordering::Relaxed) - self.base
    }

    /// Stops sampling; the committed successes in each second since `start`.
    async fn stop(self, start: Instant) -> Vec<u64> {
        let _ = self.stop.send(());
        let samples = self.sampler.await.unwrap_or_default();
        let mut completions = Vec::new();
        let mut before = self.base;
        for (at, v) in samples {
            let second = at.duration_since(start).as_secs();
            count_at(&mut completions, second, v.saturating_sub(before));
            before = before.max(v);
        }
        completions
    }
}

fn progress_bar(show: bool, duration: Duration) -> Option<indicatif::ProgressBar> {
    if !show {
        return None;
    }
    let bar = indicatif::ProgressBar::new(duration.as_secs());
    bar.set_style(
        indicatif::ProgressStyle::with_template("sending {bar:40} {pos}/{len} s")
            .expect("template"),
    );
    Some(bar)
}

/// When tenant `i` of `n` sends its first frame, after the run's start. With fixed arrivals,
/// tenants at one rate would otherwise send every frame at the same instant, a burst of `n`
/// frames no independent clients make; each is offset by its part of its own frame period
/// (as wrk2 spreads its connections' first requests). Poisson arrivals are independent already.
fn phase(arrival: Arrival, i: usize, n: usize, batch: usize, rate: f64) -> Duration {
    match arrival {
        Arrival::Fixed if n > 1 && rate > 0.0 => {
            Duration::from_secs_f64(batch as f64 / rate * i as f64 / n as f64)
        }
        _ => Duration::ZERO,
    }
}

/// How a tenant's frames are made and sent (the same for every tenant of a run).
struct Sending {
    arrival: Arrival,
    batch: usize,
    input: Option<String>,
    duration: Duration,
    seed: u64,
    start: Instant,
    retries: u32,
}

async fn tenant_loop(
    client: Arc<Client>,
    load: TenantLoad,
    sending: Sending,
    schedule_start: Instant,
    shared: Arc<Mutex<Shared>>,
    mut pacer: Pacer,
) -> anyhow::Result<(TenantOutcome, Arc<Client>)> {
    let Sending {
        arrival,
        batch,
        ref input,
        duration,
        seed,
        start,
        retries,
    } = sending;
    let mut rng = Rng::new(seed);
    // Keys unique per run: a node keeps every key it saw, and a rerun would only replay.
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let outcome = Arc::new(Mutex::new(TenantOutcome::new(load.tenant)));
    let mut intended = schedule_start;
    let mut seq = 0u64;
    // The frames in flight: finished ones are reaped as the loop goes, so what the run keeps
    // is bounded by what is in flight, not by the frames sent, and its length is the count
    // INFLIGHT_MAX bounds.
    let mut sends = tokio::task::JoinSet::new();
    loop {
        while let Some(sent) = sends.try_join_next() {
            sent?;
        }
        // The next batch is due when its first task is.
        let mut tasks = Vec::with_capacity(batch);
        let first = intended;
        for _ in 0..batch {
            seq += 1;
            let mut t = task(
                format!("lg-{run_id}-{}-{seq}", load.tenant),
                1 + (seq % 16) as u32,
                &mut rng,
            );
            t.input = input.clone();
            tasks.push(t);
            intended += gap(
                arrival,
                load.rate_at(intended.saturating_duration_since(start)),
                &mut rng,
            );
        }
        if first.duration_since(start) >= duration {
            break;
        }
        pacer.wait_until(first).await?;
        let late = first.elapsed().as_micros() as u64;
        shared
            .lock()
            .expect("shared")
            .send_late_us
            .as_mut()
            .expect("histogram")
            .saturating_record(late);
        let n = tasks.len() as u64;
        {
            let mut o = outcome.lock().expect("outcome");
            o.offered += n;
            o.retry_tokens = (o.retry_tokens + n as f64 * RETRY_RATIO).min(RETRY_TOKENS_MAX);
        }
        if sends.len() >= INFLIGHT_MAX {
            outcome.lock().expect("outcome").backlog_drops += n;
            continue;
        }
        let frame = Frame {
            client: client.clone(),
            outcome: outcome.clone(),
            shared: shared.clone(),
            start,
        };
        sends.spawn(frame.send(tasks, first, retries));
    }
    while let Some(sent) = sends.join_next().await {
        sent?;
    }
    let o = outcome.lock().expect("outcome").clone();
    Ok((o, client))
}

/// One frame's way: sent, answered, counted — and, with `--retry-refused`, its tasks refused
/// for the node's load sent again after the hint, as a frame of their own.
struct Frame {
    client: Arc<Client>,
    outcome: Arc<Mutex<TenantOutcome>>,
    shared: Arc<Mutex<Shared>>,
    start: Instant,
}

impl Frame {
    async fn send(self, mut tasks: Vec<spindle_wire::SubmitTask>, mut due: Instant, retries: u32) {
        for attempt in 0..=retries {
            let n = tasks.len() as u64;
            // The tasks are kept for a retry only where there may be one.
            let sent = if retries > 0 {
                tasks.clone()
            } else {
                std::mem::take(&mut tasks)
            };
            let answer = if sent.len() == 1 {
                let t = sent.into_iter().next().expect("one task");
                self.client.submit(t).await.map(|a| vec![a])
            } else {
                self.client.submit_batch(sent).await
            };
            let us = due.elapsed().as_micros() as u64;
            let sec = due.duration_since(self.start).as_secs();
            let admissions = match answer {
                Ok(admissions) => admissions,
                Err(e) => {
                    let mut o = self.outcome.lock().expect("outcome");
                    o.errors += n;
                    o.first_error.get_or_insert_with(|| e.to_string());
                    return;
                }
            };
            // Every answer of a frame has the frame's latency: counted per frame, recorded once
            // per kind (at five times a node's maximum the generator answers ~100,000 tasks a
            // second on the cores it measures).
            let mut accepted = Vec::new();
            let mut refused = [0u64; spindle_core::Decision::ALL.len()];
            let (mut replays, mut again) = (0u64, Vec::new());
            let mut wait = Duration::ZERO;
            let mut kept = tasks.into_iter();
            for a in admissions {
                let t = kept.next();
                if a.decision.is_accepted() && !a.replay {
                    accepted.push(a.task);
                } else if a.replay {
                    replays += 1;
                } else {
                    refused[a.decision as usize] += 1;
                    let overloaded = a.decision == spindle_core::Decision::RejectPlatformOverloaded;
                    if let (true, Some(after), Some(t)) = (overloaded, a.retry_after(), t) {
                        wait = wait.max(after);
                        again.push(t);
                    }
                }
            }
            {
                let mut o = self.outcome.lock().expect("outcome");
                let mut s = self.shared.lock().expect("shared");
                let taken = accepted.len() as u64;
                if taken > 0 {
                    o.accepted += taken;
                    o.accepted_on_retry += u64::from(attempt > 0) * taken;
                    o.ack_us.saturating_record_n(us, taken);
                    s.ack_us
                        .as_mut()
                        .expect("histogram")
                        .saturating_record_n(us, taken);
                    let second = sec as usize;
                    if s.ack_seconds.len() <= second {
                        s.ack_seconds.resize_with(second + 1, second_histogram);
                    }
                    s.ack_seconds[second].saturating_record_n(us, taken);
                    let tenant = o.tenant;
                    s.accepted.extend(accepted.into_iter().map(|t| (tenant, t)));
                }
                if replays > 0 {
                    *o.rejected.entry("REPLAY".to_string()).or_default() += replays;
                }
                let all_refused: u64 = refused.iter().sum();
                if all_refused > 0 {
                    for (d, &k) in spindle_core::Decision::ALL.iter().zip(&refused) {
                        if k > 0 {
                            *o.rejected.entry(d.name().to_string()).or_default() += k;
                        }
                    }
                    s.reject_us
                        .as_mut()
                        .expect("histogram")
                        .saturating_record_n(us, all_refused);
                    count_at(&mut s.refused_seconds, sec, all_refused);
                    let overloaded =
                        refused[spindle_core::Decision::RejectPlatformOverloaded as usize];
                    if overloaded > 0 {
                        s.overload_us
                            .as_mut()
                            .expect("histogram")
                            .saturating_record_n(us, overloaded);
                    }
                }
                if again.is_empty() || retries == 0 {
                    return;
                }
                // Within the budget only; the rest, and any past their last try, give up.
                let allowed = if attempt == retries {
                    0
                } else {
                    (o.retry_tokens.floor() as usize).min(again.len())
                };
                o.retry_tokens -= allowed as f64;
                o.gave_up += (again.len() - allowed) as u64;
                again.truncate(allowed);
                if again.is_empty() {
                    return;
                }
                o.retried += again.len() as u64;
            }
            // Never sooner than the hint; later by doubling with each try, and by a jitter of
            // up to half, so that the frames refused together do not come back together.
            let jitter = 1.0 + 0.5 * (due.elapsed().subsec_nanos() % 1_000) as f64 / 1_000.0;
            tokio::time::sleep(wait.mul_f64(f64::from(1u32 << attempt.min(16)) * jitter)).await;
            due = Instant::now();
            tasks = again;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two tenants at 5,000/s in frames of 64 (a frame every 12.8 ms each): the second starts
    /// half a period after the first, so their frames interleave instead of coinciding.
    #[test]
    fn fixed_arrivals_spread_tenants_over_one_frame_period() {
        let at = |i| phase(Arrival::Fixed, i, 2, 64, 5_000.0);
        assert_eq!(at(0), Duration::ZERO);
        assert_eq!(at(1), Duration::from_micros(6_400));
        // Four tenants: quarters of the period, each below one period.
        let quarters: Vec<_> = (0..4)
            .map(|i| phase(Arrival::Fixed, i, 4, 1, 1_000.0))
            .collect();
        assert_eq!(
            quarters,
            [0, 250, 500, 750].map(Duration::from_micros).to_vec()
        );
    }

    /// Each second's answers give its count and percentiles; a second with completions but
    /// no answer (the drain) is there with zeros for the answers; counts grow to any second.
    #[test]
    fn the_timeline_has_each_second_of_answers_and_of_completions() {
        let mut acks = vec![second_histogram(), second_histogram()];
        for us in 1..=100 {
            acks[0].saturating_record(us * 100);
        }
        acks[1].saturating_record(7_000);
        let mut completions = Vec::new();
        count_at(&mut completions, 3, 5);
        count_at(&mut completions, 0, 2);
        count_at(&mut completions, 3, 1);
        assert_eq!(completions, [2, 0, 0, 6]);
        let t = timeline(&acks, &[0, 4], &completions);
        assert_eq!(t.len(), 4);
        assert_eq!((t[0].acked, t[0].completed), (100, 2));
        // Two significant figures: within 1 %.
        assert!((4_950..=5_050).contains(&t[0].ack_p50_us), "{:?}", t[0]);
        assert!((9_800..=10_000).contains(&t[0].ack_p99_us), "{:?}", t[0]);
        assert_eq!((t[1].acked, t[1].completed, t[1].refused), (1, 0, 4));
        assert_eq!(
            t[3],
            Second {
                acked: 0,
                refused: 0,
                completed: 6,
                ack_p50_us: 0,
                ack_p99_us: 0
            }
        );
    }

    /// Poisson arrivals are independent already; a lone tenant or a zero rate has no offset.
    #[test]
    fn other_arrivals_start_at_once() {
        assert_eq!(phase(Arrival::Poisson, 1, 2, 64, 5_000.0), Duration::ZERO);
        assert_eq!(phase(Arrival::Fixed, 0, 1, 64, 5_000.0), Duration::ZERO);
        assert_eq!(phase(Arrival::Fixed, 1, 2, 64, 0.0), Duration::ZERO);
    }
}
