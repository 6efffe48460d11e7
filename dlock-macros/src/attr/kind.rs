//! `permits = N` and `mode = "read" | "write"`: what the attribute takes instead of the lock —
//! a permit of a semaphore, or a read or write hold of a read-write lock.

use proc_macro2::Span;
use syn::spanned::Spanned as _;
use syn::{Expr, Lit};

use super::{string_literal, Name};
use crate::errors::Errors;

/// What the function holds while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The lock on the key (no `permits`, no `mode`).
    Lock,
    /// `permits = N`: one of N permits of the semaphore on the key.
    Semaphore(u32),
    /// `mode = "read"`.
    Read,
    /// `mode = "write"`.
    Write,
}

/// `permits = N`, N from 1 to 4294967295.
pub(super) fn parse_permits(value: &Expr) -> syn::Result<u32> {
    let mut value = value;
    while let Expr::Group(group) = value {
        value = &group.expr;
    }
    let error = |span, why: &str| {
        syn::Error::new(
            span,
            format_args!(
                "`permits` {why}: it is how many callers may hold the semaphore at once, \
                 a whole number from 1 to 4294967295, as in `permits = 3`"
            ),
        )
    };
    match value {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Int(lit), ..
        }) => match lit.base10_parse::<u32>() {
            Ok(0) => Err(error(
                lit.span(),
                "must be at least 1 (a semaphore of 0 permits admits nobody)",
            )),
            Ok(permits) => Ok(permits),
            Err(_) => Err(error(lit.span(), "is out of range")),
        },
        other => Err(error(other.span(), "expects an integer literal")),
    }
}

/// `mode = "read" | "write"`.
pub(super) fn parse_mode(value: &Expr) -> syn::Result<Kind> {
    let lit = string_literal(Name::Mode, value)?;
    match lit.value().as_str() {
        "read" => Ok(Kind::Read),
        "write" => Ok(Kind::Write),
        other => Err(syn::Error::new(
            lit.span(),
            format_args!(
                "unknown `mode` {other:?}; expected \"read\" (shared with other readers) or \
                 \"write\" (alone) — the read-write lock on the key"
            ),
        )),
    }
}

/// The kind from the two arguments; both given is an error on `mode` (a semaphore has no
/// read or write mode).
pub(super) fn resolve(
    errors: &mut Errors,
    permits: Option<u32>,
    mode: Option<Kind>,
    mode_span: Option<Span>,
    permits_given: bool,
) -> Kind {
    if let (true, Some(span)) = (permits_given, mode_span) {
        errors.error(
            span,
            "`mode` and `permits` cannot be combined: `permits = N` takes a permit of a \
             semaphore, `mode = \"read\" | \"write\"` a hold of a read-write lock; pick one",
        );
        return Kind::Lock;
    }
    match (permits, mode) {
        (Some(n), _) => Kind::Semaphore(n),
        (None, Some(kind)) => kind,
        (None, None) => Kind::Lock,
    }
}
