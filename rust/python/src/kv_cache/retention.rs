//! Retention by priority on a `KVCachePool` (the `priority` eviction policy): what a
//! sequence asks the prefix cache to keep, and the clock its durations run on.

use atb_mem_core::{RetentionConfig, TokenRetention, DEFAULT_PRIORITY};
use pyo3::prelude::*;

use super::PyKvCachePool;
use crate::convert::{Count, Nanos, SeqId};
use crate::errors::{value_error, IntoPyResult};

/// One retention range as Python gives it: (start, end or None, priority, duration in
/// nanoseconds or None).
pub(crate) type RangeArg = (Count<0>, Option<Count<0>>, Count<0>, Option<Nanos>);

/// The core's config from Python's arguments; priorities above 255 are refused here, above
/// 100 by the core.
pub(crate) fn retention_config(
    ranges: Vec<RangeArg>,
    decode: Option<(Count<0>, Option<Nanos>)>,
    default_priority: Option<Count<0>>,
) -> PyResult<RetentionConfig> {
    let priority = |value: Count<0>| {
        u8::try_from(value.get()).map_err(|_| {
            value_error(format!(
                "retention priorities run from 0 to 100, got {}",
                value.get()
            ))
        })
    };
    let ranges = ranges
        .into_iter()
        .map(|(start, end, level, duration)| {
            Ok(TokenRetention {
                start: start.get(),
                end: end.map(Count::get),
                priority: priority(level)?,
                duration_ns: duration.map(|duration| duration.as_u64()),
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let decode = match decode {
        Some((level, duration)) => Some((priority(level)?, duration.map(|d| d.as_u64()))),
        None => None,
    };
    let default_priority = default_priority.map_or(Ok(DEFAULT_PRIORITY), priority)?;
    let config = RetentionConfig {
        ranges,
        decode,
        default_priority,
        ..RetentionConfig::default()
    };
    config.validate().into_py_result()?;
    Ok(config)
}

#[pymethods]
impl PyKvCachePool {
    /// What `seq_id` asks the prefix cache to keep: `ranges` of (start, end or None,
    /// priority 0-100, duration_ns or None), `decode` = (priority, duration_ns or None) for
    /// tokens past its current length, and `default_priority` for the rest (35). Its cached
    /// blocks take it now, the rest as they join the cache.
    #[pyo3(signature = (seq_id, ranges, *, decode=None, default_priority=None))]
    fn set_retention(
        &self,
        seq_id: SeqId,
        ranges: Vec<RangeArg>,
        decode: Option<(Count<0>, Option<Nanos>)>,
        default_priority: Option<Count<0>>,
    ) -> PyResult<()> {
        let config = retention_config(ranges, decode, default_priority)?;
        self.lock()?
            .set_retention(seq_id.0, &config)
            .into_py_result()
    }

    /// Moves the retention clock to `now_ns` (it never goes back): priorities whose
    /// duration ended fall back to the default.
    fn advance_clock(&self, now_ns: Nanos) -> PyResult<()> {
        self.lock()?.advance_clock(now_ns.as_u64());
        Ok(())
    }
}
