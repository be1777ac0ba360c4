//! The outbox relay: events written in the same transaction as the change they announce are
//! handed to a sink at least once; a consumer stays idempotent by recording what it took
//! (`consume_once`) in its own transaction.
//!
//! Order: a pass hands out what has committed, in id order. A task's changes commit one after
//! another and each takes its event's id after the one before committed, so each task's events
//! go out in the order they happened. Across tasks, a transaction that took an id and commits
//! after a later id was handed out has its events handed out in the next pass.

use std::future::Future;

use serde_json::Value;
use spindle_core::{TaskId, TaskState, TenantId};

use crate::db::{Call, Db};
use crate::error::{check_text, StoreError};
use crate::limits::{NAME_BYTES_MAX, SCAN_MAX};

#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub id: u64,
    pub task: Option<TaskId>,
    pub tenant: Option<TenantId>,
    pub kind: String,
    pub body: Value,
}

/// Where relayed events go (a webhook, a message bus…). A batch is taken whole or not at all.
pub trait EventSink {
    type Error: std::fmt::Display;
    fn deliver(&mut self, events: &[Event]) -> impl Future<Output = Result<(), Self::Error>>;
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayReport {
    pub delivered: u32,
    /// The sink refused the batch starting at this event: it and everything after it stay
    /// pending, with the sink's reason.
    pub failed_at: Option<(u64, String)>,
}

/// The body of event `i` of an outbox row: each key of the row's details holds an array with
/// one entry per event, or a value every event of the row shares (as the `outbox_event` view reads it).
/// Each array entry belongs to one event only, so it is moved out, not copied.
fn event_body(details: &mut Value, i: usize) -> Value {
    let Value::Object(keys) = details else {
        return Value::Object(Default::default());
    };
    let body = keys
        .iter_mut()
        .map(|(k, v)| {
            let value = match v {
                Value::Array(per_event) => per_event
                    .get_mut(i)
                    .map(std::mem::take)
                    .unwrap_or(Value::Null),
                shared => shared.clone(),
            };
            (k.clone(), value)
        })
        .collect();
    Value::Object(body)
}

/// The advisory lock key that keeps relays one at a time ("spindle relay").
const RELAY_LOCK: i64 = 0x5350_494e_5245_4c41;

/// Events per outbox row at most (a batch of the hot paths; the row's check constraint).
pub const EVENTS_PER_ROW_MAX: u64 = 4096;

/// The outbox rows that hold the first `$1` pending events, found by their counts alone (a row
/// holds up to 4,096 events; their details are read only for the rows sent).
const PENDING_ROWS: &str = "WITH pending AS (
         SELECT batch_id, sum(cardinality(tasks) - delivered)
                    OVER (ORDER BY batch_id) - (cardinality(tasks) - delivered) AS before
           FROM outbox_batch WHERE delivered_at IS NULL ORDER BY batch_id LIMIT $1)
     SELECT b.batch_id, b.kinds, b.tasks, b.tenants, b.details, b.delivered
       FROM pending p JOIN outbox_batch b ON b.batch_id = p.batch_id
      WHERE p.before < $1
      ORDER BY b.batch_id";

impl Db {
    /// Hands up to `limit` pending events to `sink`, as one batch in id order, and records how
    /// far each outbox row got. Events are stored one row per batch (`outbox_batch`, migration
    /// 5); an event's id is its row's id × [`EVENTS_PER_ROW_MAX`] + its position. One relay runs
    /// at a time across every node (a transaction-scoped advisory lock; a relay that does not
    /// get it delivers nothing this pass), so what has committed goes out in id order (see the
    /// module docs). A crash between the delivery and the commit delivers the batch again: at
    /// least once.
    pub async fn relay_events<S: EventSink>(
        &mut self,
        sink: &mut S,
        limit: usize,
    ) -> Result<RelayReport, StoreError> {
        let limit = limit.min(SCAN_MAX);
        // The reads before the delivery and the writes after it, each under its own deadline;
        // the sink bounds its own wait (a transaction idle longer than the server's
        // `idle_in_transaction_session_timeout` is ended by it, and the batch goes again).
        let (read_deadline, write_deadline) = (self.within(4), self.within(2));
        let results_deadline = self.within(1);
        let mut tx = None;
        let rows = read_deadline
            .run(Call::Reads, async {
                let t = tx.insert(self.client_mut().transaction().await?);
                let alone: bool = t
                    .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&RELAY_LOCK])
                    .await?
                    .get(0);
                if !alone {
                    return Ok(None);
                }
                Ok(Some(t.query(PENDING_ROWS, &[&(limit as i64)]).await?))
            })
            .await?;
        let (Some(rows), Some(tx)) = (rows, tx) else {
            return Ok(RelayReport::default());
        };
        let mut events = Vec::new();
        // Per row: (batch id, events delivered with this batch).
        let mut progress: Vec<(i64, i32)> = Vec::with_capacity(rows.len());
        for r in &rows {
            let batch: i64 = r.get(0);
            let kinds: Vec<String> = r.get(1);
            let tasks: Vec<i64> = r.get(2);
            let tenants: Vec<i32> = r.get(3);
            let mut details: Value = r.get(4);
            let mut delivered: i32 = r.get(5);
            let total = tasks.len() as i32;
            while delivered < total && events.len() < limit {
                let i = delivered as usize;
                events.push(Event {
                    id: batch as u64 * EVENTS_PER_ROW_MAX + i as u64,
                    task: Some(TaskId(tasks[i] as u64)),
                    tenant: Some(TenantId(tenants[i] as u32)),
                    kind: kinds[i].clone(),
                    body: event_body(&mut details, i),
                });
                delivered += 1;
            }
            progress.push((batch, delivered));
            if delivered < total {
                break;
            }
        }
        let Some(first) = events.first() else {
            return Ok(RelayReport::default());
        };
        let first_id = first.id;
        // A SUCCEEDED event carries what its task produced (`task.result`, written before the
        // finish that wrote the event).
        let succeeded: Vec<i64> = events
            .iter()
            .filter(|e| e.kind == TaskState::Succeeded.name())
            .filter_map(|e| e.task.map(|t| t.0 as i64))
            .collect();
        if !succeeded.is_empty() {
            let rows = results_deadline
                .run(Call::Reads, async {
                    Ok(tx
                        .query(
                            "SELECT task_id, result FROM task
                              WHERE task_id = ANY ($1) AND result IS NOT NULL",
                            &[&succeeded],
                        )
                        .await?)
                })
                .await?;
            let results: std::collections::HashMap<u64, String> = rows
                .iter()
                .map(|r| (r.get::<_, i64>(0) as u64, r.get(1)))
                .collect();
            for e in &mut events {
                if e.kind != TaskState::Succeeded.name() {
                    continue;
                }
                let result = e.task.and_then(|t| results.get(&t.0));
                if let (Some(result), Value::Object(body)) = (result, &mut e.body) {
                    body.insert("result".into(), crate::report::result_value(result));
                }
            }
        }
        if let Err(e) = sink.deliver(&events).await {
            return Ok(RelayReport {
                delivered: 0,
                failed_at: Some((first_id, e.to_string())),
            });
        }
        let (ids, counts): (Vec<i64>, Vec<i32>) = progress.into_iter().unzip();
        write_deadline
            .run(Call::Writes, async {
                tx.execute(
                    "UPDATE outbox_batch b SET delivered = p.delivered,
                            delivered_at = CASE WHEN p.delivered = cardinality(b.tasks)
                                                THEN now() END
                       FROM unnest($1::bigint[], $2::integer[]) AS p (batch, delivered)
                      WHERE b.batch_id = p.batch",
                    &[&ids, &counts],
                )
                .await?;
                Ok(tx.commit().await?)
            })
            .await?;
        Ok(RelayReport {
            delivered: events.len() as u32,
            failed_at: None,
        })
    }

    /// One bounded pass of event retention: of the `scan` oldest outbox rows, deletes those
    /// created more than `keep` ago that were delivered — or every such row when
    /// `undelivered_too` (no relay will ever take them). Returns the rows deleted.
    pub async fn prune_events(
        &self,
        keep: std::time::Duration,
        undelivered_too: bool,
        scan: usize,
    ) -> Result<u64, StoreError> {
        crate::error::check_scan(scan)?;
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        // The walk reads at most `scan` rows from the oldest (ids grow with time), so a pass
        // never reads the recent part of the table, however much of it there is.
        let n = self
            .answered(
                Call::Writes,
                self.client().execute(
                    "WITH walked AS MATERIALIZED (
                            SELECT batch_id FROM outbox_batch ORDER BY batch_id LIMIT $1)
                        DELETE FROM outbox_batch b USING walked w
                         WHERE b.batch_id = w.batch_id
                           AND b.created_at < now() - $2::bigint * interval '1 millisecond'
                           AND (b.delivered_at IS NOT NULL OR $3)",
                    &[&(scan as i64), &keep_ms, &undelivered_too],
                ),
            )
            .await?;
        Ok(n)
    }

    /// Deletes audit rows older than `keep`, looking at most at the `scan` oldest (ids grow with
    /// time, so a pass never reads the recent part of the log); how many went.
    pub async fn prune_audit(
        &self,
        keep: std::time::Duration,
        scan: usize,
    ) -> Result<u64, StoreError> {
        crate::error::check_scan(scan)?;
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        self.answered(
            Call::Writes,
            self.client().execute(
                "WITH walked AS MATERIALIZED (
                        SELECT audit_id FROM audit_log ORDER BY audit_id LIMIT $1)
                    DELETE FROM audit_log a USING walked w
                     WHERE a.audit_id = w.audit_id
                       AND a.at < now() - $2::bigint * interval '1 millisecond'",
                &[&(scan as i64), &keep_ms],
            ),
        )
        .await
    }

    /// Records that `consumer` took `event`; false when it already had (skip the effect).
    pub async fn consume_once(&self, consumer: &str, event: u64) -> Result<bool, StoreError> {
        check_text(0, "consumer", consumer, NAME_BYTES_MAX)?;
        let n = self
            .answered(
                Call::Writes,
                self.client().execute(
                    "INSERT INTO consumed_event (consumer, event_id) VALUES ($1, $2)
                     ON CONFLICT DO NOTHING",
                    &[&consumer, &(event as i64)],
                ),
            )
            .await?;
        Ok(n == 1)
    }

    /// Events not yet delivered.
    pub async fn pending_events(&self) -> Result<u64, StoreError> {
        let n: i64 = self
            .answered(
                Call::Reads,
                self.client().query_one(
                    "SELECT coalesce(sum(cardinality(tasks) - delivered), 0)::bigint
                       FROM outbox_batch WHERE delivered_at IS NULL",
                    &[],
                ),
            )
            .await?
            .get(0);
        Ok(n as u64)
    }
}
