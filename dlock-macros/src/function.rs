//! The function model: the `async fn` the attribute is on, as written ([`LockedFn`]), the
//! checks on its signature, and the names its parameters bind ([`Bindings`]), which key
//! placeholders may refer to.

use proc_macro2::{Delimiter, Group, Span, TokenStream};
use syn::parse::{Parse, ParseStream};
use syn::{Attribute, FnArg, Ident, Pat, Signature, Token, Visibility};

use crate::errors::Errors;

/// An `async fn` as written: free fn, method, or trait method (with or without a body).
pub(crate) struct LockedFn {
    pub(crate) attrs: Vec<Attribute>,
    pub(crate) vis: Visibility,
    pub(crate) sig: Signature,
    /// `None` for a declaration ending in `;`.
    pub(crate) body: Option<Body>,
}

/// The body of the function, kept as tokens so that a body that does not parse yet (while the
/// user is typing) still expands, and IDEs keep working.
pub(crate) struct Body {
    brace_span: Span,
    /// `#![…]` attributes at the top of the body.
    pub(crate) inner_attrs: Vec<Attribute>,
    stmts: TokenStream,
}

impl Body {
    /// `{ stmts }` with the original braces' span.
    pub(crate) fn block(&self) -> Group {
        let mut block = Group::new(Delimiter::Brace, self.stmts.clone());
        // Where the user wrote them, but as the macro's braces: the body becomes the tail of
        // an async block, and under the user's own hygiene rustc took a one-line body
        // (`{ id * 2 }`) for braces written around a block's return value (`unused_braces`,
        // an error under `deny(warnings)`, with advice that does not compile).
        block.set_span(self.brace_span.resolved_at(Span::mixed_site()));
        block
    }
}

impl Parse for LockedFn {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        let sig: Signature = input.parse().map_err(|error| {
            syn::Error::new(
                error.span(),
                "#[distributed_lock] can only be applied to an `async fn`",
            )
        })?;
        let body = if input.peek(Token![;]) {
            input.parse::<Token![;]>()?;
            None
        } else {
            let content;
            let brace = syn::braced!(content in input);
            Some(Body {
                brace_span: brace.span.join(),
                inner_attrs: content.call(Attribute::parse_inner)?,
                stmts: content.parse()?,
            })
        };
        Ok(LockedFn {
            attrs,
            vis,
            sig,
            body,
        })
    }
}

/// Records every reason the attribute cannot apply to `function`: not `async`, `const`,
/// `extern`, variadic, or without a body.
pub(crate) fn check_signature(function: &LockedFn, errors: &mut Errors) {
    let sig = &function.sig;
    if let Some(constness) = &sig.constness {
        errors.error(
            constness.span,
            "#[distributed_lock] cannot be used on a `const fn`: it takes the lock with \
             `.await`, so the function must be an `async fn`",
        );
    } else if sig.asyncness.is_none() {
        errors.error(
            sig.fn_token.span,
            "#[distributed_lock] can only be used on an `async fn`: the lock is taken and \
             released with `.await` around the function body; make it an `async fn`",
        );
    }
    if let Some(abi) = &sig.abi {
        errors.error(
            abi.extern_token.span,
            "#[distributed_lock] cannot be used on an `extern` function",
        );
    }
    if let Some(variadic) = &sig.variadic {
        errors.error(
            variadic.dots.spans[0],
            "#[distributed_lock] cannot be used on a variadic function",
        );
    }
    if function.body.is_none() {
        errors.error(
            sig.ident.span(),
            "#[distributed_lock] needs a function body to run under the lock; it cannot be \
             used on a trait method declaration without one (put it on the implementations, \
             and declare the method as returning `Result<T, E>` with `E: From<LockError>`, \
             which the implementations keep)",
        );
    }
}

/// The names a key placeholder can refer to.
pub(crate) struct Bindings {
    /// The `self` token of a method's receiver.
    pub(crate) receiver: Option<Ident>,
    /// Plain parameters and every name bound inside parameter patterns, in order.
    pub(crate) names: Vec<Ident>,
    /// For each of `names`, the `#[cfg(..)]` attributes of its parameter: an attribute macro
    /// sees the parameters before `cfg` removes any, so code naming every binding carries
    /// them.
    pub(crate) cfgs: Vec<Vec<syn::Attribute>>,
}

impl Bindings {
    /// The bindings of `sig`'s parameters.
    pub(crate) fn of(sig: &Signature) -> Self {
        let mut bindings = Bindings {
            receiver: None,
            names: Vec::new(),
            cfgs: Vec::new(),
        };
        for input in &sig.inputs {
            match input {
                FnArg::Receiver(receiver) => {
                    bindings.receiver = Some(Ident::from(receiver.self_token));
                }
                FnArg::Typed(typed) => {
                    pattern_bindings(&typed.pat, &mut bindings.names);
                    let cfg: Vec<syn::Attribute> = typed
                        .attrs
                        .iter()
                        .filter(|a| a.path().is_ident("cfg"))
                        .cloned()
                        .collect();
                    bindings.cfgs.resize(bindings.names.len(), cfg);
                }
            }
        }
        bindings
    }

    /// `self` (when a method), then every named binding.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Ident> {
        self.receiver.iter().chain(&self.names)
    }

    /// Every binding with the `cfg` attributes of its parameter (none for `self`).
    pub(crate) fn all_with_cfg(&self) -> impl Iterator<Item = (&Ident, &[syn::Attribute])> {
        let receiver = self.receiver.iter().map(|r| (r, &[][..]));
        receiver.chain(self.names.iter().zip(self.cfgs.iter().map(Vec::as_slice)))
    }

    /// The first `#[cfg]` attribute on a parameter, if any.
    pub(crate) fn first_cfg(&self) -> Option<&syn::Attribute> {
        self.cfgs.iter().flatten().next()
    }
}

/// Every name an (irrefutable) parameter pattern binds: `id`, `Path(id)`,
/// `Json(Req { order_no, .. })`, `Path((a, b))`, `S { field: renamed, .. }`, `ref x`, `x @ ..`.
fn pattern_bindings(pat: &Pat, names: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(pat) => {
            names.push(pat.ident.clone());
            if let Some((_, subpat)) = &pat.subpat {
                pattern_bindings(subpat, names);
            }
        }
        Pat::Tuple(pat) => pat.elems.iter().for_each(|p| pattern_bindings(p, names)),
        Pat::TupleStruct(pat) => pat.elems.iter().for_each(|p| pattern_bindings(p, names)),
        Pat::Struct(pat) => pat
            .fields
            .iter()
            .for_each(|field| pattern_bindings(&field.pat, names)),
        Pat::Slice(pat) => pat.elems.iter().for_each(|p| pattern_bindings(p, names)),
        Pat::Reference(pat) => pattern_bindings(&pat.pat, names),
        Pat::Paren(pat) => pattern_bindings(&pat.pat, names),
        Pat::Type(pat) => pattern_bindings(&pat.pat, names),
        // Every alternative binds the same names.
        Pat::Or(pat) => {
            if let Some(first) = pat.cases.first() {
                pattern_bindings(first, names);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use super::*;

    fn sig(tokens: TokenStream) -> Signature {
        syn::parse2(tokens).expect("signature")
    }

    fn names(tokens: TokenStream) -> Vec<String> {
        Bindings::of(&sig(tokens))
            .all()
            .map(|ident| ident.to_string())
            .collect()
    }

    #[test]
    fn bindings_from_patterns() {
        assert_eq!(names(quote!(async fn f(id: u64))), ["id"]);
        assert_eq!(
            names(
                quote!(async fn f(&self, Path(id): Path<u64>, Json(NewOrder { order_no, .. }): Json<NewOrder>))
            ),
            ["self", "id", "order_no"]
        );
        assert_eq!(
            names(quote!(async fn f(Path((a, b)): Path<(u32, u32)>, S { field: renamed, .. }: S))),
            ["a", "b", "renamed"]
        );
        assert_eq!(
            names(
                quote!(async fn f(ref x: u8, mut y: u8, z @ (p, _): (u8, u8), &w: &u8, [s, ..]: [u8; 2], _: u8))
            ),
            ["x", "y", "z", "p", "w", "s"]
        );
    }

    /// The errors for `item`: its parse error, or every signature problem.
    fn signature_errors(item: TokenStream) -> Vec<String> {
        let mut errors = Errors::default();
        match syn::parse2::<LockedFn>(item) {
            Ok(function) => check_signature(&function, &mut errors),
            Err(error) => errors.push(error),
        }
        match errors.finish() {
            Ok(()) => Vec::new(),
            Err(error) => error.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn signature_checks() {
        let errors = signature_errors(quote!(
            fn f() {}
        ));
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].contains("can only be used on an `async fn`"),
            "{errors:?}"
        );
        let errors = signature_errors(quote!(
            const fn f() {}
        ));
        assert!(errors[0].contains("`const fn`"), "{errors:?}");
        let errors = signature_errors(quote!(
            async fn f(&self);
        ));
        assert!(errors[0].contains("needs a function body"), "{errors:?}");
        let errors = signature_errors(quote!(
            struct S;
        ));
        assert!(
            errors[0].contains("can only be applied to an `async fn`"),
            "{errors:?}"
        );
        assert!(signature_errors(quote!(
            async fn f(id: u64) {}
        ))
        .is_empty());
    }
}
