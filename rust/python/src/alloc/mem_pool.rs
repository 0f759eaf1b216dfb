//! `MemPool`, its `Allocation` handles, and `HostRegion`, the default backing: convert, lock,
//! call the core, map errors.
//!
//! A backing owns the pool's bytes and makes views of them. Any object with `ptr` (base
//! address), `nbytes` and `view(offset, nbytes, dtype, shape)` serves; `HostRegion` is the one
//! for host memory, and device backings plug in the same way.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

use atb_mem_core::{AlignmentPolicy, CoreError, MemPool, PoolAllocation};
use numpy::ndarray::ArrayView1;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::convert::{self, Count};
use crate::errors::{invalid_handle, to_py_err, type_error, value_error, IntoPyResult};
use crate::lock::lock;

/// One aligned, zeroed host allocation: the bytes of a host-backed pool.
///
/// Allocated with calloc's alignment (so large regions come zeroed from the OS, page by page
/// as they are first touched, rather than written up front) and aligned by hand.
#[pyclass(frozen, name = "HostRegion", module = "atb_mem._core")]
pub struct HostRegion {
    /// Start of the underlying allocation.
    base: NonNull<u8>,
    layout: Layout,
    /// `base` rounded up to the requested alignment.
    aligned: NonNull<u8>,
    nbytes: usize,
}

// SAFETY: the region is plain memory owned by this object; access to its bytes goes through
// numpy views, whose synchronisation is the caller's, as for any numpy array.
unsafe impl Send for HostRegion {}
unsafe impl Sync for HostRegion {}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: allocated in `allocate` with this layout, freed once.
        unsafe { dealloc(self.base.as_ptr(), self.layout) }
    }
}

impl HostRegion {
    /// `argument` names the size argument, for the error if the host cannot provide the bytes.
    fn allocate(nbytes: usize, alignment: usize, argument: &str) -> PyResult<Self> {
        if !alignment.is_power_of_two() {
            return Err(value_error(format!(
                "alignment must be a power of two, got {alignment}"
            )));
        }
        let alignment = alignment.max(64);
        let total = nbytes
            .checked_add(alignment)
            .ok_or_else(|| value_error(format!("cannot allocate {nbytes} bytes")))?;
        // An alignment of 16 or less is what calloc gives, so `alloc_zeroed` uses calloc.
        let layout = Layout::from_size_align(total, 16)
            .map_err(|_| value_error(format!("cannot lay out {nbytes} bytes")))?;
        // SAFETY: the layout has a non-zero size.
        let base = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(|| {
            to_py_err(CoreError::HostOutOfMemory {
                what: format!("the host region of {argument} = {nbytes} bytes"),
                bytes: total as u64,
            })
        })?;
        let padding = (alignment - base.as_ptr() as usize % alignment) % alignment;
        // SAFETY: padding < alignment, and the allocation has `alignment` spare bytes.
        let aligned = unsafe { NonNull::new_unchecked(base.as_ptr().add(padding)) };
        Ok(HostRegion {
            base,
            layout,
            aligned,
            nbytes,
        })
    }
}

#[pymethods]
impl HostRegion {
    #[new]
    #[pyo3(signature = (nbytes, alignment=None), text_signature = "(nbytes, alignment=4096)")]
    fn new(nbytes: Count<1>, alignment: Option<Count<1>>) -> PyResult<Self> {
        let alignment = alignment.map_or(4096, Count::get);
        HostRegion::allocate(nbytes.get(), alignment, "nbytes")
    }

    /// Base address of the region.
    #[getter]
    fn ptr(&self) -> usize {
        self.aligned.as_ptr() as usize
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// A numpy array over bytes `[offset, offset + nbytes)`, without a copy; it keeps the
    /// region alive.
    #[pyo3(signature = (offset, nbytes, dtype, shape=None))]
    fn view<'py>(
        slf: &Bound<'py, Self>,
        offset: usize,
        nbytes: usize,
        dtype: &Bound<'py, PyAny>,
        shape: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let region = slf.get();
        if offset
            .checked_add(nbytes)
            .is_none_or(|end| end > region.nbytes)
        {
            return Err(value_error(format!(
                "bytes [{offset}, {offset}+{nbytes}) are outside the {}-byte region",
                region.nbytes
            )));
        }
        // SAFETY: in bounds (checked above) and initialised (the region is zeroed at birth);
        // the array keeps `slf`, the owner of the memory, alive.
        // SAFETY: built from the region's own (mutable) pointer, not from a shared slice, so
        // numpy may write through it.
        let view =
            unsafe { ArrayView1::from_shape_ptr(nbytes, region.aligned.as_ptr().add(offset)) };
        let array = unsafe { PyArray1::borrow_from_array(&view, slf.clone().into_any()) };
        let typed = array.call_method1("view", (dtype,))?;
        match shape {
            Some(shape) if !shape.is_none() => typed.call_method1("reshape", (shape,)),
            _ => Ok(typed),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "HostRegion(nbytes={}, ptr=0x{:x})",
            self.nbytes,
            self.aligned.as_ptr() as usize
        )
    }
}

/// A live allocation from a `MemPool`: bytes `[offset, offset + size)` at address `ptr`.
#[pyclass(frozen, eq, hash, name = "Allocation", module = "atb_mem._core")]
#[derive(PartialEq, Eq, Hash)]
pub struct PyAllocation {
    /// Byte offset in the pool's region.
    #[pyo3(get)]
    offset: u64,
    /// Usable bytes (the request rounded up by the pool's policy).
    #[pyo3(get)]
    size: u64,
    /// Base address of the region plus `offset`.
    #[pyo3(get)]
    ptr: u64,
    pool_id: u64,
    node: u32,
    generation: u32,
}

#[pymethods]
impl PyAllocation {
    fn __repr__(&self) -> String {
        format!(
            "Allocation(offset={}, size={}, ptr=0x{:x})",
            self.offset, self.size, self.ptr
        )
    }
}

/// What a pool's bytes live in, given as `backing=`.
pub enum BackingArg {
    /// `"host"`: a `HostRegion` of the pool's capacity.
    Host,
    /// `None`: offsets only.
    Offsets,
    /// Any object with `ptr`, `nbytes` and `view(offset, nbytes, dtype, shape)`.
    Object(Py<PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for BackingArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_none() {
            return Ok(BackingArg::Offsets);
        }
        if let Ok(name) = obj.cast::<PyString>() {
            return match name.to_str()? {
                "host" => Ok(BackingArg::Host),
                other => Err(value_error(format!(
                    "unknown backing {other:?}: use \"host\", None, or a backing object"
                ))),
            };
        }
        for attribute in ["ptr", "nbytes", "view"] {
            if !obj.hasattr(attribute)? {
                return Err(type_error(format!(
                    "backing must be \"host\", None, or an object with ptr, nbytes and view(); \
                     {} has no {attribute}",
                    convert::type_name(&obj)
                )));
            }
        }
        Ok(BackingArg::Object(obj.to_owned().unbind()))
    }
}

struct PoolState {
    pool: MemPool,
    backing: Option<Py<PyAny>>,
    closed: bool,
}

/// A preallocated byte pool with O(1) `malloc`/`free` of any size inside it.
#[pyclass(frozen, name = "MemPool", module = "atb_mem._core")]
pub struct PyMemPool {
    state: Mutex<PoolState>,
    base_ptr: u64,
}

impl PyMemPool {
    fn lock(&self) -> PyResult<MutexGuard<'_, PoolState>> {
        let state = lock(&self.state);
        if state.closed {
            return Err(invalid_handle("the pool is closed"));
        }
        Ok(state)
    }

    fn handle(&self, allocation: PoolAllocation) -> PyAllocation {
        PyAllocation {
            offset: allocation.offset,
            size: allocation.size,
            ptr: self.base_ptr + allocation.offset,
            pool_id: allocation.pool_id,
            node: allocation.node,
            generation: allocation.generation,
        }
    }

    /// The live allocation an `Allocation` names.
    fn resolve(&self, allocation: &Bound<'_, PyAny>) -> PyResult<PoolAllocation> {
        let Ok(handle) = allocation.cast::<PyAllocation>() else {
            return Err(type_error(format!(
                "expected an Allocation from this pool, got {}",
                convert::type_name(allocation)
            )));
        };
        let handle = handle.get();
        self.lock()?
            .pool
            .get(handle.pool_id, handle.node, handle.generation)
            .into_py_result()
    }
}

#[pymethods]
impl PyMemPool {
    #[new]
    #[pyo3(
        signature = (capacity, *, alignment=None, policy=None, backing=BackingArg::Host, max_allocations=None),
        text_signature = "(capacity, *, alignment=64, policy='default', backing='host', max_allocations=65536)"
    )]
    fn new(
        py: Python<'_>,
        capacity: &Bound<'_, PyAny>,
        alignment: Option<Count<1>>,
        policy: Option<&str>,
        backing: BackingArg,
        max_allocations: Option<Count<1>>,
    ) -> PyResult<Self> {
        let capacity = match convert::count(capacity, "capacity", 1) {
            Ok(capacity) => capacity as u64,
            Err(_) if convert::is_int(capacity) => {
                return Err(value_error(format!(
                    "capacity must be in [1, 2**48] bytes, got {capacity}"
                )))
            }
            Err(error) => return Err(error),
        };
        let alignment = alignment.map_or(64, Count::as_u64);
        let max_allocations = max_allocations.map_or(1 << 16, Count::get);
        let max_allocations = u32::try_from(max_allocations)
            .map_err(|_| value_error(format!("max_allocations is too large: {max_allocations}")))?;
        let policy = AlignmentPolicy::parse(policy.unwrap_or("default")).into_py_result()?;
        let pool = MemPool::new(capacity, alignment, policy, max_allocations).into_py_result()?;
        let backing = match backing {
            BackingArg::Offsets => None,
            BackingArg::Host => {
                let nbytes = usize::try_from(capacity)
                    .map_err(|_| value_error("capacity too large for host memory"))?;
                let region =
                    HostRegion::allocate(nbytes, pool.alignment().max(4096) as usize, "capacity")?;
                Some(Py::new(py, region)?.into_any())
            }
            BackingArg::Object(object) => {
                let nbytes: u64 = object.bind(py).getattr("nbytes")?.extract()?;
                if nbytes < capacity {
                    return Err(value_error(format!(
                        "the backing holds {nbytes} bytes, less than the capacity {capacity}"
                    )));
                }
                Some(object)
            }
        };
        let base_ptr = match &backing {
            Some(backing) => backing.bind(py).getattr("ptr")?.extract::<u64>()?,
            None => 0,
        };
        Ok(PyMemPool {
            base_ptr,
            state: Mutex::new(PoolState {
                pool,
                backing,
                closed: false,
            }),
        })
    }

    #[getter]
    fn capacity(&self) -> PyResult<u64> {
        Ok(self.lock()?.pool.capacity())
    }

    #[getter]
    fn alignment(&self) -> PyResult<u64> {
        Ok(self.lock()?.pool.alignment())
    }

    #[getter]
    fn policy(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.pool.policy().name())
    }

    /// The object that owns the pool's bytes (None for an offsets-only pool).
    #[getter]
    fn backing(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        Ok(self
            .lock()?
            .backing
            .as_ref()
            .map(|backing| backing.clone_ref(py)))
    }

    /// Base address of the region (0 for an offsets-only pool).
    #[getter]
    fn base_ptr(&self) -> u64 {
        self.base_ptr
    }

    #[getter]
    fn closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Bytes `malloc(size)` would take.
    fn rounded_size(&self, size: Count<1>) -> PyResult<u64> {
        Ok(self.lock()?.pool.rounded_size(size.as_u64()))
    }

    fn malloc(&self, size: Count<1>) -> PyResult<PyAllocation> {
        let allocation = self.lock()?.pool.malloc(size.as_u64()).into_py_result()?;
        Ok(self.handle(allocation))
    }

    /// Frees an `Allocation`, or the allocation that starts at a pointer (an int).
    fn free(&self, allocation_or_ptr: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Ok(handle) = allocation_or_ptr.cast::<PyAllocation>() {
            let handle = handle.get();
            return self
                .lock()?
                .pool
                .free(handle.pool_id, handle.node, handle.generation)
                .map(|_| ())
                .into_py_result();
        }
        if !convert::is_int(allocation_or_ptr) {
            return Err(type_error(format!(
                "free() takes an Allocation or a pointer (int), got {}",
                convert::type_name(allocation_or_ptr)
            )));
        }
        let ptr: i128 = allocation_or_ptr
            .extract()
            .map_err(|_| invalid_handle("pointer out of range"))?;
        let offset = u64::try_from(ptr - self.base_ptr as i128)
            .map_err(|_| invalid_handle(format!("pointer {ptr} is not in this pool")))?;
        self.lock()?
            .pool
            .free_offset(offset)
            .map(|_| ())
            .into_py_result()
    }

    /// Whether an `Allocation` is live in this pool.
    fn owns(&self, allocation: &Bound<'_, PyAny>) -> PyResult<bool> {
        drop(self.lock()?); // a closed pool raises, as every call does
        match self.resolve(allocation) {
            Ok(_) => Ok(true),
            Err(error)
                if error.is_instance_of::<pyo3::exceptions::PyTypeError>(allocation.py()) =>
            {
                Err(error)
            }
            Err(_) => Ok(false),
        }
    }

    /// A view of an allocation's bytes as `dtype` (and `shape`), without a copy.
    #[pyo3(signature = (allocation, dtype, shape=None))]
    fn view<'py>(
        &self,
        py: Python<'py>,
        allocation: &Bound<'py, PyAny>,
        dtype: &Bound<'py, PyAny>,
        shape: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let live = self.resolve(allocation)?;
        let backing = self
            .lock()?
            .backing
            .as_ref()
            .map(|backing| backing.clone_ref(py))
            .ok_or_else(|| {
                value_error("an offsets-only pool (backing=None) has no bytes to view")
            })?;
        // A backing that knows its own dtypes (torch) sizes them; numpy sizes the rest.
        let (dtype, itemsize): (Bound<'py, PyAny>, u64) = if backing.bind(py).hasattr("itemsize")? {
            let itemsize = backing
                .bind(py)
                .call_method1("itemsize", (dtype,))?
                .extract()?;
            (dtype.clone(), itemsize)
        } else {
            let dtype = py.import("numpy")?.call_method1("dtype", (dtype,))?;
            let itemsize = dtype.getattr("itemsize")?.extract()?;
            (dtype, itemsize)
        };
        let shape = match shape.filter(|shape| !shape.is_none()) {
            None => PyTuple::new(py, [live.size / itemsize.max(1)])?,
            Some(shape) if convert::is_int(shape) => PyTuple::new(py, [shape])?,
            Some(shape) => PyTuple::new(py, shape.try_iter()?.collect::<PyResult<Vec<_>>>()?)?,
        };
        let mut elements: u64 = 1;
        for dim in shape.iter() {
            let dim = convert::count(&dim, "shape entries", 0)? as u64;
            elements = elements
                .checked_mul(dim)
                .ok_or_else(|| value_error("shape too large"))?;
        }
        let nbytes = elements
            .checked_mul(itemsize)
            .ok_or_else(|| value_error("shape too large"))?;
        if nbytes > live.size || itemsize == 0 {
            return Err(value_error(format!(
                "a view of shape {} of {} needs {nbytes} bytes; the allocation holds {}",
                shape.repr()?,
                dtype.str()?,
                live.size
            )));
        }
        backing
            .bind(py)
            .call_method1("view", (live.offset, nbytes, dtype, shape))
    }

    /// Frees every allocation; outstanding handles become stale.
    fn reset(&self) -> PyResult<()> {
        self.lock()?.pool.reset();
        Ok(())
    }

    /// Gives back the free tail of the region beyond `min_bytes_to_keep`; returns the bytes
    /// released. A later `malloc` that needs them takes them back.
    fn trim_to(&self, min_bytes_to_keep: Count<0>) -> PyResult<u64> {
        Ok(self.lock()?.pool.trim_to(min_bytes_to_keep.as_u64()))
    }

    /// Frees everything and drops the pool's reference to its bytes (views keep theirs).
    fn close(&self) {
        let mut state = lock(&self.state);
        if !state.closed {
            state.pool.reset();
            state.closed = true;
            state.backing = None;
        }
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.lock()?.pool.stats();
        convert::figures_to_dict(py, &stats)
    }

    /// Live allocations in address order: dicts of offset, size, requested and ptr.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let live = self.lock()?.pool.snapshot();
        let list = PyList::empty(py);
        for (offset, size, requested) in live {
            let entry = PyDict::new(py);
            entry.set_item("offset", offset)?;
            entry.set_item("size", size)?;
            entry.set_item("requested", requested)?;
            entry.set_item("ptr", self.base_ptr + offset)?;
            list.append(entry)?;
        }
        Ok(list)
    }

    /// Free ranges in address order: (offset, size) pairs.
    fn free_ranges(&self) -> PyResult<Vec<(u64, u64)>> {
        Ok(self.lock()?.pool.free_ranges())
    }

    fn _check_invariants(&self) -> PyResult<()> {
        self.lock()?
            .pool
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.pool.num_allocations())
    }

    fn __repr__(&self) -> String {
        let state = lock(&self.state);
        if state.closed {
            return "MemPool(closed)".into();
        }
        format!(
            "MemPool(capacity={}, allocated={}, allocations={}, policy='{}')",
            state.pool.capacity(),
            state.pool.allocated_bytes(),
            state.pool.num_allocations(),
            state.pool.policy().name()
        )
    }
}
