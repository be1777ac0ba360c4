//! TLS to a node whose port speaks it (`[tls]` in the node's configuration), with rustls
//! (ring). The roots are the caller's: a private CA's certificates ([`Tls::trusting_pem`],
//! [`Tls::trusting_file`]) or the public web's ([`Tls::public_roots`]); where the node asks for
//! client certificates (`tls.client_ca_file`), [`Tls::with_client_cert`] presents one.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;

use crate::ClientError;

/// Certificates taken from one PEM file at most.
pub const ROOTS_MAX: usize = 64;

/// What a client trusts of a node's certificate, and the name it checks it against.
#[derive(Clone)]
pub struct Tls {
    roots: Arc<rustls::RootCertStore>,
    config: Arc<rustls::ClientConfig>,
    /// The name every node's certificate must carry; `None`: the host it is reached at.
    server_name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

fn invalid(why: String) -> ClientError {
    ClientError::Io(std::io::Error::new(std::io::ErrorKind::InvalidInput, why))
}

fn builder(
    roots: &Arc<rustls::RootCertStore>,
) -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots.clone())
}

fn trusting(roots: rustls::RootCertStore) -> Tls {
    let roots = Arc::new(roots);
    let config = builder(&roots).with_no_client_auth();
    Tls {
        roots,
        config: Arc::new(config),
        server_name: None,
    }
}

impl Tls {
    /// Trusts the CA certificates in `pem` (1..=[`ROOTS_MAX`] of them) and nothing else.
    pub fn trusting_pem(pem: &[u8]) -> Result<Tls, ClientError> {
        let mut roots = rustls::RootCertStore::empty();
        for (i, cert) in CertificateDer::pem_slice_iter(pem).enumerate() {
            if i == ROOTS_MAX {
                return Err(invalid(format!("more than {ROOTS_MAX} CA certificates")));
            }
            let cert = cert.map_err(|e| invalid(format!("not PEM certificates: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| invalid(format!("a certificate that is no CA root: {e}")))?;
        }
        if roots.is_empty() {
            return Err(invalid("no PEM certificate to trust".into()));
        }
        Ok(trusting(roots))
    }

    /// [`Tls::trusting_pem`] from a file; errors name it.
    pub fn trusting_file(path: &std::path::Path) -> Result<Tls, ClientError> {
        let pem = std::fs::read(path).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
        Tls::trusting_pem(&pem).map_err(|e| invalid(format!("{}: {e}", path.display())))
    }

    /// Trusts the public web's roots (a node with a publicly issued certificate).
    pub fn public_roots() -> Tls {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        trusting(roots)
    }

    /// Presents the certificate chain `cert_pem` (the client's first) with its private key
    /// `key_pem` to nodes that ask for one.
    pub fn with_client_cert(mut self, cert_pem: &[u8], key_pem: &[u8]) -> Result<Tls, ClientError> {
        let chain = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("client certificate: {e}")))?;
        if chain.is_empty() {
            return Err(invalid("no PEM client certificate".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| invalid(format!("client key: {e}")))?;
        let config = builder(&self.roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| invalid(format!("client certificate and key: {e}")))?;
        self.config = Arc::new(config);
        Ok(self)
    }

    /// [`Tls::with_client_cert`] from files; errors name them.
    pub fn with_client_cert_files(
        self,
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> Result<Tls, ClientError> {
        let read = |path: &std::path::Path| {
            std::fs::read(path).map_err(|e| invalid(format!("{}: {e}", path.display())))
        };
        self.with_client_cert(&read(cert)?, &read(key)?)
    }

    /// Makes every connection a full handshake: no earlier session is resumed (by default a
    /// client resumes the sessions a node gave it, which skips the certificate's check).
    pub fn without_resumption(mut self) -> Tls {
        let mut config = (*self.config).clone();
        config.resumption = rustls::client::Resumption::disabled();
        self.config = Arc::new(config);
        self
    }

    /// Checks every node's certificate against `name` instead of the host each is reached at
    /// (nodes addressed by IP whose certificates name the service, say).
    pub fn server_name(mut self, name: &str) -> Result<Tls, ClientError> {
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| invalid(format!("server name {name:?}: {e}")))?;
        self.server_name = Some(name);
        Ok(self)
    }

    /// The name the certificate of the node at `addr` ("host:port") must carry.
    fn name_for(&self, addr: &str) -> Result<ServerName<'static>, ClientError> {
        if let Some(name) = &self.server_name {
            return Ok(name.clone());
        }
        let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        ServerName::try_from(host.to_string())
            .map_err(|e| invalid(format!("no server name in {addr:?}: {e}")))
    }

    /// The TLS handshake over a connected `stream` to the node at `addr`. A certificate that
    /// does not check out is an error naming why (`invalid peer certificate: UnknownIssuer`).
    pub(crate) async fn connect(
        &self,
        addr: &str,
        stream: TcpStream,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, ClientError> {
        let name = self.name_for(addr)?;
        Ok(tokio_rustls::TlsConnector::from(self.config.clone())
            .connect(name, stream)
            .await?)
    }
}
