//! Periodic quotas (seeds 000 and 004): what a tenant, each of its users, or its use of one
//! model may consume per minute, day or month — cost and task counts — counted in civil periods
//! of the tenant's time zone (a fixed offset from UTC). A task is charged its estimate when it
//! is admitted, settled at what its provider billed, and given back when it ends without the
//! provider having billed it (failed, canceled or expired before that); a charge is only ever
//! moved within the period it was made in.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{ModelId, TenantId, UserId};

/// Quotas one tenant may have.
pub const QUOTAS_PER_TENANT_MAX: usize = 16;
/// The furthest a tenant's time zone may be from UTC, in minutes (UTC−14 … UTC+14).
pub const UTC_OFFSET_MIN_MAX: i32 = 14 * 60;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuotaPeriod {
    Minute,
    Day,
    Month,
}

impl QuotaPeriod {
    pub const ALL: [QuotaPeriod; 3] = [QuotaPeriod::Minute, QuotaPeriod::Day, QuotaPeriod::Month];

    pub fn name(self) -> &'static str {
        match self {
            QuotaPeriod::Minute => "minute",
            QuotaPeriod::Day => "day",
            QuotaPeriod::Month => "month",
        }
    }

    /// The longest this period lasts, in ms (a month: 31 days).
    pub fn longest_ms(self) -> u64 {
        match self {
            QuotaPeriod::Minute => 60_000,
            QuotaPeriod::Day => 86_400_000,
            QuotaPeriod::Month => 31 * 86_400_000,
        }
    }
}

/// Whose consumption a quota counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuotaScope {
    /// The tenant's, all its users and models together.
    Tenant,
    /// Each of the tenant's users, each on its own.
    User,
    /// The tenant's tasks of one model.
    Model { model: ModelId },
}

impl Serialize for QuotaScope {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for QuotaScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuotaScope::Tenant => f.write_str("tenant"),
            QuotaScope::User => f.write_str("user"),
            QuotaScope::Model { model } => write!(f, "model {}", model.0),
        }
    }
}

/// One quota of a tenant: at most `cost_milli` of cost and `tasks` tasks per `period` (either
/// may be absent; one must be there). Written as `{scope: "tenant" | "user" | "model", model
/// (for "model"), period, cost_milli, tasks}`; anything else is refused by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "QuotaFields", into = "QuotaFields")]
pub struct Quota {
    pub scope: QuotaScope,
    pub period: QuotaPeriod,
    pub cost_milli: Option<u64>,
    pub tasks: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ScopeName {
    Tenant,
    User,
    Model,
}

/// A quota as written.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaFields {
    scope: ScopeName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model: Option<ModelId>,
    period: QuotaPeriod,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cost_milli: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tasks: Option<u64>,
}

impl TryFrom<QuotaFields> for Quota {
    type Error = String;

    fn try_from(f: QuotaFields) -> Result<Quota, String> {
        let scope = match (f.scope, f.model) {
            (ScopeName::Tenant, None) => QuotaScope::Tenant,
            (ScopeName::User, None) => QuotaScope::User,
            (ScopeName::Model, Some(model)) => QuotaScope::Model { model },
            (ScopeName::Model, None) => return Err("a model quota names its `model`".into()),
            (_, Some(_)) => return Err("only a model quota names a `model`".into()),
        };
        Ok(Quota {
            scope,
            period: f.period,
            cost_milli: f.cost_milli,
            tasks: f.tasks,
        })
    }
}

impl From<Quota> for QuotaFields {
    fn from(q: Quota) -> QuotaFields {
        let (scope, model) = match q.scope {
            QuotaScope::Tenant => (ScopeName::Tenant, None),
            QuotaScope::User => (ScopeName::User, None),
            QuotaScope::Model { model } => (ScopeName::Model, Some(model)),
        };
        QuotaFields {
            scope,
            model,
            period: q.period,
            cost_milli: q.cost_milli,
            tasks: q.tasks,
        }
    }
}

/// What a usage counter counts for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum UsageOf {
    Tenant,
    User(UserId),
    Model(ModelId),
}

/// The key of one usage counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct UsageKey {
    pub tenant: TenantId,
    pub of: UsageOf,
    pub period: QuotaPeriod,
}

/// What one counter holds: consumption within its period (`index`, see [`period_index`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub index: u32,
    pub cost_milli: u64,
    pub tasks: u64,
}

impl Usage {
    /// This counter as of period `index`: empty if it counted an earlier one.
    pub fn at(self, index: u32) -> Usage {
        if self.index == index {
            self
        } else {
            Usage {
                index,
                ..Usage::default()
            }
        }
    }
}

/// The counter `quota` of `tenant` uses for a task of `user` and `model`; `None` when the
/// quota does not count that task (another model's).
pub(crate) fn usage_key(
    tenant: TenantId,
    quota: &Quota,
    user: UserId,
    model: ModelId,
) -> Option<UsageKey> {
    let of = match quota.scope {
        QuotaScope::Tenant => UsageOf::Tenant,
        QuotaScope::User => UsageOf::User(user),
        QuotaScope::Model { model: m } if m == model => UsageOf::Model(model),
        QuotaScope::Model { .. } => return None,
    };
    Some(UsageKey {
        tenant,
        of,
        period: quota.period,
    })
}

const MS_PER_MINUTE: i64 = 60_000;
const MS_PER_DAY: i64 = 86_400_000;

/// The period `unix_ms` falls in, numbered from the epoch (minutes, days, or months since
/// January 1970), in a time zone `offset_min` from UTC.
pub fn period_index(period: QuotaPeriod, unix_ms: u64, offset_min: i32) -> u32 {
    let local = unix_ms as i64 + i64::from(offset_min) * MS_PER_MINUTE;
    let index = match period {
        QuotaPeriod::Minute => local.div_euclid(MS_PER_MINUTE),
        QuotaPeriod::Day => local.div_euclid(MS_PER_DAY),
        QuotaPeriod::Month => {
            let (y, m, _) = civil_from_days(local.div_euclid(MS_PER_DAY));
            (y - 1970) * 12 + i64::from(m) - 1
        }
    };
    index.clamp(0, i64::from(u32::MAX)) as u32
}

/// When period `index` ends (the next one starts), in unix ms.
pub fn period_end_ms(period: QuotaPeriod, index: u32, offset_min: i32) -> u64 {
    let next = i64::from(index) + 1;
    let local = match period {
        QuotaPeriod::Minute => next * MS_PER_MINUTE,
        QuotaPeriod::Day => next * MS_PER_DAY,
        QuotaPeriod::Month => {
            let (y, m) = (1970 + next.div_euclid(12), next.rem_euclid(12) as u32 + 1);
            days_from_civil(y, m, 1) * MS_PER_DAY
        }
    };
    (local - i64::from(offset_min) * MS_PER_MINUTE).max(0) as u64
}

/// `unix_ms` as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_text(unix_ms: u64) -> String {
    let ms = unix_ms as i64;
    let (y, m, d) = civil_from_days(ms.div_euclid(MS_PER_DAY));
    let s = ms.rem_euclid(MS_PER_DAY) / 1_000;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3_600,
        s / 60 % 60,
        s % 60
    )
}

/// (year, month, day) of day `z` since 1970-01-01 (the proleptic Gregorian calendar).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Day since 1970-01-01 of (year, month, day).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Why a quota refused a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Exhausted {
    pub scope: QuotaScope,
    pub period: QuotaPeriod,
    /// Its cost is spent (else its task count).
    pub cost: bool,
    /// What is used of it (milli cost units, or tasks), and its bound: the task did not fit
    /// in what is left.
    pub used: u64,
    pub limit: u64,
    /// When the period ends and the quota is whole again (unix ms).
    pub resets_at_ms: u64,
}

impl fmt::Display for Exhausted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "quota exhausted: {} {} per {} ({} used of {}); it resets at {}",
            self.scope,
            if self.cost { "cost" } else { "tasks" },
            self.period.name(),
            self.used,
            self.limit,
            utc_text(self.resets_at_ms)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_round_trip_and_months_count_from_1970() {
        for day in [-1, 0, 59, 365, 10_957, 19_723, 20_819, 50_000] {
            let (y, m, d) = civil_from_days(day);
            assert_eq!(days_from_civil(y, m, d), day, "{y}-{m}-{d}");
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        // 2026-12-07 and 2024-02-29.
        assert_eq!(civil_from_days(20_794), (2026, 12, 7));
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
        let dec_2026 = days_from_civil(2026, 12, 7) as u64 * 86_400_000;
        let month = period_index(QuotaPeriod::Month, dec_2026, 0);
        assert_eq!(month, (2026 - 1970) * 12 + 11);
        assert_eq!(
            utc_text(period_end_ms(QuotaPeriod::Month, month, 0)),
            "2027-01-01T00:00:00Z"
        );
    }

    #[test]
    fn a_time_zone_moves_the_periods_boundaries() {
        // 2026-12-07T23:30:00Z is already the 8th at UTC+1.
        let t = days_from_civil(2026, 12, 7) as u64 * 86_400_000 + 23 * 3_600_000 + 1_800_000;
        let utc = period_index(QuotaPeriod::Day, t, 0);
        let cet = period_index(QuotaPeriod::Day, t, 60);
        assert_eq!(cet, utc + 1);
        assert_eq!(
            utc_text(period_end_ms(QuotaPeriod::Day, cet, 60)),
            "2026-12-08T23:00:00Z"
        );
        assert_eq!(
            utc_text(period_end_ms(
                QuotaPeriod::Minute,
                period_index(QuotaPeriod::Minute, t, 0),
                0
            )),
            "2026-12-07T23:31:00Z"
        );
    }
}
