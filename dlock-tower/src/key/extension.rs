//! [`extension`]: a value an earlier layer put in the request extensions.

use std::borrow::Cow;
use std::fmt;
use std::future::{ready, Ready};
use std::marker::PhantomData;

use http::Request;

use super::{combinators, ExtractKey, Extracted, Key};

/// Keys requests by a value of type `T` found in the request extensions, typically the
/// identity an authentication layer placed there: `ext:<label>:<value>`, where the value is
/// `T`'s `Display` output. A request without a `T` has no key.
///
/// The label defaults to `T`'s name without its module paths (`UserId` for
/// `my_app::auth::UserId`, `Id<User>` for `my_app::Id<my_app::User>`: generic arguments are
/// kept, so `Id<User>` and `Id<Order>` never share a lock). Two types of the same name in
/// different modules (`session::UserId`, `api_key::UserId`) get the same default label, and
/// their values one key space — user 7 and API key 7 one lock: give each its own with
/// [`Extension::label`]. It is taken from [`std::any::type_name`], whose output the
/// standard library does not promise to keep across compiler versions: when instances built
/// by different compilers share a lock store, set a fixed label with
/// [`Extension::label`].
///
/// ```
/// use dlock_tower::key;
///
/// #[derive(Clone)]
/// struct UserId(u64);
/// impl std::fmt::Display for UserId {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         self.0.fmt(f)
///     }
/// }
///
/// // `ext:user:<id>:path:<METHOD>:<path>`: one request per user and endpoint at a time.
/// let per_user = key::extension::<UserId>().label("user").and(key::method_path());
/// # let _ = per_user;
/// ```
pub fn extension<T>() -> Extension<T>
where
    T: fmt::Display + Clone + Send + Sync + 'static,
{
    Extension {
        label: Cow::Owned(short_type_name(std::any::type_name::<T>())),
        _marker: PhantomData,
    }
}

/// `full` with every path shortened to its last segment, generic arguments kept:
/// `my_app::Id<my_app::User>` → `Id<User>`. Without the arguments, `Id<User>` and `Id<Order>`
/// would share a label, and user 7 and order 7 one lock.
fn short_type_name(full: &str) -> String {
    let mut out = String::with_capacity(full.len());
    let mut path = String::new();
    let flush = |path: &mut String, out: &mut String| {
        out.push_str(path.rsplit("::").next().unwrap_or(path));
        path.clear();
    };
    for c in full.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            path.push(c);
        } else {
            flush(&mut path, &mut out);
            out.push(c);
        }
    }
    flush(&mut path, &mut out);
    out
}

/// The extractor of [`extension`].
pub struct Extension<T> {
    label: Cow<'static, str>,
    _marker: PhantomData<fn() -> T>,
}

combinators!(Extension<T>);

impl<T> Extension<T> {
    /// Sets the literal that names the value in the key (`ext:<label>:<value>`).
    #[must_use]
    pub fn label(mut self, label: impl Into<Cow<'static, str>>) -> Self {
        self.label = label.into();
        self
    }
}

impl<T> Clone for Extension<T> {
    fn clone(&self) -> Self {
        Extension {
            label: self.label.clone(),
            _marker: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Extension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Extension")
            .field("type", &std::any::type_name::<T>())
            .field("label", &self.label)
            .finish()
    }
}

impl<B, T> ExtractKey<B> for Extension<T>
where
    T: fmt::Display + Clone + Send + Sync + 'static,
{
    type Future = Ready<Extracted<B>>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        let key = request
            .extensions()
            .get::<T>()
            .map(|value| Key::new("ext").lit(self.label.clone()).value(value));
        ready(Ok((request, key)))
    }
}

#[cfg(test)]
mod tests {
    use super::short_type_name;

    #[test]
    fn labels_drop_module_paths_and_keep_generic_arguments() {
        assert_eq!(short_type_name("my_app::auth::UserId"), "UserId");
        assert_eq!(short_type_name("u64"), "u64");
        assert_eq!(short_type_name("my_app::Id<my_app::User>"), "Id<User>");
        assert_ne!(
            short_type_name("my_app::Id<my_app::User>"),
            short_type_name("my_app::Id<my_app::Order>")
        );
        assert_eq!(
            short_type_name("a::Pair<a::b::X, alloc::vec::Vec<u8>>"),
            "Pair<X, Vec<u8>>"
        );
        assert_eq!(short_type_name("&'static str"), "&'static str");
        assert_eq!(
            super::extension::<std::sync::Arc<String>>().label,
            "Arc<String>"
        );
    }
}
