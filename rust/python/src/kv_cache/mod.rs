//! `KVCachePool`: convert, lock, call the core, map errors. Its batch table, the byte
//! movers for host backings and the plan → execute → commit transactions are submodules.

mod access;
mod batch_table;
mod construct;
mod events;
pub mod host_copy;
mod lower_tiers;
mod retention;
mod rows;
mod state;
pub mod transfer;

use atb_mem_core::{pairs_of, BatchTable, BlockHash, KvCache, MoveKind};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

pub(crate) use access::DETACH_ABOVE;
pub use batch_table::PyBatchTable;
pub use events::PyKvEventList;
pub(crate) use retention::{retention_config, RangeArg};
pub(crate) use rows::GroupRow;
use rows::PrefixRow;

use crate::convert::{
    self, narrow_slots, pairs_to_array, to_2d, CacheSalt, Count, Positions, Prompt, SeqId, SeqIds,
    TokenIds,
};
use crate::errors::IntoPyResult;
use crate::lock::PyLock;

/// Paged KV cache: fixed-size blocks handed to sequences on demand, with prefix caching and
/// copy-on-write forks.
#[pyclass(frozen, name = "KVCachePool", module = "atb_mem._core")]
pub struct PyKvCachePool {
    cache: PyLock<KvCache>,
}

#[pymethods]
impl PyKvCachePool {
    /// Whether cached blocks the device evicts are kept in the host tier.
    #[getter]
    fn host_prefix_cache(&self) -> PyResult<bool> {
        Ok(self.lock()?.host_prefix_cache())
    }

    /// Which cached block goes first: `"priority"` (the default), `"lru"`, `"lfu"`, `"slru"`.
    #[getter]
    fn eviction_policy(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.eviction_policy().name())
    }

    /// Tokens per prefix key: `block_size` unless hits finer than a block were asked for.
    #[getter]
    fn hash_block_size(&self) -> PyResult<usize> {
        Ok(self.lock()?.hash_block_size())
    }

    #[getter]
    fn num_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_blocks())
    }

    #[getter]
    fn block_size(&self) -> PyResult<usize> {
        Ok(self.lock()?.block_size())
    }

    #[getter]
    fn num_layers(&self) -> PyResult<usize> {
        Ok(self.lock()?.layout().num_layers)
    }

    /// `(kind, layers, window)` per KV-cache group: transformers' layer-type name, the model
    /// layers in it, and the sliding window or chunk (None for full attention).
    #[getter]
    fn _groups(&self) -> PyResult<Vec<GroupRow>> {
        let cache = self.lock()?;
        let groups = cache.groups().iter();
        Ok(groups
            .map(|g| (g.kind.name(), g.layers.clone(), g.kind.span()))
            .collect())
    }

    /// How many layers' K/V one block holds: its group's layers share the block's slots.
    #[getter]
    fn layers_per_block(&self) -> PyResult<usize> {
        Ok(self.lock()?.layers_per_block())
    }

    /// `(group, slot)` of a model layer: its group's tables address it, at `slot` of a block.
    fn group_of_layer(&self, layer: Count<0>) -> PyResult<(usize, usize)> {
        self.lock()?.group_of_layer(layer.0).into_py_result()
    }

    #[getter]
    fn num_kv_heads(&self) -> PyResult<usize> {
        Ok(self.lock()?.layout().num_kv_heads)
    }

    #[getter]
    fn head_dim(&self) -> PyResult<usize> {
        Ok(self.lock()?.layout().head_dim)
    }

    #[getter]
    fn dtype(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.layout().dtype.name())
    }

    /// How the cache stores K/V: ``"auto"`` (in ``dtype``), ``"int8"`` or ``"fp8_e4m3"``.
    #[getter]
    fn kv_cache_dtype(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.layout().cache_dtype.name())
    }

    #[getter]
    fn enable_prefix_caching(&self) -> PyResult<bool> {
        Ok(self.lock()?.enable_prefix_caching())
    }

    #[getter]
    fn bytes_per_block(&self) -> PyResult<usize> {
        Ok(self.lock()?.bytes_per_block())
    }

    /// Blocks an allocation can take now: free plus evictable cached blocks.
    #[getter]
    fn num_free_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_free_blocks())
    }

    #[pyo3(signature = (seq_id, tokens, *, cache_salt=None))]
    fn alloc_sequence(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        tokens: Prompt<'_>,
        cache_salt: Option<CacheSalt>,
    ) -> PyResult<usize> {
        let seq_id = seq_id.0;
        let salt = cache_salt.as_ref().map(|salt| salt.0.as_slice());
        let tokens = tokens.tokens();
        self.run(py, tokens.len(), |cache| {
            cache.alloc_sequence(seq_id, tokens, salt)
        })?
        .into_py_result()
    }

    #[pyo3(signature = (tokens, *, cache_salt=None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        tokens: Prompt<'_>,
        cache_salt: Option<CacheSalt>,
    ) -> PyResult<bool> {
        let salt = cache_salt.as_ref().map(|salt| salt.0.as_slice());
        let tokens = tokens.tokens();
        self.run(py, tokens.len(), |cache| cache.can_allocate(tokens, salt))?
            .into_py_result()
    }

    /// Why `token_ids` would hit what it hits now: (hit tokens, reason, limiting group or
    /// None, [(cached tokens, reason)] per group, [(tier, tokens)] in order, partial tokens).
    /// `KVCachePool.explain_prefix` wraps it.
    #[pyo3(signature = (token_ids, *, cache_salt=None))]
    fn _explain_prefix(
        &self,
        token_ids: TokenIds<'_>,
        cache_salt: Option<CacheSalt>,
    ) -> PyResult<PrefixRow> {
        let salt = cache_salt.as_ref().map(|salt| salt.0.as_slice());
        let why = self.lock()?.explain_prefix(token_ids.as_slice(), salt);
        Ok(rows::prefix_row(&why.into_py_result()?))
    }

    /// The chain hashes of `token_ids`' full blocks, uint64 `[n, 2]`: what names a block in
    /// every tier (a lower tier's key), as `StepPlan.load_keys` does. With `parent` (a
    /// block's two hash words), the chain goes on from it over the tokens after it.
    #[pyo3(signature = (token_ids, *, cache_salt=None, parent=None))]
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        token_ids: TokenIds<'_>,
        cache_salt: Option<CacheSalt>,
        parent: Option<[u64; 2]>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if parent.is_some() && cache_salt.is_some() {
            return Err(PyValueError::new_err(
                "give cache_salt or parent, not both: the parent's chain holds its salt",
            ));
        }
        let salt = cache_salt.as_ref().map(|salt| salt.0.as_slice());
        let mut hashes = Vec::new();
        self.lock()?.block_hashes(
            token_ids.as_slice(),
            salt,
            parent.map(BlockHash),
            &mut hashes,
        );
        let words: Vec<u64> = hashes.iter().flat_map(|hash| hash.0).collect();
        Ok(words
            .into_pyarray(py)
            .reshape([hashes.len(), 2])?
            .into_any())
    }

    fn seq_len(&self, seq_id: SeqId) -> PyResult<usize> {
        let seq_id = seq_id.0;
        self.lock()?.seq_len(seq_id).into_py_result()
    }

    fn __contains__(&self, seq_id: SeqId) -> PyResult<bool> {
        let seq_id = seq_id.0;
        Ok(self.lock()?.contains(seq_id))
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_sequences())
    }

    /// Ids of the live sequences, sorted.
    fn seq_ids(&self) -> PyResult<Vec<u64>> {
        let mut ids: Vec<u64> = self.lock()?.seq_ids().collect();
        ids.sort_unstable();
        Ok(ids)
    }

    #[pyo3(signature = (seq_ids, n=None, token_ids=None))]
    fn append_tokens<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
        n: Option<Count<1>>,
        token_ids: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = n.map_or(1, Count::get);
        let ids = seq_ids.as_slice();
        let token_ids = match token_ids {
            Some(obj) => Some(TokenIds::extract_shaped(&obj, [ids.len(), n])?),
            None => None,
        };
        let token_slice = token_ids.as_ref().map(|ids| ids.as_slice());
        let mut slots = Vec::new();
        self.run(py, ids.len().saturating_mul(n), |cache| {
            cache.append_tokens(ids, n, token_slice, &mut slots)
        })?
        .into_py_result()?;
        let groups = slots.len() / (ids.len() * n).max(1);
        let slots = slots.into_pyarray(py);
        match groups {
            0 | 1 => Ok(slots.into_any()),
            _ => Ok(slots.reshape([groups, ids.len() * n])?.into_any()),
        }
    }

    #[pyo3(signature = (seq_ids, starts, ends, *, group=Count(0)))]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
        starts: Positions,
        ends: Positions,
        group: Count<0>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let starts = starts.0;
        let ends = ends.0;
        let ids = seq_ids.as_slice();
        let size: i64 = starts
            .iter()
            .zip(&ends)
            .map(|(start, end)| end.saturating_sub(*start).max(0))
            .fold(0i64, |total, span| total.saturating_add(span));
        let mut slots = Vec::new();
        self.run(py, size as usize, |cache| {
            cache.slot_mapping(group.0, ids, &starts, &ends, &mut slots)
        })?
        .into_py_result()?;
        Ok(slots.into_pyarray(py))
    }

    fn fork(&self, parent_id: SeqId, child_id: SeqId) -> PyResult<()> {
        let parent_id = parent_id.0;
        let child_id = child_id.0;
        self.lock()?.fork(parent_id, child_id).into_py_result()
    }

    fn free_sequence(&self, seq_id: SeqId) -> PyResult<()> {
        let seq_id = seq_id.0;
        self.lock()?.free_sequence(seq_id).into_py_result()
    }

    /// Records that the K/V of the first `num_tokens` tokens (all, with None) of the
    /// sequence is written; full blocks within them join the prefix cache. Returns how many.
    #[pyo3(signature = (seq_id, num_tokens=None))]
    fn mark_computed(&self, seq_id: SeqId, num_tokens: Option<Count<0>>) -> PyResult<usize> {
        let seq_id = seq_id.0;
        let mut cache = self.lock()?;
        let num_tokens = match num_tokens {
            Some(Count(n)) => n,
            None => cache.seq_len(seq_id).into_py_result()?,
        };
        cache
            .mark_computed(seq_id, Some(num_tokens))
            .into_py_result()
    }

    /// Tokens of the sequence whose K/V is known to be computed.
    fn num_computed(&self, seq_id: SeqId) -> PyResult<usize> {
        let seq_id = seq_id.0;
        self.lock()?.num_computed(seq_id).into_py_result()
    }

    /// The pending block moves, int32 `[k, 3]` of (kind, src, dst), without taking them.
    fn pending_moves<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        transfer::moves_to_array(py, self.lock()?.pending_moves())
    }

    /// Executes every pending move with `execute(moves)` as one transaction (see
    /// `BlockMoveError`); returns how many moves ran.
    fn execute_pending_moves(&self, py: Python<'_>, execute: &Bound<'_, PyAny>) -> PyResult<usize> {
        let (mut raised, mut executed) = (None, Vec::new());
        let result = self
            .lock_running_python()?
            .execute_pending_moves(transfer::executor(py, execute, &mut raised), &mut executed);
        transfer::into_py_result(result, raised)?;
        Ok(executed.len())
    }

    /// Takes the pending moves and returns the copy-on-write pairs among them, int32
    /// `[k, 2]` of (src, dst) blocks, for a caller that moves the bytes itself.
    fn take_pending_copies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let mut moves = Vec::new();
        self.lock()?.take_moves(&mut moves);
        let pairs: Vec<[u32; 2]> = pairs_of(&moves, MoveKind::Copy).collect();
        pairs_to_array(py, &pairs)
    }

    /// Checks `slots`, executes the pending moves with `execute` (a copy-on-write must land
    /// before a write into its block), then calls `write()`, all under the cache's lock: no
    /// other thread can free or take the slots' blocks in between.
    fn write_slots(
        &self,
        py: Python<'_>,
        slots: Positions,
        execute: &Bound<'_, PyAny>,
        write: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let narrow = narrow_slots(&slots.0)?;
        let mut cache = self.lock_running_python()?;
        let mut raised = None;
        let result = cache.prepare_write(&narrow, transfer::executor(py, execute, &mut raised));
        transfer::into_py_result(result, raised)?;
        write.call0()?;
        Ok(())
    }

    #[pyo3(signature = (seq_ids, *, group=Count(0)))]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
        group: Count<0>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = seq_ids.as_slice();
        let mut cells = Vec::new();
        let width = self
            .run(py, ids.len() * 16, |cache| {
                cache.block_tables(group.0, ids, &mut cells)
            })?
            .into_py_result()?;
        to_2d(py, cells, ids.len(), width)
    }

    /// The blocks of one sequence in `group`, int32, in token order (0 where its window
    /// released one).
    #[pyo3(signature = (seq_id, *, group=Count(0)))]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: SeqId,
        group: Count<0>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let seq_id = seq_id.0;
        let blocks: Vec<i32> = self
            .lock()?
            .group_block_table(seq_id, group.0)
            .into_py_result()?
            .iter()
            .map(|&block| block as i32)
            .collect();
        Ok(blocks.into_pyarray(py))
    }

    fn context_lens<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let ids = seq_ids.as_slice();
        let mut lens = Vec::new();
        self.run(py, ids.len(), |cache| cache.context_lens(ids, &mut lens))?
            .into_py_result()?;
        Ok(lens.into_pyarray(py))
    }

    /// FlashInfer's page table: (kv_indptr, kv_indices, kv_last_page_len), all int32.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (seq_ids, *, group=Count(0)))]
    fn page_table_csr<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
        group: Count<0>,
    ) -> PyResult<(
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
    )> {
        let ids = seq_ids.as_slice();
        let (mut indptr, mut indices, mut last_page_len) = (Vec::new(), Vec::new(), Vec::new());
        self.run(py, ids.len() * 16, |cache| {
            cache.page_table_csr(group.0, ids, &mut indptr, &mut indices, &mut last_page_len)
        })?
        .into_py_result()?;
        Ok((
            indptr.into_pyarray(py),
            indices.into_pyarray(py),
            last_page_len.into_pyarray(py),
        ))
    }

    /// Persistent decode-step buffers for up to `max_seqs` running sequences.
    fn batch_table(
        slf: &Bound<'_, Self>,
        max_seqs: Count<1>,
        max_blocks_per_seq: Count<1>,
    ) -> PyResult<PyBatchTable> {
        let groups = slf.get().lock()?.num_groups();
        let table = BatchTable::new(max_seqs.0, max_blocks_per_seq.0, groups).into_py_result()?;
        Ok(PyBatchTable {
            pool: slf.clone().unbind(),
            table: PyLock::new(table),
        })
    }

    /// Usable host blocks (0 without a host tier).
    #[getter]
    fn num_host_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_host_blocks())
    }

    #[getter]
    fn num_free_host_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_free_host_blocks())
    }

    fn is_swapped(&self, seq_id: SeqId) -> PyResult<bool> {
        let seq_id = seq_id.0;
        self.lock()?.is_swapped(seq_id).into_py_result()
    }

    /// Moves the sequences to the host tier, as one transaction with `execute(moves)` (every
    /// pending move, in order); returns the (device block, host block) pairs, int32 `[k, 2]`
    /// (a block the sequences share is moved once). Without `execute` the moves stay pending.
    #[pyo3(signature = (seq_ids, execute=None))]
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
        execute: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        self.swap(py, seq_ids, execute, true)
    }

    /// Brings swapped-out sequences back, as `swap_out` does; returns the (host block, device
    /// block) pairs.
    #[pyo3(signature = (seq_ids, execute=None))]
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
        execute: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        self.swap(py, seq_ids, execute, false)
    }

    /// Raises ValueError unless every slot (negative ones are padding) lies in a block some
    /// sequence holds.
    fn check_slots(&self, py: Python<'_>, slots: Positions) -> PyResult<()> {
        let slots = slots.0;
        let narrow = narrow_slots(&slots)?;
        self.run(py, narrow.len(), |cache| cache.check_slots(&narrow))?
            .into_py_result()
    }

    /// Blocks no sequence holds and the prefix cache does not keep: garbage nothing may read.
    fn unused_blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let blocks: Vec<i32> = self
            .lock()?
            .block_pool()
            .unused_blocks()
            .map(|block| block as i32)
            .collect();
        Ok(blocks.into_pyarray(py))
    }

    /// Drops every cached block no sequence uses; returns how many.
    fn reset_prefix_cache(&self) -> PyResult<usize> {
        Ok(self.lock()?.reset_prefix_cache())
    }

    #[getter]
    fn enable_kv_events(&self) -> PyResult<bool> {
        Ok(self.lock()?.kv_events_enabled())
    }

    /// Drains the KV-cache events recorded since the last call, oldest first, as a
    /// `KVEventList` (typed when first read; see `atb_mem.events`).
    fn take_events(slf: &Bound<'_, Self>) -> PyResult<events::PyKvEventList> {
        events::drain(slf)
    }

    /// Records what a tier below the host did (its connector calls this): the blocks
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.lock()?.stats();
        convert::figures_to_dict(py, &stats)
    }

    /// Checks every internal invariant; raises AssertionError naming the first broken one.
    fn _check_invariants(&self) -> PyResult<()> {
        self.lock()?
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    fn __repr__(&self) -> PyResult<String> {
        let cache = self.lock()?;
        Ok(format!(
            "KVCachePool(num_blocks={}, block_size={}, num_free_blocks={}, num_sequences={}, dtype='{}')",
            cache.num_blocks(),
            cache.block_size(),
            cache.num_free_blocks(),
            cache.num_sequences(),
            cache.layout().dtype.name()
        ))
    }
}
