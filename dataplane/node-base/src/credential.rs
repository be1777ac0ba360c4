//! Tenant credentials: how strong one must be, and how the configuration keeps it.
//!
//! A tenant's `credential` is either the secret itself or its SHA-256, written
//! `sha256:<64 hex digits>` (`spindled --hash-credential` prints it). The node keeps only the
//! digest in memory and compares digests in constant time, so a configuration file or a core
//! dump read by someone else names no credential that a client could present.
//!
//! A credential given in the clear must be at least [`CHARS_MIN`] characters, use at least
//! [`DISTINCT_MIN`] different ones, and carry at least [`BITS_MIN`] bits by a simple estimate
//! (its length times the log of the alphabet its characters come from): a bearer token, not a
//! word. One hashed is checked the same way by `--hash-credential` before it is printed. A
//! plain SHA-256 suffices for such tokens: what a slow hash protects is a guessable secret,
//! which this check refuses.

pub use crate::limits::CHARS_MAX;
use sha2::{Digest, Sha256};

/// The fewest characters a credential may have.
pub const CHARS_MIN: usize = 16;
/// The fewest different characters a credential may use.
pub const DISTINCT_MIN: usize = 8;
/// The fewest bits a credential must carry by [`estimated_bits`].
pub const BITS_MIN: f64 = 64.0;

const HASHED_PREFIX: &str = "sha256:";

/// A tenant's credential as the node keeps it.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    digest: [u8; 32],
    /// Whether the configuration gave it in the clear (the node warns at start).
    pub in_the_clear: bool,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credential(…)")
    }
}

impl Credential {
    /// A configured credential: `sha256:<hex>`, or the secret itself (its strength checked).
    /// The error never contains the credential.
    pub fn parse(configured: &str) -> Result<Credential, String> {
        if let Some(hex) = configured.strip_prefix(HASHED_PREFIX) {
            return parse_digest(hex)
                .map(|digest| Credential {
                    digest,
                    in_the_clear: false,
                })
                .ok_or_else(|| format!("{HASHED_PREFIX} must be followed by 64 hex digits"));
        }
        check_strength(configured)?;
        Ok(Credential {
            digest: digest(configured.as_bytes()),
            in_the_clear: true,
        })
    }

    /// Whether `presented` is this credential: constant time over its digest.
    pub fn matches(&self, presented: &str) -> bool {
        digests_equal(&self.digest, &digest(presented.as_bytes()))
    }

    /// A presented credential compared against no credential, taking the time a known tenant's
    /// would: an unknown tenant is not told apart by how fast it is refused.
    pub fn compare_unknown(presented: &str) -> bool {
        let _ = digests_equal(&[0; 32], &digest(presented.as_bytes()));
        false
    }
}

/// Whether `presented` is the secret `configured` names — `sha256:<hex>` of it, or the secret
/// itself — by digests compared in constant time, without a strength check (the admin API's
/// tokens, whose length the configuration checks; a malformed digest matches nothing).
pub fn matches_configured(configured: &str, presented: &str) -> bool {
    let expected = match configured.strip_prefix(HASHED_PREFIX) {
        Some(hex) => parse_digest(hex),
        None => Some(digest(configured.as_bytes())),
    };
    let got = digest(presented.as_bytes());
    digests_equal(&expected.unwrap_or([0; 32]), &got) & expected.is_some()
}

/// Whether `configured` is a well-formed `sha256:<hex>` (None: not of that form at all).
pub fn hashed_form_ok(configured: &str) -> Option<bool> {
    configured
        .strip_prefix(HASHED_PREFIX)
        .map(|hex| parse_digest(hex).is_some())
}

/// What `spindled --hash-credential` prints for `secret`: `sha256:<hex>`, once the secret has
/// passed the strength check.
pub fn hashed_for_config(secret: &str) -> Result<String, String> {
    check_strength(secret)?;
    let hex: String = digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(format!("{HASHED_PREFIX}{hex}"))
}

/// Refuses a credential that is short, repetitive or from a small alphabet, saying which
/// (never repeating it).
pub fn check_strength(secret: &str) -> Result<(), String> {
    let chars = secret.chars().count();
    if chars < CHARS_MIN {
        return Err(format!(
            "a credential must have at least {CHARS_MIN} characters (this one has {chars})"
        ));
    }
    if chars > CHARS_MAX {
        return Err(format!(
            "a credential may have at most {CHARS_MAX} characters (this one has {chars})"
        ));
    }
    if secret.chars().any(char::is_control) {
        return Err("a credential may not contain control characters".into());
    }
    let mut distinct: Vec<char> = secret.chars().collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < DISTINCT_MIN {
        return Err(format!(
            "a credential must use at least {DISTINCT_MIN} different characters (this one uses {})",
            distinct.len()
        ));
    }
    let bits = estimated_bits(secret);
    if bits < BITS_MIN {
        return Err(format!(
            "a credential must carry at least {BITS_MIN:.0} bits (this one about {bits:.0}: \
             make it longer or draw it from more kinds of characters)"
        ));
    }
    Ok(())
}

/// Length × log2(alphabet), the alphabet being the union of the classes its characters are
/// from: lower case (26), upper case (26), digits (10), other ASCII (33), beyond ASCII (100).
/// It over-rates a word and under-rates nothing random; with [`DISTINCT_MIN`] beside it, it
/// refuses the short and the repetitive.
pub fn estimated_bits(secret: &str) -> f64 {
    let mut classes = [false; 5];
    for c in secret.chars() {
        let class = match c {
            'a'..='z' => 0,
            'A'..='Z' => 1,
            '0'..='9' => 2,
            c if c.is_ascii() => 3,
            _ => 4,
        };
        classes[class] = true;
    }
    let alphabet: u32 = [26, 26, 10, 33, 100]
        .iter()
        .zip(classes)
        .filter(|(_, present)| *present)
        .map(|(size, _)| size)
        .sum();
    secret.chars().count() as f64 * f64::from(alphabet.max(1)).log2()
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

fn digests_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRONG: &str = "tenant-1-credential";

    #[test]
    fn weak_credentials_are_refused_by_what_is_wrong_and_never_echoed() {
        for (weak, why) in [
            ("a", "at least 16 characters"),
            ("tenant-1-secret", "at least 16 characters"),
            ("abababababababababab", "at least 8 different"),
            ("0123456789012345", "at least 64 bits"),
        ] {
            let e = Credential::parse(weak).unwrap_err();
            assert!(e.contains(why), "{weak}: {e}");
            assert!(
                weak.len() < 4 || !e.contains(weak),
                "the error repeats the credential: {e}"
            );
        }
        assert!(Credential::parse("tenant-1-credential\n").is_err());
        assert!(Credential::parse(&"x".repeat(CHARS_MAX + 1)).is_err());
        assert!(estimated_bits(STRONG) >= BITS_MIN);
        // 32 random hex digits: 128 bits.
        Credential::parse("9f86d081884c7d659a2feaa0c55ad015").unwrap();
    }

    #[test]
    fn a_hashed_credential_matches_the_secret_it_was_made_from_and_nothing_else() {
        let line = hashed_for_config(STRONG).unwrap();
        assert_eq!(line.len(), HASHED_PREFIX.len() + 64);
        assert!(!line.contains(STRONG));
        let hashed = Credential::parse(&line).unwrap();
        assert!(!hashed.in_the_clear);
        assert!(hashed.matches(STRONG));
        assert!(!hashed.matches("tenant-2-credential"));
        assert!(
            !hashed.matches(&line),
            "the hash itself is not the credential"
        );
        let clear = Credential::parse(STRONG).unwrap();
        assert!(clear.in_the_clear);
        assert_eq!(clear.digest, hashed.digest);
        assert!(!Credential::compare_unknown(STRONG));
        for bad in [
            "sha256:",
            "sha256:xyz",
            &format!("sha256:{}", "g".repeat(64)),
        ] {
            assert!(Credential::parse(bad)
                .unwrap_err()
                .contains("64 hex digits"));
        }
        assert!(hashed_for_config("short").is_err());
        assert!(matches_configured(&line, STRONG));
        assert!(matches_configured(STRONG, STRONG));
        assert!(!matches_configured(&line, &line));
        assert!(!matches_configured("sha256:zz", "sha256:zz"));
        assert_eq!(hashed_form_ok(&line), Some(true));
        assert_eq!(hashed_form_ok("sha256:12"), Some(false));
        assert_eq!(hashed_form_ok(STRONG), None);
        assert_eq!(format!("{hashed:?}"), "Credential(…)");
    }
}
