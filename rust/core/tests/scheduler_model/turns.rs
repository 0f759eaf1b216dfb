//! Conversations: a request whose prompt continues an ended request's tokens, as a chat's
//! next turn does. With `hash_block_size` the ended request's last, partly filled block
//! serves its computed pieces to it (issue 39 item 7), so the byte simulation checks those
//! copies against every step, failure and eviction around them.

use atb_mem_core::Tokens;
use proptest::prelude::*;

use super::workload::{tier_op, Op};
use super::Harness;

/// Ended requests a next turn may continue (the most recent ones).
const ENDED: usize = 4;
/// The longest prompt a next turn makes: a small device holds a few of them.
const LONGEST: usize = 16;

/// `tier_op`'s workload with next turns of ended requests among its arrivals.
pub fn turn_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => tier_op(),
        1 => (0usize..ENDED, prop::collection::vec(0u32..4, 1..3), 1usize..4)
            .prop_map(|(pick, tail, max_new)| Op::NextTurn { pick, tail, max_new }),
    ]
}

impl Harness {
    /// Keeps the tokens of a request that ends, if all of them are known ids.
    pub(super) fn remember_ended(&mut self, seq_id: u64) {
        let Some(ids) = self.ids.get(&seq_id) else {
            return;
        };
        if let Some(known) = ids.iter().copied().collect::<Option<Vec<u32>>>() {
            if self.ended.len() == ENDED {
                self.ended.remove(0);
            }
            self.ended.push(known);
        }
    }

    /// Adds a request whose prompt is an ended request's tokens and then `tail`.
    pub(super) fn next_turn(&mut self, pick: usize, tail: &[u32], max_new: usize) {
        let Some(ended) = self.ended.get(pick % self.ended.len().max(1)) else {
            return;
        };
        let mut prompt = ended.clone();
        prompt.extend_from_slice(tail);
        prompt.truncate(LONGEST);
        let seq_id = self.next_id;
        self.next_id += 1;
        let tokens = Tokens::Ids(&prompt);
        if self
            .scheduler
            .add_request(&mut self.cache, seq_id, tokens, max_new, 1, 0, 0)
            .is_ok()
        {
            self.planned_forks.insert(seq_id, 0);
            self.ids
                .insert(seq_id, prompt.iter().copied().map(Some).collect());
            self.offer_stored_prefix(seq_id, &prompt);
        }
    }
}
