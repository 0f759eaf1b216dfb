//! Host buffers whose length a caller chose: bounded in bytes up front, then reserved fallibly.
//!
//! A constructor sized by an argument (`num_blocks`, `max_seqs`, `max_allocations`) first adds
//! up the bytes its bookkeeping will take, with checked arithmetic, and refuses more than
//! [`MAX_BOOKKEEPING_BYTES`] ([`check_bookkeeping`]). It then builds each buffer with
//! [`try_filled_vec`] or [`try_with_capacity`], which return
//! [`CoreError::HostOutOfMemory`] where `vec![value; n]` or `Vec::with_capacity(n)` would
//! abort the whole process (and a Python interpreter with it) when the host is short of memory.

use std::mem::size_of;

use crate::error::{CoreError, CoreResult};

/// Most host memory the bookkeeping of one object may take: 8 GiB, above the largest block
/// pool (`MAX_BLOCKS`, about 4.6 GiB) or byte pool (`MAX_ALLOCATIONS`, about 4.5 GiB) and far
/// above any real configuration.
pub const MAX_BOOKKEEPING_BYTES: u64 = 8 << 30;

/// Bytes of `n` values of `T`; `None` when that overflows a `u64`.
#[inline]
pub fn array_bytes<T>(n: usize) -> Option<u64> {
    u64::try_from(n).ok()?.checked_mul(size_of::<T>() as u64)
}

/// The sum of byte counts; `None` when any is `None` or the sum overflows.
pub fn total_bytes(parts: &[Option<u64>]) -> Option<u64> {
    parts
        .iter()
        .try_fold(0u64, |total, &part| total.checked_add(part?))
}

/// `bytes` in GiB, for messages.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Refuses bookkeeping of `bytes` (`None`: more than a `u64` counts) above
/// [`MAX_BOOKKEEPING_BYTES`] with an `InvalidArgument` that names `what` (the arguments, as
/// `"num_blocks = 1234"`) and the bytes. Returns the bytes otherwise.
pub fn check_bookkeeping(bytes: Option<u64>, what: impl FnOnce() -> String) -> CoreResult<u64> {
    match bytes {
        Some(bytes) if bytes <= MAX_BOOKKEEPING_BYTES => Ok(bytes),
        Some(bytes) => Err(invalid!(
            "{} would take {bytes} bytes ({}) of host bookkeeping, more than the {} one object \
             may take",
            what(),
            gib(bytes),
            gib(MAX_BOOKKEEPING_BYTES),
        )),
        None => Err(invalid!(
            "{} would take more than 2**64 bytes of host bookkeeping",
            what()
        )),
    }
}

/// The error for a failed host allocation of `bytes` for `what`.
pub fn out_of_host_memory(bytes: Option<u64>, what: &str) -> CoreError {
    CoreError::HostOutOfMemory {
        what: what.to_owned(),
        bytes: bytes.unwrap_or(u64::MAX),
    }
}

/// An empty vector with room for exactly `n` values, or [`CoreError::HostOutOfMemory`]
/// naming `what` and the bytes if the host cannot provide them.
pub fn try_with_capacity<T>(n: usize, what: &str) -> CoreResult<Vec<T>> {
    let mut vec = Vec::new();
    vec.try_reserve_exact(n)
        .map_err(|_| out_of_host_memory(array_bytes::<T>(n), what))?;
    Ok(vec)
}

/// `vec![value; n]`, or [`CoreError::HostOutOfMemory`] naming `what` and the bytes if the host
/// cannot provide them.
pub fn try_filled_vec<T: Clone>(n: usize, value: T, what: &str) -> CoreResult<Vec<T>> {
    let mut vec = try_with_capacity(n, what)?;
    // Within the capacity just reserved: this writes, it does not allocate.
    vec.resize(n, value);
    Ok(vec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_vec_is_vec_macro() {
        assert_eq!(try_filled_vec(5, 7u32, "x").unwrap(), vec![7u32; 5]);
        assert!(try_filled_vec(0, 7u32, "x").unwrap().is_empty());
        let vec = try_with_capacity::<u64>(9, "x").unwrap();
        assert!(vec.is_empty() && vec.capacity() >= 9);
    }

    #[test]
    fn huge_lengths_are_errors_not_aborts() {
        // Over isize::MAX bytes: a capacity overflow.
        let error = try_filled_vec(usize::MAX / 2, 0u64, "the test buffer").unwrap_err();
        assert!(matches!(
            error,
            CoreError::HostOutOfMemory {
                bytes: u64::MAX,
                ..
            }
        ));
        // 2**60 bytes fit isize but no address space: the allocator itself fails.
        let error = try_filled_vec(1usize << 60, 0u8, "the test buffer").unwrap_err();
        assert_eq!(
            error,
            CoreError::HostOutOfMemory {
                what: "the test buffer".into(),
                bytes: 1 << 60
            }
        );
        let message = error.to_string();
        assert!(message.contains("the test buffer") && message.contains("1152921504606846976"));
        assert!(try_with_capacity::<[u64; 4]>(1usize << 58, "x").is_err());
    }

    #[test]
    fn byte_counts_are_checked() {
        assert_eq!(array_bytes::<u32>(10), Some(40));
        assert_eq!(array_bytes::<u64>(usize::MAX), None);
        assert_eq!(
            total_bytes(&[Some(1), Some(2), array_bytes::<u8>(3)]),
            Some(6)
        );
        assert_eq!(total_bytes(&[Some(u64::MAX), Some(1)]), None);
        assert_eq!(total_bytes(&[Some(1), None]), None);
    }

    #[test]
    fn bookkeeping_over_the_limit_is_refused_naming_the_argument() {
        assert_eq!(
            check_bookkeeping(Some(1 << 20), || unreachable!()),
            Ok(1 << 20)
        );
        assert_eq!(
            check_bookkeeping(Some(MAX_BOOKKEEPING_BYTES), String::new),
            Ok(MAX_BOOKKEEPING_BYTES)
        );
        let error =
            check_bookkeeping(Some(MAX_BOOKKEEPING_BYTES + 1), || "n = 5".into()).unwrap_err();
        assert!(matches!(error, CoreError::InvalidArgument(_)));
        let message = error.to_string();
        assert!(
            message.starts_with("n = 5 would take 8589934593 bytes"),
            "{message}"
        );
        let message = check_bookkeeping(None, || "n = 6".into())
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("n = 6") && message.contains("2**64 bytes"),
            "{message}"
        );
    }
}
