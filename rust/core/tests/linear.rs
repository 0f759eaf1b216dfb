//! A linear layer's product over a few rows against an f64 reference: random shapes (every
//! tail of the lanes, of the groups of four features and of the pieces), with and without a
//! bias, f32 within the error bound of an f32 dot product and bf16 within one rounding, the
//! same bits on one thread or several; bad sizes are errors that leave the output alone.

use atb_mem_core::{bf16, Linear};
use proptest::prelude::*;

/// xorshift: values in [-1, 1).
fn noise(state: &mut u64, count: usize) -> Vec<f32> {
    (0..count)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            (*state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Per output, the exact (f64) value and the sum of its terms' magnitudes.
fn reference(x: &[f32], weight: &[f32], bias: Option<&[f32]>, inner: usize) -> Vec<(f64, f64)> {
    let features = weight.len() / inner;
    x.chunks_exact(inner)
        .flat_map(|row| {
            (0..features).map(move |n| {
                let terms = row
                    .iter()
                    .zip(&weight[n * inner..(n + 1) * inner])
                    .map(|(&a, &b)| f64::from(a) * f64::from(b));
                let (sum, size) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
                let b = bias.map_or(0.0, |bias| f64::from(bias[n]));
                (sum + b, size + b.abs())
            })
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn f32_products_are_within_the_bound_of_an_f32_dot_product(
        rows in 0usize..20, inner in 1usize..300, features in 1usize..200,
        with_bias: bool, threads in 1usize..4, seed in 1u64..u64::MAX,
    ) {
        let mut state = seed;
        let x = noise(&mut state, rows * inner);
        let weight = noise(&mut state, features * inner);
        let bias = with_bias.then(|| noise(&mut state, features));
        let call = Linear { x: &x, weight: &weight, bias: bias.as_deref(), rows,
                            features_in: inner, features_out: features };
        let mut out = vec![f32::NAN; rows * features];
        call.run(&mut out, threads).unwrap();
        let bound = (inner + 1) as f64 * f64::from(f32::EPSILON);
        for (got, (exact, size)) in out.iter().zip(reference(&x, &weight, bias.as_deref(), inner)) {
            prop_assert!((f64::from(*got) - exact).abs() <= bound * size + 1e-30,
                         "{got} against {exact}");
        }
        let mut again = vec![0.0; rows * features];
        call.run(&mut again, 1).unwrap();
        prop_assert_eq!(again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }

    #[test]
    fn bf16_products_are_within_one_rounding(
        rows in 1usize..16, inner in 1usize..200, features in 1usize..100,
        with_bias: bool, seed in 1u64..u64::MAX,
    ) {
        let mut state = seed;
        let round = |values: Vec<f32>| values.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
        let x = round(noise(&mut state, rows * inner));
        let weight = round(noise(&mut state, features * inner));
        let bias = with_bias.then(|| round(noise(&mut state, features)));
        let call = Linear { x: &x, weight: &weight, bias: bias.as_deref(), rows,
                            features_in: inner, features_out: features };
        let mut out = vec![bf16::NAN; rows * features];
        call.run(&mut out, 2).unwrap();
        let widen = |values: &[bf16]| values.iter().map(|v| v.to_f32()).collect::<Vec<_>>();
        let wide_bias = bias.as_deref().map(widen);
        let exact = reference(&widen(&x), &widen(&weight), wide_bias.as_deref(), inner);
        for (got, (exact, size)) in out.iter().zip(exact) {
            // One bf16 rounding of the result (8 significant bits), and the f32 sum's error.
            let bound = exact.abs() * 2f64.powi(-8) + size * (inner + 1) as f64 * 1.2e-7;
            prop_assert!((f64::from(got.to_f32()) - exact).abs() <= bound + 1e-30,
                         "{got} against {exact}");
        }
    }
}

#[test]
fn a_wrong_sum_fails_the_bound() {
    // The bound the property checks can fail: one term left out of a sum is caught.
    let (x, weight) = (vec![0.5f32; 64], vec![0.25f32; 64]);
    let exact = reference(&x, &weight, None, 64)[0];
    let dropped = f64::from(63.0f32 * 0.125);
    assert!((dropped - exact.0).abs() > 65.0 * f64::from(f32::EPSILON) * exact.1);
}

#[test]
fn bad_sizes_are_errors_that_leave_out_alone() {
    let (x, weight, bias) = (vec![1.0f32; 6], vec![1.0f32; 12], vec![1.0f32; 3]);
    let call = |rows, inner, features, bias: Option<&[f32]>| {
        let linear = Linear {
            x: &x,
            weight: &weight,
            bias,
            rows,
            features_in: inner,
            features_out: features,
        };
        let mut out = vec![7.0f32; 8];
        let error = linear.run(&mut out, 1).unwrap_err().to_string();
        assert!(out.iter().all(|&value| value == 7.0));
        error
    };
    assert!(call(1, 6, 2, None).contains("out has 8 elements"));
    assert!(call(3, 3, 4, None).contains("x has 6 elements"));
    assert!(call(2, 3, 3, None).contains("the weight has 12 elements"));
    assert!(call(2, 0, 4, None).contains("features_in must be positive"));
    assert!(call(2, 3, 4, Some(&bias)).contains("the bias has 3 elements"));
    let linear = Linear {
        x: &x,
        weight: &weight,
        bias: None,
        rows: 2,
        features_in: 3,
        features_out: 4,
    };
    let mut out = vec![0.0f32; 8];
    assert!(linear
        .run(&mut out, 0)
        .unwrap_err()
        .to_string()
        .contains("threads must be"));
    linear.run(&mut out, 2).unwrap();
    assert!(out.iter().all(|&value| value == 3.0));
}
