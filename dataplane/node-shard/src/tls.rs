//! TLS on the node's own listeners (`[tls]` in the configuration): the client protocol's port
//! and the HTTP port serve it with the same certificate, read again every [`RELOAD_EVERY`]
//! ([`Certificates`]); with `client_ca_file` the client protocol's port also requires client
//! certificates (mTLS).
//!
//! The client protocol runs on glommio, which rustls has no adapter for, so rustls is driven
//! here by hand: a [`Link`] is a socket (or one half of it) and, with TLS, the connection's
//! [`Session`] — rustls' state and the ciphertext read but not yet given to it. A session is
//! `Send`: a connection handed from the executor that accepted it to its tenant's shard takes
//! its session along (`server::Handoff`). After the Hello a connection's reader and writer are
//! two tasks of one executor sharing the session (`Rc<RefCell<…>>`, never borrowed across an
//! await); only the writer writes to the socket, so what rustls has to send after a read (an
//! alert, a key update's answer) goes out with the writer's next write — the reader nudges it
//! ([`Link::wants_write`]).

use std::cell::RefCell;
use std::io::{self, Read, Write};
use std::rc::Rc;
use std::sync::{Arc, Mutex, RwLock};

use futures_util::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
pub use rustls::ServerConfig;
pub use spindle_node_base::config::{TlsConfig, CLIENT_CAS_MAX};

/// Ciphertext read from the socket at once: a whole TLS record and its overhead.
const CIPHER_CHUNK: usize = 16 * 1024 + 512;

/// Both listeners' rustls configurations and the certificate they present.
pub struct Listeners {
    /// The client protocol's port (client certificates required with `client_ca_file`).
    pub protocol: Arc<ServerConfig>,
    /// The HTTP port.
    pub http: Arc<ServerConfig>,
    /// What both present, read again by [`Certificates::watch`].
    pub certificates: Arc<Certificates>,
}

/// How often the certificate's files are read again: a renewed certificate (cert-manager,
/// certbot, …) is in use for new connections within this, without a restart.
pub const RELOAD_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

impl Listeners {
    /// Both listeners' rustls configurations from `[tls]`, and the certificate they present
    /// (for [`Certificates::reload`]); an error names the files and what is wrong with them.
    pub fn from_config(config: &TlsConfig) -> anyhow::Result<Listeners> {
        let (cert, key) = config.read()?;
        let current = config.certified(&cert, &key)?;
        let certs = Arc::new(Certificates {
            files: config.clone(),
            loaded: Mutex::new((cert, key)),
            current: RwLock::new(Arc::new(current)),
        });
        let builder = || {
            ServerConfig::builder_with_provider(spindle_providers::tls::crypto())
                .with_safe_default_protocol_versions()
                .expect("ring supports the default protocol versions")
        };
        let http = Arc::new(
            builder()
                .with_no_client_auth()
                .with_cert_resolver(certs.clone()),
        );
        let protocol = match config.client_verifier()? {
            None => http.clone(),
            Some(verifier) => Arc::new(
                builder()
                    .with_client_cert_verifier(verifier)
                    .with_cert_resolver(certs.clone()),
            ),
        };
        Ok(Listeners {
            protocol,
            http,
            certificates: certs,
        })
    }
}

/// The certificate the listeners present, replaced when its files change.
#[derive(Debug)]
pub struct Certificates {
    files: TlsConfig,
    /// The files' bytes when last loaded (or tried).
    loaded: Mutex<(Vec<u8>, Vec<u8>)>,
    current: RwLock<Arc<rustls::sign::CertifiedKey>>,
}

impl Certificates {
    /// Reads the files again; a changed pair that makes a certificate replaces the one new
    /// handshakes get (connections already up keep theirs). `Ok(true)`: replaced. An error
    /// (a file missing, a key that is not the certificate's — one file renewed before the
    /// other, say) leaves the one in use; the next call tries again.
    pub fn reload(&self) -> anyhow::Result<bool> {
        let (cert, key) = self.files.read()?;
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if *loaded == (cert.clone(), key.clone()) {
            return Ok(false);
        }
        let next = self.files.certified(&cert, &key)?;
        *loaded = (cert, key);
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
        Ok(true)
    }

    /// Reloads every [`RELOAD_EVERY`] until the runtime stops, logging what changed.
    pub async fn watch(self: Arc<Self>) {
        let mut failing = false;
        loop {
            tokio::time::sleep(RELOAD_EVERY).await;
            match self.reload() {
                Ok(true) => {
                    failing = false;
                    tracing::info!(
                        "TLS certificate reloaded from {}",
                        self.files.cert_file.display()
                    );
                }
                Ok(false) => failing = false,
                // Said once per failing spell, not every few seconds.
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!("TLS certificate not reloaded, the previous one kept: {e}");
                }
                Err(_) => {}
            }
        }
    }
}

impl rustls::server::ResolvesServerCert for Certificates {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

/// A TLS connection's state between the socket and the plaintext.
pub struct Session {
    conn: rustls::ServerConnection,
    /// Ciphertext read from the socket; `cipher[at..]` is not yet given to rustls.
    cipher: Vec<u8>,
    at: usize,
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl Session {
    /// Gives rustls what it takes of the ciphertext read so far. False when all of it was
    /// given already: read more from the socket.
    fn feed(&mut self) -> io::Result<bool> {
        if self.at == self.cipher.len() {
            return Ok(false);
        }
        let mut rest = &self.cipher[self.at..];
        let n = self.conn.read_tls(&mut rest)?;
        if n == 0 {
            // rustls takes input until its buffers are full, and says so with an error; never
            // spin on input it did not take.
            return Err(io::Error::other("TLS input not taken"));
        }
        self.at += n;
        self.conn.process_new_packets().map_err(tls_error)?;
        Ok(true)
    }
}

/// Reads ciphertext from `io` into the session's buffer (taken out while the read waits, so
/// that no borrow is held across it). `Ok(0)`: the socket's end.
async fn read_cipher<R: AsyncRead + Unpin>(io: &mut R, s: &RefCell<Session>) -> io::Result<usize> {
    let mut cipher = std::mem::take(&mut s.borrow_mut().cipher);
    cipher.resize(CIPHER_CHUNK, 0);
    let read = io.read(&mut cipher).await;
    cipher.truncate(*read.as_ref().unwrap_or(&0));
    let mut s = s.borrow_mut();
    s.cipher = cipher;
    s.at = 0;
    read
}

/// Writes what rustls has to send.
async fn flush<W: AsyncWrite + Unpin>(
    io: &mut W,
    s: &RefCell<Session>,
    out: &mut Vec<u8>,
) -> io::Result<()> {
    out.clear();
    {
        let mut s = s.borrow_mut();
        while s.conn.wants_write() {
            s.conn.write_tls(out)?;
        }
    }
    if out.is_empty() {
        return Ok(());
    }
    io.write_all(out).await
}

/// A socket, or one half of it, and its TLS session when the listener speaks TLS.
pub struct Link<S> {
    io: S,
    tls: Option<Rc<RefCell<Session>>>,
    /// Ciphertext on its way out (reused).
    out: Vec<u8>,
}

impl<S> Link<S> {
    pub fn plain(io: S) -> Link<S> {
        Link {
            io,
            tls: None,
            out: Vec::new(),
        }
    }

    /// Whether rustls has something to send that no write has taken yet (after a read: an
    /// alert, a key update's answer). Never for a plain link.
    pub fn wants_write(&self) -> bool {
        self.tls
            .as_ref()
            .is_some_and(|s| s.borrow().conn.wants_write())
    }

    /// The socket and the session, for a hand-over to another thread. The link must not be
    /// split (a split link's halves share the session).
    pub fn into_parts(self) -> (S, Option<Session>) {
        let tls = self.tls.map(|s| match Rc::try_unwrap(s) {
            Ok(s) => s.into_inner(),
            Err(_) => unreachable!("a link is taken apart only before it is split"),
        });
        (self.io, tls)
    }

    /// A link from its parts (what [`Link::into_parts`] gave, on the thread taking it up).
    pub fn from_parts(io: S, tls: Option<Session>) -> Link<S> {
        Link {
            io,
            tls: tls.map(|s| Rc::new(RefCell::new(s))),
            out: Vec::new(),
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.io
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Link<S> {
    /// Runs the server's side of a TLS handshake on this (plain) link. The ciphertext that
    /// came after the client's last handshake message (its first requests, pipelined) stays in
    /// the session (in rustls' buffers, or in ours) for the first reads. A client that speaks
    /// the protocol without TLS is reported as [`Accepted::Plain`], nothing written to it (the
    /// caller tells it in a frame it can read). The key agreement and signature run on this
    /// thread (~0.2 ms of a shard's CPU per connection: docs/benchmarks/journal.md).
    pub async fn accept_tls(&mut self, config: Arc<ServerConfig>) -> io::Result<Accepted> {
        let conn = rustls::ServerConnection::new(config).map_err(tls_error)?;
        let s = RefCell::new(Session {
            conn,
            cipher: Vec::new(),
            at: 0,
        });
        let mut first = true;
        loop {
            flush(&mut self.io, &s, &mut self.out).await?;
            if !s.borrow().conn.is_handshaking() {
                break;
            }
            let fed = s.borrow_mut().feed();
            match fed {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    // The alert that says why, then the error.
                    let _ = flush(&mut self.io, &s, &mut self.out).await;
                    return Err(e);
                }
            }
            if read_cipher(&mut self.io, &s).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            if first && !looks_like_tls(&s.borrow().cipher) {
                return Ok(Accepted::Plain);
            }
            first = false;
        }
        self.tls = Some(Rc::new(RefCell::new(s.into_inner())));
        Ok(Accepted::Tls)
    }
}

/// Whether a connection's first bytes can open a TLS handshake: a record of content type 22
/// (handshake) and major version 3. A spindle frame starts with its length, little-endian: a
/// Hello of 790 bytes would pass too, and fail the handshake with an alert.
fn looks_like_tls(first: &[u8]) -> bool {
    first.first() == Some(&22) && first.get(1).is_none_or(|&v| v == 3)
}

/// How a TLS handshake ended, short of an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepted {
    Tls,
    /// The client sent something that is not TLS: nothing was written to it.
    Plain,
}

impl<S: AsyncRead + Unpin> Link<S> {
    /// Reads plaintext into `buf`: `Ok(0)` at the connection's end.
    pub async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(s) = &self.tls else {
            return self.io.read(buf).await;
        };
        loop {
            {
                let mut s = s.borrow_mut();
                match s.conn.reader().read(buf) {
                    // 0: the peer's close_notify.
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if s.feed()? {
                    continue;
                }
            }
            if read_cipher(&mut self.io, s).await? == 0 {
                return Ok(0);
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> Link<S> {
    /// Writes all of `bytes` (for a TLS link, also whatever rustls had to send: an empty
    /// `bytes` sends only that).
    pub async fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        let Some(s) = &self.tls else {
            return self.io.write_all(bytes).await;
        };
        loop {
            {
                let mut s = s.borrow_mut();
                while !bytes.is_empty() {
                    // Short when rustls' send buffer is full: flushed below, then the rest.
                    let n = s.conn.writer().write(bytes)?;
                    if n == 0 {
                        break;
                    }
                    bytes = &bytes[n..];
                }
            }
            flush(&mut self.io, s, &mut self.out).await?;
            if bytes.is_empty() {
                return Ok(());
            }
        }
    }

    /// Ends the connection: TLS's close_notify, then the socket's end.
    pub async fn close(&mut self) -> io::Result<()> {
        if let Some(s) = &self.tls {
            s.borrow_mut().conn.send_close_notify();
            let _ = flush(&mut self.io, s, &mut self.out).await;
        }
        self.io.close().await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Link<S> {
    /// The reading and the writing half, sharing the session.
    pub fn split(
        self,
    ) -> (
        Link<futures_util::io::ReadHalf<S>>,
        Link<futures_util::io::WriteHalf<S>>,
    ) {
        let (r, w) = self.io.split();
        (
            Link {
                io: r,
                tls: self.tls.clone(),
                out: Vec::new(),
            },
            Link {
                io: w,
                tls: self.tls,
                out: self.out,
            },
        )
    }
}
