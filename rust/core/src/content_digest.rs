//! Content digests of large byte buffers (a model's weights), for keys that must change when
//! any byte does: a KV block another model computed is never served as this one's.
//!
//! Each buffer is cut into [`PIECE_BYTES`] pieces hashed with BLAKE3 on worker threads; a
//! buffer's digest is the BLAKE3 of its length and its pieces' digests in order. The result
//! depends on the bytes alone, never on how many threads ran or in which order, and the
//! cost is one pass over the bytes spread over the threads: the pieces are big enough that
//! BLAKE3's SIMD lanes stay busy and small enough that a single large tensor (an embedding
//! table) still spreads over every thread.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Bytes per piece hashed by one thread at a time.
pub const PIECE_BYTES: usize = 8 << 20;

/// A 32-byte BLAKE3 digest.
pub type Digest = [u8; 32];

/// The digest of each buffer in `buffers`, computed on up to `threads` threads (0: as many
/// as the machine has).
pub fn content_digests(buffers: &[&[u8]], threads: usize) -> Vec<Digest> {
    // Piece k of all buffers, in order: (buffer, start, end).
    let pieces: Vec<(usize, usize, usize)> = buffers
        .iter()
        .enumerate()
        .flat_map(|(index, bytes)| {
            let count = bytes.len().div_ceil(PIECE_BYTES).max(1);
            (0..count).map(move |piece| {
                let start = piece * PIECE_BYTES;
                (index, start, (start + PIECE_BYTES).min(bytes.len()))
            })
        })
        .collect();
    let digests = Mutex::new(vec![[0u8; 32]; pieces.len()]);
    let next = AtomicUsize::new(0);
    let work = || loop {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(index, start, end)) = pieces.get(k) else {
            return;
        };
        let digest = *blake3::hash(&buffers[index][start..end]).as_bytes();
        // Poisoning needs a panic in `blake3::hash`, which does not panic: take it either way.
        let mut digests = digests
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        digests[k] = digest;
    };
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
        n => n,
    }
    .min(pieces.len());
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
    let digests = digests
        .into_inner()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut done = digests.iter();
    buffers
        .iter()
        .map(|bytes| {
            let mut hasher = blake3::Hasher::new();
            hasher.update(&(bytes.len() as u64).to_le_bytes());
            for _ in 0..bytes.len().div_ceil(PIECE_BYTES).max(1) {
                hasher.update(done.next().expect("one digest per piece"));
            }
            *hasher.finalize().as_bytes()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn any_changed_byte_changes_the_digest() {
        let big = bytes(2 * PIECE_BYTES + 5, 1);
        let base = content_digests(&[&big], 1)[0];
        for position in [0, PIECE_BYTES - 1, PIECE_BYTES, 2 * PIECE_BYTES + 4] {
            let mut changed = big.clone();
            changed[position] ^= 1;
            assert_ne!(content_digests(&[&changed], 2)[0], base, "byte {position}");
        }
        assert_ne!(
            content_digests(&[&big[..big.len() - 1]], 1)[0],
            base,
            "a shorter buffer"
        );
    }

    #[test]
    fn the_digest_does_not_depend_on_threads() {
        let a = bytes(3 * PIECE_BYTES + 1, 2);
        let b = bytes(17, 3);
        let empty: &[u8] = &[];
        let one = content_digests(&[&a, &b, empty], 1);
        for threads in [0, 2, 3, 64] {
            assert_eq!(content_digests(&[&a, &b, empty], threads), one);
        }
        assert_eq!(one.len(), 3);
        assert_ne!(one[1], one[2]);
        assert!(content_digests(&[], 4).is_empty());
    }

    #[test]
    fn a_buffer_is_not_its_pieces_split_elsewhere() {
        // The same bytes cut into two buffers differ from one buffer (the length is hashed).
        let all = bytes(100, 4);
        let whole = content_digests(&[&all], 1);
        let split = content_digests(&[&all[..50], &all[50..]], 1);
        assert!(!split.contains(&whole[0]));
    }
}
