//! TLS to PostgreSQL, asked for in the conninfo the way libpq asks for it.
//!
//! | `sslmode` | what the store does |
//! |---|---|
//! | `disable`, `allow`, `prefer` (the default) | plain TCP (a TLS session that is not verified protects from no one, so none is tried) |
//! | `require`, `verify-ca`, `verify-full` | TLS or no connection; the server's certificate verified against `sslrootcert` and its name against the host's |
//!
//! `sslrootcert` names a PEM file of the CA certificates the server's chains to (at most
//! [`ROOTS_MAX`]); without it, the public web's roots (as libpq's `sslrootcert=system`). Unlike
//! libpq, `require` verifies too: a store that asks for TLS gets a server it can name. rustls
//! (ring) does the TLS, as for every other peer of spindle; no OpenSSL.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// At most this many certificates in an `sslrootcert` file.
pub const ROOTS_MAX: usize = 64;

/// A conninfo split into what tokio-postgres reads and the TLS it asks for.
pub struct PgTls {
    /// The conninfo without `sslrootcert`, its `sslmode` one tokio-postgres knows.
    pub conninfo: String,
    /// TLS with this configuration, required; `None`: plain.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for PgTls {
    /// Without the conninfo, which may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTls")
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// Reads `sslmode` and `sslrootcert` from `conninfo` (`key=value …` or a `postgresql://` URL).
/// The error names the setting and the problem.
pub fn parse(conninfo: &str) -> Result<PgTls, String> {
    let url = conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://");
    let (head, params): (&str, Vec<String>) = if url {
        match conninfo.split_once('?') {
            Some((head, query)) => (head, query.split('&').map(str::to_string).collect()),
            None => (conninfo, Vec::new()),
        }
    } else {
        ("", words(conninfo)?)
    };
    let mut mode = None;
    let mut root = None;
    let mut kept = Vec::with_capacity(params.len());
    for p in params {
        let (key, value) = p.split_once('=').unwrap_or((p.as_str(), ""));
        let value = unquote(value);
        match key.trim() {
            "sslmode" => mode = Some(value),
            "sslrootcert" => root = Some(value),
            _ => kept.push(p.clone()),
        }
    }
    let required = match mode.as_deref() {
        None | Some("disable" | "allow" | "prefer") => false,
        Some("require" | "verify-ca" | "verify-full") => true,
        Some(other) => {
            return Err(format!(
                "sslmode {other:?}: one of disable, allow, prefer, require, verify-ca, verify-full"
            ))
        }
    };
    if required {
        kept.push("sslmode=require".into());
    } else if root.is_some() {
        return Err(
            "sslrootcert is given but sslmode asks for no TLS: set sslmode=verify-full".into(),
        );
    }
    let conninfo = if url {
        if kept.is_empty() {
            head.to_string()
        } else {
            format!("{head}?{}", kept.join("&"))
        }
    } else {
        kept.join(" ")
    };
    let tls = if required {
        Some(Arc::new(client_config(root.as_deref())?))
    } else {
        None
    };
    Ok(PgTls { conninfo, tls })
}

/// `key=value` words of a libpq conninfo: values may be single-quoted (with `\'` and `\\`),
/// spaces around `=` allowed.
fn words(conninfo: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut chars = conninfo.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(format!("conninfo: {key:?} has no value"));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut word = format!("{key}=");
        if chars.next_if_eq(&'\'').is_some() {
            word.push('\'');
            loop {
                match chars.next() {
                    None => return Err(format!("conninfo: {key}'s quote is not closed")),
                    Some('\\') => {
                        word.push('\\');
                        word.extend(chars.next());
                    }
                    Some('\'') => break,
                    Some(c) => word.push(c),
                }
            }
            word.push('\'');
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                word.push(c);
            }
        }
        out.push(word);
    }
}

fn unquote(value: &str) -> String {
    let Some(inner) = value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) else {
        return value.to_string();
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        out.push(if c == '\\' {
            chars.next().unwrap_or('\\')
        } else {
            c
        });
    }
    out
}

fn client_config(root: Option<&str>) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    match root {
        None | Some("system") => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| format!("sslrootcert {path}: {e}"))?;
            let mut added = 0;
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| format!("sslrootcert {path}: not PEM: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("sslrootcert {path}: not a CA certificate: {e}"))?;
                added += 1;
                if added > ROOTS_MAX {
                    return Err(format!(
                        "sslrootcert {path}: more than {ROOTS_MAX} certificates"
                    ));
                }
            }
            if added == 0 {
                return Err(format!("sslrootcert {path}: no PEM certificate in it"));
            }
        }
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
}

/// tokio-postgres' TLS over rustls: the server's certificate checked against the roots and
/// the host it was reached by.
#[derive(Clone)]
pub struct MakeRustls(pub Arc<rustls::ClientConfig>);

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, Self::Error> {
        Ok(RustlsConnect {
            config: self.0.clone(),
            name: ServerName::try_from(domain.to_string())?,
        })
    }
}

/// One connection's TLS handshake (see [`MakeRustls`]).
pub struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

type Handshake<S> = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Handshake<S>;

    fn connect(self, stream: S) -> Handshake<S> {
        Box::pin(async move {
            tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await
                .map(RustlsStream)
        })
    }
}

/// A TLS session with the server.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    /// None: SCRAM without channel binding (the certificate check already names the server;
    /// the binding's hash would depend on the certificate's signature algorithm).
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_sslrootcert_are_read_from_both_forms() {
        let plain = parse("host=db port=5432 user=spindle dbname=postgres").unwrap();
        assert!(plain.tls.is_none());
        assert_eq!(
            plain.conninfo,
            "host=db port=5432 user=spindle dbname=postgres"
        );
        let prefer = parse("host=db sslmode=prefer").unwrap();
        assert!(prefer.tls.is_none());

        let dir = tempfile::tempdir().unwrap();
        let ca = rcgen::generate_simple_self_signed(vec!["db".to_string()]).unwrap();
        let path = dir.path().join("ca with space.pem");
        std::fs::write(&path, ca.cert.pem()).unwrap();
        let quoted = format!(
            "host=db sslmode = verify-full sslrootcert='{}' password='a b\\'c'",
            path.display()
        );
        let tls = parse(&quoted).unwrap();
        assert!(tls.tls.is_some());
        assert_eq!(tls.conninfo, "host=db password='a b\\'c' sslmode=require");
        let url = parse(&format!(
            "postgresql://spindle@db/postgres?sslmode=require&sslrootcert={}&application_name=x",
            dir.path().join("ca.pem").display()
        ));
        assert!(url.unwrap_err().contains("ca.pem"));
        std::fs::write(dir.path().join("ca.pem"), ca.cert.pem()).unwrap();
        let url = parse(&format!(
            "postgresql://spindle@db/postgres?sslmode=require&sslrootcert={}&application_name=x",
            dir.path().join("ca.pem").display()
        ))
        .unwrap();
        assert!(url.tls.is_some());
        assert_eq!(
            url.conninfo,
            "postgresql://spindle@db/postgres?application_name=x&sslmode=require"
        );
        let public = parse("host=db sslmode=require").unwrap();
        assert!(public.tls.is_some(), "the public web's roots");
    }

    #[test]
    fn a_bad_tls_setting_is_named() {
        assert!(parse("host=db sslmode=sometimes")
            .unwrap_err()
            .contains("sslmode \"sometimes\""));
        assert!(parse("host=db sslrootcert=/x.pem")
            .unwrap_err()
            .contains("sslmode"));
        assert!(
            parse("host=db sslmode=verify-full sslrootcert=/nonexistent.pem")
                .unwrap_err()
                .starts_with("sslrootcert /nonexistent.pem: ")
        );
        assert!(parse("host='db").unwrap_err().contains("not closed"));
        assert!(parse("host").unwrap_err().contains("no value"));
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "nothing").unwrap();
        let e = parse(&format!(
            "sslmode=verify-full sslrootcert={}",
            empty.display()
        ));
        assert!(e.unwrap_err().contains("no PEM certificate"));
    }
}
