//! [`Pending`]: the result of an `*_async` operation, which may not have
//! arrived yet.

use std::time::Duration;

use crate::error::{Error, Result};

/// Something that produces a `T` later: an RPC reply slot, or a value that
/// is already there. Implemented by the RPC client's reply slots and by
/// [`Pending::ready`]; tests implement it to delay or lose replies.
pub trait Waitable<T>: Send + Sync {
    /// Whether the result (or the failure) is in.
    fn is_done(&self) -> bool;
    /// Waits up to `timeout` (None = forever). [`Error::Timeout`] leaves the
    /// call pending, so the caller may wait again on the same reply; any
    /// other result is final and is returned again by later waits.
    fn wait(&self, timeout: Option<Duration>) -> Result<T>;
    /// Gives up on the result: a late reply is dropped. The default does
    /// nothing (nothing is outstanding).
    fn abandon(&self) {}
}

/// The future of one `*_async` operation of [`super::CheckpointsAsync`].
pub struct Pending<T> {
    inner: Box<dyn Waitable<T>>,
    operation: &'static str,
}

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("operation", &self.operation)
            .field("done", &self.is_done())
            .finish()
    }
}

impl<T> Pending<T> {
    /// A future of `operation` whose result comes from `inner`.
    pub fn new(operation: &'static str, inner: impl Waitable<T> + 'static) -> Pending<T> {
        Pending {
            inner: Box::new(inner),
            operation,
        }
    }

    /// The operation's name (`"prepare_store"`, ...), for messages.
    pub fn operation(&self) -> &'static str {
        self.operation
    }

    /// Whether the result (or the failure) is in.
    pub fn is_done(&self) -> bool {
        self.inner.is_done()
    }

    /// Waits up to `timeout` (None = forever); see [`Waitable::wait`].
    pub fn wait(&self, timeout: Option<Duration>) -> Result<T> {
        self.inner.wait(timeout)
    }

    /// Waits up to `timeout` and, if the reply did not come, gives up on it
    /// (a late reply is dropped): what a blocking call does.
    pub fn wait_or_abandon(&self, timeout: Duration) -> Result<T> {
        let result = self.inner.wait(Some(timeout));
        if matches!(&result, Err(Error::Timeout(_))) {
            self.inner.abandon();
        }
        result
    }
}

impl<T: Clone + Send + Sync + 'static> Pending<T> {
    /// A future that is already resolved (an in-process service answers at
    /// once). Every wait returns the same result; an error is returned with
    /// its kind and message ([`Error::replicate`]).
    pub fn ready(operation: &'static str, result: Result<T>) -> Pending<T> {
        Pending::new(operation, Ready(result))
    }
}

/// A result computed before anyone waited.
struct Ready<T>(Result<T>);

impl<T: Clone + Send + Sync> Waitable<T> for Ready<T> {
    fn is_done(&self) -> bool {
        true
    }
    fn wait(&self, _timeout: Option<Duration>) -> Result<T> {
        match &self.0 {
            Ok(value) => Ok(value.clone()),
            Err(e) => Err(e.replicate()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn a_ready_future_answers_every_wait_with_the_same_result() {
        let ok = Pending::ready("status", Ok(7_u32));
        assert!(ok.is_done());
        assert_eq!(ok.wait(None).unwrap(), 7);
        assert_eq!(ok.wait(Some(Duration::ZERO)).unwrap(), 7);
        let failed: Pending<u32> = Pending::ready("abort", Err(Error::NotFound("gone".into())));
        for _ in 0..2 {
            let e = failed.wait(None).unwrap_err();
            assert_eq!(
                (e.kind(), e.to_string()),
                (ErrorKind::NotFound, "gone".into())
            );
        }
        assert_eq!(failed.operation(), "abort");
    }
}
