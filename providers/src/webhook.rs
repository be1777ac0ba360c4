//! Signed JSON POSTs to one configured endpoint: how the node's event relay hands events to the
//! platform. The body is signed like provider callbacks (`x-signature: sha256=<hex HMAC>`), so
//! the receiver checks it with [`crate::signature::verify`].

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WebhookError {
    /// The endpoint is not an http:// or https:// URL that parses.
    #[error("{url}: not a usable http:// or https:// URL ({reason})")]
    BadUrl { url: String, reason: String },
    /// Not sent, or no answer within the timeout.
    #[error("{url}: {reason}")]
    Failed { url: String, reason: String },
    /// Answered, but not with a 2xx.
    #[error("{url} answered {status}")]
    Status { url: String, status: u16 },
}

/// One endpoint and the secret its bodies are signed with.
#[derive(Clone)]
pub struct Webhook {
    url: hyper::Uri,
    secret: Vec<u8>,
    client: Client<crate::tls::Connector, Full<Bytes>>,
    timeout: Duration,
}

impl Webhook {
    /// `url` must be http:// or https:// (its certificate checked against the public web's
    /// roots); every post gives up after `timeout`.
    pub fn new(url: &str, secret: &[u8], timeout: Duration) -> Result<Webhook, WebhookError> {
        let bad = |reason: String| WebhookError::BadUrl {
            url: url.to_string(),
            reason,
        };
        if !crate::tls::is_http_url(url) {
            return Err(bad("another scheme".into()));
        }
        let url: hyper::Uri = url.parse().map_err(|e| bad(format!("{e}")))?;
        Ok(Webhook {
            url,
            secret: secret.to_vec(),
            client: crate::tls::client(&crate::tls::public_roots(), timeout),
            timeout,
        })
    }

    /// Checks an `https://` endpoint against `tls`'s roots instead.
    pub fn with_tls(mut self, tls: &rustls::ClientConfig) -> Webhook {
        self.client = crate::tls::client(tls, self.timeout);
        self
    }

    /// Posts `body` (JSON), signed; Ok once the endpoint answered 2xx.
    pub async fn post(&self, body: Vec<u8>) -> Result<(), WebhookError> {
        let failed = |reason: String| WebhookError::Failed {
            url: self.url.to_string(),
            reason,
        };
        let signature = crate::signature::sign(&self.secret, &body);
        let request = hyper::Request::builder()
            .method(hyper::Method::POST)
            .uri(self.url.clone())
            .header("content-type", "application/json")
            .header(crate::signature::HEADER, signature)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| failed(format!("bad request: {e}")))?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| failed(crate::tls::describe(&e)))?;
            let status = response.status();
            // The answer's body is not needed; reading it lets the connection be reused.
            let _ = response.into_body().collect().await;
            if status.is_success() {
                Ok(())
            } else {
                Err(WebhookError::Status {
                    url: self.url.to_string(),
                    status: status.as_u16(),
                })
            }
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(failed(format!("no answer within {:?}", self.timeout))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_that_is_not_http_or_https_is_refused_by_name() {
        let t = Duration::from_secs(1);
        for url in ["ftp://example.com/e", "http://exa mple/e"] {
            match Webhook::new(url, b"s", t) {
                Err(WebhookError::BadUrl { url: named, .. }) => assert_eq!(named, url),
                Err(e) => panic!("{url}: {e}"),
                Ok(_) => panic!("{url} accepted"),
            }
        }
        assert!(Webhook::new("http://127.0.0.1:9/events", b"s", t).is_ok());
        assert!(Webhook::new("https://example.com/events", b"s", t).is_ok());
    }
}
