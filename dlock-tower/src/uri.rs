//! The URI a request was sent with, and the path as a key sees it.

use std::borrow::Cow;

use http::{Extensions, Uri};

/// The URI the client sent. Inside axum's `Router::nest`, the request's own URI has the nest's
/// prefix taken off before the nested router's layers run, so two nested routers' `/pay` would
/// look alike (one idempotency fingerprint, one lock, a deferred job replayed to the wrong
/// route); with the `axum` feature (or `admin`, which brings axum too) the layers read axum's
/// `OriginalUri` instead, which the outermost router sets. Without either (or outside axum)
/// it is the request's URI.
pub(crate) fn original<'a>(uri: &'a Uri, extensions: &'a Extensions) -> &'a Uri {
    #[cfg(any(feature = "axum", feature = "admin"))]
    if let Some(axum::extract::OriginalUri(sent)) = extensions.get() {
        return sent;
    }
    let _ = extensions;
    uri
}

/// `path` in one spelling per resource: two paths a router hands the same path parameters
/// get the same string (but for a catch-all parameter, which also decodes `%2F`), and two it
/// hands different ones do not. Routers (axum, actix-web)
/// decode every escape in a path parameter, so `/orders/%34%32` reaches the handler of
/// `/orders/42` and `/users/a%40b` the handler of `/users/a@b`: keyed by the raw path, each pair
/// would take two locks for one resource.
///
/// Each byte is decoded (a `%XX` escape, or a raw byte) and written back one way: the characters
/// a path segment may hold as they are (RFC 3986 `pchar`: letters, digits, `-._~`,
/// `!$&'()*+,;=`, `:` and `@`) literally, every other byte — `%`, a space, a byte of a
/// non-ASCII character, sent raw or escaped — as `%XX` with upper-case hex. A raw `/` separates
/// segments and an escaped one (`%2F`) does not, so that one stays `%2F`. A `%` that does not
/// start an escape is the byte `%`, as routers read it (`%25`).
pub(crate) fn normalised_path(path: &str) -> Cow<'_, str> {
    let bytes = path.as_bytes();
    if bytes.iter().all(|&b| b == b'/' || literal(b)) {
        return Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len() + 8);
    let mut i = 0;
    while i < bytes.len() {
        let escaped = bytes
            .get(i + 1..i + 3)
            .filter(|_| bytes[i] == b'%')
            .and_then(|digits| crate::hex::decode(digits).ok());
        let (byte, raw) = match escaped.as_deref() {
            Some(&[byte]) => (byte, false),
            _ => (bytes[i], true),
        };
        i += if raw { 1 } else { 3 };
        if literal(byte) || (raw && byte == b'/') {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push_str(&crate::hex::encode(&[byte]).to_ascii_uppercase());
        }
    }
    Cow::Owned(out)
}

/// A byte a path segment holds as itself (RFC 3986 `pchar` without escapes).
fn literal(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b)
}

/// `text` decoded as `application/x-www-form-urlencoded` does: `+` is a space and `%XX` the
/// byte `XX`; a `%` not followed by two hex digits stays as it is.
pub(crate) fn form_decoded(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: Option<&u8>| b.and_then(|b| (*b as char).to_digit(16));
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => match (hex(bytes.get(i + 1)), hex(bytes.get(i + 2))) {
                (Some(h), Some(l)) => {
                    // Two hex digits: at most 0xff.
                    out.push(u8::try_from(h * 16 + l).unwrap_or(u8::MAX));
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_are_decoded_and_written_back_one_way() {
        assert_eq!(normalised_path("/orders/42/pay"), "/orders/42/pay");
        assert_eq!(normalised_path("/orders/%34%32/pay"), "/orders/42/pay");
        assert_eq!(normalised_path("/a%2db%7E%5F%2E"), "/a-b~_.");
        // Escaped characters a segment may hold as they are: decoded, as routers decode them.
        assert_eq!(normalised_path("/users/a%40b.com"), "/users/a@b.com");
        assert_eq!(normalised_path("/k/a%2Bb%3D%3d"), "/k/a+b==");
        assert_eq!(normalised_path("/x%3ay%20z"), "/x:y%20z");
        // An escaped `/` is not a separator.
        assert_eq!(normalised_path("/a%2fb"), "/a%2Fb");
        assert_eq!(normalised_path("/a%2Fb"), "/a%2Fb");
        assert_ne!(normalised_path("/a%2Fb"), normalised_path("/a/b"));
        // Everything else escaped, with upper-case hex.
        assert_eq!(normalised_path("/caf%c3%a9"), "/caf%C3%A9");
        assert_eq!(normalised_path("/a%3f%23"), "/a%3F%23");
        // Not escapes: the byte `%`.
        assert_eq!(normalised_path("/100%"), "/100%25");
        assert_eq!(normalised_path("/%zz/%4"), "/%25zz/%254");
        assert_eq!(normalised_path("/%%34%32"), "/%2542");
        assert_eq!(normalised_path("/%%34%32"), normalised_path("/%2542"));
    }

    #[test]
    fn a_character_sent_raw_and_escaped_is_one_path() {
        // A `Uri` takes raw UTF-8 in its path (hyper passes it through), and routers hand the
        // handler the same parameter either way.
        assert_eq!(normalised_path("/items/中"), "/items/%E4%B8%AD");
        assert_eq!(normalised_path("/items/%E4%B8%AD"), "/items/%E4%B8%AD");
        assert_eq!(normalised_path("/x/中%41"), "/x/%E4%B8%ADA");
        assert_eq!(normalised_path("/x/中%41"), normalised_path("/x/中A"));
        // Different characters stay different, whatever mix of raw and escaped bytes.
        assert_ne!(normalised_path("/%41中"), normalised_path("/Aä¸\u{AD}"));
        assert_eq!(normalised_path("/Aä¸\u{AD}"), "/A%C3%A4%C2%B8%C2%AD");
    }
}
