//! `[provider]`: the HTTP provider the node dispatches to.

use std::sync::Arc;

/// The provider section of the node's configuration.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// Base URL of the generic provider API (the mock provider speaks it): `http://` or
    /// `https://` (its certificate checked against the public web's roots, and `ca_file`'s).
    pub url: String,
    /// PEM certificates of a private CA that the provider's `https://` certificates (its API's
    /// and its videos') may chain to, beside the public web's roots.
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// The secret callbacks are signed with.
    pub secret: String,
    /// Each HTTP call gives up after this; a submit without an answer is SUBMIT_UNKNOWN.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Staged polling when callbacks do not come: waits between polls of a job, the last
    /// repeated (each × a jitter of 0.7–1.3).
    #[serde(default = "default_poll_ms")]
    pub poll_ms: Vec<u64>,
    /// Send callbacks here instead of the node's HTTP address (behind a proxy, say).
    #[serde(default)]
    pub callback_base: Option<String>,
    /// Polls of one job before it counts as stuck: it is then canceled at the provider and its
    /// task ends FAILED with the reason (with the default stages, about 2.8 hours of polling).
    #[serde(default = "default_polls_max")]
    pub polls_max: u32,
    /// How far from the node's clock a callback's signed time may be (either side): one outside
    /// it is refused, and one seen inside it is not acted on again (a captured callback cannot
    /// be replayed).
    #[serde(default = "default_callback_window_s")]
    pub callback_window_s: u64,
    /// Calls the node has open at the provider at once (submits, queries, polls, cancels);
    /// more wait for one to end. Bounds the connections and sockets a burst (a restart that
    /// asks about every live attempt, say) opens.
    #[serde(default = "default_requests_max")]
    pub requests_max: usize,
}

fn default_callback_window_s() -> u64 {
    300
}

fn default_requests_max() -> usize {
    256
}

fn default_polls_max() -> u32 {
    1_000
}

fn default_timeout_ms() -> u64 {
    2_000
}

fn default_poll_ms() -> Vec<u64> {
    vec![1_000, 2_000, 5_000, 10_000]
}

impl ProviderConfig {
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            spindle_providers::tls::is_http_url(&self.url),
            "provider.url must be an http:// or https:// URL"
        );
        self.tls()?;
        anyhow::ensure!(!self.secret.is_empty(), "provider.secret must not be empty");
        anyhow::ensure!(
            (50..=120_000).contains(&self.timeout_ms),
            "provider.timeout_ms must be 50..=120000"
        );
        anyhow::ensure!(
            !self.poll_ms.is_empty()
                && self.poll_ms.len() <= 16
                && self.poll_ms.iter().all(|&p| (10..=600_000).contains(&p)),
            "provider.poll_ms must hold 1..=16 waits of 10..=600000 ms"
        );
        anyhow::ensure!(
            (1..=1_000_000).contains(&self.polls_max),
            "provider.polls_max must be 1..=1000000"
        );
        anyhow::ensure!(
            (1..=3_600).contains(&self.callback_window_s),
            "provider.callback_window_s must be 1..=3600"
        );
        anyhow::ensure!(
            (1..=65_536).contains(&self.requests_max),
            "provider.requests_max must be 1..=65536"
        );
        Ok(())
    }

    /// The roots the provider's `https://` certificates are checked against: the public
    /// web's, and `ca_file`'s.
    pub fn tls(&self) -> anyhow::Result<Arc<spindle_providers::tls::ClientConfig>> {
        spindle_providers::tls::roots_with(self.ca_file.as_deref())
            .map_err(|e| anyhow::anyhow!("provider.ca_file: {e}"))
    }
}
