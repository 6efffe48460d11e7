//! Code generation: the locked function, from the parsed arguments ([`crate::attr`]), the
//! function model ([`crate::function`]) and its return-type handling ([`crate::output`]).
//!
//! The user's signature is kept token for token (so spans stay right), except that a return type
//! that is not a `Result` is wrapped in `Result<_, LockError>`. The body becomes
//!
//! ```text
//! {
//!     #![inner attributes of the original body]
//!     let __dlock_key = { let mut __dlock_kb = KeyBuilder::new(); …lit/value calls…; __dlock_kb.finish() };
//!     let __dlock_locker = default_locker();  // or Ok({ use IntoLocker as _; (&(expr)).into_locker() })
//!     let __dlock_spec = Spec::new(ttl).name("<key template>").retry(wait)…;
//!     let __dlock_body = ::core::pin::pin!(async move {   // by value with on_fail = "defer"
//!         if false { let __dlock_fake_return: Ret = loop {}; return __dlock_fake_return; }
//!         { original body }
//!     });
//!     match run(__dlock_locker, __dlock_key, __dlock_spec, __dlock_body).await {
//!         Ok(out) => out,
//!         Err(err) => <Ret as FromLockError>::from_lock_error(err),
//!     }                                                 // or just `run(..).await`
//! }
//! ```
//!
//! The key and the locker are evaluated before the body future is created, because the
//! `async move` block takes ownership of the arguments. The body is pinned where it is made and
//! the runtime polls it through `Pin<&mut _>`, so its state is kept once (see `expand`). Nothing
//! but the body and the `run` future is held across the `.await`, and no `Send` bound is added: the function's future is `Send` exactly
//! when the original body's is and its output is too (the output is kept across the release's
//! `.await`).

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::ext::IdentExt as _;
use syn::spanned::Spanned as _;
use syn::{Ident, Signature};

use crate::attr::{Args, Key, Kind, OnFail, OnLost};
use crate::errors::Errors;
use crate::function::{check_signature, Bindings, Body, LockedFn};
use crate::key_template::{Field, Placeholder, Segment};
use crate::output::{fake_return, opaque_output, output, wrap_output, Output};

/// Expands `#[distributed_lock(args)] item`.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let function: LockedFn = syn::parse2(item)?;
    let mut errors = Errors::default();
    let args = Args::parse(args, &mut errors);
    let args = errors.ok(args).flatten();
    check_signature(&function, &mut errors);
    let bindings = Bindings::of(&function.sig);
    if let (Some(args), Some(cfg)) = (&args, bindings.first_cfg()) {
        if args.fallback.is_some() {
            errors.push(syn::Error::new_spanned(
                cfg,
                "`fallback` cannot be used with a `#[cfg]` parameter: the fallback is called \
                 with every parameter, and which ones exist would depend on the configuration",
            ));
        }
    }
    if let (Some(args), Some(opaque)) = (&args, opaque_output(&function.sig)) {
        if args.fallback.is_some() {
            errors.push(syn::Error::new_spanned(
                opaque,
                "with `fallback`, name the return type instead of an `impl Trait` (e.g. \
                 `axum::response::Response`, and `.into_response()` in the body): the body \
                 and the fallback must return the same type, and each function's \
                 `impl Trait` is a type of its own",
            ));
        }
    }
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

/// The key expression: one key builder's statements, or for a multi-key lock an array of
/// them (`[{ … }, { … }]`).
fn key_statements(
    args: &Args,
    sig: &Signature,
    bindings: &Bindings,
    errors: &mut Errors,
) -> TokenStream {
    let mut blocks = args
        .keys
        .list
        .iter()
        .map(|key| one_key(key, args, sig, bindings, errors))
        .collect::<Vec<_>>();
    if args.keys.multi {
        quote!([#({ #blocks }),*])
    } else {
        blocks.pop().unwrap_or_default()
    }
}

/// The statements that feed the key builder `__dlock_kb`, one per template segment.
fn one_key(
    key: &Key,
    args: &Args,
    sig: &Signature,
    bindings: &Bindings,
    errors: &mut Errors,
) -> TokenStream {
    let lit_span = key.lit.span();
    // User names resolve as if written in the function; our own tokens carry the macro's
    // hygiene (so lints aimed at hand-written code stay quiet) but point at the key literal.
    let user = lit_span.resolved_at(Span::call_site());
    let ours = lit_span.resolved_at(Span::mixed_site());
    let private = private_path(args);
    let builder = local("__dlock_kb");

    let mut stmts = TokenStream::new();
    for segment in &key.template.segments {
        match segment {
            Segment::Lit(text) => {
                let text = syn::LitStr::new(text, ours);
                stmts.extend(
                    quote_spanned!(ours=> #private::KeyBuilder::lit(&mut #builder, #text);),
                );
            }
            Segment::Value(placeholder) => {
                match placeholder_expr(placeholder, sig, bindings, user, lit_span) {
                    Ok(value) => stmts.extend(
                        quote_spanned!(ours=> #private::KeyBuilder::value(&mut #builder, &#value);),
                    ),
                    Err(error) => errors.push(error),
                }
            }
        }
    }
    quote! {
        let mut #builder = #private::KeyBuilder::new();
        #stmts
        #private::KeyBuilder::finish(&mut #builder)
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
        // The receiver's own token (its hygiene: the function may come out of a
        // `macro_rules!`), shown at the key literal.
        let mut receiver = bindings
            .receiver
            .clone()
            .unwrap_or_else(|| Ident::new("self", span));
        receiver.set_span(receiver.span().located_at(span));
        receiver
    } else {
        let Some(binding) = bindings
            .names
            .iter()
            .find(|name| name.unraw() == placeholder.root)
        else {
            return Err(unknown_placeholder(placeholder, sig, bindings, lit_span));
        };
        // The parameter's own hygiene, not the attribute's: through a `macro_rules!` that
        // forwards the function, the attribute's call site cannot see the parameters.
        let mut root = binding.clone();
        root.set_span(binding.span().located_at(span));
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
pub(crate) fn local(name: &str) -> Ident {
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

/// The locked function: `function` with `body` run under the lock that `args` describe.
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
        // `&(expr)` plus method-call autoderef accepts a `Locker`, a `&Locker` and a smart
        // pointer to one (`Arc<Locker>`) with the runtime's impls for `&Locker` and `&&Locker`,
        // and never moves out of the expression (often a field of an argument that the body
        // still needs).
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
    // The key template is the lock's bounded name in metrics and traces.
    // A key list is named by its templates joined with ` + ` (`account:<from> + account:<to>`).
    let name = match args.keys.list.as_slice() {
        [one] => one.lit.clone(),
        list => syn::LitStr::new(
            &list
                .iter()
                .map(|k| k.lit.value())
                .collect::<Vec<_>>()
                .join(" + "),
            list.first().map_or_else(Span::call_site, |k| k.lit.span()),
        ),
    };
    spec.extend(quote!((#ttl).name(#name)));
    if let OnFail::Retry {
        wait,
        through_outages,
    } = args.on_fail
    {
        let wait = duration(&private, wait);
        spec.extend(quote!(.retry(#wait)));
        if through_outages {
            spec.extend(quote!(.through_outages()));
        }
    }
    let deferrable = matches!(args.on_fail, OnFail::Defer(_));
    let (run_fn, defer_checks) = match &args.on_fail {
        OnFail::Defer(defer) => {
            // Spelled out even when not given: the runtime's `DeferPolicy` default is the same
            // `dlock_limits` value.
            let delay = duration(
                &private,
                defer.delay.unwrap_or(dlock_limits::DEFAULT_DEFER_DELAY),
            );
            let max_attempts = defer
                .max_attempts
                .unwrap_or(dlock_limits::DEFAULT_DEFER_MAX_ATTEMPTS);
            spec.extend(quote!(.defer(#delay, #max_attempts)));
            (quote!(#private::run_deferrable), defer::checks(bindings))
        }
        _ if args.keys.multi => (quote!(#private::run_all), TokenStream::new()),
        _ => (quote!(#private::run), TokenStream::new()),
    };
    if let Some(hold) = args.hold_at_least {
        let hold = duration(&private, hold);
        spec.extend(quote!(.hold_at_least(#hold)));
    }
    if args.on_lost == OnLost::Cancel {
        spec.extend(quote!(.cancel_on_lost()));
    }
    if let Some(message) = &args.message {
        spec.extend(quote!(.message(#message)));
    }
    match args.kind {
        Kind::Lock => {}
        Kind::Semaphore(permits) => spec.extend(quote!(.permits(#permits))),
        Kind::Read => spec.extend(quote!(.read())),
        Kind::Write => spec.extend(quote!(.write())),
    }

    let block = body.block();
    let fake_return = fake_return(sig);
    let body_future = quote! {
        async move {
            #fake_return
            #block
        }
    };
    // Pinned where it is made, and the runtime given `Pin<&mut _>`: the body's state is kept
    // once, in this function's future. Given by value, every async layer it passes through
    // (`run`, `run_held`, the task-local scope) kept a copy of its own — about five times the
    // body per locked call, so that three nested locked calls made a half-megabyte future and
    // overflowed a debug build's 2 MiB stack. A deferred body goes to the queue by value.
    let body_future = if deferrable {
        body_future
    } else {
        quote!(::core::pin::pin!(#body_future))
    };

    let held_var = local("__dlock_held");
    let mut run = if args.fallback.is_some() {
        // The lock is taken before the body (which takes the arguments) exists, so that the
        // fallback can have them when it is not.
        quote!(#private::run_held(#held_var, #body_var).await)
    } else {
        quote!(#run_fn(#locker_var, #key_var, #spec_var, #body_var).await)
    };
    if matches!(args.on_fail, OnFail::Skip) {
        // A held lock becomes the return type's "nothing done" value; the bound that requires
        // one is reported on the return type.
        let span = match &sig.output {
            syn::ReturnType::Type(_, ty) => ty.span(),
            syn::ReturnType::Default => sig.ident.span(),
        }
        .resolved_at(Span::mixed_site());
        let skip = respan(quote!(#private::skip_held), span);
        run = quote!(#skip(#run));
    }
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
    let tail = match &args.fallback {
        None => quote! {
            let #body_var = #body_future;
            #tail
        },
        Some(path) => {
            let keys = if args.keys.multi {
                quote!(#key_var)
            } else {
                quote!([#key_var])
            };
            let call = fallback::call(path, bindings, &err_var, output(&function.sig));
            quote! {
                match #private::take(#locker_var, #keys, #spec_var).await {
                    ::core::result::Result::Ok(#held_var) => {
                        let #body_var = #body_future;
                        #tail
                    }
                    ::core::result::Result::Err(#err_var) => #call,
                }
            }
        }
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
            #tail
        }
    }
}

/// `tokens` with every token spanned on `span` (so a diagnostic about them points there).
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut tree| {
            if let proc_macro2::TokenTree::Group(group) = &tree {
                let mut inner =
                    proc_macro2::Group::new(group.delimiter(), respan(group.stream(), span));
                inner.set_span(span);
                tree = proc_macro2::TokenTree::Group(inner);
            } else {
                tree.set_span(span);
            }
            tree
        })
        .collect()
}

/// `fallback = path`: when the lock is not acquired, `path(<bindings>, err).await` answers
/// instead — with every name the parameters bind (`self` first), by value, then the
/// `LockError`. It returns the function's return type as written (for a non-`Result` `T`,
/// that `T`, wrapped in `Ok`). Spanned on the path, so an arity or type mismatch points there.
mod fallback {
    use super::*;

    pub(super) fn call(
        path: &syn::Path,
        bindings: &Bindings,
        err_var: &Ident,
        output: Output<'_>,
    ) -> TokenStream {
        let span = path.span();
        let args = bindings.all();
        let call = quote_spanned!(span=> #path(#(#args,)* #err_var).await);
        match output {
            Output::Result(_) => call,
            Output::Wrapped => quote!(::core::result::Result::Ok(#call)),
        }
    }
}

/// `on_fail = "defer"`: the body goes to the runtime's in-process delay queue when the lock is
/// busy (`__private::run_deferrable`), so it runs later on another task. Every argument must
/// therefore be `Send + 'static`; each gets a check spanned on it.
mod defer {
    use super::*;

    pub(super) fn checks(bindings: &Bindings) -> TokenStream {
        // Named for the diagnostic: "required by a bound in `__dlock_defer_arg_must_be_…`".
        let assert = local("__dlock_defer_arg_must_be_send_and_static");
        let checks = bindings.all_with_cfg().map(|(binding, cfg)| {
            // The whole call sits on the argument, so both the `Send` error and the borrow
            // checker's "escapes the function body here" point at it. A parameter under
            // `#[cfg]` is checked under the same `cfg`.
            let span = binding.span().resolved_at(Span::mixed_site());
            let assert = Ident::new(&assert.to_string(), span);
            quote_spanned!(span=> #(#cfg)* #assert(&#binding);)
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
            ":: dlock_runtime :: __private :: KeyBuilder :: lit (& mut __dlock_kb , \"order:\") ;",
            ":: dlock_runtime :: __private :: KeyBuilder :: value (& mut __dlock_kb , & id) ;",
            ":: dlock_runtime :: __private :: default_locker ()",
            "Spec :: new (:: dlock_runtime :: __private :: Duration :: new (1u64 , 500000000u32))",
            ". retry (:: dlock_runtime :: __private :: Duration :: new (5u64 , 0u32))",
            ". cancel_on_lost () . message (\"busy\")",
            "let __dlock_body = :: core :: pin :: pin ! (async move { # [allow (",
            "if false { let __dlock_fake_return : Result < u32 , AppError > = loop { } ; return __dlock_fake_return ; } { Ok (id) } }) ;",
            "< Result < u32 , AppError > as :: dlock_runtime :: __private :: FromLockError > :: from_lock_error (__dlock_err)",
        ] {
            assert!(out.contains(expected), "missing `{expected}` in\n{out}");
        }
        assert!(!out.contains("through_outages"), "{out}");
    }

    #[test]
    fn expands_through_outages_after_the_retry() {
        let out = expand_str(
            quote!(key = "a", on_fail = "retry", through_outages = true),
            quote!(
                async fn f() {}
            ),
        );
        let expected = ". retry (:: dlock_runtime :: __private :: Duration :: new (10u64 , 0u32)) \
                        . through_outages ()";
        assert!(out.contains(expected), "missing `{expected}` in\n{out}");
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
            "KeyBuilder :: value (& mut __dlock_kb , & self . tenant) ;",
            "KeyBuilder :: value (& mut __dlock_kb , & n . 0) ;",
            "use my :: dlock :: __private :: IntoLocker as _ ; (& (& self . locker)) . into_locker ()",
            "let __dlock_fake_return : () = loop { } ;",
        ] {
            assert!(out.contains(expected), "missing `{expected}` in\n{out}");
        }
        assert!(!out.contains("from_lock_error"), "{out}");
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
        assert!(out.contains("} { let x = 1 ; } }) ;"), "{out}");
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

    /// Without `delay` and `max_attempts`, the expansion spells out the runtime's
    /// `DeferPolicy` defaults.
    #[test]
    fn defer_defaults_are_the_runtimes() {
        let out = expand_str(
            quote!(key = "a", on_fail = "defer"),
            quote!(
                async fn f() {}
            ),
        );
        let policy = dlock_runtime::DeferPolicy::default();
        let expected = format!(
            ". defer (:: dlock_runtime :: __private :: Duration :: new ({}u64 , {}u32) , {}u32)",
            policy.delay.as_secs(),
            policy.delay.subsec_nanos(),
            policy.max_attempts
        );
        assert!(out.contains(&expected), "missing `{expected}` in\n{out}");
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
        assert!(
            out.contains(
                ". defer (:: dlock_runtime :: __private :: Duration :: new (1u64 , 0u32) , 3u32)"
            ),
            "{out}"
        );
        assert!(out.contains(". defer ("), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
    }
}
