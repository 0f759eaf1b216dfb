//! KV-cache events drained as one `KVEventList`: one crossing and one object per drain, no
//! Python object per event, block or token. The list types its events (the named tuples of
//! `atb_mem.events`) when first read — where they are published, off the engine's thread.

use atb_mem_core::{BlockHash, KvEventKind, KvEventLog, Medium};
use numpy::PyArray1;
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyList, PyTuple};
use pyo3::PyTypeInfo;

/// The events of one drain: its buffer (see `events_to_buffer`) and the pool it came from
/// (its block size and groups type the events).
#[pyclass(frozen, sequence, name = "KVEventList", module = "atb_mem._core")]
pub struct PyKvEventList {
    buffer: Vec<u64>,
    pool: Option<Py<PyAny>>,
    typed: PyOnceLock<Py<PyList>>,
}

static EVENTS_FROM_BUFFER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

impl PyKvEventList {
    pub(crate) fn new(buffer: Vec<u64>, pool: Option<Py<PyAny>>) -> Self {
        PyKvEventList {
            buffer,
            pool,
            typed: PyOnceLock::new(),
        }
    }

    fn typed<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyList>> {
        let typed = self.typed.get_or_try_init(py, || -> PyResult<_> {
            let Some(pool) = &self.pool else {
                return Ok(PyList::empty(py).unbind());
            };
            let pool = pool.bind(py);
            let function = EVENTS_FROM_BUFFER.import(py, "atb_mem.events", "events_from_buffer")?;
            let events = function.call1((
                self.buffer(py),
                pool.getattr("block_size")?,
                pool.getattr("_groups")?,
            ))?;
            Ok(events.cast_into::<PyList>()?.unbind())
        })?;
        Ok(typed.bind(py))
    }
}

#[pymethods]
impl PyKvEventList {
    fn __len__(&self) -> usize {
        self.buffer.first().map_or(0, |&count| count as usize)
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.typed(py)?.as_any().get_item(index)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.typed(py)?.as_any().try_iter()?.into_any())
    }

    fn __eq__<'py>(&self, py: Python<'py>, other: &Bound<'py, PyAny>) -> PyResult<Py<PyAny>> {
        let comparable = other.is_instance_of::<PyList>()
            || other.is_instance_of::<PyTuple>()
            || other.is_instance_of::<PyKvEventList>();
        if !comparable {
            return Ok(py.NotImplemented());
        }
        let other = PyList::type_object(py).call1((other,))?;
        let equal = self.typed(py)?.as_any().eq(other)?;
        Ok(PyBool::new(py, equal).to_owned().into_any().unbind())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("KVEventList({})", self.typed(py)?.repr()?))
    }

    /// The drain as the core gave it: uint64 ``[E]``, the ``[E, 9]`` table, the hashes, the
    /// token ids as uint32 pairs (see ``atb_mem.events.events_from_buffer``).
    #[getter]
    fn buffer<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_slice(py, &self.buffer)
    }
}

/// The 64-bit name routers key blocks by: the first word of the 128-bit hash.
fn external(hash: BlockHash) -> u64 {
    hash.0[0]
}

/// Columns of the per-event table.
const EVENT_COLUMNS: usize = 9;

/// One uint64 array: `[E]`, then the `[E, 9]` table — per event (event_id, kind: 0 stored |
/// 1 removed | 2 cleared, medium: 0 device | 1 host | 2 disk | 3 store, has_parent, parent hash, root hash, end
/// of its hashes, end of its token ids, KV-cache group) —, then the block hashes, then the
/// token ids as uint32 pairs (little-endian: a uint32 view reads them in order). An event's
/// hashes and token ids run from the previous event's ends to its own.
pub(crate) fn events_to_buffer(log: &KvEventLog) -> PyResult<Vec<u64>> {
    let events = log.events();
    let (hashes, tokens) = (log.all_hashes(), log.all_token_ids());
    let table_end = 1 + events.len() * EVENT_COLUMNS;
    let mut buffer = Vec::new();
    buffer
        .try_reserve_exact(table_end + hashes.len() + tokens.len().div_ceil(2))
        .map_err(|_| PyMemoryError::new_err("no host memory for the KV events' drain"))?;
    buffer.push(events.len() as u64);
    let (mut hashes_end, mut tokens_end) = (0, 0);
    for event in events {
        hashes_end += log.hashes(event).len() as u64;
        tokens_end += log.token_ids(event).len() as u64;
        buffer.extend([
            event.event_id,
            match event.kind {
                KvEventKind::BlockStored => 0,
                KvEventKind::BlockRemoved => 1,
                KvEventKind::AllBlocksCleared => 2,
            },
            match event.medium {
                Medium::Device => 0,
                Medium::Host => 1,
                Medium::Disk => 2,
                Medium::Store => 3,
            },
            u64::from(event.parent_hash.is_some()),
            event.parent_hash.map_or(0, external),
            external(event.root_hash),
            hashes_end,
            tokens_end,
            u64::from(event.group),
        ]);
    }
    buffer.extend(hashes.iter().copied().map(external));
    let pairs = tokens.chunks_exact(2);
    let odd = pairs.remainder().first().copied();
    buffer.extend(pairs.map(|pair| u64::from(pair[0]) | u64::from(pair[1]) << 32));
    buffer.extend(odd.map(u64::from));
    Ok(buffer)
}

/// Drains a pool's events into one `KVEventList` (`KVCachePool.take_events`).
pub(super) fn drain(pool: &Bound<'_, super::PyKvCachePool>) -> PyResult<PyKvEventList> {
    let mut cache = pool.get().lock()?;
    if cache.kv_events().is_empty() {
        return Ok(PyKvEventList::new(Vec::new(), None));
    }
    // Dropped only once converted: a failed conversion loses no event.
    let buffer = events_to_buffer(cache.kv_events())?;
    cache.clear_kv_events();
    Ok(PyKvEventList::new(
        buffer,
        Some(pool.clone().into_any().unbind()),
    ))
}

/// What a tier below the host did, converted (`KVCachePool._record_tier_event`).
pub(super) struct TierEvent {
    medium: Medium,
    stored: bool,
    hashes: Vec<BlockHash>,
    parent: Option<BlockHash>,
}

impl TierEvent {
    pub(super) fn new(
        medium: &str,
        stored: bool,
        hashes: &[[u64; 2]],
        parent: Option<[u64; 2]>,
    ) -> PyResult<Self> {
        let medium = Medium::from_name(medium).ok_or_else(|| {
            crate::errors::value_error(format!("unknown medium {medium:?}: disk or store"))
        })?;
        Ok(TierEvent {
            medium,
            stored,
            hashes: hashes.iter().map(|&words| BlockHash(words)).collect(),
            parent: parent.map(BlockHash),
        })
    }

    pub(super) fn record(
        &self,
        cache: &mut atb_mem_core::KvCache,
        token_ids: &[u32],
    ) -> PyResult<()> {
        use crate::errors::IntoPyResult;
        cache
            .record_tier_event(
                self.medium,
                self.stored,
                &self.hashes,
                self.parent,
                token_ids,
            )
            .into_py_result()
    }
}
