//! Code generation: the locked function.
//!
//! The user's signature is kept token for token (so spans stay right), except that a return type
//! that is not a `Result` is wrapped in `Result<_, LockError>`. The body becomes
//!
//! ```text
//! {
//!     #![inner attributes of the original body]
//!     let __dlock_key = { let mut __dlock_kb = KeyBuilder::new(); …lit/value calls…; __dlock_kb.finish() };
//!     let __dlock_locker = default_locker();  // or Ok({ use IntoLocker as _; (&(expr)).into_locker() })
//!     let __dlock_spec = Spec::new(ttl).retry(wait)…;
//!     let __dlock_body = async move {
//!         if false { let __dlock_fake_return: Ret = loop {}; return __dlock_fake_return; }
//!         { original body }
//!     };
//!     match run(__dlock_locker, __dlock_key, __dlock_spec, __dlock_body).await {
//!         Ok(out) => out,
//!         Err(err) => <Ret as FromLockError>::from_lock_error(err),
//!     }                                                 // or just `run(..).await`
//! }
//! ```
//!
//! The key and the locker are evaluated before the body future is created, because the
//! `async move` block takes ownership of the arguments. Nothing but the `run` future is held
//! across the `.await`, and no `Send` bound is added: the function's future is `Send` exactly
//! when the original body's is.

use proc_macro2::{Delimiter, Group, Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::ext::IdentExt as _;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned as _;
use syn::{Attribute, FnArg, Ident, Pat, ReturnType, Signature, Token, Type, Visibility};

use crate::attr::{Args, OnFail, OnLost};
use crate::errors::Errors;
use crate::key_template::{Field, Placeholder, Segment};

/// Expands `#[distributed_lock(args)] item`.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let function: LockedFn = syn::parse2(item)?;
    let mut errors = Errors::default();
    let args = Args::parse(args, &mut errors);
    let args = errors.ok(args).flatten();
    check_signature(&function, &mut errors);
    let bindings = Bindings::of(&function.sig);
    let key = args
        .as_ref()
        .map(|args| key_statements(args, &function.sig, &bindings, &mut errors));
    errors.finish()?;

    let (Some(args), Some(key), Some(body)) = (args, key, function.body.as_ref()) else {
        // Unreachable: each missing piece recorded an error above.
        return Err(syn::Error::new(
            Span::call_site(),
            "invalid #[distributed_lock]",
        ));
    };
    Ok(expand_locked(&function, body, &args, &key, &bindings))
}

/// An `async fn` as written: free fn, method, or trait method (with or without a body).
pub(crate) struct LockedFn {
    attrs: Vec<Attribute>,
    vis: Visibility,
    sig: Signature,
    /// `None` for a declaration ending in `;`.
    body: Option<Body>,
}

/// The body of the function, kept as tokens so that a body that does not parse yet (while the
/// user is typing) still expands, and IDEs keep working.
pub(crate) struct Body {
    brace_span: Span,
    inner_attrs: Vec<Attribute>,
    stmts: TokenStream,
}

impl Body {
    /// `{ stmts }` with the original braces' span.
    fn block(&self) -> Group {
        let mut block = Group::new(Delimiter::Brace, self.stmts.clone());
        block.set_span(self.brace_span);
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

fn check_signature(function: &LockedFn, errors: &mut Errors) {
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
             used on a trait method declaration without one (put it on the implementations)",
        );
    }
}

/// The names a key placeholder can refer to.
pub(crate) struct Bindings {
    /// The `self` token of a method's receiver.
    receiver: Option<Ident>,
    /// Plain parameters and every name bound inside parameter patterns, in order.
    names: Vec<Ident>,
}

impl Bindings {
    fn of(sig: &Signature) -> Self {
        let mut bindings = Bindings {
            receiver: None,
            names: Vec::new(),
        };
        for input in &sig.inputs {
            match input {
                FnArg::Receiver(receiver) => {
                    bindings.receiver = Some(Ident::from(receiver.self_token));
                }
                FnArg::Typed(typed) => pattern_bindings(&typed.pat, &mut bindings.names),
            }
        }
        bindings
    }

    /// `self` (when a method), then every named binding.
    fn all(&self) -> impl Iterator<Item = &Ident> {
        self.receiver.iter().chain(&self.names)
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

/// The statements that feed the key builder `__dlock_kb`, one per template segment.
fn key_statements(
    args: &Args,
    sig: &Signature,
    bindings: &Bindings,
    errors: &mut Errors,
) -> TokenStream {
    let lit_span = args.key.lit.span();
    // User names resolve as if written in the function; our own tokens carry the macro's
    // hygiene (so lints aimed at hand-written code stay quiet) but point at the key literal.
    let user = lit_span.resolved_at(Span::call_site());
    let ours = lit_span.resolved_at(Span::mixed_site());
    let private = private_path(args);
    let builder = local("__dlock_kb");

    let mut stmts = TokenStream::new();
    for segment in &args.key.template.segments {
        match segment {
            Segment::Lit(text) => {
                let text = syn::LitStr::new(text, ours);
                stmts.extend(quote_spanned!(ours=> #builder.lit(#text);));
            }
            Segment::Value(placeholder) => {
                match placeholder_expr(placeholder, sig, bindings, user, lit_span) {
                    Ok(value) => stmts.extend(quote_spanned!(ours=> #builder.value(&#value);)),
                    Err(error) => errors.push(error),
                }
            }
        }
    }
    quote! {
        let mut #builder = #private::KeyBuilder::new();
        #stmts
        #builder.finish()
    }
}

/// `root.field.0` for `<root.field.0>`, with every token spanned on the key literal.
fn placeholder_expr(
    placeholder: &Placeholder,
    sig: &Signature,
    bindings: &Bindings,
    span: Span,
    lit_span: Span,
) -> syn::Result<TokenStream> {
    let root = if placeholder.root == "self" {
        if bindings.receiver.is_none() {
            return Err(syn::Error::new(
                lit_span,
                format_args!(
                    "placeholder `{placeholder}` uses `self`, but `{}` has no `self` parameter",
                    sig.ident
                ),
            ));
        }
        Ident::new("self", span)
    } else {
        let Some(binding) = bindings
            .names
            .iter()
            .find(|name| name.unraw() == placeholder.root)
        else {
            return Err(unknown_placeholder(placeholder, sig, bindings, lit_span));
        };
        let mut root = binding.clone();
        root.set_span(span);
        root
    };

    let mut expr = root.into_token_stream();
    for field in &placeholder.fields {
        match field {
            Field::Named(name) => {
                let field = field_ident(name, span).ok_or_else(|| {
                    syn::Error::new(
                        lit_span,
                        format_args!("`{name}` in `{placeholder}` cannot be used as a field name"),
                    )
                })?;
                expr.extend(quote_spanned!(span=> .#field));
            }
            Field::Index(index) => {
                let index = syn::Index {
                    index: *index,
                    span,
                };
                expr.extend(quote_spanned!(span=> .#index));
            }
        }
    }
    Ok(expr)
}

fn unknown_placeholder(
    placeholder: &Placeholder,
    sig: &Signature,
    bindings: &Bindings,
    lit_span: Span,
) -> syn::Error {
    let available: Vec<String> = bindings
        .all()
        .map(|ident| format!("`{}`", ident.unraw()))
        .collect();
    let available = if available.is_empty() {
        format!(
            "`{}` has no parameters, so its key can only be literal text",
            sig.ident
        )
    } else {
        format!("the names available are {}", available.join(", "))
    };
    syn::Error::new(
        lit_span,
        format_args!(
            "unknown placeholder `{placeholder}` in the key: `{}` is neither a parameter of `{}` \
             nor a name bound by a parameter pattern; {available}",
            placeholder.root, sig.ident,
        ),
    )
}

/// A field name as an identifier, raw (`r#type`) when it is a keyword.
fn field_ident(name: &str, span: Span) -> Option<Ident> {
    let parsed = syn::parse::Parser::parse_str(Ident::parse_any, name).ok()?;
    if syn::parse_str::<Ident>(name).is_ok() {
        let mut ident = parsed;
        ident.set_span(span);
        Some(ident)
    } else if matches!(name, "self" | "Self" | "super" | "crate" | "_") {
        None
    } else {
        Some(Ident::new_raw(name, span))
    }
}

/// A local variable of the generated code: `__dlock_`-prefixed and, with mixed-site hygiene,
/// invisible to the user's body.
fn local(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

/// `::dlock_runtime::__private`, or `<crate>::__private`.
fn private_path(args: &Args) -> TokenStream {
    match &args.krate {
        Some(krate) => quote!(#krate::__private),
        None => quote!(::dlock_runtime::__private),
    }
}

/// `Duration::new(secs, nanos)`: exact for every duration humantime parses.
fn duration(private: &TokenStream, duration: std::time::Duration) -> TokenStream {
    let secs = duration.as_secs();
    let nanos = duration.subsec_nanos();
    quote!(#private::Duration::new(#secs, #nanos))
}

/// How the function's return type is handled.
enum Output<'a> {
    /// A `Result<T, E>` kept as written; a lock error becomes `E` through `FromLockError`.
    Result(&'a Type),
    /// Any other `T` (or `()`), rewritten to `Result<T, LockError>`. So is a `Result` that
    /// contains `impl Trait`, since its type cannot be written in the body.
    Wrapped,
}

fn output(sig: &Signature) -> Output<'_> {
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
            match ty {
                Type::Infer(_) => None,
                ty => Some((ty.span(), ty.into_token_stream())),
            }
        }
    }
}

/// The first statement of the body's `async move` block: an unreachable `return` of the declared
/// type, which fixes the block's output type before the user's code is checked, as it was in the
/// original function. `?`, early `return`s and coercions (`Box::new(x)` to `Box<dyn Trait>`)
/// keep working, and type errors still point into the body. (tracing-attributes does the same.)
fn fake_return(sig: &Signature) -> TokenStream {
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

fn expand_locked(
    function: &LockedFn,
    body: &Body,
    args: &Args,
    key: &TokenStream,
    bindings: &Bindings,
) -> TokenStream {
    let LockedFn {
        attrs, vis, sig, ..
    } = function;
    let private = private_path(args);
    let key_var = local("__dlock_key");
    let locker_var = local("__dlock_locker");
    let spec_var = local("__dlock_spec");
    let body_var = local("__dlock_body");
    let out_var = local("__dlock_out");
    let err_var = local("__dlock_err");

    let locker = match &args.locker {
        // `&(expr)` plus method-call autoderef accepts both a `Locker` and a `&Locker` with the
        // runtime's impls for `Locker` and `&Locker`, and never moves out of the expression
        // (often a field of an argument that the body still needs).
        Some(expr) => {
            let span = expr.span().resolved_at(Span::mixed_site());
            quote_spanned! {span=>
                ::core::result::Result::Ok({
                    use #private::IntoLocker as _;
                    (&(#expr)).into_locker()
                })
            }
        }
        None => quote!(#private::default_locker()),
    };

    let mut spec = quote!(#private::Spec::new);
    let ttl = duration(&private, args.ttl);
    spec.extend(quote!((#ttl)));
    if let OnFail::Retry { wait } = args.on_fail {
        let wait = duration(&private, wait);
        spec.extend(quote!(.retry(#wait)));
    }
    let (run_fn, defer_checks) = match &args.on_fail {
        OnFail::Defer(defer) => {
            let delay = duration(&private, defer.delay.unwrap_or(defer::DEFAULT_DELAY));
            let max_attempts = defer.max_attempts.unwrap_or(defer::DEFAULT_MAX_ATTEMPTS);
            spec.extend(quote!(.defer(#delay, #max_attempts)));
            (quote!(run_deferrable), defer::checks(bindings))
        }
        _ => (quote!(run), TokenStream::new()),
    };
    if args.on_lost == OnLost::Cancel {
        spec.extend(quote!(.cancel_on_lost()));
    }
    if let Some(message) = &args.message {
        spec.extend(quote!(.message(#message)));
    }

    let block = body.block();
    let fake_return = fake_return(sig);
    let body_future = quote! {
        async move {
            #fake_return
            #block
        }
    };

    let run = quote! {
        #private::#run_fn(#locker_var, #key_var, #spec_var, #body_var).await
    };
    let (sig, tail) = match output(sig) {
        Output::Result(ty) => {
            let span = ty.span().resolved_at(Span::mixed_site());
            let convert = quote_spanned! {span=>
                <#ty as #private::FromLockError>::from_lock_error(#err_var)
            };
            let tail = quote! {
                match #run {
                    ::core::result::Result::Ok(#out_var) => #out_var,
                    ::core::result::Result::Err(#err_var) => #convert,
                }
            };
            (sig.clone(), tail)
        }
        Output::Wrapped => (wrap_output(sig, &private), run),
    };

    let inner_attrs = &body.inner_attrs;
    quote! {
        #(#attrs)*
        #vis #sig {
            #(#inner_attrs)*
            #defer_checks
            let #key_var = { #key };
            let #locker_var = #locker;
            let #spec_var = #spec;
            let #body_var = #body_future;
            #tail
        }
    }
}

/// `-> T` becomes `-> Result<T, LockError>`; no return type becomes `-> Result<(), LockError>`.
fn wrap_output(sig: &Signature, private: &TokenStream) -> Signature {
    let mut sig = sig.clone();
    let (arrow, inner, span) = match &sig.output {
        ReturnType::Default => {
            let span = sig.paren_token.span.close();
            (Token![->](span), quote_spanned!(span=> ()), span)
        }
        ReturnType::Type(arrow, ty) => (*arrow, ty.to_token_stream(), ty.span()),
    };
    let wrapped = quote_spanned! {span=>
        ::core::result::Result<#inner, #private::LockError>
    };
    sig.output = ReturnType::Type(arrow, Box::new(Type::Verbatim(wrapped)));
    sig
}

/// `on_fail = "defer"`: the body goes to the runtime's in-process delay queue when the lock is
/// busy (`__private::run_deferrable`), so it runs later on another task. Every argument must
/// therefore be `Send + 'static`; each gets a check spanned on it.
mod defer {
    use super::*;

    /// `delay` when the attribute gives none (the runtime's `DeferPolicy` default).
    pub(super) const DEFAULT_DELAY: std::time::Duration = std::time::Duration::from_secs(1);
    /// `max_attempts` when the attribute gives none (the runtime's `DeferPolicy` default).
    pub(super) const DEFAULT_MAX_ATTEMPTS: u32 = 5;

    pub(super) fn checks(bindings: &Bindings) -> TokenStream {
        // Named for the diagnostic: "required by a bound in `__dlock_defer_arg_must_be_…`".
        let assert = local("__dlock_defer_arg_must_be_send_and_static");
        let checks = bindings.all().map(|binding| {
            // The whole call sits on the argument, so both the `Send` error and the borrow
            // checker's "escapes the function body here" point at it.
            let span = binding.span().resolved_at(Span::mixed_site());
            let assert = Ident::new(&assert.to_string(), span);
            quote_spanned!(span=> #assert(&#binding);)
        });
        quote! {
            #[allow(dead_code)]
            fn #assert<T: ::core::marker::Send + 'static>(_: &T) {}
            #(#checks)*
        }
    }
}

#[cfg(test)]
mod tests {
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
    fn field_idents() {
        assert_eq!(
            field_ident("order_no", Span::call_site())
                .map(|i| i.to_string())
                .as_deref(),
            Some("order_no")
        );
        assert_eq!(
            field_ident("type", Span::call_site())
                .map(|i| i.to_string())
                .as_deref(),
            Some("r#type")
        );
        assert!(field_ident("self", Span::call_site()).is_none());
    }

    fn expand_str(args: TokenStream, item: TokenStream) -> String {
        match expand(args, item) {
            Ok(tokens) => tokens.to_string(),
            Err(error) => panic!("{error}"),
        }
    }

    fn expand_errors(args: TokenStream, item: TokenStream) -> Vec<String> {
        match expand(args, item) {
            Ok(tokens) => panic!("expected errors, got {tokens}"),
            Err(error) => error.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn expands_result_function() {
        let out = expand_str(
            quote!(
                key = "order:<id>",
                ttl = "1500ms",
                on_fail = "retry",
                wait = "5s",
                on_lost = "cancel",
                message = "busy"
            ),
            quote!(
                async fn pay(Path(id): Path<u64>) -> Result<u32, AppError> {
                    Ok(id)
                }
            ),
        );
        for expected in [
            "async fn pay (Path (id) : Path < u64 >) -> Result < u32 , AppError >",
            "__dlock_kb . lit (\"order:\") ;",
            "__dlock_kb . value (& id) ;",
            ":: dlock_runtime :: __private :: default_locker ()",
            "Spec :: new (:: dlock_runtime :: __private :: Duration :: new (1u64 , 500000000u32))",
            ". retry (:: dlock_runtime :: __private :: Duration :: new (5u64 , 0u32))",
            ". cancel_on_lost () . message (\"busy\")",
            "let __dlock_body = async move { # [allow (",
            "if false { let __dlock_fake_return : Result < u32 , AppError > = loop { } ; return __dlock_fake_return ; } { Ok (id) } } ;",
            "< Result < u32 , AppError > as :: dlock_runtime :: __private :: FromLockError > :: from_lock_error (__dlock_err)",
        ] {
            assert!(out.contains(expected), "missing `{expected}` in\n{out}");
        }
    }

    #[test]
    fn expands_wrapped_function() {
        let out = expand_str(
            quote!(
                key = "job:<self.tenant>:<n.0>",
                locker = &self.locker,
                crate = "my::dlock"
            ),
            quote!(
                pub async fn job(&self, n: (u8,)) {
                    work().await;
                }
            ),
        );
        for expected in [
            "pub async fn job (& self , n : (u8 ,)) -> :: core :: result :: Result < () , my :: dlock :: __private :: LockError >",
            "__dlock_kb . value (& self . tenant) ;",
            "__dlock_kb . value (& n . 0) ;",
            "use my :: dlock :: __private :: IntoLocker as _ ; (& (& self . locker)) . into_locker ()",
            "let __dlock_fake_return : () = loop { } ;",
        ] {
            assert!(out.contains(expected), "missing `{expected}` in\n{out}");
        }
        assert!(!out.contains("from_lock_error"), "{out}");
    }

    #[test]
    fn impl_trait_return_is_not_named() {
        let out = expand_str(
            quote!(key = "a"),
            quote!(
                async fn f() -> impl Display {
                    1
                }
            ),
        );
        assert!(out.contains("-> :: core :: result :: Result < impl Display , :: dlock_runtime :: __private :: LockError >"), "{out}");
        assert!(
            out.contains("let __dlock_body = async move { { 1 } } ;"),
            "{out}"
        );
        let out = expand_str(
            quote!(key = "a"),
            quote!(
                async fn f() -> Box<dyn Iterator<Item = impl Display>> {
                    1
                }
            ),
        );
        assert!(
            out.contains("let __dlock_fake_return : Box < dyn Iterator < Item = _ > > = loop"),
            "{out}"
        );
    }

    #[test]
    fn inner_attributes_move_to_the_function_body() {
        let out = expand_str(
            quote!(key = "a"),
            quote!(
                async fn f() {
                    #![allow(unused)]
                    let x = 1;
                }
            ),
        );
        assert!(
            out.contains("{ # ! [allow (unused)] let __dlock_key"),
            "{out}"
        );
        assert!(out.contains("} { let x = 1 ; } } ;"), "{out}");
    }

    #[test]
    fn signature_errors() {
        let errors = expand_errors(
            quote!(key = "a"),
            quote!(
                fn f() {}
            ),
        );
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].contains("can only be used on an `async fn`"),
            "{errors:?}"
        );
        let errors = expand_errors(
            quote!(key = "a"),
            quote!(
                const fn f() {}
            ),
        );
        assert!(errors[0].contains("`const fn`"), "{errors:?}");
        let errors = expand_errors(
            quote!(key = "a"),
            quote!(
                async fn f(&self);
            ),
        );
        assert!(errors[0].contains("needs a function body"), "{errors:?}");
        let errors = expand_errors(
            quote!(key = "a"),
            quote!(
                struct S;
            ),
        );
        assert!(
            errors[0].contains("can only be applied to an `async fn`"),
            "{errors:?}"
        );
    }

    #[test]
    fn unknown_placeholders() {
        let errors = expand_errors(
            quote!(key = "a:<idd>:<self.x>"),
            quote!(
                async fn f(id: u64, Path(other): Path<u8>) {}
            ),
        );
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors[0].starts_with("unknown placeholder `<idd>`"),
            "{errors:?}"
        );
        assert!(
            errors[0].contains("the names available are `id`, `other`"),
            "{errors:?}"
        );
        assert!(
            errors[1].contains("`f` has no `self` parameter"),
            "{errors:?}"
        );
        let errors = expand_errors(
            quote!(key = "a:<id>"),
            quote!(
                async fn f() {}
            ),
        );
        assert!(errors[0].contains("`f` has no parameters"), "{errors:?}");
    }

    #[test]
    fn all_errors_together() {
        let errors = expand_errors(
            quote!(key = "a:<nope>", ttl = "0s"),
            quote!(
                fn f(id: u64) {}
            ),
        );
        assert_eq!(errors.len(), 3, "{errors:?}");
    }

    #[test]
    fn defer_checks_arguments() {
        let out = expand_str(
            quote!(
                key = "a:<id>",
                on_fail = "defer",
                delay = "1s",
                max_attempts = 3
            ),
            quote!(
                async fn f(&self, id: u64, Path(p): Path<u8>) -> u8 {
                    1
                }
            ),
        );
        assert!(
            out.contains("__dlock_defer_arg_must_be_send_and_static (& self) ;"),
            "{out}"
        );
        assert!(
            out.contains("__dlock_defer_arg_must_be_send_and_static (& id) ;"),
            "{out}"
        );
        assert!(
            out.contains("__dlock_defer_arg_must_be_send_and_static (& p) ;"),
            "{out}"
        );
        assert!(out.contains("run_deferrable (__dlock_locker"), "{out}");
        assert!(out.contains(". defer ("), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
    }
}
