//! Signatures, checked in constant time. Event webhooks: `x-signature: sha256=<hex
//! HMAC-SHA256(secret, body)>`. Provider callbacks are signed over the time they were sent
//! too — `x-signature: t=<unix ms>,sha256=<hex HMAC-SHA256(secret, "<t>." body)>` — so that a
//! receiver can refuse one sent outside a window and remember the ones it saw inside it: a
//! captured callback cannot be replayed later.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

pub const HEADER: &str = "x-signature";

/// HMAC-SHA256 of `body` under `secret` (also SigV4's: `object_store`).
pub(crate) fn mac(secret: &[u8], body: &[u8]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(body);
    m
}

/// The header value for `body`.
pub fn sign(secret: &[u8], body: &[u8]) -> String {
    format!("sha256={}", hex(&mac(secret, body).finalize().into_bytes()))
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// The signature of a callback `body` sent at `at_ms` (unix ms).
pub fn sign_at(secret: &[u8], at_ms: u64, body: &[u8]) -> String {
    let mut m = mac(secret, format!("{at_ms}.").as_bytes());
    m.update(body);
    format!("t={at_ms},sha256={}", hex(&m.finalize().into_bytes()))
}

/// Why a timed signature was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not a timed signature of this body under this secret.
    Bad,
    /// Sent this many ms away from now, outside the window.
    OutsideWindow(u64),
}

/// A timed signature that checked out: when it was sent, and its tag (what a receiver
/// remembers to refuse it twice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signed {
    pub at_ms: u64,
    pub tag: [u8; 32],
}

/// Checks a callback's timed `header` over `body` under `secret`, sent within `window_ms` of
/// `now_ms` (either side: clocks differ).
pub fn verify_at(
    secret: &[u8],
    body: &[u8],
    header: &str,
    now_ms: u64,
    window_ms: u64,
) -> Result<Signed, Refused> {
    let (t, rest) = header
        .strip_prefix("t=")
        .and_then(|h| h.split_once(','))
        .ok_or(Refused::Bad)?;
    let at_ms: u64 = t.parse().map_err(|_| Refused::Bad)?;
    let tag = tag_of(rest).ok_or(Refused::Bad)?;
    let mut m = mac(secret, format!("{at_ms}.").as_bytes());
    m.update(body);
    m.verify_slice(&tag).map_err(|_| Refused::Bad)?;
    let off = now_ms.abs_diff(at_ms);
    if off > window_ms {
        return Err(Refused::OutsideWindow(off));
    }
    Ok(Signed { at_ms, tag })
}

/// The bytes of lower- or upper-case hex; `None` for an odd length or a non-hex digit.
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The 32 bytes of `sha256=<64 hex digits>`.
fn tag_of(header: &str) -> Option<[u8; 32]> {
    unhex(header.strip_prefix("sha256=")?)?.try_into().ok()
}

/// Whether `header` is the signature of `body` under `secret`.
pub fn verify(secret: &[u8], body: &[u8], header: &str) -> bool {
    tag_of(header).is_some_and(|tag| mac(secret, body).verify_slice(&tag).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_header_of_non_hex_text_is_refused_not_a_panic() {
        // 64 bytes, the length of a tag, but not hex; the second byte cuts a character.
        let header = format!("sha256=a{}", "\u{20ac}".repeat(21));
        assert!(!verify(b"secret", b"body", &header));
        assert_eq!(unhex("0aFf"), Some(vec![0x0a, 0xff]));
        assert_eq!(unhex("0a0"), None);
    }

    #[test]
    fn a_signature_verifies_only_its_own_body_and_secret() {
        let s = sign(b"k", b"{\"a\":1}");
        assert!(verify(b"k", b"{\"a\":1}", &s));
        assert!(!verify(b"k", b"{\"a\":2}", &s));
        assert!(!verify(b"other", b"{\"a\":1}", &s));
        assert!(!verify(b"k", b"{\"a\":1}", "sha256=00"));
        assert!(!verify(b"k", b"{\"a\":1}", &s.replace("sha256=", "md5=")));
    }

    #[test]
    fn a_timed_signature_holds_only_for_its_body_and_time_within_the_window() {
        let s = sign_at(b"k", 1_000_000, b"{}");
        let ok = verify_at(b"k", b"{}", &s, 1_000_500, 300_000).unwrap();
        assert_eq!(ok.at_ms, 1_000_000);
        // Another body, secret or time (the t= part is signed too).
        assert_eq!(
            verify_at(b"k", b"{1}", &s, 1_000_000, 300_000),
            Err(Refused::Bad)
        );
        assert_eq!(
            verify_at(b"x", b"{}", &s, 1_000_000, 300_000),
            Err(Refused::Bad)
        );
        let moved = s.replace("t=1000000", "t=1000001");
        assert_eq!(
            verify_at(b"k", b"{}", &moved, 1_000_000, 300_000),
            Err(Refused::Bad)
        );
        // Outside the window, either side.
        assert_eq!(
            verify_at(b"k", b"{}", &s, 1_400_000, 300_000),
            Err(Refused::OutsideWindow(400_000))
        );
        assert!(verify_at(b"k", b"{}", &s, 600_000, 300_000).is_err());
        // The untimed form is not taken for a callback.
        assert_eq!(
            verify_at(b"k", b"{}", &sign(b"k", b"{}"), 1_000_000, 300_000),
            Err(Refused::Bad)
        );
    }
}
