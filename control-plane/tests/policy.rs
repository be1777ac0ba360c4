//! The policy store: versioned objects, an audit row per change, invalid bodies refused whole.

use serde_json::json;
use spindle_control::policy::{PolicyChange, PolicyObject};
use spindle_control::testing::TestDb;
use spindle_control::StoreError;
use spindle_core::presets;
use spindle_core::{PolicyVersion, TenantId};

#[tokio::test]
async fn every_change_bumps_the_version_and_leaves_an_audit_row() {
    let test = TestDb::new().await;
    let mut db = test.open().await;
    assert_eq!(db.policy_version().await.unwrap(), PolicyVersion(1));
    let tenant = serde_json::to_value(presets::tenant(spindle_core::Lane::Standard, 2)).unwrap();
    let change = PolicyChange {
        object: PolicyObject::Tenant,
        key: "7".into(),
        body: Some(tenant.clone()),
        actor: "alice".into(),
        reason: "onboard tenant 7".into(),
    };
    assert_eq!(db.change_policy(&change).await.unwrap(), PolicyVersion(2));
    let mut heavier = tenant.clone();
    heavier["weight"] = json!(5);
    let change2 = PolicyChange {
        body: Some(heavier.clone()),
        actor: "bob".into(),
        reason: "contract upgrade".into(),
        ..change.clone()
    };
    assert_eq!(db.change_policy(&change2).await.unwrap(), PolicyVersion(3));
    db.set_tenant_budget(TenantId(7), 1_000_000, "carol", "monthly budget")
        .await
        .unwrap();

    let (version, rows) = db.policy_snapshot().await.unwrap();
    assert_eq!(version, PolicyVersion(4));
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].version, &rows[0].body),
        (PolicyVersion(3), &heavier)
    );

    let audit = db.audit_log(10).await.unwrap();
    let summary: Vec<(&str, &str, u64, bool)> = audit
        .iter()
        .map(|a| {
            (
                a.actor.as_str(),
                a.reason.as_str(),
                a.version.0,
                a.old.is_some(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("carol", "monthly budget", 4, false),
            ("bob", "contract upgrade", 3, true),
            ("alice", "onboard tenant 7", 2, false),
        ]
    );
    assert_eq!(audit[1].old.as_ref(), Some(&tenant));
    assert_eq!(audit[1].new.as_ref(), Some(&heavier));
}

#[tokio::test]
async fn an_invalid_change_is_refused_and_writes_nothing() {
    let test = TestDb::new().await;
    let mut db = test.open().await;
    let bad = PolicyChange {
        object: PolicyObject::Tenant,
        key: "7".into(),
        body: Some(json!({"weight": "heavy"})),
        actor: "alice".into(),
        reason: "typo".into(),
    };
    let err = db.change_policy(&bad).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err:?}");
    assert!(err.to_string().contains("tenant_policy 7"), "{err}");
    let no_reason = PolicyChange {
        body: Some(serde_json::to_value(presets::tenant(spindle_core::Lane::Standard, 1)).unwrap()),
        reason: String::new(),
        ..bad
    };
    let err = db.change_policy(&no_reason).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid input: row 0: field `reason` is empty"
    );
    assert_eq!(db.policy_version().await.unwrap(), PolicyVersion(1));
    assert!(db.audit_log(10).await.unwrap().is_empty());
}
