//! Testing only: a store whose every request waits a fixed time before it
//! is sent (`SharedConfig::inject_latency`, the sidecar's
//! `shared_inject_latency`), so a `file://` tier behaves like a distant
//! object store. `object_store`'s own `ThrottledStore` cannot wrap the
//! local filesystem (its GETs answer a file, which it does not throttle).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::stream::{BoxStream, StreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// `inner`, each request held `wait` first (a listing or a batch of
/// deletes: once, before its first answer).
#[derive(Debug)]
pub(super) struct Delayed {
    inner: Arc<dyn ObjectStore>,
    wait: Duration,
}

impl Delayed {
    /// Wraps `inner`.
    pub(super) fn new(inner: Arc<dyn ObjectStore>, wait: Duration) -> Delayed {
        Delayed { inner, wait }
    }

    /// A stream that starts after the wait.
    fn later<T: Send + 'static>(
        &self,
        stream: BoxStream<'static, Result<T>>,
    ) -> BoxStream<'static, Result<T>> {
        let wait = self.wait;
        futures_util::stream::once(async move {
            tokio::time::sleep(wait).await;
            stream
        })
        .flatten()
        .boxed()
    }
}

impl fmt::Display for Delayed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Delayed({:?}, {})", self.wait, self.inner)
    }
}

#[async_trait]
impl ObjectStore for Delayed {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        tokio::time::sleep(self.wait).await;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        tokio::time::sleep(self.wait).await;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        tokio::time::sleep(self.wait).await;
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.later(self.inner.delete_stream(locations))
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.later(self.inner.list(prefix))
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.later(self.inner.list_with_offset(prefix, offset))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        tokio::time::sleep(self.wait).await;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        tokio::time::sleep(self.wait).await;
        self.inner.copy_opts(from, to, options).await
    }
}
