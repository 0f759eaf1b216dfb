//! What the tiers below the host (the disk, a shared store) tell the cache: the blocks they
//! stored or dropped (KV events), and the prefix hits their loads served (`stats`).

use atb_mem_core::{Medium, MissReason};
use pyo3::prelude::*;

use super::{events, PyKvCachePool};
use crate::convert::TokenIds;
use crate::errors::{value_error, IntoPyResult};

#[pymethods]
impl PyKvCachePool {
    /// `hashes` (uint64 pairs, a chain after `parent`, over `token_ids`) stored on `medium`
    /// (`"disk"` or `"store"`), or removed from it (`token_ids` empty).
    #[pyo3(signature = (medium, stored, hashes, parent, token_ids))]
    fn _record_tier_event(
        &self,
        medium: &str,
        stored: bool,
        hashes: Vec<[u64; 2]>,
        parent: Option<[u64; 2]>,
        token_ids: TokenIds<'_>,
    ) -> PyResult<()> {
        let event = events::TierEvent::new(medium, stored, &hashes, parent)?;
        let mut cache = self.lock()?;
        event.record(&mut cache, token_ids.as_slice())
    }

    /// `blocks` whole blocks of an admission's prefix that `medium` (`"disk"` or `"store"`)
    /// served, its load landed: hits with their tier in `stats`. `filled`: the admission's
    /// miss reason where the load served every block the prompt can hit.
    #[pyo3(signature = (medium, blocks, filled=None))]
    fn _record_tier_hits(&self, medium: &str, blocks: usize, filled: Option<&str>) -> PyResult<()> {
        let medium = Medium::from_name(medium)
            .ok_or_else(|| value_error(format!("unknown medium {medium:?}: disk or store")))?;
        let filled = filled
            .map(|name| {
                MissReason::from_name(name)
                    .ok_or_else(|| value_error(format!("unknown miss reason {name:?}")))
            })
            .transpose()?;
        self.lock()?
            .record_tier_hits(medium, blocks, filled)
            .into_py_result()
    }
}
