//! The request side: the `Idempotency-Key` header, the key's scope, the fingerprint.

use http::header::HeaderName;
use http::{HeaderMap, Method, StatusCode, Uri};
use sha2::{Digest, Sha256};

use dlock_runtime::idempotency::Fingerprint;

use crate::key::Key;
use crate::Rejection;

/// Reads the idempotency key from `name`: `Ok(None)` when the header is absent or empty.
///
/// The draft defines the field as a Structured Field string (`Idempotency-Key: "8e03…"`); many
/// clients send the bare value (`Idempotency-Key: 8e03…`). Both are accepted and mean the same
/// key: a quoted value is unescaped (`\"`, `\\`) and its parameters (`;…`) ignored; a bare
/// value is taken as is. Either must be printable ASCII. Refused with 400: the header given
/// more than once (also as one line holding a list, `a, b`), a malformed quoted string or
/// parameters, non-ASCII or control characters, an empty quoted string, and a key longer than
/// `max_len` bytes.
pub(crate) fn parse_key(
    headers: &HeaderMap,
    name: &HeaderName,
    max_len: usize,
) -> Result<Option<String>, Rejection> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(invalid(&format!("`{name}` is given more than once")));
    }
    let raw = value.as_bytes().trim_ascii();
    if raw.is_empty() {
        return Ok(None);
    }
    // Refuse absurd input before copying it.
    if raw.len() > max_len.saturating_mul(2).saturating_add(64) {
        return Err(too_long(name, max_len));
    }
    if raw.iter().any(|&b| !(0x20..=0x7e).contains(&b)) {
        return Err(invalid(&format!(
            "`{name}` must be printable ASCII (a Structured Field string)"
        )));
    }
    let key = match raw.strip_prefix(b"\"") {
        Some(rest) => unquote(rest).ok_or_else(|| {
            invalid(&format!(
                "`{name}` is not a valid Structured Field string (RFC 9651)"
            ))
        })?,
        // A list: two field lines joined by a proxy (`a, b`), the same as the header given
        // twice — not one key with a comma in it.
        None if raw.contains(&b',') => {
            return Err(invalid(&format!("`{name}` is given more than once")))
        }
        // Printable ASCII, checked above.
        None => String::from_utf8_lossy(raw).into_owned(),
    };
    if key.is_empty() {
        return Err(invalid(&format!("`{name}` is empty")));
    }
    if key.len() > max_len {
        return Err(too_long(name, max_len));
    }
    Ok(Some(key))
}

/// The content of an sf-string after its opening quote; anything after the closing quote must
/// be parameters (`;key` or `;key=value`, RFC 9651), which are ignored — not a second member
/// (`"a", "b"`: two field lines joined) or other text.
fn unquote(rest: &[u8]) -> Option<String> {
    let (out, after) = string_body(rest)?;
    parameters(after).then_some(out)
}

/// An sf-string's content up to its closing quote (the opening one already taken), unescaped,
/// and what follows it.
fn string_body(rest: &[u8]) -> Option<(String, &[u8])> {
    let mut out = String::with_capacity(rest.len());
    let mut bytes = rest.iter();
    loop {
        match *bytes.next()? {
            b'\\' => match *bytes.next()? {
                c @ (b'"' | b'\\') => out.push(char::from(c)),
                _ => return None,
            },
            b'"' => return Some((out, bytes.as_slice())),
            c => out.push(char::from(c)),
        }
    }
}

/// Whether `s` is an sf-item's parameters and nothing else (RFC 9651 §4.2.3.2; the field's
/// printable ASCII is checked before, its trailing spaces trimmed).
fn parameters(mut s: &[u8]) -> bool {
    let key_char = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit() || b"_-.*".contains(&c);
    while let [b';', rest @ ..] = s {
        s = rest.trim_ascii_start();
        let [first, ..] = s else { return false };
        if !(first.is_ascii_lowercase() || *first == b'*') {
            return false;
        }
        let key_len = s.iter().take_while(|&&c| key_char(c)).count();
        s = &s[key_len..];
        if let [b'=', value @ ..] = s {
            match bare_item(value) {
                Some(rest) => s = rest,
                None => return false,
            }
        }
    }
    s.is_empty()
}

/// What follows an sf-bare-item at the start of `s` (RFC 9651 §4.2.3.1), or `None` when none
/// is there.
fn bare_item(s: &[u8]) -> Option<&[u8]> {
    let run = |s: &[u8], ok: fn(u8) -> bool| s.iter().take_while(|&&c| ok(c)).count();
    let tchar = |c: u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&c);
    match s {
        [b'"', rest @ ..] => string_body(rest).map(|(_, after)| after),
        [b'?', b'0' | b'1', rest @ ..] => Some(rest),
        [b':', rest @ ..] => {
            let n = run(rest, |c| c.is_ascii_alphanumeric() || b"+/=".contains(&c));
            rest[n..].strip_prefix(b":")
        }
        [b'@', rest @ ..] => number(rest),
        [b'%', b'"', rest @ ..] => {
            let n = run(rest, |c| c != b'"');
            rest[n..].strip_prefix(b"\"")
        }
        [c, ..] if c.is_ascii_alphabetic() || *c == b'*' => Some(&s[run(s, tchar)..]),
        _ => number(s),
    }
}

/// What follows an sf-integer or sf-decimal at the start of `s`.
fn number(s: &[u8]) -> Option<&[u8]> {
    let s = s.strip_prefix(b"-").unwrap_or(s);
    let int = s.iter().take_while(|c| c.is_ascii_digit()).count();
    if int == 0 || int > 15 {
        return None;
    }
    let s = &s[int..];
    match s.strip_prefix(b".") {
        None => Some(s),
        Some(frac) => {
            let n = frac.iter().take_while(|c| c.is_ascii_digit()).count();
            (int <= 12 && (1..=3).contains(&n)).then(|| &frac[n..])
        }
    }
}

fn invalid(reason: &str) -> Rejection {
    Rejection::new(
        StatusCode::BAD_REQUEST,
        "idempotency-key-invalid",
        &format!("invalid idempotency key: {reason}"),
    )
}

fn too_long(name: &HeaderName, max_len: usize) -> Rejection {
    invalid(&format!("`{name}` is longer than {max_len} bytes"))
}

/// The lock key of an idempotency key: `idem:<key>`, or `idem:<identity>:<key>` when the
/// request carries an identity. Both are values for the runtime's key encoding, so neither can
/// contain the separator: no identity/key pair collides with another, nor with an unscoped key.
pub(crate) fn scoped_key(identity: Option<&str>, key: &str) -> Key {
    let k = Key::new("idem");
    match identity {
        Some(id) => k.value(id).value(key),
        None => k.value(key),
    }
}

/// SHA-256 over the method, the path and query, and the SHA-256 of the body (each field framed
/// by its length, see [`Fingerprint`]).
pub(crate) fn fingerprint(method: &Method, uri: &Uri, body: &[u8]) -> Fingerprint {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    Fingerprint::builder()
        .field(method.as_str())
        .field(path)
        .field(Sha256::digest(body))
        .finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAME: HeaderName = HeaderName::from_static("idempotency-key");

    fn parse(values: &[&[u8]]) -> Result<Option<String>, Rejection> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(NAME, http::HeaderValue::from_bytes(v).unwrap());
        }
        parse_key(&h, &NAME, 16)
    }

    #[test]
    fn bare_and_quoted_keys_are_the_same_key() {
        assert_eq!(parse(&[b"abc-1"]).unwrap().as_deref(), Some("abc-1"));
        assert_eq!(parse(&[b"\"abc-1\""]).unwrap().as_deref(), Some("abc-1"));
        assert_eq!(parse(&[b" \"abc-1\" "]).unwrap().as_deref(), Some("abc-1"));
        assert_eq!(
            parse(&[b"\"a\\\"b\\\\c\""]).unwrap().as_deref(),
            Some("a\"b\\c")
        );
        assert_eq!(parse(&[b"\"abc\";v=1"]).unwrap().as_deref(), Some("abc"));
        // Parameters of every kind of value are ignored.
        for params in [
            &b";a"[..],
            b";a=1;b",
            b"; a=-1.5",
            b";a=\"x;y,z\"",
            b";a=tok/en:1",
            b";a=:aGk=:",
            b";a=?0",
            b";a=@1700000000",
            b";a=%\"caf%c3%a9\"",
            b";*b.c_d-e=*",
        ] {
            let field = [&b"\"abc\""[..], params].concat();
            assert_eq!(
                parse(&[&field]).unwrap().as_deref(),
                Some("abc"),
                "{params:?}"
            );
        }
    }

    #[test]
    fn missing_and_empty_headers_have_no_key() {
        assert_eq!(parse(&[]).unwrap(), None);
        assert_eq!(parse(&[b""]).unwrap(), None);
        assert_eq!(parse(&[b"   "]).unwrap(), None);
    }

    #[test]
    fn malformed_keys_are_400() {
        for bad in [
            &b"\"abc"[..],
            b"\"a\\bc\"",
            b"\"abc\" junk",
            b"\"\"",
            b"caf\xc3\xa9",
            b"a\tb",
            // Two field lines joined into one (a proxy may), or text after the key that is not
            // parameters: not one key. (`"abc";x, "def"` was taken as the key `abc`, the
            // second value dropped.)
            b"\"abc\", \"def\"",
            b"\"abc\";x, \"def\"",
            b"abc, def",
            b"\"abc\" ;x",
            b"\"abc\";X",
            b"\"abc\";1a",
            b"\"abc\";a=",
            b"\"abc\";a=\"open",
            b"\"abc\";a=?2",
            b"\"abc\";a=1.2345",
            b"\"abc\";a=1234567890123456",
            b"\"abc\";a=:x",
            b"\"abc\";a=1 b",
        ] {
            let err = parse(&[bad]).unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{bad:?}");
            assert!(err.body().contains("idempotency-key-invalid"), "{bad:?}");
        }
        let err = parse(&[b"a", b"b"]).unwrap_err();
        assert!(err.body().contains("more than once"));
        assert!(parse(&[b"a, b"])
            .unwrap_err()
            .body()
            .contains("more than once"));
    }

    #[test]
    fn length_limit_applies_to_the_key() {
        assert!(parse(&[&[b'k'; 16]]).unwrap().is_some());
        assert!(parse(&[&[b'k'; 17]]).unwrap_err().body().contains("longer"));
        // The quotes do not count.
        let quoted = format!("\"{}\"", "k".repeat(16));
        assert!(parse(&[quoted.as_bytes()]).unwrap().is_some());
        // Huge values are refused before being copied.
        assert!(parse(&[&vec![b'k'; 1 << 20]]).is_err());
    }

    #[test]
    fn scoped_keys_cannot_collide() {
        let lk = |id: Option<&str>, k: &str| scoped_key(id, k).to_lock_key().unwrap();
        assert_eq!(lk(None, "k1").as_str(), "idem:k1");
        assert_eq!(lk(Some("u7"), "k1").as_str(), "idem:u7:k1");
        assert_ne!(lk(Some("a"), "b"), lk(None, "a:b"));
        assert_ne!(lk(Some("a:b"), "c"), lk(Some("a"), "b:c"));
    }

    #[test]
    fn fingerprint_covers_method_path_query_and_body() {
        let uri = |s: &str| s.parse::<Uri>().unwrap();
        let base = fingerprint(&Method::POST, &uri("/pay?x=1"), b"{}");
        assert_eq!(base, fingerprint(&Method::POST, &uri("/pay?x=1"), b"{}"));
        assert_ne!(base, fingerprint(&Method::PATCH, &uri("/pay?x=1"), b"{}"));
        assert_ne!(base, fingerprint(&Method::POST, &uri("/pay?x=2"), b"{}"));
        assert_ne!(base, fingerprint(&Method::POST, &uri("/pay"), b"{}"));
        assert_ne!(base, fingerprint(&Method::POST, &uri("/pay?x=1"), b"{ }"));
        // An absolute-form URI has the same path and query.
        assert_eq!(
            base,
            fingerprint(&Method::POST, &uri("http://h:1/pay?x=1"), b"{}")
        );
    }
}
