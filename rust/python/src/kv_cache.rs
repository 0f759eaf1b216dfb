//! `KVCachePool` and `BatchTable`: convert, lock, call the core, map errors.

use atb_mem_core::{pairs_of, BatchTable, KvCache, KvDtype, KvLayout, MoveKind, Tokens};
use numpy::ndarray::{Array2, ArrayView1, ArrayView2};
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};
use crate::lock::{Guard, PyLock};
use crate::transfer;

/// Work (sequences, tokens or table cells) above which a call releases the GIL while it runs.
const DETACH_ABOVE: usize = 4096;

/// Paged KV cache: fixed-size blocks handed to sequences on demand, with prefix caching and
/// copy-on-write forks.
#[pyclass(frozen, subclass, name = "KVCachePool", module = "atb_mem._core")]
pub struct PyKvCachePool {
    cache: PyLock<KvCache>,
}

impl PyKvCachePool {
    pub(crate) fn lock(&self) -> PyResult<Guard<'_, KvCache>> {
        self.cache.lock()
    }

    /// The lock for a transaction that runs Python (the byte executor) while holding it.
    pub(crate) fn lock_running_python(&self) -> PyResult<Guard<'_, KvCache>> {
        self.cache.lock_running_python()
    }

    /// Runs `work` on the locked cache, releasing the GIL (not the lock) when `size` is large.
    fn run<R: Send>(
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

    /// A swap as one transaction: plan it, execute every pending move with `execute` (None:
    /// leave them pending for the caller), and commit — or roll back if executing raised.
    /// Returns the swap's own (source, destination) pairs.
    fn swap<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        execute: Option<&Bound<'py, PyAny>>,
        out: bool,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let seq_ids = convert::seq_ids(seq_ids, "seq_ids")?;
        let ids = seq_ids.as_slice();
        let mut cache = self.lock_running_python()?;
        let execute = execute.filter(|execute| !execute.is_none());
        let snapshot = execute.map(|_| cache.clone());
        let first = cache.num_pending_moves();
        match out {
            true => cache.swap_out(ids),
            false => cache.swap_in(ids),
        }
        .into_py_result()?;
        let kind = if out {
            MoveKind::ToHost
        } else {
            MoveKind::ToDevice
        };
        let pairs: Vec<[u32; 2]> = match (execute, snapshot) {
            (Some(execute), Some(snapshot)) => {
                let moves = transfer::execute_pending(py, &mut cache, snapshot, execute)?;
                if !out {
                    // The bytes are back: the blocks may serve prefix hits again.
                    for &seq_id in ids {
                        cache.mark_computed(seq_id, None).into_py_result()?;
                    }
                }
                pairs_of(&moves, kind).collect()
            }
            _ => pairs_of(&cache.pending_moves()[first..], kind).collect(),
        };
        pairs_to_array(py, &pairs)
    }
}

/// `tokens`: a count (an int), or token ids (a list/tuple or a numpy integer array).
fn tokens_arg<'py>(tokens: &Bound<'py, PyAny>) -> PyResult<Result<usize, convert::TokenIds<'py>>> {
    if convert::is_sequence_like(tokens) {
        return convert::token_ids(tokens, "tokens", None).map(Err);
    }
    if convert::is_int(tokens) {
        return convert::count(tokens, "tokens", 1).map(Ok);
    }
    Err(type_error(format!(
        "tokens must be a token count (int) or token ids (a list or 1-D numpy integer array), \
         got {}",
        convert::type_name(tokens)
    )))
}

fn with_tokens<R>(
    arg: &Result<usize, convert::TokenIds<'_>>,
    f: impl FnOnce(Tokens<'_>) -> R,
) -> R {
    match arg {
        Ok(count) => f(Tokens::Count(*count)),
        Err(ids) => f(Tokens::Ids(ids.as_slice())),
    }
}

fn narrow_slots(slots: &[i64]) -> PyResult<Vec<i32>> {
    slots
        .iter()
        .map(|&slot| {
            i32::try_from(slot).map_err(|_| value_error(format!("slot {slot} does not fit int32")))
        })
        .collect()
}

/// Row-major cells as a `[rows, width]` array, without copying them.
fn to_2d(
    py: Python<'_>,
    cells: Vec<i32>,
    rows: usize,
    width: usize,
) -> PyResult<Bound<'_, PyArray2<i32>>> {
    let array =
        Array2::from_shape_vec((rows, width), cells).map_err(|e| type_error(e.to_string()))?;
    Ok(array.into_pyarray(py))
}

/// Block pairs as an int32 `[k, 2]` array.
pub(crate) fn pairs_to_array<'py>(
    py: Python<'py>,
    pairs: &[[u32; 2]],
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let rows = pairs.len();
    let cells = pairs
        .iter()
        .flat_map(|&[src, dst]| [src as i32, dst as i32])
        .collect();
    to_2d(py, cells, rows, 2)
}

#[pymethods]
impl PyKvCachePool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, num_layers=None, num_kv_heads=None, head_dim=None,
                        dtype=None, enable_prefix_caching=true, num_host_blocks=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        num_layers: Option<&Bound<'_, PyAny>>,
        num_kv_heads: Option<&Bound<'_, PyAny>>,
        head_dim: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        enable_prefix_caching: bool,
        num_host_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let dim = |value: Option<&Bound<'_, PyAny>>, name: &str| match value {
            Some(value) => convert::count(value, name, 1),
            None => Ok(1),
        };
        let dtype = match dtype {
            None => KvDtype::Float16,
            Some(dtype) => {
                // Accept "float16", numpy.float16 and numpy.dtype("float16") alike.
                let name = if let Ok(name) = dtype.cast::<PyString>() {
                    name.to_string()
                } else if let Ok(name) = dtype.getattr("__name__") {
                    name.str()?.to_string()
                } else {
                    dtype.str()?.to_string()
                };
                KvDtype::parse(name.trim_start_matches("torch.")).into_py_result()?
            }
        };
        let layout = KvLayout {
            num_layers: dim(num_layers, "num_layers")?,
            num_kv_heads: dim(num_kv_heads, "num_kv_heads")?,
            head_dim: dim(head_dim, "head_dim")?,
            dtype,
        };
        let num_blocks = convert::count(num_blocks, "num_blocks", 2)?;
        let block_size = convert::count(block_size, "block_size", 1)?;
        let mut cache =
            KvCache::new(num_blocks, block_size, layout, enable_prefix_caching).into_py_result()?;
        if let Some(num_host_blocks) = num_host_blocks.filter(|value| !value.is_none()) {
            let num_host_blocks = convert::count(num_host_blocks, "num_host_blocks", 1)?;
            cache.enable_host_tier(num_host_blocks).into_py_result()?;
        }
        Ok(PyKvCachePool {
            cache: PyLock::new(cache),
        })
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
        seq_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        let tokens = tokens_arg(tokens)?;
        let salt = convert::cache_salt(cache_salt)?;
        let size = tokens.as_ref().err().map_or(0, |ids| ids.as_slice().len());
        with_tokens(&tokens, |tokens| {
            self.run(py, size, |cache| {
                cache.alloc_sequence(seq_id, tokens, salt.as_deref())
            })
        })?
        .into_py_result()
    }

    #[pyo3(signature = (tokens, *, cache_salt=None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let tokens = tokens_arg(tokens)?;
        let salt = convert::cache_salt(cache_salt)?;
        let size = tokens.as_ref().err().map_or(0, |ids| ids.as_slice().len());
        with_tokens(&tokens, |tokens| {
            self.run(py, size, |cache| {
                cache.can_allocate(tokens, salt.as_deref())
            })
        })?
        .into_py_result()
    }

    fn seq_len(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        self.lock()?.seq_len(seq_id).into_py_result()
    }

    fn __contains__(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
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
        seq_ids: &Bound<'py, PyAny>,
        n: Option<&Bound<'py, PyAny>>,
        token_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let seq_ids = convert::seq_ids(seq_ids, "seq_ids")?;
        let n = match n {
            Some(n) => convert::count(n, "n", 1)?,
            None => 1,
        };
        let ids = seq_ids.as_slice();
        let token_ids = match token_ids.filter(|ids| !ids.is_none()) {
            Some(obj) => Some(convert::token_ids(obj, "token_ids", Some([ids.len(), n]))?),
            None => None,
        };
        let token_slice = token_ids.as_ref().map(|ids| ids.as_slice());
        let mut slots = Vec::new();
        self.run(py, ids.len().saturating_mul(n), |cache| {
            cache.append_tokens(ids, n, token_slice, &mut slots)
        })?
        .into_py_result()?;
        Ok(slots.into_pyarray(py))
    }

    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        starts: &Bound<'py, PyAny>,
        ends: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let seq_ids = convert::seq_ids(seq_ids, "seq_ids")?;
        let starts = convert::positions(starts, "starts")?;
        let ends = convert::positions(ends, "ends")?;
        let ids = seq_ids.as_slice();
        let size: i64 = starts
            .iter()
            .zip(&ends)
            .map(|(start, end)| end.saturating_sub(*start).max(0))
            .fold(0i64, |total, span| total.saturating_add(span));
        let mut slots = Vec::new();
        self.run(py, size as usize, |cache| {
            cache.slot_mapping(ids, &starts, &ends, &mut slots)
        })?
        .into_py_result()?;
        Ok(slots.into_pyarray(py))
    }

    fn fork(&self, parent_id: &Bound<'_, PyAny>, child_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let parent_id = convert::seq_id(parent_id, "parent_id")?;
        let child_id = convert::seq_id(child_id, "child_id")?;
        self.lock()?.fork(parent_id, child_id).into_py_result()
    }

    fn free_sequence(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        self.lock()?.free_sequence(seq_id).into_py_result()
    }

    /// Records that the K/V of the first `num_tokens` tokens (all, with None) of the
    /// sequence is written; full blocks within them join the prefix cache. Returns how many.
    #[pyo3(signature = (seq_id, num_tokens=None))]
    fn mark_computed(
        &self,
        seq_id: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        let num_tokens = match num_tokens.filter(|n| !n.is_none()) {
            Some(n) => Some(convert::count(n, "num_tokens", 0)?),
            None => None,
        };
        let mut cache = self.lock()?;
        let num_tokens = match num_tokens {
            Some(n) => n,
            None => cache.seq_len(seq_id).into_py_result()?,
        };
        cache
            .mark_computed(seq_id, Some(num_tokens))
            .into_py_result()
    }

    /// Tokens of the sequence whose K/V is known to be computed.
    fn num_computed(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        self.lock()?.num_computed(seq_id).into_py_result()
    }

    /// The pending block moves, int32 `[k, 3]` of (kind, src, dst), without taking them.
    fn pending_moves<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        transfer::moves_to_array(py, self.lock()?.pending_moves())
    }

    /// Executes every pending move with `execute(moves)` as one transaction (see
    /// `BlockMoveError`); returns how many moves ran.
    fn execute_pending_moves(&self, py: Python<'_>, execute: &Bound<'_, PyAny>) -> PyResult<usize> {
        let mut cache = self.lock_running_python()?;
        if cache.num_pending_moves() == 0 {
            return Ok(0);
        }
        let snapshot = cache.clone();
        Ok(transfer::execute_pending(py, &mut cache, snapshot, execute)?.len())
    }

    /// Takes the pending moves and returns the copy-on-write pairs among them, int32
    /// `[k, 2]` of (src, dst) blocks, for a caller that moves the bytes itself.
    fn take_pending_copies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let mut moves = Vec::new();
        self.lock()?.take_moves(&mut moves);
        let pairs: Vec<[u32; 2]> = pairs_of(&moves, MoveKind::Copy).collect();
        pairs_to_array(py, &pairs)
    }

    /// Checks `slots` and, holding the cache locked throughout, first executes the pending
    /// moves with `execute` (a copy-on-write must land before a write into its block), then
    /// calls `write()`: no other thread can free or take the slots' blocks in between.
    fn write_slots(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        execute: &Bound<'_, PyAny>,
        write: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let slots = convert::positions(slots, "slots")?;
        let narrow = narrow_slots(&slots)?;
        let mut cache = self.lock_running_python()?;
        if cache.num_pending_moves() > 0 {
            let snapshot = cache.clone();
            transfer::execute_pending(py, &mut cache, snapshot, execute)?;
        }
        cache.check_slots(&narrow).into_py_result()?;
        write.call0()?;
        Ok(())
    }

    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let seq_ids = convert::seq_ids(seq_ids, "seq_ids")?;
        let ids = seq_ids.as_slice();
        let mut cells = Vec::new();
        let width = self
            .run(py, ids.len() * 16, |cache| {
                cache.block_tables(ids, &mut cells)
            })?
            .into_py_result()?;
        to_2d(py, cells, ids.len(), width)
    }

    /// The blocks of one sequence, int32, in token order.
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        let blocks: Vec<i32> = self
            .lock()?
            .block_table(seq_id)
            .into_py_result()?
            .iter()
            .map(|&block| block as i32)
            .collect();
        Ok(blocks.into_pyarray(py))
    }

    fn context_lens<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let seq_ids = convert::seq_ids(seq_ids, "seq_ids")?;
        let ids = seq_ids.as_slice();
        let mut lens = Vec::new();
        self.run(py, ids.len(), |cache| cache.context_lens(ids, &mut lens))?
            .into_py_result()?;
        Ok(lens.into_pyarray(py))
    }

    /// FlashInfer's page table: (kv_indptr, kv_indices, kv_last_page_len), all int32.
    #[allow(clippy::type_complexity)]
    fn page_table_csr<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<(
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
    )> {
        let seq_ids = convert::seq_ids(seq_ids, "seq_ids")?;
        let ids = seq_ids.as_slice();
        let (mut indptr, mut indices, mut last_page_len) = (Vec::new(), Vec::new(), Vec::new());
        self.run(py, ids.len() * 16, |cache| {
            cache.page_table_csr(ids, &mut indptr, &mut indices, &mut last_page_len)
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
        max_seqs: &Bound<'_, PyAny>,
        max_blocks_per_seq: &Bound<'_, PyAny>,
    ) -> PyResult<PyBatchTable> {
        let max_seqs = convert::count(max_seqs, "max_seqs", 1)?;
        let max_blocks_per_seq = convert::count(max_blocks_per_seq, "max_blocks_per_seq", 1)?;
        let table = BatchTable::new(max_seqs, max_blocks_per_seq).into_py_result()?;
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

    fn is_swapped(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        self.lock()?.is_swapped(seq_id).into_py_result()
    }

    /// Moves the sequences to the host tier, as one transaction with `execute(moves)` (every
    /// pending move, in order); returns the (device block, host block) pairs, int32 `[k, 2]`
    /// (a block the sequences share is moved once). Without `execute` the moves stay pending.
    #[pyo3(signature = (seq_ids, execute=None))]
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
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
        seq_ids: &Bound<'py, PyAny>,
        execute: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        self.swap(py, seq_ids, execute, false)
    }

    /// Raises ValueError unless every slot (negative ones are padding) lies in a block some
    /// sequence holds.
    fn check_slots(&self, py: Python<'_>, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let slots = convert::positions(slots, "slots")?;
        let narrow = narrow_slots(&slots)?;
        self.run(py, narrow.len(), |cache| cache.check_slots(&narrow))?
            .into_py_result()
    }

    /// Drops every cached block no sequence uses; returns how many.
    fn reset_prefix_cache(&self) -> PyResult<usize> {
        Ok(self.lock()?.reset_prefix_cache())
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.lock()?.stats();
        let dict = PyDict::new(py);
        dict.set_item("num_blocks", stats.num_blocks)?;
        dict.set_item("block_size", stats.block_size)?;
        dict.set_item("blocks_total", stats.num_blocks)?;
        dict.set_item("blocks_reserved", 1)?;
        dict.set_item("blocks_used", stats.blocks_used)?;
        dict.set_item("blocks_free", stats.blocks_free)?;
        dict.set_item("blocks_cached", stats.blocks_cached)?;
        dict.set_item("num_sequences", stats.num_sequences)?;
        dict.set_item("num_tokens", stats.num_tokens)?;
        dict.set_item("allocated_slots", stats.allocated_slots)?;
        dict.set_item("used_slots", stats.used_slots)?;
        dict.set_item("fragmentation", stats.fragmentation)?;
        dict.set_item("prefix_cache_queries", stats.prefix_cache_queries)?;
        dict.set_item("prefix_cache_hits", stats.prefix_cache_hits)?;
        dict.set_item("prefix_cache_query_tokens", stats.prefix_cache_query_tokens)?;
        dict.set_item("prefix_cache_hit_tokens", stats.prefix_cache_hit_tokens)?;
        let hit_rate = if stats.prefix_cache_queries == 0 {
            0.0
        } else {
            stats.prefix_cache_hits as f64 / stats.prefix_cache_queries as f64
        };
        dict.set_item("prefix_cache_hit_rate", hit_rate)?;
        dict.set_item("evictions", stats.evictions)?;
        dict.set_item("pending_copies", stats.pending_copies)?;
        dict.set_item("bytes_per_block", stats.bytes_per_block)?;
        dict.set_item(
            "bytes_total",
            stats.bytes_per_block as u128 * stats.num_blocks as u128,
        )?;
        dict.set_item("host_blocks", stats.host_blocks)?;
        dict.set_item("host_blocks_used", stats.host_blocks_used)?;
        dict.set_item("num_swapped", stats.num_swapped)?;
        Ok(dict)
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

/// Block tables, context lengths and slot mapping of the running batch, kept at fixed
/// addresses and updated in place by `append_tokens`.
#[pyclass(frozen, name = "BatchTable", module = "atb_mem._core")]
pub struct PyBatchTable {
    pool: Py<PyKvCachePool>,
    table: PyLock<BatchTable>,
}

impl PyBatchTable {
    fn lock(&self) -> PyResult<Guard<'_, BatchTable>> {
        self.table.lock()
    }

    /// A read-only numpy view of one of the table's buffers, keeping the table alive.
    fn view<'py, A: numpy::ndarray::Dimension>(
        slf: &Bound<'py, Self>,
        buffer: impl FnOnce(&BatchTable) -> numpy::ndarray::ArrayView<'_, i32, A>,
    ) -> PyResult<Bound<'py, numpy::PyArray<i32, A>>> {
        let table = slf.get().lock()?;
        let view = buffer(&table);
        // SAFETY: the buffers are boxed slices allocated once in `BatchTable::new` and never
        // resized or freed while the table lives; the array holds a reference to the table.
        let array = unsafe { numpy::PyArray::borrow_from_array(&view, slf.clone().into_any()) };
        drop(table);
        let flags = PyDict::new(slf.py());
        flags.set_item("write", false)?;
        array.call_method("setflags", (), Some(&flags))?;
        Ok(array)
    }
}

#[pymethods]
impl PyBatchTable {
    fn add(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        let cache = self.pool.get().lock()?;
        self.lock()?.add(&cache, seq_id).into_py_result()
    }

    fn remove(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        self.lock()?.remove(seq_id).into_py_result()
    }

    fn clear(&self) -> PyResult<()> {
        self.lock()?.clear();
        Ok(())
    }

    /// Appends one token to every row (`token_ids[row]` when given); updates the buffers.
    #[pyo3(signature = (token_ids=None))]
    fn append_tokens(&self, py: Python<'_>, token_ids: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let rows = self.lock()?.len();
        let token_ids = match token_ids.filter(|ids| !ids.is_none()) {
            Some(obj) => Some(convert::token_ids(obj, "token_ids", None)?),
            None => None,
        };
        let ids = token_ids.as_ref().map(|ids| ids.as_slice());
        let mut cache_guard = self.pool.get().lock()?;
        let mut table_guard = self.lock()?;
        let (cache, table): (&mut KvCache, &mut BatchTable) = (&mut cache_guard, &mut table_guard);
        if rows > DETACH_ABOVE {
            py.detach(|| table.append_tokens(cache, ids))
        } else {
            table.append_tokens(cache, ids)
        }
        .into_py_result()
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.len())
    }

    fn __contains__(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let seq_id = convert::seq_id(seq_id, "seq_id")?;
        Ok(self.lock()?.contains(seq_id))
    }

    /// Sequence ids by row.
    #[getter]
    fn seq_ids(&self) -> PyResult<Vec<u64>> {
        Ok(self.lock()?.seq_ids().collect())
    }

    #[getter]
    fn max_seqs(&self) -> PyResult<usize> {
        Ok(self.lock()?.max_seqs())
    }

    #[getter]
    fn max_blocks_per_seq(&self) -> PyResult<usize> {
        Ok(self.lock()?.max_blocks_per_seq())
    }

    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyKvCachePool> {
        self.pool.clone_ref(py)
    }

    /// int32 `[max_seqs, max_blocks_per_seq]`, padded with block 0 (read-only view).
    #[getter]
    fn block_tables<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        Self::view(slf, |table| {
            ArrayView2::from_shape(
                (table.max_seqs(), table.max_blocks_per_seq()),
                table.block_tables(),
            )
            .expect("buffer matches its shape")
        })
    }

    /// int32 `[max_seqs]`, 0 for unused rows (read-only view).
    #[getter]
    fn context_lens<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        Self::view(slf, |table| ArrayView1::from(table.context_lens()))
    }

    /// int32 `[max_seqs]`: each row's newest slot, -1 for rows without one (read-only view).
    #[getter]
    fn slot_mapping<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        Self::view(slf, |table| ArrayView1::from(table.slot_mapping()))
    }

    fn __repr__(&self) -> PyResult<String> {
        let table = self.lock()?;
        Ok(format!(
            "BatchTable(rows={}, max_seqs={}, max_blocks_per_seq={})",
            table.len(),
            table.max_seqs(),
            table.max_blocks_per_seq()
        ))
    }
}
