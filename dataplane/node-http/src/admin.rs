//! The admin API on the node's HTTP port (not the client protocol port): read the policy and
//! the audit log, change policy objects, requeue FAILED tasks, rebuild the pool counters, drain
//! the node. Bearer tokens from the configuration
//! carry a role — `viewer` reads, `operator` changes tenants and lanes, `admin` changes
//! everything and drains. Every change needs a reason and goes through the control plane's
//! policy store (new version, object row and audit row in one transaction); every refused call
//! is audited as refused.
//!
//! Long file: one handler per admin route, each with its checks and its audit row.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value};
use spindle_control::policy::{PolicyChange, PolicyObject};
use spindle_control::query::StoredTask;
use spindle_control::{Db, DbConfig};
use spindle_core::{TaskId, TenantId};

use spindle_node_base::config::partition_of;
pub use spindle_node_base::config::{AdminToken, Role};

pub use spindle_node_base::limits::CANCEL_TASKS_MAX;
use spindle_node_base::metrics::Metrics;
use spindle_node_control::live_policy::LivePolicy;

/// What the admin endpoints share.
pub struct Admin {
    tokens: Vec<AdminToken>,
    db_config: DbConfig,
    db: tokio::sync::Mutex<Option<Db>>,
    metrics: Arc<Metrics>,
    live: Arc<LivePolicy>,
    shards: Shards,
    /// Calls without a valid token, or past their token's role: counted, and a few a second
    /// logged (never one audit row each: anyone can send them).
    refusals_logged: std::sync::Mutex<spindle_core::ledger::TokenBucket>,
}

/// Refused calls logged a second (a second's worth at once); the rest only counted.
const REFUSALS_LOGGED_PER_S: u64 = 5;

/// How the admin API reaches the shards: requeued tasks go back to the shard that owns them.
pub struct Shards {
    pub config: spindle_node_base::config::Config,
    pub ownership: Arc<spindle_node_base::ownership::Ownership>,
    pub inboxes: Vec<tokio::sync::mpsc::Sender<spindle_node_base::messages::ShardMsg>>,
}

/// An admin answer: HTTP status line and JSON body.
pub type Answer = (&'static str, String);

fn answer(status: &'static str, body: Value) -> Answer {
    (status, format!("{body}\n"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChangeBody {
    reason: String,
    /// The object's new body; absent: delete it.
    #[serde(default)]
    body: Option<Value>,
}

/// A body that is only a reason (drain, counter rebuild).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReasonBody {
    reason: String,
}

/// `{tasks, reason}`: a requeue's or an operator's cancel.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TasksBody {
    tasks: Vec<u64>,
    reason: String,
}

impl TasksBody {
    fn ids(&self) -> Vec<spindle_core::TaskId> {
        self.tasks
            .iter()
            .copied()
            .map(spindle_core::TaskId)
            .collect()
    }
}

/// Every admin route: its method, its path (`{name}`: any one segment) and the least role it
/// needs (a policy object's kind may need more: `needed_role`). `docs/admin-openapi.yaml`
/// describes these routes and no others (a test compares both ways).
pub const ROUTES: [(&str, &str, Role); 13] = [
    ("GET", "/admin/v1/policy", Role::Viewer),
    ("GET", "/admin/v1/audit", Role::Viewer),
    ("GET", "/admin/v1/counters", Role::Viewer),
    ("GET", "/admin/v1/tasks/{task}", Role::Viewer),
    ("GET", "/admin/v1/dead-letters", Role::Viewer),
    ("GET", "/admin/v1/quotas/{tenant}", Role::Viewer),
    ("POST", "/admin/v1/quotas/{tenant}/reset", Role::Operator),
    ("PUT", "/admin/v1/policy/{object}/{key}", Role::Operator),
    ("DELETE", "/admin/v1/policy/{object}/{key}", Role::Operator),
    ("POST", "/admin/v1/drain", Role::Admin),
    ("POST", "/admin/v1/tasks/requeue", Role::Operator),
    ("POST", "/admin/v1/tasks/cancel", Role::Operator),
    ("POST", "/admin/v1/counters/rebuild", Role::Admin),
];

/// Whether `segments` (a path split at `/`, without the leading one) fit `template`.
fn fits(template: &str, segments: &[&str]) -> bool {
    let parts: Vec<&str> = template.trim_matches('/').split('/').collect();
    parts.len() == segments.len()
        && parts
            .iter()
            .zip(segments)
            .all(|(p, s)| p.starts_with('{') || p == s)
}

/// The role route `what` (`method` and its path's `segments`) needs, or the answer to a route
/// that does not exist. Tenant policies and lanes are an operator's to change; provider
/// accounts and model capabilities an admin's.
fn needed_role(method: &str, segments: &[&str], what: &str) -> Result<Role, Answer> {
    let not_found = |error: String| Err(answer("404 Not Found", json!({ "error": error })));
    let Some(&(_, _, role)) = ROUTES
        .iter()
        .find(|(m, template, _)| *m == method && fits(template, segments))
    else {
        return not_found(what.to_string());
    };
    match (method, segments) {
        ("PUT" | "DELETE", ["admin", "v1", "policy", kind, _]) => match object(kind) {
            Some(PolicyObject::Tenant | PolicyObject::Lane) => Ok(role),
            Some(_) => Ok(Role::Admin),
            None => not_found(format!("no policy object kind {kind:?}")),
        },
        _ => Ok(role),
    }
}

fn object(name: &str) -> Option<PolicyObject> {
    PolicyObject::ALL.into_iter().find(|o| o.name() == name)
}

impl Admin {
    pub fn new(
        tokens: Vec<AdminToken>,
        db_config: DbConfig,
        metrics: Arc<Metrics>,
        live: Arc<LivePolicy>,
        shards: Shards,
    ) -> Admin {
        Admin {
            tokens,
            db_config,
            db: tokio::sync::Mutex::new(None),
            metrics,
            live,
            shards,
            refusals_logged: std::sync::Mutex::new(spindle_core::ledger::TokenBucket::new(
                spindle_core::policy::RateSpec {
                    per_minute: REFUSALS_LOGGED_PER_S * 60,
                    burst: REFUSALS_LOGGED_PER_S,
                },
                spindle_core::Time::ZERO,
            )),
        }
    }

    /// Whether `token` is one of the configured ones (the dashboard's sign-in checks it
    /// before it keeps it in a cookie).
    pub fn knows(&self, token: &str) -> bool {
        self.holder(Some(&format!("Bearer {token}"))).is_some()
    }

    /// A call refused before any holder could be trusted with it (no valid token, or past its
    /// token's role): counted by why, logged while the sample allows — with the client's path
    /// escaped — and answered. Nothing is written to PostgreSQL.
    fn turn_away(&self, status: &'static str, why: &str, what: &str, detail: String) -> Answer {
        let i = usize::from(status.starts_with("403"));
        self.metrics.admin_refused[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let now = spindle_core::Time::of(std::time::Instant::now(), self.metrics.started);
        let logged = self
            .refusals_logged
            .lock()
            .map(|mut b| b.take_one(now).is_ok())
            .unwrap_or(false);
        if logged {
            tracing::warn!(status, why, "admin call refused: {what:?}: {detail}");
        }
        answer(status, json!({ "error": detail }))
    }

    /// The token's holder, compared in constant time against every configured token.
    fn holder(&self, authorization: Option<&str>) -> Option<&AdminToken> {
        let presented = authorization?.strip_prefix("Bearer ")?.trim();
        let mut found = None;
        for t in &self.tokens {
            if spindle_node_base::credential::matches_configured(&t.token, presented) {
                found = Some(t);
            }
        }
        found
    }

    async fn with_db<T>(
        &self,
        f: impl AsyncFnOnce(&mut Db) -> Result<T, spindle_control::StoreError>,
    ) -> Result<T, spindle_control::StoreError> {
        let mut slot = self.db.lock().await;
        if slot.as_ref().is_none_or(Db::is_closed) {
            *slot = Some(Db::open(&self.db_config).await?);
        }
        f(slot.as_mut().expect("opened above")).await
    }

    /// The shard inbox of `tenant` when this node serves it; else the answer that says who does.
    fn serving(
        &self,
        tenant: &str,
    ) -> Result<
        (
            spindle_core::TenantId,
            &tokio::sync::mpsc::Sender<spindle_node_base::messages::ShardMsg>,
        ),
        Answer,
    > {
        let config = &self.shards.config;
        let Some(tenant) = tenant
            .parse::<u32>()
            .ok()
            .filter(|t| config.tenants.iter().any(|c| c.id == *t))
        else {
            let why = format!("{tenant:?} is not a tenant of this node's configuration");
            return Err(answer("404 Not Found", json!({ "error": why })));
        };
        let partition = spindle_node_base::config::partition_of(tenant, config.partitions);
        if !self.shards.ownership.owns(partition) {
            let owner = self.shards.ownership.owner_of(partition);
            let why = match &owner {
                Some(node) => format!("tenant {tenant} is served by node {node}: ask it"),
                None => format!("tenant {tenant}'s partition is not served now"),
            };
            return Err(answer(
                "409 Conflict",
                json!({ "error": why, "node": owner }),
            ));
        }
        let inbox = &self.shards.inboxes[config.shard_of(tenant)];
        Ok((spindle_core::TenantId(tenant), inbox))
    }

    /// `GET /admin/v1/quotas/{tenant}`: each of its quotas with what is consumed of it in the
    /// running period and when that ends, from the node that serves it.
    async fn quotas(&self, tenant: &str) -> Answer {
        let (tenant, inbox) = match self.serving(tenant) {
            Ok(s) => s,
            Err(answer) => return answer,
        };
        let (reply, report) = tokio::sync::oneshot::channel();
        let asked = inbox
            .send(spindle_node_base::messages::ShardMsg::Quotas { tenant, reply })
            .await;
        let (Ok(()), Ok((now_ms, report))) = (asked, report.await) else {
            return answer(
                "503 Service Unavailable",
                json!({ "error": "a shard stopped" }),
            );
        };
        let quotas: Vec<Value> = report
            .iter()
            .map(|r| {
                let mut q = serde_json::to_value(r.quota).unwrap_or(Value::Null);
                q["used_cost_milli"] = r.cost_milli.into();
                q["used_tasks"] = r.tasks.into();
                if r.quota.scope == spindle_core::quota::QuotaScope::User {
                    q["users_counted"] = r.users.into();
                }
                q["resets_at"] = spindle_core::quota::utc_text(r.resets_at_ms).into();
                q
            })
            .collect();
        answer(
            "200 OK",
            json!({
                "tenant": tenant.0,
                "at": spindle_core::quota::utc_text(now_ms),
                "quotas": quotas,
            }),
        )
    }

    /// `POST /admin/v1/quotas/{tenant}/reset {reason}`: the tenant's quota counts start again
    /// from zero; nothing submitted before now counts again, here or on the next node to serve
    /// it (the floor is stored, and audited with the reason).
    async fn reset_quotas(&self, tenant: &str, actor: &str, what: &str, body: &[u8]) -> Answer {
        let Ok(request) = serde_json::from_slice::<ReasonBody>(body) else {
            let why = "expected {reason}".to_string();
            return self.refuse("400 Bad Request", actor, what, why).await;
        };
        if request.reason.trim().is_empty() {
            let why = "a reset needs a reason".to_string();
            return self.refuse("400 Bad Request", actor, what, why).await;
        }
        let (tenant, inbox) = match self.serving(tenant) {
            Ok(s) => s,
            Err(answer) => return answer,
        };
        let stored = self
            .with_db(async |db| db.reset_quotas(tenant, actor, &request.reason).await)
            .await;
        let at = match stored {
            Ok(at) => at,
            Err(e) => return answer("503 Service Unavailable", json!({ "error": e.to_string() })),
        };
        let floor_unix_ms = at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let (reply, done) = tokio::sync::oneshot::channel();
        let sent = inbox
            .send(spindle_node_base::messages::ShardMsg::ResetQuotas {
                tenant,
                floor_unix_ms,
                reply,
            })
            .await;
        if sent.is_err() || done.await.is_err() {
            return answer(
                "503 Service Unavailable",
                json!({ "error": "a shard stopped" }),
            );
        }
        answer(
            "200 OK",
            json!({ "tenant": tenant.0, "reset_at": spindle_core::quota::utc_text(floor_unix_ms) }),
        )
    }

    /// Refuses a call and audits the refusal.
    async fn refuse(&self, status: &'static str, actor: &str, what: &str, why: String) -> Answer {
        if let Err(e) = self
            .with_db(async |db| db.audit_refusal(actor, what, &why).await)
            .await
        {
            tracing::warn!("auditing a refused admin call: {e}");
        }
        answer(status, json!({ "error": why }))
    }

    /// Handles `method path` with `body`; `authorization` is the request's header.
    pub async fn handle(
        &self,
        method: &str,
        path: &str,
        authorization: Option<&str>,
        body: &[u8],
    ) -> Answer {
        let what = format!("{method} {}", path.split('?').next().unwrap_or(path));
        let Some(holder) = self.holder(authorization) else {
            return self.turn_away(
                "401 Unauthorized",
                "anonymous",
                &what,
                "no valid admin token".into(),
            );
        };
        let segments: Vec<&str> = path
            .split('?')
            .next()
            .unwrap_or("")
            .trim_matches('/')
            .split('/')
            .collect();
        let needed = match needed_role(method, &segments, &what) {
            Ok(role) => role,
            Err(refused) => return refused,
        };
        if holder.role < needed {
            let why = format!(
                "{} is {:?}; {what} needs {needed:?}",
                holder.name, holder.role
            );
            return self.turn_away("403 Forbidden", "role", &what, why);
        }
        let actor = holder.name.clone();
        match (method, segments.as_slice()) {
            ("GET", [_, _, "policy"]) => {
                match self.with_db(async |db| db.policy_snapshot().await).await {
                    Ok((version, rows)) => answer(
                        "200 OK",
                        json!({
                            "version": version.0,
                            // What this node runs with: the configuration and the store's
                            // objects over it, at the version it last applied.
                            "effective": &*self.live.current(),
                            "objects": rows.iter().map(|r| json!({
                                "object": r.object.name(),
                                "key": r.key,
                                "version": r.version.0,
                                "body": r.body,
                            })).collect::<Vec<_>>(),
                        }),
                    ),
                    Err(e) => answer("503 Service Unavailable", json!({ "error": e.to_string() })),
                }
            }
            ("GET", [_, _, "audit"]) => self.audit(path).await,
            (_, [_, _, "policy", kind, key]) => {
                self.change_policy(method, kind, key, actor, &what, body)
                    .await
            }
            ("GET", [_, _, "quotas", tenant]) => self.quotas(tenant).await,
            ("POST", [_, _, "quotas", tenant, "reset"]) => {
                self.reset_quotas(tenant, &actor, &what, body).await
            }
            ("POST", [_, _, "tasks", "requeue"]) => self.requeue(&actor, &what, body).await,
            ("POST", [_, _, "tasks", "cancel"]) => self.cancel(&actor, &what, body).await,
            ("POST", [_, _, "counters", "rebuild"]) => {
                self.rebuild_counters(&actor, &what, body).await
            }
            ("GET", [_, _, "dead-letters"]) => self.dead_letters(path).await,
            ("GET", [_, _, "tasks", id]) => self.stored_task(id).await,
            ("GET", [_, _, "counters"]) => {
                // The nodes' periodic check, on demand: read-only, nothing locked or repaired.
                match self.with_db(async |db| db.check_counters().await).await {
                    Ok(drift) => {
                        let (pools, budgets) = drift_json(&drift);
                        answer(
                            "200 OK",
                            json!({ "drifted": pools, "budgets_drifted": budgets }),
                        )
                    }
                    Err(e) => answer("503 Service Unavailable", json!({ "error": e.to_string() })),
                }
            }
            ("POST", [_, _, "drain"]) => {
                let drain = match serde_json::from_slice::<ReasonBody>(body) {
                    Ok(d) if !d.reason.trim().is_empty() => d,
                    _ => {
                        return answer(
                            "400 Bad Request",
                            json!({ "error": "expected {reason} with a reason" }),
                        )
                    }
                };
                let reason = format!("drain: {}", drain.reason);
                let audited = self
                    .with_db(async |db| db.audit_action(&actor, "node", "drain", &reason).await)
                    .await;
                if let Err(e) = audited {
                    return answer("503 Service Unavailable", json!({ "error": e.to_string() }));
                }
                self.metrics
                    .stopping
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!("drain: {reason:?} (by {:?})", holder.name);
                answer("200 OK", json!({ "draining": true }))
            }
            _ => answer("404 Not Found", json!({ "error": what })),
        }
    }

    /// `GET /admin/v1/audit?limit=N`: the newest audit rows (50 by default, 1,000 at most).
    async fn audit(&self, path: &str) -> Answer {
        let limit = query_param(path, "limit")
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(50)
            .min(1_000);
        match self.with_db(async |db| db.audit_log(limit).await).await {
            Ok(entries) => answer(
                "200 OK",
                json!(entries
                    .iter()
                    .map(|e| json!({
                        "actor": e.actor,
                        "object": e.object,
                        "key": e.key,
                        "old": e.old,
                        "new": e.new,
                        "reason": e.reason,
                        "version": e.version.0,
                        "at_ms": e.at.duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_millis() as u64),
                    }))
                    .collect::<Vec<_>>()),
            ),
            Err(e) => answer("503 Service Unavailable", json!({ "error": e.to_string() })),
        }
    }

    /// `GET /admin/v1/dead-letters?after=ID&scan=N`: a page of FAILED tasks.
    async fn dead_letters(&self, path: &str) -> Answer {
        // A page of FAILED tasks: `after` (a task id, 0 to start), `scan` (rows read).
        let after = query_param(path, "after")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let scan = query_param(path, "scan")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(spindle_control::limits::SCAN_MAX)
            .clamp(1, spindle_control::limits::SCAN_MAX);
        let after = spindle_core::TaskId(after);
        match self
            .with_db(async |db| db.failed_tasks(after, scan).await)
            .await
        {
            Ok((tasks, next)) => answer(
                "200 OK",
                json!({
                    "tasks": tasks.iter().map(|(tenant, t)| task_json(*tenant, t)).collect::<Vec<_>>(),
                    "next_after": next.map(|t| t.0),
                }),
            ),
            Err(e) => answer("503 Service Unavailable", json!({ "error": e.to_string() })),
        }
    }

    /// `GET /admin/v1/tasks/ID`: any tenant's task as stored.
    async fn stored_task(&self, id: &str) -> Answer {
        // Any tenant's task as stored (what an operator looks at before a requeue).
        let Some(id) = id.parse::<u64>().ok().filter(|&id| id > 0) else {
            let why = format!("{id:?} is not a task id");
            return answer("400 Bad Request", json!({ "error": why }));
        };
        let task = spindle_core::TaskId(id);
        match self
            .with_db(async |db| db.task_statuses(&[task]).await)
            .await
        {
            Ok(found) => match found.into_iter().next() {
                Some((tenant, t)) => answer("200 OK", task_json(tenant, &t)),
                None => answer(
                    "404 Not Found",
                    json!({ "error": format!("task {id} not found") }),
                ),
            },
            Err(e) => answer("503 Service Unavailable", json!({ "error": e.to_string() })),
        }
    }

    /// `PUT` or `DELETE` of policy object `kind` `key` with `{reason, body}`: checked as the
    /// node would take it, then stored with its audit row.
    async fn change_policy(
        &self,
        method: &str,
        kind: &str,
        key: &str,
        actor: String,
        what: &str,
        body: &[u8],
    ) -> Answer {
        let change: ChangeBody = match serde_json::from_slice(body) {
            Ok(c) => c,
            Err(e) => {
                return answer(
                    "400 Bad Request",
                    json!({ "error": format!("expected {{reason, body}}: {e}") }),
                )
            }
        };
        if change.reason.trim().is_empty() {
            return self
                .refuse(
                    "400 Bad Request",
                    &actor,
                    what,
                    "a change needs a reason".into(),
                )
                .await;
        }
        let kind = object(kind).expect("checked above");
        if method == "DELETE" {
            if let Err(why) = self.live.check_delete(kind, key) {
                let why = format!("{} {key}: {why}", kind.name());
                return self.refuse("400 Bad Request", &actor, what, why).await;
            }
        }
        if let (Some(body), "PUT") = (&change.body, method) {
            // Refused before anything is written: what the node could not take over
            // what is stored.
            let stored = match self.with_db(async |db| db.policy_snapshot().await).await {
                Ok(stored) => stored,
                Err(e) => {
                    return answer("503 Service Unavailable", json!({ "error": e.to_string() }))
                }
            };
            let checked = kind.patch(key, body).and_then(|p| {
                self.live.check_over(stored.0, &stored.1, &p)?;
                match &p {
                    spindle_core::policy::PolicyPatch::Tenant(t, policy) => self
                        .shards
                        .config
                        .check_quota_retention(t.0, &policy.quotas),
                    _ => Ok(()),
                }
            });
            if let Err(why) = checked {
                let why = format!("{} {key}: {why}", kind.name());
                return self.refuse("400 Bad Request", &actor, what, why).await;
            }
        }
        let change = PolicyChange {
            object: kind,
            key: (*key).to_string(),
            body: if method == "DELETE" {
                None
            } else {
                change.body
            },
            actor,
            reason: change.reason,
        };
        match self
            .with_db(async |db| db.change_policy(&change).await)
            .await
        {
            Ok(version) => answer("200 OK", json!({ "version": version.0 })),
            Err(e) if e.is_unavailable() => {
                answer("503 Service Unavailable", json!({ "error": e.to_string() }))
            }
            Err(e) => answer("400 Bad Request", json!({ "error": e.to_string() })),
        }
    }

    /// `POST /admin/v1/counters/rebuild` with `{reason}`: every pool counter and reserved budget
    /// rebuilt from what live attempts hold, audited with the drift it repaired.
    async fn rebuild_counters(&self, actor: &str, what: &str, body: &[u8]) -> Answer {
        let Ok(request) = serde_json::from_slice::<ReasonBody>(body) else {
            let why = "expected {reason}".to_string();
            return self.refuse("400 Bad Request", actor, what, why).await;
        };
        if request.reason.trim().is_empty() {
            let why = "a rebuild needs a reason".to_string();
            return self.refuse("400 Bad Request", actor, what, why).await;
        }
        let rebuilt = self
            .with_db(async |db| {
                let drift = db.rebuild_counters().await?;
                let why =
                    spindle_node_control::counter_check::rebuild_reason(&request.reason, &drift);
                db.audit_action(actor, "counters", "rebuild", &why).await?;
                Ok(drift)
            })
            .await;
        match rebuilt {
            Ok(drift) => {
                let (pools, budgets) = drift_json(&drift);
                answer(
                    "200 OK",
                    json!({ "repaired": pools, "budgets_repaired": budgets }),
                )
            }
            Err(e) => answer("503 Service Unavailable", json!({ "error": e.to_string() })),
        }
    }

    /// A `{tasks, reason}` body with tasks and a reason, or its refusal (audited).
    async fn tasks_body(&self, actor: &str, what: &str, body: &[u8]) -> Result<TasksBody, Answer> {
        match serde_json::from_slice::<TasksBody>(body) {
            Ok(r) if !r.reason.trim().is_empty() && !r.tasks.is_empty() => Ok(r),
            _ => {
                let why = "expected {tasks: [ids], reason} with tasks and a reason".to_string();
                Err(self.refuse("400 Bad Request", actor, what, why).await)
            }
        }
    }

    /// `POST /admin/v1/tasks/cancel {tasks, reason}`: the tasks live on this node are canceled,
    /// whatever their tenant, as their clients' cancels are (stored before they are done; one
    /// at the provider or media stage ends CANCELED when that step ends), audited with the
    /// reason first. The answer says per task what became of it.
    async fn cancel(&self, actor: &str, what: &str, body: &[u8]) -> Answer {
        let request = match self.tasks_body(actor, what, body).await {
            Ok(r) => r,
            Err(refused) => return refused,
        };
        if request.tasks.len() > CANCEL_TASKS_MAX {
            let why = format!("at most {CANCEL_TASKS_MAX} tasks per call");
            return self.refuse("400 Bad Request", actor, what, why).await;
        }
        let ids: Vec<String> = request.tasks.iter().map(u64::to_string).collect();
        let why = format!("cancel {}: {}", ids.join(" "), request.reason);
        let audited = self
            .with_db(async |db| db.audit_action(actor, "task", "cancel", &why).await)
            .await;
        if let Err(e) = audited {
            return answer("503 Service Unavailable", json!({ "error": e.to_string() }));
        }
        let tasks = request.ids();
        let mut found: Vec<Option<spindle_wire::Response>> = vec![None; tasks.len()];
        for inbox in &self.shards.inboxes {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let msg = spindle_node_base::messages::ShardMsg::AdminCancel {
                tasks: tasks.clone(),
                reply: tx,
            };
            if inbox.send(msg).await.is_err() {
                return answer(
                    "503 Service Unavailable",
                    json!({ "error": "a shard stopped (the node is stopping)" }),
                );
            }
            for (slot, answer) in found.iter_mut().zip(rx.await.unwrap_or_default()) {
                if answer.is_some() {
                    *slot = answer;
                }
            }
        }
        // What this node's shards do not hold is read as stored: ended, unknown, or another
        // node's (named, as a requeue names it).
        let unheard: Vec<TaskId> = tasks
            .iter()
            .zip(&found)
            .filter(|(_, a)| a.is_none())
            .map(|(t, _)| *t)
            .collect();
        let stored = if unheard.is_empty() {
            Ok(HashMap::new())
        } else {
            self.with_db(async |db| db.task_statuses(&unheard).await)
                .await
                .map(|rows| {
                    rows.into_iter()
                        .map(|(tenant, t)| (t.task, (tenant, t.as_seen_by_client())))
                        .collect()
                })
        };
        let answers: Vec<Value> = tasks
            .iter()
            .zip(found)
            .map(|(task, answer)| {
                let (outcome, detail) = match answer {
                    Some(spindle_wire::Response::Canceled { state, .. }) => {
                        ("canceled", json!(state.to_string()))
                    }
                    Some(spindle_wire::Response::Error(e)) => ("refused", json!(e.to_string())),
                    Some(other) => ("refused", json!(format!("{other:?}"))),
                    None => self.not_held(&stored, *task),
                };
                json!({ "task": task.0, "outcome": outcome, "detail": detail })
            })
            .collect();
        answer("200 OK", json!({ "tasks": answers }))
    }

    /// What became of an operator's cancel of `task`, which no shard of this node holds, by
    /// its stored row (`stored`: the rows read, or why they could not be).
    fn not_held(
        &self,
        stored: &Result<HashMap<TaskId, (TenantId, StoredTask)>, spindle_control::StoreError>,
        task: TaskId,
    ) -> (&'static str, Value) {
        let rows = match stored {
            Ok(rows) => rows,
            Err(e) => {
                let why = format!("not live on this node; its stored row could not be read: {e}");
                return ("not_live_here", json!(why));
            }
        };
        match rows.get(&task) {
            None => ("not_found", Value::Null),
            Some((_, t)) if t.state.is_terminal() => ("ended", json!(t.state.to_string())),
            Some((tenant, t)) => {
                let partition = partition_of(tenant.0, self.shards.config.partitions);
                if self.shards.ownership.owns(partition) {
                    let why = format!(
                        "stored {} but held by no shard of this node (its answer in doubt, or \
                         being put back): retry shortly",
                        t.state
                    );
                    ("not_live_here", json!(why))
                } else {
                    (
                        "not_served_here",
                        json!(self.served_elsewhere(partition, "cancel")),
                    )
                }
            }
        }
    }

    /// Where to send an operator's call for a task of `partition`, which this node does not
    /// serve.
    fn served_elsewhere(&self, partition: u32, verb: &str) -> String {
        match self.shards.ownership.owner_of(partition) {
            // The registry has the node's client address; its admin API is on its HTTP port.
            Some(owner) => format!(
                "partition {partition} is served by {owner} (client port): {verb} it through \
                 that node's admin API"
            ),
            None => format!("partition {partition} has no live owner now; retry shortly"),
        }
    }

    /// `POST /admin/v1/tasks/requeue {tasks, reason}`: FAILED tasks of the partitions this node
    /// serves go back to their queues (`Db::requeue_failed`) and to their shards; the answer
    /// says per task what became of it, naming the node to ask for tasks it does not serve.
    async fn requeue(&self, actor: &str, what: &str, body: &[u8]) -> Answer {
        use spindle_control::RequeueOutcome as O;
        let request = match self.tasks_body(actor, what, body).await {
            Ok(r) => r,
            Err(refused) => return refused,
        };
        let tasks = request.ids();
        let mine = self.shards.ownership.owned();
        let outcomes = match self
            .with_db(async |db| {
                db.requeue_failed(&tasks, &mine, actor, &request.reason)
                    .await
            })
            .await
        {
            Ok(o) => o,
            Err(e) if e.is_unavailable() => {
                return answer("503 Service Unavailable", json!({ "error": e.to_string() }))
            }
            Err(e) => {
                return self
                    .refuse("400 Bad Request", actor, what, e.to_string())
                    .await
            }
        };
        let config = &self.shards.config;
        let mut per_shard = spindle_node_control::control::ShardRestores::per_shard(config.shards);
        let mut answers = Vec::with_capacity(outcomes.len());
        for (task, outcome) in tasks.iter().zip(outcomes) {
            let mut take_back = |q: &spindle_control::reconcile::QueuedTask, name| {
                let to = &mut per_shard[config.shard_of(q.tenant.0)];
                match spindle_node_control::control::restore_queued(q) {
                    Ok(restore) => {
                        to.tasks.push(restore);
                        (name, Value::Null)
                    }
                    // Requeued, but its stored request cannot be read: its shard fails it
                    // again, with the reason.
                    Err(e) => {
                        let reason = format!("{e:#}");
                        to.unrestorable
                            .push(spindle_node_control::control::Unrestorable {
                                task: q.task,
                                token: None,
                                reason: reason.clone(),
                            });
                        ("requeued_unreadable", json!(reason))
                    }
                }
            };
            let (name, detail) = match outcome {
                O::Requeued(q) => take_back(&q, "requeued"),
                // Queued already (a requeue that committed unheard, asked again): its shard
                // takes it back unless it holds it (a duplicate is refused there).
                O::AlreadyQueued(q) => take_back(&q, "already_queued"),
                O::NotFound => ("not_found", Value::Null),
                O::NotFailed(state) => ("not_failed", json!(state.to_string())),
                O::NotOwned(p) => (
                    "not_served_here",
                    json!(self.served_elsewhere(p.0, "requeue")),
                ),
                O::BudgetExhausted { remaining_milli } => (
                    "budget_exhausted",
                    json!({ "remaining_milli": remaining_milli }),
                ),
                O::AttemptsExhausted { attempts } => {
                    ("attempts_exhausted", json!({ "attempts": attempts }))
                }
            };
            answers.push(json!({ "task": task.0, "outcome": name, "detail": detail }));
        }
        for (inbox, batch) in self.shards.inboxes.iter().zip(per_shard) {
            if !batch.is_empty()
                && inbox
                    .send(spindle_node_base::messages::ShardMsg::Restore(batch))
                    .await
                    .is_err()
            {
                tracing::warn!("a shard stopped; its requeued tasks wait in PostgreSQL");
            }
        }
        answer("200 OK", json!({ "tasks": answers }))
    }
}

/// Drifted (or repaired) counters as JSON: the pool shards, then the tenants' reserved budgets.
/// The value of `name` in `path`'s query string.
fn query_param<'a>(path: &'a str, name: &str) -> Option<&'a str> {
    let query = path.split_once('?')?.1;
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

/// A stored task for `GET /admin/v1/tasks/{id}`: its result as the JSON it is.
fn task_json(tenant: spindle_core::TenantId, t: &spindle_control::query::StoredTask) -> Value {
    let result = t
        .result
        .as_deref()
        .map(spindle_control::report::result_value);
    json!({
        "task": t.task.0,
        "tenant": tenant.0,
        "state": t.state.name(),
        "version": t.version,
        "attempt_no": t.attempt_no,
        "cost_estimate_milli": t.cost_estimate_milli,
        "cost_actual_milli": t.cost_actual_milli,
        "failure_reason": t.failure_reason,
        "result": result,
        // A cancel stored and not yet carried out in the row (its client reads CANCELED).
        "cancel_requested": t.cancel_requested,
    })
}

fn drift_json(
    drift: &spindle_control::reconcile::Counters,
) -> (serde_json::Value, serde_json::Value) {
    let pools = drift
        .pools
        .iter()
        .map(|d| {
            json!({
                "pool": d.shard.pool,
                "shard": d.shard.shard,
                "stored": d.stored,
                "derived": d.derived,
            })
        })
        .collect::<Vec<_>>();
    let budgets = drift
        .budgets
        .iter()
        .map(|d| json!({ "tenant": d.tenant.0, "stored": d.stored, "derived": d.derived }))
        .collect::<Vec<_>>();
    (json!(pools), json!(budgets))
}
