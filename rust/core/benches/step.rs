//! What a scheduler step costs, in the core: step plus on_tokens with a batch decoding, as
//! a plain batch (prompts given as counts, or as token ids), after one request of two
//! samples ran and ended (a fork happened), and with `hash_block_size = 4` and one request
//! waiting for a seat. `cargo bench -p atb-mem-core --bench step`.
//!
//! Each as `step` (the caller executes the moves: nothing to roll back) and as
//! `step_executing` (the step executes them and rolls back if that fails): what the undo
//! record costs is the difference.
//! `benches/step_rollback_cost.py` measures the same through Python.

use atb_mem_core::StepPlan;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};

#[path = "support/step_setup.rs"]
mod setup;
use setup::{decoding, step, Variant};

fn decode_step(c: &mut Criterion) {
    for running in [256, 4096] {
        let variants = [
            ("plain, counts", Variant::Counts),
            ("plain, token ids", Variant::Ids),
            ("after a fork", Variant::AfterFork),
            ("hash_block_size 4, one waiting", Variant::SubBlocks),
        ];
        for ((label, variant), executing) in variants
            .into_iter()
            .flat_map(|variant| [(variant, false), (variant, true)])
        {
            let state = decoding(running, variant);
            let how = if executing { "step_executing" } else { "step" };
            let name = format!("{how}/{running} running, {label}");
            // A run of steps starts from a copy of the same state; only the steps are timed.
            c.bench_function(&name, |b| {
                b.iter_custom(|iters| {
                    let mut timed = Duration::ZERO;
                    let mut left = iters;
                    while left > 0 {
                        let (mut scheduler, mut cache) = state.clone();
                        let mut plan = StepPlan::default();
                        let mut scratch = Default::default();
                        let steps = left.min(64);
                        let start = Instant::now();
                        for _ in 0..steps {
                            step(
                                &mut scheduler,
                                &mut cache,
                                &mut plan,
                                &mut scratch,
                                executing,
                            );
                        }
                        timed += start.elapsed();
                        left -= steps;
                    }
                    timed
                })
            });
        }
    }
}

criterion_group!(
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = decode_step
);
criterion_main!(benches);
