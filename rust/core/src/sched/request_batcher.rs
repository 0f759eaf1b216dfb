//! Request batching (what Triton's dynamic batcher and Ray Serve's `@serve.batch` do), as a
//! deterministic policy: the current time is always an argument, never read here.
//!
//! Requests wait in one FIFO queue per priority level (lower level first). A batch is
//! released when `max_batch_size` requests wait, when a preferred batch size can be formed,
//! or when the oldest request has waited `timeout`, whichever comes first. A request with its
//! own deadline that passes it while queued is rejected (or, with `TimeoutAction::Delay`,
//! kept). Cancelled and rejected requests are dropped from the queues lazily, so every
//! operation is O(1) amortised (O(log n) for deadlines).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use hashbrown::HashMap;

use crate::error::{CoreError, CoreResult};

/// What happens to a request whose own timeout passes while it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutAction {
    /// It leaves the queue and fails with a timeout.
    Reject,
    /// It stays queued and is served when its turn comes.
    Delay,
}

impl TimeoutAction {
    pub fn parse(name: &str) -> CoreResult<TimeoutAction> {
        match name {
            "reject" => Ok(TimeoutAction::Reject),
            "delay" => Ok(TimeoutAction::Delay),
            other => Err(invalid!(
                "timeout_action must be \"reject\" or \"delay\", got {other:?}"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TimeoutAction::Reject => "reject",
            TimeoutAction::Delay => "delay",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatcherConfig {
    pub max_batch_size: usize,
    /// How long the oldest request may wait for a batch to fill.
    pub timeout_ns: u64,
    /// Sizes worth releasing at once, before `max_batch_size` is reached.
    pub preferred_batch_sizes: Vec<usize>,
    pub max_queue_size: Option<usize>,
    pub priority_levels: usize,
    /// Each request's own deadline, unless it brings one.
    pub default_timeout_ns: Option<u64>,
    pub timeout_action: TimeoutAction,
}

impl BatcherConfig {
    pub fn validate(&self) -> CoreResult<()> {
        ensure!(
            self.max_batch_size != 0,
            "max_batch_size must be at least 1"
        );
        ensure!(
            self.priority_levels != 0 && self.priority_levels <= 1024,
            "priority_levels must be in [1, 1024]"
        );
        ensure!(
            self.max_queue_size != Some(0),
            "max_queue_size must be at least 1 (or None)",
        );
        if let Some(&bad) = self
            .preferred_batch_sizes
            .iter()
            .find(|&&size| size == 0 || size > self.max_batch_size)
        {
            return Err(invalid!(
                "preferred batch size {bad} is not in [1, max_batch_size={}]",
                self.max_batch_size
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct Queued {
    id: u64,
    enqueued_ns: u64,
}

/// What `poll` decided: a batch to run and requests that timed out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Poll {
    /// Request ids of the batch, by priority then arrival (empty if none is ready).
    pub batch: Vec<u64>,
    /// Requests whose own timeout passed (rejected).
    pub expired: Vec<u64>,
    /// When something will next be due, if anything is queued.
    pub next_wakeup_ns: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct RequestBatcher {
    config: BatcherConfig,
    levels: Vec<VecDeque<Queued>>,
    /// Queued requests: id → its deadline. Ids in `levels` or `deadlines` but not here were
    /// cancelled or expired and are skipped when met.
    live: HashMap<u64, Option<u64>>,
    deadlines: BinaryHeap<Reverse<(u64, u64)>>,
}

impl RequestBatcher {
    pub fn new(config: BatcherConfig) -> CoreResult<Self> {
        config.validate()?;
        let levels = (0..config.priority_levels)
            .map(|_| VecDeque::new())
            .collect();
        Ok(RequestBatcher {
            config,
            levels,
            live: HashMap::new(),
            deadlines: BinaryHeap::new(),
        })
    }

    pub fn config(&self) -> &BatcherConfig {
        &self.config
    }

    /// Replaces the configuration (validated first; a bad one changes nothing). Requests at
    /// priority levels the new configuration lacks move to its lowest-priority level.
    pub fn set_config(&mut self, config: BatcherConfig) -> CoreResult<BatcherConfig> {
        config.validate()?;
        while self.levels.len() > config.priority_levels {
            let dropped = self.levels.pop().unwrap_or_default();
            if let Some(last) = self.levels.last_mut() {
                last.extend(dropped);
            }
        }
        self.levels
            .resize_with(config.priority_levels, VecDeque::new);
        Ok(std::mem::replace(&mut self.config, config))
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.live.contains_key(&id)
    }

    /// Queues a request. A full queue refuses it at once.
    pub fn submit(
        &mut self,
        id: u64,
        priority: usize,
        now_ns: u64,
        timeout_ns: Option<u64>,
    ) -> CoreResult<()> {
        ensure!(
            priority < self.config.priority_levels,
            "priority {priority} is not in [0, {})",
            self.config.priority_levels
        );
        if self.live.contains_key(&id) {
            return Err(CoreError::DuplicateSequence(id));
        }
        if let Some(limit) = self.config.max_queue_size {
            if self.live.len() >= limit {
                return Err(CoreError::QueueFull { capacity: limit });
            }
        }
        let deadline = timeout_ns
            .or(self.config.default_timeout_ns)
            .map(|timeout| now_ns.saturating_add(timeout));
        if let (Some(deadline), TimeoutAction::Reject) = (deadline, self.config.timeout_action) {
            self.deadlines.push(Reverse((deadline, id)));
        }
        self.live.insert(id, deadline);
        self.levels[priority].push_back(Queued {
            id,
            enqueued_ns: now_ns,
        });
        Ok(())
    }

    /// Takes a request out of the queue; false if it is not queued.
    pub fn cancel(&mut self, id: u64) -> bool {
        self.live.remove(&id).is_some()
    }

    fn purge_fronts(&mut self) {
        for level in &mut self.levels {
            while level
                .front()
                .is_some_and(|queued| !self.live.contains_key(&queued.id))
            {
                level.pop_front();
            }
        }
        while let Some(&Reverse((_, id))) = self.deadlines.peek() {
            if self.live.contains_key(&id) {
                break;
            }
            self.deadlines.pop();
        }
    }

    fn oldest_enqueued(&self) -> Option<u64> {
        self.levels
            .iter()
            .filter_map(|level| level.front())
            .map(|queued| queued.enqueued_ns)
            .min()
    }

    /// Rejects what timed out, then releases a batch if one is due at `now_ns`.
    pub fn poll(&mut self, now_ns: u64) -> Poll {
        let mut poll = Poll::default();
        while let Some(&Reverse((deadline, id))) = self.deadlines.peek() {
            if deadline > now_ns {
                break;
            }
            self.deadlines.pop();
            if self.live.get(&id) == Some(&Some(deadline)) {
                self.live.remove(&id);
                poll.expired.push(id);
            }
        }
        self.purge_fronts();
        let waiting = self.live.len();
        if let Some(oldest) = self.oldest_enqueued() {
            let timed_out = now_ns >= oldest.saturating_add(self.config.timeout_ns);
            let size = if waiting >= self.config.max_batch_size {
                self.config.max_batch_size
            } else if timed_out {
                waiting
            } else {
                self.config
                    .preferred_batch_sizes
                    .iter()
                    .copied()
                    .filter(|&size| size <= waiting)
                    .max()
                    .unwrap_or(0)
            };
            self.take(size, &mut poll.batch);
        }
        self.purge_fronts();
        poll.next_wakeup_ns = self.next_wakeup();
        poll
    }

    /// When the next batch or timeout is due, if anything is queued.
    pub fn next_wakeup(&self) -> Option<u64> {
        let batch_due = self
            .oldest_enqueued()
            .map(|oldest| oldest.saturating_add(self.config.timeout_ns));
        let deadline = self
            .deadlines
            .peek()
            .map(|&Reverse((deadline, _))| deadline);
        match (batch_due, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn take(&mut self, size: usize, batch: &mut Vec<u64>) {
        for level in &mut self.levels {
            while batch.len() < size {
                let Some(queued) = level.pop_front() else {
                    break;
                };
                if self.live.remove(&queued.id).is_some() {
                    batch.push(queued.id);
                }
            }
        }
    }

    /// Empties the queue, returning the waiting requests by priority then arrival.
    pub fn drain(&mut self) -> Vec<u64> {
        let mut all = Vec::with_capacity(self.live.len());
        self.take(usize::MAX, &mut all);
        self.deadlines.clear();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(max_batch_size: usize, timeout_ns: u64) -> BatcherConfig {
        BatcherConfig {
            max_batch_size,
            timeout_ns,
            preferred_batch_sizes: vec![],
            max_queue_size: None,
            priority_levels: 2,
            default_timeout_ns: None,
            timeout_action: TimeoutAction::Reject,
        }
    }

    #[test]
    fn releases_at_max_size_or_exactly_at_the_timeout() {
        let mut batcher = RequestBatcher::new(config(3, 50)).unwrap();
        for id in 0..4 {
            batcher.submit(id, 0, 10, None).unwrap();
        }
        assert_eq!(batcher.poll(10).batch, [0, 1, 2]);
        assert_eq!(batcher.poll(59).batch, Vec::<u64>::new());
        assert_eq!(batcher.next_wakeup(), Some(60));
        assert_eq!(batcher.poll(60).batch, [3]);
        assert_eq!(batcher.poll(1000), Poll::default());
    }

    #[test]
    fn priorities_then_arrival_and_preferred_sizes() {
        let mut cfg = config(8, 100);
        cfg.preferred_batch_sizes = vec![2];
        let mut batcher = RequestBatcher::new(cfg).unwrap();
        batcher.submit(1, 1, 0, None).unwrap();
        assert_eq!(batcher.poll(0).batch, Vec::<u64>::new());
        batcher.submit(2, 0, 1, None).unwrap();
        assert_eq!(batcher.poll(1).batch, [2, 1]);
    }

    #[test]
    fn deadlines_reject_cancel_and_queue_limits() {
        let mut cfg = config(4, 1000);
        cfg.max_queue_size = Some(2);
        let mut batcher = RequestBatcher::new(cfg).unwrap();
        batcher.submit(1, 0, 0, Some(10)).unwrap();
        batcher.submit(2, 0, 0, None).unwrap();
        assert_eq!(
            batcher.submit(3, 0, 0, None),
            Err(CoreError::QueueFull { capacity: 2 })
        );
        assert!(batcher.cancel(2));
        assert!(!batcher.cancel(2));
        let poll = batcher.poll(10);
        assert_eq!((poll.batch.len(), poll.expired), (0, vec![1]));
        assert!(batcher.is_empty());
        assert_eq!(
            batcher.submit(4, 5, 0, None),
            Err(CoreError::invalid("priority 5 is not in [0, 2)"))
        );
    }
}
