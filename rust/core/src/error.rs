//! The one error type of the core. The Python binding maps each variant to exactly one
//! exception class, so the variant is the contract and the message is for people.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// Not enough free plus evictable blocks for the whole request.
    OutOfBlocks { needed: usize, available: usize },
    /// Not enough free host blocks to swap the sequences out.
    OutOfHostBlocks { needed: usize, available: usize },
    /// No sequence with this id.
    UnknownSequence(u64),
    /// A sequence with this id exists already.
    DuplicateSequence(u64),
    /// The byte pool has no free range large enough (or no room for another allocation).
    PoolExhausted {
        requested: u64,
        free: u64,
        largest_free: u64,
        too_many_allocations: Option<u32>,
    },
    /// A double free, or a stale or foreign allocation handle.
    InvalidHandle(String),
    /// The request queue holds its maximum already.
    QueueFull { capacity: usize },
    /// The host could not provide `bytes` of memory for `what` (the bookkeeping a size
    /// argument asked for: `what` names that argument).
    HostOutOfMemory { what: String, bytes: u64 },
    /// An argument that can never be valid (a count out of range, a malformed shape, a
    /// batch that names a sequence twice, ...).
    InvalidArgument(String),
    /// The executor failed with the first `attempted` of a transaction's block moves
    /// possibly run. Everything was put back as it was before the operation, except the
    /// sequences whose bytes the partial execution destroyed: those (`aborted`) were ended.
    MovesFailed { attempted: usize, aborted: Vec<u64> },
    /// The scheduler refuses request `seq_id` for `reason`: it could never run (or no longer
    /// could under a new configuration). The id is a field, so that a caller that knows the
    /// request by another name can say the reason under that name.
    RequestRefused { seq_id: u64, reason: String },
}

pub type CoreResult<T> = Result<T, CoreError>;

/// `ensure!(condition, "message {with} {args}")`: returns
/// [`CoreError::InvalidArgument`] with that message unless the condition holds.
macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err($crate::error::CoreError::InvalidArgument(format!($($message)+)));
        }
    };
}

/// `invalid!("message {with} {args}")`: a [`CoreError::InvalidArgument`] with that message.
macro_rules! invalid {
    ($($message:tt)+) => {
        $crate::error::CoreError::InvalidArgument(format!($($message)+))
    };
}

impl CoreError {
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        CoreError::InvalidArgument(message.into())
    }

    /// For `ok_or_else` on lookups that succeed on every hot path: built eagerly (`ok_or`),
    /// the unused error was dropped on each success, since the enum has variants that own
    /// memory (a fifth of a step's lookups' instructions, measured with callgrind).
    #[cold]
    pub(crate) fn unknown_sequence(seq_id: u64) -> Self {
        CoreError::UnknownSequence(seq_id)
    }

    /// `OutOfBlocks` for one block: the guard on allocations whose budget was checked.
    #[cold]
    pub(crate) fn no_block() -> Self {
        CoreError::OutOfBlocks {
            needed: 1,
            available: 0,
        }
    }
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::OutOfBlocks { needed, available } => write!(
                f,
                "out of KV-cache blocks: the request needs {needed} more block(s), \
                 {available} are free or evictable"
            ),
            CoreError::PoolExhausted {
                requested,
                free,
                largest_free,
                too_many_allocations: None,
            } => write!(
                f,
                "MemPool out of memory: requested {requested} bytes, {free} bytes free, \
                 largest free range {largest_free} bytes"
            ),
            CoreError::PoolExhausted {
                requested,
                too_many_allocations: Some(limit),
                ..
            } => write!(
                f,
                "MemPool out of allocations: requested {requested} bytes, but {limit} allocations \
                 (max_allocations) are live"
            ),
            CoreError::InvalidHandle(message) => write!(f, "invalid allocation handle: {message}"),
            CoreError::OutOfHostBlocks { needed, available } => write!(
                f,
                "out of host blocks: swapping out needs {needed} host block(s), {available} are free"
            ),
            CoreError::QueueFull { capacity } => {
                write!(f, "the request queue is full ({capacity} requests waiting)")
            }
            CoreError::UnknownSequence(id) => write!(f, "unknown sequence id {id}"),
            CoreError::DuplicateSequence(id) => write!(f, "sequence id {id} already exists"),
            CoreError::HostOutOfMemory { what, bytes } => write!(
                f,
                "out of host memory: could not allocate {bytes} bytes for {what}"
            ),
            CoreError::InvalidArgument(message) => f.write_str(message),
            CoreError::RequestRefused { seq_id, reason } => write!(f, "request {seq_id} {reason}"),
            CoreError::MovesFailed { attempted, aborted } if aborted.is_empty() => write!(
                f,
                "executing block moves failed ({attempted} attempted); nothing was lost: the \
                 operation was rolled back"
            ),
            CoreError::MovesFailed { attempted, aborted } => write!(
                f,
                "executing block moves failed ({attempted} attempted); rolled back, and ended \
                 the sequences whose bytes were lost: {aborted:?}"
            ),
        }
    }
}

impl std::error::Error for CoreError {}
