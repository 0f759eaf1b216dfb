//! The tuples a `KVCachePool` hands Python, named.

/// A KV-cache group as Python sees it: (kind, layers, window or chunk).
pub(crate) type GroupRow = (&'static str, Vec<usize>, Option<usize>);

use atb_mem_core::PrefixExplanation;

/// An explained prefix lookup: (hit tokens, reason, limiting group, per group: (cached tokens,
/// reason), per tier: (tier, tokens), partial tokens).
pub(super) type PrefixRow = (
    usize,
    &'static str,
    Option<usize>,
    Vec<GroupReason>,
    Vec<TierRun>,
    usize,
);
pub(super) type GroupReason = (usize, &'static str);
pub(super) type TierRun = (&'static str, usize);

pub(super) fn prefix_row(why: &PrefixExplanation) -> PrefixRow {
    let groups = why.groups.iter();
    let groups = groups.map(|g| (g.cached_tokens, g.reason.name())).collect();
    let tiers = why.tiers.iter();
    let tiers = tiers.map(|&(tier, tokens)| (tier.name(), tokens)).collect();
    let (hit, reason, limited_by) = (why.hit_tokens, why.reason.name(), why.limited_by);
    (hit, reason, limited_by, groups, tiers, why.partial_tokens)
}
