//! The CPU paged-attention kernel against a plain reference: random steps (block sizes
//! 1-256, grouped-query ratios, windows, chunks, prefill chunks over cached context, empty
//! and one-token contexts, sinks), every block no row may read poisoned with NaN; quantized
//! caches (int8, fp8) against the reference of their dequantized values; a wrong block table
//! entry is caught; bad inputs are errors that leave the output alone.

use atb_mem_core::{
    bf16, AttentionShape, Fp8E4m3Code, InstructionSet, Int8Code, KvCacheDtype, PagedAttention,
    StepRows, Visibility,
};
use proptest::prelude::*;

/// A step: the shape, per row (cached tokens, new tokens), the tables and caches.
#[derive(Debug, Clone)]
struct Step {
    shape: AttentionShape,
    visibility: Visibility,
    rows: Vec<(usize, usize)>,
    sinks: Option<Vec<f32>>,
    seed: u64,
}

struct Built {
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    tables: Vec<i32>,
    width: usize,
    query: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// xorshift: values in [-1, 1).
fn noise(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

fn build(step: &Step) -> Built {
    let shape = step.shape;
    let bs = shape.block_size;
    let mut state = step.seed | 1;
    let mut query_start_loc = vec![0i32];
    let mut seq_lens = Vec::new();
    let width = step
        .rows
        .iter()
        .map(|&(cached, new)| (cached + new).div_ceil(bs))
        .max()
        .unwrap_or(0)
        .max(1);
    let total_blocks: usize = step.rows.iter().map(|&(c, n)| (c + n).div_ceil(bs)).sum();
    let num_blocks = total_blocks + 3; // the null block, and two no row reads
    let slot = shape.num_kv_heads * shape.head_dim;
    let mut keys = vec![f32::NAN; num_blocks * bs * slot];
    let mut values = vec![f32::NAN; num_blocks * bs * slot];
    let mut tables = vec![0i32; step.rows.len() * width];
    // Blocks handed out in a scrambled order.
    let mut order: Vec<usize> = (1..num_blocks).collect();
    for i in (1..order.len()).rev() {
        let j = (noise(&mut state).abs() * (i + 1) as f32) as usize % (i + 1);
        order.swap(i, j);
    }
    let mut next = order.into_iter();
    for (row, &(cached, new)) in step.rows.iter().enumerate() {
        let len = cached + new;
        query_start_loc.push(query_start_loc[row] + new as i32);
        seq_lens.push(len as i32);
        let first_read = match new {
            0 => len,
            _ => first_visible(step.visibility, cached),
        };
        for index in 0..len.div_ceil(bs) {
            let block = next.next().unwrap();
            // Blocks before the first one read stay null, as a window leaves them.
            if (index + 1) * bs > first_read {
                tables[row * width + index] = block as i32;
                for offset in 0..bs {
                    if index * bs + offset >= len {
                        continue; // past the end: stays NaN
                    }
                    let at = (block * bs + offset) * slot;
                    for x in 0..slot {
                        keys[at + x] = noise(&mut state);
                        values[at + x] = noise(&mut state);
                    }
                }
            }
        }
    }
    let tokens = *query_start_loc.last().unwrap() as usize;
    let query = (0..tokens * shape.num_heads * shape.head_dim)
        .map(|_| noise(&mut state) * 2.0)
        .collect();
    Built {
        query_start_loc,
        seq_lens,
        tables,
        width,
        query,
        keys,
        values,
    }
}

fn first_visible(visibility: Visibility, position: usize) -> usize {
    match visibility {
        Visibility::Causal => 0,
        Visibility::Sliding { window } => (position + 1).saturating_sub(window),
        Visibility::Chunked { chunk } => position / chunk * chunk,
    }
}

/// Attention as its definition says, in f64, gathering each row's K/V through its table.
fn reference(step: &Step, built: &Built, scale: f32) -> Vec<f32> {
    let shape = step.shape;
    let (dim, bs) = (shape.head_dim, shape.block_size);
    let group = shape.num_heads / shape.num_kv_heads;
    let mut out = vec![0f32; built.query.len()];
    for (row, &(cached, new)) in step.rows.iter().enumerate() {
        let start = built.query_start_loc[row] as usize;
        for j in 0..new {
            let (token, position) = (start + j, cached + j);
            for head in 0..shape.num_heads {
                let kv = head / group;
                let q = &built.query[(token * shape.num_heads + head) * dim..][..dim];
                let visible: Vec<usize> =
                    (first_visible(step.visibility, position)..=position).collect();
                let slot_of = |p: usize| {
                    let block = built.tables[row * built.width + p / bs] as usize;
                    ((block * bs + p % bs) * shape.num_kv_heads + kv) * dim
                };
                let scores: Vec<f64> = visible
                    .iter()
                    .map(|&p| {
                        let k = &built.keys[slot_of(p)..][..dim];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let sink = step.sinks.as_ref().map(|sinks| f64::from(sinks[head]));
                let max = scores.iter().copied().chain(sink).fold(f64::MIN, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 =
                    weights.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
                for d in 0..dim {
                    let sum: f64 = visible
                        .iter()
                        .zip(&weights)
                        .map(|(&p, w)| w * f64::from(built.values[slot_of(p) + d]))
                        .sum();
                    out[(token * shape.num_heads + head) * dim + d] = (sum / total) as f32;
                }
            }
        }
    }
    out
}

fn call<'a>(
    step: &'a Step,
    built: &'a Built,
    tables: &'a [i32],
    scale: f32,
) -> PagedAttention<'a, f32> {
    PagedAttention {
        shape: step.shape,
        rows: StepRows {
            query_start_loc: &built.query_start_loc,
            seq_lens: &built.seq_lens,
            block_tables: tables,
            width: built.width,
        },
        query: &built.query,
        key_cache: &built.keys,
        value_cache: &built.values,
        visibility: step.visibility,
        scale,
        sinks: step.sinks.as_deref(),
    }
}

fn close(got: &[f32], want: &[f32], tolerance: f32) -> Result<(), String> {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        // NaN (a poisoned block read) fails too.
        let within = (g - w).abs() <= tolerance * (1.0 + w.abs());
        if !within {
            return Err(format!("element {i}: got {g}, want {w}"));
        }
    }
    Ok(())
}

fn steps() -> impl Strategy<Value = Step> {
    let shape = (
        prop::sample::select(vec![1usize, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256]),
        1usize..=3,
        prop::sample::select(vec![1usize, 2, 4, 7]),
        prop::sample::select(vec![1usize, 3, 8, 16, 17, 64]),
    );
    let visibility = prop_oneof![
        Just(Visibility::Causal),
        (1usize..40).prop_map(|window| Visibility::Sliding { window }),
        (1usize..40).prop_map(|chunk| Visibility::Chunked { chunk }),
    ];
    let row = prop_oneof![
        (0usize..300).prop_map(|cached| (cached, 1)), // decode
        (0usize..120, 0usize..40),                    // prefill chunk (or nothing new)
        (0usize..100, 40usize..150),                  // a long one: several token tiles
        Just((0usize, 1usize)),                       // one token, no context
    ];
    (
        shape,
        visibility,
        prop::collection::vec(row, 1..5),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |((block_size, num_kv_heads, group, head_dim), visibility, rows, sinks, seed)| Step {
                shape: AttentionShape {
                    num_heads: num_kv_heads * group,
                    num_kv_heads,
                    head_dim,
                    block_size,
                },
                visibility,
                sinks: sinks.then(|| {
                    (0..num_kv_heads * group)
                        .map(|h| h as f32 * 0.7 - 1.0)
                        .collect()
                }),
                rows,
                seed,
            },
        )
}

proptest! {
    // `PROPTEST_CASES` overrides (CI's valgrind run takes a few).
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(200),
        ..ProptestConfig::default()
    })]

    #[test]
    fn matches_the_reference(step in steps(), threads in 1usize..=3) {
        let built = build(&step);
        let scale = 1.0 / (step.shape.head_dim as f32).sqrt();
        let want = reference(&step, &built, scale);
        // Every copy of the kernel this CPU runs (AVX-512, AVX2, portable).
        let sets = [InstructionSet::Avx512, InstructionSet::Avx2, InstructionSet::Portable];
        for set in sets.into_iter().filter(|set| set.available()) {
            let mut out = vec![f32::NAN; built.query.len()];
            call(&step, &built, &built.tables, scale).run_with(&mut out, threads, set).unwrap();
            let compared = close(&out, &want, 2e-5);
            prop_assert!(compared.is_ok(), "{set:?}: {compared:?}");
        }
    }

    #[test]
    fn bf16_matches_the_reference_of_its_rounded_values(step in steps()) {
        let mut built = build(&step);
        let round = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
        round(&mut built.query);
        round(&mut built.keys);
        round(&mut built.values);
        let scale = 1.0 / (step.shape.head_dim as f32).sqrt();
        let halves = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let (query, keys, values) = (halves(&built.query), halves(&built.keys), halves(&built.values));
        let f32_call = call(&step, &built, &built.tables, scale);
        let bf16_call = PagedAttention {
            query: &query,
            key_cache: &keys,
            value_cache: &values,
            shape: f32_call.shape,
            rows: f32_call.rows,
            visibility: f32_call.visibility,
            scale,
            sinks: f32_call.sinks,
        };
        let mut out = vec![bf16::from_f32(0.0); query.len()];
        bf16_call.run(&mut out, 2).unwrap();
        let out: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
        let want = reference(&step, &built, scale);
        prop_assert!(close(&out, &want, 8e-3).is_ok(), "{:?}", close(&out, &want, 8e-3));
    }
}

/// Each `head_dim` row of `cache` as a quantized row of `dtype`; and the values it reads back
/// as (NaN rows stay NaN).
fn quantized(cache: &[f32], head_dim: usize, dtype: KvCacheDtype) -> (Vec<u8>, Vec<f32>) {
    let row = dtype.row_bytes(head_dim).unwrap();
    let mut codes = vec![0u8; cache.len() / head_dim * row];
    let mut back = vec![0f32; cache.len()];
    for ((values, codes), back) in cache
        .chunks_exact(head_dim)
        .zip(codes.chunks_exact_mut(row))
        .zip(back.chunks_exact_mut(head_dim))
    {
        dtype.quantize_row(values, codes);
        dtype.dequantize_row(codes, back);
    }
    (codes, back)
}

/// `call` over other caches.
fn over_caches<'a, C>(
    call: &PagedAttention<'a, f32>,
    key_cache: &'a [C],
    value_cache: &'a [C],
) -> PagedAttention<'a, f32, C> {
    PagedAttention {
        key_cache,
        value_cache,
        query: call.query,
        shape: call.shape,
        rows: call.rows,
        visibility: call.visibility,
        scale: call.scale,
        sinks: call.sinks,
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(100),
        ..ProptestConfig::default()
    })]

    /// The kernel reads quantized rows in place: the same output as the reference over the
    /// values those rows read back as, on every copy of the kernel.
    #[test]
    fn quantized_caches_match_the_reference_of_their_values(
        step in steps(),
        int8 in any::<bool>(),
        threads in 1usize..=3,
    ) {
        let mut built = build(&step);
        let dim = step.shape.head_dim;
        let dtype = if int8 { KvCacheDtype::Int8 } else { KvCacheDtype::Fp8E4m3 };
        let (key_codes, keys) = quantized(&built.keys, dim, dtype);
        let (value_codes, values) = quantized(&built.values, dim, dtype);
        (built.keys, built.values) = (keys, values);
        let scale = 1.0 / (dim as f32).sqrt();
        let want = reference(&step, &built, scale);
        let plain = call(&step, &built, &built.tables, scale);
        let sets = [InstructionSet::Avx512, InstructionSet::Avx2, InstructionSet::Portable];
        for set in sets.into_iter().filter(|set| set.available()) {
            let mut out = vec![f32::NAN; built.query.len()];
            if int8 {
                over_caches(&plain, Int8Code::from_bytes(&key_codes),
                            Int8Code::from_bytes(&value_codes))
                    .run_with(&mut out, threads, set)
                    .unwrap();
            } else {
                over_caches(&plain, Fp8E4m3Code::from_bytes(&key_codes),
                            Fp8E4m3Code::from_bytes(&value_codes))
                    .run_with(&mut out, threads, set)
                    .unwrap();
            }
            let compared = close(&out, &want, 2e-5);
            prop_assert!(compared.is_ok(), "{dtype:?} {set:?}: {compared:?}");
        }
    }
}

fn fixed_step() -> Step {
    Step {
        shape: AttentionShape {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
        },
        visibility: Visibility::Causal,
        rows: vec![(9, 1), (5, 6), (0, 3)],
        sinks: None,
        seed: 7,
    }
}

#[test]
fn a_wrong_block_table_entry_fails_the_comparison() {
    let step = fixed_step();
    let built = build(&step);
    let want = reference(&step, &built, 0.5);
    let mut out = vec![0f32; built.query.len()];
    call(&step, &built, &built.tables, 0.5)
        .run(&mut out, 1)
        .unwrap();
    assert!(close(&out, &want, 2e-5).is_ok());
    // Row 0's first block is row 1's: a valid block, the wrong one. (Exchanging two of
    // row 0's own would not do: attention over all of a row's keys ignores their order.)
    let mut tables = built.tables.clone();
    tables[0] = tables[built.width];
    call(&step, &built, &tables, 0.5).run(&mut out, 1).unwrap();
    assert!(close(&out, &want, 2e-5).is_err());
}

#[test]
fn bad_inputs_are_errors_that_leave_the_output_alone() {
    let step = fixed_step();
    let built = build(&step);
    let mut out = vec![3.0f32; built.query.len()];
    let mut expect_error = |bad: PagedAttention<'_, f32>, what: &str| {
        let error = bad.run(&mut out, 2).unwrap_err().to_string();
        assert!(error.contains(what), "{error}");
        assert!(out.iter().all(|&x| x == 3.0));
    };
    let base = call(&step, &built, &built.tables, 0.5);
    let with_table = |entry: i32| {
        let mut tables = built.tables.clone();
        tables[0] = entry;
        tables
    };
    for (entry, what) in [
        (10_000, "not a block of the cache"),
        (-1, "not a block"),
        (0, "null block"),
    ] {
        let tables = with_table(entry);
        expect_error(call(&step, &built, &tables, 0.5), what);
    }
    let seq_lens = [40, 11, 3];
    let short = [0, 1, 7];
    let wide = [0i32; 5];
    for (bad, what) in [
        (
            StepRows {
                seq_lens: &seq_lens,
                ..base.rows
            },
            "blocks; its table has",
        ),
        (
            StepRows {
                query_start_loc: &short,
                ..base.rows
            },
            "query_start_loc",
        ),
        (
            StepRows {
                block_tables: &wide,
                ..base.rows
            },
            "block_tables has",
        ),
    ] {
        expect_error(PagedAttention { rows: bad, ..base }, what);
    }
    expect_error(
        PagedAttention {
            query: &built.query[1..],
            ..base
        },
        "must both be [tokens",
    );
    expect_error(
        PagedAttention {
            key_cache: &built.keys[8..],
            ..base
        },
        "caches must",
    );
    let shape = AttentionShape {
        num_kv_heads: 3,
        ..base.shape
    };
    expect_error(PagedAttention { shape, ..base }, "evenly");
    let visibility = Visibility::Sliding { window: 0 };
    expect_error(PagedAttention { visibility, ..base }, "0 positions");
    let sinks = [0.0f32; 3];
    expect_error(
        PagedAttention {
            sinks: Some(&sinks),
            ..base
        },
        "sinks",
    );
    assert!(base.run(&mut out, 0).is_err());
    assert!(base
        .run(&mut out, atb_mem_core::MAX_ATTENTION_THREADS + 1)
        .is_err());
}
