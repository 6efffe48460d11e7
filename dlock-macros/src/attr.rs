//! The arguments of `#[distributed_lock(...)]`, parsed and validated into [`Args`].
//!
//! Parsing has two phases. The first reads the `name = value` list and only fails on malformed
//! syntax (a missing `=`, a missing `,`). The second checks every value and every combination,
//! recording each problem in [`Errors`] so that all of them are reported together, each spanned
//! on the offending token: the value for a bad value, the argument name for an unknown,
//! duplicate or misplaced argument.

use std::time::Duration;

use proc_macro2::{Span, TokenStream};
use syn::ext::IdentExt as _;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned as _;
use syn::{Expr, Ident, Lit, LitStr, Token};

use crate::errors::Errors;
use crate::key_template::Template;

mod kind;
mod surface;
pub(crate) use kind::Kind;

mod kw {
    syn::custom_keyword!(key);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(on_fail);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(through_outages);
    syn::custom_keyword!(delay);
    syn::custom_keyword!(max_attempts);
    syn::custom_keyword!(on_lost);
    syn::custom_keyword!(locker);
    syn::custom_keyword!(message);
    syn::custom_keyword!(hold_at_least);
    syn::custom_keyword!(fallback);
    syn::custom_keyword!(permits);
    syn::custom_keyword!(mode);
}

// The defaults and limits are the runtime's, from the crate both depend on.
use dlock_limits::{DEFAULT_TTL, DEFAULT_WAIT, MAX_TTL, MIN_TTL};

/// Everything the attribute asked for, validated.
pub(crate) struct Args {
    /// `key = "…"` (one key) or `key = ["…", …]` (a multi-key lock).
    pub(crate) keys: Keys,
    /// `ttl = "…"`, or [`DEFAULT_TTL`] (the runtime's default lease).
    pub(crate) ttl: Duration,
    /// `on_fail = "…"` and the arguments that belong to it.
    pub(crate) on_fail: OnFail,
    /// `on_lost = "…"`.
    pub(crate) on_lost: OnLost,
    /// `locker = <expr>`; `None` means the global default locker.
    pub(crate) locker: Option<Expr>,
    /// `message = "…"`.
    pub(crate) message: Option<LitStr>,
    /// `crate = "…"`; `None` means `::dlock_runtime`.
    pub(crate) krate: Option<syn::Path>,
    /// `hold_at_least = "…"`.
    pub(crate) hold_at_least: Option<Duration>,
    /// `fallback = path`.
    pub(crate) fallback: Option<syn::Path>,
    /// `permits = N` or `mode = "…"` (`attr::kind`); [`Kind::Lock`] without either.
    pub(crate) kind: Kind,
}

/// The key templates: one, or a list (`multi`) locked all-or-nothing.
pub(crate) struct Keys {
    pub(crate) list: Vec<Key>,
    pub(crate) multi: bool,
}

/// `key = "…"`: the literal (for spans) and its parsed template.
pub(crate) struct Key {
    pub(crate) lit: LitStr,
    pub(crate) template: Template,
}

/// `on_fail = "…"`.
pub(crate) enum OnFail {
    /// One attempt; the call fails at once when the lock is held.
    Reject,
    /// Wait for the lock up to `wait`; with `through_outages`, also while the backend is down.
    Retry {
        wait: Duration,
        through_outages: bool,
    },
    /// Hand the call to the runtime's in-process delay queue (see `expand::defer`).
    Defer(Defer),
    /// One attempt; when the lock is held, return at once with the return type's "nothing
    /// done" value (`()`, `None`, `Ok(())`, `Ok(None)`).
    Skip,
}

/// `on_fail = "defer"` and its arguments.
pub(crate) struct Defer {
    /// The `"defer"` literal.
    #[allow(dead_code, reason = "kept for diagnostics spanned on the strategy")]
    pub(crate) lit: LitStr,
    /// `delay = "…"`; `None` means [`dlock_limits::DEFAULT_DEFER_DELAY`].
    pub(crate) delay: Option<Duration>,
    /// `max_attempts = N`; `None` means [`dlock_limits::DEFAULT_DEFER_MAX_ATTEMPTS`].
    pub(crate) max_attempts: Option<u32>,
}

/// `on_lost = "…"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnLost {
    /// Keep running the body when the lock is lost.
    Ignore,
    /// Cancel the body when the lock is lost.
    Cancel,
}

/// The argument names, in the order the error for an unknown one lists them.
pub(crate) const KNOWN: &str = "`key`, `ttl`, `on_fail`, `wait`, `through_outages`, `delay`, \
                     `max_attempts`, `on_lost`, `locker`, `message`, `crate`, `hold_at_least`, \
                     `fallback`, `permits`, `mode`";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Name {
    Key,
    Ttl,
    OnFail,
    Wait,
    ThroughOutages,
    Delay,
    MaxAttempts,
    OnLost,
    Locker,
    Message,
    Crate,
    HoldAtLeast,
    Fallback,
    Permits,
    Mode,
}

impl Name {
    fn as_str(self) -> &'static str {
        match self {
            Name::Key => "key",
            Name::Ttl => "ttl",
            Name::OnFail => "on_fail",
            Name::Wait => "wait",
            Name::ThroughOutages => "through_outages",
            Name::Delay => "delay",
            Name::MaxAttempts => "max_attempts",
            Name::OnLost => "on_lost",
            Name::Locker => "locker",
            Name::Message => "message",
            Name::Crate => "crate",
            Name::HoldAtLeast => "hold_at_least",
            Name::Fallback => "fallback",
            Name::Permits => "permits",
            Name::Mode => "mode",
        }
    }

    /// How the argument is written, for error messages.
    fn example(self) -> &'static str {
        match self {
            Name::Key => "key = \"order:<id>\"",
            Name::Ttl => "ttl = \"30s\"",
            Name::OnFail => "on_fail = \"retry\"",
            Name::Wait => "wait = \"5s\"",
            Name::ThroughOutages => "through_outages = true",
            Name::Delay => "delay = \"2s\"",
            Name::MaxAttempts => "max_attempts = 5",
            Name::OnLost => "on_lost = \"cancel\"",
            Name::Locker => "locker = state.locker",
            Name::Message => "message = \"this order is being processed\"",
            Name::Crate => "crate = \"::dlock_runtime\"",
            Name::HoldAtLeast => "hold_at_least = \"30s\"",
            Name::Fallback => "fallback = busy_answer",
            Name::Permits => "permits = 3",
            Name::Mode => "mode = \"read\"",
        }
    }
}

/// One `name = value` as written. `name` is `Err` for an unknown name.
struct RawArg {
    name: Result<Name, Ident>,
    name_span: Span,
    value: Expr,
}

/// The comma-separated list as written.
struct RawArgs(Vec<RawArg>);

impl Parse for RawArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Vec::new();
        while !input.is_empty() {
            let name_span = input.span();
            let lookahead = input.lookahead1();
            let name = if lookahead.peek(kw::key) {
                input.parse::<kw::key>().map(|_| Ok(Name::Key))
            } else if lookahead.peek(kw::ttl) {
                input.parse::<kw::ttl>().map(|_| Ok(Name::Ttl))
            } else if lookahead.peek(kw::on_fail) {
                input.parse::<kw::on_fail>().map(|_| Ok(Name::OnFail))
            } else if lookahead.peek(kw::wait) {
                input.parse::<kw::wait>().map(|_| Ok(Name::Wait))
            } else if lookahead.peek(kw::through_outages) {
                input
                    .parse::<kw::through_outages>()
                    .map(|_| Ok(Name::ThroughOutages))
            } else if lookahead.peek(kw::delay) {
                input.parse::<kw::delay>().map(|_| Ok(Name::Delay))
            } else if lookahead.peek(kw::max_attempts) {
                input
                    .parse::<kw::max_attempts>()
                    .map(|_| Ok(Name::MaxAttempts))
            } else if lookahead.peek(kw::on_lost) {
                input.parse::<kw::on_lost>().map(|_| Ok(Name::OnLost))
            } else if lookahead.peek(kw::locker) {
                input.parse::<kw::locker>().map(|_| Ok(Name::Locker))
            } else if lookahead.peek(kw::message) {
                input.parse::<kw::message>().map(|_| Ok(Name::Message))
            } else if lookahead.peek(kw::hold_at_least) {
                input
                    .parse::<kw::hold_at_least>()
                    .map(|_| Ok(Name::HoldAtLeast))
            } else if lookahead.peek(kw::fallback) {
                input.parse::<kw::fallback>().map(|_| Ok(Name::Fallback))
            } else if lookahead.peek(Token![crate]) {
                input.parse::<Token![crate]>().map(|_| Ok(Name::Crate))
            } else if lookahead.peek(kw::permits) {
                input.parse::<kw::permits>().map(|_| Ok(Name::Permits))
            } else if lookahead.peek(kw::mode) {
                input.parse::<kw::mode>().map(|_| Ok(Name::Mode))
            } else if input.peek(Ident::peek_any) {
                // Unknown, but well-formed: keep going so that every problem is reported.
                Ident::parse_any(input).map(Err)
            } else {
                return Err(lookahead.error());
            }?;

            if !input.peek(Token![=]) {
                let written = match &name {
                    Ok(name) => name.example().to_owned(),
                    Err(ident) => format!("{ident} = …"),
                };
                return Err(input.error(format!("expected `=` and a value, as in `{written}`")));
            }
            input.parse::<Token![=]>()?;
            let value = input.parse::<Expr>()?;
            args.push(RawArg {
                name,
                name_span,
                value,
            });

            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(RawArgs(args))
    }
}

/// One argument's value, set at most once. The one helper every argument goes through, so a
/// duplicate always gets the same error at the repeated name.
struct Slot<T> {
    name: Name,
    /// The name's span and the value (`None` when the value was invalid, already reported).
    given: Option<(Span, Option<T>)>,
}

impl<T> Slot<T> {
    fn new(name: Name) -> Self {
        Slot { name, given: None }
    }

    fn set(&mut self, errors: &mut Errors, name_span: Span, value: syn::Result<T>) {
        let value = errors.ok(value);
        if self.given.is_some() {
            errors.error(
                name_span,
                format_args!(
                    "duplicate argument `{}`: each argument may be given only once",
                    self.name.as_str()
                ),
            );
        } else {
            self.given = Some((name_span, value));
        }
    }

    /// Where the argument was given, if it was.
    fn span(&self) -> Option<Span> {
        self.given.as_ref().map(|(span, _)| *span)
    }

    /// The value, if given and valid.
    fn value(self) -> Option<T> {
        self.given.and_then(|(_, value)| value)
    }

    /// Whether the argument was given with an invalid value.
    fn is_invalid(&self) -> bool {
        matches!(self.given, Some((_, None)))
    }
}

impl Args {
    /// Parses the attribute's arguments. Malformed syntax is returned as `Err`; every other
    /// problem is recorded in `errors`, and the model is still returned (with defaults in place
    /// of invalid values) whenever it has a valid key, so that the caller can go on checking
    /// the key's placeholders against the function.
    pub(crate) fn parse(tokens: TokenStream, errors: &mut Errors) -> syn::Result<Option<Args>> {
        let RawArgs(raw) = syn::parse2(tokens)?;

        let mut key = Slot::new(Name::Key);
        let mut ttl = Slot::new(Name::Ttl);
        let mut on_fail = Slot::new(Name::OnFail);
        let mut wait = Slot::new(Name::Wait);
        let mut through_outages = Slot::new(Name::ThroughOutages);
        let mut delay = Slot::new(Name::Delay);
        let mut max_attempts = Slot::new(Name::MaxAttempts);
        let mut on_lost = Slot::new(Name::OnLost);
        let mut locker = Slot::new(Name::Locker);
        let mut message = Slot::new(Name::Message);
        let mut krate = Slot::new(Name::Crate);
        let mut hold_at_least = Slot::new(Name::HoldAtLeast);
        let mut fallback = Slot::new(Name::Fallback);
        let mut permits = Slot::new(Name::Permits);
        let mut mode = Slot::new(Name::Mode);

        for RawArg {
            name,
            name_span,
            value,
        } in raw
        {
            let name = match name {
                Ok(name) => name,
                Err(unknown) => {
                    errors.error(
                        name_span,
                        format_args!("unknown argument `{unknown}`; expected one of: {KNOWN}"),
                    );
                    continue;
                }
            };
            match name {
                Name::Key => key.set(errors, name_span, surface::parse_keys(&value)),
                Name::Ttl => ttl.set(errors, name_span, parse_ttl(&value)),
                Name::OnFail => on_fail.set(errors, name_span, parse_on_fail(&value)),
                Name::Wait => wait.set(errors, name_span, parse_wait(name, &value)),
                Name::ThroughOutages => {
                    through_outages.set(errors, name_span, parse_bool(name, &value));
                }
                Name::Delay => delay.set(errors, name_span, parse_wait(name, &value)),
                Name::MaxAttempts => {
                    max_attempts.set(errors, name_span, parse_max_attempts(&value));
                }
                Name::OnLost => on_lost.set(errors, name_span, parse_on_lost(&value)),
                Name::Locker => locker.set(errors, name_span, Ok(value)),
                Name::Message => message.set(errors, name_span, parse_message(&value)),
                Name::Crate => krate.set(errors, name_span, parse_crate(&value)),
                Name::HoldAtLeast => {
                    hold_at_least.set(errors, name_span, surface::parse_hold_at_least(&value));
                }
                Name::Fallback => {
                    fallback.set(errors, name_span, surface::parse_fallback(&value));
                }
                Name::Permits => permits.set(errors, name_span, kind::parse_permits(&value)),
                Name::Mode => mode.set(errors, name_span, kind::parse_mode(&value)),
            }
        }

        if key.span().is_none() {
            errors.error(
                Span::call_site(),
                "missing required argument `key`, e.g. \
                 `#[distributed_lock(key = \"order:<id>\")]`",
            );
        }

        // Arguments that belong to one strategy. When `on_fail` itself is invalid that error
        // says enough.
        let strategy = if on_fail.is_invalid() {
            None
        } else {
            Some(on_fail_name(on_fail.given.as_ref()))
        };
        for (span, name, belongs_to) in [
            (wait.span(), Name::Wait, "retry"),
            (through_outages.span(), Name::ThroughOutages, "retry"),
            (delay.span(), Name::Delay, "defer"),
            (max_attempts.span(), Name::MaxAttempts, "defer"),
        ] {
            if let (Some(span), Some(strategy)) = (span, strategy) {
                if strategy != belongs_to {
                    errors.error(
                        span,
                        format_args!(
                            "`{}` only applies to `on_fail = \"{belongs_to}\"`, but this lock \
                             uses `on_fail = \"{strategy}\"`{}",
                            name.as_str(),
                            if strategy == "reject" && on_fail.span().is_none() {
                                " (the default)"
                            } else {
                                ""
                            }
                        ),
                    );
                }
            }
        }

        // Arguments a strategy would silently ignore.
        if let (Some(span), Some("defer")) = (on_lost.span(), strategy) {
            if matches!(on_lost.given, Some((_, Some(OnLost::Cancel)))) {
                errors.error(
                    span,
                    "`on_lost = \"cancel\"` does not apply to `on_fail = \"defer\"`: a deferred \
                     body runs to its end (fence its writes with the lock's token instead)",
                );
            }
        }
        if let (Some(span), Some(strategy @ ("defer" | "skip"))) = (message.span(), strategy) {
            errors.error(
                span,
                format_args!(
                    "`message` only applies to `on_fail = \"reject\"` or `\"retry\"` (the \
                     detail of their `409`), but this lock uses `on_fail = \"{strategy}\"`"
                ),
            );
        }

        let on_fail = match on_fail.value() {
            None | Some(Strategy::Reject) => OnFail::Reject,
            Some(Strategy::Retry) => OnFail::Retry {
                wait: wait.value().unwrap_or(DEFAULT_WAIT),
                through_outages: through_outages.value().unwrap_or(false),
            },
            Some(Strategy::Defer(lit)) => OnFail::Defer(Defer {
                lit,
                delay: delay.value(),
                max_attempts: max_attempts.value(),
            }),
            Some(Strategy::Skip) => OnFail::Skip,
        };
        // An invalid `ttl` has its own error: the hold is not checked against the default in
        // its place (a second error, about a ttl the user did not write).
        let ttl_invalid = ttl.is_invalid();
        let ttl = ttl.value().unwrap_or(DEFAULT_TTL);
        let hold_at_least = hold_at_least.value().and_then(|(lit, hold)| {
            if !ttl_invalid {
                errors.ok(surface::check_hold(&lit, hold, ttl))?;
            }
            Some(hold)
        });
        let fallback_span = fallback.span();
        let fallback = fallback.value();
        let permits_given = permits.span().is_some();
        let mode_span = mode.span();
        let kind = kind::resolve(
            errors,
            permits.value(),
            mode.value(),
            mode_span,
            permits_given,
        );
        let Some((list, multi)) = key.value() else {
            return Ok(None);
        };
        if multi && !matches!(kind, Kind::Lock) {
            errors.error(
                surface::multi_key_span(&list),
                "`permits` and `mode` take one key: a multi-key list locks exclusive locks only",
            );
        }
        if multi && matches!(on_fail, OnFail::Defer(_)) {
            errors.error(
                surface::multi_key_span(&list),
                "a multi-key lock cannot use `on_fail = \"defer\"`: the delay queue defers \
                 work under one key; use \"reject\", \"retry\" or \"skip\"",
            );
        }
        if let (Some(span), OnFail::Skip | OnFail::Defer(_)) = (fallback_span, &on_fail) {
            errors.error(
                span,
                format_args!(
                    "`fallback` does not apply to `on_fail = \"{}\"`, which never fails for a \
                     held lock; use \"reject\" or \"retry\"",
                    if matches!(on_fail, OnFail::Skip) {
                        "skip"
                    } else {
                        "defer"
                    }
                ),
            );
        }
        Ok(Some(Args {
            keys: Keys { list, multi },
            ttl,
            on_fail,
            on_lost: on_lost.value().unwrap_or(OnLost::Ignore),
            locker: locker.value(),
            message: message.value(),
            krate: krate.value(),
            hold_at_least,
            fallback,
            kind,
        }))
    }
}

/// `on_fail` as parsed, before its companion arguments are attached.
enum Strategy {
    Reject,
    Retry,
    Defer(LitStr),
    Skip,
}

fn on_fail_name(given: Option<&(Span, Option<Strategy>)>) -> &'static str {
    match given {
        None | Some((_, Some(Strategy::Reject))) | Some((_, None)) => "reject",
        Some((_, Some(Strategy::Retry))) => "retry",
        Some((_, Some(Strategy::Defer(_)))) => "defer",
        Some((_, Some(Strategy::Skip))) => "skip",
    }
}

/// The string literal of `value`, or an error spanned on `value`.
fn string_literal(name: Name, value: &Expr) -> syn::Result<LitStr> {
    let mut value = value;
    // A literal passed through a `macro_rules!` fragment arrives in an invisible group.
    while let Expr::Group(group) = value {
        value = &group.expr;
    }
    match value {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Str(lit), ..
        }) => Ok(lit.clone()),
        other => Err(syn::Error::new(
            other.span(),
            format_args!(
                "`{}` expects a string literal, as in `{}`",
                name.as_str(),
                name.example()
            ),
        )),
    }
}

/// One key template, a string literal.
fn parse_key_literal(value: &Expr) -> syn::Result<Key> {
    let lit = string_literal(Name::Key, value)?;
    match Template::parse(&lit.value()) {
        Ok(template) => Ok(Key { lit, template }),
        Err(messages) => Err(messages
            .into_iter()
            .map(|message| syn::Error::new(lit.span(), message))
            .reduce(|mut all, error| {
                all.combine(error);
                all
            })
            .unwrap_or_else(|| syn::Error::new(lit.span(), "invalid key"))),
    }
}

fn parse_ttl(value: &Expr) -> syn::Result<Duration> {
    let lit = string_literal(Name::Ttl, value)?;
    let ttl = parse_duration(Name::Ttl, &lit)?;
    let problem = if ttl.is_zero() {
        "must be greater than zero: a lock with a zero ttl would expire at once".to_owned()
    } else if ttl < MIN_TTL {
        format!("is shorter than the minimum of {}", short(MIN_TTL))
    } else if ttl > MAX_TTL {
        format!("is longer than the maximum of {}", short(MAX_TTL))
    } else {
        return Ok(ttl);
    };
    Err(syn::Error::new(
        lit.span(),
        format_args!(
            "`ttl` {problem} (ttl is how long the lock lives if it is not renewed; \
             it must be between {} and {})",
            short(MIN_TTL),
            short(MAX_TTL)
        ),
    ))
}

/// `wait` and `delay`: more than zero, at most [`MAX_TTL`].
fn parse_wait(name: Name, value: &Expr) -> syn::Result<Duration> {
    let lit = string_literal(name, value)?;
    let duration = parse_duration(name, &lit)?;
    let problem = if duration.is_zero() {
        match name {
            Name::Wait => "must be greater than zero (to fail at once when the lock is held, \
                           use `on_fail = \"reject\"`)"
                .to_owned(),
            _ => "must be greater than zero".to_owned(),
        }
    } else if duration > MAX_TTL {
        format!("is longer than the maximum of {}", short(MAX_TTL))
    } else {
        return Ok(duration);
    };
    Err(syn::Error::new(
        lit.span(),
        format_args!("`{}` {problem}", name.as_str()),
    ))
}

/// `duration` in its largest whole unit, as the messages show limits: `10ms`, `24h`.
pub(crate) fn short(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    for (unit, unit_nanos) in [
        ("h", 3_600_000_000_000),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
    ] {
        if nanos != 0 && nanos % unit_nanos == 0 {
            return format!("{}{unit}", nanos / unit_nanos);
        }
    }
    humantime::format_duration(duration).to_string()
}

/// A humantime duration such as `"30s"`, `"500ms"` or `"1m 30s"`.
fn parse_duration(name: Name, lit: &LitStr) -> syn::Result<Duration> {
    humantime::parse_duration(&lit.value()).map_err(|error| {
        syn::Error::new(
            lit.span(),
            format_args!(
                "invalid duration for `{}`: {error}; write a number and a unit, \
                 such as \"30s\", \"500ms\" or \"1m 30s\"",
                name.as_str()
            ),
        )
    })
}

fn parse_on_fail(value: &Expr) -> syn::Result<Strategy> {
    let lit = string_literal(Name::OnFail, value)?;
    match lit.value().as_str() {
        "reject" => Ok(Strategy::Reject),
        "retry" => Ok(Strategy::Retry),
        "defer" => Ok(Strategy::Defer(lit)),
        "skip" => Ok(Strategy::Skip),
        other => Err(syn::Error::new(
            lit.span(),
            format_args!(
                "unknown `on_fail` strategy {other:?}; expected \"reject\" (fail at once), \
                 \"retry\" (wait for the lock up to `wait`), \"defer\" (run later) or \
                 \"skip\" (return at once without running: another instance is doing it)"
            ),
        )),
    }
}

fn parse_on_lost(value: &Expr) -> syn::Result<OnLost> {
    let lit = string_literal(Name::OnLost, value)?;
    match lit.value().as_str() {
        "ignore" => Ok(OnLost::Ignore),
        "cancel" => Ok(OnLost::Cancel),
        other => Err(syn::Error::new(
            lit.span(),
            format_args!(
                "unknown `on_lost` policy {other:?}; expected \"ignore\" (keep running) or \
                 \"cancel\" (stop the function when the lock is lost)"
            ),
        )),
    }
}

fn parse_max_attempts(value: &Expr) -> syn::Result<u32> {
    let mut value = value;
    while let Expr::Group(group) = value {
        value = &group.expr;
    }
    let error = |span| {
        syn::Error::new(
            span,
            "`max_attempts` expects a whole number from 1 to 4294967295, as in \
             `max_attempts = 5`",
        )
    };
    match value {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Int(lit), ..
        }) => match lit.base10_parse::<u32>() {
            Ok(0) | Err(_) => Err(error(lit.span())),
            Ok(attempts) => Ok(attempts),
        },
        other => Err(error(other.span())),
    }
}

/// `true` or `false`.
fn parse_bool(name: Name, value: &Expr) -> syn::Result<bool> {
    let mut value = value;
    while let Expr::Group(group) = value {
        value = &group.expr;
    }
    match value {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Bool(lit),
            ..
        }) => Ok(lit.value),
        other => Err(syn::Error::new(
            other.span(),
            format_args!(
                "`{}` expects `true` or `false`, as in `{}`",
                name.as_str(),
                name.example()
            ),
        )),
    }
}

fn parse_message(value: &Expr) -> syn::Result<LitStr> {
    let lit = string_literal(Name::Message, value)?;
    if lit.value().trim().is_empty() {
        return Err(syn::Error::new(
            lit.span(),
            "`message` must not be empty; leave it out to use the default message",
        ));
    }
    Ok(lit)
}

fn parse_crate(value: &Expr) -> syn::Result<syn::Path> {
    let lit = string_literal(Name::Crate, value)?;
    lit.parse::<syn::Path>().map_err(|_| {
        syn::Error::new(
            lit.span(),
            "`crate` expects the path of the dlock_runtime crate or of a re-export of it, \
             as in `crate = \"::dlock_runtime\"` or `crate = \"my_app::dlock\"`",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(tokens: TokenStream) -> syn::Result<Args> {
        let mut errors = Errors::default();
        let args = Args::parse(tokens, &mut errors)?;
        errors.finish()?;
        Ok(args.expect("no errors, so a key"))
    }

    /// Every error message, in order.
    fn errors(tokens: TokenStream) -> Vec<String> {
        match parse(tokens) {
            Ok(_) => panic!("expected errors"),
            Err(error) => error.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    fn one_error(tokens: TokenStream) -> String {
        let mut all = errors(tokens);
        assert_eq!(all.len(), 1, "{all:?}");
        all.remove(0)
    }

    #[test]
    fn defaults() {
        let args = parse(quote::quote!(key = "order:<id>")).expect("valid");
        assert_eq!(args.keys.list[0].lit.value(), "order:<id>");
        assert!(!args.keys.multi);
        assert_eq!(args.ttl, Duration::from_secs(30));
        assert!(matches!(args.on_fail, OnFail::Reject));
        assert_eq!(args.on_lost, OnLost::Ignore);
        assert!(args.locker.is_none());
        assert!(args.message.is_none());
        assert!(args.krate.is_none());
    }

    #[test]
    fn everything() {
        let args = parse(quote::quote!(
            key = "a:<b>",
            ttl = "1m 30s",
            on_fail = "retry",
            wait = "500ms",
            on_lost = "cancel",
            locker = state.locker,
            message = "busy",
            crate = "my_app::dlock",
        ))
        .expect("valid");
        assert_eq!(args.ttl, Duration::from_secs(90));
        assert!(
            matches!(args.on_fail, OnFail::Retry { wait, .. } if wait == Duration::from_millis(500))
        );
        assert_eq!(args.on_lost, OnLost::Cancel);
        let locker = args.locker.expect("locker");
        assert_eq!(quote::quote!(#locker).to_string(), "state . locker");
        assert_eq!(args.message.expect("message").value(), "busy");
        let krate = args.krate.expect("crate");
        assert_eq!(quote::quote!(#krate).to_string(), "my_app :: dlock");
    }

    #[test]
    fn retry_default_wait() {
        let args = parse(quote::quote!(key = "a", on_fail = "retry")).expect("valid");
        assert!(matches!(
            args.on_fail,
            OnFail::Retry { wait, through_outages: false } if wait == DEFAULT_WAIT
        ));
    }

    #[test]
    fn retry_through_outages() {
        let args = parse(quote::quote!(
            key = "a",
            on_fail = "retry",
            through_outages = true
        ))
        .expect("valid");
        assert!(matches!(
            args.on_fail,
            OnFail::Retry {
                through_outages: true,
                ..
            }
        ));
        let args = parse(quote::quote!(
            key = "a",
            on_fail = "retry",
            through_outages = false
        ))
        .expect("valid");
        assert!(matches!(
            args.on_fail,
            OnFail::Retry {
                through_outages: false,
                ..
            }
        ));
        assert_eq!(
            one_error(quote::quote!(
                key = "a",
                on_fail = "retry",
                through_outages = "yes"
            )),
            "`through_outages` expects `true` or `false`, as in `through_outages = true`"
        );
        assert_eq!(
            one_error(quote::quote!(key = "a", through_outages = true)),
            "`through_outages` only applies to `on_fail = \"retry\"`, but this lock uses \
             `on_fail = \"reject\"` (the default)"
        );
    }

    #[test]
    fn defer_arguments() {
        let args = parse(quote::quote!(
            key = "a",
            on_fail = "defer",
            delay = "2s",
            max_attempts = 5
        ))
        .expect("valid");
        let OnFail::Defer(defer) = args.on_fail else {
            panic!("expected defer")
        };
        assert_eq!(defer.lit.value(), "defer");
        assert_eq!(defer.delay, Some(Duration::from_secs(2)));
        assert_eq!(defer.max_attempts, Some(5));
    }

    /// The attribute's defaults are the runtime's, and it accepts exactly the ttls the runtime
    /// accepts.
    #[tokio::test]
    async fn defaults_and_limits_are_the_runtimes() {
        let locker = dlock_runtime::Locker::memory();
        let args = parse(quote::quote!(key = "a")).expect("valid");
        assert_eq!(args.ttl, locker.default_ttl());
        let args = parse(quote::quote!(key = "a", on_fail = "retry")).expect("valid");
        let default_wait = dlock_runtime::RetryPolicy::default().wait;
        assert!(matches!(args.on_fail, OnFail::Retry { wait, .. } if wait == default_wait));

        let ms = Duration::from_millis(1);
        let (min, max) = (dlock_runtime::MIN_TTL, dlock_runtime::MAX_TTL);
        for ttl in [min - ms, min, max, max + ms] {
            let text = format!("{}ms", ttl.as_millis());
            let lit = LitStr::new(&text, Span::call_site());
            let macro_accepts = parse(quote::quote!(key = "a", ttl = #lit)).is_ok();
            let runtime_accepts = match locker.lock("a").ttl(ttl).acquire().await {
                Ok(guard) => guard.release().await.is_ok(),
                Err(dlock_runtime::LockError::InvalidTtl { .. }) => false,
                Err(error) => panic!("unexpected error: {error}"),
            };
            assert_eq!(macro_accepts, runtime_accepts, "ttl = {text:?}");
        }
    }

    #[test]
    fn missing_key() {
        assert!(one_error(quote::quote!(ttl = "1s")).contains("missing required argument `key`"));
        assert!(one_error(quote::quote!()).contains("missing required argument `key`"));
    }

    #[test]
    fn unknown_argument_lists_known_ones() {
        let message = one_error(quote::quote!(key = "a", tll = "1s"));
        assert!(message.starts_with("unknown argument `tll`"), "{message}");
        assert!(
            message.contains("`ttl`") && message.contains("`crate`"),
            "{message}"
        );
        // Keywords are names too.
        assert!(one_error(quote::quote!(key = "a", type = "x")).contains("unknown argument `type`"));
    }

    #[test]
    fn duplicate_argument() {
        let message = one_error(quote::quote!(key = "a", ttl = "1s", ttl = "2s"));
        assert_eq!(
            message,
            "duplicate argument `ttl`: each argument may be given only once"
        );
        let message = one_error(quote::quote!(key = "a", key = "b"));
        assert!(message.contains("duplicate argument `key`"), "{message}");
    }

    #[test]
    fn bad_durations() {
        let message = one_error(quote::quote!(key = "a", ttl = "30 parsecs"));
        assert!(
            message.starts_with("invalid duration for `ttl`"),
            "{message}"
        );
        assert!(one_error(quote::quote!(key = "a", ttl = "0s")).contains("greater than zero"));
        assert!(one_error(quote::quote!(key = "a", ttl = "5ms")).contains("minimum of 10ms"));
        assert!(one_error(quote::quote!(key = "a", ttl = "25h")).contains("maximum of 24h"));
        assert!(one_error(quote::quote!(key = "a", ttl = 30)).contains("expects a string literal"));
        let message = one_error(quote::quote!(key = "a", on_fail = "retry", wait = "0s"));
        assert!(
            message.contains("`wait` must be greater than zero"),
            "{message}"
        );
    }

    #[test]
    fn bad_choices() {
        let message = one_error(quote::quote!(key = "a", on_fail = "panic"));
        assert!(
            message.starts_with("unknown `on_fail` strategy \"panic\""),
            "{message}"
        );
        let message = one_error(quote::quote!(key = "a", on_lost = "abort"));
        assert!(
            message.starts_with("unknown `on_lost` policy \"abort\""),
            "{message}"
        );
    }

    #[test]
    fn strategy_arguments_must_match() {
        let message = one_error(quote::quote!(key = "a", wait = "5s"));
        assert!(
            message.contains("`wait` only applies to `on_fail = \"retry\"`"),
            "{message}"
        );
        assert!(message.contains("(the default)"), "{message}");
        let message = one_error(quote::quote!(key = "a", on_fail = "retry", delay = "1s"));
        assert!(message.contains("`delay` only applies to `on_fail = \"defer\"`"));
        let message = one_error(quote::quote!(
            key = "a",
            on_fail = "reject",
            max_attempts = 3
        ));
        assert!(message.contains("`max_attempts` only applies"), "{message}");
        assert!(!message.contains("(the default)"), "{message}");
        // No follow-up error when `on_fail` itself is wrong.
        let all = errors(quote::quote!(key = "a", on_fail = "x", wait = "1s"));
        assert_eq!(all.len(), 1, "{all:?}");
    }

    #[test]
    fn max_attempts_values() {
        assert!(one_error(quote::quote!(
            key = "a",
            on_fail = "defer",
            max_attempts = 0
        ))
        .contains("whole number"));
        assert!(one_error(quote::quote!(
            key = "a",
            on_fail = "defer",
            max_attempts = "5"
        ))
        .contains("whole number"));
    }

    #[test]
    fn bad_key_template_is_reported() {
        let message = one_error(quote::quote!(key = "a:<>"));
        assert!(message.contains("empty placeholder"), "{message}");
        assert!(one_error(quote::quote!(key = some_fn())).contains("expects a string literal"));
    }

    #[test]
    fn collects_every_error() {
        let all = errors(quote::quote!(
            ttl = "0s",
            on_fail = "later",
            nope = 1,
            message = "",
            crate = "not a path",
        ));
        assert_eq!(all.len(), 6, "{all:?}");
        assert!(
            all[5].contains("missing required argument `key`"),
            "{all:?}"
        );
    }

    #[test]
    fn syntax_errors() {
        let message = parse(quote::quote!(key "a"))
            .err()
            .expect("error")
            .to_string();
        assert_eq!(
            message,
            "expected `=` and a value, as in `key = \"order:<id>\"`"
        );
        let message = parse(quote::quote!("a")).err().expect("error").to_string();
        assert!(
            message.starts_with("expected one of: `key`, `ttl`"),
            "{message}"
        );
        assert!(parse(quote::quote!(key = "a" ttl = "1s")).is_err());
        // A trailing comma is fine.
        assert!(parse(quote::quote!(key = "a",)).is_ok());
    }
}
