//! The outbox relay: events written in the same transaction as the change they announce are
//! handed to a sink at least once, in id order; a consumer stays idempotent by recording what it
//! took (`consume_once`) in its own transaction.

use std::future::Future;

use serde_json::Value;
use spindle_core::{TaskId, TenantId};

use crate::db::Db;
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

/// Where relayed events go (the node's subscription hub, a message bus…).
pub trait EventSink {
    type Error: std::fmt::Display;
    fn deliver(&mut self, event: &Event) -> impl Future<Output = Result<(), Self::Error>>;
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayReport {
    pub delivered: u32,
    /// The sink failed on this event: it and everything after it stay pending.
    pub failed_at: Option<u64>,
}

impl Db {
    /// Hands up to `limit` pending events to `sink` in id order and marks those it took as
    /// delivered. Rows are locked SKIP LOCKED so two relays never hand out the same event at
    /// once; a crash between delivery and commit delivers again (at least once).
    pub async fn relay_events<S: EventSink>(
        &mut self,
        sink: &mut S,
        limit: usize,
    ) -> Result<RelayReport, StoreError> {
        let tx = self.client_mut().transaction().await?;
        let rows = tx
            .query(
                "SELECT event_id, task_id, tenant_id, kind, body FROM outbox_event
                  WHERE delivered_at IS NULL ORDER BY event_id LIMIT $1 FOR UPDATE SKIP LOCKED",
                &[&(limit.min(SCAN_MAX) as i64)],
            )
            .await?;
        let mut report = RelayReport::default();
        let mut delivered: Vec<i64> = Vec::with_capacity(rows.len());
        for r in &rows {
            let event = Event {
                id: r.get::<_, i64>(0) as u64,
                task: r.get::<_, Option<i64>>(1).map(|t| TaskId(t as u64)),
                tenant: r.get::<_, Option<i32>>(2).map(|t| TenantId(t as u32)),
                kind: r.get(3),
                body: r.get(4),
            };
            if sink.deliver(&event).await.is_err() {
                report.failed_at = Some(event.id);
                break;
            }
            delivered.push(event.id as i64);
        }
        tx.execute(
            "UPDATE outbox_event SET delivered_at = now() WHERE event_id = ANY ($1)",
            &[&delivered],
        )
        .await?;
        tx.commit().await?;
        report.delivered = delivered.len() as u32;
        Ok(report)
    }

    /// Records that `consumer` took `event`; false when it already had (skip the effect).
    pub async fn consume_once(&self, consumer: &str, event: u64) -> Result<bool, StoreError> {
        check_text(0, "consumer", consumer, NAME_BYTES_MAX)?;
        let n = self
            .client()
            .execute(
                "INSERT INTO consumed_event (consumer, event_id) VALUES ($1, $2)
                 ON CONFLICT DO NOTHING",
                &[&consumer, &(event as i64)],
            )
            .await?;
        Ok(n == 1)
    }

    /// Events not yet delivered.
    pub async fn pending_events(&self) -> Result<u64, StoreError> {
        let n: i64 = self
            .client()
            .query_one(
                "SELECT count(*) FROM outbox_event WHERE delivered_at IS NULL",
                &[],
            )
            .await?
            .get(0);
        Ok(n as u64)
    }
}
