//! The policy store: tenant policies, lanes, provider accounts and the model capability matrix,
//! all versioned. Every change bumps the one global policy version in the same transaction that
//! writes the object and its audit row (actor, old, new, reason, version, time). Bodies are the
//! core's own policy types as JSON, checked by deserializing them (and their keys against them)
//! before anything is written.

use serde::de::DeserializeOwned;
use serde_json::Value;
use spindle_core::cost::ModelCapability;
use spindle_core::policy::{PolicyPatch, ProviderPolicy};
use spindle_core::{Lane, PolicyVersion, TenantId};
use tokio_postgres::Transaction;

use crate::db::{Call, Db};
use crate::error::{check_text, InputError, StoreError};
use crate::limits::{NAME_BYTES_MAX, REASON_BYTES_MAX};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyObject {
    Tenant,
    Lane,
    ProviderAccount,
    ModelCapability,
}

impl PolicyObject {
    pub const ALL: [PolicyObject; 4] = [
        PolicyObject::Tenant,
        PolicyObject::Lane,
        PolicyObject::ProviderAccount,
        PolicyObject::ModelCapability,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyObject::Tenant => "tenant_policy",
            PolicyObject::Lane => "lane",
            PolicyObject::ProviderAccount => "provider_account",
            PolicyObject::ModelCapability => "model_capability",
        }
    }

    /// (table, key column, key cast): the table names are fixed here, never taken from input.
    fn table(self) -> (&'static str, &'static str, &'static str) {
        match self {
            PolicyObject::Tenant => ("tenant_policy", "tenant_id", "::text::integer"),
            PolicyObject::Lane => ("lane", "lane", ""),
            PolicyObject::ProviderAccount => ("provider_account", "account", ""),
            PolicyObject::ModelCapability => ("model_capability", "model", ""),
        }
    }

    /// The core's patch for object `key` of this kind with `body`: the body deserializes as
    /// the core's type, and the key names it (a tenant id; a lane's name; a provider account's
    /// or a model's `name`). The error says what is wrong.
    pub fn patch(self, key: &str, body: &Value) -> Result<PolicyPatch, String> {
        fn parse<T: DeserializeOwned>(body: &Value) -> Result<T, String> {
            serde_json::from_value::<T>(body.clone()).map_err(|e| e.to_string())
        }
        fn named(kind: &str, key: &str, name: &str) -> Result<(), String> {
            if key == name {
                Ok(())
            } else {
                Err(format!("the key {key:?} is not the {kind}'s name {name:?}"))
            }
        }
        match self {
            PolicyObject::Tenant => {
                let tenant = key
                    .parse::<u32>()
                    .map_err(|_| format!("tenant key {key:?} is not a tenant id"))?;
                Ok(PolicyPatch::Tenant(TenantId(tenant), parse(body)?))
            }
            PolicyObject::Lane => {
                let lane = Lane::ALL
                    .into_iter()
                    .find(|l| l.name() == key)
                    .ok_or_else(|| {
                        let names: Vec<_> = Lane::ALL.iter().map(|l| l.name()).collect();
                        format!("lane key {key:?} is not one of {}", names.join(", "))
                    })?;
                Ok(PolicyPatch::Lane(lane, parse(body)?))
            }
            PolicyObject::ProviderAccount => {
                let p: ProviderPolicy = parse(body)?;
                named("provider account", key, &p.name)?;
                Ok(PolicyPatch::Provider(p))
            }
            PolicyObject::ModelCapability => {
                let m: ModelCapability = parse(body)?;
                named("model", key, &m.name)?;
                Ok(PolicyPatch::Model(m))
            }
        }
    }
}

impl PolicyRow {
    /// This stored object as the core's patch (see [`PolicyObject::patch`]).
    pub fn patch(&self) -> Result<PolicyPatch, String> {
        self.object.patch(&self.key, &self.body)
    }
}

/// One change by an operator. `body: None` deletes the object.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyChange {
    pub object: PolicyObject,
    pub key: String,
    pub body: Option<Value>,
    pub actor: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRow {
    pub object: PolicyObject,
    pub key: String,
    /// The policy version that last wrote this object.
    pub version: PolicyVersion,
    pub body: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AuditEntry {
    pub actor: String,
    pub object: String,
    pub key: String,
    pub old: Option<Value>,
    pub new: Option<Value>,
    pub reason: String,
    pub version: PolicyVersion,
    pub at: std::time::SystemTime,
}

impl Db {
    /// Applies one change atomically: new global version, object row, audit row.
    pub async fn change_policy(
        &mut self,
        change: &PolicyChange,
    ) -> Result<PolicyVersion, StoreError> {
        check_text(0, "key", &change.key, NAME_BYTES_MAX)?;
        check_text(0, "actor", &change.actor, NAME_BYTES_MAX)?;
        check_text(0, "reason", &change.reason, REASON_BYTES_MAX)?;
        if change.object == PolicyObject::Tenant && change.key.parse::<u32>().is_err() {
            return Err(InputError::Illegal {
                row: 0,
                reason: format!("tenant key {:?} is not a tenant id", change.key),
            }
            .into());
        }
        if let Some(body) = &change.body {
            change
                .object
                .patch(&change.key, body)
                .map_err(|e| InputError::Illegal {
                    row: 0,
                    reason: format!("{} {}: {e}", change.object.name(), change.key),
                })?;
        }
        let (table, key_col, cast) = change.object.table();
        let deadline = self.within(6);
        deadline
            .run(Call::Writes, async {
                let tx = self.client_mut().transaction().await?;
                let version = bump_version(&tx).await?;
                let old: Option<Value> = tx
                    .query_opt(
                        &format!("SELECT body FROM {table} WHERE {key_col} = $1{cast} FOR UPDATE"),
                        &[&change.key],
                    )
                    .await?
                    .map(|r| r.get(0));
                match &change.body {
                    Some(body) => {
                        tx.execute(
                            &format!(
                                "INSERT INTO {table} ({key_col}, version, body) VALUES ($1{cast}, $2, $3)
                                 ON CONFLICT ({key_col}) DO UPDATE
                                    SET version = EXCLUDED.version, body = EXCLUDED.body, updated_at = now()"
                            ),
                            &[&change.key, &(version.0 as i64), body],
                        )
                        .await?;
                    }
                    None => {
                        tx.execute(
                            &format!("DELETE FROM {table} WHERE {key_col} = $1{cast}"),
                            &[&change.key],
                        )
                        .await?;
                    }
                }
                audit(
                    &tx,
                    Audit {
                        actor: &change.actor,
                        object: change.object.name(),
                        key: &change.key,
                        old: old.as_ref(),
                        new: change.body.as_ref(),
                        reason: &change.reason,
                        version,
                    },
                )
                .await?;
                tx.commit().await?;
                Ok(version)
            })
            .await
    }

    pub async fn policy_version(&self) -> Result<PolicyVersion, StoreError> {
        let read = self
            .client()
            .query_one("SELECT version FROM policy_version", &[]);
        let v: i64 = self.answered(Call::Reads, read).await?.get(0);
        Ok(PolicyVersion(v as u64))
    }

    /// Every object of every kind with the global version they were read at, in one snapshot.
    pub async fn policy_snapshot(&mut self) -> Result<(PolicyVersion, Vec<PolicyRow>), StoreError> {
        let deadline = self.within(8);
        deadline
            .run(Call::Reads, async {
                let tx = self.read_snapshot().await?;
                let version = current_version(&tx).await?;
                let mut rows = Vec::new();
                for object in PolicyObject::ALL {
                    let (table, key_col, _) = object.table();
                    for r in tx
                        .query(
                            &format!(
                                "SELECT {key_col}::text, version, body FROM {table} ORDER BY 1"
                            ),
                            &[],
                        )
                        .await?
                    {
                        rows.push(PolicyRow {
                            object,
                            key: r.get(0),
                            version: PolicyVersion(r.get::<_, i64>(1) as u64),
                            body: r.get(2),
                        });
                    }
                }
                tx.commit().await?;
                Ok((version, rows))
            })
            .await
    }

    /// The newest `limit` audit entries, newest first.
    pub async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT actor, object_kind, object_key, old_value, new_value, reason,
                             policy_version, at
                        FROM audit_log ORDER BY audit_id DESC LIMIT $1",
                    &[&i64::from(limit.min(crate::limits::SCAN_MAX as u32))],
                ),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| AuditEntry {
                actor: r.get(0),
                object: r.get(1),
                key: r.get(2),
                old: r.get(3),
                new: r.get(4),
                reason: r.get(5),
                version: PolicyVersion(r.get::<_, i64>(6) as u64),
                at: r.get(7),
            })
            .collect())
    }

    /// Records an operator action that was refused (no change, no version bump): who tried what
    /// and why it was refused, at the current policy version.
    pub async fn audit_refusal(
        &mut self,
        actor: &str,
        what: &str,
        why: &str,
    ) -> Result<(), StoreError> {
        self.audit_action(actor, "refused", what, why).await
    }

    /// Records an operator action that changes no policy object (a drain, a refusal) at the
    /// current policy version.
    pub async fn audit_action(
        &mut self,
        actor: &str,
        kind: &str,
        what: &str,
        why: &str,
    ) -> Result<(), StoreError> {
        let actor: String = actor.chars().take(NAME_BYTES_MAX).collect();
        let what: String = what.chars().take(NAME_BYTES_MAX).collect();
        let why: String = why.chars().take(REASON_BYTES_MAX).collect();
        let deadline = self.within(4);
        deadline
            .run(Call::Writes, async {
                let tx = self.client_mut().transaction().await?;
                let version = current_version(&tx).await?;
                audit(
                    &tx,
                    Audit {
                        actor: if actor.is_empty() {
                            "anonymous"
                        } else {
                            &actor
                        },
                        object: kind,
                        key: &what,
                        old: None,
                        new: None,
                        reason: &why,
                        version,
                    },
                )
                .await?;
                tx.commit().await?;
                Ok(())
            })
            .await
    }

    /// Resets `tenant`'s periodic quota counts: nothing it submitted before now counts again
    /// (the floor is stored, for the node that counts them next), audited with `reason`.
    /// Returns the floor.
    pub async fn reset_quotas(
        &mut self,
        tenant: spindle_core::TenantId,
        actor: &str,
        reason: &str,
    ) -> Result<std::time::SystemTime, StoreError> {
        check_text(0, "actor", actor, NAME_BYTES_MAX)?;
        check_text(0, "reason", reason, REASON_BYTES_MAX)?;
        let deadline = self.within(4);
        deadline
            .run(Call::Writes, async {
                let tx = self.client_mut().transaction().await?;
                let at: std::time::SystemTime = tx
                    .query_one(
                        "INSERT INTO quota_reset (tenant_id, reset_at) VALUES ($1, now())
                         ON CONFLICT (tenant_id) DO UPDATE SET reset_at = EXCLUDED.reset_at
                         RETURNING reset_at",
                        &[&(tenant.0 as i32)],
                    )
                    .await?
                    .get(0);
                let version = current_version(&tx).await?;
                audit(
                    &tx,
                    Audit {
                        actor,
                        object: "quota",
                        key: &tenant.0.to_string(),
                        old: None,
                        new: Some(&Value::from("reset")),
                        reason,
                        version,
                    },
                )
                .await?;
                tx.commit().await?;
                Ok(at)
            })
            .await
    }

    /// Sets a tenant's cost budget (creating it), audited like a policy change.
    pub async fn set_tenant_budget(
        &mut self,
        tenant: spindle_core::TenantId,
        budget_milli: u64,
        actor: &str,
        reason: &str,
    ) -> Result<PolicyVersion, StoreError> {
        check_text(0, "actor", actor, NAME_BYTES_MAX)?;
        check_text(0, "reason", reason, REASON_BYTES_MAX)?;
        let budget = crate::error::to_i64(0, "budget_milli", budget_milli)?;
        let deadline = self.within(6);
        deadline
            .run(Call::Writes, async {
                let tx = self.client_mut().transaction().await?;
                let version = bump_version(&tx).await?;
                let old: Option<i64> = tx
                    .query_opt(
                        "SELECT budget_milli FROM tenant_quota WHERE tenant_id = $1 FOR UPDATE",
                        &[&(tenant.0 as i32)],
                    )
                    .await?
                    .map(|r| r.get(0));
                tx.execute(
                    "INSERT INTO tenant_quota (tenant_id, budget_milli) VALUES ($1, $2)
                     ON CONFLICT (tenant_id) DO UPDATE SET budget_milli = EXCLUDED.budget_milli",
                    &[&(tenant.0 as i32), &budget],
                )
                .await?;
                audit(
                    &tx,
                    Audit {
                        actor,
                        object: "tenant_budget",
                        key: &tenant.0.to_string(),
                        old: old.map(Value::from).as_ref(),
                        new: Some(&Value::from(budget)),
                        reason,
                        version,
                    },
                )
                .await?;
                tx.commit().await?;
                Ok(version)
            })
            .await
    }
}

/// Takes the next global policy version inside the caller's transaction.
/// The policy version now, as `tx` reads it (what an audit row of an action that changes no
/// policy object is stamped with).
pub(crate) async fn current_version(tx: &Transaction<'_>) -> Result<PolicyVersion, StoreError> {
    let version: i64 = tx
        .query_one("SELECT version FROM policy_version", &[])
        .await?
        .get(0);
    Ok(PolicyVersion(version as u64))
}

async fn bump_version(tx: &Transaction<'_>) -> Result<PolicyVersion, StoreError> {
    let version: i64 = tx
        .query_one(
            "UPDATE policy_version SET version = version + 1 RETURNING version",
            &[],
        )
        .await?
        .get(0);
    Ok(PolicyVersion(version as u64))
}

struct Audit<'a> {
    actor: &'a str,
    object: &'a str,
    key: &'a str,
    old: Option<&'a Value>,
    new: Option<&'a Value>,
    reason: &'a str,
    version: PolicyVersion,
}

/// Writes the audit row of a change inside the change's transaction.
async fn audit(tx: &Transaction<'_>, a: Audit<'_>) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO audit_log (actor, object_kind, object_key, old_value, new_value, reason,
                                policy_version)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[
            &a.actor,
            &a.object,
            &a.key,
            &a.old,
            &a.new,
            &a.reason,
            &(a.version.0 as i64),
        ],
    )
    .await?;
    Ok(())
}
