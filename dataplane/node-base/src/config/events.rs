//! `[events]`: where the event relay posts the outbox.

use std::sync::Arc;

/// The `[events]` section of the node's configuration.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsConfig {
    /// Where event batches are posted (http:// or https://, checked against the public web's
    /// roots and `ca_file`'s).
    pub url: String,
    /// PEM certificates of a private CA the endpoint's certificate may chain to, beside the
    /// public web's roots.
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// The secret their bodies are signed with.
    pub secret: String,
    /// Each post gives up after this (then it is tried again).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Events per post at most.
    #[serde(default = "default_batch_max")]
    pub batch_max: usize,
    /// How long the relay waits when nothing is pending.
    #[serde(default = "default_idle_ms")]
    pub idle_ms: u64,
    /// Above this many pending events, new work is refused as overloaded.
    #[serde(default = "default_pending_max")]
    pub pending_max: u64,
}

fn default_timeout_ms() -> u64 {
    2_000
}

fn default_batch_max() -> usize {
    1_000
}

fn default_idle_ms() -> u64 {
    100
}

fn default_pending_max() -> u64 {
    1_000_000
}

impl EventsConfig {
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            spindle_providers::tls::is_http_url(&self.url),
            "events.url must be an http:// or https:// URL"
        );
        self.tls()?;
        anyhow::ensure!(!self.secret.is_empty(), "events.secret must not be empty");
        anyhow::ensure!(
            (50..=120_000).contains(&self.timeout_ms),
            "events.timeout_ms must be 50..=120000"
        );
        anyhow::ensure!(
            (1..=spindle_control::limits::SCAN_MAX).contains(&self.batch_max),
            "events.batch_max must be 1..={}",
            spindle_control::limits::SCAN_MAX
        );
        anyhow::ensure!(
            (1..=60_000).contains(&self.idle_ms),
            "events.idle_ms must be 1..=60000"
        );
        anyhow::ensure!(
            self.pending_max >= 1,
            "events.pending_max must be at least 1"
        );
        Ok(())
    }

    /// The roots an `https://` endpoint's certificate is checked against: the public web's,
    /// and `ca_file`'s.
    pub fn tls(&self) -> anyhow::Result<Arc<spindle_providers::tls::ClientConfig>> {
        spindle_providers::tls::roots_with(self.ca_file.as_deref())
            .map_err(|e| anyhow::anyhow!("events.ca_file: {e}"))
    }
}
