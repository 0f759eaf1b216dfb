//! Runs `STEPS` scheduler steps of a decoding batch (as `benches/step.rs` sets it up), for
//! tools that count instructions: `valgrind --tool=callgrind target/release/examples/step_cost
//! 256 ids 50 [executing]`.

use atb_mem_core::StepPlan;

#[path = "../benches/support/step_setup.rs"]
mod setup;
use setup::{decoding, step, Variant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let running: usize = args[1].parse().unwrap();
    let variant = match args[2].as_str() {
        "counts" => Variant::Counts,
        "ids" => Variant::Ids,
        "fork" => Variant::AfterFork,
        _ => Variant::SubBlocks,
    };
    let steps: usize = args[3].parse().unwrap();
    let executing = args.get(4).is_some_and(|how| how == "executing");
    let (mut scheduler, mut cache) = decoding(running, variant);
    let (mut plan, mut scratch) = (StepPlan::default(), Default::default());
    for _ in 0..steps {
        step(
            &mut scheduler,
            &mut cache,
            &mut plan,
            &mut scratch,
            executing,
        );
    }
    println!("{}", plan.decode_seq_ids.len());
}
