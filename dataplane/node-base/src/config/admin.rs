//! `admin_tokens`: who may call the admin API, with which role.

use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Viewer,
    Operator,
    Admin,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminToken {
    /// Who the token belongs to (the audit log's actor).
    pub name: String,
    pub token: String,
    pub role: Role,
}
