//! [`query`]: the value of a query-string parameter.

use std::borrow::Cow;
use std::future::{ready, Ready};

use http::Request;

use super::{combinators, ExtractKey, Extracted, Key};
use crate::uri::form_decoded;
use crate::Rejection;

/// Keys requests by the value of the query parameter `name`, decoded as a form (`+` is a space,
/// `%XX` a byte), as axum's `Query` and serde's form decoding read it: the key is
/// `query:<name>:<value>`. So `?account=7`, `?account=%37` and `?acc%6Funt=7` — one account to
/// the handler — take one lock; a closure keying on the raw query text gave them three.
///
/// * parameter absent, or empty (`?account=`, `?account`): no key;
/// * the parameter given more than once (`?account=7&account=8`), or a value that is not UTF-8
///   once decoded: 400 (`lock-invalid-key`), since which one to lock on would be ambiguous (a
///   handler reading the query into a map takes the last, one reading a struct refuses it);
/// * a value longer than the key input limit: 400 (`lock-invalid-key`).
///
/// The parameter's name is compared after decoding too, and taken as given (case-sensitive).
///
/// ```
/// let per_account = dlock_tower::key::query("account");
/// # let _ = per_account;
/// ```
pub fn query(name: impl Into<Cow<'static, str>>) -> Query {
    Query { name: name.into() }
}

/// The extractor of [`query`].
#[derive(Clone, Debug)]
pub struct Query {
    name: Cow<'static, str>,
}

combinators!(Query);

impl Query {
    /// The parameter's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn key<B>(&self, request: &Request<B>) -> Result<Option<Key>, Rejection> {
        let Some(query) = request.uri().query() else {
            return Ok(None);
        };
        let mut found: Option<Vec<u8>> = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if form_decoded(name) != self.name.as_bytes() {
                continue;
            }
            if found.is_some() {
                return Err(Rejection::invalid_key(&format!(
                    "query parameter `{}` is given more than once",
                    self.name
                )));
            }
            found = Some(form_decoded(value));
        }
        let Some(value) = found.filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let Ok(text) = std::str::from_utf8(&value) else {
            return Err(Rejection::invalid_key(&format!(
                "query parameter `{}` is not valid UTF-8",
                self.name
            )));
        };
        Ok(Some(Key::new("query").value(&*self.name).value(text)))
    }
}

impl<B> ExtractKey<B> for Query {
    type Future = Ready<Extracted<B>>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        ready(self.key(&request).map(|key| (request, key)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(uri: &str) -> Result<Option<String>, String> {
        let request = Request::builder().uri(uri).body(()).unwrap();
        match query("account").key(&request) {
            Ok(key) => Ok(key.map(|k| k.to_lock_key().unwrap().as_str().to_owned())),
            Err(rejection) => Err(rejection.status().as_str().to_owned()),
        }
    }

    /// Spellings one handler reads as the same account take one key; a separator in a value
    /// cannot make it another parameter's or another value's key.
    #[test]
    fn one_decoded_value_is_one_key() {
        let seven = key_of("/pay?account=7").unwrap();
        assert_eq!(seven.as_deref(), Some("query:account:7"));
        for same in [
            "/pay?account=%37",
            "/pay?acc%6Funt=7",
            "/pay?x=1&account=7&y=2",
        ] {
            assert_eq!(key_of(same).unwrap(), seven, "{same}");
        }
        assert_eq!(
            key_of("/pay?account=a+b").unwrap(),
            key_of("/pay?account=a%20b").unwrap()
        );
        assert_ne!(
            key_of("/pay?account=7%3Ax").unwrap(),
            key_of("/pay?account=7").unwrap()
        );
        assert_ne!(
            key_of("/pay?account=%2537").unwrap(),
            seven,
            "an escaped % is a % in the value"
        );
        assert_eq!(
            key_of("/pay?account=50%").unwrap().as_deref(),
            Some("query:account:50%25")
        );
    }

    /// Absent or empty: no key. Twice, or not UTF-8: refused, as a repeated header is.
    #[test]
    fn a_missing_value_is_no_key_and_an_ambiguous_one_is_refused() {
        for none in [
            "/pay",
            "/pay?",
            "/pay?other=1",
            "/pay?account=",
            "/pay?account",
        ] {
            assert_eq!(key_of(none), Ok(None), "{none}");
        }
        for refused in [
            "/pay?account=7&account=8",
            "/pay?account=7&acc%6Funt=7",
            "/pay?account=%ff",
        ] {
            assert_eq!(key_of(refused), Err("400".to_owned()), "{refused}");
        }
    }
}
