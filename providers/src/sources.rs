//! Where media may be fetched from: a provider's answer names the URL of its video, and a node
//! that fetched whatever it named could be sent to the cloud's metadata service or anywhere
//! else inside its network (server-side request forgery). [`Sources`] says which hosts are
//! allowed (none listed: any); addresses no video is ever served from — link-local ones (the
//! metadata services among them), unspecified, multicast and broadcast ones — are refused
//! whatever the list says, checked on every address a name resolves to, at connect time (the
//! resolver of the fetching client drops them: a name that resolves to one later, say by DNS
//! rebinding, still cannot reach it).

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::dns::Name;

/// The hosts media may be fetched from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sources {
    /// `host` or `host:port` (lower case); empty: any host.
    hosts: Vec<String>,
}

impl Sources {
    /// Any host (the forbidden addresses still refused).
    pub fn any() -> Sources {
        Sources::default()
    }

    /// Only these hosts (`host` or `host:port`).
    pub fn only(hosts: &[String]) -> Sources {
        Sources {
            hosts: hosts.iter().map(|h| h.to_ascii_lowercase()).collect(),
        }
    }

    /// Why `uri` may not be fetched, if it may not: not a listed host, or an address literal
    /// that is never a video's source.
    pub fn refusal(&self, uri: &hyper::Uri) -> Option<String> {
        let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = host.parse::<IpAddr>() {
            if forbidden(ip) {
                return Some(format!("{ip} is not an address media is fetched from"));
            }
        }
        if self.hosts.is_empty() {
            return None;
        }
        let host = host.to_ascii_lowercase();
        let with_port = uri.port_u16().map(|p| format!("{host}:{p}"));
        let listed = self
            .hosts
            .iter()
            .any(|h| *h == host || Some(h) == with_port.as_ref());
        (!listed).then(|| format!("{host} is not among media.fetch_hosts"))
    }
}

/// Addresses no video is served from: link-local (169.254.0.0/16 — the metadata services of
/// the big clouds, 169.254.169.254 — and fe80::/10), the unspecified, multicast and broadcast
/// ones, Alibaba's metadata address and AWS's IPv6 one.
pub fn forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.octets() == [100, 100, 100, 200]
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return forbidden(IpAddr::V4(v4));
            }
            (v6.segments()[0] & 0xffc0) == 0xfe80
                || v6.is_unspecified()
                || v6.is_multicast()
                || v6 == std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)
        }
    }
}

/// A resolver that drops the forbidden addresses a name resolves to (none left: an error that
/// says so).
#[derive(Debug, Clone, Copy, Default)]
pub struct GuardedResolver;

type Resolving =
    Pin<Box<dyn Future<Output = Result<std::vec::IntoIter<SocketAddr>, std::io::Error>> + Send>>;

impl tower_service::Service<Name> for GuardedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = Resolving;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        Box::pin(async move {
            let all: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> =
                all.iter().copied().filter(|a| !forbidden(a.ip())).collect();
            if allowed.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "{} resolves only to addresses media is not fetched from ({all:?})",
                        name.as_str()
                    ),
                ));
            }
            Ok(allowed.into_iter())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_and_link_local_addresses_are_never_fetched_from() {
        for ip in [
            "169.254.169.254",
            "169.254.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "100.100.100.200",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:169.254.169.254",
            "::",
        ] {
            assert!(forbidden(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "10.0.0.5",
            "93.184.216.34",
            "2001:db8::1",
            "::1",
        ] {
            assert!(!forbidden(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn only_listed_hosts_when_any_are_listed() {
        let uri = |u: &str| u.parse::<hyper::Uri>().unwrap();
        let any = Sources::any();
        assert_eq!(any.refusal(&uri("https://cdn.example.com/v.mp4")), None);
        assert!(any
            .refusal(&uri("http://169.254.169.254/latest/meta-data/"))
            .is_some_and(|r| r.contains("169.254.169.254")));
        assert!(any.refusal(&uri("http://[fe80::1]/x")).is_some());
        let only = Sources::only(&["cdn.example.com".into(), "127.0.0.1:9000".into()]);
        assert_eq!(only.refusal(&uri("https://CDN.example.com/v.mp4")), None);
        assert_eq!(only.refusal(&uri("http://127.0.0.1:9000/v.mp4")), None);
        assert!(only
            .refusal(&uri("http://127.0.0.1:9001/v.mp4"))
            .is_some_and(|r| r.contains("fetch_hosts")));
        assert!(only
            .refusal(&uri("https://evil.example.net/v.mp4"))
            .is_some());
    }

    #[tokio::test]
    async fn a_name_that_resolves_only_to_forbidden_addresses_is_not_connected_to() {
        use tower_service::Service;
        let mut r = GuardedResolver;
        let e = r
            .call("169.254.169.254".parse::<Name>().unwrap())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        let ok: Vec<_> = r
            .call("localhost".parse::<Name>().unwrap())
            .await
            .unwrap()
            .collect();
        assert!(!ok.is_empty());
    }
}
