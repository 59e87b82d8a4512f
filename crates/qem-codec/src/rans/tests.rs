//! Unit tests of the counts codec's private stages: symbol mapping, row quantisation,
//! thresholds and the `split` rule. Stream round trips and hostile streams are in
//! `tests/rans.rs`.

use super::fit::quantise_row;
use super::*;

#[test]
fn symbol_mapping_matches_the_spec() {
    assert_eq!(symbol_of(0, 32), Some((0, 0, 0)));
    assert_eq!(symbol_of(31, 32), Some((31, 0, 0)));
    assert_eq!(symbol_of(32, 32), Some((32, 0, 0))); // u = 1, nb = 0
    assert_eq!(symbol_of(33, 32), Some((33, 1, 0))); // u = 2
    assert_eq!(symbol_of(34, 32), Some((33, 1, 1))); // u = 3
    assert_eq!(symbol_of(65535, 32), Some((47, 15, 65504 - 32768)));
    assert_eq!(symbol_of(32 + 65534, 32), Some((47, 15, 32767)));
    assert_eq!(symbol_of(32 + 65535, 32), None);
    for k in 1..=128u32 {
        assert!(symbol_of(65535, k).is_some());
        for v in [0u16, 1, 5, 31, 32, 127, 128, 129, 1000, 65535] {
            assert_eq!(
                symbol_u16(v, k),
                symbol_of(v.into(), k).map(|t| t.0 as usize).unwrap()
            );
        }
    }
}

#[test]
fn quantised_rows_sum_to_4096_and_respect_floors() {
    let mut h = vec![0u64; 48];
    h[0] = 1_000_000;
    h[1] = 3;
    h[40] = 1;
    let f = quantise_row(&h, 41);
    assert_eq!(f.iter().map(|&x| u32::from(x)).sum::<u32>(), 4096);
    assert!(f[..=41].iter().all(|&x| x >= 1));
    assert!(f[42..].iter().all(|&x| x == 0));
    let f = quantise_row(&[0; 48], 0);
    assert_eq!(f[0], 4096);
    let f = quantise_row(&[0; 144], 143);
    assert!(f.iter().all(|&x| x >= 1));
    assert_eq!(f.iter().map(|&x| u32::from(x)).sum::<u32>(), 4096);
}

#[test]
fn thresholds_are_quantiles_and_sets_count_them() {
    let stats: Vec<u64> = (0..100).rev().collect();
    assert_eq!(fit_thresholds(&stats, 4), vec![25, 50, 75]);
    assert_eq!(fit_thresholds(&stats, 1), Vec::<u64>::new());
    assert_eq!(fit_thresholds(&[], 3), vec![u64::MAX; 2]);
    let q = [10, 20, 20];
    assert_eq!(table_set_of(&q, 0), 0);
    assert_eq!(table_set_of(&q, 10), 1);
    assert_eq!(table_set_of(&q, 19), 1);
    assert_eq!(table_set_of(&q, 20), 3);
    assert_eq!(table_set_of(&[], 99), 0);
}

#[test]
fn split_auto_excludes_the_bright_classes() {
    // 1024 pixels: 64 bright (sum 1000) and a dark ramp 0..=9.
    let sums: Vec<u64> = (0..1024)
        .map(|p| if p < 64 { 1000 } else { (p % 10) as u64 })
        .collect();
    let p = ModelParams {
        contexts: 4,
        table_sets: 2,
        context_rule: ContextRule::Quantiles,
        ..ModelParams::default()
    };
    let fit = fit_contexts(&sums, 10, &p).unwrap();
    let bright_class = fit.ctx_map[0];
    assert_eq!(fit.split, bright_class);
    assert!(fit.split >= 1);
    // Quantiles: class 3 holds values 8, 9 and the bright pixels; classes 0..3 are dark.
    assert_eq!(fit.split, 3);
    assert!(fit
        .ctx_map
        .iter()
        .zip(&sums)
        .all(|(&c, &s)| (c < fit.split) == (s < 8)));
    // Log bins: the bright pixels get the top class alone, every dark pixel is below.
    let logp = ModelParams {
        context_rule: ContextRule::LogBins,
        ..p
    };
    let fit = fit_contexts(&sums, 10, &logp).unwrap();
    assert_eq!(fit.ctx_map[0], 3);
    assert_eq!(fit.split, 3);
    assert!(fit.ctx_map[64..].iter().all(|&c| c < fit.split));
    let one = fit_contexts(&sums, 10, &ModelParams { table_sets: 1, ..p }).unwrap();
    assert_eq!(one.split, 0);
    let fixed = ModelParams {
        split: SplitRule::Classes(9),
        ..p
    };
    assert_eq!(fit_contexts(&sums, 10, &fixed).unwrap().split, 4);
}
