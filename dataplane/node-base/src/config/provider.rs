//! `[provider]`: the HTTP provider the node dispatches to.

use std::sync::Arc;

/// The provider section of the node's configuration.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// Which API the provider speaks: `spindle` (the generic API, which the mock provider
    /// speaks), `replicate`, `fal` or `minimax` (docs/providers.md has a table per vendor).
    #[serde(default)]
    pub vendor: spindle_providers::Vendor,
    /// Base URL of the provider's API: `http://` or `https://` (its certificate checked against
    /// the public web's roots, and `ca_file`'s). The vendors': `https://api.replicate.com`,
    /// `https://queue.fal.run`, `https://api.minimax.io`.
    pub url: String,
    /// The vendor's API key (`token_file` reads it from a file); a vendor needs one, spindle's
    /// API takes none.
    #[serde(default)]
    pub token: Option<String>,
    /// fal.ai: the JSON Web Key Set its webhooks are signed with (saved from
    /// `https://rest.alpha.fal.ai/.well-known/jwks.json`).
    #[serde(default)]
    pub jwks_file: Option<std::path::PathBuf>,
    /// The vendor's model id for each of spindle's model names (`"video-model-0" =
    /// "minimax/video-01"`); a model not named here is sent under its own name.
    #[serde(default)]
    pub models: std::collections::BTreeMap<String, String>,
    /// Replicate: how far back a submit whose answer never came is looked for in the
    /// predictions list (by the key its webhook URL names).
    #[serde(default = "default_lookup_window_s")]
    pub lookup_window_s: u64,
    /// PEM certificates of a private CA that the provider's `https://` certificates (its API's
    /// and its videos') may chain to, beside the public web's roots.
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// The secret callbacks are signed with: spindle's API signs with it; Replicate's is the
    /// account's webhook signing secret (`whsec_…`); for fal and MiniMax it keys the token each
    /// attempt's callback URL carries.
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

fn default_lookup_window_s() -> u64 {
    86_400
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
        anyhow::ensure!(
            (60..=30 * 86_400).contains(&self.lookup_window_s),
            "provider.lookup_window_s must be 60..=2592000"
        );
        self.provider(&*self.tls()?)?;
        Ok(())
    }

    /// The client for the configured API; every error names the key at fault.
    pub fn provider(
        &self,
        tls: &spindle_providers::tls::ClientConfig,
    ) -> anyhow::Result<spindle_providers::Provider> {
        use spindle_providers::vendors::{fal::Fal, minimax::Minimax, replicate::Replicate};
        use spindle_providers::{Provider, Vendor};
        let http = spindle_providers::HttpProvider::new(
            &self.url,
            std::time::Duration::from_millis(self.timeout_ms),
        )
        .with_tls(tls)
        .with_requests_max(self.requests_max);
        let token = || {
            self.token
                .as_deref()
                .filter(|t| !t.is_empty())
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "provider.token (or token_file) must hold the {} API key",
                        self.vendor.name()
                    )
                })
        };
        let named = |e: String| anyhow::anyhow!("provider: {e}");
        Ok(match self.vendor {
            Vendor::Spindle => {
                anyhow::ensure!(
                    self.token.is_none() && self.jwks_file.is_none(),
                    "provider.token and provider.jwks_file are for vendors' APIs (vendor = ...)"
                );
                Provider::Spindle(http)
            }
            Vendor::Replicate => Provider::Replicate(
                Replicate::new(http, token()?, &self.secret, self.lookup_window_s)
                    .map_err(named)?,
            ),
            Vendor::Fal => {
                let path = self.jwks_file.as_ref().ok_or_else(|| {
                    anyhow::anyhow!("provider.jwks_file must name fal's webhook key set")
                })?;
                let jwks = std::fs::read(path)
                    .map_err(|e| anyhow::anyhow!("provider.jwks_file {}: {e}", path.display()))?;
                Provider::Fal(
                    Fal::new(http, token()?, &jwks).map_err(|e| {
                        anyhow::anyhow!("provider.jwks_file {}: {e}", path.display())
                    })?,
                )
            }
            Vendor::Minimax => Provider::Minimax(Minimax::new(http, token()?).map_err(named)?),
        })
    }

    /// The roots the provider's `https://` certificates are checked against: the public
    /// web's, and `ca_file`'s.
    pub fn tls(&self) -> anyhow::Result<Arc<spindle_providers::tls::ClientConfig>> {
        spindle_providers::tls::roots_with(self.ca_file.as_deref())
            .map_err(|e| anyhow::anyhow!("provider.ca_file: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(extra: &str) -> ProviderConfig {
        toml::from_str(&format!(
            "url = \"https://api.example.com\"\nsecret = \"whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD\"\n{extra}"
        ))
        .unwrap()
    }

    fn refusal(extra: &str) -> String {
        section(extra).check().unwrap_err().to_string()
    }

    #[test]
    fn a_vendors_section_is_checked_key_by_key() {
        section("").check().unwrap();
        section("vendor = \"replicate\"\ntoken = \"r8_x\"")
            .check()
            .unwrap();
        section("vendor = \"minimax\"\ntoken = \"k\"")
            .check()
            .unwrap();
        assert!(
            refusal("vendor = \"replicate\"").contains("provider.token (or token_file)"),
            "a vendor needs its API key"
        );
        assert!(refusal("token = \"k\"").contains("are for vendors' APIs"));
        let e = toml::from_str::<ProviderConfig>(
            "url = \"https://x\"\nsecret = \"s\"\nvendor = \"replicate\"\ntoken = \"k\"",
        )
        .unwrap()
        .check()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("whsec_"),
            "Replicate's secret is its signing secret: {e}"
        );
        assert!(refusal("vendor = \"fal\"\ntoken = \"k\"").contains("provider.jwks_file"));
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        std::fs::write(&jwks, r#"{"keys": []}"#).unwrap();
        let e = refusal(&format!(
            "vendor = \"fal\"\ntoken = \"k\"\njwks_file = \"{}\"",
            jwks.display()
        ));
        assert!(e.contains("no Ed25519 key"), "{e}");
        assert!(refusal("vendor = \"minimax\"\ntoken = \"line\\nbreak\"").contains("API key"));
        assert!(
            toml::from_str::<ProviderConfig>("url = \"x\"\nsecret = \"s\"\nvendor = \"acme\"")
                .unwrap_err()
                .to_string()
                .contains("unknown variant")
        );
    }
}
