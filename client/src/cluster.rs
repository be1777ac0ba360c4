//! A client of a cluster of nodes: one connection at a time, to the node that serves the
//! tenant, replaced when it fails. A request that meets the connection's end, a node that no
//! longer serves the tenant (its partition moved), a draining node, a PostgreSQL the node cannot
//! reach or a request left unanswered is sent again — on a fresh connection found through the
//! seeds, pausing between tries; no try starts past the client's failover window (longer than
//! a partition's lease, so that another node has taken a dead node's partitions over by then).
//!
//! Sending again is safe for every request this client makes: a submit carries its
//! idempotency key (the node answers a replay with the first admission), a cancel is stored
//! once, a read changes nothing.
//!
//! Subscriptions move with the connection: a fresh one subscribes again to every task still
//! subscribed, and the node's first event for each is its state then. A task that ended while
//! no connection was up is read (`GetTask`) and its end given as an event of its own, stamped
//! with this machine's clock; one stored as not ended that the new node does not hold live
//! within about a second is given as its state then and no longer followed (subscribe again,
//! or read it). So events after a failover start from each task's current state: a state may
//! come twice, and the milestones passed during the gap are not replayed.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use spindle_core::{TaskId, TaskState, TenantId};
use spindle_wire::{Admission, ErrorCode, Event, SubmitTask, TaskStatus, WireError};

use crate::{Client, ClientError};

/// How long a request keeps failing over by default: past the default partition lease (30 s)
/// with room for the takeover.
pub const FAILOVER_WITHIN: Duration = Duration::from_secs(60);

/// The first pause between two tries; each pause doubles, up to [`FAILOVER_PAUSE_MAX`].
const FAILOVER_PAUSE: Duration = Duration::from_millis(50);
const FAILOVER_PAUSE_MAX: Duration = Duration::from_secs(2);

/// Seeds a cluster client takes (each is tried in turn at every failover).
pub const SEEDS_MAX: usize = 64;

/// Rounds of subscribing again to a task stored as not ended but not live on the new
/// connection's node yet, [`RESUBSCRIBE_PAUSE`] apart.
const RESUBSCRIBE_TRIES: u32 = 10;
const RESUBSCRIBE_PAUSE: Duration = Duration::from_millis(100);

/// A task's status as an event, stamped with this machine's clock.
fn event_of(status: TaskStatus) -> Event {
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Event {
        task: status.task,
        state: status.state,
        progress_pct: status.progress_pct,
        at_ms,
        result: status.result,
    }
}

/// Tasks a cluster client keeps subscribed across failovers by default (a node holds at most
/// 100,000 subscriptions per shard); [`ClusterClient::with_subscriptions_max`] lowers it.
pub const CLUSTER_SUBSCRIPTIONS_MAX: usize = 100_000;

pub struct ClusterClient {
    seeds: Vec<String>,
    tenant: TenantId,
    credential: String,
    /// Where the nodes' ports speak TLS: what their certificates are checked against.
    tls: Option<crate::Tls>,
    failover_within: Duration,
    /// Tasks kept subscribed at most.
    subscriptions_max: usize,
    /// The connection in use; `None` once it failed, until the next request connects again.
    current: tokio::sync::Mutex<Option<Arc<Client>>>,
    /// Connections replaced after a failure.
    failovers: AtomicU64,
    /// Counts the connections made: [`ClusterClient::next_event`] listens on the newest.
    generation: tokio::sync::watch::Sender<u64>,
    /// Tasks subscribed to and not yet ended.
    subscribed: Mutex<HashSet<TaskId>>,
    /// Ends of subscribed tasks read after a failover, given before the connection's events.
    caught_up: Mutex<VecDeque<Event>>,
}

/// Whether a request that failed with `e` is tried again on a fresh connection.
fn fails_over(e: &ClientError) -> bool {
    match e {
        ClientError::Io(_) | ClientError::Closed | ClientError::Timeout(_) => true,
        // Overloaded: the node holds its most connections; one may free within the window.
        ClientError::Refused(w) => matches!(
            w.code,
            ErrorCode::WrongNode
                | ErrorCode::Draining
                | ErrorCode::Unavailable
                | ErrorCode::Overloaded
        ),
        ClientError::Protocol(_) | ClientError::Unexpected(_) => false,
    }
}

impl ClusterClient {
    /// Connects as `tenant` through `seeds` (client addresses of any of the cluster's nodes,
    /// "host:port"), failing over for at most [`FAILOVER_WITHIN`].
    pub async fn connect(
        seeds: &[String],
        tenant: TenantId,
        credential: &str,
    ) -> Result<ClusterClient, ClientError> {
        ClusterClient::connect_within(seeds, tenant, credential, FAILOVER_WITHIN).await
    }

    /// [`ClusterClient::connect`] with another failover window (the connect itself included).
    pub async fn connect_within(
        seeds: &[String],
        tenant: TenantId,
        credential: &str,
        failover_within: Duration,
    ) -> Result<ClusterClient, ClientError> {
        ClusterClient::connect_with(seeds, tenant, credential, failover_within, None).await
    }

    /// [`ClusterClient::connect_within`] over TLS when `tls` is given, on every connection it
    /// makes ([`Client::connect_cluster_with`]).
    pub async fn connect_with(
        seeds: &[String],
        tenant: TenantId,
        credential: &str,
        failover_within: Duration,
        tls: Option<crate::Tls>,
    ) -> Result<ClusterClient, ClientError> {
        if seeds.is_empty() || seeds.len() > SEEDS_MAX {
            return Err(ClientError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "a cluster client takes 1..={SEEDS_MAX} seeds, not {}",
                    seeds.len()
                ),
            )));
        }
        let client = ClusterClient {
            seeds: seeds.to_vec(),
            tenant,
            credential: credential.to_string(),
            tls,
            failover_within,
            subscriptions_max: CLUSTER_SUBSCRIPTIONS_MAX,
            current: tokio::sync::Mutex::new(None),
            failovers: AtomicU64::new(0),
            generation: tokio::sync::watch::Sender::new(0),
            subscribed: Mutex::new(HashSet::new()),
            caught_up: Mutex::new(VecDeque::new()),
        };
        client.call(async |_| Ok(())).await?;
        Ok(client)
    }

    /// Keeps at most `max` tasks subscribed (at most [`CLUSTER_SUBSCRIPTIONS_MAX`]): past it,
    /// [`ClusterClient::subscribe`] to another task is refused `TooManySubscriptions` until
    /// one of them ends.
    pub fn with_subscriptions_max(mut self, max: usize) -> ClusterClient {
        self.subscriptions_max = max.min(CLUSTER_SUBSCRIPTIONS_MAX);
        self
    }

    /// The connection in use now (connecting if none is): for subscriptions and their events,
    /// and for what the node announced.
    pub async fn client(&self) -> Result<Arc<Client>, ClientError> {
        self.call(async |c| Ok(c)).await
    }

    /// Connections replaced after a failure so far.
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// [`Client::submit`], failing over (sent again with its idempotency key).
    pub async fn submit(&self, task: SubmitTask) -> Result<Admission, ClientError> {
        self.call(async |c| c.submit(task.clone()).await).await
    }

    /// [`Client::submit_batch`], failing over (sent again whole, every key with it).
    pub async fn submit_batch(
        &self,
        tasks: Vec<SubmitTask>,
    ) -> Result<Vec<Admission>, ClientError> {
        self.call(async |c| c.submit_batch(tasks.clone()).await)
            .await
    }

    /// [`Client::get`], failing over.
    pub async fn get(&self, task: TaskId) -> Result<TaskStatus, ClientError> {
        self.call(async |c| c.get(task).await).await
    }

    /// [`Client::cancel`], failing over (a cancel is stored once).
    pub async fn cancel(&self, task: TaskId) -> Result<TaskState, ClientError> {
        self.call(async |c| c.cancel(task).await).await
    }

    /// Subscribes to `task`'s events, on this connection and every later one, until the task
    /// ends. A task subscribed already is asked for again, not counted twice.
    pub async fn subscribe(&self, task: TaskId) -> Result<(), ClientError> {
        // Kept before it is asked for, so that a failover in between subscribes the new
        // connection too (at worst twice: the same events twice, never none); counted and
        // kept under one lock, so that subscribes at once never pass the bound together.
        let fresh = {
            let mut subscribed = self.subscribed.lock().expect("subscribed");
            if !subscribed.contains(&task) && subscribed.len() >= self.subscriptions_max {
                return Err(ClientError::Refused(WireError::new(
                    ErrorCode::TooManySubscriptions,
                    format!(
                        "a cluster client keeps at most {} subscriptions (task {task} refused \
                         until one of them ends)",
                        self.subscriptions_max
                    ),
                )));
            }
            subscribed.insert(task)
        };
        let asked = self.call(async |c| c.subscribe(task).await).await;
        if asked.is_err() && fresh {
            self.subscribed.lock().expect("subscribed").remove(&task);
        }
        asked
    }

    /// The next event of any subscription, across failovers; an error once no connection
    /// could be made within the failover window.
    pub async fn next_event(&self) -> Result<Event, ClientError> {
        loop {
            if let Some(e) = self.caught_up.lock().expect("caught up").pop_front() {
                return Ok(e);
            }
            // Watched before the connection is taken: a replacement from here on is seen.
            let mut replaced = self.generation.subscribe();
            let c = self.client().await?;
            tokio::select! {
                event = c.next_event() => match event {
                    Some(e) => {
                        if e.state.is_terminal() {
                            self.subscribed.lock().expect("subscribed").remove(&e.task);
                        }
                        return Ok(e);
                    }
                    // The connection ended: the next turn makes another.
                    None => self.forget(&c).await,
                },
                _ = replaced.changed() => {}
            }
        }
    }

    /// Subscribes `c`, a fresh connection, to every task still subscribed. A task not live on
    /// it is read: an ended one's end is queued as an event; one stored as not ended (being put
    /// back on that node) is asked for again a few times ([`RESUBSCRIBE_TRIES`]), and past them
    /// its current state is queued and it is no longer followed.
    async fn resubscribe(&self, c: &Client) -> Result<(), ClientError> {
        let mut tasks: Vec<TaskId> = self
            .subscribed
            .lock()
            .expect("subscribed")
            .iter()
            .copied()
            .collect();
        for round in 1..=RESUBSCRIBE_TRIES {
            let mut not_yet = Vec::new();
            for task in tasks {
                match c.subscribe(task).await {
                    Ok(()) => continue,
                    Err(ClientError::Refused(e)) if e.code == ErrorCode::NotFound => {}
                    Err(e) => return Err(e),
                }
                let status = match c.get(task).await {
                    Ok(status) => status,
                    // Gone for this tenant (pruned): nothing more will come of it.
                    Err(ClientError::Refused(e)) if e.code == ErrorCode::NotFound => {
                        self.subscribed.lock().expect("subscribed").remove(&task);
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                if status.state.is_terminal() || round == RESUBSCRIBE_TRIES {
                    self.subscribed.lock().expect("subscribed").remove(&task);
                    self.caught_up
                        .lock()
                        .expect("caught up")
                        .push_back(event_of(status));
                } else {
                    not_yet.push(task);
                }
            }
            if not_yet.is_empty() {
                break;
            }
            tasks = not_yet;
            tokio::time::sleep(RESUBSCRIBE_PAUSE).await;
        }
        Ok(())
    }

    /// Runs `request` on the connection in use, failing over as the module says.
    async fn call<T>(
        &self,
        request: impl AsyncFn(Arc<Client>) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let deadline = tokio::time::Instant::now() + self.failover_within;
        let mut pause = FAILOVER_PAUSE;
        loop {
            let failed = match self.connection().await {
                Ok(c) => match request(c.clone()).await {
                    Err(e) if fails_over(&e) => {
                        self.forget(&c).await;
                        e
                    }
                    done => return done,
                },
                Err(e) if fails_over(&e) => e,
                Err(e) => return Err(e),
            };
            if tokio::time::Instant::now() + pause > deadline {
                return Err(failed);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(FAILOVER_PAUSE_MAX);
        }
    }

    /// The connection in use, or a new one: each seed in turn, following redirects; the last
    /// seed's failure if none serves.
    async fn connection(&self) -> Result<Arc<Client>, ClientError> {
        let mut current = self.current.lock().await;
        if let Some(c) = current.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        if current.take().is_some() {
            self.failovers.fetch_add(1, Ordering::Relaxed);
        }
        let mut failed = None;
        for seed in &self.seeds {
            let connected = Client::connect_cluster_with(
                seed,
                self.tenant,
                &self.credential,
                self.tls.as_ref(),
            );
            let made = match connected.await {
                Ok(c) => self.resubscribe(&c).await.map(|()| c),
                Err(e) => Err(e),
            };
            match made {
                Ok(c) => {
                    let c = Arc::new(c);
                    *current = Some(c.clone());
                    self.generation.send_modify(|g| *g += 1);
                    return Ok(c);
                }
                Err(e) if fails_over(&e) => failed = Some(e),
                // A wrong credential, a suspended tenant: no other node answers otherwise.
                Err(e) => return Err(e),
            }
        }
        Err(failed.expect("at least one seed"))
    }

    /// Drops `failed` as the connection in use (unless another request replaced it already).
    async fn forget(&self, failed: &Arc<Client>) {
        let mut current = self.current.lock().await;
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, failed)) {
            *current = None;
            self.failovers.fetch_add(1, Ordering::Relaxed);
        }
    }
}
