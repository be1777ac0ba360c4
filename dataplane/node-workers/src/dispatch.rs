//! Provider I/O: a thread of its own (a tokio runtime) that talks HTTP to the provider for the
//! shards, so no shard ever waits on a provider. Shards send [`Call`]s; answers come back to
//! the shard's inbox as [`ProviderEvent`]s, carrying the attempt's fencing token (a stale one
//! changes nothing in the core or in PostgreSQL).
//!
//! Completion arrives by signed callback (POST on the node's HTTP port) or, when callbacks are
//! lost, by staged polling with jitter; whichever comes first ends the watch, so the shard sees
//! each job's end once.
//!
//! Submits are paced where they leave, not only where their RPM token was taken: a shard takes
//! the token when it picks the task, but the submit goes out after its claim commits — and a
//! stall in between (a disk's flush, PostgreSQL's locks, a starved thread) would let every task
//! picked meanwhile reach the provider at once, above the account's burst. Each shard's submits
//! to an account wait, in order, for a token of a bucket at that shard's current part of the
//! account's RPM ([`Call::Submit`]'s `pace`); the shards' parts add up to the node's, so what
//! leaves the node keeps to its part whatever the stalls before.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use spindle_core::ledger::TokenBucket;
use spindle_core::policy::RateSpec;
use spindle_core::{FencingToken, TaskId, Time};
use spindle_providers::vendors::{Callback, CallbackIn};
use spindle_providers::{
    AsyncJobProvider, JobView, Lookup, Provider, Submission, SubmitError, Vendor,
};
use tokio::sync::mpsc;

pub use spindle_node_base::config::ProviderConfig;

use spindle_node_base::jitter::jitter_milli;
pub use spindle_node_base::limits::CALLS_QUEUE_MAX;
use spindle_node_base::limits::{POLLS_AFTER_CANCEL_MAX, RESOLVE_TRIES_MAX};
pub use spindle_node_base::messages::ProviderEvent;
use spindle_node_base::messages::ShardMsg;

/// What a shard asks of the provider.
#[derive(Debug)]
pub enum Call {
    Submit {
        shard: usize,
        task: TaskId,
        token: FencingToken,
        /// Set by the shard when the task is canceled before the submit's turn comes.
        withdrawn: Arc<AtomicBool>,
        submission: Submission,
        /// The shard's part of the account's RPM now: the submit leaves once a bucket at that
        /// rate (the shard's own for the account) gives it a token. `None`: not paced.
        pace: Option<RateSpec>,
    },
    /// After an unknown outcome: find the attempt by its request key.
    Resolve {
        shard: usize,
        task: TaskId,
        token: FencingToken,
        account: String,
        request_key: String,
    },
    /// Follow an accepted job to its end; with `cancel`, ask the provider to stop it first (its
    /// task was canceled before the provider's acceptance came back). Either way the shard hears
    /// how the job ended, and only then lets go of what the attempt holds.
    Watch {
        shard: usize,
        task: TaskId,
        token: FencingToken,
        account: String,
        job_id: String,
        cancel: bool,
        /// The job's lane's execution timeout: past this instant the job is canceled at the
        /// provider and its attempt fails for the reason given (unless it succeeded first).
        timeout: Option<(std::time::Instant, String)>,
    },
    /// Best effort: the task was canceled while the provider ran it.
    Cancel { account: String, job_id: String },
}

/// A shard's send bucket for one account; its lock is FIFO, so submits leave in the order
/// they came.
struct Pacer {
    bucket: tokio::sync::Mutex<TokenBucket>,
    /// Submits waiting for their turn now: while any do, the shard picks no more work for the
    /// account ([`DispatchHandle::paced_backlog`]).
    waiting: AtomicU64,
}

/// Counts a submit as waiting at its pacer (and in `/metrics`) for as long as it lives: to its
/// token, or to the drop of a submit abandoned on the way.
struct Waiting<'a> {
    pacer: &'a Pacer,
    metrics: &'a spindle_node_base::metrics::Metrics,
}

impl<'a> Waiting<'a> {
    fn new(pacer: &'a Pacer, metrics: &'a spindle_node_base::metrics::Metrics) -> Waiting<'a> {
        pacer.waiting.fetch_add(1, Ordering::Relaxed);
        metrics
            .provider_paced_waiting
            .fetch_add(1, Ordering::Relaxed);
        Waiting { pacer, metrics }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.pacer.waiting.fetch_sub(1, Ordering::Relaxed);
        self.metrics
            .provider_paced_waiting
            .fetch_sub(1, Ordering::Relaxed);
    }
}

struct Watched {
    shard: usize,
    account: String,
    task: TaskId,
    token: FencingToken,
    /// The job was given up — it outlived `polls_max` polls, or its lane's execution timeout —
    /// and canceled: any end but success is then the attempt's failure, for this reason.
    given_up: Option<String>,
}

/// Callbacks of a vendor without a lookup by key that named a key no watch or resolve was
/// waiting for yet (a submit whose answer is still on its way back, say): kept, the newest
/// [`KEYED_MAX`], for the resolve that comes to ask.
#[derive(Default)]
struct Keyed {
    /// Request key → the job its callback named.
    jobs: Recent<String>,
    /// Resolves waiting for the callback that names their key.
    waiting: HashMap<String, tokio::sync::oneshot::Sender<String>>,
    /// Jobs a resolve found ended already, for the watch that follows (which then ends at
    /// once instead of at its first poll).
    ended: Recent<JobView>,
}

/// A map that keeps its newest [`KEYED_MAX`] entries, the oldest dropped first.
struct Recent<V> {
    entries: HashMap<String, (V, u64)>,
    /// Keys in the order they were put, each with the put's number: an entry taken and put
    /// again is dropped by its own turn, not by the turn of the value it replaced.
    order: std::collections::VecDeque<(String, u64)>,
    puts: u64,
}

impl<V> Default for Recent<V> {
    fn default() -> Self {
        Recent {
            entries: HashMap::new(),
            order: std::collections::VecDeque::new(),
            puts: 0,
        }
    }
}

impl<V> Recent<V> {
    fn put(&mut self, key: String, value: V) {
        self.puts += 1;
        self.order.push_back((key.clone(), self.puts));
        self.entries.insert(key, (value, self.puts));
        while self.order.len() > KEYED_MAX {
            if let Some((old, put)) = self.order.pop_front() {
                if self.entries.get(&old).is_some_and(|(_, p)| *p == put) {
                    self.entries.remove(&old);
                }
            }
        }
    }

    fn take(&mut self, key: &str) -> Option<V> {
        self.entries.remove(key).map(|(v, _)| v)
    }
}

/// Keys the dispatcher remembers for resolves (callbacks that came first, jobs found ended).
pub const KEYED_MAX: usize = 16_384;

/// The provider thread's shared state: the client, the shards' inboxes, the watched jobs.
pub struct Dispatcher {
    provider: Provider,
    keyed: Mutex<Keyed>,
    config: ProviderConfig,
    shards: Vec<mpsc::Sender<ShardMsg>>,
    watched: Mutex<HashMap<String, Watched>>,
    callback_url: String,
    metrics: Arc<spindle_node_base::metrics::Metrics>,
    health: Arc<spindle_node_base::health::ProviderHealth>,
    /// Per account and shard: the bucket its submits wait on, in turn.
    pacers: Mutex<HashMap<(String, usize), Arc<Pacer>>>,
    /// The pacers' clock's zero.
    epoch: std::time::Instant,
}

/// The handle shards and the HTTP server hold.
#[derive(Clone)]
pub struct DispatchHandle {
    pub calls: mpsc::Sender<Call>,
    pub dispatcher: Arc<Dispatcher>,
}

impl DispatchHandle {
    /// Where the provider should post callbacks.
    pub fn callback_url(&self) -> &str {
        &self.dispatcher.callback_url
    }

    /// Submits of `shard` to `account` waiting for their turn to leave now (0 when none ever
    /// did). While any do, the shard picks no more for the account (`shard::resplit`): what
    /// a stall bunched drains first, instead of every later submit queueing behind it.
    pub fn paced_backlog(&self, account: &str, shard: usize) -> u64 {
        let pacers = self
            .dispatcher
            .pacers
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        pacers
            .get(&(account.to_string(), shard))
            .map_or(0, |p| p.waiting.load(Ordering::Relaxed))
    }

    /// How long an attempt in doubt waits after a round of queries without any answer before
    /// it is asked about again: the last polling stage.
    pub fn resolve_again_after(&self) -> Duration {
        let last = self
            .dispatcher
            .config
            .poll_ms
            .last()
            .copied()
            .unwrap_or(10_000);
        Duration::from_millis(last)
    }
}

/// Starts the provider thread; `https://` calls trust `tls`'s roots ([`ProviderConfig::tls`]).
/// Callbacks go to `http_base` (the node's HTTP port: `http://` or `https://` and its address)
/// unless the configuration names another base.
pub fn start(
    config: ProviderConfig,
    tls: &spindle_providers::tls::ClientConfig,
    http_base: String,
    shards: Vec<mpsc::Sender<ShardMsg>>,
    metrics: Arc<spindle_node_base::metrics::Metrics>,
    health: Arc<spindle_node_base::health::ProviderHealth>,
) -> anyhow::Result<DispatchHandle> {
    let base = config.callback_base.clone().unwrap_or(http_base);
    let dispatcher = Arc::new(Dispatcher {
        provider: config.provider(tls)?,
        keyed: Mutex::new(Keyed::default()),
        callback_url: format!("{}/v1/provider/callback", base.trim_end_matches('/')),
        config,
        shards,
        watched: Mutex::new(HashMap::new()),
        metrics,
        health,
        pacers: Mutex::new(HashMap::new()),
        epoch: std::time::Instant::now(),
    });
    let (tx, mut rx) = mpsc::channel::<Call>(CALLS_QUEUE_MAX);
    let d = dispatcher.clone();
    crate::runtime::spawn_thread("provider-io", move || async move {
        while let Some(call) = rx.recv().await {
            let d = d.clone();
            tokio::spawn(async move { d.run(call).await });
        }
    })?;
    Ok(DispatchHandle {
        calls: tx,
        dispatcher,
    })
}

impl Dispatcher {
    /// Waits for a token of `shard`'s bucket for `account` at `rate`, behind the submits that
    /// came to it before (a new bucket starts full, as a shard's does). A wait is counted in
    /// `spindle_provider_paced_total` and its length in `spindle_provider_paced_seconds_total`.
    async fn paced(&self, account: &str, shard: usize, rate: RateSpec) {
        let pacer = {
            let mut pacers = self.pacers.lock().unwrap_or_else(|p| p.into_inner());
            let now = self.pace_clock();
            pacers
                .entry((account.to_string(), shard))
                .or_insert_with(|| {
                    Arc::new(Pacer {
                        bucket: tokio::sync::Mutex::new(TokenBucket::new(rate, now)),
                        waiting: AtomicU64::new(0),
                    })
                })
                .clone()
        };
        let _waiting = Waiting::new(&pacer, &self.metrics);
        let started = std::time::Instant::now();
        // Held: behind a submit that waits for its token (the lock is only ever held across
        // that wait), or waiting for its own.
        let (mut bucket, mut held) = match pacer.bucket.try_lock() {
            Ok(bucket) => (bucket, false),
            Err(_) => (pacer.bucket.lock().await, true),
        };
        loop {
            let now = self.pace_clock();
            if bucket.rate() != rate {
                bucket.set_rate(rate, now);
            }
            match bucket.take_one(now) {
                Ok(()) => break,
                // A rate of zero cannot come here (the shard sends none), nor a burst of zero
                // (it sends at least one); never wait forever on one all the same.
                Err(u64::MAX) => break,
                Err(ns) => {
                    held = true;
                    tokio::time::sleep(Duration::from_nanos(ns)).await;
                }
            }
        }
        if held {
            self.metrics.provider_paced.fetch_add(1, Ordering::Relaxed);
            self.metrics
                .provider_paced_us
                .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
    }

    fn pace_clock(&self) -> Time {
        Time::of(std::time::Instant::now(), self.epoch)
    }

    async fn send(&self, shard: usize, event: ProviderEvent) {
        if let Some(inbox) = self.shards.get(shard) {
            // A shard that stopped needs no answer.
            let _ = inbox.send(ShardMsg::Provider(event)).await;
        }
    }

    async fn run(self: Arc<Self>, call: Call) {
        match call {
            Call::Submit {
                shard,
                task,
                token,
                withdrawn,
                submission,
                pace,
            } => {
                if let Some(rate) = pace {
                    self.paced(&submission.account, shard, rate).await;
                }
                let mut submission = submission;
                if let Some(id) = self.config.models.get(&submission.model) {
                    submission.model = id.clone();
                }
                if self.provider.vendor() != Vendor::Spindle {
                    // A vendor's callback names its attempt by the URL it was given.
                    submission.callback_url = submission.callback_url.map(|base| {
                        spindle_providers::vendors::callback_url(
                            &base,
                            &submission.request_key,
                            self.secret(),
                        )
                    });
                }
                let result = self.provider.submit_unless(&submission, &withdrawn).await;
                if result != Err(SubmitError::Withdrawn) {
                    let definite = !matches!(
                        result,
                        Err(SubmitError::NotSent(_) | SubmitError::Unknown(_))
                    );
                    self.health.record(&submission.account, definite);
                }
                self.metrics.provider_call(match &result {
                    Ok(_) => "accepted",
                    Err(SubmitError::RateLimited { .. }) => "rate_limited",
                    Err(SubmitError::Refused { .. }) => "refused",
                    Err(SubmitError::NotSent(_)) => "not_sent",
                    Err(SubmitError::Unknown(_)) => "unknown",
                    Err(SubmitError::Withdrawn) => "withdrawn",
                });
                self.send(
                    shard,
                    ProviderEvent::Submitted {
                        task,
                        token,
                        result,
                    },
                )
                .await;
            }
            Call::Resolve {
                shard,
                task,
                token,
                account,
                request_key,
            } => {
                let lookup = self.resolve(&account, &request_key, task.0).await;
                if let Some(Lookup::Found(view)) = &lookup {
                    if view.state.is_final() {
                        self.ended(view.clone());
                    }
                }
                self.send(
                    shard,
                    ProviderEvent::Resolved {
                        task,
                        token,
                        lookup,
                    },
                )
                .await;
            }
            Call::Watch {
                shard,
                task,
                token,
                account,
                job_id,
                cancel,
                timeout,
            } => {
                // Watched before the cancel goes out: the callback it causes finds the watch.
                self.lock().insert(
                    job_id.clone(),
                    Watched {
                        shard,
                        account: account.clone(),
                        task,
                        token,
                        given_up: None,
                    },
                );
                let ended = self.keyed().ended.take(&job_id);
                if cancel {
                    self.cancel(&account, &job_id).await;
                } else if let Some(view) = ended {
                    self.finish(view).await;
                    return;
                }
                self.poll(&account, &job_id, timeout).await;
            }
            Call::Cancel { account, job_id } => self.cancel(&account, &job_id).await,
        }
    }

    /// Finds an attempt whose submit got no answer. The submit may still be on its way to the
    /// provider (queued in a socket, or read and not yet processed), so a "not found" is only
    /// believed once the provider has had time to process anything we sent: the first query
    /// waits one call timeout, and a "not found" must hold again two timeouts later. `None`
    /// when no query got an answer.
    async fn resolve(&self, account: &str, request_key: &str, seed: u64) -> Option<Lookup> {
        if !self.provider.finds_by_key() {
            return self.resolve_by_callback(account, request_key).await;
        }
        let timeout = Duration::from_millis(self.config.timeout_ms);
        tokio::time::sleep(timeout).await;
        let mut not_found_once = false;
        for attempt in 0..RESOLVE_TRIES_MAX {
            let found = self.provider.find_by_key(account, request_key).await;
            match found {
                Ok(Lookup::Found(view)) => return Some(Lookup::Found(view)),
                Ok(Lookup::NotFound) if not_found_once => return Some(Lookup::NotFound),
                Ok(Lookup::NotFound) => {
                    not_found_once = true;
                    tokio::time::sleep(2 * timeout).await;
                }
                Err(e) => {
                    tracing::warn!("resolving {request_key}: {e}");
                    self.pause(attempt, seed).await;
                }
            }
        }
        None
    }

    /// Finds an attempt in doubt at a vendor that cannot be asked by key: by the callback that
    /// names its key (the vendor calls back when the job it took changes), within one round
    /// of the staged polls; `None` (asked again later) when none came.
    async fn resolve_by_callback(&self, account: &str, request_key: &str) -> Option<Lookup> {
        let rx = {
            let mut k = self.keyed();
            match k.jobs.take(request_key) {
                Some(job) => Err(job),
                None => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    k.waiting.insert(request_key.to_string(), tx);
                    Ok(rx)
                }
            }
        };
        let job_id = match rx {
            Err(job) => job,
            Ok(rx) => {
                let round = self.stage(u32::MAX, 0) * RESOLVE_TRIES_MAX;
                let named = tokio::time::timeout(round, rx).await;
                self.keyed().waiting.remove(request_key);
                named.ok()?.ok()?
            }
        };
        match self.provider.job(account, &job_id).await {
            Ok(Lookup::Found(mut view)) => {
                view.request_key = request_key.to_string();
                Some(Lookup::Found(view))
            }
            // The callback named it: a job the vendor cannot show now is asked about again.
            Ok(Lookup::NotFound) | Err(_) => {
                self.remember(request_key, &job_id);
                None
            }
        }
    }

    /// Keeps a job found ended for the watch that follows (bounded).
    fn ended(&self, view: JobView) {
        self.keyed().ended.put(view.job_id.clone(), view);
    }

    fn keyed(&self) -> std::sync::MutexGuard<'_, Keyed> {
        self.keyed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a callback's job for the resolve of `key` that comes later (bounded).
    fn remember(&self, key: &str, job_id: &str) {
        self.keyed().jobs.put(key.to_string(), job_id.to_string());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watched>> {
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The `i`-th staged wait, jittered.
    async fn pause(&self, i: u32, seed: u64) {
        tokio::time::sleep(self.stage(i, seed)).await;
    }

    fn stage(&self, i: u32, seed: u64) -> Duration {
        let stages = &self.config.poll_ms;
        let base = stages[(i as usize).min(stages.len() - 1)];
        Duration::from_millis(base * jitter_milli(seed ^ u64::from(i)) / 1_000)
    }

    /// Polls `job_id` in stages until it is final or a callback ended the watch. A job still not
    /// final after `polls_max` polls, or at its execution `timeout`, is given up: canceled at the
    /// provider, and polled until the provider shows it ended.
    async fn poll(&self, account: &str, job_id: &str, mut timeout: Option<(Instant, String)>) {
        let polls_max = self.config.polls_max;
        let mut last = polls_max + POLLS_AFTER_CANCEL_MAX;
        let mut i = 0;
        while i < last {
            let wait = self.stage(i, job_id.len() as u64 ^ u64::from(i));
            if let Some((at, why)) = timeout.take_if(|(at, _)| *at <= Instant::now() + wait) {
                tokio::time::sleep_until(at.into()).await;
                if !self.lock().contains_key(job_id) {
                    return; // a callback finished it
                }
                tracing::warn!("{job_id}: {why}; canceling it");
                self.give_up(account, job_id, why).await;
                last = last.min(i + POLLS_AFTER_CANCEL_MAX);
                continue;
            }
            tokio::time::sleep(wait).await;
            if !self.lock().contains_key(job_id) {
                return; // a callback finished it
            }
            let polled = self.provider.job(account, job_id).await;
            match polled {
                Ok(Lookup::Found(view)) if view.state.is_final() => {
                    self.metrics.callback("polled");
                    self.finish(view).await;
                    return;
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("polling {job_id}: {e}"),
            }
            i += 1;
            if i == polls_max {
                tracing::warn!("{job_id}: no final state after {polls_max} polls; canceling it");
                let why =
                    format!("no final state after {polls_max} polls: canceled at the provider");
                self.give_up(account, job_id, why).await;
            }
        }
        tracing::warn!(
            "{job_id}: canceled, and still not ended at the provider after \
             {POLLS_AFTER_CANCEL_MAX} more polls; its attempt keeps its reservation"
        );
        self.lock().remove(job_id);
    }

    /// Gives the watched job up for `why` and cancels it at the provider — once: a job given up
    /// already (its timeout, then its polls) keeps its first reason and is not canceled again.
    async fn give_up(&self, account: &str, job_id: &str, why: String) {
        let first = self.lock().get_mut(job_id).is_some_and(|w| {
            let first = w.given_up.is_none();
            w.given_up.get_or_insert(why);
            first
        });
        if first {
            self.cancel(account, job_id).await;
        }
    }

    /// Asks the provider to stop `job_id` (best effort: a failure is logged).
    async fn cancel(&self, account: &str, job_id: &str) {
        if let Err(e) = self.provider.cancel(account, job_id).await {
            tracing::warn!("canceling {job_id} at the provider: {e}");
        }
    }

    /// Ends the watch of a final job (once) and tells its shard.
    async fn finish(&self, mut view: JobView) {
        let Some(w) = self.lock().remove(&view.job_id) else {
            return;
        };
        if let Some(why) = w.given_up {
            if view.state != spindle_providers::JobState::Succeeded {
                view.state = spindle_providers::JobState::Failed;
                view.retryable = false;
                view.error = Some(why);
            }
        }
        self.send(
            w.shard,
            ProviderEvent::Finished {
                task: w.task,
                token: w.token,
                view,
            },
        )
        .await;
    }

    /// A callback's body, signature checked by the caller. Final states end the watch; a
    /// callback for a job nobody watches (a duplicate, or one already polled) changes nothing.
    pub async fn on_callback(&self, view: JobView) {
        if !view.state.is_final() {
            self.metrics.callback("progress");
            return;
        }
        let watched = self.lock().contains_key(&view.job_id);
        self.metrics
            .callback(if watched { "final" } else { "ignored" });
        self.finish(view).await;
    }

    pub fn secret(&self) -> &[u8] {
        self.config.secret.as_bytes()
    }

    /// Which API the provider speaks: spindle's callbacks are job views signed with
    /// `x-signature` ([`Dispatcher::on_callback`]); a vendor's go to
    /// [`Dispatcher::on_vendor_callback`].
    pub fn vendor(&self) -> Vendor {
        self.provider.vendor()
    }

    /// A vendor's callback: checked as the vendor signs (and by the token of the URL the node
    /// gave), then taken as a reason to ask — the job named is asked for now, and its end, if
    /// it ended, ends its watch; a resolve waiting for the key hears of the job. The status and
    /// body to answer with.
    pub async fn on_vendor_callback(&self, c: &CallbackIn<'_>) -> (u16, String) {
        let (job_id, key) = match self.provider.callback(self.secret(), c) {
            Err(e) => {
                let (kind, status) = e.kind();
                self.metrics.callback(kind);
                return (status, format!("{e}\n"));
            }
            Ok(Callback::Challenge(echo)) => {
                self.metrics.callback("challenge");
                return (200, echo);
            }
            Ok(Callback::Changed {
                job_id,
                request_key,
            }) => (job_id, request_key),
        };
        if let Some(tx) = self.keyed().waiting.remove(&key) {
            self.metrics.callback("resolved");
            let _ = tx.send(job_id);
            return (200, "ok\n".into());
        }
        let account = self.lock().get(&job_id).map(|w| w.account.clone());
        let Some(account) = account else {
            // No watch yet: the answer to its submit has not come back (or never will).
            self.metrics.callback("ignored");
            self.remember(&key, &job_id);
            return (200, "ok\n".into());
        };
        match self.provider.job(&account, &job_id).await {
            Ok(Lookup::Found(view)) if view.state.is_final() => {
                self.metrics.callback("final");
                self.finish(view).await;
            }
            Ok(_) => self.metrics.callback("progress"),
            // The watch's polls will ask again.
            Err(e) => tracing::warn!("{job_id}: asked after its callback: {e}"),
        }
        (200, "ok\n".into())
    }

    /// The callbacks' window, in ms.
    pub fn callback_window_ms(&self) -> u64 {
        self.config.callback_window_s.saturating_mul(1_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_keeps_the_newest_and_a_key_put_again_keeps_its_own_turn() {
        let mut r = Recent::default();
        r.put("a".into(), 1);
        assert_eq!(r.take("a"), Some(1));
        // Put again after it was taken: the old turn at the front must not drop the new value.
        r.put("a".into(), 2);
        for i in 0..KEYED_MAX - 1 {
            r.put(format!("k{i}"), 0);
        }
        assert_eq!(
            r.take("a"),
            Some(2),
            "dropped by the turn of the value it replaced"
        );
        r.put("b".into(), 3);
        for i in 0..KEYED_MAX {
            r.put(format!("m{i}"), 0);
        }
        assert_eq!(
            r.take("b"),
            None,
            "past KEYED_MAX newer entries the oldest goes"
        );
        assert!(r.entries.len() <= KEYED_MAX && r.order.len() <= KEYED_MAX);
    }
}
