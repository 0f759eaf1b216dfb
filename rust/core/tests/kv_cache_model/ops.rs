//! The operations the KV-cache model test draws: every call of the cache, and a mix that keeps a
//! small device evicting prefixes that later prompts ask for again.

use proptest::prelude::*;

use super::VOCAB;

#[derive(Debug, Clone)]
pub enum Op {
    AllocCount {
        id: u64,
        count: usize,
    },
    AllocIds {
        id: u64,
        ids: Vec<u32>,
        salted: bool,
    },
    Append {
        ids: Vec<u64>,
        n: usize,
        with_token_ids: bool,
    },
    Fork {
        parent: u64,
        child: u64,
    },
    Free {
        id: u64,
    },
    BatchAdd {
        id: u64,
    },
    BatchRemove {
        id: u64,
    },
    BatchAppend {
        with_token_ids: bool,
    },
    SwapOut {
        ids: Vec<u64>,
    },
    SwapIn {
        ids: Vec<u64>,
    },
    Compute {
        id: u64,
    },
    Reset,
}

pub fn op() -> impl Strategy<Value = Op> {
    let id = 0u64..8;
    prop_oneof![
        (id.clone(), 0usize..12).prop_map(|(id, count)| Op::AllocCount { id, count }),
        (
            id.clone(),
            prop::collection::vec(0..VOCAB, 0..12),
            any::<bool>()
        )
            .prop_map(|(id, ids, salted)| Op::AllocIds { id, ids, salted }),
        (
            prop::collection::vec(id.clone(), 0..4),
            0usize..5,
            any::<bool>()
        )
            .prop_map(|(ids, n, with_token_ids)| Op::Append {
                ids,
                n,
                with_token_ids
            }),
        (id.clone(), id.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        id.clone().prop_map(|id| Op::Free { id }),
        id.clone().prop_map(|id| Op::BatchAdd { id }),
        id.prop_map(|id| Op::BatchRemove { id }),
        any::<bool>().prop_map(|with_token_ids| Op::BatchAppend { with_token_ids }),
        prop::collection::vec(0u64..8, 0..3).prop_map(|ids| Op::SwapOut { ids }),
        prop::collection::vec(0u64..8, 0..3).prop_map(|ids| Op::SwapIn { ids }),
        (0u64..8).prop_map(|id| Op::Compute { id }),
        (0u64..8).prop_map(|id| Op::Compute { id }),
        Just(Op::Reset),
    ]
}

/// Ops that keep a small device busy with prompts that share prefixes, admitted, computed
/// and freed over and over: cached blocks are evicted (demoted) and found again (promoted).
pub fn tier_op() -> impl Strategy<Value = Op> {
    let id = 0u64..6;
    // Prompts of a few families: a family's prompts share their leading tokens.
    let prompt = (0u32..3, 1usize..13).prop_map(|(family, len)| {
        (0..len as u32)
            .map(|t| (family * 5 + t * (family + 1)) % VOCAB)
            .collect::<Vec<u32>>()
    });
    prop_oneof![
        5 => (id.clone(), prompt, any::<bool>())
            .prop_map(|(id, ids, salted)| Op::AllocIds { id, ids, salted }),
        5 => id.clone().prop_map(|id| Op::Compute { id }),
        4 => id.clone().prop_map(|id| Op::Free { id }),
        1 => (prop::collection::vec(id.clone(), 0..3), 1usize..4, any::<bool>())
            .prop_map(|(ids, n, with_token_ids)| Op::Append { ids, n, with_token_ids }),
        1 => (id.clone(), id.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        1 => prop::collection::vec(id.clone(), 0..2).prop_map(|ids| Op::SwapOut { ids }),
        1 => prop::collection::vec(id.clone(), 0..2).prop_map(|ids| Op::SwapIn { ids }),
        1 => id.clone().prop_map(|id| Op::BatchAdd { id }),
        1 => any::<bool>().prop_map(|with_token_ids| Op::BatchAppend { with_token_ids }),
        1 => id.prop_map(|id| Op::BatchRemove { id }),
    ]
}
