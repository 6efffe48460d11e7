//! The URI a request was sent with, and the path as a key sees it.

use std::borrow::Cow;

use http::{Extensions, Uri};

/// The URI the client sent. Inside axum's `Router::nest`, the request's own URI has the nest's
/// prefix taken off before the nested router's layers run, so two nested routers' `/pay` would
/// look alike (one idempotency fingerprint, one lock, a deferred job replayed to the wrong
/// route); with the `axum` feature the layers read axum's `OriginalUri` instead, which the
/// outermost router sets. Without the feature (or outside axum) it is the request's URI.
pub(crate) fn original<'a>(uri: &'a Uri, extensions: &'a Extensions) -> &'a Uri {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::OriginalUri(sent)) = extensions.get() {
        return sent;
    }
    let _ = extensions;
    uri
}

/// `path` with its percent-encoding normalised (RFC 3986, 6.2.2.1 and 6.2.2.2): an escaped
/// unreserved character (`A`–`Z`, `a`–`z`, `0`–`9`, `-`, `.`, `_`, `~`) is decoded, and the hex
/// digits of the other escapes are upper case. Both forms name the same resource, and routers
/// decode path parameters, so `/orders/%34%32` reaches the handler of `/orders/42`: keyed by the
/// raw path, the two would take different locks. Escapes of reserved characters (`%2F`, `%3A`
/// …) stay escaped, so no two paths that differ in meaning share a key.
pub(crate) fn normalised_path(path: &str) -> Cow<'_, str> {
    if !path.contains('%') {
        return Cow::Borrowed(path);
    }
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = path
            .get(i + 1..i + 3)
            .filter(|_| bytes[i] == b'%')
            .and_then(|digits| crate::hex::decode(digits).ok());
        match escaped.as_deref() {
            Some(&[byte]) => {
                let c = char::from(byte);
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '~') {
                    out.push(c);
                } else {
                    out.push('%');
                    out.push_str(&path[i + 1..i + 3].to_ascii_uppercase());
                }
                i += 3;
            }
            _ => {
                // Not an escape (a lone `%`, or one without two hex digits): kept as sent. The
                // path is ASCII (a `Uri` holds no other bytes), so a byte is a char.
                out.push(char::from(bytes[i]));
                i += 1;
            }
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaped_unreserved_characters_are_decoded_and_hex_is_upper_case() {
        assert_eq!(normalised_path("/orders/42/pay"), "/orders/42/pay");
        assert_eq!(normalised_path("/orders/%34%32/pay"), "/orders/42/pay");
        assert_eq!(normalised_path("/a%2db%7E%5F%2E"), "/a-b~_.");
        assert_eq!(normalised_path("/a%2fb"), "/a%2Fb");
        assert_eq!(normalised_path("/a%2Fb"), "/a%2Fb");
        assert_eq!(normalised_path("/x%3ay%20z"), "/x%3Ay%20z");
        assert_eq!(normalised_path("/caf%c3%a9"), "/caf%C3%A9");
        // Not escapes: kept as sent.
        assert_eq!(normalised_path("/100%"), "/100%");
        assert_eq!(normalised_path("/%zz/%4"), "/%zz/%4");
        assert_eq!(normalised_path("/%%34%32"), "/%42");
    }
}
