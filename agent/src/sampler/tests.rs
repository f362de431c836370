//! Sampler tests: greedy, logprobs and top-n, penalties, seeded reproducibility, empirical
//! frequencies of the truncated distributions against a plain full-sort reference, and
//! non-finite logits.

use super::*;

fn sampled(temperature: f32) -> SamplingParams {
    SamplingParams {
        do_sample: true,
        temperature,
        ..SamplingParams::default()
    }
}

/// Plain reference: the distribution the sampler should draw from (full sort, f64 softmax).
fn reference_probs(logits: &[f32], t: f32, top_k: usize, top_p: f64, min_p: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let max = logits[order[0]] as f64;
    let w: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / t as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = order.len();
    if top_p < 1.0 {
        let mut cum = 0.0;
        for (j, wj) in w.iter().enumerate() {
            cum += wj / total;
            if cum >= top_p {
                keep = j + 1;
                break;
            }
        }
    }
    let mut probs = vec![0.0; logits.len()];
    for j in 0..keep {
        if w[j] >= min_p {
            probs[order[j]] = w[j];
        }
    }
    let z: f64 = probs.iter().sum();
    probs.iter().map(|p| p / z).collect()
}

/// Draw `n` tokens with gen_index 0..n and count them.
fn histogram(logits: &[f32], params: &SamplingParams, n: u64) -> Vec<u64> {
    let mut sampler = Sampler::new();
    let history = TokenHistory::new();
    let mut counts = vec![0u64; logits.len()];
    for i in 0..n {
        let mut l = logits.to_vec();
        let out = sampler.sample(&mut l, params, &history, i).unwrap();
        counts[out.token.token as usize] += 1;
    }
    counts
}

/// Pearson chi-square of observed counts against expected probabilities. Tokens with zero
/// expected probability must never be observed.
fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    let mut chi = 0.0;
    for (i, (&c, &p)) in counts.iter().zip(probs).enumerate() {
        if p == 0.0 {
            assert_eq!(c, 0, "token {i} has probability 0 but was drawn {c} times");
            continue;
        }
        let e = p * n as f64;
        chi += (c as f64 - e).powi(2) / e;
    }
    chi
}

/// Below the 99.99% quantile of chi-square with <= 7 degrees of freedom (29.9).
const CHI_LIMIT: f64 = 29.0;
const SMALL_LOGITS: [f32; 8] = [1.0, 2.5, 0.3, -1.0, 2.0, 0.0, 1.7, -0.5];

fn hand_log_softmax(logits: &[f32]) -> Vec<f64> {
    let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
    logits.iter().map(|&x| x as f64 - z.ln()).collect()
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let mut s = Sampler::new();
    let h = TokenHistory::new();
    let mut l = vec![0.5, 3.0, -1.0, 3.0, 2.9];
    let out = s.sample(&mut l, &SamplingParams::greedy(), &h, 0).unwrap();
    assert_eq!(out.token.token, 1);
    // Greedy whatever the other settings when do_sample is false, or temperature 0, or top_k 1.
    for p in [
        SamplingParams {
            temperature: 5.0,
            top_p: 0.1,
            ..SamplingParams::default()
        },
        sampled(0.0),
        SamplingParams {
            top_k: 1,
            ..sampled(2.0)
        },
        sampled(f32::NAN),
        sampled(1e-45),
    ] {
        for i in 0..50 {
            let mut l = SMALL_LOGITS.to_vec();
            assert_eq!(s.sample(&mut l, &p, &h, i).unwrap().token.token, 1, "{p:?}");
        }
    }
}

#[test]
fn logprob_is_log_softmax_of_raw_logits() {
    let expected = hand_log_softmax(&SMALL_LOGITS);
    let mut history = TokenHistory::new();
    history.push_prompt(&[1, 4]);
    history.push_generated(1);
    let params = SamplingParams {
        repetition_penalty: 1.5,
        presence_penalty: 0.7,
        frequency_penalty: 0.3,
        top_k: 4,
        top_p: 0.95,
        top_n: 8,
        seed: 9,
        ..sampled(0.6)
    };
    let mut s = Sampler::new();
    let mut seen = std::collections::HashSet::new();
    for i in 0..200 {
        let mut l = SMALL_LOGITS.to_vec();
        let out = s.sample(&mut l, &params, &history, i).unwrap();
        let t = out.token.token as usize;
        seen.insert(t);
        assert!((out.token.logprob as f64 - expected[t]).abs() < 1e-5);
        for alt in &out.top {
            assert!((alt.logprob as f64 - expected[alt.token as usize]).abs() < 1e-5);
        }
    }
    // The penalised token 1 (raw best) must also be reported with its raw logprob when drawn.
    assert!(seen.contains(&1), "token 1 never drawn: {seen:?}");
    assert!(seen.len() >= 3);
}

#[test]
fn logprob_is_stable_for_huge_logits() {
    let mut s = Sampler::new();
    let h = TokenHistory::new();
    let mut l = vec![1000.0f32, 999.0, -1000.0];
    let out = s.sample(&mut l, &SamplingParams::greedy(), &h, 0).unwrap();
    let z = (1.0f64 + (-1.0f64).exp()).ln();
    assert_eq!(out.token.token, 0);
    assert!((out.token.logprob as f64 + z).abs() < 1e-5, "{out:?}");
}

#[test]
fn top_n_is_best_first_clamped_and_ties_by_id() {
    let mut s = Sampler::new();
    let h = TokenHistory::new();
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 50) as f32 / 10.0).collect();
    let expected = hand_log_softmax(&logits);
    let params = SamplingParams {
        top_n: 5,
        ..SamplingParams::default()
    };
    let out = s.sample(&mut logits.clone(), &params, &h, 0).unwrap();
    // Every value occurs twice (ids i and i + 50): ties must list the lower id first.
    let mut order: Vec<u32> = (0..100).collect();
    order.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    let ids: Vec<u32> = out.top.iter().map(|t| t.token).collect();
    assert_eq!(ids, order[..5]);
    assert_eq!(ids[1], ids[0] + 50);
    for t in &out.top {
        assert!((t.logprob as f64 - expected[t.token as usize]).abs() < 1e-5);
    }
    assert_eq!(out.token.token, order[0]);

    let many = SamplingParams {
        top_n: 1000,
        ..SamplingParams::default()
    };
    let out = s.sample(&mut logits.clone(), &many, &h, 0).unwrap();
    assert_eq!(out.top.len(), MAX_TOP_N);
    assert!(out.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));

    let tiny = s.sample(&mut [0.0, 1.0], &many, &h, 0).unwrap();
    assert_eq!(tiny.top.iter().map(|t| t.token).collect::<Vec<_>>(), [1, 0]);
    let none = s
        .sample(&mut logits.clone(), &SamplingParams::greedy(), &h, 0)
        .unwrap();
    assert!(none.top.is_empty());
}

#[test]
fn penalties_change_logits_as_defined() {
    let mut h = TokenHistory::new();
    h.push_prompt(&[0, 1, 1]);
    h.push_generated(2);
    h.push_generated(2);
    h.push_generated(3);
    h.push_generated(99); // outside the vocab: ignored
    assert_eq!(h.n_prompt(), 3);
    assert_eq!(h.n_generated(), 4);
    assert_eq!(
        h.counts(1),
        TokenCounts {
            prompt: 2,
            generated: 0
        }
    );
    assert_eq!(h.n_distinct(), 5);

    let base = [2.0f32, -2.0, 4.0, -1.0, 3.0];
    let p = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..SamplingParams::default()
    };
    let mut l = base;
    apply_penalties(&mut l, &p, &h);
    // 0: prompt, positive -> /2. 1: prompt, negative -> *2. 2: generated twice: 4/2 - 0.5 - 0.5.
    // 3: generated once: -1*2 - 0.5 - 0.25. 4: never seen.
    assert_eq!(l, [1.0, -4.0, 1.0, -2.75, 3.0]);

    // Presence/frequency apply to generated tokens only.
    let pf = SamplingParams {
        presence_penalty: 1.0,
        frequency_penalty: 1.0,
        ..SamplingParams::default()
    };
    let mut l = base;
    apply_penalties(&mut l, &pf, &h);
    assert_eq!(l, [2.0, -2.0, 1.0, -3.0, 3.0]);

    // Disabled or invalid settings leave logits alone.
    for bad in [1.0f32, 0.0, -2.0, f32::NAN, f32::INFINITY] {
        let p = SamplingParams {
            repetition_penalty: bad,
            presence_penalty: f32::NAN,
            frequency_penalty: f32::INFINITY,
            ..SamplingParams::default()
        };
        let mut l = base;
        apply_penalties(&mut l, &p, &h);
        assert_eq!(l, base, "repetition_penalty {bad}");
    }

    // Negative penalties encourage; results stay finite.
    let mut l = [f32::MAX, 0.0, 0.0, 0.0, 0.0];
    let mut h2 = TokenHistory::new();
    h2.push_generated(0);
    let enc = SamplingParams {
        presence_penalty: -f32::MAX,
        ..SamplingParams::default()
    };
    apply_penalties(&mut l, &enc, &h2);
    assert_eq!(l[0], f32::MAX);

    h.clear();
    assert_eq!((h.n_prompt(), h.n_generated(), h.n_distinct()), (0, 0, 0));
    let mut l = base;
    apply_penalties(&mut l, &p, &h);
    assert_eq!(l, base);
}

#[test]
fn repetition_penalty_moves_greedy_choice_but_not_raw_logprob() {
    let mut s = Sampler::new();
    let mut h = TokenHistory::new();
    h.push_generated(1);
    let p = SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::default()
    };
    let mut l = SMALL_LOGITS.to_vec();
    let out = s.sample(&mut l, &p, &h, 0).unwrap();
    // Token 1 (2.5) becomes 1.25; token 4 (2.0) wins.
    assert_eq!(out.token.token, 4);
    assert_eq!(l[1], 1.25);
    let expected = hand_log_softmax(&SMALL_LOGITS);
    assert!((out.token.logprob as f64 - expected[4]).abs() < 1e-6);
}

#[test]
fn same_seed_and_index_give_same_token_whatever_ran_before() {
    let logits: Vec<f32> = (0..64).map(|i| ((i * 7919) % 101) as f32 / 40.0).collect();
    let h = TokenHistory::new();
    let p = SamplingParams {
        seed: 1234,
        top_p: 0.95,
        ..sampled(1.0)
    };
    let mut fresh = Sampler::new();
    let first: Vec<u32> = (0..100)
        .map(|i| {
            fresh
                .sample(&mut logits.clone(), &p, &h, i)
                .unwrap()
                .token
                .token
        })
        .collect();
    // Another sampler that serves other requests in between, visiting indices in reverse order.
    let mut busy = Sampler::new();
    let other = SamplingParams {
        seed: 77,
        top_k: 3,
        ..sampled(0.7)
    };
    for i in (0..100).rev() {
        busy.sample(&mut logits.clone(), &other, &h, i).unwrap();
        let t = busy
            .sample(&mut logits.clone(), &p, &h, i)
            .unwrap()
            .token
            .token;
        assert_eq!(t, first[i as usize], "index {i}");
    }
}

#[test]
fn different_seeds_give_different_streams() {
    let logits = vec![0.0f32; 32];
    let h = TokenHistory::new();
    let mut s = Sampler::new();
    let mut stream = |seed| -> Vec<u32> {
        let p = SamplingParams {
            seed,
            ..sampled(1.0)
        };
        (0..500)
            .map(|i| {
                s.sample(&mut logits.clone(), &p, &h, i)
                    .unwrap()
                    .token
                    .token
            })
            .collect()
    };
    let a = stream(1);
    let b = stream(2);
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    // Independent uniform draws over 32 tokens agree about 500/32 ~ 16 times.
    assert!(same < 40, "seeds 1 and 2 agree on {same} of 500 draws");
    assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 25);
}

#[test]
fn plain_temperature_frequencies_match_softmax() {
    for t in [1.0f32, 0.5, 2.0] {
        let counts = histogram(&SMALL_LOGITS, &sampled(t), 20_000);
        let probs = reference_probs(&SMALL_LOGITS, t, 0, 1.0, 0.0);
        let chi = chi_square(&counts, &probs);
        assert!(chi < CHI_LIMIT, "temperature {t}: chi2 {chi}, {counts:?}");
    }
}

#[test]
fn top_k_frequencies_match_renormalised_truncation() {
    for k in [2u32, 3, 5] {
        let p = SamplingParams {
            top_k: k,
            seed: 5,
            ..sampled(0.8)
        };
        let counts = histogram(&SMALL_LOGITS, &p, 20_000);
        let probs = reference_probs(&SMALL_LOGITS, 0.8, k as usize, 1.0, 0.0);
        assert_eq!(probs.iter().filter(|&&x| x > 0.0).count(), k as usize);
        let chi = chi_square(&counts, &probs);
        assert!(chi < CHI_LIMIT, "top_k {k}: chi2 {chi}, {counts:?}");
    }
}

#[test]
fn top_p_frequencies_match_renormalised_nucleus() {
    for (top_p, top_k) in [(0.5f32, 0u32), (0.8, 0), (0.95, 0), (0.7, 4)] {
        let p = SamplingParams {
            top_p,
            top_k,
            seed: 11,
            ..sampled(1.0)
        };
        let counts = histogram(&SMALL_LOGITS, &p, 20_000);
        let probs = reference_probs(&SMALL_LOGITS, 1.0, top_k as usize, top_p as f64, 0.0);
        let chi = chi_square(&counts, &probs);
        assert!(
            chi < CHI_LIMIT,
            "top_p {top_p} top_k {top_k}: chi2 {chi}, {counts:?}"
        );
    }
}

#[test]
fn min_p_drops_unlikely_tokens() {
    // Relative to the best (2.5): exp(-0.5)=0.61 (token 4), exp(-0.8)=0.45 (token 6),
    // exp(-1.5)=0.22 (token 0); min_p 0.3 keeps tokens 1, 4, 6.
    let p = SamplingParams {
        min_p: 0.3,
        seed: 3,
        ..sampled(1.0)
    };
    let counts = histogram(&SMALL_LOGITS, &p, 20_000);
    let probs = reference_probs(&SMALL_LOGITS, 1.0, 0, 1.0, 0.3);
    let kept: Vec<usize> = (0..8).filter(|&i| probs[i] > 0.0).collect();
    assert_eq!(kept, vec![1, 4, 6]);
    let chi = chi_square(&counts, &probs);
    assert!(chi < CHI_LIMIT, "min_p: chi2 {chi}, {counts:?}");
    // min_p of 1 or more keeps only the best.
    let all = SamplingParams {
        min_p: 5.0,
        ..p.clone()
    };
    let counts = histogram(&SMALL_LOGITS, &all, 500);
    assert_eq!(counts[1], 500);
}

#[test]
fn large_vocab_nucleus_never_leaves_the_reference_set() {
    // Pseudo-random logits over a vocab large enough for several rounds of the progressive
    // partial sort, which must keep exactly the full-sort nucleus. u just below 1 picks the
    // nucleus' last token, u = 0 its first.
    let vocab = 8_192;
    let logits: Vec<f32> = (0..vocab as u64)
        .map(|i| (uniform_f64(99, i) * 12.0 - 6.0) as f32)
        .collect();
    for (top_p, top_k, t) in [
        (0.9f32, 0u32, 1.0f32),
        (0.3, 0, 0.7),
        (0.999, 0, 1.5),
        (0.5, 1000, 1.0),
    ] {
        let probs = reference_probs(&logits, t, top_k as usize, top_p as f64, 0.0);
        let params = SamplingParams {
            top_p,
            top_k,
            ..sampled(t)
        };
        let trunc = Truncation::from_params(&params, vocab).unwrap();
        let mut order: Vec<usize> = (0..vocab).filter(|&i| probs[i] > 0.0).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let (mut c, mut w) = (Vec::new(), Vec::new());
        let first = draw_token(&logits, &trunc, 0.0, &mut c, &mut w);
        let last = draw_token(&logits, &trunc, 1.0 - 1e-12, &mut c, &mut w);
        assert_eq!(first as usize, order[0], "top_p {top_p}");
        assert_eq!(
            last as usize,
            *order.last().unwrap(),
            "top_p {top_p}: nucleus size"
        );
        let mut s = Sampler::new();
        let h = TokenHistory::new();
        for i in 0..50 {
            let tok = s
                .sample(&mut logits.clone(), &params, &h, i)
                .unwrap()
                .token
                .token;
            assert!(probs[tok as usize] > 0.0, "token {tok} outside the nucleus");
        }
    }
}

#[test]
fn non_finite_logits_do_not_panic() {
    let mut s = Sampler::new();
    let h = TokenHistory::new();
    let p = SamplingParams {
        top_n: 3,
        ..sampled(1.0)
    };
    // NaN is never chosen; -inf never drawn.
    for i in 0..300 {
        let mut l = vec![f32::NAN, 0.0, f32::NEG_INFINITY, 0.5, f32::NAN];
        let out = s.sample(&mut l, &p, &h, i).unwrap();
        assert!([1, 3].contains(&out.token.token), "{out:?}");
        assert!(out.token.logprob.is_finite());
        assert_eq!(out.top[0].token, 3);
    }
    // +inf wins greedy and dominates sampling.
    let mut l = vec![0.0, f32::INFINITY, 3.0];
    let out = s.sample(&mut l, &SamplingParams::greedy(), &h, 0).unwrap();
    assert_eq!(out.token.token, 1);
    assert!(out.token.logprob.abs() < 1e-6);
    for i in 0..50 {
        let mut l = vec![0.0, f32::INFINITY, 3.0];
        assert_eq!(s.sample(&mut l, &p, &h, i).unwrap().token.token, 1);
    }
    // Nothing finite: uniform.
    for params in [SamplingParams::greedy(), p.clone()] {
        let mut l = vec![f32::NAN, f32::NEG_INFINITY, f32::NAN, f32::NAN];
        let out = s.sample(&mut l, &params, &h, 1).unwrap();
        assert!(out.token.token < 4);
        assert!((out.token.logprob as f64 + 4f64.ln()).abs() < 1e-6);
    }
    // Penalties on non-finite logits with non-finite params.
    let mut h2 = TokenHistory::new();
    h2.push_generated(0);
    h2.push_prompt(&[1]);
    let weird = SamplingParams {
        repetition_penalty: f32::INFINITY,
        presence_penalty: f32::NAN,
        frequency_penalty: -f32::MAX,
        top_p: f32::NAN,
        min_p: f32::NAN,
        ..sampled(1.0)
    };
    let mut l = vec![f32::INFINITY, f32::NAN, 1.0];
    let out = s.sample(&mut l, &weird, &h2, 0).unwrap();
    assert!(out.token.token < 3);
}

#[test]
fn empty_logits_is_an_error() {
    let mut s = Sampler::new();
    let err = s
        .sample(&mut [], &SamplingParams::greedy(), &TokenHistory::new(), 0)
        .unwrap_err();
    assert_eq!(err, SamplerError::EmptyLogits);
}

#[test]
fn scratch_buffers_are_reused_after_warm_up() {
    let logits: Vec<f32> = (0..4096).map(|i| (i % 97) as f32 / 30.0).collect();
    let mut s = Sampler::new();
    let h = TokenHistory::new();
    let p = SamplingParams {
        top_p: 0.9,
        ..sampled(1.0)
    };
    s.sample(&mut logits.clone(), &p, &h, 0).unwrap();
    let ptrs = (s.candidates.as_ptr(), s.weights.as_ptr());
    let caps = (s.candidates.capacity(), s.weights.capacity());
    for i in 1..20 {
        s.sample(&mut logits.clone(), &p, &h, i).unwrap();
    }
    assert_eq!((s.candidates.as_ptr(), s.weights.as_ptr()), ptrs);
    assert_eq!((s.candidates.capacity(), s.weights.capacity()), caps);
}

#[test]
fn logit_bias_moves_the_pick_and_reports_raw_logprobs() {
    let expected = hand_log_softmax(&SMALL_LOGITS);
    let mut s = Sampler::new();
    let h = TokenHistory::new();
    // -100 on the argmax (token 1): greedy takes the next best (token 4); +100 on a low token
    // (token 3): greedy takes it. Each pick's log-probability is its raw one.
    for (bias, want) in [
        (vec![(1, -100.0)], 4u32),
        (vec![(3, 100.0), (99_999, 5.0)], 3),
    ] {
        let p = SamplingParams {
            logit_bias: bias.clone(),
            ..SamplingParams::greedy()
        };
        assert!(!is_plain_greedy(&p), "a biased request needs the host pick");
        let mut l = SMALL_LOGITS.to_vec();
        let out = s.sample(&mut l, &p, &h, 0).unwrap();
        assert_eq!(out.token.token, want, "{bias:?}");
        assert!(
            (out.token.logprob as f64 - expected[want as usize]).abs() < 1e-5,
            "{bias:?}: {} vs {}",
            out.token.logprob,
            expected[want as usize]
        );
    }
    // Sampling: a -100 bias takes a token out of the distribution.
    let p = SamplingParams {
        logit_bias: vec![(1, -100.0), (4, -100.0)],
        ..sampled(1.0)
    };
    let counts = histogram(&SMALL_LOGITS, &p, 2000);
    assert_eq!((counts[1], counts[4]), (0, 0), "{counts:?}");
    // With a penalty on the same token, the reported log-probability is still the raw one.
    let mut history = TokenHistory::new();
    history.push_generated(3);
    let p = SamplingParams {
        repetition_penalty: 2.0,
        logit_bias: vec![(3, 100.0)],
        ..SamplingParams::greedy()
    };
    let mut l = SMALL_LOGITS.to_vec();
    let out = s.sample(&mut l, &p, &history, 0).unwrap();
    assert_eq!(out.token.token, 3);
    assert!((out.token.logprob as f64 - expected[3]).abs() < 1e-5);
}

#[test]
fn a_token_mask_limits_the_pick_and_keeps_raw_logprobs() {
    let logits: Vec<f32> = (0..70).map(|i| (i % 10) as f32 * 0.5).collect();
    // Tokens 3, 40 and 65 allowed (65 lies in the third word).
    let mask = [1u32 << 3, 1 << (40 - 32), 1 << (65 - 64)];
    let hist = TokenHistory::new();
    let mut s = Sampler::new();
    let greedy = s
        .sample_masked(
            &mut logits.clone(),
            &SamplingParams::greedy(),
            &hist,
            0,
            Some(&mask),
        )
        .unwrap();
    // 65 % 10 = 5 beats 3 and 40 % 10 = 0.
    assert_eq!(greedy.token.token, 65);
    let unmasked = s
        .sample(&mut logits.clone(), &SamplingParams::greedy(), &hist, 0)
        .unwrap();
    let raw = logprob(logits[65], sanitize_and_log_norm(&mut logits.clone()));
    assert_eq!(greedy.token.logprob, raw, "the model's raw log-probability");
    assert_ne!(unmasked.token.token, 65);
    let mut seen = std::collections::HashSet::new();
    for i in 0..300 {
        let out = s
            .sample_masked(&mut logits.clone(), &sampled(1.5), &hist, i, Some(&mask))
            .unwrap();
        seen.insert(out.token.token);
    }
    assert!(seen.iter().all(|t| [3, 40, 65].contains(t)), "{seen:?}");
    assert_eq!(
        seen.len(),
        3,
        "every allowed token is drawn at temperature 1.5"
    );
    let e = s
        .sample_masked(
            &mut logits.clone(),
            &sampled(1.0),
            &hist,
            0,
            Some(&[0, 0, 0]),
        )
        .unwrap_err();
    assert_eq!(e, SamplerError::EmptyMask);
    // A mask shorter than the vocabulary allows nothing past its words.
    let out = s
        .sample_masked(
            &mut logits.clone(),
            &SamplingParams::greedy(),
            &hist,
            0,
            Some(&[1 << 9]),
        )
        .unwrap();
    assert_eq!(out.token.token, 9);
}

/// Masks applied a word at a time ban exactly the tokens a bit-by-bit reading bans, for whole
/// words allowed, whole words banned, mixed words, masks shorter than the vocabulary and bits
/// past its end.
#[test]
fn a_mask_applied_by_words_bans_exactly_the_tokens_of_its_bits() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for case in 0..200 {
        let vocab = 1 + (next() % 200) as usize;
        let n_words = (next() % (vocab as u64 / 32 + 3)) as usize;
        let words: Vec<u32> = (0..n_words)
            .map(|_| match next() % 4 {
                0 => 0,
                1 => u32::MAX,
                _ => next() as u32 & next() as u32,
            })
            .collect();
        let mut logits: Vec<f32> = (0..vocab).map(|t| t as f32).collect();
        let any = apply_mask(&mut logits, &words);
        let allowed = |t: usize| words.get(t / 32).is_some_and(|w| w & (1 << (t % 32)) != 0);
        for (t, &l) in logits.iter().enumerate() {
            let want = if allowed(t) {
                t as f32
            } else {
                f32::NEG_INFINITY
            };
            assert_eq!(
                l, want,
                "case {case}: token {t} of {vocab}, words {words:x?}"
            );
        }
        assert_eq!(any, (0..vocab).any(allowed), "case {case}");
    }
}
