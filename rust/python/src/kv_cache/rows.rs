//! The tuples a `KVCachePool` hands Python, named.

/// A KV-cache group as Python sees it: (kind, layers, window or chunk).
pub(crate) type GroupRow = (&'static str, Vec<usize>, Option<usize>);

/// An explained prefix lookup: (hit tokens, reason, limiting group, per group: (cached tokens,
/// reason), per tier: (tier, tokens)).
pub(super) type PrefixRow = (
    usize,
    &'static str,
    Option<usize>,
    Vec<GroupReason>,
    Vec<TierRun>,
);
pub(super) type GroupReason = (usize, &'static str);
pub(super) type TierRun = (&'static str, usize);
