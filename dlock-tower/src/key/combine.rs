//! Combinators: [`And`] and [`Or`].

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;

use super::{combinators, ExtractKey, Extracted, Key};

/// Both keys, joined with `:` (`<first>:<second>`); the request has no key if either
/// extractor finds none. The second extractor sees the request the first one handed on.
///
/// Made by the `and` method of every built-in extractor, or [`And::new`] for closures.
///
/// ```
/// use dlock_tower::key;
/// // `hdr:x-tenant:<tenant>:path:<METHOD>:<path>`
/// let per_tenant_endpoint = key::header("x-tenant").and(key::method_path());
/// # let _ = per_tenant_endpoint;
/// ```
#[derive(Clone, Copy, Debug)]
pub struct And<A, C> {
    first: A,
    second: C,
}

impl<A, C> And<A, C> {
    /// `first`'s key, then `second`'s.
    pub fn new(first: A, second: C) -> Self {
        And { first, second }
    }
}

combinators!(And<A, C>);

impl<B, A, C> ExtractKey<B> for And<A, C>
where
    A: ExtractKey<B>,
    C: ExtractKey<B> + Clone,
{
    type Future = AndFuture<B, A, C>;

    fn extract(&mut self, request: http::Request<B>) -> Self::Future {
        AndFuture {
            state: AndState::First {
                fut: self.first.extract(request),
                second: Some(self.second.clone()),
            },
        }
    }
}

pin_project! {
    /// The future of [`And`].
    pub struct AndFuture<B, A, C>
    where
        A: ExtractKey<B>,
        C: ExtractKey<B>,
    {
        #[pin]
        state: AndState<A::Future, C::Future, C>,
    }
}

pin_project! {
    #[project = AndStateProj]
    enum AndState<FA, FC, C> {
        First { #[pin] fut: FA, second: Option<C> },
        Second { #[pin] fut: FC, first: Option<Key> },
        Done,
    }
}

impl<B, A, C> Future for AndFuture<B, A, C>
where
    A: ExtractKey<B>,
    C: ExtractKey<B>,
{
    type Output = Extracted<B>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                AndStateProj::First { fut, second } => {
                    let (request, key) = ready!(fut.poll(cx))?;
                    let Some(first) = key else {
                        state.set(AndState::Done);
                        return Poll::Ready(Ok((request, None)));
                    };
                    let mut second = second.take().expect("polled after completion");
                    let fut = second.extract(request);
                    state.set(AndState::Second {
                        fut,
                        first: Some(first),
                    });
                }
                AndStateProj::Second { fut, first } => {
                    let (request, key) = ready!(fut.poll(cx))?;
                    let first = first.take().expect("polled after completion");
                    state.set(AndState::Done);
                    return Poll::Ready(Ok((request, key.map(|second| first.and(second)))));
                }
                AndStateProj::Done => panic!("AndFuture polled after completion"),
            }
        }
    }
}

/// The first extractor's key, or the second's when the first finds none. The second extractor
/// sees the request the first one handed on. A rejection by the first is final.
///
/// Made by the `or` method of every built-in extractor, or [`Or::new`] for closures. Keys of
/// two different built-in extractors start with different literals (`hdr:`, `path:`, …), so
/// they never collide with each other; two of the same kind must differ in what follows — two
/// headers by name, two [`extension`](super::extension)s by label (two types of one name in
/// different modules share a default label: give one its own with `label`).
///
/// ```
/// use dlock_tower::key;
/// let idem_or_endpoint = key::header("idempotency-key").or(key::method_path());
/// # let _ = idem_or_endpoint;
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Or<A, C> {
    first: A,
    second: C,
}

impl<A, C> Or<A, C> {
    /// `first`'s key, else `second`'s.
    pub fn new(first: A, second: C) -> Self {
        Or { first, second }
    }
}

combinators!(Or<A, C>);

impl<B, A, C> ExtractKey<B> for Or<A, C>
where
    A: ExtractKey<B>,
    C: ExtractKey<B> + Clone,
{
    type Future = OrFuture<B, A, C>;

    fn extract(&mut self, request: http::Request<B>) -> Self::Future {
        OrFuture {
            state: OrState::First {
                fut: self.first.extract(request),
                second: Some(self.second.clone()),
            },
        }
    }
}

pin_project! {
    /// The future of [`Or`].
    pub struct OrFuture<B, A, C>
    where
        A: ExtractKey<B>,
        C: ExtractKey<B>,
    {
        #[pin]
        state: OrState<A::Future, C::Future, C>,
    }
}

pin_project! {
    #[project = OrStateProj]
    enum OrState<FA, FC, C> {
        First { #[pin] fut: FA, second: Option<C> },
        Second { #[pin] fut: FC },
        Done,
    }
}

impl<B, A, C> Future for OrFuture<B, A, C>
where
    A: ExtractKey<B>,
    C: ExtractKey<B>,
{
    type Output = Extracted<B>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                OrStateProj::First { fut, second } => {
                    let (request, key) = ready!(fut.poll(cx))?;
                    if key.is_some() {
                        state.set(OrState::Done);
                        return Poll::Ready(Ok((request, key)));
                    }
                    let mut second = second.take().expect("polled after completion");
                    let fut = second.extract(request);
                    state.set(OrState::Second { fut });
                }
                OrStateProj::Second { fut } => {
                    let out = ready!(fut.poll(cx));
                    state.set(OrState::Done);
                    return Poll::Ready(out);
                }
                OrStateProj::Done => panic!("OrFuture polled after completion"),
            }
        }
    }
}
