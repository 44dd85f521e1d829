//! A service value too large for one etcd request, stored in pieces.
//!
//! etcd refuses a request over `--max-request-bytes` (1.5 MiB by default), and a
//! service of some 10,000 endpoints has a larger value. Such a value is cut into
//! chunks of at most [`CHUNK_BYTES`], each put under
//! `<prefix>/chunks/<service>/<generation>/<index>`, and the service's own key then
//! holds a small [`Manifest`] naming the generation, the number of chunks and the
//! value's length. The manifest is written last, in the same fenced transaction as any
//! other value of the service, together with the deletion of every other generation's
//! chunks: a reader that finds a manifest at revision `R` reads the chunks at revision
//! `R` and gets exactly the value that was current then, however many writes came
//! since (until etcd compacts `R` away; the reader then reads again).
//!
//! A service whose value fits in one request is stored whole, as before, so that
//! every service of an ordinary fleet keeps one key a tool can watch and read alone.
//! Nothing here does I/O: the etcd store and the tests drive the same functions.

use serde::{Deserialize, Serialize};

/// The most bytes of one chunk: well below etcd's default request limit of 1.5 MiB,
/// with room for the key and the transaction around it.
pub const CHUNK_BYTES: usize = 1 << 20;

/// What a service's key holds when its value is stored in chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Where the value is.
    pub chunked: Chunked,
}

/// Where a chunked value is, and how to check it whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chunked {
    /// The write's generation: its chunks' keys are under
    /// `<prefix>/chunks/<service>/<generation>/`.
    pub generation: String,
    /// How many chunks, keyed `00000` onwards.
    pub chunks: u32,
    /// The value's length in bytes, all chunks together.
    pub bytes: u64,
}

/// Why chunks read back do not make the value their manifest describes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// A different number of chunks than the manifest says.
    #[error("{found} chunks of generation {generation}, the manifest says {expected}")]
    Count {
        /// The manifest's generation.
        generation: String,
        /// The manifest's count.
        expected: u32,
        /// What was read.
        found: usize,
    },
    /// The chunks' lengths add up to another length than the manifest's.
    #[error(
        "the chunks of generation {generation} hold {found} bytes, the manifest says {expected}"
    )]
    Length {
        /// The manifest's generation.
        generation: String,
        /// The manifest's length.
        expected: u64,
        /// What the chunks hold.
        found: u64,
    },
}

impl Manifest {
    /// The manifest of a value of `bytes` bytes cut into `chunks` chunks of
    /// `generation`.
    pub fn new(generation: &str, chunks: usize, bytes: usize) -> Manifest {
        Manifest {
            chunked: Chunked {
                generation: generation.to_string(),
                chunks: u32::try_from(chunks).unwrap_or(u32::MAX),
                bytes: u64::try_from(bytes).unwrap_or(u64::MAX),
            },
        }
    }

    /// The manifest `value` is, or `None` when it is anything else (a service's
    /// snapshot, which is read as it is). A snapshot is never taken for a manifest: it
    /// does not start with the manifest's one field.
    pub fn parse(value: &[u8]) -> Option<Chunked> {
        if !value.starts_with(b"{\"chunked\"") || value.len() > 4096 {
            return None;
        }
        serde_json::from_slice::<Manifest>(value)
            .ok()
            .map(|m| m.chunked)
    }

    /// The manifest as its key holds it.
    pub fn to_vec(&self) -> Vec<u8> {
        // A struct of strings and integers always encodes.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The range every chunk of `service` lives in: `<prefix>/chunks/<service>/`.
pub fn chunks_prefix(prefix: &str, service: &str) -> String {
    format!("{prefix}/chunks/{service}/")
}

/// The range of one generation's chunks: `<prefix>/chunks/<service>/<generation>/`.
pub fn generation_prefix(prefix: &str, service: &str, generation: &str) -> String {
    format!("{}{generation}/", chunks_prefix(prefix, service))
}

/// The key of chunk `index` of a generation; keys sort in chunk order.
pub fn chunk_key(prefix: &str, service: &str, generation: &str, index: usize) -> String {
    format!(
        "{}{index:05}",
        generation_prefix(prefix, service, generation)
    )
}

/// The end of the range of keys that start with `start` (etcd's `range_end` for a
/// prefix): `start` with its last byte raised by one.
pub fn prefix_end(start: &str) -> Vec<u8> {
    let mut end = start.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte was 0xff: the range runs to the end of the key space.
    vec![0]
}

/// `value` cut into chunks of at most [`CHUNK_BYTES`].
pub fn split(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.chunks(CHUNK_BYTES)
}

/// The value `manifest` describes, from its chunks in key order.
pub fn assemble(manifest: &Chunked, chunks: &[Vec<u8>]) -> Result<Vec<u8>, ChunkError> {
    if chunks.len() != manifest.chunks as usize {
        return Err(ChunkError::Count {
            generation: manifest.generation.clone(),
            expected: manifest.chunks,
            found: chunks.len(),
        });
    }
    let found: u64 = chunks.iter().map(|c| c.len() as u64).sum();
    if found != manifest.bytes {
        return Err(ChunkError::Length {
            generation: manifest.generation.clone(),
            expected: manifest.bytes,
            found,
        });
    }
    Ok(chunks.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_splits_and_assembles_back() {
        let value: Vec<u8> = (0..(2 * CHUNK_BYTES + 17))
            .map(|i| (i % 251) as u8)
            .collect();
        let chunks: Vec<Vec<u8>> = split(&value).map(<[u8]>::to_vec).collect();
        assert_eq!(chunks.len(), 3);
        let m = Manifest::new("g1", chunks.len(), value.len());
        let parsed = Manifest::parse(&m.to_vec()).expect("a manifest");
        assert_eq!(parsed, m.chunked);
        assert_eq!(assemble(&parsed, &chunks).expect("whole"), value);
        assert!(matches!(
            assemble(&parsed, &chunks[..2]),
            Err(ChunkError::Count { found: 2, .. })
        ));
        let mut short = chunks.clone();
        short[2].pop();
        assert!(matches!(
            assemble(&parsed, &short),
            Err(ChunkError::Length { .. })
        ));
    }

    #[test]
    fn only_a_manifest_reads_as_one() {
        assert_eq!(
            Manifest::parse(br#"{"version":3,"cycle":3,"endpoints":{}}"#),
            None
        );
        assert_eq!(Manifest::parse(br#"{"chunked":{"generation":"g"}}"#), None);
        assert_eq!(
            Manifest::parse(br#"{"chunked":{"generation":"g","chunks":1,"bytes":2,"x":1}}"#),
            None
        );
        assert_eq!(Manifest::parse(b"{\"chunked\""), None);
    }

    #[test]
    fn keys_sort_in_chunk_order_within_their_ranges() {
        let k = |i| chunk_key("/b", "web", "g7", i);
        assert_eq!(k(0), "/b/chunks/web/g7/00000");
        assert!(k(9) < k(10) && k(99) < k(100));
        let range = generation_prefix("/b", "web", "g7");
        assert!(k(3).starts_with(&range));
        assert!(k(3).as_bytes() < prefix_end(&range).as_slice());
        assert_eq!(prefix_end("/b/chunks/web/"), b"/b/chunks/web0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }
}
