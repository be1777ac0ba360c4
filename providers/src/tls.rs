//! TLS for outbound HTTP — provider API calls, the provider's videos, event webhooks — with
//! rustls (ring): an `https://` peer's certificate is checked against the public web's roots
//! (webpki-roots, built in: no system store needed) and, where configured, a private CA's
//! certificates (`provider.ca_file`). `http://` stays plain. The mock provider serves HTTPS
//! too ([`server_config`]), so the tests use the same path as a real provider.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub use rustls::{ClientConfig, ServerConfig};

/// The connector every outbound client uses: `https://` over rustls, `http://` plain.
pub type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// Whether `url` is one the outbound clients speak: `http://`, or `https://` over rustls.
pub fn is_http_url(url: &str) -> bool {
    url.starts_with("http://") || url.starts_with("https://")
}

/// Certificates of a private CA: at most this many in one file.
pub const EXTRA_ROOTS_MAX: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    /// Roots or a server's certificate that cannot be used, and why.
    #[error("{what}: {reason}")]
    Unusable { what: String, reason: String },
}

/// The cryptography every TLS configuration here uses: rustls' ring provider.
pub fn crypto() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn public_store() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    roots
}

fn trusting(roots: rustls::RootCertStore) -> rustls::ClientConfig {
    rustls::ClientConfig::builder_with_provider(crypto())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// Trusts the public web's roots only (one configuration, shared).
pub fn public_roots() -> Arc<rustls::ClientConfig> {
    static CONFIG: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    CONFIG
        .get_or_init(|| Arc::new(trusting(public_store())))
        .clone()
}

/// Trusts the public web's roots and the PEM certificates in `pem` (1..=[`EXTRA_ROOTS_MAX`]
/// of them; `what` names them in errors: a file's path, say).
pub fn with_extra_roots(pem: &[u8], what: &str) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = public_store();
    add_pem_roots(&mut roots, pem, what)?;
    Ok(Arc::new(trusting(roots)))
}

/// The PEM CA certificates in the file at `path` alone (1..=[`EXTRA_ROOTS_MAX`]): a server's
/// roots for its clients' certificates, say. Errors name the file.
pub fn pem_roots_file(path: &std::path::Path) -> Result<rustls::RootCertStore, TlsError> {
    let (pem, what) = read(path)?;
    let mut roots = rustls::RootCertStore::empty();
    add_pem_roots(&mut roots, &pem, &what)?;
    Ok(roots)
}

/// Adds the PEM certificates in `pem` (1..=[`EXTRA_ROOTS_MAX`]) to `roots`.
fn add_pem_roots(
    roots: &mut rustls::RootCertStore,
    pem: &[u8],
    what: &str,
) -> Result<(), TlsError> {
    let unusable = |reason: String| TlsError::Unusable {
        what: what.to_string(),
        reason,
    };
    let mut added = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| unusable(format!("not PEM certificates: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| unusable(format!("a certificate that is no CA root: {e}")))?;
        added += 1;
        if added > EXTRA_ROOTS_MAX {
            return Err(unusable(format!(
                "more than {EXTRA_ROOTS_MAX} certificates"
            )));
        }
    }
    if added == 0 {
        return Err(unusable("no PEM certificate in it".into()));
    }
    Ok(())
}

/// [`with_extra_roots`] from the file at `path`.
pub fn with_roots_file(path: &std::path::Path) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let (pem, what) = read(path)?;
    with_extra_roots(&pem, &what)
}

/// The public web's roots, and those of `ca_file` where one is configured.
pub fn roots_with(
    ca_file: Option<&std::path::Path>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    match ca_file {
        None => Ok(public_roots()),
        Some(path) => with_roots_file(path),
    }
}

/// The bytes of the file at `path`, and its name for errors.
fn read(path: &std::path::Path) -> Result<(Vec<u8>, String), TlsError> {
    let what = path.display().to_string();
    let pem = std::fs::read(path).map_err(|e| TlsError::Unusable {
        what: what.clone(),
        reason: e.to_string(),
    })?;
    Ok((pem, what))
}

/// An HTTP/1.1 client, `https://` trusting `tls`'s roots; connecting gives up after
/// `connect_timeout`, idle connections after 30 s.
pub fn client(
    tls: &rustls::ClientConfig,
    connect_timeout: Duration,
) -> Client<Connector, Full<Bytes>> {
    over(HttpConnector::new(), tls, connect_timeout)
}

/// A client like [`client`] whose resolver drops the addresses media is never fetched from
/// (`crate::sources`).
pub fn guarded_client(
    tls: &rustls::ClientConfig,
    connect_timeout: Duration,
) -> Client<hyper_rustls::HttpsConnector<HttpConnector<crate::sources::GuardedResolver>>, Full<Bytes>>
{
    over(
        HttpConnector::new_with_resolver(crate::sources::GuardedResolver),
        tls,
        connect_timeout,
    )
}

/// [`client`]'s settings over `http`, whatever resolves its names.
fn over<R>(
    mut http: HttpConnector<R>,
    tls: &rustls::ClientConfig,
    connect_timeout: Duration,
) -> Client<hyper_rustls::HttpsConnector<HttpConnector<R>>, Full<Bytes>>
where
    hyper_rustls::HttpsConnector<HttpConnector<R>>:
        hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls.clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector)
}

/// A server's TLS configuration: its certificate chain and private key, PEM.
pub fn server_config(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let unusable = |reason: String| TlsError::Unusable {
        what: "the server's certificate".into(),
        reason,
    };
    let (chain, key) = pem_chain_and_key(cert_pem, key_pem).map_err(unusable)?;
    rustls::ServerConfig::builder_with_provider(crypto())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map(Arc::new)
        .map_err(|e| unusable(e.to_string()))
}

/// A certificate chain (the server's own first) and its private key, from PEM; an error says
/// what is wrong with them.
#[allow(clippy::type_complexity)]
pub fn pem_chain_and_key(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    if chain.is_empty() {
        return Err("no PEM certificate".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| e.to_string())?;
    Ok((chain, key))
}

/// `e` with the errors under it, `a: b: c`: a client's "client error (Connect)" says nothing
/// of the certificate the TLS handshake refused, its sources do.
/// Sends `request` on `client` and reads the answer's body, at most `max_bytes`: the answer's
/// head and body, or why not (a failed send's cause chain, or "reading the answer: …").
pub async fn exchange(
    client: &Client<Connector, Full<Bytes>>,
    request: hyper::Request<Full<Bytes>>,
    max_bytes: usize,
) -> Result<(hyper::http::response::Parts, Bytes), String> {
    use http_body_util::BodyExt;
    let response = client.request(request).await.map_err(|e| describe(&e))?;
    let (head, body) = response.into_parts();
    let body = http_body_util::Limited::new(body, max_bytes)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    Ok((head, body))
}

pub fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}
