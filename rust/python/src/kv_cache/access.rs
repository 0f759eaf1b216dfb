//! Reaching a `KVCachePool`'s core: its lock, and work that releases the GIL.

use atb_mem_core::KvCache;
use pyo3::prelude::*;

use super::PyKvCachePool;
use crate::lock::Guard;

/// Work (sequences, tokens or table cells) above which a call releases the GIL while it runs.
pub(crate) const DETACH_ABOVE: usize = 4096;

impl PyKvCachePool {
    pub(crate) fn lock(&self) -> PyResult<Guard<'_, KvCache>> {
        self.cache.lock()
    }

    /// The lock for a transaction that runs Python (the byte executor) while holding it.
    pub(crate) fn lock_running_python(&self) -> PyResult<Guard<'_, KvCache>> {
        self.cache.lock_running_python()
    }

    /// Runs `work` on the locked cache, releasing the GIL (not the lock) when `size` is large.
    pub(super) fn run<R: Send>(
        &self,
        py: Python<'_>,
        size: usize,
        work: impl FnOnce(&mut KvCache) -> R + Send,
    ) -> PyResult<R> {
        let mut guard = self.lock()?;
        let cache: &mut KvCache = &mut guard;
        Ok(if size > DETACH_ABOVE {
            py.detach(|| work(cache))
        } else {
            work(cache)
        })
    }
}
