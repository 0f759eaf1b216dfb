//! KV-cache events as plain Python tuples, for `atb_mem.events` to give them their types.

use atb_mem_core::{BlockHash, KvEventKind, KvEventLog, Medium};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// The 64-bit name routers key blocks by: the first word of the 128-bit hash.
fn external(hash: BlockHash) -> u64 {
    hash.0[0]
}

/// One tuple per event: (event_id, kind, medium, parent_hash | None, block_hashes,
/// token_ids, root_hash), with kind "stored" | "removed" | "cleared" and medium "device" |
/// "host".
pub(crate) fn events_to_list<'py>(
    py: Python<'py>,
    log: &KvEventLog,
) -> PyResult<Bound<'py, PyList>> {
    let events = PyList::empty(py);
    for event in log.events() {
        let kind = match event.kind {
            KvEventKind::BlockStored => "stored",
            KvEventKind::BlockRemoved => "removed",
            KvEventKind::AllBlocksCleared => "cleared",
        };
        let medium = match event.medium {
            Medium::Device => "device",
            Medium::Host => "host",
        };
        let hashes: Vec<u64> = log.hashes(event).iter().copied().map(external).collect();
        let record = PyTuple::new(
            py,
            [
                event.event_id.into_pyobject(py)?.into_any(),
                kind.into_pyobject(py)?.into_any(),
                medium.into_pyobject(py)?.into_any(),
                event.parent_hash.map(external).into_pyobject(py)?,
                PyList::new(py, hashes)?.into_any(),
                PyList::new(py, log.token_ids(event))?.into_any(),
                external(event.root_hash).into_pyobject(py)?.into_any(),
            ],
        )?;
        events.append(record)?;
    }
    Ok(events)
}
