//! Lock keys: validation, collision-free encoding, length bounds.
//!
//! A [`LockKey`] is the *logical* key of a lock (`"order:42"`), already encoded. The
//! [`Locker`](crate::Locker) places it inside one Redis Cluster hash tag behind its namespace
//! prefix (`dlock:{order:42}`), so the lock, its fencing counter, its waiter queue and its
//! notification channel all live in one slot.
//!
//! # Encoding
//!
//! * Literal text (a key given to [`Locker::lock`](crate::Locker::lock), or the fixed parts of a
//!   template) is kept as written, except that `%`, `{`, `}`, `#`, whitespace and control
//!   characters are percent-encoded (`%25`, `%7B`, …). `{`/`}` would break the hash tag; `%` and
//!   `#` are reserved for the encoding itself.
//! * Interpolated values ([`KeyBuilder::value`]) are encoded the same way **and** `:` becomes
//!   `%3A`. A value can therefore never contain the separator, so `user:<a>:<b>` with
//!   `a = "1:2", b = "3"` (`user:1%3A2:3`) and `a = "1", b = "2:3"` (`user:1:2%3A3`) are different
//!   locks. The attribute refuses templates whose placeholders are not separated by a `:`.
//! * Input longer than [`MAX_KEY_INPUT_LEN`] bytes is refused with
//!   [`LockError::InvalidKey`] before it is copied (a 10 MB header does not become a 10 MB
//!   Redis key). An encoded key longer than [`DIGEST_THRESHOLD`] bytes is replaced by its first
//!   96 bytes, `#`, and the hex SHA-256 of the whole encoded key — `#` never appears unescaped
//!   in an encoded key, so a digested key cannot collide with a plain one.
//! * The empty key is refused.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::LockError;

/// Largest accepted raw key input, in bytes (literal text plus formatted values, before
/// encoding). Longer input is a [`LockError::InvalidKey`].
pub const MAX_KEY_INPUT_LEN: usize = 4096;

/// Encoded keys longer than this many bytes are shortened to a prefix plus a SHA-256 digest.
pub const DIGEST_THRESHOLD: usize = 200;

const DIGEST_PREFIX_LEN: usize = 96;

/// A validated, encoded logical lock key.
///
/// ```
/// use dlock_runtime::LockKey;
///
/// let key = LockKey::new("report:2026-11").unwrap();
/// assert_eq!(key.as_str(), "report:2026-11");
///
/// let key = LockKey::builder().lit("user:").value("1:2").lit(":").value(&3).finish().unwrap();
/// assert_eq!(key.as_str(), "user:1%3A2:3");
///
/// assert!(LockKey::new("").unwrap_err().is_invalid());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LockKey {
    encoded: Arc<str>,
}

impl LockKey {
    /// Validates and encodes a literal key (no interpolation: `:` is kept as a separator).
    pub fn new(key: &str) -> Result<Self, LockError> {
        let mut b = KeyBuilder::new();
        b.lit(key);
        b.finish()
    }

    /// Starts a key made of literal parts and interpolated values.
    pub fn builder() -> KeyBuilder {
        KeyBuilder::new()
    }

    /// A key that is already encoded — read back from storage, such as a queued job's key
    /// ([`LockKey::as_str`] of an earlier key) — taken as is, without encoding it again. Not
    /// for request data: build those keys with [`LockKey::builder`].
    pub fn from_encoded(encoded: &str) -> Result<Self, LockError> {
        if encoded.is_empty() {
            return Err(LockError::invalid_key("key is empty"));
        }
        if encoded.len() > MAX_KEY_INPUT_LEN * 3 {
            return Err(LockError::invalid_key("stored key is too long"));
        }
        Ok(LockKey {
            encoded: encoded.into(),
        })
    }

    /// The encoded key.
    pub fn as_str(&self) -> &str {
        &self.encoded
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encoded)
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LockKey").field(&&*self.encoded).finish()
    }
}

/// Builds a [`LockKey`] from literal parts and [`Display`](fmt::Display) values, encoding the
/// values so that no two different value tuples give the same key (see the
/// [module docs](self)). Used by the attribute and the tower key extractors.
#[derive(Clone, Debug, Default)]
pub struct KeyBuilder {
    out: String,
    raw_len: usize,
    too_long: bool,
}

impl KeyBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends literal text.
    pub fn lit(&mut self, text: &str) -> &mut Self {
        self.push(text, false);
        self
    }

    /// Appends one interpolated value, formatted with `Display` and encoded so that it cannot
    /// contain the `:` separator.
    pub fn value<T: fmt::Display + ?Sized>(&mut self, value: &T) -> &mut Self {
        if self.too_long {
            return self;
        }
        let mut enc = Encoder {
            builder: self,
            value: true,
        };
        // An error here only means the input passed the length limit; `finish` reports it.
        let _ = write!(enc, "{value}");
        self
    }

    /// Validates the key: non-empty, input within [`MAX_KEY_INPUT_LEN`]; digests long keys.
    pub fn finish(&mut self) -> Result<LockKey, LockError> {
        if self.too_long {
            return Err(LockError::invalid_key(format!(
                "key input longer than {MAX_KEY_INPUT_LEN} bytes"
            )));
        }
        if self.out.is_empty() {
            return Err(LockError::invalid_key("key is empty"));
        }
        let out = std::mem::take(&mut self.out);
        self.raw_len = 0;
        let encoded = if out.len() > DIGEST_THRESHOLD {
            let mut cut = DIGEST_PREFIX_LEN;
            while !out.is_char_boundary(cut) {
                cut -= 1;
            }
            let digest = Sha256::digest(out.as_bytes());
            let mut short = String::with_capacity(cut + 1 + 64);
            short.push_str(&out[..cut]);
            short.push('#');
            crate::util::hex_into(&mut short, &digest);
            short
        } else {
            out
        };
        Ok(LockKey {
            encoded: encoded.into(),
        })
    }

    fn push(&mut self, s: &str, value: bool) -> bool {
        if self.too_long {
            return false;
        }
        self.raw_len += s.len();
        if self.raw_len > MAX_KEY_INPUT_LEN {
            self.too_long = true;
            self.out = String::new();
            return false;
        }
        for c in s.chars() {
            if needs_escape(c, value) {
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    let _ = write!(self.out, "%{b:02X}");
                }
            } else {
                self.out.push(c);
            }
        }
        true
    }
}

fn needs_escape(c: char, value: bool) -> bool {
    matches!(c, '%' | '{' | '}' | '#') || (value && c == ':') || c.is_whitespace() || c.is_control()
}

struct Encoder<'a> {
    builder: &'a mut KeyBuilder,
    value: bool,
}

impl fmt::Write for Encoder<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if self.builder.push(s, self.value) {
            Ok(())
        } else {
            Err(fmt::Error)
        }
    }
}

/// Checks a namespace prefix: no hash-tag braces, whitespace or control characters.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), LockError> {
    if prefix.len() > 128 {
        return Err(LockError::invalid_key("prefix longer than 128 bytes"));
    }
    if prefix
        .chars()
        .any(|c| matches!(c, '{' | '}') || c.is_whitespace() || c.is_control())
    {
        return Err(LockError::invalid_key(
            "prefix must not contain `{`, `}`, whitespace or control characters",
        ));
    }
    Ok(())
}

/// The backend-facing name of one lock: `<prefix>:{<encoded key>}`. Every key of the lock
/// (fencing counter, waiter queue, channel) is this name plus a suffix, so all share the hash
/// tag.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResourceName {
    full: Arc<str>,
    key: LockKey,
}

impl ResourceName {
    pub(crate) fn new(prefix: &str, key: LockKey) -> Self {
        let mut full = String::with_capacity(prefix.len() + key.as_str().len() + 3);
        if !prefix.is_empty() {
            full.push_str(prefix);
            full.push(':');
        }
        full.push('{');
        full.push_str(key.as_str());
        full.push('}');
        ResourceName {
            full: full.into(),
            key,
        }
    }

    /// `<prefix>:{<key>}` — the name of the lock itself.
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// The logical key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// A key of the lock's namespace rather than of the lock: `<prefix>:<suffix>` (`<suffix>`
    /// without a prefix). It has no hash tag, so it never names a lock's key.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn namespace_key(&self, suffix: &str) -> String {
        // The prefix has no braces: the first `{` opens the encoded key.
        let brace = self.full.find('{').unwrap_or(0);
        let mut s = String::with_capacity(brace + suffix.len());
        s.push_str(&self.full[..brace]);
        s.push_str(suffix);
        s
    }

    /// The name of a companion key of this lock (`<prefix>:{<key>}:<suffix>`).
    pub fn with_suffix(&self, suffix: &str) -> String {
        let mut s = String::with_capacity(self.full.len() + 1 + suffix.len());
        s.push_str(&self.full);
        s.push(':');
        s.push_str(suffix);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_keys_have_no_hash_tag_and_follow_the_prefix() {
        let key = || LockKey::new("order:{42}").unwrap();
        assert_eq!(
            ResourceName::new("dlock", key()).namespace_key("fence"),
            "dlock:fence"
        );
        assert_eq!(ResourceName::new("", key()).namespace_key("fence"), "fence");
    }

    fn two(a: &str, b: &str) -> String {
        LockKey::builder()
            .lit("user:")
            .value(a)
            .lit(":")
            .value(b)
            .finish()
            .unwrap()
            .as_str()
            .to_owned()
    }

    #[test]
    fn interpolated_values_cannot_collide_through_the_separator() {
        assert_ne!(two("1:2", "3"), two("1", "2:3"));
        assert_eq!(two("1:2", "3"), "user:1%3A2:3");
        assert_eq!(two("1", "2:3"), "user:1:2%3A3");
    }

    #[test]
    fn escape_characters_cannot_be_forged() {
        // A value containing what looks like an escape is itself escaped.
        assert_ne!(two("%3A", "x"), two(":", "x"));
        assert_eq!(two("%3A", "x"), "user:%253A:x");
    }

    #[test]
    fn hash_tag_braces_and_whitespace_are_escaped_in_literals_and_values() {
        assert_eq!(LockKey::new("a{b}c d").unwrap().as_str(), "a%7Bb%7Dc%20d");
        assert_eq!(two("{x}", "\n"), "user:%7Bx%7D:%0A");
    }

    #[test]
    fn literal_keys_keep_their_separators_and_match_templates() {
        let literal = LockKey::new("user:1:2").unwrap();
        let templated = LockKey::builder()
            .lit("user:")
            .value(&1)
            .lit(":")
            .value(&2)
            .finish()
            .unwrap();
        assert_eq!(literal, templated);
    }

    #[test]
    fn empty_key_is_refused() {
        let err = LockKey::new("").unwrap_err();
        assert!(err.is_invalid(), "{err}");
        let err = LockKey::builder().value("").finish().unwrap_err();
        assert!(err.is_invalid(), "{err}");
    }

    #[test]
    fn oversized_input_is_refused_without_being_copied() {
        let huge = "x".repeat(10 * 1024 * 1024);
        let mut b = LockKey::builder();
        b.lit("h:").value(huge.as_str());
        assert!(b.out.len() <= MAX_KEY_INPUT_LEN);
        let err = b.finish().unwrap_err();
        assert!(err.is_invalid(), "{err}");
        assert!(LockKey::new(&"y".repeat(MAX_KEY_INPUT_LEN)).is_ok());
        assert!(LockKey::new(&"y".repeat(MAX_KEY_INPUT_LEN + 1)).is_err());
    }

    #[test]
    fn long_keys_are_digested_and_stay_distinct() {
        let a = LockKey::new(&format!("{}a", "k".repeat(300))).unwrap();
        let b = LockKey::new(&format!("{}b", "k".repeat(300))).unwrap();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), DIGEST_PREFIX_LEN + 1 + 64);
        assert!(a.as_str().contains('#'));
        // A literal '#' is escaped, so no plain key can look like a digested one.
        assert_eq!(LockKey::new("a#b").unwrap().as_str(), "a%23b");
    }

    #[test]
    fn digest_cut_respects_char_boundaries() {
        let k = LockKey::new(&"é".repeat(200)).unwrap();
        assert!(k.as_str().contains('#'));
    }

    #[test]
    fn resource_names_share_one_hash_tag() {
        let r = ResourceName::new("app", LockKey::new("order:1").unwrap());
        assert_eq!(r.as_str(), "app:{order:1}");
        assert_eq!(r.with_suffix("fence"), "app:{order:1}:fence");
        let r = ResourceName::new("", LockKey::new("x").unwrap());
        assert_eq!(r.as_str(), "{x}");
    }

    #[test]
    fn prefixes_with_braces_are_refused() {
        assert!(validate_prefix("a{b").is_err());
        assert!(validate_prefix("my-app:locks").is_ok());
    }
}
