//! The byte pool: `MemPool`, its allocations and host regions.

mod mem_pool;

pub use mem_pool::{HostRegion, PyAllocation, PyMemPool};
