//! Operating dlock: inspect locks, list a namespace's locks, free a stuck lock by hand, and
//! see this process's recent contention — what the `dlock` CLI and `dlock_tower::admin` (the
//! ops page) are built on.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
//! use dlock_runtime::Locker;
//!
//! let locker = Locker::memory();
//! let guard = locker.lock("report:2026-11").acquire().await?;
//! let admin = locker.admin()?;
//! let state = admin.inspect("report:2026-11").await?;
//! let holder = state.holder.expect("held");
//! assert_eq!(holder.fencing_token, Some(guard.fencing_token()));
//! assert_eq!(holder.token_prefix.len(), 8); // never the whole owner token
//!
//! // Only while the holder inspected still holds it: another owner's prefix releases nothing.
//! let spared = admin.force_release_held_by("report:2026-11", "0123abcd").await?;
//! assert!(!spared.was_held);
//! assert_eq!(spared.other_holder.as_ref(), Some(&holder.token_prefix));
//!
//! // Frees it while that holder holds it, and raises the fencing counter past its token.
//! let freed = admin.force_release_held_by("report:2026-11", &holder.token_prefix).await?;
//! assert!(freed.was_held && freed.fence.unwrap() > guard.fencing_token());
//! # Ok(()) }
//! ```
//!
//! The capability is the backend's ([`AdminStore`], [`Backend::admin`](crate::backend::Backend::admin)):
//! memory, Redis (one server, Sentinel, a cluster), Postgres, etcd and ZooKeeper have it; Redlock does
//! not (its state is spread over independent servers) and answers
//! [`LockError::Unsupported`].
//!
//! **Force-release skips the owner check** — the only operation in dlock that does — and is
//! meant for incidents. Name the holder you inspected
//! ([`Admin::force_release_held_by`]) so that a lock that changed hands meanwhile stays with
//! its new holder. Expose it (and everything here) only behind your own authentication.
//!
//! # Keys as shown
//!
//! [`LockState::key`] is the *encoded* key ([`LockKey::as_str`]): `%`, `{`, `}`, `#`,
//! whitespace and control characters of literal text, and `:` of interpolated values, appear as
//! `%XX`, and a long key as a prefix, `#` and a digest. An operator copies that text back into
//! a tool, so the tools read what they are given with [`key_as_shown`] (a key) and
//! [`Admin::list`] (a key prefix): text that is an encoded key (or the start of one) is taken
//! as is, any other text is a literal key, encoded as [`LockKey::new`] does.

use std::time::Duration;

pub use crate::backend::admin::{
    ForceReleased, Holder, LockPage, LockState, Waiter, TOKEN_PREFIX_LEN,
};
use crate::backend::AdminStore;
use crate::key::DIGEST_THRESHOLD;
pub use crate::locker::ContentionEvent;
use crate::locker::IntoLockKey;
use crate::{LockError, LockKey, Locker};

/// The operator's view of a [`Locker`]'s store, from [`Locker::admin`]. Every call is bounded
/// by the locker's command timeout.
#[derive(Clone, Debug)]
pub struct Admin {
    locker: Locker,
}

impl Locker {
    /// The operator's view of this locker's store, or [`LockError::Unsupported`] when the
    /// backend cannot be inspected (Redlock).
    pub fn admin(&self) -> Result<Admin, LockError> {
        match self.backend().admin() {
            Some(_) => Ok(Admin {
                locker: self.clone(),
            }),
            None => Err(LockError::unsupported(self.backend_name(), "inspection")),
        }
    }
}

impl Admin {
    pub(crate) fn store(&self) -> &dyn AdminStore {
        self.locker
            .backend()
            .admin()
            .expect("checked by Locker::admin")
    }

    /// The locker this view belongs to.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    /// The lock on `key` (a literal key or a [`LockKey`]): holder (token prefix, fencing token,
    /// lease left), waiters in order, the fencing counter.
    pub async fn inspect(&self, key: impl IntoLockKey) -> Result<LockState, LockError> {
        let resource = self.locker.resource(key.into_lock_key()?);
        self.locker
            .with_deadline("inspect", self.store().inspect(&resource))
            .await
    }

    /// One page (about `limit` locks) of the active locks whose key starts with `key_prefix`
    /// (`""` for all), from `cursor` (`None` to start; then the page's [`LockPage::cursor`]
    /// until it is `None`). The prefix is read like [`key_as_shown`] reads a key: the start of
    /// an encoded key as [`LockState::key`] shows it (`user:1%3A`) is taken as is, other text
    /// (`100%`, `a b`) is encoded like a literal key.
    pub async fn list(
        &self,
        key_prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, LockError> {
        let encoded = prefix_as_shown(key_prefix)?;
        let store = self.store();
        self.locker
            .with_deadline(
                "list",
                store.list(self.locker.prefix(), &encoded, cursor, limit.max(1)),
            )
            .await
    }

    /// Every active lock whose key starts with `key_prefix`, page after page (at most `max`).
    pub async fn list_all(
        &self,
        key_prefix: &str,
        max: usize,
    ) -> Result<Vec<LockState>, LockError> {
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let page = self
                .list(key_prefix, cursor.as_deref(), 100.min(max.max(1)))
                .await?;
            out.extend(page.locks);
            cursor = page.cursor;
            if cursor.is_none() || out.len() >= max {
                out.truncate(max);
                return Ok(out);
            }
        }
    }

    /// Frees the lock on `key` whoever holds it (**no owner check**), raises the fencing
    /// counter and passes the lock to the next waiter. The holder's guard reports
    /// [`LockError::Lost`] at its next renewal.
    pub async fn force_release(&self, key: impl IntoLockKey) -> Result<ForceReleased, LockError> {
        let resource = self.locker.resource(key.into_lock_key()?);
        let out = self
            .locker
            .with_deadline("force release", self.store().force_release(&resource))
            .await?;
        tracing::warn!(
            target: "dlock::admin",
            backend = self.locker.backend_name(),
            was_held = out.was_held,
            "lock force-released by an operator"
        );
        Ok(out)
    }

    /// [`force_release`](Self::force_release), only while the lock on `key` is held by the
    /// owner whose token starts with `holder` — the token prefix [`inspect`](Self::inspect)
    /// shows ([`TOKEN_PREFIX_LEN`] hex digits; more or fewer will do). The check and the
    /// release are one step in the store, so a lock that changed hands since it was inspected
    /// — its holder released it, or it expired and another took it — is left to its new
    /// holder: nothing is released, and
    /// [`ForceReleased::other_holder`] names the holder found (`None`, with `was_held` `false`,
    /// when the lock is free).
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] for a `holder` that is not 1 to 32 hex digits;
    /// [`LockError::Unsupported`] for a store without it (every backend of this crate with an
    /// admin has it).
    pub async fn force_release_held_by(
        &self,
        key: impl IntoLockKey,
        holder: &str,
    ) -> Result<ForceReleased, LockError> {
        let hex = holder.bytes().all(|b| b.is_ascii_hexdigit());
        if holder.is_empty() || holder.len() > 32 || !hex {
            return Err(LockError::misconfigured(
                format!("holder `{holder}`: an owner token's prefix is 1 to 32 hex digits"),
                None,
            ));
        }
        let holder = holder.to_ascii_lowercase();
        let resource = self.locker.resource(key.into_lock_key()?);
        let out = self
            .locker
            .with_deadline(
                "force release",
                self.store().force_release_held_by(&resource, &holder),
            )
            .await?;
        tracing::warn!(
            target: "dlock::admin",
            backend = self.locker.backend_name(),
            was_held = out.was_held,
            spared = out.other_holder.is_some(),
            "lock force-released by an operator, if held by the owner named"
        );
        Ok(out)
    }

    /// This process's contended acquire attempts of the last `window` (see
    /// [`Locker::recent_contention`]).
    pub fn recent_contention(&self, window: Duration) -> Vec<ContentionEvent> {
        self.locker.recent_contention(window)
    }
}

/// The key an operator means by `text`: the encoded key itself when `text` is one, as
/// [`LockState::key`], the ops page and the `dlock` CLI show keys (`user:1%3A2`, `a%23b`, a
/// digested `…#<sha-256 hex>`); otherwise the literal key `text` ([`LockKey::new`]: `a b`,
/// `100%`, `a#b`).
///
/// `text` is an encoded key when every `%` starts a `%XX` escape (two hex digits), every other
/// character is one the encoder keeps as it is, a `#` is only the digest marker (after the first
/// 96 bytes — up to 3 fewer when the cut backs off to a character boundary — which may end in a
/// cut `%XX`; followed by exactly 64 lowercase hex digits), and it is at most
/// [`DIGEST_THRESHOLD`] bytes long (a longer encoded key is digested). Plain text such as
/// `order:42` reads the same both ways.
///
/// ```
/// use dlock_runtime::admin::key_as_shown;
/// use dlock_runtime::LockKey;
///
/// let key = LockKey::builder().lit("user:").value("1:2").finish().unwrap();
/// assert_eq!(key.as_str(), "user:1%3A2");
/// assert_eq!(key_as_shown("user:1%3A2").unwrap(), key); // as shown
/// assert_eq!(key_as_shown("100%").unwrap().as_str(), "100%25"); // literal
/// assert_eq!(key_as_shown("100%25").unwrap().as_str(), "100%25"); // as shown
/// ```
pub fn key_as_shown(text: &str) -> Result<LockKey, LockError> {
    if is_shown(text, false) {
        LockKey::from_encoded(text)
    } else {
        LockKey::new(text)
    }
}

/// The encoded key prefix an operator means by `text` (see [`Admin::list`]): as is when it is
/// the start of an encoded key (as [`key_as_shown`] reads keys, and the digest marker may be
/// followed by fewer than 64 hex digits), otherwise encoded like a literal key.
fn prefix_as_shown(text: &str) -> Result<String, LockError> {
    if text.is_empty() || is_shown(text, true) {
        Ok(text.to_owned())
    } else {
        Ok(LockKey::new(text)?.as_str().to_owned())
    }
}

/// Where a digested key's `#` can be: after the first 96 bytes of the encoded key (the
/// [`key`](crate::key) module's documented cut), or up to 3 bytes earlier when the cut backs
/// off to a character boundary.
const DIGEST_MARKER_AT: std::ops::RangeInclusive<usize> = 93..=96;

/// Hex digits after a digested key's `#`: a SHA-256.
const DIGEST_HEX_LEN: usize = 64;

/// Whether `text` is an encoded key as [`LockKey::as_str`] shows it (the start of one when
/// `prefix`).
fn is_shown(text: &str, prefix: bool) -> bool {
    if text.len() > DIGEST_THRESHOLD {
        return false;
    }
    match text.split_once('#') {
        None => is_encoded_text(text, false),
        Some((head, digest)) => {
            let hex = digest
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            let complete = digest.len() == DIGEST_HEX_LEN;
            DIGEST_MARKER_AT.contains(&head.len())
                && hex
                && (complete || (prefix && digest.len() < DIGEST_HEX_LEN))
                // The digest's cut may split an escape: `…%2#<hex>`.
                && is_encoded_text(head, true)
        }
    }
}

/// Whether every `%` of `text` starts a `%XX` escape (or a cut one at its end, when `cut`) and
/// every other character is one the encoder keeps as written.
fn is_encoded_text(text: &str, cut: bool) -> bool {
    let bytes = text.as_bytes();
    let mut chars = text.char_indices();
    while let Some((at, c)) = chars.next() {
        if c != '%' {
            if !kept_by_encoder(c) {
                return false;
            }
            continue;
        }
        let escape = &bytes[at + 1..bytes.len().min(at + 3)];
        if !escape.iter().all(u8::is_ascii_hexdigit) {
            return false;
        }
        if escape.len() < 2 {
            return cut;
        }
        chars.nth(1);
    }
    true
}

/// Whether the encoder writes `c` of literal text as it is. Asked of the encoder itself, so
/// this can never disagree with it about what it escapes.
fn kept_by_encoder(c: char) -> bool {
    let mut buf = [0u8; 4];
    let s = c.encode_utf8(&mut buf);
    LockKey::new(s).is_ok_and(|k| k.as_str() == s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(text: &str) -> String {
        key_as_shown(text).unwrap().as_str().to_owned()
    }

    fn literal(text: &str) -> String {
        LockKey::new(text).unwrap().as_str().to_owned()
    }

    #[test]
    fn encoded_keys_are_taken_as_shown() {
        let key = LockKey::builder()
            .lit("user:")
            .value("1:2")
            .lit(":")
            .value(&3)
            .finish()
            .unwrap();
        assert_eq!(key_as_shown(key.as_str()).unwrap(), key);
        assert_eq!(shown("user:1%3A2:3"), "user:1%3A2:3");
        assert_eq!(shown(&literal("a#b c")), "a%23b%20c");
        assert_eq!(shown(&literal("x{y}")), "x%7By%7D");
        assert_eq!(shown("order:42"), "order:42");
        assert_eq!(shown("café:1"), "café:1");
    }

    #[test]
    fn other_text_is_a_literal_key_as_before() {
        for text in [
            "a b",
            "100%",
            "a#b",
            "issue#12",
            "50%off",
            "x{y}",
            "tab\there",
            "%4",
        ] {
            assert_eq!(shown(text), literal(text), "{text:?}");
        }
        assert!(key_as_shown("").unwrap_err().is_invalid());
        // Longer than any encoded key: a literal key, digested.
        let long = "k".repeat(DIGEST_THRESHOLD + 1);
        assert_eq!(shown(&long), literal(&long));
    }

    #[test]
    fn digested_keys_are_taken_as_shown() {
        let plain = literal(&"k".repeat(300));
        assert!(plain.contains('#'), "{plain}");
        assert_eq!(shown(&plain), plain);
        // The cut after 96 bytes splits an escape (`…%2#…`) or backs off a character.
        for filler in [94, 95] {
            let key = literal(&format!("{}%{}", "k".repeat(filler), "x".repeat(200)));
            assert!(key.contains("%#") || key.contains("%2#"), "{key}");
            assert_eq!(shown(&key), key);
        }
        let key = literal(&format!("k{}", "€".repeat(100)));
        assert_eq!(key.find('#'), Some(94), "{key}");
        assert_eq!(shown(&key), key);
        // A `#` anywhere else, or with a short or uppercase digest, is literal.
        let upper = plain.to_uppercase();
        assert_eq!(shown(&upper), literal(&upper));
        let short = &plain[..plain.len() - 1];
        assert_eq!(shown(short), literal(short));
    }

    #[test]
    fn prefixes_are_read_like_keys() {
        assert_eq!(prefix_as_shown("").unwrap(), "");
        assert_eq!(prefix_as_shown("user:1%3A").unwrap(), "user:1%3A");
        assert_eq!(prefix_as_shown("report:").unwrap(), "report:");
        assert_eq!(prefix_as_shown("100%").unwrap(), "100%25");
        assert_eq!(prefix_as_shown("a b").unwrap(), "a%20b");
        assert_eq!(prefix_as_shown("issue#1").unwrap(), "issue%231");
        // The start of a digested key, cut inside its digest.
        let plain = literal(&"k".repeat(300));
        let start = &plain[..plain.len() - 10];
        assert_eq!(prefix_as_shown(start).unwrap(), start);
        assert_eq!(prefix_as_shown(&plain).unwrap(), plain);
    }
}
