//! The lock inside every pyclass that owns core state.
//!
//! A compound operation (plan → execute → commit) holds the lock while Python executes its
//! block moves, and that Python code may release the GIL (a large copy does). A thread that
//! then blocked on the lock *with* the GIL would wait for the holder, and the holder for the
//! GIL: so a contended lock is waited for without the GIL. A thread that asks again for a
//! lock it holds (a callback calling back into the pool) gets an error, not a deadlock.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

thread_local! {
    static THREAD_TOKEN: Cell<u8> = const { Cell::new(0) };
}

/// A number unique to the calling thread while it lives (the address of a thread-local).
fn thread_token() -> usize {
    THREAD_TOKEN.with(|token| token as *const Cell<u8> as usize)
}

pub(crate) struct PyLock<T> {
    value: Mutex<T>,
    /// `thread_token()` of the holder, 0 when free.
    owner: AtomicUsize,
}

pub(crate) struct Guard<'a, T> {
    guard: MutexGuard<'a, T>,
    /// Set while a holder that runs Python holds the lock (see `lock_running_python`).
    owner: Option<&'a AtomicUsize>,
}

impl<T: Send> PyLock<T> {
    pub(crate) fn new(value: T) -> Self {
        PyLock {
            value: Mutex::new(value),
            owner: AtomicUsize::new(0),
        }
    }

    pub(crate) fn lock(&self) -> PyResult<Guard<'_, T>> {
        let guard = self.acquire()?;
        Ok(Guard { guard, owner: None })
    }

    /// The lock for an operation that calls Python while holding it (a byte executor):
    /// a call back into this object from that Python code is then an error, not a deadlock.
    pub(crate) fn lock_running_python(&self) -> PyResult<Guard<'_, T>> {
        let guard = self.acquire()?;
        self.owner.store(thread_token(), Ordering::Relaxed);
        Ok(Guard {
            guard,
            owner: Some(&self.owner),
        })
    }

    fn acquire(&self) -> PyResult<MutexGuard<'_, T>> {
        loop {
            match self.value.try_lock() {
                Ok(guard) => return Ok(guard),
                // The core never panics while holding the lock, so a poisoned lock still
                // holds a consistent value.
                Err(TryLockError::Poisoned(poisoned)) => return Ok(poisoned.into_inner()),
                Err(TryLockError::WouldBlock) => {}
            }
            if self.owner.load(Ordering::Relaxed) == thread_token() {
                return Err(PyRuntimeError::new_err(
                    "re-entrant call: this object is busy with an operation of this thread \
                     (a byte executor must not call back into its pool)",
                ));
            }
            Python::attach(|py| py.detach(|| drop(self.value.lock())));
        }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        if let Some(owner) = self.owner {
            owner.store(0, Ordering::Relaxed);
        }
    }
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// Locks a plain mutex whose holder never runs Python.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The core never panics while holding the lock, so a poisoned lock still holds a
    // consistent value.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
