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
        .map(|h| {
            if h.contains('/') || h.contains('?') {
                Err(invalid("paths and query strings are not supported"))
            } else if h
                .rsplit_once(':')
                .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
            {
                Ok(h.to_owned())
            } else {
                Ok(format!("{h}:2379"))
            }
        })
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
}
