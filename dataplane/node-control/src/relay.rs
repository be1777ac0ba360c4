//! The event relay: the transactional outbox's events (a task claimed, running, requeued,
//! ended: written in the same transaction as the change) go to the platform's endpoint as signed
//! JSON batches, at least once — one relay at a time across the nodes of a cluster
//! (`Db::relay_events`), each task's events in the order its changes happened. A consumer dedupes
//! by event id.
//!
//! ```text
//! POST <events.url>   x-signature: sha256=<hex HMAC-SHA256(events.secret, body)>
//! {"events": [{"id": 4097, "kind": "SUCCEEDED", "task": 12, "tenant": 1, "body": {...}}, ...]}
//! ```
//!
//! A refused or unanswered batch is tried again, with a backoff, until the endpoint takes it;
//! while more than `pending_max` events wait, the node refuses new work as
//! REJECT_PLATFORM_OVERLOADED instead of letting the backlog grow without bound.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spindle_control::events::{Event, EventSink};
use spindle_control::DbConfig;
use spindle_providers::{Webhook, WebhookError};

pub use spindle_node_base::config::EventsConfig;

use spindle_node_base::limits::BACKOFF_MAX;
use spindle_node_base::metrics::Metrics;

/// One event as posted (borrowed from the relay's batch: nothing is copied to write it).
#[derive(serde::Serialize)]
struct Posted<'a> {
    id: u64,
    kind: &'a str,
    task: Option<u64>,
    tenant: Option<u32>,
    body: &'a serde_json::Value,
}

#[derive(serde::Serialize)]
struct Post<'a> {
    events: Vec<Posted<'a>>,
}

/// The body of one post.
pub fn batch_body(events: &[Event]) -> Vec<u8> {
    let post = Post {
        events: events
            .iter()
            .map(|e| Posted {
                id: e.id,
                kind: &e.kind,
                task: e.task.map(|t| t.0),
                tenant: e.tenant.map(|t| t.0),
                body: &e.body,
            })
            .collect(),
    };
    serde_json::to_vec(&post).expect("plain data serializes")
}

struct WebhookSink(Webhook);

impl EventSink for WebhookSink {
    type Error = WebhookError;
    async fn deliver(&mut self, events: &[Event]) -> Result<(), WebhookError> {
        self.0.post(batch_body(events)).await
    }
}

/// How often the pending events are counted (the count reads the pending outbox rows).
const COUNT_EVERY: Duration = Duration::from_secs(1);

/// Runs the relay for the life of the node.
pub async fn run(db_config: DbConfig, config: EventsConfig, metrics: Arc<Metrics>) {
    let made = Webhook::new(
        &config.url,
        config.secret.as_bytes(),
        Duration::from_millis(config.timeout_ms),
    )
    .map_err(anyhow::Error::from)
    .and_then(|hook| Ok(hook.with_tls(&*config.tls()?)));
    let hook = match made {
        Ok(h) => h,
        Err(e) => {
            tracing::error!("event relay not started: {e}");
            return;
        }
    };
    let mut sink = WebhookSink(hook);
    let mut db = crate::control::reconnect(&db_config, &metrics).await;
    let idle = Duration::from_millis(config.idle_ms);
    let mut refusals = 0u32;
    let mut counted: Option<Instant> = None;
    loop {
        if db.is_closed() {
            db = crate::control::reconnect(&db_config, &metrics).await;
        }
        if counted.is_none_or(|at| at.elapsed() >= COUNT_EVERY) {
            counted = Some(Instant::now());
            match db.pending_events().await {
                Ok(n) => {
                    metrics.events_pending.store(n, Ordering::Relaxed);
                    metrics
                        .events_backlogged
                        .store(n > config.pending_max, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!("counting pending events: {e}"),
            }
        }
        let wait = match db.relay_events(&mut sink, config.batch_max).await {
            Ok(r) => match r.failed_at {
                Some((id, why)) => {
                    metrics.events_refused.fetch_add(1, Ordering::Relaxed);
                    refusals = refusals.saturating_add(1);
                    tracing::warn!("event relay: the batch from event {id} was not taken: {why}");
                    backoff(refusals)
                }
                None => {
                    refusals = 0;
                    metrics
                        .events_relayed
                        .fetch_add(u64::from(r.delivered), Ordering::Relaxed);
                    if r.delivered as usize >= config.batch_max {
                        Duration::ZERO
                    } else {
                        idle
                    }
                }
            },
            Err(e) => {
                refusals = refusals.saturating_add(1);
                tracing::warn!("event relay: {e}");
                backoff(refusals)
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// 100 ms doubling per refusal in a row, at most [`BACKOFF_MAX`].
fn backoff(refusals: u32) -> Duration {
    (Duration::from_millis(100) * 2u32.saturating_pow(refusals.clamp(1, 10) - 1)).min(BACKOFF_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_post_carries_each_event_with_its_id_kind_task_tenant_and_body() {
        let events = [Event {
            id: 4097,
            task: Some(spindle_core::TaskId(12)),
            tenant: Some(spindle_core::TenantId(1)),
            kind: "SUCCEEDED".into(),
            body: serde_json::json!({ "cost_actual_milli": 1234, "reason": null }),
        }];
        let posted: serde_json::Value = serde_json::from_slice(&batch_body(&events)).unwrap();
        assert_eq!(
            posted,
            serde_json::json!({ "events": [{
                "id": 4097, "kind": "SUCCEEDED", "task": 12, "tenant": 1,
                "body": { "cost_actual_milli": 1234, "reason": null },
            }]})
        );
    }

    #[test]
    fn backoff_doubles_to_its_cap() {
        let waits: Vec<u64> = (1..=9).map(|n| backoff(n).as_millis() as u64).collect();
        assert_eq!(
            waits,
            [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000]
        );
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }
}
