//! Undo logs: how a step whose block moves fail puts back exactly what it changed.
//!
//! A transaction (a scheduler step, a swap executed with its moves) calls [`Undo::begin`]
//! on the state it may change, plans, executes, and then either [`Undo::commit`]s, which
//! forgets the record, or [`Undo::rollback`]s, which puts every recorded change back, newest
//! first. Each structure records its own changes as they happen — an array entry's old
//! value, an element pushed or popped, the scalars it had at `begin` — so a rollback costs
//! what the transaction changed, never what the state holds, and no caller has to foresee
//! whether a step might move blocks. Outside a transaction nothing is recorded: a write costs
//! one predictable branch more.
//!
//! The record is kept in each structure's own buffers, which keep their capacity between
//! transactions: a warm transaction allocates nothing.

use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set by [`skip_one_undo`]: the next rollback of an array entry is skipped.
static SKIP_ONE: AtomicBool = AtomicBool::new(false);

/// Makes the next rollback skip putting back one array entry: a negative control for the
/// tests that check rollbacks, which must then fail. Not for use outside tests.
#[doc(hidden)]
pub fn skip_one_undo() {
    SKIP_ONE.store(true, Ordering::Relaxed);
}

/// State that records its changes between `begin` and `commit` or `rollback`.
pub(crate) trait Undo {
    /// Starts recording changes.
    fn begin(&mut self);
    /// Forgets what was recorded: the changes stand.
    fn commit(&mut self);
    /// Puts back everything recorded since `begin`, newest first, and stops recording.
    fn rollback(&mut self);
}

/// A part of a structure: a borrowed field that records its own changes.
impl<T: Undo + ?Sized> Undo for &mut T {
    fn begin(&mut self) {
        (**self).begin();
    }

    fn commit(&mut self) {
        (**self).commit();
    }

    fn rollback(&mut self) {
        (**self).rollback();
    }
}

/// Several parts as one, in their order: a structure lists its parts once (its
/// `undo_parts`), and its `begin`, `commit` and `rollback` each call that one list.
macro_rules! undo_for_tuple {
    ($($index:tt: $part:ident),+) => {
        impl<$($part: Undo),+> Undo for ($($part,)+) {
            fn begin(&mut self) {
                $(self.$index.begin();)+
            }

            fn commit(&mut self) {
                $(self.$index.commit();)+
            }

            fn rollback(&mut self) {
                $(self.$index.rollback();)+
            }
        }
    };
}

undo_for_tuple!(0: A, 1: B);
undo_for_tuple!(0: A, 1: B, 2: C);
undo_for_tuple!(0: A, 1: B, 2: C, 3: D);
undo_for_tuple!(0: A, 1: B, 2: C, 3: D, 4: E);
undo_for_tuple!(0: A, 1: B, 2: C, 3: D, 4: E, 5: F);
undo_for_tuple!(0: A, 1: B, 2: C, 3: D, 4: E, 5: F, 6: G);
undo_for_tuple!(0: A, 1: B, 2: C, 3: D, 4: E, 5: F, 6: G, 7: H);
undo_for_tuple!(0: A, 1: B, 2: C, 3: D, 4: E, 5: F, 6: G, 7: H, 8: I);
undo_for_tuple!(0: A, 1: B, 2: C, 3: D, 4: E, 5: F, 6: G, 7: H, 8: I, 9: J);

/// A part of a structure that keeps no record of its own: the field (`.0`) is copied into
/// its place in the structure's record (`.1`) at `begin`, and swapped back at `rollback`,
/// so the record's buffer keeps its capacity for the next transaction.
pub(crate) struct Kept<'a, T>(pub(crate) &'a mut T, pub(crate) &'a mut T);

impl<T: Clone> Undo for Kept<'_, T> {
    fn begin(&mut self) {
        self.1.clone_from(self.0);
    }

    fn commit(&mut self) {}

    fn rollback(&mut self) {
        std::mem::swap(self.0, self.1);
    }
}

impl<T: Undo> Undo for Option<T> {
    fn begin(&mut self) {
        if let Some(inner) = self {
            inner.begin();
        }
    }

    fn commit(&mut self) {
        if let Some(inner) = self {
            inner.commit();
        }
    }

    fn rollback(&mut self) {
        if let Some(inner) = self {
            inner.rollback();
        }
    }
}

/// One recorded change of an [`UndoVec`].
#[derive(Clone)]
enum Change<T> {
    Set(u32, T),
    /// This many items pushed.
    Pushed(u32),
    Popped(T),
}

/// A vector whose writes go through methods that record, during a transaction, how to undo
/// them. It reads as a slice.
#[derive(Clone)]
pub(crate) struct UndoVec<T> {
    items: Vec<T>,
    changes: Vec<Change<T>>,
    recording: bool,
}

impl<T> UndoVec<T> {
    pub(crate) fn new(items: Vec<T>) -> Self {
        UndoVec {
            items,
            changes: Vec::new(),
            recording: false,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.items.capacity()
    }

    /// Replaces the whole vector, outside any transaction (a structure sized once).
    pub(crate) fn replace(&mut self, items: Vec<T>) {
        debug_assert!(
            !self.recording,
            "a whole vector replaced inside a transaction"
        );
        self.items = items;
    }
}

impl<T: Clone> UndoVec<T> {
    #[inline]
    pub(crate) fn set(&mut self, index: usize, value: T) {
        let old = std::mem::replace(&mut self.items[index], value);
        if self.recording {
            self.changes.push(Change::Set(index as u32, old));
        }
    }

    /// Applies `change` to entry `index`.
    #[inline]
    pub(crate) fn update(&mut self, index: usize, change: impl FnOnce(&mut T)) {
        if self.recording {
            self.changes
                .push(Change::Set(index as u32, self.items[index].clone()));
        }
        change(&mut self.items[index]);
    }

    #[inline]
    pub(crate) fn push(&mut self, value: T) {
        self.items.push(value);
        if self.recording {
            self.changes.push(Change::Pushed(1));
        }
    }

    #[inline]
    pub(crate) fn pop(&mut self) -> Option<T> {
        let value = self.items.pop()?;
        if self.recording {
            self.changes.push(Change::Popped(value.clone()));
        }
        Some(value)
    }

    pub(crate) fn clear(&mut self) {
        match self.recording {
            true => while self.pop().is_some() {},
            false => self.items.clear(),
        }
    }
}

impl<T: Clone> Undo for UndoVec<T> {
    fn begin(&mut self) {
        debug_assert!(self.changes.is_empty());
        self.recording = true;
    }

    fn commit(&mut self) {
        self.changes.clear();
        self.recording = false;
    }

    fn rollback(&mut self) {
        while let Some(change) = self.changes.pop() {
            match change {
                Change::Set(index, old) => {
                    let skip =
                        SKIP_ONE.load(Ordering::Relaxed) && SKIP_ONE.swap(false, Ordering::Relaxed);
                    if !skip {
                        self.items[index as usize] = old;
                    }
                }
                Change::Pushed(count) => {
                    let len = self.items.len() - count as usize;
                    self.items.truncate(len);
                }
                Change::Popped(value) => self.items.push(value),
            }
        }
        self.recording = false;
    }
}

impl<T> Deref for UndoVec<T> {
    type Target = [T];

    #[inline]
    fn deref(&self) -> &[T] {
        &self.items
    }
}

impl<'a, T> IntoIterator for &'a UndoVec<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl<T> Default for UndoVec<T> {
    fn default() -> Self {
        UndoVec::new(Vec::new())
    }
}

/// Printed as the vector it holds: a record is no state.
impl<T: fmt::Debug> fmt::Debug for UndoVec<T> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.items.fmt(formatter)
    }
}

/// Values a structure had at `begin` (its scalars), kept to be put back by `rollback`.
#[derive(Clone)]
pub(crate) struct Saved<T>(Option<T>);

impl<T> Default for Saved<T> {
    fn default() -> Self {
        Saved(None)
    }
}

impl<T> Saved<T> {
    pub(crate) fn save(&mut self, values: T) {
        self.0 = Some(values);
    }

    /// What `save` kept, if a transaction is open; forgets it.
    pub(crate) fn take(&mut self) -> Option<T> {
        self.0.take()
    }

    pub(crate) fn forget(&mut self) {
        self.0 = None;
    }

    pub(crate) fn is_saved(&self) -> bool {
        self.0.is_some()
    }

    #[inline]
    pub(crate) fn peek(&self) -> Option<&T> {
        self.0.as_ref()
    }
}

impl<T> fmt::Debug for Saved<T> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("_")
    }
}

/// A whole value copied at its first change in a transaction (for structures with no cheap
/// per-entry record, such as a heap, and which only some configurations use).
#[derive(Clone, Default)]
pub(crate) struct CopyOnChange<T> {
    backup: T,
    recording: bool,
    copied: bool,
}

impl<T: Clone> CopyOnChange<T> {
    /// Call before changing `value` (the structure this record belongs to).
    #[inline]
    pub(crate) fn before_change(&mut self, value: &T) {
        if self.recording && !self.copied {
            self.backup.clone_from(value);
            self.copied = true;
        }
    }

    /// This record with the value it copies, as a part of their structure.
    pub(crate) fn of<'a>(&'a mut self, value: &'a mut T) -> impl Undo + 'a {
        Copying {
            record: self,
            value,
        }
    }
}

struct Copying<'a, T> {
    record: &'a mut CopyOnChange<T>,
    value: &'a mut T,
}

impl<T: Clone> Undo for Copying<'_, T> {
    fn begin(&mut self) {
        self.record.recording = true;
        self.record.copied = false;
    }

    fn commit(&mut self) {
        self.record.recording = false;
        self.record.copied = false;
    }

    fn rollback(&mut self) {
        if self.record.copied {
            self.value.clone_from(&self.record.backup);
        }
        self.commit();
    }
}

impl<T> fmt::Debug for CopyOnChange<T> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("_")
    }
}

/// The transaction that last changed an entry, so that its old value is recorded once per
/// transaction. No state: printed as `_`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Stamp(pub(crate) u64);

impl fmt::Debug for Stamp {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("_")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollback_puts_back_sets_pushes_and_pops_newest_first() {
        let mut items = UndoVec::new(vec![1, 2, 3]);
        items.set(0, 9); // untracked: no transaction
        items.begin();
        items.set(1, 7);
        items.set(1, 8);
        items.push(4);
        items.pop();
        items.pop();
        items.push(5);
        items.update(0, |value| *value += 1);
        assert_eq!(&*items, &[10, 8, 5]);
        items.rollback();
        assert_eq!(&*items, &[9, 2, 3]);
        items.begin();
        items.clear();
        items.commit();
        assert!(items.is_empty());
        items.rollback(); // nothing recorded
        assert!(items.is_empty());
    }
}
