//! Error collection: every phase pushes what it finds, and the macro reports all of it at once
//! (one `compile_error!` per problem) instead of stopping at the first one.

use std::fmt::Display;

use proc_macro2::Span;

/// Accumulates `syn::Error`s with [`syn::Error::combine`].
#[derive(Default)]
pub(crate) struct Errors {
    combined: Option<syn::Error>,
}

impl Errors {
    /// Records one error.
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.combined {
            Some(combined) => combined.combine(error),
            None => self.combined = Some(error),
        }
    }

    /// Records one error spanned on `span`.
    pub(crate) fn error(&mut self, span: Span, message: impl Display) {
        self.push(syn::Error::new(span, message));
    }

    /// Records the error of `result`, if any, and returns its value.
    pub(crate) fn ok<T>(&mut self, result: syn::Result<T>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(error) => {
                self.push(error);
                None
            }
        }
    }

    /// `Err` with everything recorded, or `Ok(())` when nothing was.
    pub(crate) fn finish(self) -> syn::Result<()> {
        match self.combined {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}
