//! A `tracing` layer that keeps every span and event it sees — name, target, level, fields —
//! for the tests to check.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// A span or an event as the layer saw it.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub(crate) kind: Kind,
    /// The span's name, or the event's message (`""` when it has none).
    pub(crate) name: String,
    pub(crate) target: String,
    pub(crate) level: Level,
    pub(crate) fields: Vec<(String, String)>,
    /// For an event: the name of the span it happened in.
    pub(crate) span: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Span,
    Event,
}

impl Seen {
    pub(crate) fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every text of this record: its name and its fields' values.
    pub(crate) fn texts(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.name.as_str()).chain(self.fields.iter().map(|(_, v)| v.as_str()))
    }
}

/// What the layer saw, shared with the test.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<Seen>>>);

impl Captured {
    pub(crate) fn all(&self) -> Vec<Seen> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn spans(&self, name: &str) -> Vec<Seen> {
        self.all()
            .into_iter()
            .filter(|s| s.kind == Kind::Span && s.name == name)
            .collect()
    }

    /// Events whose message (or, without one, whose `event` field) is `name`.
    /// The events at `level`.
    pub(crate) fn at(&self, level: Level) -> Vec<Seen> {
        self.all()
            .into_iter()
            .filter(|s| s.kind == Kind::Event && s.level == level)
            .collect()
    }

    pub(crate) fn events(&self, name: &str) -> Vec<Seen> {
        self.all()
            .into_iter()
            .filter(|s| s.kind == Kind::Event && (s.name == name || s.field("event") == Some(name)))
            .collect()
    }

    fn push(&self, seen: Seen) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(seen);
    }
}

struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

/// The layer.
pub(crate) struct Capture(Captured);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields(Vec::new());
        attrs.record(&mut fields);
        let meta = attrs.metadata();
        if let Some(span) = ctx.span(id) {
            span.extensions_mut()
                .insert(self.0 .0.lock().unwrap().len());
        }
        self.0.push(Seen {
            kind: Kind::Span,
            name: meta.name().to_owned(),
            target: meta.target().to_owned(),
            level: *meta.level(),
            fields: fields.0,
            span: None,
        });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(index) = ctx
            .span(id)
            .and_then(|s| s.extensions().get::<usize>().copied())
        else {
            return;
        };
        let mut fields = Fields(Vec::new());
        values.record(&mut fields);
        if let Some(seen) = self.0 .0.lock().unwrap().get_mut(index) {
            seen.fields.extend(fields.0);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields(Vec::new());
        event.record(&mut fields);
        let message = fields
            .0
            .iter()
            .position(|(k, _)| k == "message")
            .map(|i| fields.0.remove(i).1)
            .unwrap_or_default();
        let meta = event.metadata();
        self.0.push(Seen {
            kind: Kind::Event,
            name: message,
            target: meta.target().to_owned(),
            level: *meta.level(),
            fields: fields.0,
            span: ctx.event_span(event).map(|s| s.name().to_owned()),
        });
    }
}

/// Runs `f` with a subscriber that captures everything (all levels) on this thread.
pub(crate) fn capturing<T>(f: impl FnOnce() -> T) -> (T, Captured) {
    capturing_live(|_| f())
}

/// Runs `f` on a current-thread runtime — so the tasks it spawns report here too — with a
/// subscriber that captures everything on this thread, and what is captured so far in `f`'s
/// hands (to wait for a record).
pub(crate) fn capturing_run<T>(f: impl AsyncFnOnce(&Captured) -> T) -> (T, Captured) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    capturing_live(|captured| runtime.block_on(f(captured)))
}

/// A second dispatcher, registered for the life of the process. While exactly one dispatcher
/// is registered (a capture's), tracing-core computes the interest of a callsite reached for
/// the first time from the thread-local default of the thread that reaches it, and caches it
/// for the process: a sibling test with no subscriber that reaches an event first caches
/// "never", and the capture misses that event from then on (tokio-rs/tracing#2874, #3611; the
/// defer queue's `retried` events went missing so, about one run in two of the in-process
/// tests). With two registered, a callsite's interest is that of every live dispatcher.
static SECOND_DISPATCHER: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();

/// Like [`capturing`], with what is captured so far in `f`'s hands (to wait for a record).
pub(crate) fn capturing_live<T>(f: impl FnOnce(&Captured) -> T) -> (T, Captured) {
    SECOND_DISPATCHER.get_or_init(|| tracing::Dispatch::new(tracing_subscriber::registry()));
    let captured = Captured::default();
    let subscriber = tracing_subscriber::registry().with(Capture(captured.clone()));
    let out = tracing::subscriber::with_default(subscriber, || f(&captured));
    (out, captured)
}
