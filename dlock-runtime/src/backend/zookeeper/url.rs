//! `zk://host:port[,host:port…][/chroot][?session_timeout_ms=N]` URLs.

use std::time::Duration;

use crate::LockError;

/// A parsed `zk://` URL.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ZkUrl {
    /// `host:port` of every server given (port 2181 when none).
    pub(super) hosts: Vec<String>,
    /// The chroot path (`""` for none, else `/a/b`).
    pub(super) chroot: String,
    /// `session_timeout_ms`, when given.
    pub(super) session_timeout: Option<Duration>,
}

fn invalid(what: &str) -> LockError {
    LockError::misconfigured(format!("invalid ZooKeeper URL: {what}"), None)
}

/// Parses a `zk://` URL.
pub(super) fn parse(url: &str) -> Result<ZkUrl, LockError> {
    let rest = url
        .strip_prefix("zk://")
        .ok_or_else(|| invalid("the scheme must be zk://"))?;
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    if rest.contains('@') {
        return Err(invalid("credentials are not supported"));
    }
    let (hosts, chroot) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let chroot = chroot.strip_suffix('/').unwrap_or(chroot);
    if !chroot.is_empty() {
        for part in chroot[1..].split('/') {
            if part.is_empty() || part == "." || part == ".." {
                return Err(invalid(
                    "the chroot must be a path like /a/b (no empty, `.` or `..` parts)",
                ));
            }
            if part.chars().any(char::is_control) {
                return Err(invalid("the chroot holds a control character"));
            }
        }
    }
    let hosts: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| match h.rsplit_once(':') {
            Some(("", _)) => Err(invalid("a host is empty")),
            Some((_, port)) => port
                .parse::<u16>()
                .map(|_| h.to_owned())
                .map_err(|_| invalid("a port is not a number in 0..=65535")),
            None => Ok(format!("{h}:2181")),
        })
        .collect::<Result<_, _>>()?;
    if hosts.is_empty() {
        return Err(invalid("no host"));
    }
    let mut session_timeout = None;
    for pair in query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("session_timeout_ms", v)) => {
                let ms: u64 = v
                    .parse()
                    .ok()
                    .filter(|ms| *ms > 0)
                    .ok_or_else(|| invalid("session_timeout_ms must be a positive integer"))?;
                session_timeout = Some(Duration::from_millis(ms));
            }
            _ => return Err(invalid("unknown parameter (known: session_timeout_ms)")),
        }
    }
    Ok(ZkUrl {
        hosts,
        chroot: chroot.to_owned(),
        session_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_default_port_and_chroot() {
        let u = parse("zk://h1:1,h2,h3:2181/app/locks").unwrap();
        assert_eq!(u.hosts, ["h1:1", "h2:2181", "h3:2181"]);
        assert_eq!(u.chroot, "/app/locks");
        assert_eq!(u.session_timeout, None);
        let u = parse("zk://h1/?session_timeout_ms=4000").unwrap();
        assert_eq!(u.chroot, "");
        assert_eq!(u.session_timeout, Some(Duration::from_secs(4)));
    }

    #[test]
    fn bad_urls_are_refused_with_a_reason() {
        for (url, reason) in [
            ("zookeeper://h1", "scheme"),
            ("zk://", "no host"),
            ("zk:///chroot", "no host"),
            ("zk://h1:99999", "port"),
            ("zk://h1:x", "port"),
            ("zk://h1/a//b", "chroot"),
            ("zk://h1/a/../b", "chroot"),
            ("zk://u:p@h1", "credentials"),
            ("zk://h1?session_timeout_ms=0", "session_timeout_ms"),
            ("zk://h1?timeout=3", "unknown parameter"),
        ] {
            let e = parse(url).unwrap_err();
            assert!(e.is_misconfigured(), "{url}: {e}");
            assert!(e.to_string().contains(reason), "{url}: {e}");
        }
    }
}
