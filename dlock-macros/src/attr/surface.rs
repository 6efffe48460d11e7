//! The arguments for lock kinds beyond one key held while the body runs: multi-key lists
//! (`key = ["a:<x>", "b:<y>"]`), scheduled jobs (`on_fail = "skip"`, `hold_at_least`) and
//! `fallback`. Kept apart from the rest of `attr` so that each kind's parsing and checks sit
//! together.

use std::time::Duration;

use proc_macro2::Span;
use syn::spanned::Spanned as _;
use syn::{Expr, LitStr};

use super::{parse_duration, parse_key_literal, short, string_literal, Key, Name};

/// `key = "…"` or `key = ["…", "…"]`: one template, or a list for a multi-key lock.
pub(crate) fn parse_keys(value: &Expr) -> syn::Result<(Vec<Key>, bool)> {
    let mut value = value;
    while let Expr::Group(group) = value {
        value = &group.expr;
    }
    let Expr::Array(array) = value else {
        return Ok((vec![parse_key_literal(value)?], false));
    };
    if array.elems.is_empty() {
        return Err(syn::Error::new(
            array.span(),
            "`key = []` names no key: a multi-key lock needs at least one key template, as in \
             `key = [\"account:<from>\", \"account:<to>\"]`",
        ));
    }
    let mut keys: Vec<Key> = Vec::with_capacity(array.elems.len());
    let mut error: Option<syn::Error> = None;
    let mut push_error = |e: syn::Error| match &mut error {
        Some(all) => all.combine(e),
        None => error = Some(e),
    };
    for elem in &array.elems {
        match parse_key_literal(elem) {
            Ok(key) => {
                if keys.iter().any(|k| k.lit.value() == key.lit.value()) {
                    push_error(syn::Error::new(
                        key.lit.span(),
                        format_args!(
                            "duplicate key template {:?}: a multi-key lock takes each key once",
                            key.lit.value()
                        ),
                    ));
                } else {
                    keys.push(key);
                }
            }
            Err(e) => push_error(e),
        }
    }
    match error {
        Some(error) => Err(error),
        None => Ok((keys, true)),
    }
}

/// `hold_at_least = "…"`: more than zero; checked against the ttl by [`check_hold`].
pub(crate) fn parse_hold_at_least(value: &Expr) -> syn::Result<(LitStr, Duration)> {
    let lit = string_literal(Name::HoldAtLeast, value)?;
    let hold = parse_duration(Name::HoldAtLeast, &lit)?;
    if hold.is_zero() {
        return Err(syn::Error::new(
            lit.span(),
            "`hold_at_least` must be greater than zero (leave it out to release as soon as \
             the function returns)",
        ));
    }
    Ok((lit, hold))
}

/// `hold_at_least` must fit in the lock's lease.
pub(crate) fn check_hold(lit: &LitStr, hold: Duration, ttl: Duration) -> syn::Result<()> {
    if hold > ttl {
        return Err(syn::Error::new(
            lit.span(),
            format_args!(
                "`hold_at_least` ({}) is longer than the `ttl` ({}): the lock cannot be kept \
                 longer than its lease; raise `ttl` or shorten `hold_at_least`",
                short(hold),
                short(ttl)
            ),
        ));
    }
    Ok(())
}

/// `fallback = path::to_fn`.
pub(crate) fn parse_fallback(value: &Expr) -> syn::Result<syn::Path> {
    let mut value = value;
    while let Expr::Group(group) = value {
        value = &group.expr;
    }
    match value {
        Expr::Path(path) if path.qself.is_none() => Ok(path.path.clone()),
        other => Err(syn::Error::new(
            other.span(),
            "`fallback` expects the path of an async fn, as in `fallback = busy_answer` or \
             `fallback = handlers::busy`",
        )),
    }
}

/// The span to report a multi-key misuse on: the key list.
pub(crate) fn multi_key_span(keys: &[Key]) -> Span {
    keys.first().map_or_else(Span::call_site, |k| k.lit.span())
}
