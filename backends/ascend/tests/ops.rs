//! Each wrapped operator, run on the emulated CANN, against a plain Rust reference.

mod common;

use common::*;
use npu_backend_ascend::ops::{Attention, KvWrite, OpRunner};
use npu_backend_ascend::tensor::{DType, Tensor, View};
use npu_backend_ascend::weights;

#[test]
fn rms_norm_add_swiglu_match_reference() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (rows, dim) = (3usize, 64usize);
    let x = h(&rand_vec(1, rows * dim, 2.0));
    let g = h(&rand_vec(2, dim, 1.0));
    let (xb, gb) = (upload_f16(&x), upload_f16(&g));
    let (yb, rb) = (zeros(rows * dim * 2), zeros(rows * 4));
    ops.rms_norm(
        &t(&xb, DType::F16, &[rows as i64, dim as i64]),
        &t(&gb, DType::F16, &[dim as i64]),
        1e-5,
        &t(&yb, DType::F16, &[rows as i64, dim as i64]),
        &t(&rb, DType::F32, &[rows as i64, 1]),
    )
    .unwrap();
    // residual add in place: x += y
    let mut xs = upload_f16(&x);
    ops.inplace_add(
        &t(&xs, DType::F16, &[rows as i64, dim as i64]),
        &t(&yb, DType::F16, &[rows as i64, dim as i64]),
    )
    .unwrap();
    // swiglu over rows of 2*dim/2
    let sw = zeros(rows * dim);
    ops.swiglu(
        &t(&xb, DType::F16, &[rows as i64, dim as i64]),
        -1,
        &t(&sw, DType::F16, &[rows as i64, dim as i64 / 2]),
    )
    .unwrap();
    dev.synchronize().unwrap();
    ops.synchronized();

    let mut want_y = vec![0.0; rows * dim];
    for r in 0..rows {
        let row = &x[r * dim..(r + 1) * dim];
        let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ms + 1e-5).sqrt();
        for i in 0..dim {
            want_y[r * dim + i] = row[i] * inv * g[i];
        }
    }
    let y = read_f16(&yb, rows * dim);
    assert_close(&y, &want_y, 4e-3, "rms_norm");
    let sum = read_f16(&xs, rows * dim);
    let want_sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    assert_close(&sum, &want_sum, 4e-3, "inplace_add");
    let half = dim / 2;
    let mut want_sw = vec![0.0; rows * half];
    for r in 0..rows {
        for i in 0..half {
            let a = x[r * dim + i];
            want_sw[r * half + i] = a / (1.0 + (-a).exp()) * x[r * dim + half + i];
        }
    }
    assert_close(&read_f16(&sw, rows * half), &want_sw, 4e-3, "swiglu");
    let stats = ops.take_stats();
    assert_eq!((stats.prepares, stats.launches), (3, 3));
    xs.fill(0, 0, 2).unwrap();
}

#[test]
fn embedding_argmax_cast_match_reference() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (vocab, dim) = (10usize, 16usize);
    let table = h(&rand_vec(3, vocab * dim, 1.0));
    let tb = upload_f16(&table);
    let ids = [7i32, 0, 9, 7];
    let ib = upload_i32(&ids);
    let out = zeros(ids.len() * dim * 2);
    ops.embedding(
        &t(&tb, DType::F16, &[vocab as i64, dim as i64]),
        &t(&ib, DType::I32, &[4]),
        &t(&out, DType::F16, &[4, dim as i64]),
    )
    .unwrap();
    let am = zeros(4 * 8);
    ops.argmax(
        &t(&out, DType::F16, &[4, dim as i64]),
        -1,
        &t(&am, DType::I64, &[4]),
    )
    .unwrap();
    let f = zeros(4 * dim * 4);
    ops.cast(
        &t(&out, DType::F16, &[4, dim as i64]),
        &t(&f, DType::F32, &[4, dim as i64]),
    )
    .unwrap();
    dev.synchronize().unwrap();
    let got = read_f16(&out, 4 * dim);
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| table[i as usize * dim..(i as usize + 1) * dim].to_vec())
        .collect();
    assert_eq!(got, want);
    let want_am: Vec<i64> = want
        .chunks(dim)
        .map(|r| {
            r.iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
                .0 as i64
        })
        .collect();
    assert_eq!(read_i64(&am, 4), want_am);
    assert_eq!(read_f32(&f, 4 * dim), want);
}

fn reference_matmul(x: &[f32], w_rows: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|kk| x[i * k + kk] * w_rows[j * k + kk]).sum();
        }
    }
    out
}

#[test]
fn matmul_with_transposed_f16_weights_matches_reference() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (m, k, n) = (3usize, 64usize, 40usize);
    let x = h(&rand_vec(4, m * k, 1.0));
    let w = h(&rand_vec(5, n * k, 0.2)); // n rows of k, as GGUF stores them
    let (xb, wb, yb) = (upload_f16(&x), upload_f16(&w), zeros(m * n * 2));
    let wt = Tensor::new(
        acl(),
        &wb,
        View::strided(DType::F16, &[k as i64, n as i64], &[1, k as i64], 0),
    )
    .unwrap();
    ops.matmul(
        &t(&xb, DType::F16, &[m as i64, k as i64]),
        &wt,
        &t(&yb, DType::F16, &[m as i64, n as i64]),
    )
    .unwrap();
    dev.synchronize().unwrap();
    assert_close(
        &read_f16(&yb, m * n),
        &reference_matmul(&x, &w, m, k, n),
        5e-3,
        "matmul",
    );
}

fn run_quant(qw: &weights::QuantWeight, x: &[f32], m: usize) -> Vec<f32> {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (n, k, g) = (qw.n as i64, qw.k as i64, (qw.k / weights::GROUP) as i64);
    let xb = upload_f16(x);
    let wb = upload(&qw.weight);
    let sb = upload(
        &qw.scale
            .iter()
            .flat_map(|s| s.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let ob = qw
        .offset
        .as_ref()
        .map(|o| upload(&o.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>()));
    let yb = zeros(m * qw.n * 2);
    let wdt = if qw.int4 { DType::I4 } else { DType::I8 };
    let wt = Tensor::new(acl(), &wb, View::strided(wdt, &[k, n], &[1, k], 0)).unwrap();
    let st = Tensor::new(acl(), &sb, View::strided(DType::F16, &[g, n], &[1, g], 0)).unwrap();
    let ot = ob
        .as_ref()
        .map(|b| Tensor::new(acl(), b, View::strided(DType::F16, &[g, n], &[1, g], 0)).unwrap());
    ops.weight_quant_matmul(
        &t(&xb, DType::F16, &[m as i64, k]),
        &wt,
        &st,
        ot.as_ref(),
        weights::GROUP as i32,
        &t(&yb, DType::F16, &[m as i64, n]),
    )
    .unwrap();
    dev.synchronize().unwrap();
    read_f16(&yb, m * qw.n)
}

#[test]
fn weight_quant_matmul_matches_q4_1_and_q8_0_dequantized() {
    let (m, k, n) = (2usize, 128usize, 48usize);
    let x = h(&rand_vec(6, m * k, 1.0));
    let (data, deq) = q4_1_rows(7, n, k);
    let got = run_quant(&weights::from_q4_1(&data, n, k).unwrap(), &x, m);
    assert_close(
        &got,
        &reference_matmul(&x, &deq, m, k, n),
        1e-2,
        "Q4_1 matmul",
    );
    let (data, deq) = q8_0_rows(8, n, k);
    let got = run_quant(&weights::from_q8_0(&data, n, k).unwrap(), &x, m);
    assert_close(
        &got,
        &reference_matmul(&x, &deq, m, k, n),
        1e-2,
        "Q8_0 matmul",
    );
}

#[test]
fn rotary_embedding_both_modes_match_reference() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (tokens, heads) = (3usize, 2usize);
    let pos = [0usize, 5, 17];
    for (d, interleave) in [(16, false), (16, true), (128, false)] {
        let x = h(&rand_vec(9, tokens * heads * d, 1.0));
        let mut cos = vec![0.0; tokens * d];
        let mut sin = vec![0.0; tokens * d];
        for (ti, &p) in pos.iter().enumerate() {
            for i in 0..d {
                let pair = if interleave { i / 2 } else { i % (d / 2) };
                let theta = p as f32 / 10000f32.powf(2.0 * pair as f32 / d as f32);
                cos[ti * d + i] = theta.cos();
                sin[ti * d + i] = theta.sin();
            }
        }
        let (cos, sin) = (h(&cos), h(&sin));
        let (xb, cb, sb, ob) = (
            upload_f16(&x),
            upload_f16(&cos),
            upload_f16(&sin),
            zeros(x.len() * 2),
        );
        let dims = [1, tokens as i64, heads as i64, d as i64];
        let cdims = [1, tokens as i64, 1, d as i64];
        ops.rope(
            &t(&xb, DType::F16, &dims),
            &t(&cb, DType::F16, &cdims),
            &t(&sb, DType::F16, &cdims),
            interleave as i64,
            &t(&ob, DType::F16, &dims),
        )
        .unwrap();
        dev.synchronize().unwrap();
        let mut want = vec![0.0; x.len()];
        for ti in 0..tokens {
            for hd in 0..heads {
                let row = &x[(ti * heads + hd) * d..(ti * heads + hd + 1) * d];
                for i in 0..d {
                    let rot = if interleave {
                        if i % 2 == 0 {
                            -row[i + 1]
                        } else {
                            row[i - 1]
                        }
                    } else if i < d / 2 {
                        -row[i + d / 2]
                    } else {
                        row[i - d / 2]
                    };
                    want[(ti * heads + hd) * d + i] =
                        row[i] * cos[ti * d + i] + rot * sin[ti * d + i];
                }
            }
        }
        assert_close(
            &read_f16(&ob, x.len()),
            &want,
            4e-3,
            if interleave {
                "rope interleave"
            } else {
                "rope half"
            },
        );
        if !interleave && d == 128 {
            // ApplyRotaryPosEmb (D = 128 only): the same half rotation on q and k in place.
            let (qb, kb) = (upload_f16(&x), upload_f16(&x[..tokens * d]));
            let kd = [1, tokens as i64, 1, d as i64];
            ops.apply_rope(
                &t(&qb, DType::F16, &dims),
                &t(&kb, DType::F16, &kd),
                &t(&cb, DType::F16, &cdims),
                &t(&sb, DType::F16, &cdims),
            )
            .unwrap();
            dev.synchronize().unwrap();
            assert_close(&read_f16(&qb, x.len()), &want, 4e-3, "apply_rope q");
        }
    }
}

struct Seq {
    q_len: usize,
    kv_len: usize,
    blocks: Vec<i32>,
}

/// Writes every cached position's K/V through write_kv, runs paged attention, compares with a
/// direct softmax(QK^T)V over each sequence's visible positions.
fn paged_attention_case(block_size: usize, seqs: &[Seq], seed: u64) {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (heads, kv_heads, d, num_blocks) = (4usize, 2usize, 16usize, 6usize);
    let kvh = kv_heads * d;
    let total: usize = seqs.iter().map(|s| s.kv_len).sum();
    let k = h(&rand_vec(seed, total * kvh, 1.0));
    let v = h(&rand_vec(seed + 1, total * kvh, 1.0));
    let mut slots = Vec::new();
    for s in seqs {
        for p in 0..s.kv_len {
            slots.push(s.blocks[p / block_size] * block_size as i32 + (p % block_size) as i32);
        }
    }
    let cache_bytes = num_blocks * block_size * kvh * 2;
    let (kc, vc) = (zeros(cache_bytes), zeros(cache_bytes));
    let (kb, vb, sb) = (upload_f16(&k), upload_f16(&v), upload_i32(&slots));
    ops.write_kv(&KvWrite {
        dtype: DType::F16,
        tokens: total,
        kv_heads,
        head_dim: d,
        row_stride: kvh,
        key: &kb,
        key_offset: 0,
        value: &vb,
        value_offset: 0,
        key_cache: &kc,
        value_cache: &vc,
        slots: &sb,
        slots_offset: 0,
        num_blocks,
        block_size,
    })
    .unwrap();
    let b = seqs.len();
    let s_max = seqs.iter().map(|s| s.q_len).max().unwrap();
    let q = h(&rand_vec(seed + 2, b * s_max * heads * d, 1.0));
    let max_blocks = seqs.iter().map(|s| s.blocks.len()).max().unwrap();
    let table: Vec<i32> = seqs
        .iter()
        .flat_map(|s| (0..max_blocks).map(|i| *s.blocks.get(i).unwrap_or(&0)))
        .collect();
    let (qb, ob, tb) = (upload_f16(&q), zeros(q.len() * 2), upload_i32(&table));
    let mask_vals: Vec<u8> = (0..2048 * 2048)
        .map(|i| ((i % 2048) > (i / 2048)) as u8)
        .collect();
    let mb = upload(&mask_vals);
    let mask = t(&mb, DType::I8, &[2048, 2048]);
    let qdims = [b as i64, s_max as i64, (heads * d) as i64];
    let (qt, ot) = (t(&qb, DType::F16, &qdims), t(&ob, DType::F16, &qdims));
    let bt = t(&tb, DType::I32, &[b as i64, max_blocks as i64]);
    let q_lens: Vec<i64> = seqs.iter().map(|s| s.q_len as i64).collect();
    let kv_lens: Vec<i64> = seqs.iter().map(|s| s.kv_len as i64).collect();
    let scale = 1.0 / (d as f64).sqrt();
    ops.attention(&Attention {
        query: &qt,
        out: &ot,
        key_cache: &kc,
        value_cache: &vc,
        cache_view: View::contiguous(
            DType::F16,
            &[num_blocks as i64, block_size as i64, kvh as i64],
        ),
        block_table: &bt,
        // The causal mask is the prompt branch's; the incremental branch takes none here.
        mask: (s_max > 1).then_some(&mask),
        band: None,
        q_lens: &q_lens,
        kv_lens: &kv_lens,
        heads: heads as i64,
        kv_heads: kv_heads as i64,
        block_size: block_size as i64,
        scale,
    })
    .unwrap();
    dev.synchronize().unwrap();
    let got = read_f16(&ob, q.len());
    let mut base = 0;
    for (bi, s) in seqs.iter().enumerate() {
        for i in 0..s.q_len {
            let visible = s.kv_len - s.q_len + i + 1;
            for hd in 0..heads {
                let kh = hd / (heads / kv_heads);
                let qrow = &q[((bi * s_max + i) * heads + hd) * d..][..d];
                let scores: Vec<f32> = (0..visible)
                    .map(|j| {
                        (0..d)
                            .map(|c| qrow[c] * k[(base + j) * kvh + kh * d + c])
                            .sum::<f32>()
                            * scale as f32
                    })
                    .collect();
                let mx = scores.iter().copied().fold(f32::MIN, f32::max);
                let e: Vec<f32> = scores.iter().map(|x| (x - mx).exp()).collect();
                let sum: f32 = e.iter().sum();
                for c in 0..d {
                    let want: f32 = (0..visible)
                        .map(|j| e[j] / sum * v[(base + j) * kvh + kh * d + c])
                        .sum();
                    let g = got[((bi * s_max + i) * heads + hd) * d + c];
                    assert!(
                        (g - want).abs() < 5e-3,
                        "seq {bi} query {i} head {hd} dim {c}: got {g}, want {want}"
                    );
                }
            }
        }
        base += s.kv_len;
    }
}

#[test]
fn paged_attention_decode_matches_reference() {
    // S = 1 (incremental branch): block size 16, sequences spanning several blocks.
    paged_attention_case(
        16,
        &[
            Seq {
                q_len: 1,
                kv_len: 20,
                blocks: vec![3, 1],
            },
            Seq {
                q_len: 1,
                kv_len: 5,
                blocks: vec![0],
            },
        ],
        11,
    );
}

#[test]
fn paged_attention_prefill_chunks_match_reference() {
    // S > 1 (prompt branch, causal right-down): a chunk after cached tokens, and a decode token.
    paged_attention_case(
        128,
        &[
            Seq {
                q_len: 3,
                kv_len: 5,
                blocks: vec![2],
            },
            Seq {
                q_len: 1,
                kv_len: 7,
                blocks: vec![0],
            },
        ],
        21,
    );
}

#[test]
fn repeatable_executor_runs_again_with_new_addresses() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let acl = ops.acl();
    let n = 8i64;
    let (a, b, out1, out2) = (
        upload_f16(&[1.0; 8]),
        upload_f16(&[2.0; 8]),
        zeros(16),
        zeros(16),
    );
    let c = upload_f16(&[5.0; 8]);
    let tensors = vec![
        t(&a, DType::F16, &[n]),
        t(&b, DType::F16, &[n]),
        t(&out1, DType::F16, &[n]),
    ];
    let alpha = npu_backend_ascend::tensor::Scalar::f32(acl, 1.0).unwrap();
    let ops_api = acl.api.ops;
    let mut op = ops
        .prepare_repeatable(
            "aclnnAdd",
            tensors,
            |ts, w, e| unsafe {
                (ops_api.aclnnAddGetWorkspaceSize)(
                    ts[0].raw(),
                    ts[1].raw(),
                    alpha.raw(),
                    ts[2].raw(),
                    w,
                    e,
                )
            },
            ops_api.aclnnAdd,
        )
        .unwrap();
    ops.launch_repeatable(&op).unwrap();
    op.set_input_addr(1, 1, &c).unwrap();
    op.set_output_addr(0, 2, &out2).unwrap();
    ops.launch_repeatable(&op).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(read_f16(&out1, 8), vec![3.0; 8]);
    assert_eq!(read_f16(&out2, 8), vec![6.0; 8]);
    let s = ops.take_stats();
    assert_eq!((s.prepares, s.launches, s.reused_launches), (1, 2, 2));
}

#[test]
fn kv_write_by_scatter_nd_update_matches_scatter_pa_kv_cache() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (kv_heads, d, bs, blocks, tokens) = (2usize, 16usize, 16usize, 3usize, 5usize);
    let row = 3 * kv_heads * d; // fused rows: K, V and something else, K at 0, V at kv_heads*d
    let qkv = h(&rand_vec(31, tokens * row, 1.0));
    let src = upload_f16(&qkv);
    let slots = upload_i32(&[17, 3, 40, 16, 0]);
    let bytes = blocks * bs * kv_heads * d * 2;
    let caches: Vec<_> = (0..4).map(|_| zeros(bytes)).collect();
    let kvh = kv_heads * d;
    // The same K and V rows, dense: ScatterPaKvCache's scatter mode "None" takes them so.
    let (kd, vd) = (
        upload_f16(
            &(0..tokens)
                .flat_map(|r| qkv[r * row..][..kvh].to_vec())
                .collect::<Vec<_>>(),
        ),
        upload_f16(
            &(0..tokens)
                .flat_map(|r| qkv[r * row + kvh..][..kvh].to_vec())
                .collect::<Vec<_>>(),
        ),
    );
    let write = |kc, vc, (key, value, row_stride, value_offset)| KvWrite {
        dtype: DType::F16,
        tokens,
        kv_heads,
        head_dim: d,
        row_stride,
        key,
        key_offset: 0,
        value,
        value_offset,
        key_cache: kc,
        value_cache: vc,
        slots: &slots,
        slots_offset: 0,
        num_blocks: blocks,
        block_size: bs,
    };
    let fused = (&src, &src, row, kvh);
    let e = ops
        .write_kv(&write(&caches[0], &caches[1], fused))
        .unwrap_err();
    assert!(e.to_string().contains("contiguous"), "{e}");
    ops.write_kv(&write(&caches[0], &caches[1], (&kd, &vd, kvh, 0)))
        .unwrap();
    ops.write_kv_rows(&write(&caches[2], &caches[3], fused))
        .unwrap();
    dev.synchronize().unwrap();
    let n = bytes / 2;
    let (k1, v1, k2, v2) = (
        read_f16(&caches[0], n),
        read_f16(&caches[1], n),
        read_f16(&caches[2], n),
        read_f16(&caches[3], n),
    );
    assert_eq!(k1, k2);
    assert_eq!(v1, v2);
    // token 2 went to slot 40: block 2, position 8
    assert_eq!(&k1[40 * kvh..41 * kvh], &qkv[2 * row..2 * row + kvh]);
    assert_eq!(
        &v1[40 * kvh..41 * kvh],
        &qkv[2 * row + kvh..2 * row + 2 * kvh]
    );
}
