//! The crate's one hex codec (stored requests, body digests, percent-escapes in paths).

use std::fmt::Write as _;

/// `bytes` as lowercase hex.
pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Decodes lowercase or uppercase hex. Works on bytes, so no input can make it panic.
pub(crate) fn decode(s: impl AsRef<[u8]>) -> Result<Vec<u8>, &'static str> {
    fn digit(b: u8) -> Result<u8, &'static str> {
        match b {
            b'0'..=b'9' => Ok(b - b'0'),
            b'a'..=b'f' => Ok(b - b'a' + 10),
            b'A'..=b'F' => Ok(b - b'A' + 10),
            _ => Err("not a hex digit"),
        }
    }
    let bytes = s.as_ref();
    if bytes.len() % 2 != 0 {
        return Err("odd hex length");
    }
    bytes
        .chunks_exact(2)
        .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_arbitrary_bytes() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(encode(&bytes)).unwrap(), bytes);
        assert!(decode("abc").is_err());
        assert!(decode("zz").is_err());
    }

    #[test]
    fn corrupt_hex_is_an_error_never_a_panic() {
        // A multi-byte character across a digit pair used to panic on a str slice.
        for corrupt in ["aéb", "é0", "0é", "\u{1F600}", "+1", "0x", " 1"] {
            assert!(decode(corrupt).is_err(), "{corrupt:?}");
        }
    }
}
