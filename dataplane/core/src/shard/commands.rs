//! A tenant's commands other than submits that cost PostgreSQL a call — cancels, each stored
//! before it is answered, and status reads of tasks no shard holds live — each kind under a
//! rate of the tenant's own (`TenantPolicy::cancel_rate`, `store_read_rate`; design.md §4: a
//! flood of create-then-cancel, or of polling, must not take the node's
//! PostgreSQL connections from the other tenants). What a shard answers from memory (a live
//! task's status, a cancel of a task it does not hold) spends nothing.

use super::*;

/// A kind of command with a rate of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Cancel,
    StoreRead,
}

impl Command {
    pub const ALL: [Command; 2] = [Command::Cancel, Command::StoreRead];

    /// Its name in `/metrics` and in the refusal.
    pub fn name(self) -> &'static str {
        match self {
            Command::Cancel => "cancel",
            Command::StoreRead => "store_read",
        }
    }

    fn rate(self, policy: &TenantPolicy) -> RateSpec {
        match self {
            Command::Cancel => policy.cancel_rate,
            Command::StoreRead => policy.store_read_rate,
        }
    }
}

/// A command refused for its tenant's rate of that kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandLimited {
    pub tenant: TenantId,
    pub command: Command,
    pub rate: RateSpec,
    /// When the next one would be taken, at this rate and with nothing else spent meanwhile;
    /// `None` for a rate of zero (none is taken until the policy changes).
    pub retry_after_ms: Option<u64>,
}

impl fmt::Display for CommandLimited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.command {
            Command::Cancel => "cancels",
            Command::StoreRead => "status reads from PostgreSQL (of tasks not live here)",
        };
        write!(
            f,
            "tenant {}'s {what} are limited to {} a minute, {} at once: ",
            self.tenant, self.rate.per_minute, self.rate.burst
        )?;
        match self.retry_after_ms {
            Some(ms) => write!(f, "the next in {ms} ms"),
            None => f.write_str("none until its policy changes"),
        }
    }
}

/// A tenant's command buckets, by [`Command`], kept beside its record (admission and the pick
/// never read them, so they stay out of its cache lines).
#[derive(Debug, Clone)]
pub(super) struct CommandRates([SubmitBucket; Command::ALL.len()]);

impl CommandRates {
    pub(super) fn new(policy: &TenantPolicy) -> CommandRates {
        CommandRates(Command::ALL.map(|c| SubmitBucket::new(c.rate(policy), Time::ZERO)))
    }

    pub(super) fn set_policy(&mut self, policy: &TenantPolicy, now: Time) {
        for (bucket, c) in self.0.iter_mut().zip(Command::ALL) {
            bucket.set_rate(c.rate(policy), now);
        }
    }

    pub(super) fn within_burst(&self) -> bool {
        self.0.iter().all(SubmitBucket::within_burst)
    }
}

impl Shard {
    /// Spends one of `tenant`'s `command` tokens, or says why not and when to try again. A
    /// tenant the policy does not have has no rate here (what it asks for is refused its own
    /// way).
    pub fn charge_command(
        &mut self,
        now: Time,
        tenant: TenantId,
        command: Command,
    ) -> Result<(), CommandLimited> {
        let Ok(slot) = self.ensure_tenant(tenant) else {
            return Ok(());
        };
        let bucket = &mut self.commands[slot as usize].0[command as usize];
        if bucket.try_take_one(now) {
            return Ok(());
        }
        Err(CommandLimited {
            tenant,
            command,
            rate: command.rate(&self.policy.tenants[&tenant]),
            retry_after_ms: bucket.wait_ns().map(|ns| ns.div_ceil(NANOS_PER_MS)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::{small_node, with_tenants};

    fn shard(cancels: RateSpec) -> (Shard, TenantId) {
        let mut policy = with_tenants(small_node(), 1);
        let tenant = TenantId(1);
        policy
            .tenants
            .get_mut(&tenant)
            .expect("tenant 1")
            .cancel_rate = cancels;
        (Shard::new(policy, 1, Time::ZERO), tenant)
    }

    #[test]
    fn a_tenant_spends_its_burst_then_waits_for_its_rate() {
        let (mut s, t) = shard(RateSpec {
            per_minute: 60,
            burst: 2,
        });
        let now = Time::ZERO;
        assert_eq!(s.charge_command(now, t, Command::Cancel), Ok(()));
        assert_eq!(s.charge_command(now, t, Command::Cancel), Ok(()));
        let refused = s.charge_command(now, t, Command::Cancel).unwrap_err();
        assert_eq!(refused.retry_after_ms, Some(1_000), "{refused}");
        assert!(
            refused
                .to_string()
                .contains("cancels are limited to 60 a minute, 2 at once"),
            "{refused}"
        );
        // Reads have a rate of their own.
        assert_eq!(s.charge_command(now, t, Command::StoreRead), Ok(()));
        let later = now.plus_ns(400 * NANOS_PER_MS);
        let refused = s.charge_command(later, t, Command::Cancel).unwrap_err();
        assert_eq!(refused.retry_after_ms, Some(600));
        let second = now.plus_ns(NANOS_PER_S);
        assert_eq!(s.charge_command(second, t, Command::Cancel), Ok(()));
        assert!(s.charge_command(second, t, Command::Cancel).is_err());
    }

    #[test]
    fn a_lowered_rate_drops_the_stored_tokens_above_it() {
        let (mut s, t) = shard(RateSpec {
            per_minute: 600,
            burst: 100,
        });
        let mut policy = s.policy().tenants[&t].clone();
        policy.cancel_rate = RateSpec {
            per_minute: 0,
            burst: 1,
        };
        assert_eq!(s.charge_command(Time::ZERO, t, Command::Cancel), Ok(()));
        s.set_tenant_policy(t, policy, Time::ZERO);
        assert_eq!(s.charge_command(Time::ZERO, t, Command::Cancel), Ok(()));
        let refused = s
            .charge_command(Time::ZERO, t, Command::Cancel)
            .unwrap_err();
        assert_eq!(refused.retry_after_ms, None);
        assert!(refused
            .to_string()
            .ends_with("none until its policy changes"));
    }
}
