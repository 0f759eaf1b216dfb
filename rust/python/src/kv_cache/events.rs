//! KV-cache events as three numpy arrays — one crossing per drain, no Python object per block
//! or token — for `atb_mem.events` to give them their types.

use atb_mem_core::{BlockHash, KvEventKind, KvEventLog, Medium};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::type_error;

/// The 64-bit name routers key blocks by: the first word of the 128-bit hash.
fn external(hash: BlockHash) -> u64 {
    hash.0[0]
}

/// Columns of the per-event array.
const EVENT_COLUMNS: usize = 9;

/// `(events, hashes, token_ids)`: `events` is uint64 `[E, 9]`, per event (event_id, kind:
/// 0 stored | 1 removed | 2 cleared, medium: 0 device | 1 host, has_parent, parent hash, root
/// hash, end of its hashes, end of its token ids, KV-cache group); an event's block hashes
/// (uint64) and token ids (uint32) run from the previous event's ends to its own.
pub(crate) fn events_to_arrays<'py>(
    py: Python<'py>,
    log: &KvEventLog,
) -> PyResult<Bound<'py, PyTuple>> {
    let events = log.events();
    let mut table = Vec::with_capacity(events.len() * EVENT_COLUMNS);
    let mut hashes = Vec::new();
    let mut token_ids = Vec::new();
    for event in events {
        hashes.extend(log.hashes(event).iter().copied().map(external));
        token_ids.extend_from_slice(log.token_ids(event));
        table.extend([
            event.event_id,
            match event.kind {
                KvEventKind::BlockStored => 0,
                KvEventKind::BlockRemoved => 1,
                KvEventKind::AllBlocksCleared => 2,
            },
            match event.medium {
                Medium::Device => 0,
                Medium::Host => 1,
            },
            u64::from(event.parent_hash.is_some()),
            event.parent_hash.map_or(0, external),
            external(event.root_hash),
            hashes.len() as u64,
            token_ids.len() as u64,
            u64::from(event.group),
        ]);
    }
    let table = Array2::from_shape_vec((events.len(), EVENT_COLUMNS), table)
        .map_err(|error| type_error(error.to_string()))?;
    PyTuple::new(
        py,
        [
            table.into_pyarray(py).into_any(),
            PyArray1::from_vec(py, hashes).into_any(),
            PyArray1::from_vec(py, token_ids).into_any(),
        ],
    )
}
