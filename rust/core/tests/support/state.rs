//! The scheduler's and the cache's state as text, to compare before and after a call that
//! must change nothing: their `Debug` output without the scratch buffers, which hold no
//! state between calls.

use atb_mem_core::{ContinuousScheduler, KvCache};

#[allow(dead_code)] // each test binary uses one of the two
pub fn state(scheduler: &ContinuousScheduler, cache: &KvCache) -> String {
    without_scratch(&format!("{scheduler:?}\n{cache:?}"))
}

#[allow(dead_code)]
pub fn cache_state(cache: &KvCache) -> String {
    without_scratch(&format!("{cache:?}"))
}

fn without_scratch(printed: &str) -> String {
    let mut kept = String::new();
    let mut rest = printed;
    while let Some(at) = [" scratch_", " decode_slots"]
        .iter()
        .filter_map(|name| rest.find(name))
        .min()
    {
        kept.push_str(&rest[..at]);
        // Skip `name: value` up to the next `,` or `}` at the same depth.
        let mut depth = 0i32;
        let end = rest[at..]
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '[' | '{' | '(' => depth += 1,
                    ']' | '}' | ')' => depth -= 1,
                    _ => {}
                }
                depth < 0 || (depth == 0 && c == ',')
            })
            .map_or(rest.len() - at, |(offset, _)| offset);
        rest = &rest[at + end..];
    }
    kept.push_str(rest);
    kept
}
