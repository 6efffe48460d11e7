//! Return-type handling: whether the declared return type is kept (a `Result` whose error
//! absorbs a lock error) or wrapped in `Result<_, LockError>`, and the code that depends on it —
//! the rewritten signature and the unreachable `return` that fixes the body's output type.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::spanned::Spanned as _;
use syn::{ReturnType, Signature, Token, Type};

use crate::expand::local;

/// How the function's return type is handled.
pub(crate) enum Output<'a> {
    /// A `Result<T, E>` kept as written; a lock error becomes `E` through `FromLockError`.
    Result(&'a Type),
    /// Any other `T` (or `()`), rewritten to `Result<T, LockError>`. So is a `Result` that
    /// contains `impl Trait`, since its type cannot be written in the body.
    Wrapped,
}

/// How `sig`'s return type is handled.
pub(crate) fn output(sig: &Signature) -> Output<'_> {
    match &sig.output {
        ReturnType::Type(_, ty) if is_result(ty) && !contains_impl_trait(ty) => Output::Result(ty),
        _ => Output::Wrapped,
    }
}

/// A path type whose last segment is `Result`: `Result<T, E>`, `std::result::Result<T, E>`,
/// `anyhow::Result<T>`, `io::Result<T>`.
fn is_result(ty: &Type) -> bool {
    match ty {
        Type::Group(group) => is_result(&group.elem),
        Type::Paren(paren) => is_result(&paren.elem),
        Type::Path(path) => {
            path.qself.is_none()
                && path
                    .path
                    .segments
                    .last()
                    .is_some_and(|segment| segment.ident == "Result")
        }
        _ => false,
    }
}

/// Whether `impl Trait` appears anywhere in `ty`.
fn contains_impl_trait(ty: &Type) -> bool {
    erase_impl_trait(&mut ty.clone())
}

/// Replaces every `impl Trait` in `ty` with `_`; returns whether there was one.
fn erase_impl_trait(ty: &mut Type) -> bool {
    fn in_path(path: &mut syn::Path) -> bool {
        let mut erased = false;
        for segment in &mut path.segments {
            match &mut segment.arguments {
                syn::PathArguments::None => {}
                syn::PathArguments::AngleBracketed(args) => {
                    for arg in &mut args.args {
                        match arg {
                            syn::GenericArgument::Type(ty) => erased |= erase_impl_trait(ty),
                            syn::GenericArgument::AssocType(assoc) => {
                                erased |= erase_impl_trait(&mut assoc.ty);
                            }
                            _ => {}
                        }
                    }
                }
                syn::PathArguments::Parenthesized(args) => {
                    for input in &mut args.inputs {
                        erased |= erase_impl_trait(input);
                    }
                    if let ReturnType::Type(_, output) = &mut args.output {
                        erased |= erase_impl_trait(output);
                    }
                }
            }
        }
        erased
    }
    match ty {
        Type::ImplTrait(impl_trait) => {
            *ty = Type::Infer(syn::TypeInfer {
                underscore_token: Token![_](impl_trait.impl_token.span),
            });
            true
        }
        Type::Path(path) => {
            let in_qself = path
                .qself
                .as_mut()
                .is_some_and(|qself| erase_impl_trait(&mut qself.ty));
            in_path(&mut path.path) | in_qself
        }
        Type::Group(ty) => erase_impl_trait(&mut ty.elem),
        Type::Paren(ty) => erase_impl_trait(&mut ty.elem),
        Type::Reference(ty) => erase_impl_trait(&mut ty.elem),
        Type::Ptr(ty) => erase_impl_trait(&mut ty.elem),
        Type::Slice(ty) => erase_impl_trait(&mut ty.elem),
        Type::Array(ty) => erase_impl_trait(&mut ty.elem),
        Type::Tuple(ty) => ty
            .elems
            .iter_mut()
            .fold(false, |erased, elem| erase_impl_trait(elem) | erased),
        Type::TraitObject(ty) => ty.bounds.iter_mut().fold(false, |erased, bound| {
            erased
                | match bound {
                    syn::TypeParamBound::Trait(bound) => in_path(&mut bound.path),
                    _ => false,
                }
        }),
        _ => false,
    }
}

/// The type the body produces, written as it can be inside the body: the declared return type
/// with every `impl Trait` replaced by `_`. `None` for `-> impl Trait`, where nothing is left to
/// say.
fn body_output_type(sig: &Signature) -> Option<(Span, TokenStream)> {
    match &sig.output {
        ReturnType::Default => Some((sig.paren_token.span.close(), quote!(()))),
        ReturnType::Type(_, ty) => {
            let mut ty = (**ty).clone();
            erase_impl_trait(&mut ty);
            match peel_groups(&ty) {
                Type::Infer(_) => None,
                Type::Never(never) => Some((never.span(), never_type(never.span()))),
                _ => Some((ty.span(), ty.into_token_stream())),
            }
        }
    }
}

/// The first statement of the body's `async move` block: an unreachable `return` of the declared
/// type, which fixes the block's output type before the user's code is checked, as it was in the
/// original function. `?`, early `return`s and coercions (`Box::new(x)` to `Box<dyn Trait>`)
/// keep working, and type errors still point into the body. (tracing-attributes does the same.)
pub(crate) fn fake_return(sig: &Signature) -> TokenStream {
    let Some((span, ty)) = body_output_type(sig) else {
        return TokenStream::new();
    };
    let span = span.resolved_at(Span::mixed_site());
    let fake = local("__dlock_fake_return");
    quote_spanned! {span=>
        #[allow(
            unknown_lints,
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::let_with_type_underscore,
            clippy::needless_return,
            clippy::unreachable
        )]
        if false {
            let #fake: #ty = loop {};
            return #fake;
        }
    }
}

/// The declared return type when it names an `impl Trait` somewhere (`-> impl IntoResponse`,
/// `-> Result<impl Serialize, E>`): a `fallback` cannot return the same type, since every
/// function's `impl Trait` is a type of its own.
pub(crate) fn opaque_output(sig: &Signature) -> Option<&Type> {
    match &sig.output {
        ReturnType::Type(_, ty) if erase_impl_trait(&mut (**ty).clone()) => Some(ty),
        _ => None,
    }
}

/// `ty` without the invisible groups around it: a return type written through a
/// `macro_rules!` as a `$ret:ty` fragment arrives as one (`!` among them).
fn peel_groups(mut ty: &Type) -> &Type {
    while let Type::Group(group) = ty {
        ty = &group.elem;
    }
    ty
}

/// What `-> !` is written as where the never type cannot be (a type argument, a `let`'s type:
/// unstable there): `Infallible`, which a body that never returns coerces to.
fn never_type(span: Span) -> TokenStream {
    quote_spanned!(span=> ::core::convert::Infallible)
}

/// `-> T` becomes `-> Result<T, LockError>`; no return type becomes `-> Result<(), LockError>`;
/// `-> !` becomes `-> Result<Infallible, LockError>` (the lock may fail, so it returns after all).
pub(crate) fn wrap_output(sig: &Signature, private: &TokenStream) -> Signature {
    let mut sig = sig.clone();
    let (arrow, inner, span) = match &sig.output {
        ReturnType::Default => {
            let span = sig.paren_token.span.close();
            (Token![->](span), quote_spanned!(span=> ()), span)
        }
        ReturnType::Type(arrow, ty) => match peel_groups(ty) {
            Type::Never(never) => (*arrow, never_type(never.span()), never.span()),
            ty => (*arrow, ty.to_token_stream(), ty.span()),
        },
    };
    let wrapped = quote_spanned! {span=>
        ::core::result::Result<#inner, #private::LockError>
    };
    sig.output = ReturnType::Type(arrow, Box::new(Type::Verbatim(wrapped)));
    sig
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(tokens: TokenStream) -> Signature {
        syn::parse2(tokens).expect("signature")
    }

    fn result_kind(tokens: TokenStream) -> &'static str {
        match output(&sig(tokens)) {
            Output::Result(_) => "result",
            Output::Wrapped => "wrapped",
        }
    }

    #[test]
    fn return_types() {
        assert_eq!(result_kind(quote!(async fn f())), "wrapped");
        assert_eq!(result_kind(quote!(async fn f() -> u32)), "wrapped");
        assert_eq!(
            result_kind(quote!(async fn f() -> Result<u32, E>)),
            "result"
        );
        assert_eq!(
            result_kind(quote!(async fn f() -> std::result::Result<u32, E>)),
            "result"
        );
        assert_eq!(
            result_kind(quote!(async fn f() -> anyhow::Result<u32>)),
            "result"
        );
        assert_eq!(
            result_kind(quote!(async fn f() -> io::Result<()>)),
            "result"
        );
        assert_eq!(
            result_kind(quote!(async fn f() -> Option<Result<u8, E>>)),
            "wrapped"
        );
        assert_eq!(result_kind(quote!(async fn f() -> impl Display)), "wrapped");
        assert_eq!(
            result_kind(quote!(async fn f() -> Result<impl Display, E>)),
            "wrapped"
        );
        assert_eq!(
            result_kind(quote!(async fn f() -> Box<dyn Fn() -> impl Sized>)),
            "wrapped"
        );
    }

    #[test]
    fn impl_trait_return_is_not_named() {
        let private = quote!(::dlock_runtime::__private);
        let f = sig(quote!(async fn f() -> impl Display));
        let wrapped = wrap_output(&f, &private).to_token_stream().to_string();
        assert!(wrapped.contains("-> :: core :: result :: Result < impl Display , :: dlock_runtime :: __private :: LockError >"), "{wrapped}");
        assert!(fake_return(&f).is_empty(), "{}", fake_return(&f));
        let f = sig(quote!(async fn f() -> Box<dyn Iterator<Item = impl Display>>));
        let fake = fake_return(&f).to_string();
        assert!(
            fake.contains("let __dlock_fake_return : Box < dyn Iterator < Item = _ > > = loop"),
            "{fake}"
        );
    }

    #[test]
    fn fake_return_of_each_output() {
        let fake = fake_return(&sig(quote!(async fn f()))).to_string();
        assert!(
            fake.contains("if false { let __dlock_fake_return : () = loop { } ; return __dlock_fake_return ; }"),
            "{fake}"
        );
        let fake = fake_return(&sig(quote!(async fn f() -> Result<u32, AppError>))).to_string();
        assert!(
            fake.contains("let __dlock_fake_return : Result < u32 , AppError > = loop { } ;"),
            "{fake}"
        );
    }
}
