//! `etcd://[user:password@]host:port[,host:port…][/]` URLs, and `etcds://` for TLS.

use crate::LockError;

/// A parsed `etcd://` URL.
pub(super) struct EtcdUrl {
    /// `host:port` of every member given.
    pub(super) hosts: Vec<String>,
    /// User and password, percent-decoded.
    pub(super) user: Option<(String, String)>,
    /// `etcds://`: TLS to every member.
    pub(super) tls: bool,
}

fn invalid(what: &str) -> LockError {
    // Never echo the URL: it may carry a password.
    LockError::misconfigured(format!("invalid etcd URL: {what}"), None)
}

fn percent_decode(s: &str) -> Result<String, LockError> {
    crate::util::percent_decode(s)
        .ok_or_else(|| invalid("bad percent-encoding in the user or password, or not UTF-8"))
}

/// One member, `host[:port]` (an IPv6 address in brackets), as `host:port`: 2379 when the
/// port is left out. A port that is not one (`h:abc`, `h:0`, `h:70000`, `h:`) is refused here —
/// it would otherwise be taken for part of the host, and the connection's failure reported as
/// the cluster being down.
fn host(h: &str) -> Result<String, LockError> {
    if h.contains('/') || h.contains('?') {
        return Err(invalid("paths and query strings are not supported"));
    }
    let port = match h.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((addr, "")) if !addr.is_empty() => None,
            Some((addr, port)) if !addr.is_empty() => Some(port.strip_prefix(':')),
            _ => {
                return Err(invalid(
                    "an IPv6 host must be in brackets: [addr] or [addr]:port",
                ))
            }
        },
        None => h
            .rsplit_once(':')
            .map(|(name, port)| (!name.is_empty() && !name.contains(':')).then_some(port)),
    };
    match port {
        None => Ok(format!("{h}:2379")),
        Some(Some(p)) if p.parse::<u16>().is_ok_and(|p| p != 0) => Ok(h.to_owned()),
        Some(_) => Err(invalid(
            "a member's port must be a number from 1 to 65535 (IPv6 addresses in brackets)",
        )),
    }
}

/// Parses an `etcd://` URL.
pub(super) fn parse(url: &str) -> Result<EtcdUrl, LockError> {
    let (rest, tls) = match url.strip_prefix("etcds://") {
        Some(rest) => (rest, true),
        None => (
            url.strip_prefix("etcd://")
                .ok_or_else(|| invalid("the scheme must be etcd:// or etcds:// (TLS)"))?,
            false,
        ),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (user, hosts) = match rest.rsplit_once('@') {
        Some((cred, hosts)) => {
            let (u, p) = cred
                .split_once(':')
                .ok_or_else(|| invalid("credentials must be user:password"))?;
            (Some((percent_decode(u)?, percent_decode(p)?)), hosts)
        }
        None => (None, rest),
    };
    let hosts: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(host)
        .collect::<Result<_, _>>()?;
    if hosts.is_empty() {
        return Err(invalid("no host"));
    }
    Ok(EtcdUrl { hosts, user, tls })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_users_and_default_port() {
        let u = parse("etcd://al%40x:p%3Ass@h1:1,h2/").unwrap();
        assert_eq!(u.hosts, ["h1:1", "h2:2379"]);
        assert_eq!(u.user, Some(("al@x".to_owned(), "p:ss".to_owned())));
        assert!(parse("etcd://").is_err());
        let Err(e) = parse("etcd://u:secret@h1/path") else {
            panic!("a path must be refused")
        };
        assert!(!e.to_string().contains("secret"));
        assert!(!u.tls);
        let t = parse("etcds://h1:2380").unwrap();
        assert!(t.tls);
        assert_eq!(t.hosts, ["h1:2380"]);
        assert!(parse("http://h1").is_err());
    }

    #[test]
    fn ports_that_are_not_ones_are_misconfigured() {
        for bad in [
            "etcd://127.0.0.1:abc",
            "etcd://h:",
            "etcd://h:0",
            "etcd://h:70000",
            "etcd://h1:2379,h2:x",
            "etcd://:2379",
            "etcd://::1",
            "etcd://[::1]x",
            "etcd://[::1]:",
            "etcd://[]:2379",
        ] {
            match parse(bad) {
                Err(e) => assert!(e.is_misconfigured(), "{bad}: {e}"),
                Ok(u) => panic!("{bad} was taken, as {:?}", u.hosts),
            }
        }
        let u = parse("etcd://[::1],[::1]:2380,h:1").unwrap();
        assert_eq!(u.hosts, ["[::1]:2379", "[::1]:2380", "h:1"]);
    }
}
