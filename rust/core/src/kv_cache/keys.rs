//! The names blocks are cached under, beyond a block's own chain hash: a group's key, a
//! state checkpoint's keys and a block's sub-block keys; and which of them a lower tier may
//! keep. A leaf: the parts that cache, look up, demote or explain blocks all name them, and
//! none of them owns them.

use crate::alloc::BlockHash;

/// The prefix-cache key of a block of group `group`: group 0 keeps the chain's hash itself (a
/// one-group cache and KV events see the plain hashes); other groups XOR a constant of their
/// own in, so the same tokens cached by two groups are two entries. XOR undoes itself:
/// `group_key(group_key(hash, g), g) == hash`, which names an evicted block for its event
/// from its key and group alone. (The chain's hash is uniform, so its XOR with a constant is
/// as well spread in the prefix table.)
#[inline]
pub fn group_key(hash: BlockHash, group: usize) -> BlockHash {
    let group = group as u64;
    BlockHash([
        hash.0[0] ^ group.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        hash.0[1] ^ group,
    ])
}

/// The second word of every checkpoint key: what tells one from a K/V block's key (which
/// has it with odds of 2^-64), so that whoever mirrors the cache from its KV events can leave
/// checkpoints out.
const CHECKPOINT_TAG: u64 = 0x5354_4154_4543_4B50;

/// The key of the `column`-th block of the checkpoint at the end of the block named `hash`:
/// 64 bits of the chain hash, mixed with the column, and the tag.
#[inline]
pub fn checkpoint_key(hash: BlockHash, column: usize) -> BlockHash {
    let mixed = group_key(hash, column + 1);
    BlockHash([mixed.0[0], CHECKPOINT_TAG])
}

/// Whether `key` names a block of a state checkpoint rather than K/V.
#[inline]
pub fn is_checkpoint_key(key: BlockHash) -> bool {
    key.0[1] == CHECKPOINT_TAG
}

/// Whether a device block cached under `key` may be demoted to the host tier when evicted: a
/// checkpoint's may not, since hits resume only from checkpoints on the device.
#[inline]
pub(super) fn may_demote(key: BlockHash) -> bool {
    !is_checkpoint_key(key)
}

/// The keys of the leading `piece`-token pieces of `tokens`, chained after `parent`: `s_1`,
/// `s_2`, ... (what a lookup asks for and what a cached block is indexed by).
pub(super) fn piece_keys(
    parent: BlockHash,
    tokens: &[u32],
    piece: usize,
) -> impl Iterator<Item = BlockHash> + '_ {
    tokens.chunks_exact(piece).scan(parent, |key, chunk| {
        *key = key.chain(chunk);
        Some(*key)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_keys_differ_except_group_zero() {
        let hash = BlockHash([7, 9]);
        assert_eq!(group_key(hash, 0), hash);
        assert_ne!(group_key(hash, 1), hash);
        assert_ne!(group_key(hash, 1), group_key(hash, 2));
        assert_eq!(group_key(group_key(hash, 3), 3), hash);
    }

    #[test]
    fn checkpoint_keys_are_told_from_block_keys() {
        let hash = BlockHash([7, 9]);
        assert!(is_checkpoint_key(checkpoint_key(hash, 0)));
        assert_ne!(checkpoint_key(hash, 0), checkpoint_key(hash, 1));
        assert!(!is_checkpoint_key(group_key(hash, 1)));
        assert!(!may_demote(checkpoint_key(hash, 2)) && may_demote(hash));
    }
}
