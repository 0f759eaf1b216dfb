//! Chained, collision-resistant block hashes for prefix caching.
//!
//! A full block is named by BLAKE3(parent hash ‖ its token ids), truncated to 128 bits. The
//! chain makes a block's name depend on the whole prefix before it; the root of the chain is
//! derived from the sequence's `cache_salt`, so two tenants with different salts never share
//! (or can probe) each other's blocks. A cryptographic hash matters here: with a weak hash an
//! attacker can craft a prompt whose block collides with a victim's and read its K/V.

/// 128-bit name of a full block's contents and everything before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Parent of a sequence's first block.
    pub fn root(cache_salt: Option<&[u8]>) -> BlockHash {
        match cache_salt {
            None => BlockHash(0),
            Some(salt) => {
                let mut hasher = blake3::Hasher::new_derive_key("atb-mem 2026 prefix-cache salt");
                hasher.update(salt);
                BlockHash::from_digest(hasher.finalize())
            }
        }
    }

    /// Hash of a full block whose parent block has hash `self`.
    #[inline]
    pub fn chain(self, token_ids: &[u32]) -> BlockHash {
        let mut hasher = blake3::Hasher::new();
        hasher.update(&self.0.to_le_bytes());
        update_with_tokens(&mut hasher, token_ids);
        BlockHash::from_digest(hasher.finalize())
    }

    #[inline]
    fn from_digest(digest: blake3::Hash) -> BlockHash {
        let mut low = [0u8; 16];
        low.copy_from_slice(&digest.as_bytes()[..16]);
        BlockHash(u128::from_le_bytes(low))
    }
}

#[inline]
fn update_with_tokens(hasher: &mut blake3::Hasher, token_ids: &[u32]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: u32 has no padding and any byte pattern is a valid u8; on little-endian
        // targets this is exactly the little-endian encoding of the ids.
        let bytes = unsafe {
            std::slice::from_raw_parts(token_ids.as_ptr().cast::<u8>(), std::mem::size_of_val(token_ids))
        };
        hasher.update(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for token in token_ids {
        hasher.update(&token.to_le_bytes());
    }
}

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
        assert_ne!(root.chain(&[1, 2]).chain(&[3]), root.chain(&[1]).chain(&[2, 3]));
    }
}
