//! Length-prefixed messages on a QUIC stream, for the hello exchange.

use crate::wire::{self, Message, MAX_MESSAGE};

/// Why a framed message could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream failed or ended early.
    #[error("stream: {0}")]
    Read(#[from] quinn::ReadExactError),
    /// Writing failed.
    #[error("stream: {0}")]
    Write(#[from] quinn::WriteError),
    /// The length prefix exceeds the limit.
    #[error("frame of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge(usize),
    /// The bytes do not decode.
    #[error(transparent)]
    Decode(#[from] wire::DecodeError),
    /// Encoding failed.
    #[error(transparent)]
    Encode(#[from] wire::EncodeError),
}

impl FrameError {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            FrameError::Read(_) | FrameError::Write(_) => "stream",
            FrameError::TooLarge(_) => "oversized",
            FrameError::Decode(d) => d.label(),
            FrameError::Encode(_) => "encode",
        }
    }
}

/// Reads one message: a 2-byte big-endian length, then that many bytes. The length is
/// checked before anything is allocated.
pub async fn read(stream: &mut quinn::RecvStream) -> Result<Message, FrameError> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await?;
    let len = usize::from(u16::from_be_bytes(len));
    if len > MAX_MESSAGE {
        return Err(FrameError::TooLarge(len));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf).await?;
    Ok(wire::decode(&buf)?)
}

/// One message with its length prefix, ready to write on a stream. Sans IO, for the
/// session machines ([`crate::session`]), which hand their drivers bytes to send.
pub fn encode(msg: &Message) -> Result<Vec<u8>, wire::EncodeError> {
    crate::protocol::Protocol::CURRENT.frame(msg)
}

/// Writes one message with its length prefix.
pub async fn write(stream: &mut quinn::SendStream, msg: &Message) -> Result<(), FrameError> {
    stream.write_all(&encode(msg)?).await?;
    Ok(())
}
