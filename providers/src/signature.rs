//! Callback signatures: `x-signature: sha256=<hex HMAC-SHA256(secret, body)>`, checked in
//! constant time.

use hmac::{Hmac, Mac};
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

/// Whether `header` is the signature of `body` under `secret`.
pub fn verify(secret: &[u8], body: &[u8], header: &str) -> bool {
    let Some(hex) = header.strip_prefix("sha256=") else {
        return false;
    };
    if hex.len() != 64 {
        return false;
    }
    let mut tag = [0u8; 32];
    for (i, byte) in tag.iter_mut().enumerate() {
        match u8::from_str_radix(&hex[2 * i..2 * i + 2], 16) {
            Ok(b) => *byte = b,
            Err(_) => return false,
        }
    }
    mac(secret, body).verify_slice(&tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_its_own_body_and_secret() {
        let s = sign(b"k", b"{\"a\":1}");
        assert!(verify(b"k", b"{\"a\":1}", &s));
        assert!(!verify(b"k", b"{\"a\":2}", &s));
        assert!(!verify(b"other", b"{\"a\":1}", &s));
        assert!(!verify(b"k", b"{\"a\":1}", "sha256=00"));
        assert!(!verify(b"k", b"{\"a\":1}", &s.replace("sha256=", "md5=")));
    }
}
