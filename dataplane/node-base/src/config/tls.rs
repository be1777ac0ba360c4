//! `[tls]`: the certificate both listeners present, and the client CAs of mTLS.

use std::path::PathBuf;

/// The `[tls]` section: the certificate (chain, PEM) and private key (PEM) both listeners
/// present.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// Client certificates (mTLS) on the client protocol's port: a client must present one
    /// that chains to these CA certificates (PEM, at most [`CLIENT_CAS_MAX`]). The HTTP port
    /// asks for none (probes, scrapers; its admin API has its tokens).
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

/// CA certificates one `client_ca_file` may hold.
pub const CLIENT_CAS_MAX: usize = spindle_providers::tls::EXTRA_ROOTS_MAX;

impl TlsConfig {
    /// The files' bytes; an error names the file.
    pub fn read(&self) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
        let read = |what: &str, path: &PathBuf| {
            std::fs::read(path).map_err(|e| anyhow::anyhow!("tls.{what}: {}: {e}", path.display()))
        };
        Ok((
            read("cert_file", &self.cert_file)?,
            read("key_file", &self.key_file)?,
        ))
    }

    /// The certificate and key as rustls uses them: the key must be the certificate's.
    pub fn certified(&self, cert: &[u8], key: &[u8]) -> anyhow::Result<rustls::sign::CertifiedKey> {
        let named = |e: String| {
            anyhow::anyhow!(
                "tls: {} with {}: {e}",
                self.cert_file.display(),
                self.key_file.display()
            )
        };
        let (chain, key) = spindle_providers::tls::pem_chain_and_key(cert, key).map_err(named)?;
        rustls::sign::CertifiedKey::from_der(chain, key, &spindle_providers::tls::crypto())
            .map_err(|e| named(e.to_string()))
    }

    /// The verifier of client certificates `client_ca_file` asks for (none without it).
    pub fn client_verifier(
        &self,
    ) -> anyhow::Result<Option<std::sync::Arc<dyn rustls::server::danger::ClientCertVerifier>>>
    {
        let Some(path) = &self.client_ca_file else {
            return Ok(None);
        };
        let roots = spindle_providers::tls::pem_roots_file(path)
            .map_err(|e| anyhow::anyhow!("tls.client_ca_file: {e}"))?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            std::sync::Arc::new(roots),
            spindle_providers::tls::crypto(),
        )
        .build()
        .map_err(|e| anyhow::anyhow!("tls.client_ca_file: {}: {e}", path.display()))?;
        Ok(Some(verifier))
    }

    /// The files read and checked as the listeners will use them: an error names the files and
    /// what is wrong with them.
    pub fn check(&self) -> anyhow::Result<()> {
        let (cert, key) = self.read()?;
        self.certified(&cert, &key)?;
        self.client_verifier()?;
        Ok(())
    }
}
