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
/// encoding). Longer input is a [`LockError::InvalidKey`]; `#[distributed_lock]` refuses at
/// compile time a key whose literal text alone is longer.
pub const MAX_KEY_INPUT_LEN: usize = dlock_limits::MAX_KEY_INPUT_LEN;

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
/// values (a value never contains `:`) so that, with the same literals and a `:` between every
/// two values, no two different value tuples give the same key (see the
/// [module docs](self)). Values without a `:` between them can: `value("1").value("23")` and
/// `value("12").value("3")` are both `123`. Used by the attribute (which refuses a template
/// whose placeholders are not separated by literal text with a `:`) and the tower key
/// extractors (which join their parts with `:`).
#[derive(Clone, Debug, Default)]
pub struct KeyBuilder {
    out: String,
    raw_len: usize,
    too_long: bool,
    /// A value's `Display` returned an error: what it wrote is a part of the value only.
    cut_short: bool,
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
    /// contain the `:` separator. A `Display` that fails makes [`finish`](Self::finish) an
    /// error: the part it wrote is not the value, and two values cut short alike would share
    /// a key.
    pub fn value<T: fmt::Display + ?Sized>(&mut self, value: &T) -> &mut Self {
        if self.too_long {
            return self;
        }
        let mut enc = Encoder {
            builder: self,
            value: true,
        };
        // Past the length limit the encoder fails too; `finish` reports that as such.
        if write!(enc, "{value}").is_err() && !self.too_long {
            self.cut_short = true;
        }
        self
    }

    /// Validates the key: non-empty, input within [`MAX_KEY_INPUT_LEN`], every value formatted
    /// whole; digests long keys.
    pub fn finish(&mut self) -> Result<LockKey, LockError> {
        if self.too_long {
            return Err(LockError::invalid_key(format!(
                "key input longer than {MAX_KEY_INPUT_LEN} bytes"
            )));
        }
        if self.cut_short {
            return Err(LockError::invalid_key(
                "a key value's Display implementation returned an error",
            ));
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

/// What one acquisition holds: the lock kinds a [`Locker`](crate::Locker) offers.
///
/// A plain lock is [`Exclusive`](LockKind::Exclusive). A semaphore lets up to `permits`
/// holders in at once; a read-write lock lets in many [`Read`](LockKind::Read) holders or one
/// [`Write`](LockKind::Write) holder. Semaphores and read-write locks live under names of their
/// own ([`ResourceName::as_str`]), so a lock, a semaphore and a read-write lock on the same key
/// are three independent things.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockKind {
    /// One holder at a time (the plain lock).
    #[default]
    Exclusive,
    /// One of at most `permits` holders at a time.
    Semaphore {
        /// How many holders the semaphore admits at once (≥ 1). Every caller of one semaphore
        /// should name the same count: a grant counts the holders against the caller's.
        permits: u32,
    },
    /// A reader of a read-write lock: any number of readers, no writer.
    Read,
    /// The writer of a read-write lock: no other holder.
    Write,
}

impl LockKind {
    /// The suffix of the kind's name: `""` (a lock), `"sem"` (a semaphore), `"rw"` (both
    /// modes of a read-write lock, which share one name).
    pub fn suffix(self) -> &'static str {
        match self {
            LockKind::Exclusive => "",
            LockKind::Semaphore { .. } => "sem",
            LockKind::Read | LockKind::Write => "rw",
        }
    }

    /// Whether a holder of this kind excludes every other holder of the name (a lock, a writer).
    pub fn is_exclusive(self) -> bool {
        matches!(self, LockKind::Exclusive | LockKind::Write)
    }

    /// How many holders the name admits at once: 1 for a lock, `permits` for a semaphore,
    /// unbounded (`u32::MAX`) for a read-write lock (whose writer is alone by
    /// [`is_exclusive`](LockKind::is_exclusive)).
    pub fn capacity(self) -> u32 {
        match self {
            LockKind::Exclusive => 1,
            LockKind::Semaphore { permits } => permits,
            LockKind::Read | LockKind::Write => u32::MAX,
        }
    }
}

/// How keys appear in dlock's `tracing` spans and events: redacted by default (a short keyed
/// hash), plain when the locker was built with
/// [`LockerBuilder::trace_plain_keys`](crate::LockerBuilder::trace_plain_keys).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct KeyLog {
    pub(crate) plain: bool,
}

impl KeyLog {
    /// `key` as this setting shows it; formatted (and hashed) only when a subscriber records it.
    pub(crate) fn show(self, key: &str) -> ShownKey<'_> {
        ShownKey {
            key,
            plain: self.plain,
        }
    }

    /// `err`'s message with its key ([`LockError::key`]) shown as this setting shows it.
    pub(crate) fn error(self, err: &LockError) -> ShownError<'_> {
        ShownError {
            err,
            key: self.show(err.key().unwrap_or("")),
        }
    }
}

/// A key as [`KeyLog`] shows it.
pub(crate) struct ShownKey<'a> {
    key: &'a str,
    plain: bool,
}

impl fmt::Display for ShownKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.plain {
            return f.write_str(self.key);
        }
        f.write_str(&redact(self.key))
    }
}

/// An error message with its key as [`KeyLog`] shows it.
pub(crate) struct ShownError<'a> {
    err: &'a LockError,
    key: ShownKey<'a>,
}

impl fmt::Display for ShownError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let message = self.err.to_string();
        if self.key.plain || self.key.key.is_empty() {
            return f.write_str(&message);
        }
        f.write_str(&message.replace(self.key.key, &self.key.to_string()))
    }
}

/// `#` and 12 hex digits of SHA-256 over a per-process random secret and `key`: the same key
/// gives the same hash within one process (events of one lock can be followed), and a hash
/// cannot be matched against guessed keys without the secret.
pub(crate) fn redact(key: &str) -> String {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let secret = SECRET.get_or_init(crate::util::secure_token::<16>);
    let mut h = Sha256::new();
    h.update(secret.as_bytes());
    h.update(key.as_bytes());
    let digest = h.finalize();
    let mut out = String::with_capacity(13);
    out.push('#');
    crate::util::hex_into(&mut out, &digest[..6]);
    out
}

/// The backend-facing name of one lock: `<prefix>:{<encoded key>}`. Every key of the lock
/// (fencing counter, waiter queue, channel) is this name plus a suffix, so all share the hash
/// tag. A semaphore's name is `<prefix>:{<key>}:sem`, a read-write lock's `<prefix>:{<key>}:rw`
/// ([`LockKind`]), with the same hash tag as the key's lock.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResourceName {
    full: Arc<str>,
    key: LockKey,
    kind: LockKind,
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
            kind: LockKind::Exclusive,
        }
    }

    /// The name of `kind` on the same key and prefix (see [`LockKind`]).
    pub(crate) fn with_kind(self, kind: LockKind) -> Self {
        if kind == self.kind {
            return self;
        }
        let suffix = kind.suffix();
        let base = match self.kind.suffix() {
            "" => &self.full[..],
            old => &self.full[..self.full.len() - old.len() - 1],
        };
        let full = if suffix.is_empty() {
            base.into()
        } else {
            format!("{base}:{suffix}").into()
        };
        ResourceName {
            full,
            key: self.key,
            kind,
        }
    }

    /// `<prefix>:{<key>}` — the name of the lock itself (`<prefix>:{<key>}:sem` for a
    /// semaphore, `<prefix>:{<key>}:rw` for a read-write lock).
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// [`as_str`](Self::as_str), shared (no copy): for backends that key their own maps
    /// by it.
    #[cfg_attr(not(any(feature = "etcd", feature = "zookeeper")), allow(dead_code))]
    pub(crate) fn shared(&self) -> Arc<str> {
        self.full.clone()
    }

    /// What an acquisition of this name holds: [`LockKind::Exclusive`] for a plain lock.
    pub fn kind(&self) -> LockKind {
        self.kind
    }

    /// The logical key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The start of a key of the lock's namespace rather than of the lock (the Redis fencing
    /// counter's, `<prefix>:fence`): the full name up to the `{` that opens the encoded key
    /// (the prefix has no braces). A key made from it has no hash tag, so it never names a
    /// lock's key.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn namespace_prefix(&self) -> &str {
        &self.full[..self.full.find('{').unwrap_or(0)]
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

    /// A `Display` that writes part of its value, then fails.
    struct Cut(&'static str);

    impl fmt::Display for Cut {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)?;
            Err(fmt::Error)
        }
    }

    /// A value whose `Display` fails is an invalid key, not the part it wrote: two values
    /// whose formatting fails after the same prefix shared a key (and so a lock).
    #[test]
    fn a_value_whose_display_fails_is_an_invalid_key() {
        let err = KeyBuilder::new()
            .lit("user:")
            .value(&Cut("4"))
            .finish()
            .unwrap_err();
        assert!(matches!(err, LockError::InvalidKey { .. }), "{err:?}");
        assert!(err.to_string().contains("Display"), "{err}");
        // A value past the length limit is still reported as too long.
        let long = "x".repeat(MAX_KEY_INPUT_LEN + 1);
        let err = KeyBuilder::new().value(&long).finish().unwrap_err();
        assert!(err.to_string().contains("longer than"), "{err}");
    }

    #[test]
    fn keys_are_redacted_to_a_stable_keyed_hash_unless_plain() {
        let shown = KeyLog::default().show("user:42").to_string();
        assert!(shown.starts_with('#') && shown.len() == 13, "{shown}");
        // (Not `contains("42")`: the hash is hex, and holds "42" about once in 23 processes.)
        assert!(
            shown[1..].bytes().all(|b| b.is_ascii_hexdigit()),
            "the key is not shown: {shown}"
        );
        assert_eq!(shown, KeyLog::default().show("user:42").to_string());
        assert_ne!(shown, KeyLog::default().show("user:43").to_string());
        assert_eq!(
            KeyLog { plain: true }.show("user:42").to_string(),
            "user:42"
        );
        let err = LockError::lost("user:42");
        let redacted = KeyLog::default().error(&err).to_string();
        assert_eq!(redacted, format!("lock `{shown}` was lost"));
    }

    #[test]
    fn namespace_keys_have_no_hash_tag_and_follow_the_prefix() {
        let key = || LockKey::new("order:{42}").unwrap();
        assert_eq!(
            ResourceName::new("dlock", key()).namespace_prefix(),
            "dlock:"
        );
        assert_eq!(ResourceName::new("", key()).namespace_prefix(), "");
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
    fn kinds_have_names_of_their_own_with_the_same_hash_tag() {
        let r = ResourceName::new("app", LockKey::new("pool").unwrap());
        let sem = r.clone().with_kind(LockKind::Semaphore { permits: 3 });
        assert_eq!(sem.as_str(), "app:{pool}:sem");
        assert_eq!(sem.kind(), LockKind::Semaphore { permits: 3 });
        let read = sem.with_kind(LockKind::Read);
        assert_eq!(read.as_str(), "app:{pool}:rw");
        assert_eq!(
            read.clone().with_kind(LockKind::Write).as_str(),
            "app:{pool}:rw"
        );
        assert_eq!(read.with_kind(LockKind::Exclusive), r);
    }

    #[test]
    fn prefixes_with_braces_are_refused() {
        assert!(validate_prefix("a{b").is_err());
        assert!(validate_prefix("my-app:locks").is_ok());
    }
}
