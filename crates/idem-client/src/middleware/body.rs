//! Body types of the middleware: `IdemBody` (the inner body untouched, a
//! buffered body, or a buffered prefix followed by the rest of the inner
//! body) and `collect_limited`, which buffers a body up to a size limit.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

/// Error type of the bodies the middleware hands on.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// Request body given to the inner service, and response body of the
    /// middleware.
    pub struct IdemBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes> },
        Resumed { prefix: Option<Bytes>, rest: Pin<Box<B>> },
    }
}

impl<B> IdemBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        IdemBody {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        IdemBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    pub(crate) fn resumed(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        IdemBody {
            kind: Kind::Resumed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            },
        }
    }
}

impl<B> Body for IdemBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx).map(boxed_error),
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Resumed { prefix, rest } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => rest.as_mut().poll_frame(cx).map(boxed_error),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
            Kind::Resumed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Resumed { prefix, rest } => {
                let prefix_len = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + prefix_len);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + prefix_len);
                }
                hint
            }
        }
    }
}

fn boxed_error<E: Into<BoxError>>(
    frame: Option<Result<Frame<Bytes>, E>>,
) -> Option<Result<Frame<Bytes>, BoxError>> {
    frame.map(|r| r.map_err(Into::into))
}

/// A body read up to a limit.
pub(crate) enum Collected<B> {
    /// The whole body (trailers are dropped).
    Complete(Bytes),
    /// The body is longer than the limit: what was read, and the rest.
    Overflow { prefix: Bytes, rest: Pin<Box<B>> },
}

/// Reads `body` into memory, stopping once it exceeds `limit` bytes. A body
/// whose size hint rules out an overflow is read in place (and fails if it
/// breaks that hint past the limit); one that comes in a single frame is kept
/// as it is, without a copy.
pub(crate) async fn collect_limited<B>(body: B, limit: usize) -> Result<Collected<B>, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let hint = body.size_hint();
    if hint.upper().is_some_and(|upper| upper <= limit as u64) {
        let body = std::pin::pin!(body);
        let mut buffer = Buffer::with_capacity(hint.lower());
        if read_into(body, &mut buffer, limit).await? {
            return Err("the body is longer than its size hint".into());
        }
        return Ok(Collected::Complete(buffer.freeze()));
    }
    let mut body = Box::pin(body);
    let mut buffer = Buffer::with_capacity(hint.lower().min(limit as u64 + 1));
    if read_into(body.as_mut(), &mut buffer, limit).await? {
        return Ok(Collected::Overflow {
            prefix: buffer.freeze(),
            rest: body,
        });
    }
    Ok(Collected::Complete(buffer.freeze()))
}

/// Reads data frames into `buffer` until the body ends (`false`) or the
/// buffer holds more than `limit` bytes (`true`).
async fn read_into<B>(
    mut body: Pin<&mut B>,
    buffer: &mut Buffer,
    limit: usize,
) -> Result<bool, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(Into::into)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buffer.push(data);
        if buffer.len() > limit {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Bytes read so far: the first frame as it came, copied into one buffer
/// (sized by the body's hint) once a second one arrives.
struct Buffer {
    hint: usize,
    first: Bytes,
    all: Option<BytesMut>,
}

impl Buffer {
    fn with_capacity(hint: u64) -> Self {
        Buffer {
            hint: usize::try_from(hint).unwrap_or(0),
            first: Bytes::new(),
            all: None,
        }
    }

    fn push(&mut self, data: Bytes) {
        if let Some(all) = &mut self.all {
            all.extend_from_slice(&data);
        } else if self.first.is_empty() {
            self.first = data;
        } else if !data.is_empty() {
            let mut all = BytesMut::with_capacity(self.hint.max(self.first.len() + data.len()));
            all.extend_from_slice(&std::mem::take(&mut self.first));
            all.extend_from_slice(&data);
            self.all = Some(all);
        }
    }

    fn len(&self) -> usize {
        self.all.as_ref().map_or(self.first.len(), BytesMut::len)
    }

    fn freeze(self) -> Bytes {
        match self.all {
            Some(all) => all.freeze(),
            None => self.first,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};

    fn chunks(parts: &[&'static str]) -> impl Body<Data = Bytes, Error = BoxError> {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn collects_within_limit() {
        let Collected::Complete(all) = collect_limited(chunks(&["ab", "cd"]), 4).await.unwrap()
        else {
            panic!("expected the whole body");
        };
        assert_eq!(all, "abcd");
    }

    #[tokio::test]
    async fn overflow_keeps_every_byte() {
        let Collected::Overflow { prefix, rest } = collect_limited(chunks(&["ab", "cd", "ef"]), 3)
            .await
            .unwrap()
        else {
            panic!("expected an overflow");
        };
        assert_eq!(prefix, "abcd");
        let resumed = IdemBody::resumed(prefix, rest);
        let all = resumed.collect().await.unwrap().to_bytes();
        assert_eq!(all, "abcdef");
    }

    #[tokio::test]
    async fn a_single_frame_is_kept_without_a_copy() {
        let data = Bytes::from(vec![7u8; 64]);
        let Collected::Complete(all) = collect_limited(Full::new(data.clone()), 64).await.unwrap()
        else {
            panic!("expected the whole body");
        };
        assert_eq!(all.as_ptr(), data.as_ptr());
        assert_eq!(all, data);
    }

    #[tokio::test]
    async fn a_known_size_over_the_limit_overflows() {
        let body = Full::new(Bytes::from_static(b"0123456789"));
        let Collected::Overflow { prefix, rest } = collect_limited(body, 4).await.unwrap() else {
            panic!("expected an overflow");
        };
        let resumed = IdemBody::resumed(prefix, rest);
        assert_eq!(resumed.collect().await.unwrap().to_bytes(), "0123456789");
    }

    /// A body that says it has 2 bytes and has more.
    struct Understated(Option<Bytes>);

    impl Body for Understated {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.0.take().map(|data| Ok(Frame::data(data))))
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(2)
        }
    }

    #[tokio::test]
    async fn a_body_past_its_size_hint_and_the_limit_fails() {
        let body = Understated(Some(Bytes::from_static(b"0123456789")));
        assert!(collect_limited(body, 4).await.is_err());
    }

    #[tokio::test]
    async fn full_body_reports_exact_size() {
        let body: IdemBody<Full<Bytes>> = IdemBody::full(Bytes::from_static(b"hello"));
        assert_eq!(body.size_hint().exact(), Some(5));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "hello");
        let empty: IdemBody<Full<Bytes>> = IdemBody::full(Bytes::new());
        assert!(empty.is_end_stream());
    }
}
