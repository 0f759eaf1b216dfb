//! Chained, collision-resistant block hashes for prefix caching.
//!
//! A full block is named by BLAKE3(parent hash ‖ its token ids), truncated to 128 bits. The
//! chain makes a block's name depend on the whole prefix before it; the root of the chain is
//! derived from the sequence's `cache_salt`, so two tenants with different salts never share
//! (or can probe) each other's blocks. A cryptographic hash matters here: with a weak hash an
//! attacker can craft a prompt whose block collides with a victim's and read its K/V.

/// 128-bit name of a full block's contents and everything before it. Two words rather than
/// a `u128` keep its alignment at 8, so it packs tightly into per-sequence state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BlockHash(pub [u64; 2]);

impl BlockHash {
    /// Parent of a sequence's first block.
    pub fn root(cache_salt: Option<&[u8]>) -> BlockHash {
        match cache_salt {
            None => BlockHash([0, 0]),
            Some(salt) => {
                let mut hasher = blake3::Hasher::new_derive_key("atb-mem 2026 prefix-cache salt");
                hasher.update(salt);
                BlockHash::from_digest(hasher.finalize())
            }
        }
    }

    /// Hash of a full block whose parent block has hash `self`.
    ///
    /// The parent keys BLAKE3 (keyed mode puts the key where the IV goes, which is exactly
    /// how BLAKE3 chains its own chunks), so a block of 16 tokens is one 64-byte compression.
    #[inline]
    pub fn chain(self, token_ids: &[u32]) -> BlockHash {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.0[0].to_le_bytes());
        key[8..16].copy_from_slice(&self.0[1].to_le_bytes());
        BlockHash::from_digest(blake3::keyed_hash(&key, token_bytes(token_ids)))
    }

    #[inline]
    fn from_digest(digest: blake3::Hash) -> BlockHash {
        let bytes = digest.as_bytes();
        let word =
            |i: usize| u64::from_le_bytes(bytes[i * 8..(i + 1) * 8].try_into().unwrap_or_default());
        BlockHash([word(0), word(1)])
    }
}

/// The ids as little-endian bytes: the memory itself on little-endian targets (all that
/// this crate supports; the compile-time check below says so).
#[inline]
fn token_bytes(token_ids: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding and every byte pattern is a valid u8.
    unsafe {
        std::slice::from_raw_parts(
            token_ids.as_ptr().cast::<u8>(),
            std::mem::size_of_val(token_ids),
        )
    }
}

#[cfg(not(target_endian = "little"))]
compile_error!(
    "atb-mem-core hashes token ids in memory order and supports little-endian targets only"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_parent_tokens_and_salt() {
        let tokens = [1u32, 2, 3, 4];
        let root = BlockHash::root(None);
        let a = root.chain(&tokens);
        assert_eq!(a, root.chain(&tokens));
        assert_ne!(a, root.chain(&[1, 2, 3, 5]));
        assert_ne!(a.chain(&tokens), a);
        let salted = BlockHash::root(Some(b"tenant-a"));
        assert_ne!(salted, root);
        assert_ne!(salted.chain(&tokens), a);
        assert_ne!(salted, BlockHash::root(Some(b"tenant-b")));
        // Token boundaries matter: [1, 2] then [3] is not [1] then [2, 3].
        assert_ne!(
            root.chain(&[1, 2]).chain(&[3]),
            root.chain(&[1]).chain(&[2, 3])
        );
    }
}
