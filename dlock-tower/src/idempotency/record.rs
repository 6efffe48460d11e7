//! What is stored and replayed: the status policy, the header policy, and the record's byte
//! format.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{response, Response, StatusCode};
use http_body::Body;

use super::ResponseBody;

/// The response headers stored and replayed by default (besides the status and the body):
/// representation metadata and what a client needs to find what the request created.
///
/// Everything else is not replayed. In particular, never: `set-cookie` (a session secret
/// belongs to the response it was issued with), `date` and `age` (a replay is a new message),
/// `content-length` (recomputed from the stored body), and the hop-by-hop fields
/// (`connection`, `keep-alive`, `proxy-connection`, `te`, `trailer`, `transfer-encoding`,
/// `upgrade`). Add your own with
/// [`IdempotencyLayer::replay_header`](super::IdempotencyLayer::replay_header).
pub const DEFAULT_REPLAY_HEADERS: &[&str] = &[
    "allow",
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-location",
    "content-type",
    "etag",
    "expires",
    "last-modified",
    "link",
    "location",
    "preference-applied",
    "vary",
];

/// Headers that are never stored, even when asked for (see [`DEFAULT_REPLAY_HEADERS`]).
pub(crate) const NEVER_REPLAYED: &[&str] = &[
    "age",
    "connection",
    "content-length",
    "date",
    "idempotent-replayed",
    "keep-alive",
    "proxy-connection",
    "set-cookie",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether a response with `status` is stored (and so replayed to retries).
///
/// Not stored — the key is freed, so the client's retry runs the handler again:
/// * `1xx` (not a final response) and every `5xx`: the server failed or gave up; the request's
///   outcome is not known to be final, and a retry is what the client should do.
/// * The statuses a request gets for one of its header fields, which the fingerprint does not
///   cover, so the client's corrected retry is the same request: `401 Unauthorized` and
///   `407 Proxy Authentication Required` (credentials), `406 Not Acceptable` (`Accept…`),
///   `412 Precondition Failed` and `428 Precondition Required` (`If-Match`…),
///   `415 Unsupported Media Type` (`Content-Type`, `Content-Encoding`), `426 Upgrade Required`
///   (the protocol) and `431 Request Header Fields Too Large`.
/// * `408 Request Timeout`, `425 Too Early`, `429 Too Many Requests`: explicitly "try again".
/// * `409 Conflict`, `423 Locked`: a conflict with the resource's *current* state (a concurrent
///   change, a lock), which a later retry may not meet.
///
/// Everything else is stored: `2xx`, `3xx` and the remaining `4xx` are the request's final
/// outcome (a validation error of the body stays one on retry).
pub(crate) fn is_storable(status: StatusCode) -> bool {
    !(status.is_informational()
        || status.is_server_error()
        || matches!(
            status.as_u16(),
            401 | 406 | 407 | 408 | 409 | 412 | 415 | 423 | 425 | 426 | 428 | 429 | 431
        ))
}

/// A stored response: status, the replay-safe headers (in their original order, repeated
/// fields kept), and the body bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

const VERSION: u8 = 1;

impl StoredResponse {
    /// Keeps the headers of `head` that are in `allow`.
    pub(crate) fn capture(head: &response::Parts, allow: &[HeaderName], body: Bytes) -> Self {
        let headers = head
            .headers
            .iter()
            .filter(|(name, _)| allow.contains(name))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        StoredResponse {
            status: head.status,
            headers,
            body,
        }
    }

    /// `[version 1][status u16][header count u16]([name len u16][name][value len u32][value])*[body]`,
    /// integers big-endian.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let size = 5
            + self
                .headers
                .iter()
                .map(|(n, v)| 6 + n.as_str().len() + v.len())
                .sum::<usize>()
            + self.body.len();
        let mut out = Vec::with_capacity(size);
        out.push(VERSION);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        let count = self.headers.len().min(usize::from(u16::MAX));
        out.extend_from_slice(&(count as u16).to_be_bytes());
        for (name, value) in self.headers.iter().take(count) {
            let name = name.as_str().as_bytes();
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name);
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads a record written by [`encode`](StoredResponse::encode); `None` if it is not one.
    pub(crate) fn decode(record: Vec<u8>) -> Option<Self> {
        let record = Bytes::from(record);
        let mut at = 0usize;
        let mut take = |n: usize| -> Option<Bytes> {
            let end = at.checked_add(n)?;
            let part = record.get(at..end)?;
            let part = record.slice_ref(part);
            at = end;
            Some(part)
        };
        if take(1)?[0] != VERSION {
            return None;
        }
        let status = take(2)?;
        let status = StatusCode::from_u16(u16::from_be_bytes([status[0], status[1]])).ok()?;
        let count = take(2)?;
        let count = u16::from_be_bytes([count[0], count[1]]);
        // Each header takes at least 7 bytes (two lengths and a name byte): never reserve more
        // than the record can hold, whatever a corrupt count says.
        let mut headers = Vec::with_capacity(usize::from(count).min(record.len() / 7));
        for _ in 0..count {
            let n = take(2)?;
            let name = take(usize::from(u16::from_be_bytes([n[0], n[1]])))?;
            let n = take(4)?;
            let value = take(u32::from_be_bytes([n[0], n[1], n[2], n[3]]) as usize)?;
            headers.push((
                HeaderName::from_bytes(&name).ok()?,
                HeaderValue::from_maybe_shared(value).ok()?,
            ));
        }
        let body = record.slice(at..);
        Some(StoredResponse {
            status,
            headers,
            body,
        })
    }

    /// The replay: the stored status, headers and body, plus `Idempotent-Replayed: true`.
    /// The first of this response's content codings (`Content-Encoding`) that a request with
    /// `request`'s headers does not accept (`Accept-Encoding`, RFC 9110 §12.5.3), if any: no
    /// field accepts every coding; an empty one only `identity`; a coding is accepted when it
    /// is listed, or `*` is, with a weight above 0 (`x-gzip` and `x-compress` are `gzip` and
    /// `compress`).
    pub(crate) fn unacceptable_coding(&self, request: &http::HeaderMap) -> Option<String> {
        let normal = |c: &str| {
            let c = c.trim().to_ascii_lowercase();
            match c.strip_prefix("x-") {
                Some(base @ ("gzip" | "compress")) => base.to_owned(),
                _ => c,
            }
        };
        let codings: Vec<String> = self
            .headers
            .iter()
            .filter(|(name, _)| name == http::header::CONTENT_ENCODING)
            .flat_map(|(_, v)| v.to_str().unwrap_or("").split(','))
            .map(normal)
            .filter(|c| !c.is_empty() && c != "identity")
            .collect();
        let mut fields = request
            .get_all(http::header::ACCEPT_ENCODING)
            .iter()
            .peekable();
        if codings.is_empty() || fields.peek().is_none() {
            return None;
        }
        let accepted: Vec<(String, f32)> = fields
            .flat_map(|v| v.to_str().unwrap_or("").split(','))
            .filter_map(|item| {
                let mut parts = item.split(';');
                let name = normal(parts.next()?);
                let weight = parts
                    .filter_map(|p| p.trim().strip_prefix("q=").or(p.trim().strip_prefix("Q=")))
                    .find_map(|q| q.trim().parse::<f32>().ok())
                    .unwrap_or(1.0);
                (!name.is_empty()).then_some((name, weight))
            })
            .collect();
        let weight = |coding: &str| {
            let named = |n: &str| accepted.iter().find(|(a, _)| a == n).map(|(_, q)| *q);
            named(coding).or_else(|| named("*"))
        };
        codings
            .into_iter()
            .find(|c| weight(c).is_none_or(|q| q <= 0.0))
    }

    pub(crate) fn into_response<B: Body>(self) -> Response<ResponseBody<B>> {
        let mut res = Response::new(ResponseBody::full(self.body));
        *res.status_mut() = self.status;
        let headers = res.headers_mut();
        for (name, value) in self.headers {
            headers.append(name, value);
        }
        headers.insert(
            HeaderName::from_static("idempotent-replayed"),
            HeaderValue::from_static("true"),
        );
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow() -> Vec<HeaderName> {
        DEFAULT_REPLAY_HEADERS
            .iter()
            .map(|h| HeaderName::from_static(h))
            .collect()
    }

    #[test]
    fn only_final_outcomes_are_stored() {
        for s in [
            200, 201, 202, 204, 301, 303, 400, 403, 404, 405, 410, 413, 422,
        ] {
            assert!(is_storable(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [
            100, 103, 401, 406, 407, 408, 409, 412, 415, 423, 425, 426, 428, 429, 431, 500, 502,
            503, 504, 599,
        ] {
            assert!(!is_storable(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }

    #[test]
    fn capture_keeps_only_replay_safe_headers_in_order() {
        let res = Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .header("set-cookie", "session=secret")
            .header("date", "Tue, 01 Dec 2026 10:00:00 GMT")
            .header("location", "/payments/1")
            .header("link", "</a>; rel=a")
            .header("link", "</b>; rel=b")
            .header("connection", "close")
            .header("transfer-encoding", "chunked")
            .header("content-length", "2")
            .header("x-request-id", "r1")
            .body(())
            .unwrap();
        let (head, ()) = res.into_parts();
        let stored = StoredResponse::capture(&head, &allow(), Bytes::from_static(b"{}"));
        let names: Vec<&str> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "location", "link", "link"]);
        assert_eq!(stored.headers[3].1, "</b>; rel=b");
        // Nothing the layer refuses to replay is in the default list.
        for h in NEVER_REPLAYED {
            assert!(!DEFAULT_REPLAY_HEADERS.contains(h), "{h}");
        }
    }

    #[test]
    fn records_round_trip_byte_for_byte() {
        let body: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/octet-stream"),
                ),
                (
                    HeaderName::from_static("etag"),
                    HeaderValue::from_bytes(b"\"\xe9t\xe9\"").unwrap(),
                ),
            ],
            body: Bytes::from(body),
        };
        let bytes = stored.encode();
        assert_eq!(StoredResponse::decode(bytes).unwrap(), stored);

        let empty = StoredResponse {
            status: StatusCode::NO_CONTENT,
            headers: vec![],
            body: Bytes::new(),
        };
        assert_eq!(StoredResponse::decode(empty.encode()).unwrap(), empty);
    }

    #[test]
    fn corrupt_records_are_refused() {
        let stored = StoredResponse {
            status: StatusCode::OK,
            headers: vec![(
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("text/plain"),
            )],
            body: Bytes::from_static(b"ok"),
        };
        let good = stored.encode();
        assert!(StoredResponse::decode(Vec::new()).is_none());
        let mut v = good.clone();
        v[0] = 2; // unknown version
        assert!(StoredResponse::decode(v).is_none());
        let mut v = good.clone();
        v[1] = 0xff; // status 65_000+
        assert!(StoredResponse::decode(v).is_none());
        // Truncated inside the header section.
        assert!(StoredResponse::decode(good[..10].to_vec()).is_none());
    }

    #[test]
    fn a_coding_is_replayed_only_where_accepted() {
        let stored = |encoding: &str| StoredResponse {
            status: StatusCode::OK,
            headers: vec![(
                HeaderName::from_static("content-encoding"),
                HeaderValue::from_str(encoding).unwrap(),
            )],
            body: Bytes::from_static(b"x"),
        };
        let accept = |fields: &[&str]| {
            let mut h = http::HeaderMap::new();
            for f in fields {
                h.append("accept-encoding", HeaderValue::from_str(f).unwrap());
            }
            h
        };
        let gzip = stored("gzip");
        for ok in [
            &[][..],
            &["gzip"],
            &["br;q=0.5, GZIP"],
            &["*"],
            &["identity", "x-gzip;q=0.1"],
            &["deflate, *;q=0.2"],
        ] {
            assert_eq!(gzip.unacceptable_coding(&accept(ok)), None, "{ok:?}");
        }
        for refused in [
            &[""][..],
            &["identity"],
            &["br"],
            &["gzip;q=0, *"],
            &["*;q=0"],
        ] {
            assert_eq!(
                gzip.unacceptable_coding(&accept(refused)),
                Some("gzip".to_owned()),
                "{refused:?}"
            );
        }
        // Every coding applied must be accepted; `identity` always is.
        let both = stored("gzip, br");
        assert_eq!(
            both.unacceptable_coding(&accept(&["gzip"])),
            Some("br".into())
        );
        assert_eq!(stored("identity").unacceptable_coding(&accept(&[""])), None);
    }

    #[test]
    fn replay_adds_the_replayed_marker() {
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![(
                HeaderName::from_static("location"),
                HeaderValue::from_static("/p/1"),
            )],
            body: Bytes::from_static(b"x"),
        };
        let res: Response<ResponseBody<http_body_util::Full<Bytes>>> = stored.into_response();
        assert_eq!(res.status(), 201);
        assert_eq!(res.headers()["location"], "/p/1");
        assert_eq!(res.headers()["idempotent-replayed"], "true");
    }
}
